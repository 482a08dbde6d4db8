"""Declared layouts: how a global tensor is cut for a parallel config.

A :class:`Layout` is declared per tensor leaf and never inferred from shapes.
It has five parts:

1. :class:`Stage`: pipeline membership, by global layer index or as the
   first, last, first-and-last (tied embeddings) or every stage.
2. :class:`Split`: the tensor-parallel split, or ``None`` for replicated.
   A split may carry ``parts`` (the axis is a concatenation of blocks, each
   split on its own, as SwiGLU's ``[gate; up]``) and a ``granularity`` (a
   boundary must fall on whole units, e.g. one query group of Megatron's
   interleaved QKV).
3. :class:`Padding`: the axis is padded to a multiple that depends on tp.
4. :class:`DPShard`: the leaf is a member of a flat buffer sharded across
   data parallelism (:class:`~tenplex.ptree.buffer.FlatBuffer`), as
   Megatron's distributed optimizer and ZeRO-1 shard; ``None`` means every
   dp (and cp) rank holds a replica.
5. :class:`Expert`: the leaf belongs to one expert of a mixture-of-experts
   layer. It lives on the expert grid: the ep rank that owns the expert holds
   it, its split is over expert tp, its replicas are the expert-dp ranks.

All records are frozen and hashable; ``str`` is short and ``to_json`` /
``from_json`` round-trip.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from math import ceil

from tenplex.errors import ConfigError, LayoutError
from tenplex.ptree.buffer import Bucketing, FlatBuffer

__all__ = ["StageKind", "Stage", "Split", "Padding", "DPShard", "Expert", "FlatBuffer",
           "Bucketing", "Layout"]


class StageKind(enum.Enum):
    """Which pipeline stages hold a tensor."""

    LAYER = "layer"
    """The stage that holds global layer ``Stage.layer`` under the config's assignment."""
    FIRST = "first"
    """Stage 0 only (input embeddings)."""
    LAST = "last"
    """Stage pp-1 only (final norm, untied output layer)."""
    FIRST_AND_LAST = "first_and_last"
    """Stage 0 and stage pp-1: two replicas of one logical tensor when pp > 1 (tied embeddings)."""
    ALL = "all"
    """Every stage holds a replica."""


@dataclass(frozen=True)
class Stage:
    """Pipeline membership of a tensor.

    Attributes:
        kind: see :class:`StageKind`.
        layer: the global layer index for ``StageKind.LAYER``, else ``None``.
    """

    kind: StageKind
    layer: int | None = None

    def __post_init__(self) -> None:
        if (self.kind is StageKind.LAYER) != (self.layer is not None):
            raise LayoutError(f"Stage: kind {self.kind.value} and layer={self.layer!r} do not fit")
        if self.layer is not None and self.layer < 0:
            raise LayoutError(f"Stage: layer must be >= 0, got {self.layer}")

    @classmethod
    def of_layer(cls, layer: int) -> "Stage":
        return cls(StageKind.LAYER, layer)

    def stages(self, pp: int, stage_of_layer) -> tuple[int, ...]:
        """The stage indices holding the tensor, ascending and unique."""
        if self.kind is StageKind.LAYER:
            return (stage_of_layer(self.layer),)
        if self.kind is StageKind.FIRST:
            return (0,)
        if self.kind is StageKind.LAST:
            return (pp - 1,)
        if self.kind is StageKind.FIRST_AND_LAST:
            return (0,) if pp == 1 else (0, pp - 1)
        return tuple(range(pp))

    def __str__(self) -> str:
        return f"layer {self.layer}" if self.kind is StageKind.LAYER else self.kind.value

    def to_json(self):
        return {"layer": self.layer} if self.kind is StageKind.LAYER else self.kind.value

    @classmethod
    def from_json(cls, obj) -> "Stage":
        if isinstance(obj, dict):
            return cls(StageKind.LAYER, int(obj["layer"]))
        return cls(StageKind(obj))


@dataclass(frozen=True)
class Split:
    """A tensor-parallel split along one axis.

    Each part of the axis is cut into ``tp`` equal contiguous chunks; tp rank
    ``t`` holds chunk ``t`` of every part, concatenated in part order. With
    ``parts=None`` the whole axis is one part.

    Attributes:
        axis: the split axis.
        parts: lengths of the concatenated blocks along ``axis`` (elements),
            e.g. ``(ffn, ffn)`` for SwiGLU ``[gate; up]``; they sum to the axis
            length. ``None``: one part.
        granularity: a chunk boundary must fall on a multiple of this many
            elements (e.g. ``(heads/groups + 2) * head_dim`` rows for one query
            group of Megatron's interleaved QKV).
        unit: what one granule is called, for error messages
            (e.g. ``"num_query_groups"``).
    """

    axis: int
    parts: tuple[int, ...] | None = None
    granularity: int = 1
    unit: str | None = None

    def __post_init__(self) -> None:
        if self.axis < 0 or self.granularity < 1:
            raise LayoutError(f"Split: bad axis={self.axis} or granularity={self.granularity}")
        if self.parts is not None:
            object.__setattr__(self, "parts", tuple(int(p) for p in self.parts))
            if not self.parts or any(p < 1 for p in self.parts):
                raise LayoutError(f"Split: parts must be positive lengths, got {self.parts}")

    def part_lengths(self, axis_length: int) -> tuple[int, ...]:
        return self.parts if self.parts is not None else (axis_length,)

    def check(self, axis_length: int, tp: int, where: str, degree: str = "tp") -> None:
        """Check that ``tp`` cuts every part on whole granules.

        Args:
            axis_length: the (padded) length of the split axis, in elements.
            tp: the split degree.
            where: the leaf's path, for messages.
            degree: the degree's name in messages (``"etp"`` for experts).

        Raises:
            ConfigError: naming the leaf, the degree and the unit count it does not divide.
        """
        parts = self.part_lengths(axis_length)
        if sum(parts) != axis_length:
            raise LayoutError(
                f"{where}: split parts {list(parts)} sum to {sum(parts)}, "
                f"expected axis {self.axis} length {axis_length}"
            )
        for length in parts:
            units, rest = divmod(length, self.granularity)
            if rest:
                raise LayoutError(
                    f"{where}: part length {length} is not a multiple of granularity "
                    f"{self.granularity}"
                )
            if units % tp:
                name = self.unit or f"axis {self.axis} length"
                raise ConfigError(f"{degree}={tp} does not divide {name}={units} ({where})")

    def __str__(self) -> str:
        text = f"S({self.axis}"
        if self.parts is not None:
            text += f", parts={list(self.parts)}"
        if self.granularity != 1:
            text += f", g={self.granularity}"
        return text + ")"

    def to_json(self) -> dict:
        obj: dict = {"axis": self.axis}
        if self.parts is not None:
            obj["parts"] = list(self.parts)
        if self.granularity != 1:
            obj["granularity"] = self.granularity
        if self.unit:
            obj["unit"] = self.unit
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "Split":
        parts = obj.get("parts")
        return cls(
            int(obj["axis"]),
            tuple(parts) if parts is not None else None,
            int(obj.get("granularity", 1)),
            obj.get("unit"),
        )


@dataclass(frozen=True)
class Padding:
    """Padding of one axis to a multiple that depends on tp.

    The padded length is ``ceil(n / m) * m`` with ``m = multiple * tp`` when
    ``scale_with_tp`` (Megatron pads the vocabulary to a multiple of
    ``make_vocab_size_divisible_by * tp``), else ``m = multiple``.

    The rule for padding rows is explicit: when resharding, a padding row
    that exists on both sides is copied (training may have written it, and
    the logits over the padded vocabulary depend on it), a padding row that
    only the target has is created zero-filled, and a padding row that only
    the source has is dropped. Plans report the rows created and dropped.

    Attributes:
        axis: the padded axis.
        multiple: the base multiple, in elements (>= 1).
        scale_with_tp: whether the multiple is scaled by tp.
    """

    axis: int
    multiple: int
    scale_with_tp: bool = True

    def __post_init__(self) -> None:
        if self.axis < 0 or self.multiple < 1:
            raise LayoutError(f"Padding: bad axis={self.axis} or multiple={self.multiple}")

    def padded(self, length: int, tp: int) -> int:
        """The padded length of an axis of logical ``length`` under ``tp``."""
        m = self.multiple * tp if self.scale_with_tp else self.multiple
        return ceil(length / m) * m

    def __str__(self) -> str:
        return f"pad({self.axis}, {self.multiple}{'*tp' if self.scale_with_tp else ''})"

    def to_json(self) -> dict:
        return {"axis": self.axis, "multiple": self.multiple, "scale_with_tp": self.scale_with_tp}

    @classmethod
    def from_json(cls, obj: dict) -> "Padding":
        return cls(int(obj["axis"]), int(obj["multiple"]), bool(obj.get("scale_with_tp", True)))


@dataclass(frozen=True)
class DPShard:
    """Membership in a dp-sharded flat buffer.

    Attributes:
        buffer: the :class:`FlatBuffer`'s name.
        key: this leaf's member key in the buffer. Several leaves may share
            a key (Adam's ``exp_avg`` and ``exp_avg_sq`` of one parameter):
            they are sharded identically.
    """

    buffer: str
    key: str

    def __str__(self) -> str:
        return f"dp-shard({self.buffer})"

    def to_json(self) -> dict:
        return {"buffer": self.buffer, "key": self.key}

    @classmethod
    def from_json(cls, obj: dict) -> "DPShard":
        return cls(obj["buffer"], obj["key"])


@dataclass(frozen=True)
class Expert:
    """Membership in one expert of a mixture-of-experts layer.

    With ``ep`` expert-parallel ranks, ep rank ``e`` holds the contiguous
    block of experts ``[e * count / ep, (e + 1) * count / ep)``; local index
    ``i`` on ep rank ``e`` is global expert ``e * count / ep + i``
    (megatron-core 0.16 ``MoELayer.local_expert_indices``).

    Attributes:
        index: the global expert id, ``0 <= index < count``.
        count: experts in the layer (megatron's ``num_moe_experts``).
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise LayoutError(f"Expert: index {self.index} is outside [0, count={self.count})")

    def check(self, ep: int, where: str) -> None:
        """Raise ConfigError ``"ep=3 does not divide num_moe_experts=8 (...)"`` if ep does not fit."""
        if self.count % ep:
            raise ConfigError(f"ep={ep} does not divide num_moe_experts={self.count} ({where})")

    def owner(self, ep: int) -> int:
        """The ep rank that holds this expert."""
        return self.index // (self.count // ep)

    def local_index(self, ep: int) -> int:
        """This expert's index among its ep rank's local experts."""
        return self.index % (self.count // ep)

    def __str__(self) -> str:
        return f"expert {self.index}/{self.count}"

    def to_json(self) -> dict:
        return {"index": self.index, "count": self.count}

    @classmethod
    def from_json(cls, obj: dict) -> "Expert":
        return cls(int(obj["index"]), int(obj["count"]))


@dataclass(frozen=True)
class Layout:
    """How a tensor leaf is cut for a parallel config.

    Attributes:
        stage: pipeline membership.
        split: tensor-parallel split, or ``None`` for replicated across tp.
        padding: axis padding, or ``None``.
        dp_shard: dp-sharded buffer membership, or ``None`` for dp replicas.
        expert: expert membership, or ``None`` for a dense tensor. An expert
            tensor's split and padding follow etp instead of tp.
    """

    stage: Stage = Stage(StageKind.ALL)
    split: Split | None = None
    padding: Padding | None = None
    dp_shard: DPShard | None = None
    expert: Expert | None = None

    def check_rank(self, ndim: int, where: str) -> None:
        """Raise LayoutError if an axis is out of range for an ``ndim`` tensor."""
        for name, part in (("split", self.split), ("padding", self.padding)):
            if part is not None and part.axis >= ndim:
                raise LayoutError(f"{where}: {name} axis {part.axis} is out of range for {ndim}-d")
        if self.padding and self.split and self.split.parts and self.padding.axis == self.split.axis:
            raise LayoutError(f"{where}: a padded axis cannot also have split parts")

    def __str__(self) -> str:
        items = [str(self.stage), str(self.split) if self.split else "R"]
        if self.padding:
            items.append(str(self.padding))
        if self.dp_shard:
            items.append(str(self.dp_shard))
        if self.expert:
            items.append(str(self.expert))
        return " ".join(items)

    def to_json(self) -> dict:
        obj: dict = {"stage": self.stage.to_json()}
        if self.split:
            obj["split"] = self.split.to_json()
        if self.padding:
            obj["padding"] = self.padding.to_json()
        if self.dp_shard:
            obj["dp_shard"] = self.dp_shard.to_json()
        if self.expert:
            obj["expert"] = self.expert.to_json()
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "Layout":
        return cls(
            Stage.from_json(obj["stage"]),
            Split.from_json(obj["split"]) if "split" in obj else None,
            Padding.from_json(obj["padding"]) if "padding" in obj else None,
            DPShard.from_json(obj["dp_shard"]) if "dp_shard" in obj else None,
            Expert.from_json(obj["expert"]) if "expert" in obj else None,
        )

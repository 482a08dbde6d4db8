"""Declared layouts: how a global tensor is cut for a parallel config.

A :class:`Layout` is declared per tensor leaf and never inferred from shapes.
It has four parts:

1. :class:`Stage`: pipeline membership, by global layer index or as the
   first, last, first-and-last (tied embeddings) or every stage.
2. :class:`Split`: the tensor-parallel split, or ``None`` for replicated.
   A split may carry ``parts`` (the axis is a concatenation of blocks, each
   split on its own, as SwiGLU's ``[gate; up]``) and a ``granularity`` (a
   boundary must fall on whole units, e.g. one query group of Megatron's
   interleaved QKV).
3. :class:`Padding`: the axis is padded to a multiple that depends on tp.
4. :class:`DPShard`: the leaf is a member of a flat buffer sharded across
   dp, as Megatron's distributed optimizer and ZeRO-1 shard; ``None`` means
   every dp rank holds a replica.

All records are frozen and hashable; ``str`` is short and ``to_json`` /
``from_json`` round-trip.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from math import ceil

from tenplex.errors import LayoutError

__all__ = ["StageKind", "Stage", "Split", "Padding", "DPShard", "FlatBuffer", "Layout"]


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

    def check(self, axis_length: int, tp: int, where: str) -> None:
        """Check that ``tp`` cuts every part on whole granules.

        Raises:
            ConfigError: naming the leaf, tp and the unit count it does not divide.
        """
        from tenplex.errors import ConfigError

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
                raise ConfigError(f"tp={tp} does not divide {name}={units} ({where})")

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
class FlatBuffer:
    """A flat buffer sharded across dp, as Megatron's distributed optimizer does.

    For one (tp, pp) coordinate, the buffer holds the tp-local shards of the
    ``members`` that live on that stage, flattened, in ``members`` order.
    Each member starts on a multiple of ``align`` elements. Members are cut
    into buckets: a bucket is closed once it holds at least ``bucket_numel``
    elements (``None``: one bucket). Each bucket's length is padded to a
    multiple of ``lcm(dp, pad_multiple)`` and cut into ``dp`` equal contiguous
    ranges; dp rank ``d`` holds range ``d`` of every bucket. Ranges may cross
    member boundaries. (Megatron-core 0.16: ``param_and_grad_buffer.py``
    aligns each param to 64 elements and pads each bucket to a multiple of
    ``lcm(dp, 128)`` when the distributed optimizer is on.)

    Attributes:
        name: the buffer's name, referenced by :class:`DPShard`.
        members: member keys in buffer order (usually parameter paths).
        align: element alignment of each member's start.
        pad_multiple: bucket lengths are padded to ``lcm(dp, pad_multiple)``.
        bucket_numel: bucket size threshold in elements, or ``None``.
    """

    name: str
    members: tuple[str, ...]
    align: int = 1
    pad_multiple: int = 1
    bucket_numel: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        if len(set(self.members)) != len(self.members):
            raise LayoutError(f"FlatBuffer {self.name!r}: members repeat")
        if self.align < 1 or self.pad_multiple < 1:
            raise LayoutError(f"FlatBuffer {self.name!r}: align and pad_multiple must be >= 1")

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "members": list(self.members),
            "align": self.align,
            "pad_multiple": self.pad_multiple,
            "bucket_numel": self.bucket_numel,
        }

    @classmethod
    def from_json(cls, obj: dict) -> "FlatBuffer":
        return cls(
            obj["name"],
            tuple(obj["members"]),
            int(obj.get("align", 1)),
            int(obj.get("pad_multiple", 1)),
            obj.get("bucket_numel"),
        )


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
class Layout:
    """How a tensor leaf is cut for a parallel config.

    Attributes:
        stage: pipeline membership.
        split: tensor-parallel split, or ``None`` for replicated across tp.
        padding: axis padding, or ``None``.
        dp_shard: dp-sharded buffer membership, or ``None`` for dp replicas.
    """

    stage: Stage = Stage(StageKind.ALL)
    split: Split | None = None
    padding: Padding | None = None
    dp_shard: DPShard | None = None

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
        return " ".join(items)

    def to_json(self) -> dict:
        obj: dict = {"stage": self.stage.to_json()}
        if self.split:
            obj["split"] = self.split.to_json()
        if self.padding:
            obj["padding"] = self.padding.to_json()
        if self.dp_shard:
            obj["dp_shard"] = self.dp_shard.to_json()
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "Layout":
        return cls(
            Stage.from_json(obj["stage"]),
            Split.from_json(obj["split"]) if "split" in obj else None,
            Padding.from_json(obj["padding"]) if "padding" in obj else None,
            DPShard.from_json(obj["dp_shard"]) if "dp_shard" in obj else None,
        )

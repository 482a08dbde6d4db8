"""The parallelizable tensor tree (PTree): paths to leaves.

A :class:`PTree` is the *spec* of a training job's state: a mapping from
paths such as ``model/layers/7/mlp/fc1/weight``, ``optimizer/exp_avg/...``,
``data/consumed_samples`` or ``rng/...`` to leaves. It holds no data; the
data lives in per-rank shards (see :mod:`tenplex.ptree.shards`).

- :class:`TensorLeaf`: global (logical) shape, dtype and :class:`Layout`.
  Layer indices in paths and layouts are global, never stage-local.
- :class:`ValueLeaf`: a JSON-able scalar or small structure, with a scope:
  one global value, one value per rank, or one value per coordinate along
  some axes (e.g. an RNG state per ``(tp, pp)``).

Paths are ``/``-separated segments of ``[A-Za-z0-9_.-]``; a segment may not
be empty, ``.`` or ``..``, so a path can never escape a store root.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Union

import torch

from tenplex.errors import ConfigError, LayoutError, PathError
from tenplex.ptree.config import COORD_AXES, ParallelConfig
from tenplex.ptree.layout import FlatBuffer, Layout, StageKind

__all__ = [
    "DTYPES",
    "Scope",
    "TensorLeaf",
    "ValueLeaf",
    "Leaf",
    "PTree",
    "check_path",
    "torch_dtype",
]

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Dtype names tenplex stores (safetensors' names lower-cased) and their torch dtypes."""

_SEGMENT = re.compile(r"[A-Za-z0-9_.\-]+")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a dtype name such as ``"bfloat16"``.

    Raises:
        LayoutError: for an unknown name.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise LayoutError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def check_path(path: str) -> str:
    """Return ``path`` if it is a valid leaf path or storage key.

    Raises:
        PathError: if it is empty, absolute, has an empty, ``.`` or ``..``
            segment, or a character outside ``[A-Za-z0-9_.-/]``.
    """
    if not isinstance(path, str) or not path:
        raise PathError(f"path {path!r}: expected a non-empty string")
    if path.startswith("/") or "\\" in path or ":" in path:
        raise PathError(f"path {path!r}: expected a relative '/'-separated path")
    for segment in path.split("/"):
        if segment in ("", ".", ".."):
            raise PathError(f"path {path!r}: segment {segment!r} is not allowed")
        if not _SEGMENT.fullmatch(segment):
            raise PathError(f"path {path!r}: segment {segment!r} has characters outside [A-Za-z0-9_.-]")
    return path


class Scope(enum.Enum):
    """The scope of a value leaf."""

    GLOBAL = "global"
    """One value for the whole job (step counter, consumed samples)."""
    RANK = "rank"
    """One value per rank number."""
    COORD = "coord"
    """One value per coordinate along ``ValueLeaf.axes`` (e.g. an RNG state per tp rank)."""


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor leaf: global logical shape, dtype and layout.

    Attributes:
        shape: the global logical shape, in elements (padding excluded).
        dtype: a name from :data:`DTYPES`, e.g. ``"bfloat16"``.
        layout: how the tensor is cut for a config.
    """

    shape: tuple[int, ...]
    dtype: str
    layout: Layout = field(default_factory=Layout)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        torch_dtype(self.dtype)
        if any(n < 0 for n in self.shape):
            raise LayoutError(f"TensorLeaf: negative size in shape {self.shape}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch_dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        return {"kind": "tensor", "shape": list(self.shape), "dtype": self.dtype,
                "layout": self.layout.to_json()}


@dataclass(frozen=True)
class ValueLeaf:
    """A value leaf: JSON-able data with a scope.

    Attributes:
        scope: see :class:`Scope`.
        axes: for ``Scope.COORD``, the axes the value varies along: distinct
            :class:`~tenplex.ptree.config.Coord` fields, e.g. ``("tp", "pp")``
            or ``("ep", "etp", "pp")``.
    """

    scope: Scope = Scope.GLOBAL
    axes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(self.axes))
        if (self.scope is Scope.COORD) != bool(self.axes) or not set(self.axes) <= set(COORD_AXES) \
                or len(set(self.axes)) != len(self.axes):
            raise LayoutError(f"ValueLeaf: scope {self.scope.value} with axes {self.axes} do not fit")

    def key(self, config: ParallelConfig, rank: int) -> str:
        """The key of ``rank``'s value: ``""``, ``"rank=3"`` or ``"tp=1,pp=0"``."""
        if self.scope is Scope.GLOBAL:
            return ""
        if self.scope is Scope.RANK:
            return f"rank={rank}"
        coord = config.coord(rank)._asdict()
        return ",".join(f"{a}={coord[a]}" for a in self.axes)

    def to_json(self) -> dict:
        obj: dict = {"kind": "value", "scope": self.scope.value}
        if self.axes:
            obj["axes"] = list(self.axes)
        return obj


Leaf = Union[TensorLeaf, ValueLeaf]


@dataclass(frozen=True)
class PTree:
    """The spec of a job's state: paths to leaves, plus pipeline and buffer facts.

    Attributes:
        leaves: ``{path: leaf}``; iteration follows insertion order, which is
            the tree's stable leaf order (plans and stores use it).
        num_layers: transformer layers the pipeline assigns to stages.
        buffers: dp-sharded flat buffers referenced by ``DPShard`` layouts.

    Raises:
        PathError: for a bad path.
        LayoutError: for a layout that does not fit its leaf, or a DPShard
            that names an unknown buffer or key.
    """

    leaves: Mapping[str, Leaf]
    num_layers: int = 1
    buffers: tuple[FlatBuffer, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "leaves", dict(self.leaves))
        object.__setattr__(self, "buffers", tuple(self.buffers))
        names = {b.name: b for b in self.buffers}
        if len(names) != len(self.buffers):
            raise LayoutError("PTree: two buffers share a name")
        for path, leaf in self.leaves.items():
            check_path(path)
            if isinstance(leaf, TensorLeaf):
                self._check_tensor(path, leaf, names)

    def _check_tensor(self, path: str, leaf: TensorLeaf, buffers: dict) -> None:
        layout = leaf.layout
        layout.check_rank(len(leaf.shape), path)
        if layout.stage.kind is StageKind.LAYER and layout.stage.layer >= self.num_layers:
            raise LayoutError(f"{path}: layer {layout.stage.layer} >= num_layers={self.num_layers}")
        if layout.dp_shard is not None:
            buf = buffers.get(layout.dp_shard.buffer)
            if buf is None or layout.dp_shard.key not in buf.members:
                raise LayoutError(f"{path}: {layout.dp_shard} names an unknown buffer or key "
                                  f"{layout.dp_shard.key!r}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)

    def __getitem__(self, path: str) -> Leaf:
        return self.leaves[path]

    def tensors(self) -> Iterator[tuple[str, TensorLeaf]]:
        """``(path, leaf)`` for every tensor leaf, in tree order."""
        return ((p, l) for p, l in self.leaves.items() if isinstance(l, TensorLeaf))

    def values(self) -> Iterator[tuple[str, ValueLeaf]]:
        """``(path, leaf)`` for every value leaf, in tree order."""
        return ((p, l) for p, l in self.leaves.items() if isinstance(l, ValueLeaf))

    def buffer(self, name: str) -> FlatBuffer:
        for buf in self.buffers:
            if buf.name == name:
                return buf
        raise LayoutError(f"PTree: no buffer named {name!r}")

    def validate(self, config: ParallelConfig) -> None:
        """Check that ``config`` can hold this tree.

        Raises:
            ConfigError: naming the violated constraint, e.g.
                ``"tp=3 does not divide num_query_groups=8 (model/layers/0/...)"``,
                ``"pp=3 does not divide num_layers=8"``,
                ``"vpp=2 does not divide the 3 layers of stage 0 (...)"``,
                ``"ep=3 does not divide num_moe_experts=8 (...)"``, or an etp
                that the experts' distributed-optimizer state cannot follow
                when ep = 1.
        """
        config.check_layers(self.num_layers)
        for path, leaf in self.tensors():
            layout = leaf.layout
            degree, name = config.tp, "tp"
            if layout.expert is not None:
                layout.expert.check(config.ep, path)
                degree, name = config.etp, "etp"
                if layout.dp_shard is not None and config.ep == 1 \
                        and not config.etp_follows_dp_cp_groups:
                    raise ConfigError(
                        f"{config}: with ep=1 the experts' distributed-optimizer state is sharded "
                        f"over dp-cp groups (megatron-core keeps it in the dense buffer), whose "
                        f"ranks hold different etp={config.etp} shards; use etp=1 or etp=tp ({path})")
            if layout.split is None:
                continue
            length = leaf.shape[layout.split.axis]
            if layout.padding is not None and layout.padding.axis == layout.split.axis:
                length = layout.padding.padded(length, degree)
            layout.split.check(length, degree, path, name)

    def to_json(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "buffers": [b.to_json() for b in self.buffers],
            "leaves": {p: l.to_json() for p, l in self.leaves.items()},
        }

    @classmethod
    def from_json(cls, obj: dict) -> "PTree":
        """Rebuild a tree from :meth:`to_json` output.

        Raises:
            LayoutError: on an unknown leaf kind or a missing field.
        """
        try:
            leaves: dict[str, Leaf] = {}
            for path, item in obj["leaves"].items():
                if item["kind"] == "tensor":
                    leaves[path] = TensorLeaf(tuple(item["shape"]), item["dtype"],
                                              Layout.from_json(item["layout"]))
                elif item["kind"] == "value":
                    leaves[path] = ValueLeaf(Scope(item["scope"]), tuple(item.get("axes", ())))
                else:
                    raise LayoutError(f"{path}: unknown leaf kind {item['kind']!r}")
            return cls(leaves, int(obj.get("num_layers", 1)),
                       tuple(FlatBuffer.from_json(b) for b in obj.get("buffers", [])))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, (LayoutError, PathError, ConfigError)):
                raise
            raise LayoutError(f"PTree: malformed tree JSON: {exc!r}") from exc

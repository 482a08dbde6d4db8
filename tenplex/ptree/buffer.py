"""Flat buffers sharded across data parallelism, as Megatron's distributed optimizer shards them.

A :class:`FlatBuffer` is declared once per tree. For a config it is
instantiated once per *(tp rank, pipeline stage, virtual chunk, part)*:

- **virtual chunk**: with ``vpp > 1`` megatron builds one DDP wrapper, hence
  one set of buffers, per model chunk; a buffer holds the members of its own
  chunk only.
- **part**: megatron-core's DDP (``distributed_data_parallel.py``) puts
  parameters with ``allreduce=False`` in separate buffers over the expert
  data-parallel group. ``tensor_parallel/layers.py`` sets that attribute on
  expert parameters only when ``expert_model_parallel_size > 1``. So with
  ``ep > 1`` the members whose leaves carry an
  :class:`~tenplex.ptree.layout.Expert` layout form an **expert part**
  sharded over ``edp`` (one per ep rank, holding that rank's experts); every
  other member, and every member when ``ep = 1``, is in the **dense part**
  sharded over megatron's dp-cp group (``dp * cp`` ranks).

:func:`layout_buffer` is megatron-core 0.16's
``_ParamAndGradBuffer.__init__`` rule (``distributed/param_and_grad_buffer.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from math import lcm
from typing import Sequence

from tenplex.errors import LayoutError

__all__ = ["Bucketing", "FlatBuffer", "Bucket", "BufferLayout", "layout_buffer"]


class Bucketing(enum.Enum):
    """Which of a buffer's instances are cut into buckets of ``bucket_numel`` elements."""

    ALL = "all"
    """Every (stage, chunk) instance."""
    FIRST_STAGE = "first_stage"
    """Pipeline stage 0 only: megatron-core's DDP sets ``bucket_size = None`` on pp ranks > 0."""
    FIRST_CHUNK = "first_chunk"
    """Stage 0, chunk 0 only: as FIRST_STAGE, plus Megatron-LM's ``get_model`` passes
    ``disable_bucketing=(model_chunk_idx > 0)`` to each chunk's DDP."""


@dataclass(frozen=True)
class FlatBuffer:
    """A flat buffer sharded across data parallelism (see the module docstring for its instances).

    An instance holds the tp-local (etp-local for experts) shards of the
    ``members`` it contains, flattened, in ``members`` order. Each member
    starts on a multiple of ``align`` elements. Members are cut into
    buckets: a bucket is closed once it holds at least ``bucket_numel``
    elements (``None``: one bucket), and a member of ``own_bucket`` whose
    leaf lives on more than one pipeline stage gets a bucket of its own.
    Each bucket's length is padded to a multiple of ``lcm(n, pad_multiple)``
    and cut into ``n`` equal contiguous ranges, ``n`` being the part's group
    size; the rank with index ``d`` in that group holds range ``d`` of every
    bucket. Ranges may cross member boundaries. (Megatron-core 0.16 aligns
    each param to 64 elements, pads each bucket to a multiple of
    ``lcm(n, 128)``, and gives the shared embedding (tied, pp > 1) a bucket
    of its own, ``_does_param_require_new_bucket``, when the distributed
    optimizer is on.)

    Attributes:
        name: the buffer's name, referenced by :class:`~tenplex.ptree.layout.DPShard`.
        members: member keys in buffer order (megatron: reverse
            ``named_parameters()`` order).
        align: element alignment of each member's start.
        pad_multiple: bucket lengths are padded to ``lcm(n, pad_multiple)``.
        bucket_numel: bucket size threshold in elements, or ``None``.
        own_bucket: members that get a bucket of their own where their leaf
            lives on more than one pipeline stage.
        bucketing: which instances ``bucket_numel`` applies to.

    Raises:
        LayoutError: on repeated members, an ``own_bucket`` key that is not a
            member, or a bad alignment, multiple or bucket size.
    """

    name: str
    members: tuple[str, ...]
    align: int = 1
    pad_multiple: int = 1
    bucket_numel: int | None = None
    own_bucket: tuple[str, ...] = ()
    bucketing: Bucketing = Bucketing.ALL

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "own_bucket", tuple(self.own_bucket))
        object.__setattr__(self, "bucketing", Bucketing(self.bucketing))
        if len(set(self.members)) != len(self.members):
            raise LayoutError(f"FlatBuffer {self.name!r}: members repeat")
        if not set(self.own_bucket) <= set(self.members):
            raise LayoutError(f"FlatBuffer {self.name!r}: own_bucket keys "
                              f"{sorted(set(self.own_bucket) - set(self.members))} are not members")
        for field in ("align", "pad_multiple"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"FlatBuffer {self.name!r}: {field} must be an integer >= 1, "
                                  f"got {value!r}")
        if self.bucket_numel is not None and (not isinstance(self.bucket_numel, int)
                                              or self.bucket_numel < 1):
            raise LayoutError(f"FlatBuffer {self.name!r}: bucket_numel must be None or an "
                              f"integer >= 1, got {self.bucket_numel!r}")

    def bucket_size(self, stage: int, chunk: int) -> int | None:
        """The bucket threshold of the (``stage``, ``chunk``) instance, or ``None``."""
        if self.bucketing is Bucketing.FIRST_STAGE and stage > 0:
            return None
        if self.bucketing is Bucketing.FIRST_CHUNK and (stage > 0 or chunk > 0):
            return None
        return self.bucket_numel

    def to_json(self) -> dict:
        obj = {"name": self.name, "members": list(self.members), "align": self.align,
               "pad_multiple": self.pad_multiple, "bucket_numel": self.bucket_numel}
        if self.own_bucket:
            obj["own_bucket"] = list(self.own_bucket)
        if self.bucketing is not Bucketing.ALL:
            obj["bucketing"] = self.bucketing.value
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "FlatBuffer":
        try:
            return cls(obj["name"], tuple(obj["members"]), int(obj.get("align", 1)),
                       int(obj.get("pad_multiple", 1)), obj.get("bucket_numel"),
                       tuple(obj.get("own_bucket", ())), Bucketing(obj.get("bucketing", "all")))
        except (KeyError, TypeError, ValueError) as exc:
            raise LayoutError(f"FlatBuffer: malformed buffer JSON: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket of a buffer instance, in elements.

    Attributes:
        start: offset of its first element in the instance.
        numel: its length before end padding (megatron's ``numel_unpadded``;
            includes alignment gaps between members).
        padded: its length padded to ``lcm(n, pad_multiple)``.
    """

    start: int
    numel: int
    padded: int


@dataclass(frozen=True)
class BufferLayout:
    """Where every member of one buffer instance sits.

    Attributes:
        members: ``{key: (start, numel, bucket index)}``, in elements.
        buckets: the buckets, in order.
        group_size: ``n``, the ranks each bucket is cut over.
    """

    members: dict
    buckets: tuple[Bucket, ...]
    group_size: int

    def shard(self, key: str, d: int) -> tuple[int, int] | None:
        """The range ``[lo, hi)`` of member ``key`` (member-relative) that group index ``d`` holds."""
        start, numel, b = self.members[key]
        bucket = self.buckets[b]
        per = bucket.padded // self.group_size
        lo = max(start, bucket.start + d * per)
        hi = min(start + numel, bucket.start + (d + 1) * per)
        return (lo - start, hi - start) if hi > lo else None

    def holders(self, key: str) -> range:
        """The group indices whose ranges may overlap member ``key``."""
        start, numel, b = self.members[key]
        bucket = self.buckets[b]
        per = bucket.padded // self.group_size
        if per == 0:
            return range(0)
        first = (start - bucket.start) // per
        last = (start + max(numel, 1) - 1 - bucket.start) // per
        return range(first, min(last, self.group_size - 1) + 1)


def layout_buffer(entries: Sequence[tuple[str, int, bool]], group_size: int, align: int,
                  pad_multiple: int, bucket_size: int | None) -> BufferLayout:
    """Lay out one buffer instance, as megatron-core 0.16's ``_ParamAndGradBuffer`` does.

    Args:
        entries: ``(key, numel, own bucket)`` per member present, in buffer order.
        group_size: ranks the buffer is sharded over (dp-cp or expert-dp group size).
        align: each member starts on a multiple of ``align`` elements.
        pad_multiple: each bucket is padded to a multiple of ``lcm(group_size, pad_multiple)``.
        bucket_size: close a bucket once it holds at least this many elements, or ``None``.

    Returns:
        The layout; no buckets when ``entries`` is empty.
    """
    pad = lcm(group_size, pad_multiple)
    members: dict = {}
    buckets: list[Bucket] = []
    bucket_start = start = end = 0
    open_bucket = False

    def close(at: int) -> int:
        nonlocal bucket_start, open_bucket
        padded_end = -(-at // pad) * pad
        buckets.append(Bucket(bucket_start, at - bucket_start, padded_end - bucket_start))
        bucket_start, open_bucket = padded_end, False
        return padded_end

    for key, numel, own in entries:
        start = -(-start // align) * align
        if own and open_bucket:
            start = close(start)
        members[key] = (start, numel, len(buckets))
        end = start + numel
        open_bucket = True
        if own or (bucket_size is not None and end - bucket_start >= bucket_size):
            start = close(end)
        else:
            start = end
    if open_bucket:
        close(end)
    return BufferLayout(members, tuple(buckets), group_size)

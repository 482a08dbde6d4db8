"""The Plan: frozen records of what must move, with a stable order and JSON form.

A plan is plain data. The planner (:mod:`tenplex.transform.planner`) makes
it and executors only consume it; neither side does the other's job.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from dataclasses import dataclass, field

from tenplex.errors import PlanError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.region import Box
from tenplex.transform.placement import Placement

__all__ = ["OpKind", "Link", "CopyOp", "ValueOp", "PaddingChange", "Totals", "Plan", "FORMAT"]

FORMAT = "tenplex.plan/1"


class OpKind(enum.Enum):
    """How a copy reshapes data (the Tenplex paper's transformation terms)."""

    KEEP = "keep"
    """The region is a whole source piece and a whole target piece."""
    SPLIT = "split"
    """A whole target piece cut out of a larger source piece."""
    MERGE = "merge"
    """A whole source piece that becomes part of a larger target piece."""
    REPARTITION = "repartition"
    """Part of a source piece into part of a target piece."""
    FILL = "fill"
    """Padding elements that only the target has; zero-filled, read from nowhere."""


class Link(enum.Enum):
    """Which link an op's bytes cross."""

    LOCAL = "local"
    """Source and target are on the same device: nothing moves."""
    HOST = "host"
    """Different devices of one host."""
    NETWORK = "network"
    """Different hosts."""
    STORE = "store"
    """Read from a store (no live rank holds the region)."""


STORE_RANK = -1
"""``CopyOp.src_rank`` of FILL ops and of reads from a store."""


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy one global box from a source rank's shard into a target rank's shard.

    Attributes:
        path: the leaf.
        dst_rank: the target rank.
        src_rank: the source rank, or ``STORE_RANK`` (-1) for FILL and store reads.
        region: the global box copied, in elements of the padded global tensor.
        src_piece: index into the source rank's ``Holding.pieces`` (-1 for FILL).
        dst_piece: index into the target rank's ``Holding.pieces``.
        nbytes: bytes in ``region``.
        kind: see :class:`OpKind`.
        link: see :class:`Link`.
    """

    path: str
    dst_rank: int
    src_rank: int
    region: Box
    src_piece: int
    dst_piece: int
    nbytes: int
    kind: OpKind
    link: Link


@dataclass(frozen=True, slots=True)
class ValueOp:
    """Give a target rank a value leaf's value from a source rank (-1: none exists)."""

    path: str
    dst_rank: int
    src_rank: int


@dataclass(frozen=True, slots=True)
class PaddingChange:
    """A padded axis whose padded length changes: rows created or dropped."""

    path: str
    axis: int
    logical: int
    src_padded: int
    dst_padded: int

    @property
    def created(self) -> int:
        return max(0, self.dst_padded - self.src_padded)

    @property
    def dropped(self) -> int:
        return max(0, self.src_padded - self.dst_padded)


@dataclass(frozen=True)
class Totals:
    """Byte counts of a plan.

    Attributes:
        needed: bytes every target rank receives, summed (FILL excluded).
        local: bytes already on the target's device.
        host: bytes moved between devices of one host.
        network: bytes moved between hosts.
        store: bytes read from a store.
        fill: bytes of zero-filled padding.
        lower_bound: bytes that must move: bytes a target needs that no live
            source on its own device holds.
        lower_bound_network: bytes that must cross hosts: bytes a target
            needs that no live source on its own host holds.
        max_sender: bytes the busiest source rank sends to other devices.
    """

    needed: int = 0
    local: int = 0
    host: int = 0
    network: int = 0
    store: int = 0
    fill: int = 0
    lower_bound: int = 0
    lower_bound_network: int = 0
    max_sender: int = 0

    @property
    def moved(self) -> int:
        """Bytes that leave their device: host + network + store."""
        return self.host + self.network + self.store


@dataclass(frozen=True)
class Plan:
    """What every target rank must receive, from where.

    Attributes:
        src: the source config.
        dst: the target config.
        src_placement, dst_placement: rank -> device on each side.
        alive: the source ranks that could serve as sources.
        ops: copy ops ordered by target rank, then tree leaf order, then
            target piece and region.
        values: value-leaf ops, ordered the same way.
        padding: padded axes whose padded length changes.
        totals: byte counts.
    """

    src: ParallelConfig
    dst: ParallelConfig
    src_placement: Placement
    dst_placement: Placement
    alive: tuple[int, ...]
    ops: tuple[CopyOp, ...]
    values: tuple[ValueOp, ...] = ()
    padding: tuple[PaddingChange, ...] = ()
    totals: Totals = field(default_factory=Totals)

    def ops_for(self, dst_rank: int) -> list[CopyOp]:
        return [op for op in self.ops if op.dst_rank == dst_rank]

    def kinds(self) -> dict[str, int]:
        """Bytes per op kind."""
        out: Counter = Counter()
        for op in self.ops:
            out[op.kind.value] += op.nbytes
        return dict(out)

    def matrix(self) -> dict[tuple[int, int], int]:
        """``{(src_rank, dst_rank): bytes}`` over all ops but FILL."""
        out: Counter = Counter()
        for op in self.ops:
            if op.kind is not OpKind.FILL:
                out[(op.src_rank, op.dst_rank)] += op.nbytes
        return dict(out)

    # -- JSON -------------------------------------------------------------
    def to_json(self) -> dict:
        paths = list(dict.fromkeys([op.path for op in self.ops] + [v.path for v in self.values]))
        index = {p: i for i, p in enumerate(paths)}
        return {
            "format": FORMAT,
            "src": self.src.to_json(),
            "dst": self.dst.to_json(),
            "src_placement": self.src_placement.to_json(),
            "dst_placement": self.dst_placement.to_json(),
            "alive": list(self.alive),
            "paths": paths,
            "ops": [[index[o.path], o.dst_rank, o.src_rank, list(o.region.offsets),
                     list(o.region.sizes), o.src_piece, o.dst_piece, o.nbytes, o.kind.value,
                     o.link.value] for o in self.ops],
            "values": [[index[v.path], v.dst_rank, v.src_rank] for v in self.values],
            "padding": [[p.path, p.axis, p.logical, p.src_padded, p.dst_padded]
                        for p in self.padding],
            "totals": {k: getattr(self.totals, k) for k in Totals.__dataclass_fields__},
        }

    def dumps(self) -> str:
        """Canonical JSON text: the same plan always gives the same bytes."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, obj: dict) -> "Plan":
        """Rebuild a plan from :meth:`to_json` output.

        Raises:
            PlanError: on an unknown format or malformed content.
        """
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise PlanError(f"plan: expected format {FORMAT!r}, found {found!r}")
        try:
            paths = obj["paths"]
            ops = tuple(CopyOp(paths[p], d, s, Box(tuple(off), tuple(size)), sp, dp, n,
                               OpKind(k), Link(link))
                        for p, d, s, off, size, sp, dp, n, k, link in obj["ops"])
            values = tuple(ValueOp(paths[p], d, s) for p, d, s in obj["values"])
            padding = tuple(PaddingChange(*row) for row in obj["padding"])
            return cls(ParallelConfig.from_json(obj["src"]), ParallelConfig.from_json(obj["dst"]),
                       Placement.from_json(obj["src_placement"]),
                       Placement.from_json(obj["dst_placement"]), tuple(obj["alive"]), ops,
                       values, padding, Totals(**obj["totals"]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise PlanError(f"plan: malformed JSON: {exc!r}") from exc

"""The Plan: frozen records of what must move, with a stable order and JSON form.

A plan is plain data. The planner (:mod:`tenplex.transform.planner`) makes
it and executors only consume it; neither side does the other's job.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import xxhash

from tenplex.errors import PlanError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.region import Box
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree
from tenplex.transform.placement import Placement

__all__ = ["OpKind", "Link", "CopyOp", "ValueOp", "PaddingChange", "Totals", "OpTable", "Plan",
           "PLAN_SCHEMA", "STORE_RANK"]

PLAN_SCHEMA = "tenplex.plan/1"


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

    def __str__(self) -> str:
        """One line, as the CLI and :class:`~tenplex.api.ReshardReport` show it."""
        return (f"{self.path}: axis {self.axis} padded {self.src_padded} -> {self.dst_padded} "
                f"(logical {self.logical}; {self.created} rows zero-filled, {self.dropped} dropped)")


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
        placement_bound: bytes no placement of the target ranks on the
            source devices can avoid moving: Σ over target ranks of (bytes
            needed − the most bytes of them any one live source rank holds)
            (:func:`~tenplex.transform.assign.placement_bound`); ``None``
            unless asked for (``make_plan(..., bound=True)``, whole plans only).
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
    placement_bound: int | None = None

    @property
    def moved(self) -> int:
        """Bytes that leave their device: host + network + store."""
        return self.host + self.network + self.store


_KINDS = tuple(OpKind)
_LINKS = tuple(Link)
KIND_CODE = {k: i for i, k in enumerate(_KINDS)}
LINK_CODE = {k: i for i, k in enumerate(_LINKS)}
FILL_CODE = KIND_CODE[OpKind.FILL]
"""The ``kind`` column's code of :attr:`OpKind.FILL` (the only thing named FILL besides it)."""


class OpTable:
    """Copy ops as numpy columns, one row per op, sorted by target rank.

    Large plans hold about a million ops; columns keep them in tens of MB and
    let executors select a rank's ops without Python objects. ``table[i]``
    and iteration give :class:`CopyOp` records.

    Columns (all 1-D of length ``n`` unless noted): ``path`` (int32 index
    into ``paths``), ``dst``, ``src`` (int32 ranks), ``offsets`` and
    ``sizes`` (int64, ``[n, max_ndim]``, elements; axes past a leaf's ndim
    are 0 and 1), ``src_piece``, ``dst_piece`` (int32), ``nbytes`` (int64),
    ``kind``, ``link`` (int8 codes of :class:`OpKind` and :class:`Link`).

    The table owns its columns and makes them read-only, so a table (and the
    :class:`Plan` holding it) never changes after it is built: its
    :meth:`digest` and ``hash`` stay valid.
    """

    COLUMNS = ("path", "dst", "src", "offsets", "sizes", "src_piece", "dst_piece", "nbytes",
               "kind", "link")
    DTYPES = {"path": np.int32, "dst": np.int32, "src": np.int32, "offsets": np.int64,
              "sizes": np.int64, "src_piece": np.int32, "dst_piece": np.int32, "nbytes": np.int64,
              "kind": np.int8, "link": np.int8}

    def __init__(self, paths, ndims, columns: dict):
        self.paths = tuple(paths)
        self.ndims = tuple(int(n) for n in ndims)
        self.cols = {k: np.ascontiguousarray(columns[k], dtype=self.DTYPES[k]) for k in self.COLUMNS}
        for col in self.cols.values():
            col.flags.writeable = False
        n = len(self.cols["dst"])
        if any(len(c) != n for c in self.cols.values()):
            raise PlanError("OpTable: columns have different lengths")
        dst = self.cols["dst"]
        if n and bool((dst[1:] < dst[:-1]).any()):
            raise PlanError("OpTable: rows must be sorted by target rank")

    @classmethod
    def empty(cls, paths=(), ndims=()) -> "OpTable":
        z = lambda dt: np.zeros(0, dtype=dt)
        d = max(ndims, default=0)
        return cls(paths, ndims, {"path": z(np.int32), "dst": z(np.int32), "src": z(np.int32),
                                  "offsets": np.zeros((0, d), np.int64),
                                  "sizes": np.zeros((0, d), np.int64),
                                  "src_piece": z(np.int32), "dst_piece": z(np.int32),
                                  "nbytes": z(np.int64), "kind": z(np.int8), "link": z(np.int8)})

    def __len__(self) -> int:
        return len(self.cols["dst"])

    def __getitem__(self, i: int) -> CopyOp:
        rows = self.__dict__.get("_rows")
        if rows is None:  # the columns as Python lists, once (the table never changes)
            rows = self.__dict__["_rows"] = {k: v.tolist() for k, v in self.cols.items()}
        i = int(i)
        p = rows["path"][i]
        nd = self.ndims[p]
        return CopyOp(self.paths[p], rows["dst"][i], rows["src"][i],
                      Box(tuple(rows["offsets"][i][:nd]), tuple(rows["sizes"][i][:nd])),
                      rows["src_piece"][i], rows["dst_piece"][i], rows["nbytes"][i],
                      _KINDS[rows["kind"][i]], _LINKS[rows["link"][i]])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def rows_for(self, dst_rank: int) -> range:
        """Row indices of ``dst_rank``'s ops."""
        dst = self.cols["dst"]
        return range(int(np.searchsorted(dst, dst_rank, "left")),
                     int(np.searchsorted(dst, dst_rank, "right")))

    def __eq__(self, other) -> bool:
        return (isinstance(other, OpTable) and self.paths == other.paths
                and self.ndims == other.ndims
                and all(np.array_equal(self.cols[k], other.cols[k]) for k in self.COLUMNS))

    def __hash__(self) -> int:
        return hash(self.digest())

    def digest(self) -> str:
        """xxh3-128 hex digest of the table: a canonical header, then every column's bytes.

        Equal tables give equal digests on any machine (columns are hashed in
        little-endian byte order); about 15 ms per million ops (bench/plan_digest.py).
        """
        header = {"paths": list(self.paths), "ndims": list(self.ndims),
                  "columns": [[k, np.dtype(self.DTYPES[k]).str, list(self.cols[k].shape)]
                              for k in self.COLUMNS]}
        h = xxhash.xxh3_128(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
        for k in self.COLUMNS:
            col = self.cols[k] if np.little_endian else self.cols[k].byteswap()
            h.update(col.tobytes() if not col.size else memoryview(col).cast("B"))
        return h.hexdigest()

    def to_json(self) -> dict:
        out = {"paths": list(self.paths), "ndims": list(self.ndims)}
        for k in self.COLUMNS:
            out[k] = self.cols[k].tolist()
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "OpTable":
        d = max(obj["ndims"], default=0)
        cols = {}
        for k in cls.COLUMNS:
            arr = np.asarray(obj[k], dtype=cls.DTYPES[k])
            if k in ("offsets", "sizes"):
                arr = arr.reshape(-1, d)
            cols[k] = arr
        return cls(obj["paths"], obj["ndims"], cols)


@dataclass(frozen=True, eq=True)
class Plan:
    """What every target rank must receive, from where.

    Attributes:
        src: the source config.
        dst: the target config.
        src_placement, dst_placement: rank -> device on each side.
        alive: the source ranks that could serve data.
        table: the copy ops, ordered by target rank, then tree leaf order,
            then target piece and region (see :class:`OpTable`).
        values: value-leaf ops, ordered by target rank then tree order.
        padding: padded axes whose padded length changes.
        totals: byte counts.
        shardings: ``(Sharding(tree, src), Sharding(tree, dst))`` as the planner built them, for
            the executors and writers of this plan (not compared, hashed or serialized; empty
            for a plan read from JSON): see :meth:`src_sharding`, :meth:`dst_sharding`.
        ranks, senders: for a partial plan (``make_plan(..., ranks=,
            senders=)``), the target ranks and source ranks whose ops it
            holds; ``None`` for the whole plan.
    """

    src: ParallelConfig
    dst: ParallelConfig
    src_placement: Placement
    dst_placement: Placement
    alive: tuple[int, ...]
    table: OpTable
    values: tuple[ValueOp, ...] = ()
    padding: tuple[PaddingChange, ...] = ()
    totals: Totals = field(default_factory=Totals)
    ranks: tuple[int, ...] | None = None
    senders: tuple[int, ...] | None = None
    shardings: tuple = field(default=(), compare=False, repr=False)

    def src_sharding(self, tree: PTree) -> Sharding:
        """The source config's geometry of ``tree``: the planner's, or built where the plan has none."""
        return self.shardings[0] if self.shardings else Sharding(tree, self.src)

    def dst_sharding(self, tree: PTree) -> Sharding:
        """The target config's geometry of ``tree``: the planner's, or built where the plan has none."""
        return self.shardings[1] if self.shardings else Sharding(tree, self.dst)

    @property
    def ops(self) -> OpTable:
        """The copy ops; iterate or index for :class:`CopyOp` records."""
        return self.table

    def __hash__(self) -> int:
        return hash(self.digest())

    def digest(self) -> str:
        """xxh3-128 hex digest of the whole plan; equal plans give equal digests.

        The header (configs, placements, live ranks, value ops, padding
        changes, totals) is hashed as canonical JSON, then the op table's
        columns as raw bytes (:meth:`OpTable.digest`), so a plan of a million
        ops digests in tens of milliseconds. Processes compare digests to
        agree that they run the same plan before any byte moves. The digest
        is computed once and cached (a plan never changes).
        """
        cached = self.__dict__.get("_digest")
        if cached is None:
            head = self._header()
            h = xxhash.xxh3_128(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())
            h.update(self.table.digest().encode())
            cached = h.hexdigest()
            object.__setattr__(self, "_digest", cached)
        return cached

    def kinds(self) -> dict[str, int]:
        """Bytes per op kind."""
        c = self.table.cols
        sums = np.bincount(c["kind"], weights=c["nbytes"], minlength=len(_KINDS))
        return {k.value: int(v) for k, v in zip(_KINDS, sums) if v}

    def matrix(self) -> dict[tuple[int, int], int]:
        """``{(src_rank, dst_rank): bytes}`` over all ops but FILL (src -1: store reads)."""
        c = self.table.cols
        keep = c["kind"] != FILL_CODE
        out: Counter = Counter()
        for s, d, n in zip(c["src"][keep].tolist(), c["dst"][keep].tolist(),
                           c["nbytes"][keep].tolist()):
            out[(s, d)] += n
        return dict(out)

    # -- JSON -------------------------------------------------------------
    def _header(self) -> dict:
        """Everything but the op table, as JSON."""
        return {
            "format": PLAN_SCHEMA,
            "src": self.src.to_json(),
            "dst": self.dst.to_json(),
            "src_placement": self.src_placement.to_json(),
            "dst_placement": self.dst_placement.to_json(),
            "alive": list(self.alive),
            "values": [[v.path, v.dst_rank, v.src_rank] for v in self.values],
            "padding": [[p.path, p.axis, p.logical, p.src_padded, p.dst_padded]
                        for p in self.padding],
            "totals": {k: getattr(self.totals, k) for k in Totals.__dataclass_fields__},
            **({} if self.ranks is None and self.senders is None else
               {"ranks": list(self.ranks or ()), "senders": list(self.senders or ())}),
        }

    def to_json(self) -> dict:
        return {**self._header(), "ops": self.table.to_json()}

    def dumps(self) -> str:
        """Canonical JSON text: the same plan always gives the same bytes."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, obj: dict) -> "Plan":
        """Rebuild a plan from :meth:`to_json` output.

        Raises:
            PlanError: on an unknown format or malformed content.
        """
        if not isinstance(obj, dict) or obj.get("format") != PLAN_SCHEMA:
            found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise PlanError(f"plan: expected format {PLAN_SCHEMA!r}, found {found!r}")
        try:
            values = tuple(ValueOp(p, d, s) for p, d, s in obj["values"])
            padding = tuple(PaddingChange(*row) for row in obj["padding"])
            return cls(ParallelConfig.from_json(obj["src"]), ParallelConfig.from_json(obj["dst"]),
                       Placement.from_json(obj["src_placement"]),
                       Placement.from_json(obj["dst_placement"]), tuple(obj["alive"]),
                       OpTable.from_json(obj["ops"]), values, padding, Totals(**obj["totals"]),
                       _ranks(obj, "ranks"), _ranks(obj, "senders"))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"plan: malformed JSON: {exc!r}") from exc


def _ranks(obj: dict, key: str) -> tuple[int, ...] | None:
    """A partial plan's ``ranks`` or ``senders`` from its JSON (``None``: a whole plan)."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(r, int) for r in value):
        raise PlanError(f"plan: {key} must be a list of ranks, found {_short(value)}")
    return tuple(value)


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""The planner: which piece of which tensor each target rank needs, and from where.

``make_plan(tree, src, dst, ...)`` returns a :class:`~tenplex.transform.plan.Plan`.
It does no I/O and touches no tensor data.

For every tensor leaf and every target rank, each piece the rank must hold
is covered, exactly once, by boxes of live source pieces
(:mod:`tenplex.transform.geometry`). Several sources may hold the same box
(dp replicas, tied embedding copies). The choice among them:

1. a source on the target's own device: nothing moves;
2. else a source on the target's host; among several, the least loaded;
3. else the least loaded source anywhere.

"Load" is the bytes a source rank has been given to send so far. Targets
that need the same box from the same pool of replicas are dealt out over the
pool's ranks in order of increasing load (least-loaded-first round robin),
leaf after leaf in tree order, which keeps the busiest sender's bytes close
to the even share. Padding that only the target has becomes FILL ops.
Boxes no live source holds raise :class:`~tenplex.errors.MissingDataError`,
or become STORE reads with ``store_fallback=True``.

Cost: geometry is computed once per kind of leaf (see
:func:`~tenplex.transform.geometry.signature`) and source choice is
vectorized over target ranks, so planning GPT-3 175B from 1024 to 2048
ranks takes seconds (``bench/plan_scale.py``).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterable

import numpy as np

from tenplex.errors import ConfigError, MissingDataError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.region import Box
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, TensorLeaf
from tenplex.transform.geometry import (COPY, MISSING, LeafGeometry, signature, tp_shift,
                                       tp_symmetric)
from tenplex.transform.placement import Placement
from tenplex.transform.plan import (KIND_CODE, LINK_CODE, STORE_RANK, Link, OpKind, OpTable,
                                    PaddingChange, Plan, Totals, ValueOp)

__all__ = ["make_plan"]

_LOCAL, _HOST, _NET, _STORE = (LINK_CODE[Link.LOCAL], LINK_CODE[Link.HOST],
                               LINK_CODE[Link.NETWORK], LINK_CODE[Link.STORE])
_FILL_KIND = KIND_CODE[OpKind.FILL]


def make_plan(tree: PTree, src: ParallelConfig, dst: ParallelConfig, *,
              src_placement: Placement | None = None, dst_placement: Placement | None = None,
              alive: Iterable[int] | None = None, store_fallback: bool = False) -> Plan:
    """Plan the move of ``tree``'s state from config ``src`` to config ``dst``.

    Args:
        tree: the tree spec.
        src: the config the state is laid out for now.
        dst: the config to lay it out for.
        src_placement: device of each source rank; default
            ``Placement.contiguous(src.world_size)``.
        dst_placement: device of each target rank; default
            ``Placement.contiguous(dst.world_size)``, so that rank ``r`` of
            both configs shares a device.
        alive: the source ranks that can serve data; default all.
        store_fallback: plan boxes no live rank holds as STORE reads
            (``src_rank == -1``) instead of raising.

    Returns:
        The plan; the same inputs give the same plan, byte for byte.

    Raises:
        ConfigError: if either config cannot hold the tree, or a placement
            does not match its config.
        MissingDataError: if some box has no live source (and no store
            fallback); ``.missing`` maps leaf paths to the boxes.
    """
    src_placement = src_placement or Placement.contiguous(src.world_size)
    dst_placement = dst_placement or Placement.contiguous(dst.world_size)
    src_placement.check(src.world_size, "source")
    dst_placement.check(dst.world_size, "target")
    alive_set = set(range(src.world_size)) if alive is None else set(alive)
    if not alive_set <= set(range(src.world_size)):
        raise ConfigError(f"alive ranks {sorted(alive_set - set(range(src.world_size)))} "
                          f"are not ranks of {src}")
    with _gc_paused():
        builder = _Builder(tree, Sharding(tree, src), Sharding(tree, dst), src_placement,
                           dst_placement, alive_set, store_fallback)
        for index, (path, leaf) in enumerate(tree.tensors()):
            builder.leaf(index, path, leaf)
    if builder.missing:
        raise MissingDataError(_missing_message(builder.missing), builder.missing)
    table = builder.table()
    return Plan(src, dst, src_placement, dst_placement, tuple(sorted(alive_set)), table,
                _value_ops(tree, src, dst, alive_set), tuple(builder.padding),
                builder.totals(table))


@contextlib.contextmanager
def _gc_paused():
    """Pause cyclic GC: planning allocates ~1M acyclic objects, which would trigger full scans."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _missing_message(missing: dict) -> str:
    items = [f"{path} {', '.join(str(b) for b in boxes[:2])}{' ...' if len(boxes) > 2 else ''}"
             for path, boxes in list(missing.items())[:3]]
    more = f"; and {len(missing) - 3} more leaves" if len(missing) > 3 else ""
    return (f"{len(missing)} leaves have regions that no live source holds: "
            + "; ".join(items) + more)


def _value_ops(tree: PTree, src: ParallelConfig, dst: ParallelConfig, alive: set) -> tuple:
    ops = []
    for path, leaf in tree.values():
        first: dict[str, int] = {}
        for r in sorted(alive):
            first.setdefault(leaf.key(src, r), r)
        for rank in range(dst.world_size):
            key = leaf.key(dst, rank)
            same = rank in alive and leaf.key(src, rank) == key
            ops.append(ValueOp(path, rank, rank if same else first.get(key, STORE_RANK)))
    ops.sort(key=lambda op: op.dst_rank)
    return tuple(ops)


class _Template:
    """Rows (target rank x segment) of one LeafGeometry, with every load-free choice made."""

    __slots__ = ("dst", "seg", "src", "alt", "link", "typ", "offsets", "sizes", "dst_piece",
                 "volume", "pools", "pieces", "kinds", "net_groups", "host_groups", "static_moved",
                 "lb_volume", "lb_net_volume", "missing_rows", "prefer")


class _Builder:
    def __init__(self, tree, S: Sharding, D: Sharding, src_pl: Placement, dst_pl: Placement,
                 alive: set, store_fallback: bool):
        self.tree, self.S, self.D = tree, S, D
        self.store_fallback = store_fallback
        ws = S.config.world_size
        self.alive_mask = np.zeros(ws + 1, dtype=bool)
        self.alive_mask[sorted(alive)] = True
        hosts = sorted({d.host for d in src_pl.devices} | {d.host for d in dst_pl.devices})
        host_id = {h: i for i, h in enumerate(hosts)}
        self.n_hosts = len(hosts)
        self.src_host = np.array([host_id[d.host] for d in src_pl.devices], dtype=np.int64)
        self.dst_host = np.array([host_id[d.host] for d in dst_pl.devices], dtype=np.int64)
        on_device = {d: r for r, d in enumerate(src_pl.devices) if r in alive}
        self.src_on_dev = np.array([on_device.get(d, ws) for d in dst_pl.devices], dtype=np.int64)
        self.ndim = max((len(l.shape) for _, l in tree.tensors()), default=0)
        self.loads = np.zeros(ws + 1, dtype=np.int64)
        self.all_alive = bool(self.alive_mask[:ws].all())
        self.src_tp = np.array([S.config.coord(r).tp for r in range(ws)] + [-1], dtype=np.int64)
        self.templates: dict = {}
        self.covers: dict = {}
        self.chunks: list[dict] = []
        self.missing: dict[str, list[Box]] = {}
        self.padding: list[PaddingChange] = []
        self.lb = self.lb_net = 0
        self.paths: list[str] = []
        self.ndims: list[int] = []

    # -- per leaf ----------------------------------------------------------
    def leaf(self, index: int, path: str, leaf: TensorLeaf) -> None:
        self.paths.append(path)
        self.ndims.append(len(leaf.shape))
        src_shape, dst_shape = self.S.physical_shape(leaf), self.D.physical_shape(leaf)
        if leaf.layout.padding is not None and src_shape != dst_shape:
            axis = leaf.layout.padding.axis
            self.padding.append(PaddingChange(path, axis, leaf.shape[axis], src_shape[axis],
                                              dst_shape[axis]))
        key = signature(self.S, self.D, leaf)
        T = self.templates.get(key)
        if T is None:
            T = self.templates[key] = self._make_template(path, leaf)
        itemsize = leaf.itemsize
        self.lb += T.lb_volume * itemsize
        self.lb_net += T.lb_net_volume * itemsize
        if len(T.missing_rows) and not self.store_fallback:
            boxes = self.missing.setdefault(path, [])
            for s in dict.fromkeys(T.seg[T.missing_rows].tolist()):
                boxes.append(_box(T, s, len(leaf.shape)))
            return
        nbytes = T.volume[T.seg] * itemsize
        src = self._choose(T, nbytes)
        self.chunks.append({
            "path": np.full(len(T.seg), index, dtype=np.int32),
            "dst": T.dst, "src": src, "offsets": T.offsets[T.seg], "sizes": T.sizes[T.seg],
            "src_piece": T.pieces[T.alt, T.seg], "dst_piece": T.dst_piece[T.seg],
            "nbytes": nbytes, "kind": T.kinds[T.alt, T.seg], "link": T.link,
        })

    def _choose(self, T: _Template, nbytes: np.ndarray) -> np.ndarray:
        """Source ranks for every row, with load-dependent choices made now."""
        src = T.src.copy()
        loads = self.loads
        if len(T.static_moved):
            np.add.at(loads, src[T.static_moved], nbytes[T.static_moved])
        for candidates, rows in T.host_groups + T.net_groups:
            order = np.lexsort((candidates, loads[candidates]))
            chosen = candidates[order][np.arange(len(rows)) % len(candidates)]
            src[rows] = chosen
            np.add.at(loads, chosen, nbytes[rows])
        return src

    def _make_template(self, path: str, leaf: TensorLeaf) -> _Template:
        if self.all_alive and tp_symmetric(self.S, self.D, leaf):
            g0 = LeafGeometry(self.S, self.D, path, self.alive_mask, self.covers, tp_coord=0)
            T = self._tiled_template(g0, leaf)
            if T is not None:
                return T
        g = LeafGeometry(self.S, self.D, path, self.alive_mask, self.covers)
        segs, T = self._rows(g)
        self._segment_table(T, segs)
        self._static_choice(T, g.pools, g.member)
        return T

    def _rows(self, g: LeafGeometry) -> tuple[list, _Template]:
        """Segments and (target rank, segment) rows of ``g``, grouped by preferred pool."""
        segs: list = []
        dst: list = []
        seg: list = []
        lb = 0
        T = _Template()
        T.prefer = []
        for k, (ranks, _) in enumerate(g.dst_classes):
            prefer = g.class_of_src[self.src_on_dev[ranks]]
            T.prefer.append(prefer)
            for p in (prefer.tolist() if len(ranks) == 1 else np.unique(prefer).tolist()):
                group = ranks if len(ranks) == 1 else ranks[prefer == p]
                ss = g.segments(k, p)
                off = len(segs)
                segs.extend(ss)
                if len(group) == 1:
                    dst.append(np.full(len(ss), group[0], dtype=np.int64))
                    seg.append(np.arange(off, off + len(ss)))
                else:
                    dst.append(np.repeat(group, len(ss)))
                    seg.append(np.tile(np.arange(off, off + len(ss)), len(group)))
                lb += g.unheld_volume(k, p) * len(group)
        T.dst = np.concatenate(dst) if dst else np.zeros(0, np.int64)
        T.seg = np.concatenate(seg) if seg else np.zeros(0, np.int64)
        T.lb_volume = lb
        return segs, T

    def _tiled_template(self, g0: LeafGeometry, leaf: TensorLeaf) -> _Template | None:
        """tp rank 0's rows tiled over every tp rank; None if device locality is not tp-symmetric."""
        tp = self.S.config.tp
        ss, sd = self.S.config.stride("tp"), self.D.config.stride("tp")
        segs, T = self._rows(g0)
        ws = self.S.config.world_size
        if g0.dst_classes:
            ranks = np.concatenate([r for r, _ in g0.dst_classes])
            prefer = np.concatenate(T.prefer)
            shifts = np.arange(1, tp)[:, None]
            loc = self.src_on_dev[ranks[None, :] + shifts * sd]
            back = np.where(self.src_tp[loc] == shifts, loc - shifts * ss, ws)
            if not np.array_equal(g0.class_of_src[back], np.broadcast_to(prefer, back.shape)):
                return None
        self._segment_table(T, segs)
        m, n = len(segs), len(T.seg)
        P0 = len(g0.pools)
        shape = self.S.physical_shape(leaf)
        T.offsets = np.concatenate([tp_shift(shape, leaf.layout.split, tp, T.offsets, t)
                                    for t in range(tp)])
        for name in ("sizes", "typ", "dst_piece", "volume"):
            setattr(T, name, np.concatenate([getattr(T, name)] * tp))
        T.pools = np.concatenate([np.where(T.pools >= 0, T.pools + t * P0, -1)
                                  for t in range(tp)], axis=1)
        T.pieces = np.concatenate([T.pieces] * tp, axis=1)
        T.kinds = np.concatenate([T.kinds] * tp, axis=1)
        T.dst = np.concatenate([T.dst + t * sd for t in range(tp)])
        T.seg = np.concatenate([T.seg + t * m for t in range(tp)])
        T.lb_volume *= tp
        pools = [pool + t * ss for t in range(tp) for pool in g0.pools]
        member = np.zeros((max(len(pools), 1), ws + 1), dtype=bool)
        for i, pool in enumerate(pools):
            member[i, pool] = True
        assert len(T.seg) == n * tp
        self._static_choice(T, pools, member)
        return T

    def _segment_table(self, T: _Template, segs) -> None:
        m, d = len(segs), self.ndim
        alts = max((len(s.alts) for s in segs), default=0) or 1
        T.typ = np.array([s.type for s in segs], dtype=np.int8)
        T.offsets = np.zeros((m, d), dtype=np.int64)
        T.sizes = np.ones((m, d), dtype=np.int64)
        for i, s in enumerate(segs):
            n = len(s.box.sizes)
            T.offsets[i, :n] = s.box.offsets
            T.sizes[i, :n] = s.box.sizes
        T.dst_piece = np.array([s.dst_piece for s in segs], dtype=np.int32)
        T.volume = np.prod(T.sizes, axis=1) if m else np.zeros(0, np.int64)
        pools = np.full((alts, m), -1, dtype=np.int64)
        T.pieces = np.full((alts, m), -1, dtype=np.int32)
        T.kinds = np.full((alts, m), _FILL_KIND, dtype=np.int8)
        for i, s in enumerate(segs):
            for a, (pool, piece, kind) in enumerate(s.alts):
                pools[a, i], T.pieces[a, i], T.kinds[a, i] = pool, piece, kind
            if s.type == MISSING:
                T.kinds[0, i] = KIND_CODE[OpKind.REPARTITION]
        T.pools = pools

    def _static_choice(self, T: _Template, pools_live: list, member: np.ndarray) -> None:
        n, seg = len(T.seg), T.seg
        pools = T.pools
        typ = T.typ[seg]
        loc = self.src_on_dev[T.dst]
        T.src = np.full(n, STORE_RANK, dtype=np.int64)
        T.alt = np.zeros(n, dtype=np.int64)
        T.link = np.full(n, _LOCAL, dtype=np.int8)
        undecided = typ == COPY
        for a in range(pools.shape[0]):
            pa = pools[a, seg]
            ok = undecided & (pa >= 0) & member[np.maximum(pa, 0), loc]
            T.src[ok], T.alt[ok] = loc[ok], a
            undecided &= ~ok
        host = self.dst_host[T.dst]
        counts, first = self._host_tables(pools_live)
        p0 = np.maximum(pools[0, seg], 0)
        on_host = counts[p0, host]
        single = undecided & (on_host == 1)
        T.src[single], T.link[single] = first[p0[single], host[single]], _HOST
        multi = undecided & (on_host > 1)
        net = undecided & (on_host == 0)
        T.link[multi], T.link[net] = _HOST, _NET
        sizes = np.array([len(pool) for pool in pools_live] or [0], dtype=np.int64)
        firsts = np.array([pool[0] if len(pool) else STORE_RANK for pool in pools_live] or [0],
                          dtype=np.int64)
        sole = net & (sizes[p0] == 1)  # one live replica: nothing to choose
        T.src[sole] = firsts[p0[sole]]
        net &= ~sole
        T.static_moved = np.nonzero(single | sole)[0]
        T.host_groups = []
        for key in np.unique(p0[multi] * self.n_hosts + host[multi]).tolist():
            p, h = divmod(key, self.n_hosts)
            rows = np.nonzero(multi & (p0 == p) & (host == h))[0]
            live = pools_live[p]
            T.host_groups.append((live[self.src_host[live] == h], rows))
        T.net_groups = [(pools_live[p], np.nonzero(net & (p0 == p))[0])
                        for p in np.unique(p0[net]).tolist()]
        missing = typ == MISSING
        T.missing_rows = np.nonzero(missing)[0]
        T.link[missing] = _STORE
        has_host = np.zeros(n, dtype=bool)
        for a in range(pools.shape[0]):
            pa = pools[a, seg]
            has_host |= (pa >= 0) & (counts[np.maximum(pa, 0), host] > 0)
        T.lb_net_volume = int(T.volume[seg][(undecided | missing) & ~has_host].sum()) \
            if n else 0

    def _host_tables(self, pools_live: list):
        counts = np.zeros((max(len(pools_live), 1), self.n_hosts), dtype=np.int64)
        first = np.full((max(len(pools_live), 1), self.n_hosts), STORE_RANK, dtype=np.int64)
        for p, live in enumerate(pools_live):
            if len(live):
                hosts = self.src_host[live]
                np.add.at(counts[p], hosts, 1)
                first[p, hosts[::-1]] = live[::-1]  # the lowest rank on each host wins
        return counts, first

    # -- results ---------------------------------------------------------------
    def table(self) -> OpTable:
        if not self.chunks:
            return OpTable.empty(self.paths, self.ndims)
        cols = {k: np.concatenate([c[k] for c in self.chunks]) for k in OpTable.COLUMNS}
        order = np.argsort(cols["dst"], kind="stable")
        dtypes = {"path": np.int32, "dst": np.int32, "src": np.int32, "src_piece": np.int32,
                  "dst_piece": np.int32, "nbytes": np.int64, "kind": np.int8, "link": np.int8,
                  "offsets": np.int64, "sizes": np.int64}
        cols = {k: np.ascontiguousarray(v[order].astype(dtypes[k], copy=False))
                for k, v in cols.items()}
        return OpTable(self.paths, self.ndims, cols)

    def totals(self, table: OpTable) -> Totals:
        c = table.cols
        fill = c["kind"] == _FILL_KIND
        by_link = np.bincount(c["link"][~fill], weights=c["nbytes"][~fill], minlength=4)
        moved = (c["link"] != _LOCAL) & (c["link"] != _STORE)
        sent = np.bincount(c["src"][moved], weights=c["nbytes"][moved]) if moved.any() else [0]
        return Totals(needed=int(c["nbytes"][~fill].sum()), local=int(by_link[_LOCAL]),
                      host=int(by_link[_HOST]), network=int(by_link[_NET]),
                      store=int(by_link[_STORE]), fill=int(c["nbytes"][fill].sum()),
                      lower_bound=self.lb, lower_bound_network=self.lb_net,
                      max_sender=int(max(sent)))


def _box(T: _Template, s: int, ndim: int) -> Box:
    return Box(tuple(int(v) for v in T.offsets[s, :ndim]), tuple(int(v) for v in T.sizes[s, :ndim]))

"""The planner: which piece of which tensor each target rank needs, and from where.

``make_plan(tree, src, dst, ...)`` returns a :class:`~tenplex.transform.plan.Plan`.
It does no I/O and touches no tensor data.

For every tensor leaf and every target rank, each piece the rank must hold
is covered, exactly once, by regions of live source pieces. Several sources
may hold the same region (dp replicas, tied embedding copies). The choice
among them:

1. a source on the target's own device (nothing moves);
2. else a source on the target's host, the least loaded one;
3. else the least loaded source anywhere.

"Load" is the bytes a source rank has been given to send so far; choosing
the least loaded sender greedily (in a fixed order: target rank, then leaf)
keeps the busiest link's bytes low. Padding elements only the target has
are FILL ops. Regions no live source holds raise
:class:`~tenplex.errors.MissingDataError`, or become STORE reads when
``store_fallback=True``.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import defaultdict
from typing import Iterable

from tenplex.errors import ConfigError, MissingDataError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.region import Box, contains, full_box, intersect, subtract
from tenplex.ptree.sharding import HolderClass, Sharding
from tenplex.ptree.tree import PTree, TensorLeaf
from tenplex.transform.placement import Placement
from tenplex.transform.plan import (STORE_RANK, CopyOp, Link, OpKind, PaddingChange, Plan,
                                    Totals, ValueOp)

__all__ = ["make_plan"]


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
        store_fallback: plan regions no live rank holds as STORE reads
            (``src_rank == -1``) instead of raising.

    Returns:
        The plan, deterministic for the same inputs.

    Raises:
        ConfigError: if either config cannot hold the tree, or a placement
            does not match its config.
        MissingDataError: if some region has no live source (and no store
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
    state = _Planner(tree, Sharding(tree, src), Sharding(tree, dst), src_placement,
                     dst_placement, alive_set, store_fallback)
    for path, leaf in tree.tensors():
        state.plan_leaf(path, leaf)
    if state.missing:
        raise MissingDataError(_missing_message(state.missing), state.missing)
    values = _value_ops(tree, src, dst, alive_set)
    ops = tuple(op for rank in range(dst.world_size) for op in state.ops[rank])
    return Plan(src, dst, src_placement, dst_placement, tuple(sorted(alive_set)), ops, values,
                tuple(state.padding), state.totals())


def _missing_message(missing: dict) -> str:
    lines = [f"{len(missing)} leaves have regions that no live source holds:"]
    for path, boxes in list(missing.items())[:10]:
        lines.append(f"  {path}: " + ", ".join(str(b) for b in boxes[:4])
                     + (" ..." if len(boxes) > 4 else ""))
    if len(missing) > 10:
        lines.append(f"  ... and {len(missing) - 10} more leaves")
    return "\n".join(lines)


def _value_ops(tree: PTree, src: ParallelConfig, dst: ParallelConfig, alive: set) -> tuple:
    ops = []
    for path, leaf in tree.values():
        first: dict[str, int] = {}
        for r in sorted(alive):
            first.setdefault(leaf.key(src, r), r)
        for rank in range(dst.world_size):
            key = leaf.key(dst, rank)
            same = rank in alive and rank < src.world_size and leaf.key(src, rank) == key
            ops.append(ValueOp(path, rank, rank if same else first.get(key, STORE_RANK)))
    ops.sort(key=lambda op: op.dst_rank)
    return tuple(ops)


class _Pool:
    """The live replica ranks of one source holder class, for sender choice."""

    __slots__ = ("ranks", "by_device", "by_host", "heap")

    def __init__(self, ranks: list[int], placement: Placement):
        self.ranks = ranks
        self.by_device = {placement.devices[r]: r for r in ranks}
        self.by_host: dict[str, list[int]] = defaultdict(list)
        for r in ranks:
            self.by_host[placement.devices[r].host].append(r)
        self.heap = [(0, r) for r in ranks]


class _Cand:
    """One piece of one source holder class."""

    __slots__ = ("pool", "piece", "box", "start", "end")

    def __init__(self, pool: _Pool, piece: int, box: Box):
        self.pool, self.piece, self.box = pool, piece, box
        self.start = box.offsets[0] if box.offsets else 0
        self.end = self.start + (box.sizes[0] if box.sizes else 1)


class _Index:
    """Candidates indexed on axis 0 for overlap queries (sorted starts, prefix-max ends)."""

    def __init__(self, cands: list[_Cand]):
        self.cands = sorted(cands, key=lambda c: (c.start, c.end))
        self.starts = [c.start for c in self.cands]
        self.max_end = []
        top = -1
        for c in self.cands:
            top = max(top, c.end)
            self.max_end.append(top)

    def overlapping(self, box: Box) -> list[_Cand]:
        if not box.sizes:
            return list(self.cands)
        lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
        i = bisect_left(self.starts, hi) - 1
        out = []
        while i >= 0 and self.max_end[i] > lo:
            c = self.cands[i]
            if c.end > lo:
                out.append(c)
            i -= 1
        out.reverse()
        return out


class _Planner:
    def __init__(self, tree, S: Sharding, D: Sharding, src_pl: Placement, dst_pl: Placement,
                 alive: set, store_fallback: bool):
        self.tree, self.S, self.D = tree, S, D
        self.src_pl, self.dst_pl = src_pl, dst_pl
        self.alive, self.store_fallback = alive, store_fallback
        self.ops: list[list[CopyOp]] = [[] for _ in range(D.config.world_size)]
        self.missing: dict[str, list[Box]] = {}
        self.padding: list[PaddingChange] = []
        self.load: dict[int, int] = defaultdict(int)
        self.count = defaultdict(int)
        self.src_rank_on = {d: r for r, d in enumerate(src_pl.devices) if r in alive}

    def totals(self) -> Totals:
        c = self.count
        return Totals(needed=c["needed"], local=c[Link.LOCAL], host=c[Link.HOST],
                      network=c[Link.NETWORK], store=c[Link.STORE], fill=c["fill"],
                      lower_bound=c["lb"], lower_bound_network=c["lb_net"],
                      max_sender=max(self.load.values(), default=0))

    # -- one leaf --------------------------------------------------------------
    def plan_leaf(self, path: str, leaf: TensorLeaf) -> None:
        itemsize = leaf.itemsize
        src_shape, dst_shape = self.S.physical_shape(leaf), self.D.physical_shape(leaf)
        if leaf.layout.padding is not None and src_shape != dst_shape:
            axis = leaf.layout.padding.axis
            self.padding.append(PaddingChange(path, axis, leaf.shape[axis], src_shape[axis],
                                              dst_shape[axis]))
        extent = full_box(src_shape)
        src_classes = self.S.classes(path)
        pools, cands = [], []
        for cls in src_classes:
            ranks = [r for r in cls.ranks if r in self.alive]
            pool = _Pool(ranks, self.src_pl) if ranks else None
            pools.append(pool)
            if pool is not None:
                cands.extend(_Cand(pool, i, p.box) for i, p in enumerate(cls.holding.pieces))
        index = _Index(cands)
        rank_class = {r: k for k, cls in enumerate(src_classes) for r in cls.ranks}
        bounds: dict = {}
        for dcls in self.D.classes(path):
            covers: dict = {}
            for rank in dcls.ranks:
                device = self.dst_pl.devices[rank]
                local_src = self.src_rank_on.get(device)
                prefer = rank_class.get(local_src) if local_src is not None else None
                for j, piece in enumerate(dcls.holding.pieces):
                    key = (j, prefer)
                    if key not in covers:
                        covers[key] = self._cover(piece.box, extent, index, pools[prefer]
                                                  if prefer is not None else None, path)
                    self._emit(path, rank, device, j, piece.box, covers[key], itemsize,
                               src_classes)
                    self._lower_bounds(piece.box, extent, index, device, local_src, itemsize,
                                       bounds, j)

    def _lower_bounds(self, target, extent, index, device, local_src, itemsize, memo, j):
        """Add the bytes of ``target`` that no live source on the device / host holds."""
        key = (j, target, local_src, device.host)
        hit = memo.get(key)
        if hit is None:
            inside = intersect(target, extent)
            need = _volume(inside) if inside is not None else 0
            on_device = on_host = 0
            if inside is not None:
                near = index.overlapping(inside)
                on_device = _union_volume(inside, [c.box for c in near
                                                   if device in c.pool.by_device])
                on_host = _union_volume(inside, [c.box for c in near
                                                 if device.host in c.pool.by_host])
            hit = memo[key] = ((need - on_device) * itemsize, (need - on_host) * itemsize)
        self.count["lb"] += hit[0]
        self.count["lb_net"] += hit[1]

    def _cover(self, target: Box, extent: Box, index: _Index, prefer, path: str):
        """Segments of ``target``: ``[(box, [cands holding all of it], first cand)]``, fills."""
        inside = intersect(target, extent)
        fills = list(subtract(target, extent)) if inside != target else []
        segments = []
        if inside is None:
            return segments, fills, []
        hits = [(c, b) for c in index.overlapping(inside) if (b := intersect(c.box, inside))]
        if prefer is not None:
            hits.sort(key=lambda h: h[0].pool is not prefer)
        remaining = [inside]
        for cand, hit in hits:
            if not remaining:
                break
            rest = []
            for box in remaining:
                seg = intersect(box, hit)
                if seg is None:
                    rest.append(box)
                    continue
                alts = [c for c, b in hits if contains(b, seg)]
                segments.append((seg, alts))
                rest.extend(subtract(box, seg))
            remaining = rest
        segments.sort(key=lambda s: s[0].offsets)
        return segments, fills, remaining

    def _emit(self, path, rank, device, j, tbox, cover, itemsize, src_classes):
        segments, fills, missing = cover
        out = self.ops[rank]
        for box in fills:
            n = _volume(box) * itemsize
            out.append(CopyOp(path, rank, STORE_RANK, box, -1, j, n, OpKind.FILL, Link.LOCAL))
            self.count["fill"] += n
        for seg, alts in segments:
            n = _volume(seg) * itemsize
            src, cand, link = self._pick(alts, device, n)
            kind = _kind(seg, cand.box, tbox)
            out.append(CopyOp(path, rank, src, seg, cand.piece, j, n, kind, link))
            self.count[link] += n
            self.count["needed"] += n
        for box in missing:
            n = _volume(box) * itemsize
            self.count["needed"] += n
            if self.store_fallback:
                out.append(CopyOp(path, rank, STORE_RANK, box, -1, j, n, _kind(box, box, tbox),
                                  Link.STORE))
                self.count[Link.STORE] += n
            else:
                self.missing.setdefault(path, []).append(box)

    def _pick(self, alts, device, nbytes):
        for cand in alts:
            r = cand.pool.by_device.get(device)
            if r is not None:
                return r, cand, Link.LOCAL
        best = None
        for cand in alts:
            for r in cand.pool.by_host.get(device.host, ()):
                key = (self.load[r], r)
                if best is None or key < best[0]:
                    best = (key, r, cand)
        if best is not None:
            _, r, cand = best
            self.load[r] += nbytes
            return r, cand, Link.HOST
        for cand in alts:
            r = self._least_loaded(cand.pool)
            key = (self.load[r], r)
            if best is None or key < best[0]:
                best = (key, r, cand)
        _, r, cand = best
        self.load[r] += nbytes  # the pool heaps see the new load lazily
        return r, cand, Link.NETWORK

    def _least_loaded(self, pool: _Pool) -> int:
        heap = pool.heap
        while True:
            load, r = heap[0]
            if load == self.load[r]:
                return r
            heapq.heapreplace(heap, (self.load[r], r))


def _kind(seg: Box, src_box: Box, dst_box: Box) -> OpKind:
    whole_src, whole_dst = seg == src_box, seg == dst_box
    if whole_src and whole_dst:
        return OpKind.KEEP
    if whole_dst:
        return OpKind.SPLIT
    if whole_src:
        return OpKind.MERGE
    return OpKind.REPARTITION


def _union_volume(target: Box, boxes: list[Box]) -> int:
    """Elements of ``target`` covered by the union of ``boxes``."""
    remaining, covered = [target], 0
    for other in boxes:
        rest = []
        for box in remaining:
            inter = intersect(box, other)
            if inter is None:
                rest.append(box)
            else:
                covered += _volume(inter)
                rest.extend(subtract(box, inter))
        remaining = rest
    return covered


def _volume(box: Box) -> int:
    n = 1
    for s in box.sizes:
        n *= s
    return n

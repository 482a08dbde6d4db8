"""Templates: every load-free planning decision for one kind of leaf, as arrays.

Vocabulary (see also :mod:`tenplex.transform.geometry`):

- a **pool** is the live ranks of one source holder class (replicas);
- a **segment** is a box of one target piece that is either copied (held
  whole by one or more source pieces, its *alternatives*, best first),
  filled (padding only the target has) or missing (no live source holds it);
- a **row** is one (target rank, segment) pair: one op of the plan.

Leaves of one kind (equal :func:`~tenplex.transform.geometry.signature`)
share a :class:`Template`; the planner then only makes the load-dependent
choices per leaf. Array shapes are given as ``[rows]``, ``[segments]``,
``[alts, segments]`` (alternative ``a`` of each segment; -1 where a segment
has fewer) and ``[segments, ndim]`` (boxes, padded with offset 0 and size 1
beyond a leaf's own rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tenplex.ptree.region import intersect
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import TensorLeaf
from tenplex.transform.geometry import LeafGeometry, Segment, SegmentType, tp_shift, tp_symmetric
from tenplex.transform.plan import FILL_CODE, KIND_CODE, LINK_CODE, STORE_RANK, Link, OpKind

__all__ = ["Devices", "Rows", "Segments", "Choice", "Template", "TemplateMaker"]

LOCAL, HOST, NETWORK, STORE = (LINK_CODE[Link.LOCAL], LINK_CODE[Link.HOST],
                               LINK_CODE[Link.NETWORK], LINK_CODE[Link.STORE])


@dataclass(frozen=True, eq=False)
class Devices:
    """Where the ranks of both configs run, as arrays.

    Attributes:
        src_host: ``[src world]`` int64, the host id of each source rank.
        dst_host: ``[dst world]`` int64, the host id of each target rank.
        src_on_device: ``[dst world]`` int64, the live source rank on each
            target rank's device, or ``src world`` (a sentinel) if none.
        n_hosts: the number of distinct hosts.
    """

    src_host: np.ndarray
    dst_host: np.ndarray
    src_on_device: np.ndarray
    n_hosts: int


@dataclass(frozen=True, eq=False)
class Rows:
    """The rows of one kind of leaf, grouped by the pool on each target's own device.

    Attributes:
        dst: ``[rows]`` int64, each row's target rank.
        seg: ``[rows]`` int64, each row's segment.
        pos: ``[rows]`` int64, each row's target's position among the ranks
            of its target holder class (its replicas) that share its own-device
            pool, which deals the sources out
            (:func:`~tenplex.transform.planner.deal`).
        unheld: elements the counted targets need that no pool on their own
            device holds: the lower bound of elements moved (FILL excluded).
        prefer: per target class, ``[its ranks]`` int64: the pool on each
            rank's own device (-1: none).
    """

    dst: np.ndarray
    seg: np.ndarray
    pos: np.ndarray
    unheld: int
    prefer: list


@dataclass(frozen=True, eq=False)
class Segments:
    """The segments of one kind of leaf.

    Attributes:
        typ: ``[segments]`` int8, a :class:`SegmentType` each.
        offsets: ``[segments, ndim]`` int64, box offsets in the padded global tensor.
        sizes: ``[segments, ndim]`` int64, box sizes.
        dst_piece: ``[segments]`` int32, the target piece each segment lies in.
        volume: ``[segments]`` int64, elements.
        pools: ``[alts, segments]`` int64, the pool of each alternative (-1: none).
        pieces: ``[alts, segments]`` int32, its source piece index.
        kinds: ``[alts, segments]`` int8, its op kind code (``FILL_CODE`` where none).
        phase: ``[segments]`` int64, where the segment lies in its first
            alternative's source piece, in 1/65536 turns (sum over axes of
            relative offset / piece size, modulo 1): targets that need other
            parts of one source piece start the deal at other sources.
    """

    typ: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    dst_piece: np.ndarray
    volume: np.ndarray
    pools: np.ndarray
    pieces: np.ndarray
    kinds: np.ndarray
    phase: np.ndarray


@dataclass(frozen=True, eq=False)
class Choice:
    """The sources chosen without looking at load, and the choices left for load.

    Attributes:
        src: ``[rows]`` int64, the chosen source rank (STORE_RANK where undecided,
            filled or missing).
        alt: ``[rows]`` int64, the alternative it serves.
        link: ``[rows]`` int8, the link code of each row.
        static_moved: ``[k]`` int64, rows whose source is fixed here but whose
            bytes move (their load is counted as the leaf is emitted).
        host_groups: ``[(candidates [c], rows [r])]``: rows served from the
            same host by one of several candidate ranks, chosen by load.
        net_groups: ``[(candidates [c], rows [r])]``: the same across hosts.
        missing_rows: ``[m]`` int64, rows no live source holds.
        lb_net_volume: elements that must cross hosts: no pool on the
            target's host holds them (counted targets only).
    """

    src: np.ndarray
    alt: np.ndarray
    link: np.ndarray
    static_moved: np.ndarray
    host_groups: list
    net_groups: list
    missing_rows: np.ndarray
    lb_net_volume: int


@dataclass(frozen=True, eq=False)
class Template:
    """Every load-free decision for one kind of leaf: its rows, segments and static choices.

    Built only by :meth:`TemplateMaker.make`. A leaf's ops are row ``i``:
    target ``rows.dst[i]``, box ``segments.offsets/sizes[rows.seg[i]]``,
    source piece ``segments.pieces[choice.alt[i], rows.seg[i]]``.
    """

    rows: Rows
    segments: Segments
    choice: Choice


class TemplateMaker:
    """Builds the :class:`Template` of a leaf under (source, target) shardings.

    Args:
        src, dst: the source and target shardings.
        alive_mask: ``[src world + 1]`` bool, the live source ranks (the last
            entry, the sentinel, is False).
        devices: where ranks run.
        ndim: the largest tensor rank in the tree (width of box arrays).
        part: for a partial plan, ``(targets, senders)``: ``[dst world]`` and
            ``[src world + 1]`` bool masks of the target ranks whose rows are
            wanted and of the source ranks whose sends are wanted; ``None``
            for the whole plan. Rows are then made only for target classes
            with a wanted target or a sender's data, and only wanted targets
            are counted in the bounds.
    """

    def __init__(self, src: Sharding, dst: Sharding, alive_mask: np.ndarray, devices: Devices,
                 ndim: int, part: tuple[np.ndarray, np.ndarray] | None = None):
        self.src, self.dst = src, dst
        self.alive_mask = alive_mask
        self.devices = devices
        self.ndim = ndim
        self.part = part
        self.covers: dict = {}
        self.all_alive = bool(alive_mask[:-1].all())
        self._axis_coord: dict = {}

    def make(self, path: str, leaf: TensorLeaf) -> Template:
        """The template of ``leaf``: tp rank 0's rows tiled over tp ranks where that is exact."""
        parts = None
        if self.all_alive and self.part is None and tp_symmetric(self.src, self.dst, leaf):
            parts = self._tiled(path, leaf)
        if parts is None:
            geometry = LeafGeometry(self.src, self.dst, path, self.alive_mask, self.covers)
            segs, rows = self._rows(geometry)
            parts = rows, self._segment_table(segs, geometry.pool_boxes), geometry.pools, geometry.member
        rows, segments, pools, member = parts
        return Template(rows, segments, self._static_choice(rows, segments, pools, member))

    def _rows(self, g: LeafGeometry) -> tuple[list[Segment], Rows]:
        """Segments and rows of ``g``; targets with the same own-device pool share segments."""
        segs: list = []
        dst: list = []
        seg: list = []
        pos: list = []
        unheld = 0
        prefers = []
        for k, (ranks, _) in enumerate(g.dst_classes):
            place = _positions(g.class_of_src[self.devices.src_on_device[ranks]])
            counted = np.ones(len(ranks), dtype=bool)
            if self.part is not None:
                counted = self.part[0][ranks]
                if not self._sends_to(g, k):
                    ranks, place, counted = ranks[counted], place[counted], counted[counted]
            prefer = g.class_of_src[self.devices.src_on_device[ranks]]
            prefers.append(prefer)
            for p in (prefer.tolist() if len(ranks) == 1 else np.unique(prefer).tolist()):
                chosen = prefer == p
                group = ranks[chosen]
                ss = g.segments(k, p)
                off = len(segs)
                segs.extend(ss)
                dst.append(np.repeat(group, len(ss)))
                seg.append(np.tile(np.arange(off, off + len(ss)), len(group)))
                pos.append(np.repeat(place[chosen], len(ss)))
                unheld += g.unheld_volume(k, p) * int(counted[chosen].sum())
        empty = np.zeros(0, np.int64)
        join = lambda parts: np.concatenate(parts) if parts else empty
        return segs, Rows(join(dst), join(seg), join(pos), unheld, prefers)

    def _sends_to(self, g: LeafGeometry, k: int) -> bool:
        """Whether a wanted sender's pool holds part of target class ``k``'s boxes (may serve it)."""
        senders = self.part[1]
        if not senders.any():
            return False
        index = g.sender_index(senders)
        return any(intersect(c.box, box) is not None
                   for box in g.dst_classes[k][1] for c in index.overlapping(box))

    def _segment_table(self, segs: list[Segment], pool_boxes: list) -> Segments:
        """The segments' boxes and alternatives as arrays (see :class:`Segments`)."""
        m, d = len(segs), self.ndim
        alts = max((len(s.alts) for s in segs), default=0) or 1
        offsets = np.zeros((m, d), dtype=np.int64)
        sizes = np.ones((m, d), dtype=np.int64)
        pools = np.full((alts, m), -1, dtype=np.int64)
        pieces = np.full((alts, m), -1, dtype=np.int32)
        kinds = np.full((alts, m), FILL_CODE, dtype=np.int8)
        phase = np.zeros(m, dtype=np.int64)
        for i, s in enumerate(segs):
            if s.alts:
                phase[i] = _phase(s.box, pool_boxes[s.alts[0][0]][s.alts[0][1]])
            n = len(s.box.sizes)
            offsets[i, :n] = s.box.offsets
            sizes[i, :n] = s.box.sizes
            for a, (pool, piece, kind) in enumerate(s.alts):
                pools[a, i], pieces[a, i], kinds[a, i] = pool, piece, kind
            if s.type == SegmentType.MISSING:
                kinds[0, i] = KIND_CODE[OpKind.REPARTITION]
        return Segments(np.array([s.type for s in segs], dtype=np.int8), offsets, sizes,
                        np.array([s.dst_piece for s in segs], dtype=np.int32),
                        np.prod(sizes, axis=1) if m else np.zeros(0, np.int64), pools, pieces,
                        kinds, phase)

    def _tiled(self, path: str, leaf: TensorLeaf):
        """Rows, segments and pools of split rank 0 tiled over every split rank.

        Split rank ``t``'s picture is split rank 0's shifted by ``t`` chunks
        along the split axis and by ``t`` strides of the split coordinate in
        rank numbers (tp, or etp for experts). Returns ``None`` unless device
        locality is symmetric the same way (each target's own-device source
        is the shift of split rank 0's).
        """
        src, dst = self.src, self.dst
        axis = src.split_axis(leaf)
        degree = src.degree(leaf)
        src_stride, dst_stride = src.config.stride(axis), dst.config.stride(axis)
        world = src.config.world_size
        geometry_t0 = LeafGeometry(src, dst, path, self.alive_mask, self.covers, tp_coord=0)
        segs, rows = self._rows(geometry_t0)
        if geometry_t0.dst_classes:
            ranks = np.concatenate([r for r, _ in geometry_t0.dst_classes])
            prefer = np.concatenate(rows.prefer)
            shifts = np.arange(degree)[:, None]
            own = self.devices.src_on_device[ranks[None, :] + shifts * dst_stride]
            coord = self._src_axis_coord(axis)[own]
            if ((own != world) & (coord != shifts)).any():
                # a source of another split rank on a target's device: an untiled plan groups the
                # target with those beside the same pool, which split rank 0's picture cannot see
                return None
            back = np.where(coord == shifts, own - shifts * src_stride, world)
            if not np.array_equal(geometry_t0.class_of_src[back], np.broadcast_to(prefer, back.shape)):
                return None
        t0 = self._segment_table(segs, geometry_t0.pool_boxes)
        n_segments = len(segs)
        pools_per_rank = len(geometry_t0.pools)
        shape = src.physical_shape(leaf)
        ts = range(degree)
        segments = Segments(
            np.concatenate([t0.typ] * degree),
            np.concatenate([tp_shift(shape, leaf.layout.split, degree, t0.offsets, t) for t in ts]),
            np.concatenate([t0.sizes] * degree), np.concatenate([t0.dst_piece] * degree),
            np.concatenate([t0.volume] * degree),
            np.concatenate([np.where(t0.pools >= 0, t0.pools + t * pools_per_rank, -1) for t in ts],
                           axis=1),
            np.concatenate([t0.pieces] * degree, axis=1), np.concatenate([t0.kinds] * degree, axis=1),
            np.concatenate([t0.phase] * degree))
        tiled_rows = Rows(np.concatenate([rows.dst + t * dst_stride for t in ts]),
                          np.concatenate([rows.seg + t * n_segments for t in ts]),
                          np.concatenate([rows.pos] * degree), rows.unheld * degree, rows.prefer)
        pools = [pool + t * src_stride for t in ts for pool in geometry_t0.pools]
        member = np.zeros((max(len(pools), 1), world + 1), dtype=bool)
        for i, pool in enumerate(pools):
            member[i, pool] = True
        return tiled_rows, segments, pools, member

    def _src_axis_coord(self, axis: str) -> np.ndarray:
        """``[src world + 1]`` int64: each source rank's coordinate on ``axis`` (-1 for the sentinel)."""
        hit = self._axis_coord.get(axis)
        if hit is None:
            config = self.src.config
            coords = [getattr(config.coord(r), axis) for r in range(config.world_size)]
            hit = self._axis_coord[axis] = np.array(coords + [-1], dtype=np.int64)
        return hit

    def _static_choice(self, rows: Rows, segments: Segments, pools_live: list,
                       member: np.ndarray) -> Choice:
        """Sources that need no load: own device, a sole source on the host or anywhere.

        Args:
            rows, segments: the leaf's rows and segments.
            pools_live: per pool, its live ranks.
            member: ``[pools, src world + 1]`` bool, ``member[p, r]``: rank
                ``r`` is a live rank of pool ``p``.
        """
        dev = self.devices
        n, seg = len(rows.seg), rows.seg
        pools = segments.pools
        typ = segments.typ[seg]
        own = dev.src_on_device[rows.dst]
        src = np.full(n, STORE_RANK, dtype=np.int64)
        alt = np.zeros(n, dtype=np.int64)
        link = np.full(n, LOCAL, dtype=np.int8)
        undecided = typ == SegmentType.COPY
        for a in range(pools.shape[0]):
            pa = pools[a, seg]
            ok = undecided & (pa >= 0) & member[np.maximum(pa, 0), own]
            src[ok], alt[ok] = own[ok], a
            undecided &= ~ok
        host = dev.dst_host[rows.dst]
        counts, first = self._host_tables(pools_live)
        p0 = np.maximum(pools[0, seg], 0)
        on_host = counts[p0, host]
        single = undecided & (on_host == 1)
        src[single], link[single] = first[p0[single], host[single]], HOST
        multi = undecided & (on_host > 1)
        net = undecided & (on_host == 0)
        link[multi], link[net] = HOST, NETWORK
        sizes = np.array([len(pool) for pool in pools_live] or [0], dtype=np.int64)
        firsts = np.array([pool[0] if len(pool) else STORE_RANK for pool in pools_live] or [0],
                          dtype=np.int64)
        sole = net & (sizes[p0] == 1)  # one live replica: nothing to choose
        src[sole] = firsts[p0[sole]]
        net &= ~sole
        host_groups = []
        for key in np.unique(p0[multi] * dev.n_hosts + host[multi]).tolist():
            p, h = divmod(key, dev.n_hosts)
            live = pools_live[p]
            host_groups.append((live[dev.src_host[live] == h],
                                np.nonzero(multi & (p0 == p) & (host == h))[0]))
        net_groups = [(pools_live[p], np.nonzero(net & (p0 == p))[0])
                      for p in np.unique(p0[net]).tolist()]
        missing = typ == SegmentType.MISSING
        link[missing] = STORE
        has_host = np.zeros(n, dtype=bool)
        for a in range(pools.shape[0]):
            pa = pools[a, seg]
            has_host |= (pa >= 0) & (counts[np.maximum(pa, 0), host] > 0)
        counted = self.part[0][rows.dst] if self.part is not None else True
        lb_net = int(segments.volume[seg][(undecided | missing) & ~has_host & counted].sum()) if n else 0
        return Choice(src, alt, link, np.nonzero(single | sole)[0], host_groups, net_groups,
                      np.nonzero(missing)[0], lb_net)

    def _host_tables(self, pools_live: list) -> tuple[np.ndarray, np.ndarray]:
        """``[pools, hosts]``: live ranks of each pool on each host, and the lowest of them."""
        dev = self.devices
        counts = np.zeros((max(len(pools_live), 1), dev.n_hosts), dtype=np.int64)
        first = np.full((max(len(pools_live), 1), dev.n_hosts), STORE_RANK, dtype=np.int64)
        for p, live in enumerate(pools_live):
            if len(live):
                hosts = dev.src_host[live]
                np.add.at(counts[p], hosts, 1)
                first[p, hosts[::-1]] = live[::-1]  # the lowest rank on each host wins
        return counts, first


def _phase(box, piece) -> int:
    """Where ``box`` lies in ``piece``: sum over axes of relative offset / size, in 1/65536 turns."""
    turn = sum((o - p) / n for o, p, n in zip(box.offsets, piece.offsets, piece.sizes))
    return int(turn % 1 * 65536)


def _positions(prefer: np.ndarray) -> np.ndarray:
    """``[ranks]`` int64: each rank's position among the ranks of its class with the same
    own-device pool (``prefer``), in rank order: the targets that share a group of sources.

    A function of the whole class, so a partial plan deals its targets as the whole plan does.
    """
    order = np.argsort(prefer, kind="stable")
    sorted_prefer = prefer[order]
    starts = np.r_[0, np.nonzero(sorted_prefer[1:] != sorted_prefer[:-1])[0] + 1]
    first = np.repeat(starts, np.diff(np.r_[starts, len(prefer)]))
    out = np.empty(len(prefer), dtype=np.int64)
    out[order] = np.arange(len(prefer)) - first
    return out

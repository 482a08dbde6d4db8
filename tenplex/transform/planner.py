"""The planner: which piece of which tensor each target rank needs, and from where.

``make_plan(tree, src, dst, ...)`` returns a :class:`~tenplex.transform.plan.Plan`.
It does no I/O and touches no tensor data.

For every tensor leaf and every target rank, each piece the rank must hold
is covered, exactly once, by boxes of live source pieces
(:mod:`tenplex.transform.geometry`). Several sources may hold the same box
(dp and cp replicas, expert-dp replicas of an expert, tied embedding
copies). The choice among them:

1. a source on the target's own device: nothing moves;
2. else a source on the target's host; among several, one dealt out;
3. else one dealt out among the live sources anywhere.

Targets that need the same box from the same pool of replicas are dealt
out over the pool's live ranks (on the target's host, if any) round robin
(:func:`deal`): by their position among the targets that share that pool,
by where the box lies in the source piece, and by a turn that goes on from
leaf to leaf, so the busiest sender's bytes stay close to the even share
(``bench/plan_scale.py`` prints the busiest sender beside the even share).
Every choice is a function of the target, the leaf, the tree order and
the live ranks alone, never of what other targets were given, so a
process can plan only its own part: ``make_plan(..., ranks=R, senders=S)``
gives exactly the ops of the whole plan whose target is in ``R`` or whose
source is in ``S``, at a cost that grows with what those ranks hold.
Padding that only the target has becomes
FILL ops.
Boxes no live source holds raise :class:`~tenplex.errors.MissingDataError`,
or become STORE reads with ``store_fallback=True``.

Cost: geometry and every load-free choice are computed once per kind of
leaf (a :class:`~tenplex.transform.template.Template` per
:func:`~tenplex.transform.geometry.signature`), leaves of one template,
item size and deal turns share their op columns (the deal depends on the
turn only modulo each group's number of candidates), and the rest is
vectorized over target ranks, so planning GPT-3 175B from 1024 to 2048 ranks takes
seconds (``bench/plan_scale.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Iterable

import numpy as np

from tenplex.errors import ConfigError, MissingDataError, PlanError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.ranks import RankTable
from tenplex.ptree.region import Box
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, Scope, TensorLeaf
from tenplex.transform.assign import placement_bound
from tenplex.transform.geometry import signature
from tenplex.transform.placement import Placement
from tenplex.transform.plan import FILL_CODE, STORE_RANK, OpTable, PaddingChange, Plan, Totals, ValueOp
from tenplex.transform.template import (HOST, LOCAL, NETWORK, STORE, Choice, Devices,
                                        Segments, TemplateMaker)

__all__ = ["make_plan", "value_ops", "deal", "RULES"]

RULES = "tenplex.planner/3"
"""The version of the planner's rules (source choice, op order); change it with them.
Processes that plan their own parts compare it (:mod:`tenplex.transform.parts`)."""


def _given(sharding: Sharding | None, tree: PTree, config: ParallelConfig) -> Sharding | None:
    """A caller's sharding, checked to be ``tree``'s at ``config``."""
    if sharding is None:
        return None
    if sharding.config != config or (sharding.tree is not tree and sharding.tree != tree):
        raise PlanError(f"a sharding was given for {sharding.config}, but the plan's config is {config} "
                        f"(or its tree differs)")
    return sharding


def make_plan(tree: PTree, src: ParallelConfig, dst: ParallelConfig, *,
              src_placement: Placement | None = None, dst_placement: Placement | None = None,
              alive: Iterable[int] | None = None, store_fallback: bool = False,
              src_sharding: Sharding | None = None, dst_sharding: Sharding | None = None,
              ranks: Iterable[int] | None = None, senders: Iterable[int] | None = None,
              bound: bool = False) -> Plan:
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
        src_sharding, dst_sharding: the configs' geometry of ``tree`` where the caller already
            holds it (a reader's ``sharding``); built here otherwise. The plan carries both
            (:attr:`Plan.shardings`), so executors and writers build none.
        ranks: plan only the ops whose target rank is in ``ranks`` (a
            partial plan; ``None`` with ``senders=None``: the whole plan).
        senders: also plan the ops whose source rank is in ``senders`` (the
            sends of a live transfer's process).
        bound: also compute ``totals.placement_bound``, the bytes no
            placement can avoid moving (whole plans only;
            :func:`~tenplex.transform.assign.placement_bound`, which costs
            more than the plan at thousands of ranks).

    Returns:
        The plan; the same inputs give the same plan, byte for byte. A
        partial plan's ops are the whole plan's ops that it selects, in the
        same order; its value ops are those of ``ranks``, and its totals
        count the ops and bounds of the targets in ``ranks`` only, so that
        the totals of partial plans over disjoint ``ranks`` add up to the
        whole plan's (but ``max_sender``, which is the busiest sender to
        these targets).

    Raises:
        ConfigError: if either config cannot hold the tree, or a placement
            does not match its config.
        MissingDataError: if some box has no live source (and no store
            fallback); ``.missing`` maps leaf paths to the boxes. A partial
            plan raises it only for the boxes of its targets.
    """
    src_placement = src_placement or Placement.contiguous(src.world_size)
    dst_placement = dst_placement or Placement.contiguous(dst.world_size)
    src_placement.check(src.world_size, "source")
    dst_placement.check(dst.world_size, "target")
    alive_set = set(range(src.world_size)) if alive is None else set(alive)
    if not alive_set <= set(range(src.world_size)):
        raise ConfigError(f"alive ranks {sorted(alive_set - set(range(src.world_size)))} "
                          f"are not ranks of {src}")
    part = _part(src, dst, ranks, senders)
    with _gc_paused():
        S, D = _given(src_sharding, tree, src) or Sharding(tree, src), _given(dst_sharding, tree, dst) or Sharding(tree, dst)
        builder = _Builder(tree, S, D, src_placement, dst_placement, alive_set, store_fallback, part)
        for index, (path, leaf) in enumerate(tree.tensors()):
            builder.leaf(index, path, leaf)
    if builder.missing:
        raise MissingDataError(missing_message(builder.missing), builder.missing)
    table = builder.table()
    totals = builder.totals(table)
    if bound and part is None:
        alive_mask = np.zeros(src.world_size + 1, dtype=bool)
        alive_mask[sorted(alive_set)] = True
        totals = dataclasses.replace(totals, placement_bound=placement_bound(tree, src, dst, alive_mask))
    wanted = None if part is None else np.nonzero(part[0])[0].tolist()
    return Plan(src, dst, src_placement, dst_placement, tuple(sorted(alive_set)), table,
                value_ops(tree, src, dst, alive_set, wanted), tuple(builder.padding), totals,
                ranks=None if part is None else tuple(wanted),
                senders=None if part is None else tuple(np.nonzero(part[1][:-1])[0].tolist()),
                shardings=(S, D))


def _part(src: ParallelConfig, dst: ParallelConfig, ranks, senders):
    """``(targets [dst world], senders [src world + 1])`` bool masks of a partial plan, or ``None``."""
    if ranks is None and senders is None:
        return None
    targets = np.zeros(dst.world_size, dtype=bool)
    sending = np.zeros(src.world_size + 1, dtype=bool)
    for mask, given, config, what in ((targets, ranks, dst, "target"),
                                      (sending, senders, src, "source")):
        for r in given or ():
            if not (isinstance(r, (int, np.integer)) and 0 <= r < config.world_size):
                raise ConfigError(f"make_plan: {what} rank {r!r} is not a rank of {config}")
            mask[int(r)] = True
    return targets, sending


def deal(candidates: np.ndarray, pos: np.ndarray, phase: np.ndarray, turn: int) -> np.ndarray:
    """The source of each row among ``candidates``: a function of the row and its leaf alone.

    Row ``i`` gets ``candidates[(pos[i] + phase[i] * c / 65536 + turn) % c]``:
    a target's replicas go to successive sources; targets that need other
    parts of one source piece (a tp merge) start at other sources; and
    ``turn`` (:meth:`_Builder._turn`) starts each leaf where the last leaf of
    its kind left off, so the leaves of a kind (a weight, its optimizer
    states, the same weight in the next layer) take turns over the replicas. No choice depends on what other
    targets were given, so a process can plan its own part alone and get the
    whole plan's choices.

    Args:
        candidates: ``[c]`` int64 live source ranks that hold the rows' box
            (ascending).
        pos: ``[rows]`` int64, each row's target's position among its replicas.
        phase: ``[rows]`` int64, where the row's box lies in its source
            piece, in 1/65536 turns.
        turn: the leaf's turn (see above).

    Returns:
        ``[rows]`` int64 source ranks.
    """
    n = len(candidates)
    return candidates[(pos + (phase * n >> 16) + turn) % n]


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


def missing_message(missing: dict) -> str:
    """The message of a :class:`MissingDataError` for ``{path: [Box, ...]}`` (three leaves named)."""
    items = [f"{path} {', '.join(str(b) for b in boxes[:2])}{' ...' if len(boxes) > 2 else ''}"
             for path, boxes in list(missing.items())[:3]]
    more = f"; and {len(missing) - 3} more leaves" if len(missing) > 3 else ""
    return (f"{len(missing)} leaves have regions that no live source holds: "
            + "; ".join(items) + more)


def value_ops(tree: PTree, src: ParallelConfig, dst: ParallelConfig, alive: set,
              ranks: list | None = None) -> tuple:
    """Value-leaf ops of target ``ranks`` (default all; ``alive``: the source ranks that can serve
    values), as :attr:`Plan.values` holds them, by target rank, then tree order: a target keeps
    its own value where its rank is live and holds the same key, else takes the lowest live
    rank's with it (``STORE_RANK``: none). Process 0 of a reshard under torchrun, which planned
    its own part, completes every rank's values with this alone.

    The lowest live rank with a key is found on coordinate arrays
    (:class:`~tenplex.ptree.ranks.RankTable`), so a partial plan costs no loop over the world.
    """
    ops = []
    targets = range(dst.world_size) if ranks is None else ranks
    live = np.zeros(src.world_size, dtype=bool)
    live[sorted(alive)] = True
    table = None
    for path, leaf in tree.values():
        keys = {rank: leaf.key(dst, rank) for rank in targets}
        if table is None and leaf.scope is Scope.COORD:
            table = RankTable(src)
        first = {key: _first_holder(leaf, key, live, table) for key in set(keys.values())}
        for rank, key in keys.items():
            same = rank in alive and leaf.key(src, rank) == key
            ops.append(ValueOp(path, rank, rank if same else first[key]))
    ops.sort(key=lambda op: op.dst_rank)
    return tuple(ops)


def _first_holder(leaf, key: str, live: np.ndarray, table) -> int:
    """The lowest live source rank whose value of ``leaf`` has ``key`` (``STORE_RANK``: none).

    Keys are ``""`` (global), ``"rank=3"`` or ``"tp=1,pp=0"`` (:meth:`ValueLeaf.key`).
    """
    if leaf.scope is Scope.RANK:
        r = int(key.partition("=")[2])
        return r if r < len(live) and live[r] else STORE_RANK
    mask = live.copy()
    if leaf.scope is Scope.COORD:
        for item in key.split(","):
            axis, _, value = item.partition("=")
            mask &= table.coord[axis] == int(value)
    return int(np.argmax(mask)) if mask.any() else STORE_RANK


class _Builder:
    """Emits every leaf's ops, making the load-dependent source choices as it goes.

    Args:
        tree: the tree spec.
        src_sharding, dst_sharding: the tree under the source and target configs.
        src_pl, dst_pl: where the source and target ranks run.
        alive: the live source ranks.
        store_fallback: plan regions no live rank holds as STORE reads.
        part: ``(targets, senders)`` masks of a partial plan (see :func:`_part`), or ``None``.
    """

    def __init__(self, tree, src_sharding: Sharding, dst_sharding: Sharding, src_pl: Placement,
                 dst_pl: Placement, alive: set, store_fallback: bool, part=None):
        self.tree = tree
        self.src_sharding, self.dst_sharding = src_sharding, dst_sharding
        self.store_fallback = store_fallback
        ws = src_sharding.config.world_size
        alive_mask = np.zeros(ws + 1, dtype=bool)
        alive_mask[sorted(alive)] = True
        devices = _devices(src_pl, dst_pl, alive_mask)
        ndim = max((len(l.shape) for _, l in tree.tensors()), default=0)
        self.maker = TemplateMaker(src_sharding, dst_sharding, alive_mask, devices, ndim, part)
        self.part = part
        self.sides = () if part is None else (  # (sharding, coords of the part's ranks) per side
            (dst_sharding, [dst_sharding.config.coord(r) for r in np.nonzero(part[0])[0].tolist()]),
            (src_sharding, [src_sharding.config.coord(r) for r in np.nonzero(part[1][:-1])[0].tolist()]))
        self.kinds: dict = {}  # (shape, split, itemsize) -> [cursor at first sight, widths since]
        self.cursor = 0  # the widths of the leaves so far (see _turn)
        self.near_stage: dict = {}  # Stage -> whether a rank of the part runs it
        self.templates: dict = {}
        self.signatures: dict = {}  # TensorLeaf -> its signature
        self.stamps: dict = {}  # (signature, item size, turns) -> columns (see leaf)
        self.columns: list[tuple] = []  # per leaf: (its index, its ops' OpTable columns but path)
        self.missing: dict[str, list[Box]] = {}
        self.padding: list[PaddingChange] = []
        self.lower_bound = self.lower_bound_network = 0  # bytes
        self.paths: list[str] = []
        self.ndims: list[int] = []

    # -- per leaf ----------------------------------------------------------
    def leaf(self, index: int, path: str, leaf: TensorLeaf) -> None:
        """Emit the ops of tensor leaf ``path`` (number ``index`` in tree order).

        Leaves of one kind share a :class:`~tenplex.transform.template.Template`
        (made on first sight); this adds the leaf's bytes to the lower
        bounds, records padding changes and missing regions, and chooses the
        sources left to load.
        """
        self.paths.append(path)
        self.ndims.append(len(leaf.shape))
        if leaf.layout.padding is not None:
            src_shape = self.src_sharding.physical_shape(leaf)
            dst_shape = self.dst_sharding.physical_shape(leaf)
            if src_shape != dst_shape:
                axis = leaf.layout.padding.axis
                self.padding.append(PaddingChange(path, axis, leaf.shape[axis], src_shape[axis],
                                                  dst_shape[axis]))
        turn = self._turn(leaf)
        if self.part is not None and not self._wanted(path, leaf):
            return  # none of the part's targets holds it, none of its senders: no op of the part
        key = self.signatures.get(leaf)
        if key is None:  # equal leaves (another layer's same weight) have equal signatures
            key = self.signatures[leaf] = signature(self.src_sharding, self.dst_sharding, leaf)
        template = self.templates.get(key)
        if template is None:
            template = self.templates[key] = self.maker.make(path, leaf)
        rows, segments, choice = template.rows, template.segments, template.choice
        itemsize = leaf.itemsize
        self.lower_bound += rows.unheld * itemsize
        self.lower_bound_network += choice.lb_net_volume * itemsize
        missing = choice.missing_rows
        if self.part is not None and len(missing):
            missing = missing[self.part[0][rows.dst[missing]]]
        if len(missing) and not self.store_fallback:
            boxes = self.missing.setdefault(path, [])
            for s in dict.fromkeys(rows.seg[missing].tolist()):
                boxes.append(_box(segments, s, len(leaf.shape)))
            return
        # the leaf's columns but its path are a function of its template, item size and the
        # turn modulo each deal's number of candidates: leaves that agree on these share them
        stamp = (key, itemsize, tuple(turn % len(c) for c, _ in choice.host_groups + choice.net_groups))
        cols = self.stamps.get(stamp)
        if cols is None:
            src = self._choose(choice, rows.pos, segments.phase[rows.seg], turn)
            keep = slice(None)
            if self.part is not None:
                keep = np.nonzero(self.part[0][rows.dst] | self.part[1][src])[0]
            seg, alt = rows.seg[keep], choice.alt[keep]
            cols = self.stamps[stamp] = {
                "dst": rows.dst[keep], "src": src[keep], "offsets": segments.offsets[seg],
                "sizes": segments.sizes[seg], "src_piece": segments.pieces[alt, seg],
                "dst_piece": segments.dst_piece[seg], "nbytes": segments.volume[seg] * itemsize,
                "kind": segments.kinds[alt, seg], "link": choice.link[keep]}
        self.columns.append((index, cols))

    def _turn(self, leaf: TensorLeaf) -> int:
        """The leaf's turn in :func:`deal`, a round robin over the replicas that goes on from
        leaf to leaf, as a least-loaded deal would, without looking at any other target.

        Each leaf advances a cursor by its width: the target ranks that hold each of its pieces
        (``dp * cp`` target ranks for a dense leaf, ``edp`` for an expert's, one for a dp-sharded
        buffer's), so the next leaf's targets start at the replica after the last one used. The
        turn of a leaf is the cursor where its kind (shape, tp split and dtype) was first seen,
        plus the widths of the leaves of its kind before it: leaves of a kind need the same
        bytes from the same places of their pieces and take turns over the replicas; other
        kinds start elsewhere. Every leaf counts, whether or not a partial plan emits its
        ops (a dictionary update per leaf).
        """
        dst, layout = self.dst_sharding.config, leaf.layout
        width = 1 if layout.dp_shard is not None else dst.edp if layout.expert is not None \
            else dst.dp * dst.cp
        key = (leaf.shape, layout.split, leaf.itemsize)
        seen = self.kinds.get(key)
        if seen is None:
            seen = self.kinds[key] = [self.cursor, 0]
        turn = seen[0] + seen[1]
        seen[1] += width
        self.cursor += width
        return turn

    def _wanted(self, path: str, leaf: TensorLeaf) -> bool:
        """Whether a target rank of the part holds ``path`` under the target config, or a
        sender under the source config (a partial plan skips every other leaf).

        Leaves of a stage none of the part's ranks runs are skipped on one look-up per stage,
        so the cost per skipped leaf is a dictionary read.
        """
        stage = leaf.layout.stage
        near = self.near_stage.get(stage)
        if near is None:
            near = self.near_stage[stage] = any(
                c.pp in sharding.stages(leaf) for sharding, coords in self.sides for c in coords)
        return near and any(sharding.holding(path, c) is not None
                            for sharding, coords in self.sides for c in coords)

    @staticmethod
    def _choose(choice: Choice, pos: np.ndarray, phase: np.ndarray, turn: int) -> np.ndarray:
        """Source ranks for every row: the static choices, then each group's rows dealt out.

        Args:
            choice: the template's static choices.
            pos: ``[rows]`` int64, each row's target's position among its replicas.
            phase: ``[rows]`` int64, where each row's box lies in its source piece.
            turn: the leaf's turn (:meth:`_turn`).
        """
        src = choice.src.copy()
        for candidates, rows in choice.host_groups + choice.net_groups:
            src[rows] = deal(candidates, pos[rows], phase[rows], turn)
        return src

    # -- results ---------------------------------------------------------------
    def table(self) -> OpTable:
        """Every leaf's ops in one table, ordered by target rank (stable: tree order within)."""
        if not self.columns:
            return OpTable.empty(self.paths, self.ndims)
        cols = {k: np.concatenate([c[k] for _, c in self.columns]) for k in OpTable.COLUMNS if k != "path"}
        cols["path"] = np.repeat(np.array([i for i, _ in self.columns], dtype=np.int32),
                                 [len(c["dst"]) for _, c in self.columns])
        order = np.argsort(cols["dst"], kind="stable")
        dtypes = {"path": np.int32, "dst": np.int32, "src": np.int32, "src_piece": np.int32,
                  "dst_piece": np.int32, "nbytes": np.int64, "kind": np.int8, "link": np.int8,
                  "offsets": np.int64, "sizes": np.int64}
        cols = {k: np.ascontiguousarray(v[order].astype(dtypes[k], copy=False))
                for k, v in cols.items()}
        return OpTable(self.paths, self.ndims, cols)

    def totals(self, table: OpTable) -> Totals:
        """Bytes by link, FILL bytes, the busiest sender and the lower bounds, in bytes.

        A partial plan's totals count the ops of its targets only.
        """
        c = table.cols
        if self.part is not None:
            mine = self.part[0][c["dst"]]
            c = {k: c[k][mine] for k in ("kind", "link", "nbytes", "src")}
        fill = c["kind"] == FILL_CODE
        by_link = np.bincount(c["link"][~fill], weights=c["nbytes"][~fill], minlength=4)
        moved = (c["link"] != LOCAL) & (c["link"] != STORE)
        sent = np.bincount(c["src"][moved], weights=c["nbytes"][moved]) if moved.any() else [0]
        return Totals(needed=int(c["nbytes"][~fill].sum()), local=int(by_link[LOCAL]),
                      host=int(by_link[HOST]), network=int(by_link[NETWORK]),
                      store=int(by_link[STORE]), fill=int(c["nbytes"][fill].sum()),
                      lower_bound=self.lower_bound, lower_bound_network=self.lower_bound_network,
                      max_sender=int(max(sent)))


def _devices(src_pl: Placement, dst_pl: Placement, alive_mask: np.ndarray) -> Devices:
    """Where both configs' ranks run, as arrays (:class:`Devices`): by arithmetic for two
    contiguous placements of one rule, else from the devices (~20 ms at 16384 ranks)."""
    devices = _contiguous_devices(src_pl, dst_pl, alive_mask)
    if devices is not None:
        return devices
    ws = len(src_pl.devices)
    hosts = sorted({d.host for d in src_pl.devices} | {d.host for d in dst_pl.devices})
    host_id = {h: i for i, h in enumerate(hosts)}
    on_device = {d: r for r, d in enumerate(src_pl.devices) if alive_mask[r]}
    return Devices(
        src_host=np.array([host_id[d.host] for d in src_pl.devices], dtype=np.int64),
        dst_host=np.array([host_id[d.host] for d in dst_pl.devices], dtype=np.int64),
        src_on_device=np.array([on_device.get(d, ws) for d in dst_pl.devices], dtype=np.int64),
        n_hosts=len(hosts))


def _contiguous_devices(src_pl: Placement, dst_pl: Placement, alive_mask: np.ndarray):
    """:class:`Devices` of two placements that :meth:`Placement.contiguous` made with the same
    ``per_host`` and ``first`` (rank ``r`` of both on one device), by arithmetic; else ``None``.

    Host ids are then the host numbers, as the general path's sorted host names would not be
    (``h10`` sorts before ``h2``), but only equality of host ids is ever used.
    """
    rule = src_pl.contiguous_rule()
    if rule is None or rule != dst_pl.contiguous_rule():
        return None
    per_host, first = rule
    ws, wd = len(src_pl), len(dst_pl)
    dst = np.arange(wd, dtype=np.int64)
    own = np.where((dst < ws) & alive_mask[np.minimum(dst, ws)], dst, ws)
    devices = Devices(src_host=(np.arange(ws, dtype=np.int64) + first) // per_host,
                      dst_host=(dst + first) // per_host, src_on_device=own,
                      n_hosts=(max(ws, wd) + first - 1) // per_host + 1 if max(ws, wd) else 0)
    return devices


def _box(segments: Segments, s: int, ndim: int) -> Box:
    return Box(tuple(int(v) for v in segments.offsets[s, :ndim]),
               tuple(int(v) for v in segments.sizes[s, :ndim]))

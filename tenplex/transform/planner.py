"""The planner: which piece of which tensor each target rank needs, and from where.

``make_plan(tree, src, dst, ...)`` returns a :class:`~tenplex.transform.plan.Plan`.
It does no I/O and touches no tensor data.

For every tensor leaf and every target rank, each piece the rank must hold
is covered, exactly once, by boxes of live source pieces
(:mod:`tenplex.transform.geometry`). Several sources may hold the same box
(dp and cp replicas, expert-dp replicas of an expert, tied embedding
copies). The choice among them:

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

Cost: geometry and every load-free choice are computed once per kind of
leaf (a :class:`~tenplex.transform.template.Template` per
:func:`~tenplex.transform.geometry.signature`) and the rest is vectorized
over target ranks, so planning GPT-3 175B from 1024 to 2048 ranks takes
seconds (``bench/plan_scale.py``).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterable

import numpy as np

from tenplex.errors import ConfigError, MissingDataError, PlanError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.region import Box
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, TensorLeaf
from tenplex.transform.geometry import signature
from tenplex.transform.placement import Placement
from tenplex.transform.plan import FILL_CODE, STORE_RANK, OpTable, PaddingChange, Plan, Totals, ValueOp
from tenplex.transform.template import (HOST, LOCAL, NETWORK, STORE, Choice, Devices,
                                        Segments, TemplateMaker)

__all__ = ["make_plan"]


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
              src_sharding: Sharding | None = None, dst_sharding: Sharding | None = None) -> Plan:
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
        S, D = _given(src_sharding, tree, src) or Sharding(tree, src), _given(dst_sharding, tree, dst) or Sharding(tree, dst)
        builder = _Builder(tree, S, D, src_placement, dst_placement, alive_set, store_fallback)
        for index, (path, leaf) in enumerate(tree.tensors()):
            builder.leaf(index, path, leaf)
    if builder.missing:
        raise MissingDataError(_missing_message(builder.missing), builder.missing)
    table = builder.table()
    return Plan(src, dst, src_placement, dst_placement, tuple(sorted(alive_set)), table,
                _value_ops(tree, src, dst, alive_set), tuple(builder.padding),
                builder.totals(table), shardings=(S, D))


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


class _Builder:
    """Emits every leaf's ops, making the load-dependent source choices as it goes.

    Args:
        tree: the tree spec.
        src_sharding, dst_sharding: the tree under the source and target configs.
        src_pl, dst_pl: where the source and target ranks run.
        alive: the live source ranks.
        store_fallback: plan regions no live rank holds as STORE reads.
    """

    def __init__(self, tree, src_sharding: Sharding, dst_sharding: Sharding, src_pl: Placement,
                 dst_pl: Placement, alive: set, store_fallback: bool):
        self.tree = tree
        self.src_sharding, self.dst_sharding = src_sharding, dst_sharding
        self.store_fallback = store_fallback
        ws = src_sharding.config.world_size
        alive_mask = np.zeros(ws + 1, dtype=bool)
        alive_mask[sorted(alive)] = True
        hosts = sorted({d.host for d in src_pl.devices} | {d.host for d in dst_pl.devices})
        host_id = {h: i for i, h in enumerate(hosts)}
        on_device = {d: r for r, d in enumerate(src_pl.devices) if r in alive}
        devices = Devices(
            src_host=np.array([host_id[d.host] for d in src_pl.devices], dtype=np.int64),
            dst_host=np.array([host_id[d.host] for d in dst_pl.devices], dtype=np.int64),
            src_on_device=np.array([on_device.get(d, ws) for d in dst_pl.devices], dtype=np.int64),
            n_hosts=len(hosts))
        ndim = max((len(l.shape) for _, l in tree.tensors()), default=0)
        self.maker = TemplateMaker(src_sharding, dst_sharding, alive_mask, devices, ndim)
        self.loads = np.zeros(ws + 1, dtype=np.int64)
        self.templates: dict = {}
        self.columns: list[dict] = []  # per leaf: its ops' OpTable columns
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
        src_shape = self.src_sharding.physical_shape(leaf)
        dst_shape = self.dst_sharding.physical_shape(leaf)
        if leaf.layout.padding is not None and src_shape != dst_shape:
            axis = leaf.layout.padding.axis
            self.padding.append(PaddingChange(path, axis, leaf.shape[axis], src_shape[axis],
                                              dst_shape[axis]))
        key = signature(self.src_sharding, self.dst_sharding, leaf)
        template = self.templates.get(key)
        if template is None:
            template = self.templates[key] = self.maker.make(path, leaf)
        rows, segments, choice = template.rows, template.segments, template.choice
        itemsize = leaf.itemsize
        self.lower_bound += rows.unheld * itemsize
        self.lower_bound_network += choice.lb_net_volume * itemsize
        if len(choice.missing_rows) and not self.store_fallback:
            boxes = self.missing.setdefault(path, [])
            for s in dict.fromkeys(rows.seg[choice.missing_rows].tolist()):
                boxes.append(_box(segments, s, len(leaf.shape)))
            return
        nbytes = segments.volume[rows.seg] * itemsize
        src = self._choose(choice, nbytes)
        self.columns.append({
            "path": np.full(len(rows.seg), index, dtype=np.int32),
            "dst": rows.dst, "src": src, "offsets": segments.offsets[rows.seg],
            "sizes": segments.sizes[rows.seg], "src_piece": segments.pieces[choice.alt, rows.seg],
            "dst_piece": segments.dst_piece[rows.seg], "nbytes": nbytes,
            "kind": segments.kinds[choice.alt, rows.seg], "link": choice.link,
        })

    def _choose(self, choice: Choice, nbytes: np.ndarray) -> np.ndarray:
        """Source ranks for every row: the static choices, then each group dealt out by load.

        Args:
            choice: the template's static choices.
            nbytes: ``[rows]`` int64, each row's bytes for this leaf's dtype.
        """
        src = choice.src.copy()
        loads = self.loads
        if len(choice.static_moved):
            np.add.at(loads, src[choice.static_moved], nbytes[choice.static_moved])
        for candidates, rows in choice.host_groups + choice.net_groups:
            order = np.lexsort((candidates, loads[candidates]))
            chosen = candidates[order][np.arange(len(rows)) % len(candidates)]
            src[rows] = chosen
            np.add.at(loads, chosen, nbytes[rows])
        return src

    # -- results ---------------------------------------------------------------
    def table(self) -> OpTable:
        """Every leaf's ops in one table, ordered by target rank (stable: tree order within)."""
        if not self.columns:
            return OpTable.empty(self.paths, self.ndims)
        cols = {k: np.concatenate([c[k] for c in self.columns]) for k in OpTable.COLUMNS}
        order = np.argsort(cols["dst"], kind="stable")
        dtypes = {"path": np.int32, "dst": np.int32, "src": np.int32, "src_piece": np.int32,
                  "dst_piece": np.int32, "nbytes": np.int64, "kind": np.int8, "link": np.int8,
                  "offsets": np.int64, "sizes": np.int64}
        cols = {k: np.ascontiguousarray(v[order].astype(dtypes[k], copy=False))
                for k, v in cols.items()}
        return OpTable(self.paths, self.ndims, cols)

    def totals(self, table: OpTable) -> Totals:
        """Bytes by link, FILL bytes, the busiest sender and the lower bounds, in bytes."""
        c = table.cols
        fill = c["kind"] == FILL_CODE
        by_link = np.bincount(c["link"][~fill], weights=c["nbytes"][~fill], minlength=4)
        moved = (c["link"] != LOCAL) & (c["link"] != STORE)
        sent = np.bincount(c["src"][moved], weights=c["nbytes"][moved]) if moved.any() else [0]
        return Totals(needed=int(c["nbytes"][~fill].sum()), local=int(by_link[LOCAL]),
                      host=int(by_link[HOST]), network=int(by_link[NETWORK]),
                      store=int(by_link[STORE]), fill=int(c["nbytes"][fill].sum()),
                      lower_bound=self.lower_bound, lower_bound_network=self.lower_bound_network,
                      max_sender=int(max(sent)))


def _box(segments: Segments, s: int, ndim: int) -> Box:
    return Box(tuple(int(v) for v in segments.offsets[s, :ndim]),
               tuple(int(v) for v in segments.sizes[s, :ndim]))

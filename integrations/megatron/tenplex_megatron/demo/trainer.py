"""The demo's worker: one job process that trains a megatron-core GPT through the runs' phases.

Every run (the elastic one, then the two static ones) is a list of phases.
A run starts from the same global step-0 state at its first config; between
phases the job moves with :func:`tenplex_megatron.live.change` (export,
``tenplex.reconfigure``, new ``parallel_state``, rebuild, import). When a
phase needs fewer workers, the others are parked until a later phase needs
them (:class:`~tenplex_megatron.live.group.Membership`).

Records put on the queue (rank 0 only, except ``done`` and ``error``):
``("step", run, phase, step, loss, sample ids)``,
``("reconfig", run, phase, seconds, transfer seconds, sent bytes, lower bound)``,
``("done", process)`` and ``("error", process, type name, last message line, traceback, where)``.
"""

from __future__ import annotations

import datetime

import torch

__all__ = ["run_worker"]


def run_worker(process: int, port: int, runs: list, cfg_json: dict, opts_json: dict, corpus_bytes: int,
               queue) -> None:
    """Run every ``(name, phases)`` of ``runs`` as job process ``process``; report through ``queue``."""
    import warnings

    # megatron-core warns at import that Apex and TransformerEngine are missing (expected on CPU);
    # the demo's output is its own lines and, on failure, the one line of the error
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    where = {"run": None, "phase": 0}
    try:
        from tenplex_megatron import cpu_shim

        cpu_shim.apply_optimizer_patches()
        torch.set_num_threads(1)
        _run_all(process, port, runs, cfg_json, opts_json, corpus_bytes, queue, where)
        queue.put(("done", process))
    except BaseException as exc:
        from tenplex_megatron.demo.workers import report_error

        report_error(queue, process, exc, f"run {where['run']}, phase {where['phase'] + 1}"
                     if where["run"] else "")
        raise SystemExit(1) from None


def _run_all(process, port, runs, cfg_json, opts_json, corpus_bytes, queue, where: dict) -> None:
    import torch.distributed as dist

    from tenplex_megatron.model.config import MegatronConfig
    from tenplex_megatron.demo.data import load_corpus
    from tenplex_megatron.demo.job import JobOptions
    from tenplex_megatron.live.group import Membership

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    membership = Membership(store, process, timeout=datetime.timedelta(seconds=300))
    cfg, opts = MegatronConfig.from_json(cfg_json), JobOptions(**opts_json)
    corpus = load_corpus(opts.seq, corpus_bytes, opts.seed)
    for name, phases in runs:
        where.update(run=name, phase=0)
        _run(membership, name, phases, cfg, opts, corpus, queue, where)


def _start(cfg, opts, config):
    """Parts at ``config`` holding the same global step-0 state at any config."""
    import torch.distributed as dist

    from tenplex.ptree.shards import materialize
    from tenplex_megatron.demo.job import build, initial_state, live_spec
    from tenplex_megatron.live.group import init_parallel_state
    from tenplex_megatron.live.state import import_state

    spec = live_spec(cfg, opts)
    tree = spec.tree(config)
    init_parallel_state(config, opts.seed)
    parts = build(cfg, opts, config)
    import_state(materialize(tree, initial_state(tree, opts.seed), config, dist.get_rank()), *parts,
                 spec=spec, tree=tree)
    return parts


def _run(membership, name: str, phases: list, cfg, opts, corpus, queue, where: dict) -> None:
    from tenplex_megatron.demo.job import build, live_spec, train_step
    from tenplex_megatron.live.change import change
    from tenplex_megatron.live.group import destroy_parallel_state

    spec = live_spec(cfg, opts)
    first = phases[0].config
    parts = _start(cfg, opts, first) if membership.form(first.world_size) else None
    consumed, step, me = 0, 0, membership.process
    for index, phase in enumerate(phases):
        where["phase"] = index
        if index:
            done = change(parts, lambda c: build(cfg, opts, c), spec=spec, old=phases[index - 1].config,
                          new=phase.config, consumed_samples=consumed if parts else None, seed=opts.seed,
                          membership=membership)
            parts = done.parts
            if me == 0:
                queue.put(("reconfig", name, index, done.seconds, done.report.seconds, done.report.sent,
                           done.report.lower_bound, done.report.placement_bound))
            if parts is not None:
                consumed = done.imported.consumed_samples
        if parts is not None:
            for _ in range(phase.steps):
                loss, idx = train_step(parts, corpus, consumed, opts)
                consumed += opts.global_batch
                step += 1
                if membership.rank == 0:  # renumbered groups: process 0 may be parked
                    queue.put(("step", name, index, step, loss, idx))
    if parts is not None:
        parts = None
        destroy_parallel_state()
    membership.leave()

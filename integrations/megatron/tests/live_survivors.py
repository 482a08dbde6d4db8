"""Workers for the survivors-alone test (issue 24): no replacement, then a newcomer grows the world back.

Four processes train a real megatron-core GPT (fp32, DDP, DistributedOptimizer)
at ``CONFIG``, checkpointing every ``EVERY`` steps. Process ``KILL`` SIGKILLs
itself as step ``DURING`` starts. The three survivors call
``live.rebuild_after_failure(..., replaced=())`` onto ``ALONE`` (two processes; the third
survivor is parked), train to step ``GROW_AFTER``, then a newcomer (a fresh
process that never formed a group) joins and ``live.change`` grows the world
back to ``BACK``; all train to ``STEPS``. Results are JSON files in ``out``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import traceback

from tenplex.ptree.config import ParallelConfig

import live_workers as w

CONFIG, ALONE, BACK = "dp=2,tp=2,pp=1", "dp=1,tp=2,pp=1", "dp=2,tp=2,pp=1"
KILL, DURING, GROW_AFTER, STEPS, EVERY = 1, 3, 4, 6, 2
NEWCOMER = 3
"""The newcomer's process number: after the recovery the survivors are 0, 1, 2."""


def model():
    return dataclasses.replace(w.MODEL, params_dtype="float32")


def _job():
    from tenplex_megatron.demo.data import load_corpus
    from tenplex_megatron.demo.job import build, live_spec

    cfg, opts = model(), w.options(True)
    return cfg, opts, live_spec(cfg, opts), (lambda c: build(cfg, opts, c)), load_corpus(opts.seq, 1 << 20, w.SEED)


def checkpoint(out: str, step: int) -> str:
    return os.path.join(out, f"ckpt-{step}")


def _start(config, steps: int):
    """Fresh parts at ``config`` from the step-0 state, then ``steps`` steps: ``(parts, losses)``."""
    import torch.distributed as dist
    from tenplex.ptree.shards import materialize
    from tenplex_megatron.demo.job import initial_state, train_step
    from tenplex_megatron.live.state import import_state

    _, opts, spec, build, corpus = _job()
    tree = spec.tree(config)
    parts = build(config)
    import_state(materialize(tree, initial_state(tree, w.SEED), config, dist.get_rank()), *parts,
                 spec=spec, tree=tree)
    return parts, [train_step(parts, corpus, k * opts.global_batch, opts)[0] for k in range(steps)]


def _log(out, process, text):
    import time
    with open(os.path.join(out, f"log-{process}.txt"), "a") as f:
        f.write(f"{time.time():.2f} {text}\n")


def _guarded(fn, out: str, tag: str, *args) -> None:
    try:
        fn(*args)
    except BaseException:
        w.write(out, f"error-{tag}", traceback.format_exc())
        raise


def survivor(process: int, port: int, out: str) -> None:
    _guarded(_survivor, out, f"process-{process}", process, port, out)


def newcomer(port: int, out: str) -> None:
    _guarded(_newcomer, out, "newcomer", port, out)


def _train(parts, first: int, last: int, consumed: int, losses: dict) -> int:
    from tenplex_megatron.demo.job import train_step

    _, opts, _, _, corpus = _job()
    for step in range(first, last + 1):
        losses[step] = train_step(parts, corpus, consumed, opts)[0]
        consumed += opts.global_batch
    return consumed


def _survivor(process: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from tenplex_megatron import live
    from tenplex_megatron.demo.job import train_step

    _, opts, spec, build, corpus = _job()
    membership = w.setup(process, port)
    config, alone, back = (ParallelConfig.parse(c) for c in (CONFIG, ALONE, BACK))
    membership.form(config.world_size, name="start")
    live.init_parallel_state(config, w.SEED)
    reference = _start(config, STEPS)[1]        # the run without a failure (its model is dropped)
    parts, losses, consumed, failure, seed, url = _start(config, 0)[0], {}, 0, None, w.SEED, None
    # the lines marked `# docs` are those docs/megatron.md shows (test_live_docs checks them)
    for step in range(1, STEPS + 1):
        if process == KILL and step == DURING:
            os.kill(os.getpid(), signal.SIGKILL)
        _log(out, process, f"step {step} start")
        failed = False                                                                        # docs
        try:                                                                                  # docs
            loss, _ = train_step(parts, corpus, consumed, opts)                               # docs
        except Exception:                                                                     # docs
            failed = True                                                                     # docs
        if failed:
            failure = {"step": step}
            break
        losses[step] = loss
        consumed += opts.global_batch
        _log(out, process, f"step {step} done")
        if step % EVERY == 0:
            url = checkpoint(out, step)
            live.save_checkpoint(parts, url, spec=spec, consumed_samples=consumed)            # docs
    _log(out, process, f"failure {failure}")
    if failed:                                                                                # docs
        state = live.export_state(*parts, spec=spec, consumed_samples=consumed)               # docs
        parts = None                                                                          # docs
        live.destroy_parallel_state()                                                         # docs
        membership.leave(abort=True)                                                          # docs
        lost = set(json.loads(membership.store.get("lost")))                                  # docs
        done = live.rebuild_after_failure(state, build, spec=spec, config=config, lost=lost, seed=seed,  # docs
                                          membership=membership, name="recovery-1", store=url, new=alone,
                                          replaced=())
        parts, config = done.parts, alone                                                     # docs
        if parts is not None:                                                                 # docs
            consumed = done.imported.consumed_samples                                         # docs
    after_recovery = membership.process
    if parts is not None:
        consumed = _train(parts, DURING, GROW_AFTER, consumed, losses)
    grown = live.change(parts, build, spec=spec, old=alone, new=back, consumed_samples=consumed if parts else None,
                        seed=w.SEED, membership=membership)
    _train(grown.parts, GROW_AFTER + 1, STEPS, grown.imported.consumed_samples, losses)
    if dist.get_rank() == 0:
        w.write(out, "survivors", {
            "reference": reference, "losses": losses, "failure": failure, "rolled_back_to": done.rolled_back_to,
            "store": done.report.store, "sent": done.report.sent, "step": done.imported.step,
            "grown_sent": grown.report.sent, "grown_lower_bound": grown.report.lower_bound})
    w.write(out, f"numbers-{process}", {"after_recovery": after_recovery, "rank": dist.get_rank(),
                                        "in_alone": done.parts is not None})
    grown = None
    live.destroy_parallel_state()
    membership.leave()


def _newcomer(port: int, out: str) -> None:
    import torch.distributed as dist
    from tenplex_megatron import live

    _, _, spec, build, _ = _job()
    membership = w.setup(NEWCOMER, port)     # a fresh Membership: no counter set by hand
    alone, back = ParallelConfig.parse(ALONE), ParallelConfig.parse(BACK)
    grown = live.change(None, build, spec=spec, old=alone, new=back, consumed_samples=None, seed=w.SEED,
                        membership=membership)
    losses: dict = {}
    _train(grown.parts, GROW_AFTER + 1, STEPS, grown.imported.consumed_samples, losses)
    w.write(out, "newcomer", {"losses": losses, "rank": dist.get_rank()})
    grown = None
    live.destroy_parallel_state()
    membership.leave()

"""Workers for the recovery test: a rank is SIGKILLed during training; survivors and a replacement go on.

Scenarios run one after another in the same processes (the replacement of one
scenario is an ordinary process in the next). In each, the processes first
train without a failure (the reference), then again with process ``kill``
killing itself as step ``during`` starts. The test process sees it die,
publishes the lost rank in the store and starts a replacement; survivors and
replacement call ``tenplex_megatron.live.rebuild_after_failure`` and train to the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import traceback
from typing import NamedTuple

from tenplex.ptree.config import ParallelConfig

import live_workers as w


class Scenario(NamedTuple):
    config: str
    distributed_optimizer: bool
    kill: int
    during: int
    every: int          # checkpoint every this many steps (0: never)
    steps: int = 6


SCENARIOS = [
    Scenario("dp=2,tp=2,pp=1", False, kill=3, during=4, every=0),   # replicas hold everything
    Scenario("dp=2,tp=1,pp=2", True, kill=2, during=5, every=2),    # lost optimizer shard from the step-4 checkpoint
    Scenario("dp=2,tp=1,pp=2", True, kill=1, during=4, every=2),    # checkpoint older than the survivors: back to it
]


def checkpoint(out: str, s: int, step: int) -> str:
    return os.path.join(out, f"ckpt-{s}-{step}")


def last_checkpoint(out: str, s: int, sc: Scenario):
    step = (sc.during - 1) // sc.every * sc.every if sc.every else 0
    return checkpoint(out, s, step) if step else None


def recovery(process: int, port: int, out: str, first: int, replacement: bool) -> None:
    try:
        _recovery(process, port, out, first, replacement)
    except BaseException:
        w.write(out, f"error-{process}-{first}", traceback.format_exc())
        raise


def _recovery(process: int, port: int, out: str, first: int, replacement: bool) -> None:
    membership = w.setup(process, port)
    for s in range(first, len(SCENARIOS)):
        _scenario(membership, out, s, replacement and s == first)


def _log(out, process, text):
    import time
    with open(os.path.join(out, f"log-{process}.txt"), "a") as f:
        f.write(f"{time.time():.2f} {text}\n")


def _scenario(membership, out: str, s: int, replacement: bool) -> None:
    """One scenario; the lines marked ``# docs`` are those docs/megatron.md shows (test_live_docs checks)."""
    import torch.distributed as dist
    from tenplex_megatron import live
    from tenplex_megatron.demo.data import load_corpus
    from tenplex_megatron.demo.job import build as build_parts, live_spec, train_step

    sc = SCENARIOS[s]
    config = ParallelConfig.parse(sc.config)
    opts = dataclasses.replace(w.options(), distributed_optimizer=sc.distributed_optimizer)
    spec, batch, seed, failures = live_spec(w.MODEL, opts), opts.global_batch, w.SEED, s
    build = lambda c: build_parts(w.MODEL, opts, c)
    corpus = load_corpus(opts.seq, 1 << 20, w.SEED)
    process, parts, state, losses, failure, consumed = membership.process, None, None, {}, None, 0
    if not replacement:
        membership.form(config.world_size, name=f"s{s}/start")
        live.init_parallel_state(config, seed)
        reference = w.start(config, corpus, sc.steps, opts=opts)[1]   # (its model is dropped)
        parts, _ = w.start(config, corpus, 0, opts=opts)
        try:
            for step in range(1, sc.steps + 1):
                if process == sc.kill and step == sc.during:
                    os.kill(os.getpid(), signal.SIGKILL)
                _log(out, process, f"s{s} step {step} start")
                losses[step] = train_step(parts, corpus, consumed, opts)[0]
                consumed += batch
                _log(out, process, f"s{s} step {step} done")
                if sc.every and step % sc.every == 0:
                    url = checkpoint(out, s, step)
                    live.save_checkpoint(parts, url, spec=spec, consumed_samples=consumed)     # docs
        except Exception as exc:   # a peer died: every survivor gets here, in the step it died in
            failure = {"step": step, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            _log(out, process, f"s{s} failure {failure}")
        if failure:  # outside the except block: its traceback would keep the model (and its groups) alive
            state = live.export_state(*parts, spec=spec, consumed_samples=consumed)           # docs
            parts = None                                                                       # docs
            live.destroy_parallel_state()                                                      # docs
            membership.leave()                                                                 # docs
    if replacement or failure:
        _log(out, process, f"s{s} waiting for lost")
        lost = set(json.loads(membership.store.get(f"s{s}/lost")))
        url = last_checkpoint(out, s, sc)
        _log(out, process, f"s{s} recover {lost} from {url}")
        done = live.rebuild_after_failure(state, build, spec=spec, config=config, lost=lost, seed=seed,  # docs
                                          membership=membership, name=f"recovery-{failures}", store=url)  # docs
        parts = done.parts                                                                     # docs
        consumed = done.imported.consumed_samples                                              # docs
        first = consumed // batch + 1
        for step in range(first, sc.steps + 1):
            losses[step] = train_step(parts, corpus, consumed, opts)[0]
            consumed += batch
        if dist.get_rank() == 0:
            w.write(out, f"scenario-{s}", {
                "reference": reference if not replacement else None, "losses": losses, "failure": failure,
                "resumed_at": first, "rolled_back_to": done.rolled_back_to,
                "step": done.imported.step, "store": done.report.store if done.report else None,
                "sent": done.report.sent if done.report else None})
        if replacement:
            w.write(out, f"replacement-{s}", {"losses": losses, "resumed_at": first})
    parts = None
    live.destroy_parallel_state()

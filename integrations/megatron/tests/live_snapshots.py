"""Workers for the megatron-core snapshot test: four processes on two simulated hosts, then a
restart on one (issue 24).

The old job (four processes, ``CONFIG``; processes 0, 1 on host A and 2, 3 on
host B, each host with its own snapshot folder) trains ``STEPS`` steps of a
real megatron-core GPT (fp32, DDP, DistributedOptimizer), snapshotting every
step through ``live.Snapshots`` and checkpointing at ``CHECKPOINT``. Then all
its processes end, as torchrun ends them when host B is lost. The restarted
job is two fresh processes on host A at ``NEW``: ``live.recover_from_snapshots``,
then training to ``FINAL``.
"""

from __future__ import annotations

import datetime
import os
import traceback

from tenplex.ptree.config import ParallelConfig

import live_survivors as s
import live_workers as w

CONFIG, NEW = "dp=2,tp=2,pp=1", "dp=1,tp=2,pp=1"
STEPS, CHECKPOINT, FINAL = 3, 2, 5


def _group(rank: int, size: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    from tenplex_megatron import cpu_shim

    cpu_shim.apply_optimizer_patches()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))


def roots(out: str) -> list[str]:
    return [os.path.join(out, "host-a"), os.path.join(out, "host-b")]


def url(out: str) -> str:
    return os.path.join(out, "checkpoint")


def old_job(process: int, port: int, out: str) -> None:
    try:
        _old_job(process, port, out)
        import torch.distributed as dist
        dist.destroy_process_group()
    except BaseException:
        w.write(out, f"error-old-{process}", traceback.format_exc())
        raise


def new_job(process: int, port: int, out: str) -> None:
    try:
        _new_job(process, port, out)
        import torch.distributed as dist
        dist.destroy_process_group()
    except BaseException:
        w.write(out, f"error-new-{process}", traceback.format_exc())
        raise


def _old_job(process: int, port: int, out: str) -> None:
    _group(process, 4, port)
    run_old(process, out, roots(out)[process // 2])


def _new_job(process: int, port: int, out: str) -> None:
    _group(process, 2, port)
    run_new(process, out, roots(out)[0])


def run_old(process: int, out: str, root: str | None) -> None:
    """The old job on this process (the default group is up): snapshots into ``root``."""
    import torch.distributed as dist
    from tenplex_megatron import live
    from tenplex_megatron.demo.job import train_step

    _, opts, spec, build, corpus = s._job()
    config = ParallelConfig.parse(CONFIG)
    live.init_parallel_state(config, w.SEED)
    reference = s._start(config, FINAL)[1]          # the run without a failure
    parts, losses, consumed = s._start(config, 0)[0], {}, 0
    checkpoint = url(out)     # the shared checkpoint
    # the lines marked `# docs` are those docs/megatron.md shows (test_docs_snippets checks them)
    snaps = live.Snapshots(spec, config, root=root)                                              # docs
    for step in range(1, STEPS + 1):
        losses[step] = train_step(parts, corpus, consumed, opts)[0]
        consumed += opts.global_batch
        snaps.save(parts, consumed_samples=consumed, step=step)                                  # docs
        if step == CHECKPOINT:
            live.save_checkpoint(parts, checkpoint, spec=spec, consumed_samples=consumed)        # docs
    snaps.wait()
    if process == 0:
        w.write(out, "old", {"reference": reference, "losses": losses})
    dist.barrier()
    parts = None
    live.destroy_parallel_state()


def run_new(process: int, out: str, root: str | None) -> None:
    """The restarted job on this process (the default group is up): recovery from ``root``."""
    from tenplex_megatron import live
    from tenplex_megatron.demo.job import train_step

    _, opts, spec, build, corpus = s._job()
    new, seed, checkpoint = ParallelConfig.parse(NEW), w.SEED, url(out)
    done = live.recover_from_snapshots(build, spec=spec, new=new, seed=seed, store=checkpoint, root=root)  # docs
    parts = done.parts                                                                           # docs
    consumed, losses = done.imported.consumed_samples, {}                                        # docs
    for step in range(done.imported.step + 1, FINAL + 1):
        losses[step] = train_step(parts, corpus, consumed, opts)[0]
        consumed += opts.global_batch
    if process == 0:
        w.write(out, "new", {"losses": losses, "step": done.imported.step, "store": done.report.store,
                             "sent": done.report.sent, "rolled_back_to": done.rolled_back_to})
    done = parts = None
    live.destroy_parallel_state()

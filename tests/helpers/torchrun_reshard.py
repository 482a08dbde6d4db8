"""Helpers for tests of ``tenplex reshard`` under torchrun: make a GPT store, launch, kill a worker."""

from __future__ import annotations

import os
import subprocess
import sys

from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.shards import materialize
from tenplex.store.writer import save


def gpt_store(url: str, config: ParallelConfig, *, layers: int, hidden: int, seed: int = 0) -> None:
    """A GPT store with mixed-precision Adam (about 14 bytes x 12 x hidden^2 x layers)."""
    spec = GPTSpec(num_layers=layers, hidden=hidden, heads=8, query_groups=8, ffn=4 * hidden, vocab=1000,
                   seq_len=128, dtype="bfloat16", optimizer="distributed_adam", bucket_numel=1 << 20)
    tree = gpt_tree(spec)
    state = random_state(tree, config, seed)
    sharding = Sharding(tree, config)
    shards = {r: materialize(tree, state, config, r, sharding) for r in range(config.world_size)}
    save(url, tree, config, shards)


def torchrun(nproc: int, args: list[str], *, no_python: bool = False, log=None) -> subprocess.Popen:
    """Start ``tenplex <args>`` under torchrun --standalone with ``nproc`` workers (new session)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
              "--monitor-interval=0.5"]
    cmd = launch + (["--no-python", "tenplex"] if no_python else ["-m", "tenplex"]) + args
    return subprocess.Popen(cmd, env=env, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def worker_rank(pid: int) -> int | None:
    """The RANK in a process's environment, or None."""
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def kill_mid_run(job: subprocess.Popen, rank: int, started, written, *, wait: float = 240.0) -> tuple[str, float]:
    """SIGKILL worker ``rank`` of the torchrun ``job`` mid-run; ``(job output, seconds it took to exit)``,
    once the job has failed within 60 s naming that rank and SIGKILL.

    Once ``started()`` is true (the run's temporary folder exists) the worker is frozen with SIGSTOP,
    so that the others go on and write their files; once ``written()`` is true it is killed.

    Raises:
        AssertionError: the job ended before ``started()``, ``written()`` never came true, or the
            job did not fail within 60 s naming the killed rank.
    """
    import signal
    import time

    victim, deadline = None, time.time() + wait
    while time.time() < deadline and job.poll() is None:
        if started():
            victim = next((p for p in descendants(job.pid) if worker_rank(p) == rank), None)
            os.kill(victim, signal.SIGSTOP)
            break
        time.sleep(0.005)
    assert victim is not None, "no worker to stop: the job ended first"
    while time.time() < deadline and not written():
        time.sleep(0.05)
    assert written(), "the other workers wrote no files"
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    out, _ = job.communicate(timeout=60)
    exit_s = time.time() - t0
    assert exit_s < 60
    assert job.returncode != 0, out[-3000:]
    assert f"rank: {rank}" in out and "SIGKILL" in out, out[-3000:]  # torchrun names the killed worker
    return out, exit_s

"""Where the time of one live reconfiguration goes, per process, and what it would be at 405B.

:func:`instrument` wraps the phases of :func:`tenplex.reconfigure` with timers (no change to
the library: the names it calls are replaced in its module, in the bench's processes only):

- **plan**: ``make_plan``.
- **agree**: what processes do to agree before any byte moves: the inputs gather (host
  names, values, arguments; it also waits for the last process to arrive), the local-state
  and argument checks, the plan's digest and its gather.
- **executor** phases, from ``DistStats.times`` (:mod:`tenplex.transform.distributed`):
  allocate targets, setup (row classes, views), pack, post, local copies, wait (blocked on
  transfers), unpack.
- **confirm**: the confirm gather (it also waits for the slowest process to finish).
- **other**: the rest of the call (guard set-up and exit, values).

:func:`estimate_405b` scales the measured per-op and per-byte costs to the state of one rank of
Llama-3.1-405B (126 layers, uneven pp 16 as 7 + 14 * 8 + 7, tp 8, distributed Adam), for
dp 64 -> 128 (8192 -> 16384 GPUs).
"""

from __future__ import annotations

import functools
import socket
import time

AGREE = ("gather inputs", "checks", "digest", "gather agree")
EXECUTOR = ("allocate", "setup", "pack", "post", "local", "wait", "unpack", "store")
ORDER = ("plan",) + AGREE + EXECUTOR + ("gather confirm", "other", "total", "cpu user", "cpu sys",
                                         "faults MB")


def instrument() -> dict:
    """Wrap the live path's phases with timers; returns the dict they add seconds to (clear it
    before a run). Call once per process."""
    import tenplex
    import tenplex.elastic as el
    import tenplex.transform.parts as parts
    from tenplex.transform.guard import TransferGuard
    from tenplex.transform.plan import Plan

    times: dict = {}

    def add(label, seconds):
        times[label] = times.get(label, 0.0) + seconds

    def wrap(owner, name, label):
        fn = getattr(owner, name, None)
        if fn is None:  # the library changed: that phase is not broken out
            return

        @functools.wraps(fn)
        def timed_fn(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            u0 = _usage() if name == "reconfigure" else None
            try:
                out = fn(*args, **kwargs)
            finally:
                key = label(args) if callable(label) else label
                add(key, time.perf_counter() - t0)
                add("cpu " + key, time.thread_time() - c0)
                if u0 is not None:
                    for k, before, after in zip(USAGE, u0, _usage()):
                        add(k, after - before)
            if name == "execute_distributed":
                for k, v in getattr(out[1], "times", {}).items():
                    add(k, v)
                for k, v in getattr(out[1], "cpu", {}).items():
                    add("cpu " + k, v)
                add("received bytes", out[1].received)
            if name == "make_plan":
                add("plan rows", len(out.table))
            return out
        setattr(owner, name, timed_fn)

    wrap(parts, "make_plan", "plan")  # reconfigure plans through plan_own_part
    wrap(parts, "inputs_digest", "digest")
    wrap(el, "tree_digest", "digest")
    for name in ("local_problems", "check_same_inputs", "check_local_state", "check_same_plan"):
        wrap(el, name, "checks")
    wrap(el, "execute_distributed", "executor")
    wrap(Plan, "digest", "digest")
    wrap(TransferGuard, "gather", lambda args: f"gather {args[1]}")
    wrap(tenplex, "reconfigure", "total")
    return times


USAGE = ("cpu user", "cpu sys", "faults MB")
"""Per process, over the whole call (all threads): user and system CPU seconds, and minor page
faults (first touches of new memory) as MB of 4 KiB pages."""


def _usage() -> tuple:
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime, u.ru_stime, u.ru_minflt * 4096 / 1e6


def finish(t: dict) -> dict:
    """``t`` with ``other`` (the call's time outside every named phase) filled in, in wall and in
    the calling thread's CPU seconds."""
    t = dict(t)
    for pre in ("", "cpu "):
        named = sum(t.get(pre + k, 0.0) for k in ("plan",) + AGREE + ("executor", "gather confirm"))
        t[pre + "other"] = t.get(pre + "total", 0.0) - named
    return t


def table(per_rank: list[dict]) -> str:
    """One row per phase, one column per process: wall seconds, then the calling thread's CPU
    seconds in the same phase (``cpu user``/``cpu sys`` count every thread of the process)."""
    head = "".join(f"{'proc ' + str(r):>9}" for r in range(len(per_rank)))
    lines = [f"{'':<16}{'wall':>36}   {'cpu of the calling thread':>36}", f"{'phase (s)':<16}{head}   {head}"]
    for k in ORDER:
        if any(k in t for t in per_rank):
            cpu = "" if not any("cpu " + k in t for t in per_rank) else \
                "   " + "".join(f"{t.get('cpu ' + k, 0.0):>9.4f}" for t in per_rank)
            lines.append(f"{k:<16}" + "".join(f"{t.get(k, 0.0):>9.4f}" for t in per_rank) + cpu)
    return "\n".join(lines)


def llama405b_tree():
    """The tree of Llama-3.1-405B (Meta's config: 126 layers, hidden 16384, 128 heads in 8 groups,
    ffn 53248, vocabulary 128256, SwiGLU, RMSNorm, no biases, untied) with a distributed Adam."""
    from tenplex.models import GPTSpec, gpt_tree

    return gpt_tree(GPTSpec(num_layers=126, hidden=16384, heads=128, query_groups=8, ffn=53248,
                            vocab=128256, seq_len=8192, swiglu=True, tied=False, rope=True, bias=False,
                            layernorm=False, dtype="bfloat16", optimizer="distributed_adam"))


LINK_BYTES_PER_S = 50e9
"""One GPU's network link in Llama 3's training cluster: 400 Gb/s RoCE (Llama Team, "The Llama 3
Herd of Models", 2024, section 3.3.1), for the share of planning and agreement at that speed."""


def estimate_405b(seconds_per_op: float, agree_s: float, bytes_per_s: float) -> dict:
    """Planning and agreement against the whole change for one rank of Llama-3.1-405B.

    The whole plan of dp=64 -> 128 (tp 8, pp 16) is made once here (about 6 s, 1 GB);
    the rank that receives the most bytes is the one that takes longest.

    - plan: that rank's plan rows (as a target, plus the rows it sends) times
      ``seconds_per_op`` (measured here: ``make_plan`` seconds over rows planned). When
      ``make_plan`` takes ``ranks=`` (own-rank planning) it is timed directly instead.
    - agree: ``agree_s`` as measured here (gathers of fixed-size digests; it does not grow
      with the state).
    - transfer: that rank's bytes received over ``bytes_per_s``, the live path's
      measured rate per process (bytes received by the busiest process over its
      executor time).

    Returns the numbers and ``plan_agree_share`` = (plan + agree) / (plan + agree + transfer);
    ``link_plan_agree_share`` the same with the transfer at :data:`LINK_BYTES_PER_S`.
    ``agree_s`` is measured with 4 processes: the store-based gathers of
    :mod:`tenplex.transform.guard` at 16384 processes are not measured.
    """
    import inspect

    import numpy as np

    from tenplex.ptree import ParallelConfig
    from tenplex.transform.plan import FILL_CODE, LINK_CODE, Link
    from tenplex.transform.planner import make_plan

    tree = llama405b_tree()
    stages = "stages=" + ":".join(["7"] + ["8"] * 14 + ["7"])
    src = ParallelConfig.parse(f"dp=64,tp=8,pp=16,{stages}")
    dst = ParallelConfig.parse(f"dp=128,tp=8,pp=16,{stages}")
    t0 = time.perf_counter()
    plan = make_plan(tree, src, dst)
    whole_s = time.perf_counter() - t0
    c = plan.table.cols
    moving = (c["link"] != LINK_CODE[Link.LOCAL]) & (c["kind"] != FILL_CODE)
    received = np.bincount(c["dst"][moving], weights=c["nbytes"][moving], minlength=dst.world_size)
    rank = int(np.argmax(received))
    rows = int(np.count_nonzero(c["dst"] == rank) + np.count_nonzero((c["src"] == rank) & (c["dst"] != rank) & moving))
    out = {"whole_plan_s": whole_s, "whole_plan_rows": len(plan.table), "rank": rank,
           "rank_rows": rows, "rank_bytes": int(received[rank])}
    if "ranks" in inspect.signature(make_plan).parameters:
        t0 = time.perf_counter()
        make_plan(tree, src, dst, ranks={rank})
        out["plan_s"], out["plan_how"] = time.perf_counter() - t0, "own-rank make_plan, timed"
    else:
        out["plan_s"], out["plan_how"] = rows * seconds_per_op, "rank rows x measured s/op"
    out["today_plan_s"] = whole_s  # every rank plans the whole world today
    out["agree_s"] = agree_s
    out["transfer_s"] = out["rank_bytes"] / bytes_per_s
    fixed = out["plan_s"] + agree_s
    out["plan_agree_share"] = fixed / (fixed + out["transfer_s"])
    today = whole_s + agree_s
    out["today_plan_agree_share"] = today / (today + out["transfer_s"])
    link = out["rank_bytes"] / LINK_BYTES_PER_S
    out["link_plan_agree_share"] = fixed / (fixed + link)
    return out


def ring_fresh(nbytes: int, repeat: int) -> float:
    """:func:`bench_common.ring` with a new, untouched receive buffer in every repetition (made
    before the timer starts): the transfer then faults its pages in, as the live path's new
    tensors do. Best slowest-process seconds."""
    import math

    import torch
    import torch.distributed as dist

    from bench_common import p2p_exchange, timed

    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.full((nbytes,), rank + 1, dtype=torch.uint8)
    best = math.inf
    for _ in range(repeat):
        recv = torch.empty(nbytes, dtype=torch.uint8)
        _, s, _ = timed(lambda: p2p_exchange([((rank + 1) % world, send)], [((rank - 1) % world, recv)]))
        assert recv[-1] == (rank - 1) % world + 1
        best = min(best, s)
        del recv
    return best


def pattern_fresh(matrix, repeat: int) -> float:
    """:func:`bench_common.pattern` (``matrix[p][q]`` raw bytes from p to q, all at once) into new,
    untouched receive buffers each time (made before the timer starts), as the live path receives
    into new tensors. Best slowest-process seconds."""
    import math

    import torch
    import torch.distributed as dist

    from bench_common import p2p_exchange, timed

    me = dist.get_rank()
    sends = [(q, torch.ones(int(n), dtype=torch.uint8)) for q, n in enumerate(matrix[me]) if n and q != me]
    best = math.inf
    for _ in range(repeat):
        recvs = [(p, torch.empty(int(row[me]), dtype=torch.uint8)) for p, row in enumerate(matrix)
                 if row[me] and p != me]
        best = min(best, timed(lambda: p2p_exchange(sends, recvs))[1])
    return best


def balanced(matrix):
    """``matrix`` with each receiver's bytes split evenly over the processes that send to it in
    ``matrix`` (the same senders, receivers and total bytes per receiver): what the plan's pattern
    would take if its deal split every receiver's bytes evenly over its senders."""
    world = len(matrix)
    out = [[0] * world for _ in range(world)]
    for q in range(world):
        senders = [p for p in range(world) if matrix[p][q] and p != q]
        total = sum(matrix[p][q] for p in senders)
        for i, p in enumerate(senders):
            out[p][q] = total // len(senders) + (1 if i < total % len(senders) else 0)
    return out


VARIANTS = ("fresh", "out")
"""The live runs: new tensors allocated by the call, and ``out=`` (received in place)."""


def touched(expected):
    """New, touched tensors of ``expected``'s shapes and dtypes (as model construction leaves
    them), for ``out=``; ``None`` for a process that holds no new rank."""
    import torch

    if expected is None:
        return None
    return {p: torch.empty(t.shape, dtype=t.dtype).fill_(1) for p, t in expected.items()
            if isinstance(t, torch.Tensor)}


def pair_matrix(tree, src, dst, world: int):
    """Bytes per ordered pair of processes in the plan ``reconfigure`` makes (default mapping)."""
    import numpy as np

    from tenplex.transform.placement import Device, Placement
    from tenplex.transform.plan import KIND_CODE, LINK_CODE, Link, OpKind
    from tenplex.transform.planner import make_plan

    host = socket.gethostname()
    plan = make_plan(tree, src, dst,
                     src_placement=Placement(tuple(Device(host, p) for p in range(src.world_size))),
                     dst_placement=Placement(tuple(Device(host, p) for p in range(dst.world_size))))
    c = plan.table.cols
    cross = ((c["src"] >= 0) & (c["src"] != c["dst"]) & (c["kind"] != KIND_CODE[OpKind.FILL])
             & (c["link"] != LINK_CODE[Link.STORE]))
    m = np.zeros((world, world), dtype=np.int64)
    np.add.at(m, (c["src"][cross], c["dst"][cross]), c["nbytes"][cross])
    return m.tolist()

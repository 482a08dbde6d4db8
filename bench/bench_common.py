"""Pieces the benchmarks share: a GPT-style spec of a given size, DTensor-compatibility checks,
measurements of this process (RSS, CPU, I/O) from /proc, timing across torch.distributed
processes (slowest wall time, summed CPU time, raw point-to-point floors) and cProfile tables."""

from __future__ import annotations

import functools
import math
import os
import resource
import socket
import time

import fsspec

from tenplex.models import GPTSpec

BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weight; fp32 exp_avg, exp_avg_sq, main_param


def make_spec(target_bytes: float, vocabs=(32768, 16384, 8192, 4096, 2048, 1024, 512),
              hiddens=range(256, 8193, 256), layers=range(1, 129)) -> GPTSpec:
    """A GPTSpec of about ``target_bytes`` logical bytes whose tp layout is plain DTensor sharding.

    Heads are ``hidden / 64`` with ``query_groups = heads`` and no SwiGLU, so every tp split at
    tp <= 4 is DTensor's ``Shard(axis)``; vocabularies are multiples of 128 * 4, so padding never
    changes.
    """
    best = None
    for vocab in vocabs:
        for hidden in hiddens:
            for n in layers:
                seq = 1024
                per_layer = 12 * hidden * hidden + 13 * hidden  # qkv, proj, fc1, fc2, biases, norms
                params = vocab * hidden + seq * hidden + n * per_layer + 2 * hidden
                err = abs(math.log(params * BYTES_PER_PARAM / target_bytes))
                shape = abs(math.log(n / (hidden / 128)))  # a GPT-like depth/width
                key = (err > 0.05, shape if err <= 0.05 else err, -vocab)
                if best is None or key < best[0]:
                    best = (key, vocab, hidden, n)
    _, vocab, hidden, n = best
    heads = hidden // 64
    return GPTSpec(num_layers=n, hidden=hidden, heads=heads, query_groups=heads,
                   ffn=4 * hidden, vocab=vocab, seq_len=1024, swiglu=False, tied=True,
                   dtype="bfloat16", make_vocab_size_divisible_by=128, optimizer="adam")


def check_plain_sharding(tree, configs) -> None:
    """Raise unless every tp split of ``tree`` is DTensor's ``Shard(axis)`` under ``configs``."""
    from tenplex.ptree.sharding import Sharding

    for cfg in configs:
        sharding = Sharding(tree, cfg)
        for path, leaf in tree.tensors():
            assert leaf.layout.dp_shard is None, path
            assert sharding.physical_shape(leaf) == leaf.shape, f"{path}: padded under {cfg}"
            split = leaf.layout.split
            if split is None:
                continue
            n = leaf.shape[split.axis]
            exact = (split.parts is None and n % cfg.tp == 0
                     and (n // cfg.tp) % split.granularity == 0)
            assert exact, f"{path}: tp split under {cfg} is not DTensor's Shard({split.axis})"


def logical_bytes(tree) -> int:
    return sum(math.prod(leaf.shape) * leaf.itemsize for _, leaf in tree.tensors())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb() -> float:
    """This process's resident set size now, in MB."""
    return _status_mb("VmRSS")


def reset_peak_rss() -> float:
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0); returns the current RSS.

    Peak RSS is read from ``VmHWM`` rather than ``getrusage``: ``ru_maxrss``
    survives ``exec``, so a spawned child would report its parent's RSS at fork.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return rss_mb()


def peak_rss_mb() -> float:
    """This process's peak RSS (since :func:`reset_peak_rss`), in MB."""
    value = _status_mb("VmHWM")
    return value if value == value else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s() -> float:
    """User plus system CPU seconds of this process so far (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def io_counters() -> tuple[int, int]:
    """``(rchar, wchar)`` of this process: bytes passed to read and write system calls."""
    values = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            values[key] = int(value)
    return values["rchar"], values["wchar"]


def dir_bytes(path: str) -> int:
    """Bytes of the files under local directory ``path`` (fsspec's ``du``)."""
    return int(fsspec.filesystem("file").du(path, total=True))


# -- timing across torch.distributed processes (gloo) ----------------------------------------

def slowest(seconds: float) -> float:
    """The largest of every process's ``seconds``."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def total(seconds: float) -> float:
    """The sum of every process's ``seconds``."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def timed(fn):
    """``fn()`` on every process, started after a barrier: ``(result, slowest seconds, cpu seconds)``.

    The CPU seconds are user + system, all threads, summed over the processes:
    on a machine with fewer cores than processes, wall time follows them.
    """
    import torch.distributed as dist

    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return out, slowest(wall), total(cpu)


def p2p_exchange(sends, recvs) -> None:
    """Send each ``(peer, tensor)`` and receive each ``(peer, tensor)``, all in one batch, through
    the live path's own transport (:class:`tenplex.transform.comm.TorchComm`: on a gloo group of
    several devices, large messages travel in parts over all of them), so that a floor and the
    live path move bytes alike."""
    _comm().exchange(sends, recvs)


@functools.lru_cache(maxsize=1)
def _comm():
    """The world group's :class:`~tenplex.transform.comm.TorchComm`, made once (not in a timed call)."""
    from tenplex.transform.comm import TorchComm

    return TorchComm()


def ring(nbytes: int, repeat: int) -> tuple[float, float]:
    """Best slowest-process seconds of a ring exchange (each process sends ``nbytes`` to the
    next, all at once), and the CPU seconds of that run."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.full((nbytes,), rank + 1, dtype=torch.uint8)
    recv = torch.empty(nbytes, dtype=torch.uint8)
    best, best_cpu = math.inf, 0.0
    for _ in range(repeat):
        recv.zero_()
        _, s, cpu = timed(lambda: p2p_exchange([((rank + 1) % world, send)], [((rank - 1) % world, recv)]))
        if s < best:
            best, best_cpu = s, cpu
        assert bool((recv[::4096] == (rank - 1) % world + 1).all()) and recv[-1] == (rank - 1) % world + 1
    return best, best_cpu


def pattern(matrix, repeat: int) -> float:
    """Best slowest-process seconds of sending ``matrix[p][q]`` raw bytes from p to q, all at once."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    sends = [(q, torch.ones(int(n), dtype=torch.uint8)) for q, n in enumerate(matrix[me]) if n and q != me]
    recvs = [(p, torch.empty(int(row[me]), dtype=torch.uint8)) for p, row in enumerate(matrix)
             if row[me] and p != me]
    return min(timed(lambda: p2p_exchange(sends, recvs))[1] for _ in range(repeat))


# -- cProfile of several processes ------------------------------------------------------------

def profile_path(profile: str, rank: int) -> str:
    """Rank 0's stats go to ``profile`` itself, the others' to ``profile.rankN``."""
    return profile if rank == 0 else f"{profile}.rank{rank}"


def phase_table(profile: str, world: int, phases) -> str:
    """Cumulative seconds per ``(label, file suffix, function name)`` of ``phases``, per rank,
    from the dumped cProfile stats."""
    import pstats

    ranks = [r for r in range(world) if os.path.exists(profile_path(profile, r))]
    stats = {r: pstats.Stats(profile_path(profile, r)).stats for r in ranks}
    lines = [f"{'phase (cumulative s)':<34}" + "".join(f"{'rank ' + str(r):>9}" for r in ranks)]
    for label, suffix, name in phases:
        row = f"{label:<34}"
        for r in ranks:
            spent = sum(v[3] for (f, _, fn), v in stats[r].items() if fn == name and f.endswith(suffix))
            row += f"{spent:>9.3f}"
        lines.append(row)
    return "\n".join(lines)

"""Pieces the benchmarks share: a GPT-style spec of a given size, DTensor-compatibility checks,
and measurements of this process (RSS, CPU, I/O) from /proc."""

from __future__ import annotations

import math
import os
import resource
import socket

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
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)

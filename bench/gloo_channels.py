"""Does spreading one pair's bytes over several gloo connections raise point-to-point throughput?

A gloo process group made with ``GLOO_SOCKET_IFNAME=lo,lo,...`` (one entry per
"device") holds one TCP connection per pair per device, each served by its
device's own thread; torch's ``ProcessGroupGloo`` sends a message with tag
``t`` over device ``t % devices``. Four processes on this machine exchange,
all pairs at once in one ``batch_isend_irecv``:

- **pattern**: the bytes per pair of processes of ``bench/reconfigure.py``'s
  plan (its default model and change, dp=2,tp=2 -> dp=1,tp=4: two processes
  each receive 38.8 + 64.0 MB; ``live_phases.pair_matrix``);
- **ring**: the same bytes, a quarter from each process to the next (the
  floor of ``bench/reconfigure.py``);

each with every message sent whole (``split`` 1) or cut into ``split`` parts
with tags ``0 .. split-1``, into new receive buffers each time. Best of
``--repeat``, slowest process. The last line is JSON: per device count, the
seconds of each, and ``*_split_over_whole`` (the best split over the whole
message, same group).

Usage: python bench/gloo_channels.py [--devices 1 2 4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def matrices() -> tuple[list, list]:
    """``(ring, pattern)``: bytes per ordered pair of processes (see above)."""
    from bench_common import make_spec
    from live_phases import pair_matrix
    from tenplex.models import gpt_tree
    from tenplex.ptree.config import ParallelConfig

    pattern = pair_matrix(gpt_tree(make_spec(400e6)), ParallelConfig.parse("dp=2,tp=2,pp=1"),
                          ParallelConfig.parse("dp=1,tp=4,pp=1"), WORLD)
    quarter = sum(map(sum, pattern)) // WORLD
    return [[quarter if q == (p + 1) % WORLD else 0 for q in range(WORLD)] for p in range(WORLD)], pattern


def _ops(me: int, matrix, split: int) -> list:
    ops = []
    for q, n in enumerate(matrix[me]):
        for k, part in enumerate(torch.ones(n, dtype=torch.uint8).chunk(split) if n else ()):
            ops.append(dist.P2POp(dist.isend, part, q, tag=k))
    for p in range(WORLD):
        n = matrix[p][me]
        for k, part in enumerate(torch.empty(n, dtype=torch.uint8).chunk(split) if n else ()):
            ops.append(dist.P2POp(dist.irecv, part, p, tag=k))
    return ops


def _timed(me: int, matrix, split: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        ops = _ops(me, matrix, split)
        dist.barrier()
        start = time.perf_counter()
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        best = min(best, took.item())
    return best


def _worker(me: int, port: int, devices: int, repeat: int, out: str, ring, pattern) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = ",".join(["lo"] * devices)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=me, world_size=WORLD)
    try:
        result = {}
        for name, matrix in (("ring", ring), ("pattern", pattern)):
            for split in sorted({1, devices, 2 * devices}):
                result[f"{name}_split{split}_s"] = round(_timed(me, matrix, split, repeat), 4)
        if me == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    ring, pattern = matrices()
    print(f"pattern, MB per pair (row: sender): {[[round(n / 1e6, 1) for n in row] for row in pattern]}")
    summary = {}
    for devices in args.devices:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(tempfile.gettempdir(), f"gloo-channels-{os.getpid()}-{devices}.json")
        mp.spawn(_worker, args=(port, devices, args.repeat, out, ring, pattern), nprocs=WORLD)
        with open(out) as f:
            r = json.load(f)
        os.remove(out)
        for name in ("ring", "pattern"):
            whole = r[f"{name}_split1_s"]
            best = min(v for k, v in r.items() if k.startswith(name))
            r[f"{name}_split_over_whole"] = round(best / whole, 3)
        print(f"{devices} gloo device(s) per process: {r}")
        summary[f"devices{devices}"] = r
    summary["cpus"] = os.cpu_count()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

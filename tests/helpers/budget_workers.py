"""Worker processes for the memory-budget test: a strided region far larger than the budget.

Process 0 holds one [8192, 4096] fp32 leaf (128 MiB) split on axis 1 at tp=1
and moves to tp=2: it keeps the left half (a local copy) and sends the right
half (64 MiB, strided at the source) to process 1, which joins empty.
Each process measures its resident-set high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs``) over the reconfiguration, against what it
held before plus its new shard, and reports the executor's own buffer peak.
"""

import json
import os

import torch
import torch.distributed as dist

import tenplex
from tenplex.ptree import ParallelConfig as P
from tenplex.ptree.layout import Layout, Split, Stage
from tenplex.ptree.tree import PTree, TensorLeaf

from tests.helpers.rendezvous import init_group


SHAPE = (8192, 4096)
TREE = PTree({"w": TensorLeaf(SHAPE, "float32", Layout(Stage.of_layer(0), Split(1)))}, num_layers=1)
SMALL = PTree({"w": TensorLeaf((64, 64), "float32", Layout(Stage.of_layer(0), Split(1)))}, num_layers=1)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def reset_peak() -> int:
    """Reset the high-water mark to the current RSS (Linux >= 4.0); the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") << 10


def peak() -> int:
    return _status_kib("VmHWM") << 10


def budget_worker(rank: int, budget: int, out_dir: str) -> None:
    init_group(rank, 2, os.path.join(out_dir, "rendezvous"), 300)
    torch.set_num_threads(1)
    # warm-up: connections, thread pools and first-call costs are not what is measured
    small = {"w": torch.randn(64, 64)} if rank == 0 else None
    tenplex.reconfigure(small, SMALL, P(), P(tp=2), memory_budget=budget)
    local = {"w": torch.randn(SHAPE)} if rank == 0 else None
    expected = None
    if rank == 0:
        expected = local["w"][:, : SHAPE[1] // 2].contiguous()
    dist.barrier()
    before = reset_peak()
    out, rep = tenplex.reconfigure(local, TREE, P(), P(tp=2), memory_budget=budget)
    high = peak()
    new_shard = out["w"].numel() * out["w"].element_size()
    if rank == 1:  # process 0's right half, to compare
        expected = torch.empty_like(out["w"])
        dist.recv(expected, 0)
    else:
        dist.send(local["w"][:, SHAPE[1] // 2:].contiguous(), 1)
    result = {"before": before, "peak": high, "new_shard": new_shard,
              "extra": high - before - new_shard, "peak_buffer": rep.peak_buffer,
              "rounds": rep.rounds, "exact": bool(torch.equal(out["w"], expected))}
    with open(os.path.join(out_dir, f"budget-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()

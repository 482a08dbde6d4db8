"""A host-local snapshot against a plain memcpy of the rank's state to /dev/shm.

One process holds rank 0's state of a GPT-style tree (:func:`bench_common.make_spec`,
bf16 weights and Adam: fp32 ``exp_avg``, ``exp_avg_sq``, ``main_param``) of about
``--mb`` MB at ``--config`` (default ``dp=2,tp=2,pp=1``). Side by side, in one run:

1. **memcpy**: every tensor of the state copied (``torch`` ``copy_``, the same per-tensor
   copies) into one memory-mapped file in ``--dir`` (default ``/dev/shm``) of the same
   size, laid out back to back; the file exists and its pages are touched once before
   timing, as a snapshot's slot files are after the first two snapshots.
2. **snapshot**: ``Snapshotter.save(state, step)`` then ``wait()``: the state checked
   against the tree, the copy into the free slot in a background thread, the slot's
   JSON and the atomic ``head.json`` switch.

Each is run ``--repeat`` times, alternating; the best time of each counts. The snapshot
is read back and checked bit for bit against the state; ``OK`` is printed.

Last line, JSON: ``snapshot_s``, ``memcpy_s``, ``snapshot_over_memcpy`` (goal <= 1.2),
``bytes``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import make_spec  # noqa: E402

from tenplex.models import gpt_tree, random_state  # noqa: E402
from tenplex.ptree import ParallelConfig, materialize  # noqa: E402
from tenplex.snapshot import Snapshotter  # noqa: E402
from tenplex.snapshot_recover import load_snapshot  # noqa: E402


def memcpy(tensors, path: str, size: int) -> float:
    """Seconds to copy ``tensors`` back to back into the mapped file ``path`` of ``size`` bytes."""
    start = time.perf_counter()
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as mm:
        offset = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=offset).copy_(t.reshape(-1).view(torch.uint8))
            offset += n
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=512, help="logical MB of the whole state (all ranks)")
    p.add_argument("--config", default="dp=2,tp=2,pp=1")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm")
    args = p.parse_args()
    torch.set_num_threads(1)
    config = ParallelConfig.parse(args.config)
    tree = gpt_tree(make_spec(args.mb * 1e6))
    state = materialize(tree, random_state(tree, config, seed=0), config, 0)
    state["optimizer/step"] = 1
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    size = sum(t.numel() * t.element_size() for t in tensors)
    root = tempfile.mkdtemp(prefix="tenplex-bench-snapshot-", dir=args.dir)
    try:
        plain = os.path.join(root, "plain.bin")
        with open(plain, "wb") as f:
            f.truncate(size)
        memcpy(tensors, plain, size)                          # touch the pages once
        snaps = Snapshotter(tree, config, 0, root=root, job="bench")
        for step in (1, 2):                                   # both slots exist, their pages touched
            snaps.save(state, step)
            snaps.wait()
        times = {"memcpy": [], "snapshot": []}
        for k in range(args.repeat):
            times["memcpy"].append(memcpy(tensors, plain, size))
            start = time.perf_counter()
            snaps.save(state, 3 + k)
            snaps.wait()
            times["snapshot"].append(time.perf_counter() - start)
        back = load_snapshot(root, "bench", 0, json.load(open(os.path.join(snaps.dir, "head.json")))["latest"], tree)
        assert all(torch.equal(back[p].view(torch.uint8), v.view(torch.uint8)) for p, v in state.items()
                   if isinstance(v, torch.Tensor))
        print("OK: the last snapshot reads back bit for bit")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    print(f"rank 0 of {config}: {size / 1e6:.1f} MB in {len(tensors)} tensors; "
          f"memcpy {best['memcpy'] * 1e3:.1f} ms ({size / best['memcpy'] / 1e9:.2f} GB/s), "
          f"snapshot {best['snapshot'] * 1e3:.1f} ms; all: " +
          ", ".join(f"{k} {[round(x * 1e3, 1) for x in v]}" for k, v in times.items()))
    print(json.dumps({"snapshot_s": round(best["snapshot"], 4), "memcpy_s": round(best["memcpy"], 4),
                      "snapshot_over_memcpy": round(best["snapshot"] / best["memcpy"], 3), "bytes": size}))


if __name__ == "__main__":
    main()

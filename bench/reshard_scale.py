"""Offline reshard with 1, 2 and 4 processes under torchrun, against the I/O floor, in one run.

A GPT-style store (bf16 weights, mixed-precision Adam; ``--layers`` x
``--hidden``, about 0.5 GB by default) is saved at ``dp=1,tp=2,pp=1`` on
tmpfs (``/dev/shm``) and resharded to ``dp=1,tp=1,pp=4``:

1. **1 process**: ``python -m tenplex reshard --json`` (the plain command);
2. **2 and 4 processes**: ``torchrun --standalone --nproc_per_node=N -m tenplex
   reshard --format tenplex --json`` (:mod:`tenplex.distributed_reshard`);
3. **floor**: in this process, plain reads of every source shard file, whole,
   and plain writes of as many bytes as the output's shard files hold,
   through one reused 16 MiB buffer.
4. **verified floor**: the floor plus the checksum work every tenplex reshard
   does and the floor does not: each source block's xxh3-128 digest is
   compared with the manifest's as it is read, and the output's block digests
   are computed as it is written (``tenplex.store.blocks``). No plan, no
   manifest, no assembly: what no executor that checks what it reads and
   records what it writes can go below, on this machine
   (``verified_floor_over_floor``; ``tenplex_over_verified_floor`` beside the goal's ratio).

Times are the reshards' own (``seconds`` of the JSON report: from opening the
source to the commit on process 0), so interpreter and torchrun start-up
are not counted; the wall time of each command is printed beside them.
Every output is verified and compared bit for bit with the 1-process output.
With ``--repeat R`` the three commands run R times, interleaved, and the
fastest of each counts, the floor's too (the machine may be shared).

Printed per run: seconds, bytes read / needed / written, per process bytes
read and seconds. The last line is JSON: ``two_over_one``, ``four_over_one``
(time ratios), ``tenplex_over_floor`` (1 process), ``bytes_read_over_needed``
(4 processes, over the 1-process plan's needed bytes), the per-process
bytes read with 4 processes, and ``verified_floor_over_floor`` and
``tenplex_over_verified_floor``. On a machine shared with other jobs, wall
times measure the scheduler as much as the work (a job of 4 processes gets
a larger share of an oversubscribed machine than one), so the same
1-process reshard is also run inside this process beside the floor, and
``inprocess_over_floor`` (wall) and ``cpu_over_floor`` (CPU seconds of
this process, all threads, over the floor's) are printed too.

Usage: python bench/reshard_scale.py [--layers 12] [--hidden 512] [--repeat 1] [--root /dev/shm]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tenplex.api import load_global, reshard, verify  # noqa: E402
from tenplex.models import GPTSpec, gpt_tree, random_state  # noqa: E402
from tenplex.ptree.config import ParallelConfig  # noqa: E402
from tenplex.ptree.sharding import Sharding  # noqa: E402
from tenplex.ptree.shards import materialize  # noqa: E402
from tenplex.store.blocks import DEFAULT_BLOCK, BlockHasher, digest  # noqa: E402
from tenplex.store.reader import StoreReader  # noqa: E402
from tenplex.store.writer import save  # noqa: E402

SRC = ParallelConfig(dp=1, tp=2, pp=1)
DST = "dp=1,tp=1,pp=4"
CHUNK = 16 << 20


def make_store(url: str, layers: int, hidden: int) -> None:
    spec = GPTSpec(num_layers=layers, hidden=hidden, heads=8, query_groups=8, ffn=4 * hidden, vocab=1000,
                   seq_len=128, dtype="bfloat16", optimizer="distributed_adam", bucket_numel=1 << 20)
    tree = gpt_tree(spec)
    state = random_state(tree, SRC, 0)
    sharding = Sharding(tree, SRC)
    save(url, tree, SRC, {r: materialize(tree, state, SRC, r, sharding) for r in range(SRC.world_size)})


def floor(src: str, out: str, sizes: list[int]) -> float:
    """Seconds to read every source shard file once and write ``sizes`` bytes of files (fsynced)."""
    buf = memoryview(bytearray(CHUNK))
    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()
    for name in sorted(glob.glob(os.path.join(src, "shards", "*"))):
        with open(name, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    for k, size in enumerate(sizes):
        with open(os.path.join(out, f"out-{k}.bin"), "wb", buffering=0) as f:
            while size > 0:
                size -= f.write(buf[:min(size, CHUNK)])
            os.fsync(f.fileno())
    return time.perf_counter() - start


def verified_floor(src: str, out: str, sizes: list[int]) -> float:
    """:func:`floor` with tenplex's checksum work: every source block's digest checked on read,
    every output block's digest computed on write (seconds)."""
    files = StoreReader(src).manifest.files
    buf = memoryview(bytearray(CHUNK))
    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()
    for key in sorted(files):
        record, index = files[key], 0
        if CHUNK % record.block:
            raise SystemExit(f"{key}: checksum block {record.block} does not divide the {CHUNK}-byte chunk")
        with open(os.path.join(src, key), "rb", buffering=0) as f:
            while n := f.readinto(buf):
                for a in range(0, n, record.block):
                    if digest(buf[a:min(a + record.block, n)]) != record.digests[index]:
                        raise SystemExit(f"{key}: block {index} differs from the manifest")
                    index += 1
    for k, size in enumerate(sizes):
        hasher = BlockHasher(DEFAULT_BLOCK)  # the reshard's output block
        with open(os.path.join(out, f"out-{k}.bin"), "wb", buffering=0) as f:
            while size > 0:
                n = f.write(buf[:min(size, CHUNK)])
                hasher.update(buf[:n])
                size -= n
            os.fsync(f.fileno())
        hasher.finish()
    return time.perf_counter() - start


def run(nproc: int, src: str, dst: str) -> tuple[dict, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [ROOT, os.path.join(ROOT, "integrations", "megatron"), os.environ.get("PYTHONPATH", "")]))
    tail = ["reshard", src, dst, "--to", DST, "--format", "tenplex", "--json", "--threads", "2"]
    cmd = [sys.executable, "-m", "tenplex", *tail] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         "--monitor-interval=0.5", "-m", "tenplex", *tail]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{nproc} processes failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1]), wall


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each; the fastest counts")
    ap.add_argument("--root", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tenplex-scale-", dir=args.root)
    try:
        src = os.path.join(work, "src")
        make_store(src, args.layers, args.hidden)
        results, walls = {}, {}
        for i in range(args.repeat):  # interleaved, so that load from elsewhere hits each alike
            for n in (1, 2, 4):
                dst = os.path.join(work, f"dst{n}")
                if i:
                    shutil.rmtree(dst)
                r, wall = run(n, src, dst)
                if n not in results or r["seconds"] < results[n]["seconds"]:
                    results[n], walls[n] = r, wall
        sizes = [os.path.getsize(p) for p in glob.glob(os.path.join(work, "dst1", "shards", "*"))]
        t_floor, c_floor, t_in, c_in, t_verified = (float("inf"),) * 5
        for _ in range(args.repeat):  # the floors, and one process in this process, wall and CPU seconds
            shutil.rmtree(os.path.join(work, "floor"), ignore_errors=True)
            cpu = time.process_time()
            t_floor = min(t_floor, floor(src, os.path.join(work, "floor"), sizes))
            c_floor = min(c_floor, time.process_time() - cpu)
            shutil.rmtree(os.path.join(work, "floor"), ignore_errors=True)
            t_verified = min(t_verified, verified_floor(src, os.path.join(work, "floor"), sizes))
            shutil.rmtree(os.path.join(work, "inproc"), ignore_errors=True)
            wall, cpu = time.perf_counter(), time.process_time()
            reshard(src, os.path.join(work, "inproc"), ParallelConfig.parse(DST), format="tenplex", threads=2)
            t_in, c_in = min(t_in, time.perf_counter() - wall), min(c_in, time.process_time() - cpu)
        ref = load_global(os.path.join(work, "dst1"))
        for n in (1, 2, 4):
            verify(os.path.join(work, f"dst{n}"))
            assert n == 1 or same(load_global(os.path.join(work, f"dst{n}")), ref), f"{n} processes differ"
        needed = results[1]["bytes_needed"]
        for n in (1, 2, 4):
            r = results[n]
            print(f"{n} process(es): {r['seconds']:.2f} s (command {walls[n]:.2f} s), read {r['bytes_read']}, "
                  f"needed {r['bytes_needed']}, written {r['bytes_written']}")
            for p in r.get("processes", []):
                print(f"  process {p['process']}: ranks {p['ranks']}, read {p['bytes_read']} "
                      f"(shared {p['bytes_shared']}), {p['seconds']:.2f} s")
        print(f"1 process in this process: {t_in:.2f} s, {c_in:.2f} CPU s (plugins imported, files warm)")
        read = sum(os.path.getsize(p) for p in glob.glob(src + "/shards/*"))
        print(f"floor: {t_floor:.2f} s, {c_floor:.2f} CPU s (read {read}, wrote {sum(sizes)}); "
              f"verified floor (block digests checked and made): {t_verified:.2f} s")
        t1 = results[1]["seconds"]
        print(json.dumps({"two_over_one": round(results[2]["seconds"] / t1, 3),
                          "four_over_one": round(results[4]["seconds"] / t1, 3),
                          "tenplex_over_floor": round(t1 / t_floor, 3),
                          "inprocess_over_floor": round(t_in / t_floor, 3),
                          "cpu_over_floor": round(c_in / c_floor, 3),
                          "verified_floor_over_floor": round(t_verified / t_floor, 3),
                          "tenplex_over_verified_floor": round(t1 / t_verified, 3),
                          "bytes_read_over_needed": round(results[4]["bytes_read"] / needed, 4),
                          "bytes_read_per_process": [p["bytes_read"] for p in results[4]["processes"]],
                          "cpus": os.cpu_count()}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

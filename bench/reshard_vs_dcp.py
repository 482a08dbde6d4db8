"""Offline reshard: tenplex against PyTorch DCP and the I/O floor, on a ~1 GB GPT state.

The state is a GPT-style tree (:class:`tenplex.models.GPTSpec`) with bf16
weights and Adam (fp32 ``exp_avg``, ``exp_avg_sq`` and ``main_param`` per
parameter), sized to about ``--gb`` logical bytes. It is saved at
``dp=2,tp=2,pp=1`` and resharded to ``dp=1,tp=4,pp=1`` and to
``dp=2,tp=1,pp=2``, three ways, in the same run:

1. **tenplex**: ``tenplex.api.reshard(src, dst, to)`` in a fresh child
   process (so that its peak RSS is its own).
2. **DCP** (``torch.distributed.checkpoint``): the source layout is saved
   once, untimed, by ``src.world_size`` gloo processes whose local shards are
   DTensors with the source placements (mesh ``(pp, dp, tp)`` in Megatron's
   rank order; each stage's ranks use the ``(dp, tp)`` submesh; ``Replicate()``
   on dp, ``Shard(axis)`` or ``Replicate()`` on tp). Timed: ``dst.world_size``
   fresh gloo processes load into DTensors with the *target* placements (each
   pipeline stage loads only its own tensors) and save them at the target.
   ``FileSystemWriter(sync_files=False)``, because tenplex does not fsync
   either; other DCP settings are defaults.
3. **floor**: plain file reads of the whole source shard files and plain
   writes of as many bytes as tenplex's output files hold, in one process,
   streamed through one reused 16 MiB buffer: the kernel's copy cost alone,
   with no fresh memory faulted in (large fresh buffers on a machine with
   transparent huge pages on ``madvise``, as numpy requests, can stall in
   page compaction and make the "floor" slower than tenplex).

Every path runs once with checkpoints on tmpfs (``/dev/shm``), where software
cost decides, and once on the working disk (``/tmp``; reads largely come from
the page cache, writes are not fsynced, so this is not a cold-disk number;
``os.sync()`` runs, untimed, before each path so that none is throttled by
write-back of another's data).

Plain DTensor ``Shard(axis)`` must describe the tensor-parallel layout
exactly, so the model uses ``swiglu=False`` (no ``[gate; up]`` parts in fc1),
``query_groups=heads`` (fused QKV split on whole heads, which is DTensor's
even chunking when tp divides heads) and a vocabulary that is a multiple of
``128 * 4`` (padded == logical at tp = 1, 2, 4). DCP moves tensors only;
tenplex also moves the value leaves (step, rng, ...), which are tiny.

Correctness: after each tenplex reshard, ``tenplex.api.load_global(dst)``
is compared with the original global state bit for bit (every leaf); for
DCP, a few leaves per target rank are compared with
``materialize(tree, state, target, rank)``.

Printed per storage and change: wall time, CPU time (user + system, all
threads, summed over processes), bytes read and written (tenplex: its report;
DCP and floor: ``rchar``/``wchar`` from ``/proc/self/io``, summed over
processes), peak RSS (``VmHWM``, reset when the timed section starts; max over
the working processes; the RSS at the start in brackets), and the ratios
tenplex/DCP and tenplex/floor (wall times). The last line is one JSON object
with the worst case over both changes in the tmpfs run: ``tenplex_over_dcp``,
``tenplex_over_floor``, ``bytes_read_over_needed``.

Wall times are sensitive to other load on the machine; run it on an otherwise
idle machine, with ``--repeat 3`` or more (the best run of each path counts).

Usage: python bench/reshard_vs_dcp.py [--gb 1.0] [--skip-disk] [--repeat 1]
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import math
import multiprocessing as mp
import os
import shutil
import tempfile
import time

from bench_common import (check_plain_sharding, cpu_s, dir_bytes, free_port, io_counters,
                          logical_bytes, make_spec, peak_rss_mb, reset_peak_rss)


SHAPES = dict(vocabs=(32768, 8192, 2048),
              hiddens=(256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192),
              layers=range(2, 97, 2))  # even: the pp=2 change splits the layers
"""The model shapes ``make_spec`` chooses among here."""

SOURCE = "dp=2,tp=2,pp=1"
CHANGES = {"tp4": "dp=1,tp=4,pp=1", "pp2": "dp=2,tp=1,pp=2"}
FLOOR_CHUNK = 16 << 20


# -- helpers ------------------------------------------------------------------


def in_child(target, *args):
    """Run ``target(*args, queue)`` in a fresh spawned process and return what it puts."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    if isinstance(result, BaseException):
        raise result
    return result


def rm(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- source ------------------------------------------------------------------

def save_source(spec, url: str, seed: int, queue) -> None:
    """Save the random state of ``spec`` at SOURCE with tenplex (untimed)."""
    try:
        from tenplex import api
        from tenplex.models import gpt_tree, random_state
        from tenplex.ptree import ParallelConfig
        from tenplex.ptree.shards import materialize
        from tenplex.ptree.sharding import Sharding

        tree, cfg = gpt_tree(spec), ParallelConfig.parse(SOURCE)
        state = random_state(tree, cfg, seed)
        sharding = Sharding(tree, cfg)
        shards = {r: materialize(tree, state, cfg, r, sharding) for r in range(cfg.world_size)}
        del state
        api.save(url, tree, cfg, shards)
        queue.put({"bytes": dir_bytes(url)})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(exc)


# -- tenplex -------------------------------------------------------------------

def run_tenplex(src: str, dst: str, to: str, queue) -> None:
    try:
        from tenplex import api
        from tenplex.ptree import ParallelConfig

        cfg = ParallelConfig.parse(to)
        base = reset_peak_rss()
        r0, w0 = io_counters()
        c0, t0 = cpu_s(), time.perf_counter()
        report = api.reshard(src, dst, cfg)
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        r1, w1 = io_counters()
        queue.put({"wall": wall, "cpu": cpu, "seconds": report.seconds, "read": report.bytes_read,
                   "needed": report.bytes_needed, "written": report.bytes_written,
                   "rchar": r1 - r0, "wchar": w1 - w0, "peak_rss_mb": peak_rss_mb(),
                   "base_rss_mb": base, "summary": report.summary(), "padding": report.padding})
    except BaseException as exc:  # noqa: BLE001
        queue.put(exc)


# -- floor ---------------------------------------------------------------------

def run_floor(src: str, out: str, sizes: list[int], queue) -> None:
    """Read every source shard file whole and write files of ``sizes`` bytes, streaming the
    data read through one reused buffer (so no fresh memory is faulted in)."""
    try:
        files = sorted(glob.glob(os.path.join(src, "shards", "*")))
        buf = memoryview(bytearray(FLOOR_CHUNK))
        os.makedirs(out, exist_ok=True)
        base = reset_peak_rss()
        r0, w0 = io_counters()
        c0, t0 = cpu_s(), time.perf_counter()
        t_read = 0.0
        read = written = 0
        pending = list(enumerate(sizes))
        handle, left = None, 0

        def emit(data) -> None:
            nonlocal handle, left, written
            while len(data) and (pending or left):
                if not left:
                    k, left = pending.pop(0)
                    handle = open(os.path.join(out, f"out-{k:05d}.bin"), "wb", buffering=0)
                n = handle.write(data[:left])
                data, left, written = data[n:], left - n, written + n
                if not left:
                    handle.close()

        for name in files:
            with open(name, "rb", buffering=0) as f:
                while True:
                    t = time.perf_counter()
                    n = f.readinto(buf)
                    t_read += time.perf_counter() - t
                    if not n:
                        break
                    read += n
                    emit(buf[:n])
        while pending or left:  # outputs larger than the inputs: repeat the last chunk
            emit(buf)
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        r1, w1 = io_counters()
        queue.put({"wall": wall, "cpu": cpu, "read_s": t_read, "read": read,
                   "written": written, "rchar": r1 - r0, "wchar": w1 - w0,
                   "peak_rss_mb": peak_rss_mb(), "base_rss_mb": base})
    except BaseException as exc:  # noqa: BLE001
        queue.put(exc)


# -- DCP -----------------------------------------------------------------------

def dcp_worker(rank: int, mode: str, spec, cfg_text: str, port: int, tenplex_src: str,
               dcp_src: str, dcp_dst: str, result_dir: str, samples: list[str]) -> None:
    """One gloo rank. ``mode="save"``: save the source layout (untimed);
    ``mode="load"``: timed load at the target placements plus save at the target."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from tenplex import api
    from tenplex.models import gpt_tree
    from tenplex.ptree import ParallelConfig
    from tenplex.ptree.sharding import Sharding
    from tenplex.ptree.tree import torch_dtype

    cfg = ParallelConfig.parse(cfg_text)
    assert cfg.order == ("tp", "dp", "pp")  # rank = tp + tp_size * (dp + dp_size * pp)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world_size)
    try:
        tree = gpt_tree(spec)
        sharding = Sharding(tree, cfg)
        mesh = init_device_mesh("cpu", (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp"))
        stage_mesh = mesh["dp", "tp"]
        coord = cfg.coord(rank)

        def dtensor(leaf, local):
            split = leaf.layout.split
            placements = [Replicate(), Shard(split.axis) if split is not None else Replicate()]
            shape = torch.Size(leaf.shape)
            stride = tuple(math.prod(leaf.shape[i + 1:]) for i in range(len(leaf.shape)))
            return DTensor.from_local(local, stage_mesh, placements, run_check=False,
                                      shape=shape, stride=stride)

        if mode == "save":
            local = api.load(tenplex_src, cfg, rank)
            state = {p: dtensor(leaf, local[p]) for p, leaf in tree.tensors() if p in local}
            dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_src, sync_files=False))
            dist.barrier()
            return

        state = {}
        for path, leaf in tree.tensors():
            held = sharding.holding(path, coord)
            if held is not None:
                state[path] = dtensor(leaf, torch.empty(held.shape, dtype=torch_dtype(leaf.dtype)))
        base = reset_peak_rss()
        dist.barrier()
        r0, w0 = io_counters()
        c0, t0 = cpu_s(), time.perf_counter()
        dcp.load(state, storage_reader=dcp.FileSystemReader(dcp_src))
        t1 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dst, sync_files=False))
        t2 = time.perf_counter()
        dist.barrier()
        t3, c3 = time.perf_counter(), cpu_s()
        r1, w1 = io_counters()
        result = {"rank": rank, "load_s": t1 - t0, "save_s": t2 - t1, "wall": t3 - t0,
                  "cpu": c3 - c0,
                  "rchar": r1 - r0, "wchar": w1 - w0, "peak_rss_mb": peak_rss_mb(),
                  "base_rss_mb": base}
        if samples:
            torch.save({p: state[p].to_local().clone() for p in samples if p in state},
                       os.path.join(result_dir, f"sample-{rank}.pt"))
        with open(os.path.join(result_dir, f"rank-{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def spawn_dcp(mode: str, spec, cfg_text: str, **kw) -> None:
    import torch.multiprocessing as tmp
    from tenplex.ptree import ParallelConfig

    world = ParallelConfig.parse(cfg_text).world_size
    args = (mode, spec, cfg_text, free_port(), kw.get("tenplex_src", ""), kw.get("dcp_src", ""),
            kw.get("dcp_dst", ""), kw.get("result_dir", ""), kw.get("samples", []))
    tmp.spawn(dcp_worker, args=args, nprocs=world, join=True, start_method="spawn")


def run_dcp(spec, to: str, dcp_src: str, dcp_dst: str, result_dir: str, samples) -> dict:
    os.makedirs(result_dir, exist_ok=True)
    spawn_dcp("load", spec, to, dcp_src=dcp_src, dcp_dst=dcp_dst, result_dir=result_dir,
              samples=samples)
    ranks = []
    for name in sorted(glob.glob(os.path.join(result_dir, "rank-*.json"))):
        with open(name) as f:
            ranks.append(json.load(f))
    return {"wall": max(r["wall"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
            "save_s": max(r["save_s"] for r in ranks), "cpu": sum(r["cpu"] for r in ranks),
            "read": sum(r["rchar"] for r in ranks),
            "written": sum(r["wchar"] for r in ranks), "stored": dir_bytes(dcp_dst),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "sum_peak_rss_mb": sum(r["peak_rss_mb"] for r in ranks),
            "base_rss_mb": max(r["base_rss_mb"] for r in ranks)}


# -- checks ----------------------------------------------------------------------

def check_tenplex(dst: str, state) -> int:
    """Assemble ``dst`` and compare every tensor leaf with ``state``; returns leaves compared."""
    from tenplex import api
    from tenplex.ptree.shards import bitwise_equal

    out = api.load_global(dst)
    n = 0
    for path, expected in state.items():
        if hasattr(expected, "dtype"):
            if not bitwise_equal(out[path], expected):
                raise AssertionError(f"tenplex reshard to {dst}: leaf {path} differs")
            n += 1
    return n


def check_dcp(tree, state, to: str, result_dir: str) -> int:
    """Compare the sampled DCP-loaded shards with ``materialize``; returns tensors compared."""
    import torch

    from tenplex.ptree import ParallelConfig
    from tenplex.ptree.shards import bitwise_equal, materialize
    from tenplex.ptree.sharding import Sharding

    cfg = ParallelConfig.parse(to)
    sharding = Sharding(tree, cfg)
    n = 0
    for rank in range(cfg.world_size):
        got = torch.load(os.path.join(result_dir, f"sample-{rank}.pt"))
        if len(got) < 2:
            raise AssertionError(f"DCP check: rank {rank} of {to} has {len(got)} sampled leaves")
        expected = materialize(tree, state, cfg, rank, sharding)
        for path, tensor in got.items():
            if not bitwise_equal(tensor, expected[path]):
                raise AssertionError(f"DCP load at {to}, rank {rank}: leaf {path} differs")
            n += 1
        del expected
    return n


def sample_leaves(spec) -> list[str]:
    last = spec.num_layers - 1
    return ["model/embedding/word_embeddings/weight",
            "model/layers/0/attention/qkv/weight",
            f"optimizer/exp_avg_sq/model/layers/{last}/attention/proj/weight",
            f"optimizer/main_param/model/layers/{last}/mlp/fc1/weight",
            "optimizer/exp_avg/model/layers/0/mlp/fc2/weight",
            "model/final_norm/weight"]


# -- driver ----------------------------------------------------------------------

def run_storage(label: str, root: str, spec, tree, state, repeat: int) -> dict:
    os.makedirs(root, exist_ok=True)
    src, dcp_src = os.path.join(root, "tenplex-src"), os.path.join(root, "dcp-src")
    saved = in_child(save_source, spec, src, 0)
    spawn_dcp("save", spec, SOURCE, tenplex_src=src, dcp_src=dcp_src)
    print(f"[{label}] {root}: source {SOURCE}: tenplex {saved['bytes'] / 1e9:.3f} GB, "
          f"DCP {dir_bytes(dcp_src) / 1e9:.3f} GB on storage", flush=True)
    results = {}
    for name, to in CHANGES.items():
        best: dict = {}
        for rep in range(repeat):
            dst = os.path.join(root, f"tenplex-{name}")
            os.sync()  # each path starts with no dirty pages of the others' writes
            t = in_child(run_tenplex, src, dst, to)
            sizes = [os.path.getsize(p) for p in glob.glob(os.path.join(dst, "shards", "*"))]
            if rep == 0:
                n = check_tenplex(dst, state)
                print(f"[{label}] {name}: tenplex load_global == original, {n} tensor leaves "
                      "bit for bit", flush=True)
                gc.collect()
            rm(dst)
            out = os.path.join(root, f"dcp-{name}")
            res = os.path.join(root, f"dcp-result-{name}")
            os.sync()
            d = run_dcp(spec, to, dcp_src, out, res, sample_leaves(spec) if rep == 0 else [])
            if rep == 0:
                n = check_dcp(tree, state, to, res)
                print(f"[{label}] {name}: DCP target shards == materialize, {n} tensors checked",
                      flush=True)
                gc.collect()
            rm(out)
            rm(res)
            fdir = os.path.join(root, f"floor-{name}")
            os.sync()
            f = in_child(run_floor, src, fdir, sizes)
            rm(fdir)
            for key, r in (("tenplex", t), ("dcp", d), ("floor", f)):
                if key not in best or r["wall"] < best[key]["wall"]:
                    best[key] = r
            print(f"[{label}] {name} run {rep + 1}/{repeat}: tenplex {t['wall']:.2f} s, "
                  f"DCP {d['wall']:.2f} s, floor {f['wall']:.2f} s", flush=True)
        results[name] = best
    rm(src)
    rm(dcp_src)
    return results


def report(label: str, results: dict) -> dict:
    ratios = {}
    print(f"\n== {label} ==")
    print(f"{'change':<30} {'path':<8} {'wall s':>7} {'cpu s':>6} {'read MB':>9} "
          f"{'written MB':>10} {'GB/s':>6} {'peak RSS MB (base)':>19}")
    for name, best in results.items():
        change = f"{SOURCE} -> {CHANGES[name]}".replace(",pp=1", "")
        for key in ("tenplex", "dcp", "floor"):
            r = best[key]
            gbps = (r["read"] + r["written"]) / r["wall"] / 1e9
            rss = f"{r['peak_rss_mb']:.0f} ({r['base_rss_mb']:.0f})"
            print(f"{change:<30} {key:<8} {r['wall']:>7.2f} {r['cpu']:>6.2f} "
                  f"{r['read'] / 1e6:>9.1f} {r['written'] / 1e6:>10.1f} {gbps:>6.2f} {rss:>19}")
        t, d, f = best["tenplex"], best["dcp"], best["floor"]
        ratios[name] = {"tenplex_over_dcp": t["wall"] / d["wall"],
                        "tenplex_over_floor": t["wall"] / f["wall"],
                        "bytes_read_over_needed": t["read"] / t["needed"] if t["needed"] else 1.0}
        print(f"{'':<30} tenplex: needed {t['needed'] / 1e6:.1f} MB, read/needed "
              f"{ratios[name]['bytes_read_over_needed']:.4f}, rchar {t['rchar'] / 1e6:.1f} MB, "
              f"wchar {t['wchar'] / 1e6:.1f} MB; DCP: load {d['load_s']:.2f} s + save "
              f"{d['save_s']:.2f} s, sum of peak RSS {d['sum_peak_rss_mb']:.0f} MB; "
              f"floor read {f['read_s']:.2f} s")
        print(f"{'':<30} tenplex/DCP {ratios[name]['tenplex_over_dcp']:.3f}  "
              f"tenplex/floor {ratios[name]['tenplex_over_floor']:.3f}")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="target logical state size in GB")
    parser.add_argument("--skip-disk", action="store_true", help="run on tmpfs only")
    parser.add_argument("--repeat", type=int, default=1, help="runs per path; the best is reported")
    args = parser.parse_args()

    from tenplex.models import gpt_tree, random_state
    from tenplex.ptree import ParallelConfig

    spec = make_spec(args.gb * 1e9, **SHAPES)
    tree = gpt_tree(spec)
    configs = [ParallelConfig.parse(SOURCE)] + [ParallelConfig.parse(c) for c in CHANGES.values()]
    check_plain_sharding(tree, configs)
    print(f"model: layers={spec.num_layers} hidden={spec.hidden} heads={spec.heads} ffn={spec.ffn} "
          f"vocab={spec.vocab} bf16 + Adam (fp32 exp_avg, exp_avg_sq, main_param); "
          f"{sum(1 for _ in tree.tensors())} tensor leaves, "
          f"{logical_bytes(tree) / 1e9:.3f} GB logical",
          flush=True)
    state = random_state(tree, configs[0], 0)  # the same seed as save_source's

    storages = [("tmpfs", tempfile.mkdtemp(prefix="tenplex-bench-", dir="/dev/shm"))]
    if not args.skip_disk:
        storages.append(("disk", tempfile.mkdtemp(prefix="tenplex-bench-", dir="/tmp")))
    all_ratios = {}
    try:
        results = {}
        for label, root in storages:
            results[label] = run_storage(label, root, spec, tree, state, max(1, args.repeat))
            rm(root)
        for label, _ in storages:
            all_ratios[label] = report(label, results[label])
    finally:
        for _, root in storages:
            rm(root)
    tmpfs = all_ratios["tmpfs"]
    print()
    keys = ("tenplex_over_dcp", "tenplex_over_floor", "bytes_read_over_needed")
    print(json.dumps({key: round(max(r[key] for r in tmpfs.values()), 4) for key in keys}))


if __name__ == "__main__":
    main()

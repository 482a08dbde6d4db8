"""Megatron dist checkpoint, tp=2,pp=1 -> tp=1,pp=2: ``tenplex reshard`` against megatron-core's load + save.

A real megatron-core ``GPTModel`` (GQA, SwiGLU, rope, untied embeddings,
RMSNorm, no linear biases; fp32 weights, no optimizer) of about ``--gb``
GB is built and saved with ``megatron.core.dist_checkpointing.save`` at
``tp=2,pp=1`` by two gloo processes on CPU
(``integrations/megatron/tests/mcore_worker.py --save dist``). The vocabulary
is a multiple of ``128 * 4``, so its padding is the same at tp = 1, 2 and 4.
That checkpoint (SRC) is then brought to ``tp=1,pp=2`` two ways, in the same
run:

1. **tenplex**: ``tenplex reshard SRC DST --to dp=1,tp=1,pp=2`` (the console
   script, in a subprocess; megatron-dist in, megatron-dist out). Timed as
   the subprocess's wall time. Python start-up and the CLI's import are timed
   apart (``python -c 'import tenplex.cli.main'``, best of 3) and subtracted
   for the second figure; the CLI's own ``seconds`` (``--json``) is shown too.
2. **megatron-core**: the worker at ``tp=1,pp=2`` (2 processes) with
   ``--load dist --load-dir SRC --save dist --save-dir DST2``: its
   ``TIME load_dist`` + ``TIME save_dist`` lines, i.e. the time of the
   ``sharded_state_dict`` + ``dist_checkpointing.load`` + ``load_state_dict``
   and ``sharded_state_dict`` + ``dist_checkpointing.save`` calls, without
   torchrun, process-group and model-build time. The worker's whole wall time
   is printed for reference.

Correctness: the source worker writes the model's logits on a fixed batch
right after saving; the worker at ``tp=1,pp=2`` loads tenplex's DST with
megatron-core's ``dist_checkpointing.load`` and writes its logits; the max
absolute difference is printed against 1e-6. The megatron-core worker also
writes its logits after its own load + save (not counted in its times), and
tenplex's logits are compared with those too: the same weights at the same
config, so they must agree exactly. tp=2 and tp=1 sum the row-parallel
matmuls in different orders, so at ~1 GB (hidden 1024) both megatron-core's
own reshard and tenplex's differ from the source logits by a few 1e-6.
``ok`` (exit status 0) means: tenplex's logits equal megatron-core's exactly,
and tenplex's difference to the source is within max(1e-6, megatron-core's).

Checkpoints go to ``/dev/shm`` when it has room (tmpfs: software cost
decides), otherwise to a temporary directory; they are removed at the end
unless ``--keep``. Printed: times, bytes on disk, and tenplex/megatron. The
last line is one JSON object: ``tenplex_over_megatron`` (tenplex CLI wall
time over megatron's load + save call time), ``tenplex_over_megatron_no_startup``,
the component times, sizes and ``max_abs_diff``.

``--profile`` also runs the tenplex reshard once more under cProfile (every
thread profiled; stats merged) and prints the top functions.

Wall times are sensitive to other load on the machine (megatron uses two
processes, one thread each; tenplex one process with its default threads).

Usage: python bench/megatron_reshard.py [--gb 1.0] [--keep] [--repeat 1] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "integrations" / "megatron" / "tests" / "mcore_worker.py"
SRC_CFG = (2, 1)  # (tp, pp)
DST_CFG = (1, 2)
TARGET = "dp=1,tp=1,pp=2"
TOL = 1e-6

# Runs tenplex.cli.main under cProfile with one profiler per thread; merges them into argv[1].
PROFILE_DRIVER = r"""
import cProfile, pstats, sys, threading
out, argv = sys.argv[1], sys.argv[2:]
profiles = []
_run = threading.Thread.run
def run(self):
    p = cProfile.Profile()
    profiles.append(p)
    p.enable()
    try:
        _run(self)
    finally:
        p.disable()
threading.Thread.run = run
main = cProfile.Profile()
main.enable()
from tenplex.cli.main import main as cli
rc = cli(argv)
main.disable()
stats = pstats.Stats(main)
for p in profiles:
    try:
        stats.add(p)
    except TypeError:  # a thread that recorded nothing
        pass
stats.dump_stats(out)
sys.exit(rc)
"""


def model_shape(gb: float) -> dict:
    """Layers/hidden/ffn/vocab for about ``gb`` GB of fp32 weights (GQA, SwiGLU, untied)."""
    target = gb * 1e9 / 4
    best = None
    for hidden in (2048, 1536, 1024, 768, 512, 256, 128):
        heads = max(8, hidden // 64)
        groups = heads // 4  # divisible by 2 (tp=2 at the source)
        kv = hidden // heads
        ffn = -(-(8 * hidden // 3) // 128) * 128
        vocab = 32768 if hidden >= 512 else 8192  # multiple of 128 * 4
        per_layer = (hidden * (heads + 2 * groups) * kv  # linear_qkv
                     + heads * kv * hidden  # linear_proj
                     + 3 * ffn * hidden  # linear_fc1 [gate; up] + linear_fc2
                     + 2 * hidden)  # two RMSNorms
        fixed = 2 * vocab * hidden + hidden  # embedding, output layer, final norm
        layers = max(2, 2 * round((target - fixed) / per_layer / 2))
        best = dict(layers=layers, hidden=hidden, heads=heads, query_groups=groups, ffn=ffn,
                    vocab=vocab, params=fixed + layers * per_layer)
        if layers >= 8:
            break
    return best


def worker_flags(m: dict) -> list[str]:
    return ["--layers", str(m["layers"]), "--hidden", str(m["hidden"]), "--heads", str(m["heads"]),
            "--query-groups", str(m["query_groups"]), "--ffn", str(m["ffn"]), "--swiglu",
            "--position", "rope", "--untie", "--vocab", str(m["vocab"]),
            "--make-vocab-size-divisible-by", "128", "--seq", "16", "--batch", "2"]


def run_worker(cfg: tuple[int, int], flags: list[str], *extra: str) -> tuple[float, dict[str, float], str]:
    """The worker under torchrun (tp * pp processes): wall seconds, its TIME lines, its stdout."""
    tp, pp = cfg
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp * pp}",
           str(WORKER), "--tp", str(tp), "--pp", str(pp), *flags, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"worker failed ({' '.join(cmd)}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    times = {}
    for line in done.stdout.splitlines():
        if line.startswith("TIME "):
            parts = line.split()
            times[parts[1]] = float(parts[2])
    return wall, times, done.stdout


def tenplex_exe() -> list[str]:
    """The ``tenplex`` console script next to this Python (not a pyenv shim), else on PATH."""
    exe = pathlib.Path(sys.executable).parent / "tenplex"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("tenplex")
    return [found] if found else [sys.executable, "-m", "tenplex.cli.main"]


def run_tenplex(src: str, dst: str) -> tuple[float, dict]:
    cmd = [*tenplex_exe(), "reshard", src, dst, "--to", TARGET, "--json"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"tenplex failed ({' '.join(cmd)}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return wall, summary


def startup_seconds(repeat: int = 3) -> float:
    """Python start-up plus ``import tenplex.cli.main`` (best of ``repeat``)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import tenplex.cli.main"], check=True)
        best = min(best, time.perf_counter() - t0)
    return best


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def max_abs_diff(a: str, b: str) -> float:
    import torch

    x = torch.load(a, weights_only=True)["logits"]
    y = torch.load(b, weights_only=True)["logits"]
    if x.shape != y.shape:
        sys.exit(f"logits shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    return (x.double() - y.double()).abs().max().item()


def scratch_root(need: int) -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > need:
        return tempfile.mkdtemp(prefix="tenplex-mcore-bench-", dir=shm)
    return tempfile.mkdtemp(prefix="tenplex-mcore-bench-")


def profile(src: str, dst: str, out: str, top: int = 30) -> None:
    import pstats

    cmd = [sys.executable, "-c", PROFILE_DRIVER, out, "reshard", src, dst, "--to", TARGET, "--json"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"profile run failed:\n{done.stderr[-3000:]}")
        return
    print(f"\nprofile ({time.perf_counter() - t0:.2f} s under cProfile, all threads merged): {out}")
    stats = pstats.Stats(out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_callers(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="approximate model size in GB (fp32)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint directories")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of each path (best counts)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one tenplex reshard (cProfile, all threads)")
    args = parser.parse_args()

    m = model_shape(args.gb)
    flags = worker_flags(m)
    # source + two outputs + the scratch copies megatron's writer makes; generous
    root = scratch_root(int(m["params"] * 4 * 4))
    src, logits_src, logits_dst, logits_mc = (f"{root}/src", f"{root}/logits_src.pt",
                                              f"{root}/logits_dst.pt", f"{root}/logits_megatron.pt")
    print(f"model: layers={m['layers']} hidden={m['hidden']} heads={m['heads']} "
          f"query_groups={m['query_groups']} ffn={m['ffn']} vocab={m['vocab']} swiglu rope untied "
          f"~{m['params'] / 1e6:.1f}M params ({m['params'] * 4 / 1e9:.3f} GB fp32); scratch {root}")
    try:
        wall, t, _ = run_worker(SRC_CFG, flags, "--save", "dist", "--save-dir", src,
                                "--logits-out", logits_src)
        src_bytes = dir_bytes(src)
        print(f"source: megatron-core tp=2,pp=1 save_dist {t['save_dist']:.2f} s "
              f"(worker {wall:.1f} s), {src_bytes / 1e9:.3f} GB on disk")

        startup = startup_seconds()
        tp_walls, tp_inner, mc_calls, mc_load, mc_save, mc_walls = [], [], [], [], [], []
        for i in range(args.repeat):
            dst, dst2 = f"{root}/tenplex_{i}", f"{root}/megatron_{i}"
            wall, summary = run_tenplex(src, dst)
            tp_walls.append(wall)
            tp_inner.append(summary.get("seconds", float("nan")))
            wall, t, _ = run_worker(DST_CFG, flags, "--load", "dist", "--load-dir", src,
                                    "--save", "dist", "--save-dir", dst2, "--logits-out", logits_mc)
            mc_load.append(t["load_dist"])
            mc_save.append(t["save_dist"])
            mc_calls.append(t["load_dist"] + t["save_dist"])
            mc_walls.append(wall - t.get("logits", 0.0))  # the logits check is not part of it
            if i < args.repeat - 1:  # keep the last pair for checks and sizes
                shutil.rmtree(dst)
                shutil.rmtree(dst2)
        dst, dst2 = f"{root}/tenplex_{args.repeat - 1}", f"{root}/megatron_{args.repeat - 1}"
        dst_bytes, dst2_bytes = dir_bytes(dst), dir_bytes(dst2)

        wall, t, _ = run_worker(DST_CFG, flags, "--load", "dist", "--load-dir", dst,
                                "--logits-out", logits_dst)
        diff = max_abs_diff(logits_src, logits_dst)
        diff_mc = max_abs_diff(logits_mc, logits_dst)
        diff_mc_src = max_abs_diff(logits_src, logits_mc)
        ok = diff_mc == 0.0 and diff <= max(TOL, diff_mc_src)

        best_mc = min(range(args.repeat), key=lambda j: mc_calls[j])
        tenplex_s, megatron_s = min(tp_walls), mc_calls[best_mc]
        no_startup = tenplex_s - startup
        print(f"\ntenplex reshard CLI ({' '.join(tenplex_exe())}): wall {tenplex_s:.2f} s "
              f"(runs {', '.join(f'{x:.2f}' for x in tp_walls)}); "
              f"without start-up ({startup:.2f} s) {no_startup:.2f} s; "
              f"CLI-reported {min(tp_inner):.2f} s; output {dst_bytes / 1e9:.3f} GB")
        print(f"megatron-core tp=1,pp=2 load_dist + save_dist: {megatron_s:.2f} s "
              f"(load {mc_load[best_mc]:.2f} + save {mc_save[best_mc]:.2f}; "
              f"runs {', '.join(f'{x:.2f}' for x in mc_calls)}); "
              f"worker wall {min(mc_walls):.1f} s; output {dst2_bytes / 1e9:.3f} GB")
        print(f"tenplex / megatron: {tenplex_s / megatron_s:.2f} "
              f"(without tenplex start-up {no_startup / megatron_s:.2f})")
        print(f"check: tenplex output loaded by megatron-core at tp=1,pp=2; logits max |diff| vs source "
              f"= {diff:.3g} ({'within' if diff <= TOL else 'OVER'} {TOL:g}); "
              f"vs megatron-core's own tp=1,pp=2 output {diff_mc:.3g} "
              f"(megatron's output vs source {diff_mc_src:.3g}): {'OK' if ok else 'FAIL'}")

        if args.profile:
            profile(src, f"{root}/tenplex_profile", f"{root}/tenplex_reshard.prof")

        result = {
            "tenplex_over_megatron": round(tenplex_s / megatron_s, 4),
            "tenplex_over_megatron_no_startup": round(no_startup / megatron_s, 4),
            "tenplex_cli_wall_s": round(tenplex_s, 3),
            "tenplex_no_startup_s": round(no_startup, 3),
            "tenplex_reported_s": round(min(tp_inner), 3),
            "python_startup_s": round(startup, 3),
            "megatron_load_save_s": round(megatron_s, 3),
            "megatron_load_s": mc_load[best_mc],
            "megatron_save_s": mc_save[best_mc],
            "megatron_worker_wall_s": round(min(mc_walls), 3),
            "src_bytes": src_bytes, "tenplex_dst_bytes": dst_bytes, "megatron_dst_bytes": dst2_bytes,
            "params": m["params"], "max_abs_diff": diff, "max_abs_diff_vs_megatron_output": diff_mc,
            "max_abs_diff_megatron_vs_source": diff_mc_src, "ok": ok,
        }
        if args.keep:
            print(f"kept {root}")
        print(json.dumps(result))
        if not ok:
            sys.exit(1)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Megatron checkpoints through ``tenplex reshard``: bounded memory, and time against megatron-core.

A real megatron-core ``GPTModel`` (GQA, SwiGLU, rope, untied, RMSNorm, fp32)
of about ``--gb`` GB *with its distributed-optimizer state* (fp32 main
params and two Adam moments: 16 bytes per parameter) is trained one step
and saved at ``tp=2,pp=2`` by four gloo processes on CPU
(``integrations/megatron/tests/mcore_worker.py``): as a Megatron-LM legacy
checkpoint (``model_optim_rng.pt`` + ``distrib_optim.pt`` per rank), as a
``torch_dist`` directory with ``fully_reshardable`` optimizer state, and as
one with ``dp_reshardable`` state. Each is then resharded to
``tp=1,pp=4`` by ``python -m tenplex.cli.main`` (what the console script runs; a subprocess):

| case | source | target |
|---|---|---|
| ``legacy_to_legacy`` | legacy + ``distrib_optim.pt`` | legacy + ``distrib_optim.pt`` |
| ``legacy_to_dist`` | legacy + ``distrib_optim.pt`` | ``torch_dist`` |
| ``dist_to_legacy`` | ``torch_dist`` (``fully_reshardable``) | legacy |
| ``dpr_to_dist`` | ``torch_dist`` (``dp_reshardable``) | ``torch_dist`` (planner path) |
| ``dist_to_dist`` | ``torch_dist`` (``fully_reshardable``) | ``torch_dist`` (items copied directly) |

**Memory.** Each run's peak RSS is its process's own high-water mark
(``os.wait4``'s ``ru_maxrss``). The interpreter's baseline is the peak RSS
of a process that imports what the CLI imports for the case (DCP's modules
only when the target is ``torch_dist``: tenplex reads DCP metadata into its
own records) and exits; its wall time is the
start-up shown beside each case. The bound is ``1.5 x (largest source file + largest target file)``;
``peak_rss_over_bound`` = (peak - baseline) / bound, the worst case's
(goal <= 1.0).

**Time.** megatron-core can reshard only ``torch_dist`` checkpoints with
``fully_reshardable`` state (legacy files load only at their own tp and pp,
and ``dp_reshardable`` only across dp). For those two cases the worker at
``tp=1,pp=4`` times its own ``dist_checkpointing.load`` + save (``TIME
load_dist`` + ``TIME save_legacy``/``save_dist``, i.e. without process
start, process groups and model build). ``tenplex_over_megatron`` is the
worse of the two ratios of tenplex's CLI wall time (start-up included) to
that (goal <= 0.5). Both sides run ``--repeat`` times (default 3),
alternately, each after ``os.sync()`` (so neither pays for writing back
the other's output); the ratio is of the medians, and every run's time is
printed. On a 2-core VM single runs of either side vary by up to 1.5x.

**Inspect.** ``tenplex inspect --json`` of the legacy and the ``torch_dist``
source: the CLI's wall time, and, in a process that has already imported
what the command needs, the command's own seconds and the bytes it read
(``/proc/self/io`` ``rchar``); ``inspect_s`` is the slower format's.

**Correctness.** Every output's global tensors (model and optimizer) equal
the source's bit for bit, compared leaf by leaf through tenplex's readers;
megatron-core loads tenplex's ``dist_to_legacy`` output at ``tp=1,pp=4`` and
its logits equal those after megatron-core's own load exactly.

Checkpoints go to a temporary directory on disk (``--shm``: ``/dev/shm``);
each output is removed once measured and checked, the sources at the end.
At most the three sources and two outputs exist at once (about 5 x
``--gb``). The last line is one JSON object. Run it when the machine is
otherwise idle.

Usage: python bench/megatron_reshard.py [--gb 2.0] [--threads 8] [--repeat 3] [--shm]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_common import dir_bytes  # noqa: E402

WORKER = ROOT / "integrations" / "megatron" / "tests" / "mcore_worker.py"
SRC, DST = (2, 2), (1, 4)  # (tp, pp)
TARGET = "dp=1,tp=1,pp=4"
_IMPORTS = ("import tenplex.cli.main as m; m.build_parser(); import tenplex.cli.commands, tenplex.api, "
            "tenplex_megatron.formats.legacy.read, tenplex_megatron.formats.legacy.write")
BASELINE = {  # what a run imports: DCP's reader records are tenplex's own; its writer's are torch's
    "legacy": _IMPORTS,
    "read_dist": _IMPORTS + ", tenplex_megatron.formats.dist.source",
    "write_dist": _IMPORTS + ", tenplex_megatron.formats.dist.source, tenplex_megatron.formats.dist.write, "
                             "tenplex_megatron.formats.dist.direct"}
CASES = {  # name: (source dir, --format, megatron's own comparison: (source dir, save kind) or None)
    "legacy_to_legacy": ("legacy", "megatron-legacy", None),
    "legacy_to_dist": ("legacy", "megatron-dist", None),
    "dist_to_legacy": ("dist_fr", "megatron-legacy", ("dist_fr", "legacy")),
    "dpr_to_dist": ("dist_dpr", "megatron-dist", None),
    "dist_to_dist": ("dist_fr", "megatron-dist", ("dist_fr", "dist")),
}


def model_shape(gb: float) -> dict:
    """Layers/hidden/ffn/vocab for about ``gb`` GB of weights plus distributed-optimizer state."""
    params = gb * 1e9 / 16
    hidden = 1024 if params > 60e6 else 512
    heads, groups, vocab = hidden // 64, hidden // 256, 32768
    ffn = -(-(8 * hidden // 3) // 128) * 128
    kv = hidden // heads
    per_layer = hidden * (heads + 2 * groups) * kv + heads * kv * hidden + 3 * ffn * hidden + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(4, 4 * round((params - fixed) / per_layer / 4))
    return dict(layers=layers, hidden=hidden, heads=heads, query_groups=groups, ffn=ffn, vocab=vocab,
                params=fixed + layers * per_layer)


def worker_flags(m: dict) -> list[str]:
    return ["--layers", str(m["layers"]), "--hidden", str(m["hidden"]), "--heads", str(m["heads"]),
            "--query-groups", str(m["query_groups"]), "--ffn", str(m["ffn"]), "--swiglu",
            "--position", "rope", "--untie", "--vocab", str(m["vocab"]),
            "--make-vocab-size-divisible-by", "128", "--seq", "16", "--batch", "4", "--dist-opt"]


def run_worker(cfg, flags, *extra) -> tuple[float, dict]:
    tp, pp = cfg
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp * pp}",
           str(WORKER), "--tp", str(tp), "--pp", str(pp), *flags, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"worker failed ({' '.join(cmd)}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    times = {line.split()[1]: float(line.split()[2]) for line in done.stdout.splitlines()
             if line.startswith("TIME ")}
    return time.perf_counter() - t0, times


def measured(cmd: list[str]) -> tuple[float, float, str]:
    """Run ``cmd``; its wall seconds, its own peak RSS (MB) and its stdout."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this process's own rusage, not all children's
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.exit(f"failed ({' '.join(cmd)}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return wall, usage.ru_maxrss / 1024, stdout


def tenplex_exe() -> list[str]:
    """``python -m tenplex.cli.main``: what the ``tenplex`` console script runs (``run``), from
    the code on ``sys.path`` whatever entry point an installed copy's metadata names."""
    return [sys.executable, "-m", "tenplex.cli.main"]


_INSPECT = """
import contextlib, io, json, sys, time
from tenplex.cli import commands, formats
import tenplex_megatron.formats.legacy.read, tenplex_megatron.formats.dist.read  # what inspect imports, loaded before timing
formats.formats()
def rchar():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
from tenplex.cli.main import main
t0, r0 = time.perf_counter(), rchar()
with contextlib.redirect_stdout(io.StringIO()):
    code = main(["inspect", sys.argv[1], "--json"])
print(json.dumps({"code": code, "seconds": time.perf_counter() - t0, "bytes_read": rchar() - r0}))
"""


def inspect_cost(path: str) -> dict:
    """``tenplex inspect``: the CLI's wall time, and in one process with its imports loaded
    first, the command's own seconds and the bytes it read (``/proc/self/io`` ``rchar``)."""
    wall, _, _ = measured([*tenplex_exe(), "inspect", path, "--json"])
    done = subprocess.run([sys.executable, "-c", _INSPECT, path], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"inspect failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {"cli_wall_s": round(wall, 2), "inspect_s": round(got["seconds"], 3),
            "bytes_read": got["bytes_read"], "checkpoint_bytes": dir_bytes(path)}


def largest_file(path: str) -> int:
    return max(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if f.endswith((".pt", ".distcp")) and f != "common.pt")


def same_state(a: str, b: str) -> bool:
    """Whether two Megatron checkpoints hold the same global tensors, compared leaf by leaf."""
    code = f"""
import sys, torch
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.shards import assemble
from tenplex_megatron.formats.plugin import LEGACY, DIST
def src(p):
    return (LEGACY if LEGACY.detect(p) else DIST).open_source(p)
def leaf(s, path):
    shards = {{r: {{}} for r in range(s.config.world_size)}}
    for r in range(s.config.world_size):
        if s.sharding.holding(path, s.config.coord(r)) is not None:
            shards[r] = {{path: s.read(s.record(path, r))}}
    sub = type(s.tree)({{path: s.tree[path]}}, s.tree.num_layers)
    return assemble(sub, s.config, shards, padded=False, check_replicas=False)[path]
x, y = src({a!r}), src({b!r})
assert [p for p, _ in x.tree.tensors()] == [p for p, _ in y.tree.tensors()]
bad = [p for p, _ in x.tree.tensors() if not torch.equal(leaf(x, p), leaf(y, p))]
print("DIFF", bad[:3]) if bad else print("SAME")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"comparison failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().endswith("SAME")


def logits_equal(a: str, b: str) -> float:
    import torch

    return (torch.load(a, weights_only=True)["logits"] - torch.load(b, weights_only=True)["logits"]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="checkpoint size with optimizer state (GB)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each side where megatron-core can reshard too; medians compared")
    parser.add_argument("--shm", action="store_true", help="put the checkpoints in /dev/shm (RAM)")
    args = parser.parse_args()

    m = model_shape(args.gb)
    flags = worker_flags(m)
    root = tempfile.mkdtemp(prefix="tenplex-mcore-bench-", dir="/dev/shm" if args.shm else None)
    print(f"model: layers={m['layers']} hidden={m['hidden']} heads={m['heads']} groups={m['query_groups']} "
          f"ffn={m['ffn']} vocab={m['vocab']}: {m['params'] / 1e6:.1f}M params; scratch {root}")
    try:
        src = {k: f"{root}/{k}" for k in ("legacy", "dist_fr", "dist_dpr")}
        w, _ = run_worker(SRC, flags, "--train-steps", "1", "--save", "both", "--save-dir", f"{root}/a")
        os.rename(f"{root}/a/legacy", src["legacy"])
        os.rename(f"{root}/a/dist", src["dist_fr"])
        w2, _ = run_worker(SRC, flags, "--train-steps", "1", "--sharding-type", "dp_reshardable",
                           "--save", "dist", "--save-dir", src["dist_dpr"])
        print(f"sources saved by megatron-core at tp=2,pp=2 ({w + w2:.0f} s): " + ", ".join(
            f"{k} {dir_bytes(v) / 1e9:.2f} GB" for k, v in src.items()))
        inspect = {}
        for name in ("legacy", "dist_fr"):
            inspect[name] = r = inspect_cost(src[name])
            print(f"inspect {name:8s} CLI {r['cli_wall_s']:.2f} s; the command itself {r['inspect_s']:.3f} s, "
                  f"read {r['bytes_read'] / 1e6:.2f} MB of {r['checkpoint_bytes'] / 1e9:.2f} GB", flush=True)
        starts, baselines = {}, {}
        for kind, code in BASELINE.items():
            starts[kind], baselines[kind], _ = measured([sys.executable, "-c", code])
        results, ratios, diff = {}, {}, float("nan")
        for name, (source, fmt, own) in CASES.items():
            kind = "write_dist" if fmt == "megatron-dist" else "read_dist" if "dist" in source else "legacy"
            baseline, startup = baselines[kind], starts[kind]
            dst = f"{root}/out_{name}"
            walls, peaks, megatron = [], [], []
            for i in range(args.repeat if own is not None else 1):  # interleaved: same machine state
                os.sync()  # earlier outputs' dirty pages are written back before either side runs
                wall, peak, out = measured([*tenplex_exe(), "reshard", src[source], dst, "--to", TARGET,
                                            "--format", fmt, "--threads", str(args.threads), "--json"])
                walls.append(wall)
                peaks.append(peak)
                if i == 0:
                    bound = 1.5 * (largest_file(src[source]) + largest_file(dst))
                    written = json.loads(out.strip().splitlines()[-1])["bytes_written"]
                    same = same_state(src[source], dst)
                if own is not None:  # megatron-core's own load + save at the target
                    mc_dst = f"{root}/megatron_{name}"
                    os.sync()
                    _, t = run_worker(DST, flags, "--optimizer", "--load", "dist", "--load-dir", src[own[0]],
                                      "--save", own[1], "--save-dir", mc_dst, "--logits-out",
                                      f"{mc_dst}.logits.pt")
                    megatron.append(t["load_dist"] + t[f"save_{own[1]}"])
                    if i == 0 and own[1] == "legacy":  # megatron-core loads tenplex's output: same logits
                        run_worker(DST, flags, "--optimizer", "--load", "legacy", "--load-dir", dst,
                                   "--logits-out", f"{root}/tenplex.logits.pt")
                        diff = logits_equal(f"{root}/tenplex.logits.pt", f"{mc_dst}.logits.pt")
                        print(f"megatron-core loads tenplex's {name} output: logits max |diff| vs its own "
                              f"load {diff:g}", flush=True)
                    shutil.rmtree(mc_dst)
                shutil.rmtree(dst)
            wall, peak = statistics.median(walls), max(peaks)
            r = results[name] = {"wall_s": round(wall, 2), "wall_runs_s": [round(w, 2) for w in walls],
                                 "startup_s": round(startup, 2), "peak_rss_mb": round(peak, 1),
                                 "baseline_rss_mb": round(baseline, 1),
                                 "over_bound": round((peak - baseline) * 2**20 / bound, 3),
                                 "bound_mb": round(bound / 2**20, 1), "bytes_written": written,
                                 "same_state": same}
            print(f"{name:17s} {wall:7.2f} s  peak RSS {peak:8.1f} MB (baseline {baseline:.0f}), bound "
                  f"{bound / 2**20:8.1f} MB: {r['over_bound']:.3f}; same state {same}", flush=True)
            if megatron:
                mc = statistics.median(megatron)
                ratios[name] = round(wall / mc, 3)
                r["megatron_load_save_s"] = round(mc, 2)
                r["megatron_runs_s"] = [round(m, 2) for m in megatron]
                r["tenplex_over_megatron_no_startup"] = round((wall - startup) / mc, 3)
                print(f"{name:17s} megatron-core load + save at tp=1,pp=4: {mc:.2f} s; tenplex/megatron "
                      f"{ratios[name]:.2f} ({r['tenplex_over_megatron_no_startup']:.2f} without tenplex's "
                      f"start-up, {startup:.2f} s); runs: tenplex {r['wall_runs_s']}, megatron-core "
                      f"{r['megatron_runs_s']}", flush=True)
        worst = max(r["over_bound"] for r in results.values())
        ok = worst <= 1.0 and diff == 0.0 and all(r["same_state"] for r in results.values())
        print(json.dumps({"peak_rss_over_bound": worst, "tenplex_over_megatron": max(ratios.values()),
                          "tenplex_over_megatron_by_case": ratios,
                          "inspect_s": max(r["inspect_s"] for r in inspect.values()),
                          "inspect": inspect, "cases": results, "params": m["params"],
                          "logits_max_abs_diff": diff, "ok": ok}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

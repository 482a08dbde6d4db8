"""Megatron to Hugging Face: ``tenplex reshard SRC DST --format hf`` in bounded memory, against a full
in-memory conversion.

A real megatron-core ``GPTModel`` (Llama: GQA, SwiGLU, rope, RMSNorm,
untied, fp32, weights only) of about ``--gb`` GB is saved at ``tp=2,pp=2``
by four gloo processes on CPU (``integrations/megatron/tests/hf_worker.py``)
as a legacy checkpoint and a ``torch_dist`` directory. Each is exported
with ``python -m tenplex.cli.main reshard SRC DST --to dp=1,tp=1,pp=1
--format hf`` (a subprocess; the ``hf`` format comes from the installed entry
points).

**Memory.** The export's peak RSS is its own process's high-water mark
(``os.wait4``'s ``ru_maxrss``); the baseline is that of a process that
imports what the export imports and exits. The bound is ``1.5 x (largest
source file + largest output shard)``; ``peak_rss_over_bound`` =
(peak - baseline) / bound, the worse format's (goal <= 1.0).

**Time.** The best single-process alternative that runs here: megatron-core
at tp = pp = 1 loads the ``torch_dist`` checkpoint (``dist_checkpointing.load``),
its state dict is renamed and split into transformers' tensors in memory
(the same transforms), a transformers model built on the meta device takes
them (``load_state_dict(assign=True)``) and ``save_pretrained`` writes it. It
runs as one plain ``python`` process (``RANK=0 WORLD_SIZE=1``, no torchrun
launcher), as a user would run a conversion script. Two ratios, each like
for like, medians of ``--repeat`` alternating runs (goal <= 0.5 for both):

- ``tenplex_over_alternative`` (the headline): whole process against whole
  process, as a user waits for each command: tenplex's CLI (interpreter
  start, imports, open, plan, read, write) against the alternative's
  process (interpreter start, imports of torch, megatron-core and
  transformers, process group, model build, load, conversion, save). Each
  tool's start-up is what using it costs, so both are charged theirs.
- ``export_over_alternative``: in-process against in-process, start-up left
  out on both sides: the CLI's own "resharded ... in S s" (open, plan, read,
  write) against the alternative's ``TIME hf_convert`` (load to save, model
  already built). This is the conversion itself.

``cpu_*`` are the same ratios in CPU seconds (user + system, every thread):
on a machine shared with other jobs, wall times swing with their load, CPU
seconds much less.

**Correctness.** Both sides' outputs hold the same tensors bit for bit
(every key of tenplex's shards against the alternative's ``save_pretrained``).

The last line is one JSON object. Run it when the machine is otherwise idle.

Usage: python bench/hf_export.py [--gb 2.0] [--threads 8] [--repeat 3] [--shm] [--sources DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_common import dir_bytes  # noqa: E402

WORKER = ROOT / "integrations" / "megatron" / "tests" / "hf_worker.py"
_IMPORTS = ("import sys; import tenplex.cli.main as m; m.build_parser(); import tenplex.cli.commands, tenplex.api; "
            "from tenplex.formats.registry import formats; "
            "import tenplex_megatron.formats.legacy.read, tenplex_megatron.formats.dist.source; "
            "import tenplex_megatron.formats.hf.plugin, tenplex_megatron.formats.hf.export; "
            "import safetensors.torch; assert 'hf' in formats(), sorted(formats())")
_CLI = (_IMPORTS + "\nimport time; cpu = time.process_time(); code = m.main(sys.argv[1:])"
        "\nprint(f'EXPORT_CPU {time.process_time() - cpu:.3f}', file=sys.stderr); sys.exit(code)")


def model_shape(gb: float) -> dict:
    """Layers/hidden/ffn/vocab of a Llama-style GPT of about ``gb`` GB of fp32 weights."""
    params = gb * 1e9 / 4
    hidden = 2048 if params > 300e6 else 1024
    heads, groups, vocab = hidden // 128, hidden // 512, 32000
    ffn = -(-(8 * hidden // 3) // 256) * 256
    per_layer = hidden * (heads + 2 * groups) * 128 + heads * 128 * hidden + 3 * ffn * hidden + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(4, 4 * round((params - fixed) / per_layer / 4))
    return dict(layers=layers, hidden=hidden, heads=heads, query_groups=groups, ffn=ffn, vocab=vocab,
                params=fixed + layers * per_layer)


def worker_flags(m: dict) -> list[str]:
    return ["--layers", str(m["layers"]), "--hidden", str(m["hidden"]), "--heads", str(m["heads"]),
            "--query-groups", str(m["query_groups"]), "--ffn", str(m["ffn"]), "--swiglu", "--position", "rope",
            "--untie", "--vocab", str(m["vocab"]), "--make-vocab-size-divisible-by", "128", "--seq", "16",
            "--eps", "1e-5", "--rotary-base", "500000"]


def run_worker(n: int, flags: list[str], *extra: str) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", str(WORKER),
           *flags, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"worker failed ({' '.join(cmd)}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return time.perf_counter() - t0, _times(done.stdout)


def _times(out: str) -> dict:
    return {line.split()[1]: float(line.split()[2]) for line in out.splitlines() if line.startswith("TIME ")}


def run_alternative(flags: list[str], *extra: str) -> tuple[float, float, dict]:
    """The worker as one plain ``python`` process (no launcher); its wall and CPU seconds and its TIME lines."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    wall, _, out, cpu = measured([sys.executable, str(WORKER), *flags, *extra], env)
    return wall, cpu, _times(out)


def measured(cmd: list[str], env: dict | None = None) -> tuple[float, float, str, float]:
    """Run ``cmd``; its wall seconds, its own peak RSS (MB), its output and its CPU seconds (user + system)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed ({' '.join(cmd)}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return wall, usage.ru_maxrss / 1024, stdout + stderr, usage.ru_utime + usage.ru_stime


def largest(path: str, suffixes: tuple[str, ...]) -> int:
    return max(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if f.endswith(suffixes) and f != "common.pt")


def same_tensors(a: str, b: str) -> bool:
    """Whether two HF directories hold the same tensors, key by key, bit for bit."""
    import torch
    from safetensors import safe_open

    def tensors(d):
        return {k: f for f in pathlib.Path(d).glob("*.safetensors") for k in safe_open(str(f), "pt").keys()}

    x, y = tensors(a), tensors(b)
    if sorted(x) != sorted(y):
        return False
    for key in x:
        with safe_open(str(x[key]), "pt") as fa, safe_open(str(y[key]), "pt") as fb:
            if not torch.equal(fa.get_tensor(key), fb.get_tensor(key)):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="checkpoint size (GB of fp32 weights)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shm", action="store_true", help="put the checkpoints in /dev/shm (RAM)")
    parser.add_argument("--sources", default=None,
                        help="keep the saved checkpoints in this folder and reuse them when it holds "
                             "legacy/ and dist/ (saved by this script at the same --gb)")
    args = parser.parse_args()
    m = model_shape(args.gb)
    flags = worker_flags(m)
    root = tempfile.mkdtemp(prefix="tenplex-hf-bench-", dir="/dev/shm" if args.shm else None)
    print(f"model: layers={m['layers']} hidden={m['hidden']} heads={m['heads']} groups={m['query_groups']} "
          f"ffn={m['ffn']} vocab={m['vocab']}: {m['params'] / 1e6:.1f}M params; scratch {root}", flush=True)
    try:
        saved = args.sources or f"{root}/src"
        src = {"legacy": f"{saved}/legacy", "dist": f"{saved}/dist"}
        w = 0.0
        if not all(os.path.isdir(p) for p in src.values()):
            w, _ = run_worker(4, flags, "--tp", "2", "--pp", "2", "--save", "both", "--save-dir", saved)
        print(f"sources saved by megatron-core at tp=2,pp=2 ({w:.0f} s): " + ", ".join(
            f"{k} {dir_bytes(v) / 1e9:.2f} GB" for k, v in src.items()), flush=True)
        start, baseline, _, start_cpu = measured([sys.executable, "-c", _IMPORTS])
        cases, alt = {}, {"convert": [], "convert_cpu": [], "process": [], "process_cpu": []}
        for name, path in src.items():
            walls, peaks, cpus, inner, inner_cpus = [], [], [], [], []
            for i in range(args.repeat):
                dst = f"{root}/hf_{name}"
                os.sync()
                wall, peak, err, cpu = measured([sys.executable, "-c", _CLI, "reshard", path, dst, "--to",
                                            "dp=1,tp=1,pp=1", "--format", "hf", "--threads", str(args.threads)])
                said_s = re.search(r"resharded .* in ([0-9.]+) s", err)
                inner.append(float(said_s.group(1)) if said_s else wall)
                inner_cpus.append(float(re.search(r"EXPORT_CPU ([0-9.]+)", err).group(1)))
                walls.append(wall)
                peaks.append(peak)
                cpus.append(cpu)
                if i == 0:
                    bound = 1.5 * (largest(path, (".pt", ".distcp")) + largest(dst, (".safetensors",)))
                    said = [line for line in err.splitlines() if "optimizer state" in line]
                if name == "dist":  # the alternative, alternating with tenplex's runs
                    out = f"{root}/alt"
                    os.sync()
                    alt_wall, alt_cpu, t = run_alternative(flags, "--load", "dist", "--load-dir", path,
                                                           "--hf-save", out)
                    for key, value in (("convert", t["hf_convert"]), ("convert_cpu", t["hf_convert_cpu"]),
                                       ("process", alt_wall), ("process_cpu", alt_cpu)):
                        alt[key].append(value)
                    if i == 0:
                        same = same_tensors(dst, out)
                    shutil.rmtree(out)
                if i < args.repeat - 1 or name != "dist":
                    shutil.rmtree(dst)
            peak, wall = max(peaks), statistics.median(walls)
            cases[name] = r = {"wall_s": round(wall, 2), "wall_runs_s": [round(x, 2) for x in walls],
                               "cpu_s": round(statistics.median(cpus), 2),
                               "export_s": round(statistics.median(inner), 2),
                               "export_runs_s": [round(x, 2) for x in inner],
                               "export_cpu_s": round(statistics.median(inner_cpus), 2),
                               "peak_rss_mb": round(peak, 1), "baseline_rss_mb": round(baseline, 1),
                               "bound_mb": round(bound / 2**20, 1),
                               "over_bound": round((peak - baseline) * 2**20 / bound, 3),
                               "weights_only_line": said[0] if said else None}
            print(f"{name:7s} process {wall:6.2f} s (runs {r['wall_runs_s']}; imports alone {start:.2f} s), CPU "
                  f"{r['cpu_s']:.2f} s; export {r['export_s']:.2f} s (runs {r['export_runs_s']}), CPU "
                  f"{r['export_cpu_s']:.2f} s; peak RSS {peak:.0f} MB (baseline {baseline:.0f}), bound "
                  f"{bound / 2**20:.0f} MB: {r['over_bound']:.3f}", flush=True)
        med = {k: statistics.median(v) for k, v in alt.items()}
        d = cases["dist"]
        ratios = {"tenplex_over_alternative": d["wall_s"] / med["process"],
                  "cpu_tenplex_over_alternative": d["cpu_s"] / med["process_cpu"],
                  "export_over_alternative": d["export_s"] / med["convert"],
                  "cpu_export_over_alternative": d["export_cpu_s"] / med["convert_cpu"]}
        ratios = {k: round(v, 3) for k, v in ratios.items()}
        print(f"alternative (megatron-core load + in-memory conversion + save_pretrained): process "
              f"{med['process']:.2f} s (runs {[round(x, 2) for x in alt['process']]}), CPU {med['process_cpu']:.2f} s; "
              f"load to save {med['convert']:.2f} s (runs {[round(x, 2) for x in alt['convert']]}), CPU "
              f"{med['convert_cpu']:.2f} s. tenplex/alternative: whole processes {ratios['tenplex_over_alternative']:.2f} "
              f"(CPU {ratios['cpu_tenplex_over_alternative']:.2f}), in-process {ratios['export_over_alternative']:.2f} "
              f"(CPU {ratios['cpu_export_over_alternative']:.2f}); same tensors {same}")
        worst = max(c["over_bound"] for c in cases.values())
        print(json.dumps({"peak_rss_over_bound": worst, **ratios,
                          "alternative_process_s": round(med["process"], 2),
                          "alternative_s": round(med["convert"], 2),
                          "alternative_cpu_s": round(med["convert_cpu"], 2),
                          "alternative_runs_s": {k: [round(x, 2) for x in v] for k, v in alt.items()},
                          "cases": cases, "same_tensors": same, "params": m["params"],
                          "ok": worst <= 1.0 and same and all(c["weights_only_line"] for c in cases.values())}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

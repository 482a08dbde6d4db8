"""Peak RSS and time of ``tenplex inspect`` on a ~20 KB hostile manifest as its numbers grow.

Issue 20: a 20 KB manifest stating ``dp`` (or ``tp``) of 65536 made the
parser compute every holder class before any record was checked: over 1 GB
and minutes. Now the holder classes are counted against the records listed
and the parse stops early, so both numbers must stay flat as the stated
degree grows from 2 to 32768 (the world stays within ``MAX_WORLD``).

Each point runs the installed console script in a fresh process (through a
small wrapper that reports its child's ``ru_maxrss``), side by side in one
run; the ratios largest/smallest are printed. The last line is JSON.

The hostile manifests are written compact (no indentation): about 20 KB
(the manifest of a one-layer model with the distributed optimizer at dp=2, tp=1),
the size the issue names; the JSON line reports the largest.

Usage: ``python bench/hostile_inspect.py [--repeat 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from tenplex.api import save
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize

_WRAPPER = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
            "r.returncode, repr(r.stderr.strip().splitlines()[-1:]))")


def _store(root: str) -> str:
    spec = GPTSpec(num_layers=1, hidden=32, heads=4, query_groups=2, ffn=64, vocab=128,
                   optimizer="distributed_adam", bucket_numel=2000)
    tree, a = gpt_tree(spec), P(dp=2, tp=1)
    state = random_state(tree, a, 0)
    path = os.path.join(root, "pristine")
    save(path, tree, a, {r: materialize(tree, state, a, r) for r in range(a.world_size)})
    return path


def _hostile(pristine: str, root: str, dp: int) -> str:
    path = os.path.join(root, f"dp{dp}")
    shutil.copytree(pristine, path)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["config"]["dp"] = dp
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f, separators=(",", ":"))  # compact: the hostile file is ~20 KB
    return path


def _inspect(path: str) -> tuple[float, float, int, str]:
    script = shutil.which("tenplex", path=os.path.dirname(sys.executable)) or "tenplex"
    out = subprocess.run([sys.executable, "-c", _WRAPPER, script, "inspect", path],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    seconds, rss_kb, rc, last = out.stdout.split(" ", 3)
    return float(seconds), int(rss_kb) / 1024, int(rc), last.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--degrees", default="2,16,256,4096,32768")
    args = parser.parse_args()
    degrees = [int(x) for x in args.degrees.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        pristine = _store(root)
        paths = {dp: _hostile(pristine, root, dp) for dp in degrees}
        size = max(os.path.getsize(os.path.join(p, "manifest.json")) for p in paths.values())
        for dp in degrees:
            runs = [_inspect(paths[dp]) for _ in range(args.repeat)]
            seconds = min(r[0] for r in runs)
            rss = max(r[1] for r in runs)
            rows.append({"dp": dp, "seconds": round(seconds, 3), "peak_rss_mib": round(rss, 1),
                         "exit": runs[0][2]})
            print(f"dp={dp:>6}  manifest {size / 1024:.1f} KiB  inspect {seconds:.2f} s  "
                  f"peak RSS {rss:.0f} MiB  exit {runs[0][2]}  {runs[0][3][:120]}")
    result = {"bench": "hostile_inspect", "manifest_kib": round(size / 1024, 1), "rows": rows,
              "time_ratio_max_over_min": round(max(r["seconds"] for r in rows) / min(r["seconds"] for r in rows), 2),
              "rss_ratio_max_over_min": round(max(r["peak_rss_mib"] for r in rows)
                                              / min(r["peak_rss_mib"] for r in rows), 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Reading legacy ``.pt`` files: byte ranges after a meta load, against ``torch.load(mmap=True)``.

Issue 11 suggests ``torch.load(mmap=True, weights_only=True)`` for Megatron-LM
legacy files. tenplex instead loads each file's pickle on the meta device
(after its restricted unpickler) and reads each tensor's bytes by range
(:mod:`tenplex_megatron.torchfiles.ptfile`). This script reads every tensor of every
``.pt`` file of a legacy checkpoint both ways, each file in a fresh process
with the file already in the page cache, and materializes each tensor once
(as a conversion's target needs it) before dropping it:

- ``ranges``: :func:`~tenplex_megatron.torchfiles.ptfile.load_refs`, then
  :meth:`TensorRef.read` per tensor (``readinto`` a fresh buffer);
- ``mmap``: :func:`~tenplex_megatron.torchfiles.safe_load.safe_load` with ``mmap=True``
  (the same restricted unpickler first, then ``torch.load(mmap=True,
  weights_only=True)``), then ``clone()`` per tensor.

Per method it prints the summed wall and CPU seconds and the largest peak
RSS over the process's baseline (``ru_maxrss``, which counts the mapped file
pages a process touched). The last line is one JSON object.

Usage: python bench/legacy_read.py LEGACY_CHECKPOINT_DIR [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = """
import json, resource, sys, time, torch
from tenplex_megatron.torchfiles.ptfile import TensorRef, load_refs
from tenplex_megatron.torchfiles.safe_load import safe_load
method, path = sys.argv[1], sys.argv[2]
def leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values(): yield from leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj: yield from leaves(v)
    elif isinstance(obj, (TensorRef, torch.Tensor)):
        yield obj
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0, c0, n = time.perf_counter(), time.process_time(), 0
if method == "ranges":
    obj, _ = load_refs(path)
    for ref in leaves(obj):
        t, _ = ref.read()
        n += t.numel() * t.element_size()
        del t
else:
    obj = safe_load(path, mmap=True)
    for m in leaves(obj):
        t = m.clone()
        n += t.numel() * t.element_size()
        del t
del obj
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "bytes": n,
                  "rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))
"""


def _files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".pt"))


def _run(method: str, path: str) -> dict:
    with open(path, "rb") as f:  # into the page cache: time the reading, not the disk
        while f.read(1 << 24):
            pass
    done = subprocess.run([sys.executable, "-c", _CHILD, method, path], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{method} {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="a Megatron-LM legacy checkpoint directory")
    parser.add_argument("--repeat", type=int, default=3, help="runs per method; the best is kept")
    args = parser.parse_args()
    files = _files(args.root)
    out = {}
    for method in ("ranges", "mmap"):
        best = None
        for _ in range(args.repeat):
            runs = [_run(method, f) for f in files]
            total = {"wall_s": sum(r["wall"] for r in runs), "cpu_s": sum(r["cpu"] for r in runs),
                     "bytes": sum(r["bytes"] for r in runs),
                     "peak_rss_over_baseline_mb": max(r["rss_mb"] for r in runs),
                     "largest_file_mb": max(os.path.getsize(f) for f in files) / 2**20}
            if best is None or total["wall_s"] < best["wall_s"]:
                best = total
        out[method] = {k: round(v, 3) if isinstance(v, float) else v for k, v in best.items()}
        print(f"{method:6s} {len(files)} files, {best['bytes'] / 1e9:.2f} GB: {best['wall_s']:.2f} s wall, "
              f"{best['cpu_s']:.2f} s CPU, peak RSS +{best['peak_rss_over_baseline_mb']:.0f} MB "
              f"(largest file {best['largest_file_mb']:.0f} MB)", flush=True)
    out["mmap_over_ranges_wall"] = round(out["mmap"]["wall_s"] / out["ranges"]["wall_s"], 3)
    out["mmap_over_ranges_rss"] = round(out["mmap"]["peak_rss_over_baseline_mb"] /
                                        max(out["ranges"]["peak_rss_over_baseline_mb"], 1e-9), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

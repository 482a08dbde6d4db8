"""Peak memory of ``tenplex.verify`` on a 1 GB store: streamed (now) against whole files (before).

Writes a GPT-style checkpoint of about ``--gb`` GB (bf16 weights, fp32 Adam
state; saved under ``dp=1,tp=2,pp=1``, so two shard files of about half a GB
each), then verifies it twice, each time in a fresh child process:

- ``streamed``: ``tenplex.verify`` (files read block by block, several at once);
- ``whole_file``: the way ``verify`` worked before, each file read into
  memory whole (``fs.cat_file``) and its blocks hashed.

Each child measures its RSS after imports and after opening the manifest
(the interpreter's baseline), resets the peak (``/proc/self/clear_refs``),
runs, and reports peak RSS (``VmHWM``) over that baseline. The last line is
one JSON object: ``store_bytes``, ``files``, ``streamed_peak_mb``,
``whole_file_peak_mb`` (MB over the baseline), ``whole_over_streamed`` and
the seconds of each. The goal is ``streamed_peak_mb < 200`` for 1 GB.

Usage: python bench/verify_memory.py [--gb 1.0] [--dir /tmp] [--threads 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import make_spec, peak_rss_mb, reset_peak_rss  # noqa: E402

CONFIG = "dp=1,tp=2,pp=1"


def write_store(url: str, gb: float) -> int:
    from tenplex.api import save
    from tenplex.models import gpt_tree, random_state
    from tenplex.ptree import ParallelConfig, materialize

    config = ParallelConfig.parse(CONFIG)
    tree = gpt_tree(make_spec(gb * 1e9))
    state = random_state(tree, config, 0)
    shards = {r: materialize(tree, state, config, r) for r in range(config.world_size)}
    del state
    manifest = save(url, tree, config, shards)
    return sum(f.size for f in manifest.files.values())


def whole_file_verify(reader) -> None:
    """Before: each file read whole, then every block hashed."""
    from tenplex.store.blocks import digest

    for key, frec in reader.manifest.files.items():
        reader.check_file(key)
        data = reader.root.fs.cat_file(reader.root.key(key))
        for index in range(len(frec.digests)):
            part = memoryview(data)[index * frec.block:(index + 1) * frec.block]
            if digest(part) != frec.digests[index]:
                raise reader.mismatch(key, index, digest(part))


def child(url: str, kind: str, threads: int, queue) -> None:
    from tenplex.store.reader import StoreReader
    from tenplex.store.verify import verify_store

    reader = StoreReader(url)
    base = reset_peak_rss()
    start = time.perf_counter()
    if kind == "streamed":
        verify_store(reader, threads=threads)
    else:
        whole_file_verify(reader)
    queue.put({"seconds": time.perf_counter() - start, "peak_mb": peak_rss_mb() - base,
               "baseline_mb": base})


def measure(url: str, kind: str, threads: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(url, kind, threads, queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="store size, in GB (default 1)")
    parser.add_argument("--dir", default=None, help="where to write the store (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=4, help="files verified at once")
    args = parser.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="tenplex-verify-bench-")
    try:
        url = f"{root}/ck"
        stored = write_store(url, args.gb)
        files = len(list(Path(url, "shards").iterdir()))
        streamed = measure(url, "streamed", args.threads)
        whole = measure(url, "whole_file", args.threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"store: {stored / 1e9:.2f} GB in {files} files; interpreter baseline "
          f"{streamed['baseline_mb']:.0f} MB", file=sys.stderr)
    print(json.dumps({
        "store_bytes": stored, "files": files, "threads": args.threads,
        "streamed_peak_mb": round(streamed["peak_mb"], 1),
        "whole_file_peak_mb": round(whole["peak_mb"], 1),
        "whole_over_streamed": round(whole["peak_mb"] / max(streamed["peak_mb"], 1e-9), 1),
        "streamed_s": round(streamed["seconds"], 2), "whole_file_s": round(whole["seconds"], 2),
    }))


if __name__ == "__main__":
    main()

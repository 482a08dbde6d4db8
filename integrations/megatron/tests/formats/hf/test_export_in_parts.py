"""The ``hf`` format written in parts (issue 25): several processes write its shard files, one commits.

The Llama source of the export tests (megatron-core at tp=2, pp=2, torch_dist)
is exported in small shards (``--max-shard-size 100000``: ten files, so every
process has some). In one process, parts are written one after another: the
commit must refuse a short or a missing file with nothing visible, and
otherwise give the single-process export byte for byte, each part having read
only the bytes its files need. Under torchrun with four processes: a worker
killed mid-run fails the job within 60 s with nothing at the destination, and
the rerun gives the single-process export byte for byte, which transformers
loads with megatron-core's logits.
"""

from __future__ import annotations

import json
import time

import pytest

from tenplex.api import verify
from tenplex.errors import CorruptShardError, TenplexError
from tenplex.formats import Part, detect, get_format

from hf_cases import hf_logits, reference
from mcore_helpers import core_torchrun_helpers

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
SHARD = 100_000
TOL = 1e-5


def _files(root) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file under ``root``."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _single(src, dst):
    """The single-process export of ``src`` at ``dst`` (the reference output); its WriteResult."""
    return get_format("hf").write(detect(str(src)).open_source(str(src)), str(dst), None,
                                  max_shard_size=SHARD, threads=2)


def _parts(src, dst, token: str, n: int = 3) -> list[tuple]:
    """Every part's ``(WriteResult, source bytes read for tensors)``, written one after another, each
    from its own source (as its own process would open it; the bytes read opening it left out)."""
    out = []
    for i in range(n):
        source = detect(str(src)).open_source(str(src))
        opened = source.bytes_read
        r = get_format("hf").write(source, str(dst), None, part=Part(i, n, token), max_shard_size=SHARD,
                                   threads=2)
        out.append((r, source.bytes_read - opened))
    return out


def test_parts_commit_once_to_the_single_process_export_and_a_bad_part_commits_nothing(hf_sources, tmp_path):
    src = hf_sources("llama", 4, "--tp 2 --pp 2") / "dist"
    fmt, single, dst = get_format("hf"), tmp_path / "single", tmp_path / "hf"
    one = _single(src, single)

    done = _parts(src, dst, "run1")
    parts = [r.part for r, _ in done]
    assert not dst.exists()  # written, not visible
    expected = parts[0]["expected"]
    assert len(expected) >= 6 and sorted(f for p in parts for f in p["files"]) == sorted(expected)
    assert all(p["files"] for p in parts)  # split by bytes: every part writes some
    # each part reads only the bytes its files need: together, what the single process read
    assert sum(r.bytes_needed for r, _ in done) == one.bytes_needed
    print({"needed": [r.bytes_needed for r, _ in done], "read": [read for _, read in done],
           "single": [one.bytes_needed, one.bytes_read]})
    assert all(read <= 1.05 * r.bytes_needed for r, read in done)
    victim = sorted(parts[1]["files"])[0]
    path = tmp_path / "hf.tenplex-partial-run1" / victim
    path.write_bytes(path.read_bytes()[:-1])  # a file one byte short of what its part reported
    with pytest.raises(CorruptShardError, match=f"{victim}: expected .* bytes as its part reported"):
        fmt.commit(str(dst), None, parts, part=Part(0, 3, "run1"))
    with pytest.raises(CorruptShardError, match="missing"):  # a part that never reported
        fmt.commit(str(dst), None, parts[:2], part=Part(0, 3, "run1"))
    assert not dst.exists()
    fmt.abort(str(dst), part=Part(0, 3, "run1"), everything=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["single"]

    parts = [r.part for r, _ in _parts(src, dst, "run2")]
    assert fmt.commit(str(dst), None, parts, part=Part(0, 3, "run2")).files == len(expected)
    verify(str(dst))
    assert _files(dst) == _files(single)  # shards, index and config, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "single"]


def test_four_processes_export_as_one_and_a_killed_worker_leaves_nothing(hf_sources, tmp_path):
    """SIGKILL of worker 2 mid-run: torchrun fails within 60 s naming it, nothing is at the destination
    and no partial folder is left; the rerun equals the single-process export byte for byte and
    transformers loads it with megatron-core's logits."""
    launch = core_torchrun_helpers()
    cached = hf_sources("llama", 4, "--tp 2 --pp 2")
    src, dst, single = cached / "dist", tmp_path / "hf", tmp_path / "single"
    args = ["reshard", str(src), str(dst), "--format", "hf", "--max-shard-size", str(SHARD), "--threads", "1"]
    job = launch.torchrun(4, args)  # the default --timeout: torchrun's SIGTERM stops the others
    out, _ = launch.kill_mid_run(job, 2, lambda: any(tmp_path.glob("hf.tenplex-partial-*")),
                                      lambda: any(tmp_path.glob("hf.tenplex-partial-*/*.safetensors")))
    with pytest.raises(TenplexError):
        verify(str(dst))
    time.sleep(1)
    assert list(tmp_path.iterdir()) == [], (list(tmp_path.rglob("*")), out[-6000:])  # no model, no partial folder

    rerun = launch.torchrun(4, args + ["--json"])
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out[-3000:]
    report = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert report["format"] == "hf" and len(report["processes"]) == 4
    assert all(p["ranks"] for p in report["processes"])  # every process wrote some of the files
    verify(str(dst))
    _single(src, single)
    assert _files(dst) == _files(single)  # byte for byte
    ref, tokens = reference(cached)
    assert (hf_logits(dst, tokens) - ref).abs().max().item() <= TOL

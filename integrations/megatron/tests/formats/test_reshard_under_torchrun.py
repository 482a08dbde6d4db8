"""``tenplex reshard`` of real megatron-core checkpoints under torchrun (issue 25).

The legacy and torch_dist checkpoints of one megatron-core run (tp=2, pp=2,
tied embeddings) are resharded to a tenplex store at tp=1, pp=4 by four
processes (torchrun --standalone, gloo); the result verifies and equals the
single-process reshard tensor for tensor, bit for bit. The same checkpoints
are resharded to megatron-legacy and megatron-dist targets by four processes
that write parts and commit once: every file equals the single-process
output byte for byte, and a SIGKILLed worker leaves nothing visible.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tenplex.api import load_global, reshard, verify
from tenplex.errors import TenplexError
from tenplex.formats import get_format
from tenplex.ptree.config import ParallelConfig

from mcore_helpers import core_torchrun_helpers

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

DST = "dp=1,tp=1,pp=4"


def _torchrun(nproc: int, args: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--monitor-interval=0.5", "-m", "tenplex", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_four_processes_reshard_a_megatron_checkpoint_as_one_process_does(sources, tmp_path, fmt):
    src = sources("mha", 2, 2) / fmt
    single, dst = tmp_path / "single", tmp_path / "dst"
    one = reshard(str(src), str(single), ParallelConfig.parse(DST), format="tenplex", threads=2)
    report = _torchrun(4, ["reshard", str(src), str(dst), "--to", DST, "--format", "tenplex", "--json",
                           "--threads", "2"])
    verify(str(dst))
    a, b = load_global(str(dst)), load_global(str(single))
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and v.shape == b[k].shape, k
            assert torch.equal(v.reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
        else:
            assert v == b[k], k
    assert sorted(r for p in report["processes"] for r in p["ranks"]) == [0, 1, 2, 3]
    # the reads, counted. Opening the source (its pickles or DCP index, and the tied-copy check)
    # costs each process what it costs one (not shared yet: issue 25's byte goal is not met for
    # Megatron sources); beyond that each process reads only the tensor bytes its files need
    # (legacy: 4 x 273 KB of pickles against 567 KB of tensors on this small model)
    opened = get_format(f"megatron-{fmt}").open_source(str(src)).bytes_read
    for p in report["processes"][1:]:  # process 0 also reads the values (RNG states, steps)
        assert p["bytes_read"] - opened <= 1.05 * p["bytes_needed"], p
    assert report["bytes_read"] <= 1.05 * one.bytes_needed + (one.bytes_read - one.bytes_needed) + 3 * opened
    print(json.dumps({"format": fmt, "bytes_read": report["bytes_read"], "single_needed": one.bytes_needed,
                      "opened_per_process": opened,
                      "single_read": one.bytes_read,
                      "per_process": [p["bytes_read"] for p in report["processes"]]}))


def _files(root) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file under ``root`` (hidden temporary folders included)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _dcp_metadata(folder) -> tuple[dict, dict]:
    """A torch_dist folder's ``.metadata`` as comparable dicts: items (chunks as a set) and byte ranges."""
    from torch.distributed.checkpoint import FileSystemReader  # our own output, in a test
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = FileSystemReader(str(folder)).read_metadata()
    items = {k: (str(v.properties.dtype), tuple(v.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
             if isinstance(v, TensorStorageMetadata) else "bytes" for k, v in md.state_dict_metadata.items()}
    storage = {(i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset, s.length)
               for i, s in md.storage_data.items()}
    return items, storage


@pytest.mark.parametrize("fmt,target", [("legacy", "megatron-dist")])  # dist -> legacy: the kill test's rerun
def test_four_processes_write_a_megatron_target_byte_for_byte_as_one_process_does(sources, tmp_path, fmt,
                                                                                    target):
    """Megatron targets under torchrun: each process writes its part, process 0 commits (issue 25)."""
    src = sources("mha", 2, 2) / fmt
    single, dst = tmp_path / "single", tmp_path / "dst"
    reshard(str(src), str(single), ParallelConfig.parse(DST), format=target, threads=2)
    report = _torchrun(4, ["reshard", str(src), str(dst), "--to", DST, "--format", target, "--json",
                           "--threads", "2"])
    assert report["format"] == target and len(report["processes"]) == 4
    assert sorted(r for p in report["processes"] for r in p["ranks"]) == [0, 1, 2, 3]
    assert all(len(p["ranks"]) == 1 for p in report["processes"])  # balanced: one stage each
    verify(str(dst), checksums=True)
    one, many = _files(single), _files(dst)
    assert one.keys() == many.keys()  # no temporary folder left, the same files
    for name in one:  # every file the same bytes (tensors, pickled args, rng, CRC-32s), but the index
        if not name.endswith(".metadata"):
            assert one[name] == many[name], name
    if target == "megatron-dist":  # the merged DCP index: the same items, chunks and byte ranges
        it = "iter_" + one["latest_checkpointed_iteration.txt"].decode().zfill(7)
        assert _dcp_metadata(dst / it) == _dcp_metadata(single / it)


def test_a_killed_worker_commits_no_megatron_checkpoint_and_a_rerun_succeeds(sources, tmp_path):
    """SIGKILL of one worker mid-run: torchrun fails within 60 s, nothing is visible, a rerun verifies
    and equals the single-process legacy output byte for byte."""
    launch = core_torchrun_helpers()
    src, dst, single = sources("mha", 2, 2) / "dist", tmp_path / "dst", tmp_path / "single"
    args = ["reshard", str(src), str(dst), "--to", DST, "--format", "megatron-legacy", "--threads", "1"]
    job = launch.torchrun(4, args)
    out, _ = launch.kill_mid_run(job, 2, lambda: dst.is_dir() and any(dst.glob(".iter_*.tmp-*")),
                                      lambda: len(list(dst.rglob("model_optim_rng.pt"))) >= 3)
    with pytest.raises(TenplexError):
        verify(str(dst))
    time.sleep(1)
    assert [p.name for p in dst.iterdir()] == [], list(dst.rglob("*"))  # no tracker, folder, or part
    rerun = launch.torchrun(4, args)
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out[-3000:]
    verify(str(dst))
    reshard(str(src), str(single), ParallelConfig.parse(DST), format="megatron-legacy", threads=2)
    one, many = _files(single), _files(dst)
    assert one.keys() == many.keys() and all(one[k] == many[k] for k in one)  # byte for byte

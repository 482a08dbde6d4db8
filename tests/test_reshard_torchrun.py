"""``tenplex reshard`` under torchrun (issue 25): the same result as one process, one commit, fail together.

Every multi-process test runs torchrun --standalone with gloo on this machine;
each output is compared bit for bit with the single-process reshard's, and
both with the source's assembled global tensors.
"""

import json
import os
import signal
import time

import pytest
import torch

from tenplex.api import load_global, reshard, verify
from tenplex.errors import TenplexError
from tenplex.ptree.config import ParallelConfig
from tenplex.store.safetensors_format import Entry
from tenplex.store.split import split_files
from tests.helpers.torchrun_reshard import descendants, gpt_store, torchrun, worker_rank

SRC = ParallelConfig(dp=1, tp=2, pp=1)
DST = "dp=1,tp=1,pp=4"


def _same(a: dict, b: dict, tensors_only: bool = False) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k
        elif not tensors_only:  # rank-scoped values (rng states) are keyed by config
            assert a[k] == b[k], k


def _run(nproc, src, dst, *, no_python=False, extra=(), to=DST):
    p = torchrun(nproc, ["reshard", str(src), str(dst), "--to", to, "--format", "tenplex", "--json",
                         "--threads", "2", *extra], no_python=no_python)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-4000:]
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _check(src, dst, single, report, nproc):
    verify(str(dst))
    _same(load_global(str(dst)), load_global(str(single)))
    _same(load_global(str(dst)), load_global(str(src)), tensors_only=True)
    assert len(report["processes"]) == nproc
    ranks = sorted(r for p in report["processes"] for r in p["ranks"])
    assert ranks == list(range(ParallelConfig.parse(DST).world_size))


def test_split_keeps_each_stage_on_one_process_and_balances_bytes():
    config = ParallelConfig(dp=1, tp=2, pp=4)
    entries = {r: [Entry(f"layer{config.coord(r).pp}", "float32", (100 + r,))] for r in range(8)}
    parts = split_files(entries, 4, config)
    assert sorted(r for p in parts for r in p) == list(range(8))
    assert sorted(sorted({config.coord(r).pp for r in p}) for p in parts) == [[0], [1], [2], [3]]
    # fewer stages than processes: a stage is split, every process gets work
    parts = split_files(entries, 8, ParallelConfig(dp=1, tp=8, pp=1))
    assert sorted(len(p) for p in parts) == [1] * 8


@pytest.fixture(scope="module")
def half_gb(tmp_path_factory):
    """A 0.5 GB GPT store (12 layers, hidden 512, bf16 with mixed-precision Adam) at tp=2."""
    src = tmp_path_factory.mktemp("half") / "src"
    gpt_store(str(src), SRC, layers=12, hidden=512)
    return src


@pytest.mark.slow
@pytest.mark.multiprocess
def test_four_processes_write_what_one_process_writes_reading_each_byte_once(half_gb, tmp_path):
    src, dst, single = half_gb, tmp_path / "dst", tmp_path / "single"
    one = reshard(str(src), str(single), ParallelConfig(dp=1, tp=1, pp=4), threads=2)
    report = _run(4, src, dst)
    _check(src, dst, single, report, 4)
    # bytes: each process reads its stages' tensors; the checksum blocks at the edges of its
    # ranges are fetched by one process of the host and taken by the other from /dev/shm
    assert report["bytes_read"] <= 1.05 * one.bytes_needed, (report, one.bytes_needed)
    assert sum(p["bytes_shared"] for p in report["processes"]) > 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_no_python_runs_the_console_script(tmp_path):
    src, dst, single = tmp_path / "src", tmp_path / "dst", tmp_path / "single"
    gpt_store(str(src), SRC, layers=4, hidden=128)
    reshard(str(src), str(single), ParallelConfig(dp=1, tp=1, pp=4), threads=2)
    report = _run(2, src, dst, no_python=True)
    _check(src, dst, single, report, 2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_processes_without_files_plan_nothing_and_process_0_commits_every_ranks_values(tmp_path):
    """Each process plans its own files' ops only; with more processes than files some plan none (and
    read nothing), and process 0 still commits every target rank's values, as one process does."""
    src, dst, single = tmp_path / "src", tmp_path / "dst", tmp_path / "single"
    to = ParallelConfig(dp=2, tp=1, pp=1)  # two files for three processes
    gpt_store(str(src), SRC, layers=1, hidden=64)
    reshard(str(src), str(single), to, threads=2)
    report = _run(3, src, dst, to=str(to))
    assert sorted(len(p["ranks"]) for p in report["processes"]) == [0, 1, 1]
    # process 0 checks every source file before the others open it; another reads its own files only
    idle = [p for p in report["processes"] if not p["ranks"]]
    assert idle[0]["process"] != 0 and idle[0]["bytes_read"] == 0, report["processes"]
    verify(str(dst))
    _same(load_global(str(dst)), load_global(str(single)))  # values too: rank-scoped ones of both ranks


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_worker_stops_every_process_commits_nothing_and_a_rerun_succeeds(half_gb, tmp_path):
    src, dst = half_gb, tmp_path / "dst"
    job = torchrun(4, ["reshard", str(src), str(dst), "--to", DST, "--format", "tenplex", "--threads", "1"])
    killed = None
    deadline = time.time() + 240
    while killed is None and time.time() < deadline and job.poll() is None:
        if (dst / "shards").is_dir() and any((dst / "shards").iterdir()):  # mid-run: files being written
            for pid in descendants(job.pid):
                if worker_rank(pid) == 2:
                    killed = pid
                    os.kill(pid, signal.SIGKILL)
                    break
        time.sleep(0.01)
    assert killed is not None, "no worker to kill: the job ended first"
    t0 = time.time()
    out, _ = job.communicate(timeout=60)  # within 60 s of the kill
    assert time.time() - t0 < 60
    assert job.returncode != 0, out[-3000:]
    assert "rank: 2" in out and "SIGKILL" in out, out[-3000:]  # torchrun names the dead worker
    assert not (dst / "manifest.json").exists()
    with pytest.raises(TenplexError):
        verify(str(dst))
    time.sleep(1)
    leftovers = list((dst / "shards").iterdir()) if (dst / "shards").is_dir() else []
    assert leftovers == [], leftovers  # every process removed its files; process 0 the dead one's
    rerun = torchrun(4, ["reshard", str(src), str(dst), "--to", DST, "--format", "tenplex", "--threads", "1"])
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out[-3000:]
    verify(str(dst))
    _same(load_global(str(dst)), load_global(str(src)), tensors_only=True)


def test_a_shared_edge_block_is_checked_and_a_bad_one_is_read_again(tmp_path):
    from tenplex.store.hostcache import HostBlockCache, edge_blocks
    from tenplex.store.reader import StoreReader
    src = tmp_path / "src"
    gpt_store(str(src), ParallelConfig(dp=1, tp=1, pp=1), layers=1, hidden=128)
    reader = StoreReader(str(src))
    recs = sorted(reader.manifest.tensors.values(), key=lambda r: r.offset)
    big = max(range(1, len(recs) - 1), key=lambda i: recs[i].nbytes)
    rec = recs[big]
    edges = edge_blocks(reader.manifest, {(rec.path, rec.rank)})
    assert edges  # the blocks it shares with its neighbours
    cache = HostBlockCache(str(tmp_path / "shm"), edges)
    for key, index in edges:  # another "process" left garbage
        (tmp_path / "shm" / cache._name(key, index).rsplit("/", 1)[1]).write_bytes(b"x" * 16)
    reader.host_cache = cache
    want = StoreReader(str(src)).read(rec).clone()
    assert torch.equal(reader.read(rec).view(torch.uint8), want.view(torch.uint8))
    assert cache.bytes_shared == 0  # the garbage failed its digest: fetched from storage instead
    for key, index in edges:  # replaced by nothing: the good block is left for the next reader
        assert len(cache.get(key, index)) > 16
    again = StoreReader(str(src))
    again.host_cache = HostBlockCache(str(tmp_path / "shm"), edges)
    assert torch.equal(again.read(rec).view(torch.uint8), want.view(torch.uint8))
    assert again.host_cache.bytes_shared > 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_bad_source_block_in_one_process_fails_every_process_with_its_message(tmp_path):
    from tenplex.store.reader import StoreReader
    src, dst = tmp_path / "src", tmp_path / "dst"
    gpt_store(str(src), SRC, layers=4, hidden=128)
    m = StoreReader(str(src)).manifest
    rec = max((r for r in m.tensors.values() if "layers/3/" in r.path and r.nbytes > 4096),
              key=lambda r: r.offset)  # past the header's blocks (checked when the source opens)
    path = src / rec.file
    data = bytearray(path.read_bytes())
    data[rec.offset + 100] ^= 0xFF  # a block only the process writing stage 3 reads
    path.write_bytes(bytes(data))
    job = torchrun(4, ["reshard", str(src), str(dst), "--to", DST, "--format", "tenplex"])
    out, _ = job.communicate(timeout=120)
    assert job.returncode != 0
    lines = [line for line in out.splitlines() if line.startswith("tenplex reshard:")]
    assert len(lines) == 4, out[-3000:]  # every process exits with one line
    assert all("checksum mismatch" in line and "failed in phase 'write'" in line for line in lines), lines
    assert not (dst / "manifest.json").exists()
    assert not (dst / "shards").is_dir() or list((dst / "shards").iterdir()) == []


@pytest.mark.slow
@pytest.mark.multiprocess
def test_without_an_agent_a_dead_process_is_named_by_every_other_after_the_timeout(half_gb, tmp_path):
    # srun-style: every process started directly, no torchrun agent to stop the others
    import socket
    import subprocess
    import sys
    dst = tmp_path / "dst"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(4):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="4", RANK=str(r),
                   LOCAL_RANK=str(r), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "tenplex", "reshard", str(half_gb), str(dst), "--to", DST,
                                       "--format", "tenplex", "--threads", "1", "--timeout", "10"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.time() + 240
    while not ((dst / "shards").is_dir() and any((dst / "shards").iterdir())) and time.time() < deadline:
        time.sleep(0.01)
    procs[2].kill()
    outs = [p.communicate(timeout=60)[0] for p in procs]  # timeout 10 s plus a beat, well within 60
    for r in (0, 1, 3):
        assert procs[r].returncode == 1, outs[r][-2000:]
        assert "reshard: process 2 stopped: no heartbeat for 10 s" in outs[r], outs[r][-2000:]
    assert not (dst / "manifest.json").exists()
    assert not (dst / "shards").is_dir() or list((dst / "shards").iterdir()) == []


def test_process_0s_progress_counts_every_process_s_bytes():
    """The bar on process 0 is fed by every process's counts (through the job's store)."""
    import threading

    from torch.distributed import HashStore

    from tenplex.distributed_parts import _Counter, _watch
    store, seen, stop = HashStore(), [], threading.Event()
    mine, other = _Counter(store, every=0.0), _Counter(store, every=0.0)
    watcher = threading.Thread(target=_watch, args=(store, 300, lambda d, t: seen.append((d, t)), stop))
    watcher.start()
    try:
        mine(100, 150)          # process 0's own share: 150 bytes
        other(150, 150)         # another process's share, all written
        deadline = time.time() + 10
        while not any(d == 250 for d, _ in seen) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        watcher.join()
    assert (250, 300) in seen and all(t == 300 for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)

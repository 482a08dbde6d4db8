"""save_distributed then load, across processes and "hosts": a shared directory, per-host
directories (caught before the commit), and an S3 store (moto on 127.0.0.1)."""

import json
import multiprocessing as mp
import re
import uuid

import pytest
import torch

import tenplex
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.ptree.tree import Scope

from tests.helpers import staging_workers as sw


pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
CTX = mp.get_context("spawn")


def _run(tmp_path, config: str, urls, storage_options=None, block=256, fail=None):
    world = len(urls)
    rendezvous = str(tmp_path / f"rendezvous-{uuid.uuid4().hex}")
    procs = [CTX.Process(target=sw.stage, args=(r, world, rendezvous, config, urls[r], storage_options,
                                                block, fail, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    crashes = [c.read_text() for c in tmp_path.glob("crash-*.json")]
    assert not crashes and all(p.exitcode == 0 for p in procs), crashes
    return [json.loads((tmp_path / f"stage-{r}.json").read_text()) for r in range(world)]


def _check_loads(url, src: P, targets, storage_options=None):
    """Every rank of every target config loads bit-exact against materialize(x, B, r)."""
    x = sw.truth(src)
    for text in targets:
        dst = P.parse(text)
        for r in range(dst.world_size):
            got = tenplex.load(url, dst, r, storage_options=storage_options)
            want = materialize(sw.TREE, x, dst, r)
            assert set(got) == set(want), (text, r, set(got) ^ set(want))
            for path, value in want.items():
                if isinstance(value, torch.Tensor):
                    assert bitwise_equal(got[path], value), (text, r, path)
                elif sw.TREE[path].scope is Scope.GLOBAL:
                    assert got[path] == value, (text, r, path)


def _files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_save_distributed_then_load_on_a_shared_directory(tmp_path):
    url = f"file://{tmp_path}/shared/ck"
    outcomes = _run(tmp_path, "dp=2,tp=2", [url] * 4, block=256)
    assert all(o["error"] is None for o in outcomes), outcomes
    _check_loads(url, P(dp=2, tp=2), ["dp=1,tp=1,pp=2", "dp=4,tp=1", "dp=1,tp=2,pp=2"])
    # saving again to a committed checkpoint: the same refusal everywhere, nothing touched
    before = _files(tmp_path / "shared")
    again = _run(tmp_path, "dp=2,tp=2", [url] * 4)
    assert {o["error"] for o in again} == {"AlreadyExistsError"}
    assert len({o["message"] for o in again}) == 1
    assert _files(tmp_path / "shared") == before


def test_per_host_directories_are_caught_before_the_commit(tmp_path):
    # two "hosts": each process sees its own /dev/shm, so each writes to its own directory
    urls = [f"file://{tmp_path}/host{r}/ck" for r in range(2)]
    outcomes = _run(tmp_path, "dp=1,tp=2", urls)
    assert {o["error"] for o in outcomes} == {"CorruptShardError"}, outcomes
    assert len({o["message"] for o in outcomes}) == 1
    message = outcomes[0]["message"]
    assert re.search(rf"{re.escape(urls[0])}/shards/rank-00001-[0-9a-f]{{16}}\.safetensors is not in the store "
                     "as process 0 sees it", message), message
    assert "found no such file" in message and "shared filesystem or s3://" in message
    for r in range(2):  # nothing committed, nothing left behind
        assert _files(tmp_path / f"host{r}") == [], r


def test_a_failed_writer_fails_every_process_and_commits_nothing(tmp_path):
    url = f"file://{tmp_path}/shared/ck"
    outcomes = _run(tmp_path, "dp=2,tp=2", [url] * 4, fail="write")
    assert {o["error"] for o in outcomes} == {"TransferError"}, outcomes
    assert len({o["message"] for o in outcomes}) == 1
    assert "process 3 failed in phase 'write': OSError: injected: disk full" in outcomes[0]["message"]
    assert not (tmp_path / "shared" / "ck" / "manifest.json").exists()
    assert [f for f in _files(tmp_path / "shared") if f.endswith(".safetensors")] == []


def test_save_distributed_then_load_on_s3(tmp_path, s3_endpoint, s3_bucket):
    url = f"{s3_bucket}/{uuid.uuid4().hex}/ck"  # the moto server of tests/conftest.py
    options = {"endpoint_url": s3_endpoint, "skip_instance_cache": True}
    outcomes = _run(tmp_path, "dp=2,tp=2", [url] * 4, storage_options=options, block=512)
    assert all(o["error"] is None for o in outcomes), outcomes
    _check_loads(url, P(dp=2, tp=2), ["dp=1,tp=2,pp=2", "dp=4,tp=1"], storage_options=options)

"""The streaming reshard: one building thread, one write thread, a bounded hand-off, failures from either side."""

from __future__ import annotations

import threading
import time

import pytest

import tenplex.store.stream as stream
from tenplex.api import load_global, reshard, save
from tenplex.errors import StoreError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.store.execute import StorePlanRunner
from tenplex.store.reader import StoreReader
from tenplex.store.writer import StoreWriter

from .helpers import assert_same_global

SPEC = GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=2, ffn=64, vocab=100,
               optimizer="distributed_adam", bucket_numel=3000)
A, B = P(dp=2, tp=2), P(dp=1, tp=1, pp=2)


@pytest.fixture
def source(tmp_path):
    tree = gpt_tree(SPEC)
    state = random_state(tree, A, 3)
    save(f"{tmp_path}/a", tree, A, {r: materialize(tree, state, A, r) for r in range(A.world_size)})
    return tree, state, f"{tmp_path}/a"


def _writers_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "tenplex-write"]


def _raised_within(seconds: float, call) -> BaseException | None:
    """What ``call()`` raised (None if nothing), failing the test if it runs past ``seconds``
    (a hang: a side that never learns the other stopped)."""
    out: list = []

    def run():
        try:
            call()
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still running after {seconds} s: one side waits for the other forever"
    return out[0]


def _nothing_at(path) -> bool:
    return not path.exists() or not any(path.rglob("*"))


def test_a_write_error_stops_the_builder_and_reaches_the_caller(source, tmp_path, monkeypatch):
    tree, _, src = source
    built, writes = [], []
    assemble, write = StorePlanRunner._assemble, StoreWriter.write

    def counting_assemble(self, job, tensors):
        built.append(job.path)
        return assemble(self, job, tensors)

    def failing_write(self, rank, path, tensor):
        writes.append(path)
        if len(writes) == 3:
            raise StoreError(f"{self.root}: disk full (test)")
        time.sleep(0.01)  # a slow disk: the builder is ahead, then must stop
        write(self, rank, path, tensor)

    monkeypatch.setattr(StorePlanRunner, "_assemble", counting_assemble)
    monkeypatch.setattr(StoreWriter, "write", failing_write)
    monkeypatch.setattr(stream, "QUEUE_BYTES", 1)
    exc = _raised_within(60, lambda: reshard(src, str(tmp_path / "b"), B))
    assert isinstance(exc, StoreError) and "disk full" in str(exc)
    total = sum(1 for _ in tree.tensors())
    assert len(built) <= 3 + 2 < total  # written, one waiting, one being built; not the rest
    assert _nothing_at(tmp_path / "b") and not _writers_alive()


def test_a_build_error_stops_the_write_thread_and_reaches_the_caller(source, tmp_path, monkeypatch):
    _, _, src = source
    assemble, calls = StorePlanRunner._assemble, []

    def failing_assemble(self, job, tensors):
        calls.append(job.path)
        if len(calls) == 5:
            raise StoreError(f"{job.path}: unreadable (test)")
        return assemble(self, job, tensors)

    monkeypatch.setattr(StorePlanRunner, "_assemble", failing_assemble)
    exc = _raised_within(60, lambda: reshard(src, str(tmp_path / "b"), B))
    assert isinstance(exc, StoreError) and "unreadable" in str(exc)
    assert _nothing_at(tmp_path / "b") and not _writers_alive()


def test_built_tensors_waiting_for_the_writer_are_bounded(source, tmp_path, monkeypatch):
    """With a slow writer and a bound below one leaf, the builder is at most one leaf ahead of the
    write in progress (one waits, one is being built)."""
    tree, state, src = source
    built, written, ahead = [0], [0], []
    assemble, write = StorePlanRunner._assemble, StoreWriter.write

    def counting_assemble(self, job, tensors):
        ahead.append(built[0] - written[0])
        out = assemble(self, job, tensors)
        built[0] += 1
        return out

    def slow_write(self, rank, path, tensor):
        time.sleep(0.002)
        write(self, rank, path, tensor)

    def counting_done(self, nbytes):
        written[0] += 1
        done(self, nbytes)

    done = stream._Handoff.done
    monkeypatch.setattr(StorePlanRunner, "_assemble", counting_assemble)
    monkeypatch.setattr(StoreWriter, "write", slow_write)
    monkeypatch.setattr(stream._Handoff, "done", counting_done)
    monkeypatch.setattr(stream, "QUEUE_BYTES", 1)
    reshard(src, str(tmp_path / "b"), B)
    assert max(ahead) <= 2 and len(ahead) == sum(1 for _ in tree.tensors())
    assert_same_global(tree, state, load_global(str(tmp_path / "b")))


def test_a_local_source_is_read_by_the_building_thread(source, tmp_path, monkeypatch):
    """No hand-off per read: a local store's reads run in the thread that builds the leaf."""
    tree, state, src = source
    readers, read_many = set(), StoreReader.read_many

    def recording_read(self, requests):
        readers.add(threading.current_thread().name)
        return read_many(self, requests)

    monkeypatch.setattr(StoreReader, "read_many", recording_read)
    reshard(src, str(tmp_path / "b"), B, threads=4)
    assert readers == {threading.current_thread().name}  # not empty: every read goes through read_many
    assert_same_global(tree, state, load_global(str(tmp_path / "b")))

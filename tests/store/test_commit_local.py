"""Local commits: fsync before the committing link, a no-replace link, and racing writers."""

from __future__ import annotations

import errno
import os
import threading

import pytest

import tenplex.store.commit as commit_module
import tenplex.store.writer as writer_module
from tenplex.api import load_global, save
from tenplex.errors import AlreadyExistsError
from tenplex.store import StoreWriter
from tenplex.store.values import gather_values

from .helpers import SPEC, SRC, assert_same_global, state_of


def _write_all(writer, shards) -> None:
    for rank, entries in writer.entries().items():
        for path, _, _ in entries:
            writer.write(rank, path, shards[rank][path])


def test_shards_manifest_and_directories_are_fsynced_before_the_link(tmp_path, monkeypatch):
    tree, st, shards = state_of(SPEC, SRC, 7)
    events: list[tuple[str, str]] = []
    real_fsync, real_link = os.fsync, os.link

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def link(src, dst):
        events.append(("link", str(dst)))
        return real_link(src, dst)

    monkeypatch.setattr(writer_module.os, "fsync", fsync)
    monkeypatch.setattr(commit_module.os, "link", link)
    root = tmp_path / "ck"
    save(str(root), tree, SRC, shards)
    at = events.index(("link", str(root / "manifest.json")))
    before = {path for kind, path in events[:at] if kind == "fsync"}
    shard_files = {str(p) for p in (root / "shards").iterdir()}
    assert shard_files and shard_files <= before
    assert {str(root / "shards"), str(root)} <= before
    assert any("manifest.json.tmp-" in p for p in before)  # the temporary's content
    assert ("fsync", str(root)) in events[at + 1:]  # the link itself
    assert sorted(os.listdir(root)) == ["manifest.json", "shards"]  # temporary removed


def test_racing_writers_commit_exactly_once(tmp_path):
    """Eight writers commit at once at one path: one wins, seven get AlreadyExistsError."""
    tree, st, shards = state_of(SPEC, SRC, 7)
    url = str(tmp_path / "ck")
    writers = [StoreWriter(url, tree, SRC, block=1 << 16) for _ in range(8)]
    for w in writers:
        _write_all(w, shards)
    values = gather_values(tree, SRC, shards)
    barrier, results = threading.Barrier(len(writers)), {}

    def commit(i):
        barrier.wait()
        try:
            with writers[i]:
                writers[i].commit(values)
            results[i] = "ok"
        except AlreadyExistsError:
            results[i] = "exists"

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(len(writers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results.values()) == ["exists"] * 7 + ["ok"]
    winner = writers[next(i for i, r in results.items() if r == "ok")]
    files = os.listdir(tmp_path / "ck" / "shards")
    assert files and all(winner.token in f for f in files)  # the losers removed their own files
    assert sorted(os.listdir(tmp_path / "ck")) == ["manifest.json", "shards"]
    assert_same_global(tree, st, load_global(url))


def test_without_hard_links_a_commit_still_never_replaces(tmp_path, monkeypatch):
    """A filesystem without hard links: check, rename, re-read."""
    tree, st, shards = state_of(SPEC, SRC, 7)

    def no_link(src, dst):
        raise OSError(errno.EPERM, "hard links are not supported here")

    monkeypatch.setattr(commit_module.os, "link", no_link)
    url = str(tmp_path / "ck")
    first, second = StoreWriter(url, tree, SRC), StoreWriter(url, tree, SRC)
    _write_all(first, shards)
    _write_all(second, shards)
    first.commit(gather_values(tree, SRC, shards))
    committed = (tmp_path / "ck" / "manifest.json").read_bytes()
    with pytest.raises(AlreadyExistsError):
        with second:
            second.commit(gather_values(tree, SRC, shards))
    assert (tmp_path / "ck" / "manifest.json").read_bytes() == committed
    assert sorted(os.listdir(tmp_path / "ck")) == ["manifest.json", "shards"]
    assert_same_global(tree, st, load_global(url))


def test_backends_without_conditional_writes_check_put_and_reread(monkeypatch):
    """The generic path (no conditional create): a committed manifest is refused, a new one put."""
    import uuid

    import fsspec

    from tenplex.store import StoreRoot
    monkeypatch.setattr(commit_module, "CONDITIONAL", ())
    url = f"memory://tenplex-generic-{uuid.uuid4().hex}"
    try:
        root = StoreRoot(url)
        commit_module.commit_manifest(root, b"first")
        with pytest.raises(AlreadyExistsError, match="another writer committed"):
            commit_module.commit_manifest(root, b"second")
        assert root.fs.cat_file(root.key("manifest.json")) == b"first"
    finally:
        fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)

"""Commits: atomic, never overwriting, leaving nothing of a failed save, on one backend."""

from __future__ import annotations

import os

import pytest

from tenplex.api import load_global, save, verify
from tenplex.errors import AlreadyExistsError, ManifestError, ShardError
from tenplex.store import StoreReader, StoreRoot, StoreWriter
from tenplex.store.commit import commit_manifest
from tenplex.store.values import gather_values

from .fixtures import StoreFixtures
from .helpers import SPEC, SRC, assert_same_global, fs_path, listing, read_bytes, state_of


class CommitSuite(StoreFixtures):
    """The commit protocol.

    ``atomic_create``: whether the backend creates the manifest atomically
    (a no-replace link, or a conditional PUT), rather than by check-then-put.
    """

    atomic_create = True

    def test_commit_never_replaces_even_when_the_existence_check_misses(self, root, state,
                                                                       monkeypatch):
        """The race window of check-then-put, forced open: the create itself must refuse."""
        if not self.atomic_create:
            pytest.skip("this backend creates by check-then-put")
        tree, st, shards = state
        save(f"{root}/ck", tree, SRC, shards)
        committed = read_bytes(f"{root}/ck/manifest.json")
        store = StoreRoot(f"{root}/ck")
        monkeypatch.setattr(type(store.fs), "exists", lambda self, path, **kw: False)
        monkeypatch.setattr(os.path, "exists", lambda path: False)
        with pytest.raises(AlreadyExistsError, match="another writer committed"):
            commit_manifest(store, b'{"format": "not this one"}')
        monkeypatch.undo()
        assert read_bytes(f"{root}/ck/manifest.json") == committed

    def test_never_overwrites_a_committed_checkpoint(self, root, state):
        tree, st, shards = state
        save(f"{root}/ck", tree, SRC, shards)
        before = read_bytes(f"{root}/ck/manifest.json")
        files = listing(f"{root}/ck")
        with pytest.raises(AlreadyExistsError, match="a committed checkpoint exists"):
            save(f"{root}/ck", tree, SRC, shards)
        assert read_bytes(f"{root}/ck/manifest.json") == before
        assert listing(f"{root}/ck") == files
        verify(f"{root}/ck", progress=False)

    def test_uncommitted_save_is_invisible_and_rerun_succeeds(self, root, state):
        tree, st, shards = state
        writer = StoreWriter(f"{root}/ck", tree, SRC)
        for rank, entries in writer.entries().items():
            for path, _, _ in entries:
                writer.write(rank, path, shards[rank][path])
        # no commit: as if the process died before the manifest
        with pytest.raises(ManifestError, match="not a committed checkpoint .*incomplete save"):
            StoreReader(f"{root}/ck")
        save(f"{root}/ck", tree, SRC, shards)
        assert_same_global(tree, st, load_global(f"{root}/ck"))

    def test_failed_save_leaves_nothing(self, root, state):
        tree, st, shards = state
        bad = {r: dict(s) for r, s in shards.items()}
        path = "model/layers/1/mlp/fc2/weight"
        bad[0][path] = bad[0][path].float()
        with pytest.raises(ShardError, match=f"tensor {path}: expected .* bfloat16, found .* float32"):
            save(f"{root}/ck", tree, SRC, bad)
        assert listing(f"{root}/ck") == []

    def _fill(self, writer, shards) -> None:
        for rank, entries in writer.entries().items():
            for path, _, _ in entries:
                writer.write(rank, path, shards[rank][path])

    def test_a_second_writer_never_replaces_the_first_commit(self, root, state):
        """Two writers at one URL: the first commit wins, the other fails and removes its files."""
        tree, st, shards = state
        other = state_of(SPEC, SRC, 8)
        first, second = StoreWriter(f"{root}/ck", tree, SRC), StoreWriter(f"{root}/ck", tree, SRC)
        self._fill(first, shards)
        self._fill(second, other[2])
        first.commit(gather_values(tree, SRC, shards))
        committed, files = read_bytes(f"{root}/ck/manifest.json"), listing(f"{root}/ck")
        with pytest.raises(AlreadyExistsError, match="another writer committed a checkpoint here first"):
            with second:
                second.commit(gather_values(tree, SRC, other[2]))
        assert read_bytes(f"{root}/ck/manifest.json") == committed
        assert listing(f"{root}/ck") == [f for f in files if second.token not in f]
        assert not any(second.token in f for f in listing(f"{root}/ck"))
        verify(f"{root}/ck", progress=False)
        assert_same_global(tree, st, load_global(f"{root}/ck"))

    def test_abort_removes_only_this_writers_files(self, root, state):
        tree, st, shards = state
        stranger = f"{root}/ck/shards/notes.txt"
        fs, path = fs_path(stranger)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, b"not tenplex's")
        kept = StoreWriter(f"{root}/ck", tree, SRC)  # an interrupted save: its files stay
        self._fill(kept, shards)
        before = listing(f"{root}/ck")
        doomed = StoreWriter(f"{root}/ck", tree, SRC)
        rank, entries = next(iter(doomed.entries().items()))
        doomed.write(rank, entries[0][0], shards[rank][entries[0][0]])  # one file left open
        self._fill_rank(doomed, shards, rank=max(doomed.entries()))
        doomed.abort()
        assert listing(f"{root}/ck") == before
        assert read_bytes(stranger) == b"not tenplex's"
        save(f"{root}/ck", tree, SRC, shards)  # a save beside both keeps them too
        assert set(before) <= set(listing(f"{root}/ck"))
        assert not any("manifest.json.tmp" in f for f in listing(f"{root}/ck"))

    def _fill_rank(self, writer, shards, rank) -> None:
        for path, _, _ in writer.entries()[rank]:
            writer.write(rank, path, shards[rank][path])

    def test_progress_reports_bytes_written(self, root, state):
        tree, st, shards = state
        calls = []
        save(f"{root}/ck", tree, SRC, shards, progress=lambda done, total: calls.append((done, total)))
        stored = sum(r.nbytes for r in StoreReader(f"{root}/ck").manifest.tensors.values())
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)
        assert calls[-1] == (stored, stored) and {t for _, t in calls} == {stored}

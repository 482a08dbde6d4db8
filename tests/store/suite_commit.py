"""Commits: atomic, never overwriting, leaving nothing of a failed save, on one backend."""

from __future__ import annotations

import pytest

from tenplex.api import load_global, save, verify
from tenplex.errors import AlreadyExistsError, ManifestError, ShardError
from tenplex.store import StoreReader, StoreWriter

from .fixtures import StoreFixtures
from .helpers import SRC, assert_same_global, listing, read_bytes


class CommitSuite(StoreFixtures):
    """The commit protocol."""

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

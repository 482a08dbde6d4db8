"""Corrupted data and lying manifests are refused with a clear error, on one backend."""

from __future__ import annotations

import pytest
import torch

from tenplex.api import load_global, save, verify
from tenplex.errors import CorruptShardError, ManifestError
from tenplex.store import StoreReader

from .fixtures import StoreFixtures
from .helpers import SRC, corrupt, edit_manifest, fs_path, read_bytes


def _shard_key(root: str, rank: int) -> str:
    """The shard file of ``rank`` (holder of a tp-split leaf, so never deduplicated away)."""
    return StoreReader(root).record("model/layers/0/mlp/fc1/weight", rank).file


class IntegritySuite(StoreFixtures):
    """Checksums, sizes and manifest checks."""

    def test_flipped_byte_is_reported(self, root, state):
        tree, st, shards = state
        save(f"{root}/ck", tree, SRC, shards, block=4096)
        reader = StoreReader(f"{root}/ck")
        rec = reader.manifest.tensors[("model/layers/0/mlp/fc1/weight", 0)]
        at = rec.offset + rec.nbytes // 2  # mid-tensor, mid-block
        corrupt(f"{root}/ck", rec.file, lambda d: d[:at] + bytes([d[at] ^ 0xFF]) + d[at + 1:])
        pattern = (rf"{rec.file}: checksum mismatch in block \d+ \(bytes \d+..\d+\) holding "
                   rf".*model/layers/0/mlp/fc1/weight.*: "
                   r"expected xxh3-128 [0-9a-f]{32}, found [0-9a-f]{32}")
        with pytest.raises(CorruptShardError, match=pattern):
            load_global(f"{root}/ck")
        with pytest.raises(CorruptShardError, match=pattern):
            verify(f"{root}/ck", progress=False)

    def test_truncated_and_missing_shards_are_reported(self, root, state):
        tree, st, shards = state
        save(f"{root}/ck", tree, SRC, shards)
        key = _shard_key(f"{root}/ck", 1)
        corrupt(f"{root}/ck", key, lambda d: d[: len(d) // 2])
        with pytest.raises(CorruptShardError,
                           match=rf"{key}: shard file is truncated .*expected \d+ bytes, found \d+"):
            verify(f"{root}/ck", progress=False)
        fs, p = fs_path(f"{root}/ck/{key}")
        fs.rm(p)
        with pytest.raises(CorruptShardError, match=f"{key}: shard file is missing"):
            load_global(f"{root}/ck")

    @pytest.mark.parametrize("edit,message", [
        (lambda m: {**m, "format": "tenplex.store/99"}, "unknown format 'tenplex.store/99'"),
        (lambda m: "{not json", "malformed JSON"),
        (lambda m: {**m, "tensors": [{**m["tensors"][0], "file": "../escape.safetensors"}]
                    + m["tensors"][1:]}, r"segment '\.\.' is not allowed"),
        (lambda m: {**m, "tensors": [{**m["tensors"][0], "file": "/abs/x.safetensors"}]
                    + m["tensors"][1:]}, "expected a relative"),
        (lambda m: {**m, "tree": {**m["tree"], "leaves": {"../x": {"kind": "value", "scope": "global"},
                                                          **m["tree"]["leaves"]}}},
         r"segment '\.\.' is not allowed"),
        (lambda m: {**m, "tensors": [{**m["tensors"][0], "dtype": "float16"}] + m["tensors"][1:]},
         "dtype: expected bfloat16 .*found 'float16'"),
        (lambda m: {**m, "values": {}}, "value leaf .* has no value"),
    ])
    def test_bad_manifests_are_refused(self, root, state, edit, message):
        tree, st, shards = state
        save(f"{root}/ck", tree, SRC, shards)
        edit_manifest(f"{root}/ck", edit)
        with pytest.raises(ManifestError, match=message):
            StoreReader(f"{root}/ck")

    def test_missing_leaf_in_index_is_reported(self, root, state):
        tree, st, shards = state
        save(f"{root}/ck", tree, SRC, shards)
        edit_manifest(f"{root}/ck", lambda m: {**m, "tensors": [
            t for t in m["tensors"] if t["path"] != "model/final_norm/weight"]})
        with pytest.raises(ManifestError, match="no stored tensor holds leaf model/final_norm/weight"):
            load_global(f"{root}/ck")

    def test_files_are_real_safetensors(self, root, state):
        """The safetensors package itself reads every shard file back."""
        from safetensors.torch import load as st_load
        tree, st, shards = state
        save(f"{root}/ck", tree, SRC, shards, block=1000)
        reader = StoreReader(f"{root}/ck")
        for (path, rank), rec in reader.manifest.tensors.items():
            if rank == 1:
                loaded = st_load(read_bytes(f"{root}/ck/{rec.file}"))
                break
        for path, tensor in loaded.items():
            assert torch.equal(tensor, shards[1][path]), path

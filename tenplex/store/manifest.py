"""The store manifest: the tree, the config, values and the shard index, as JSON.

A checkpoint directory is committed exactly when ``manifest.json`` exists and
parses. The manifest holds:

- ``format``: ``"tenplex.store/1"``; other versions are refused;
- ``config``: the parallel config the shards are laid out for;
- ``tree``: paths, global shapes, dtypes and layouts;
- ``values``: value leaves (``{path: value}`` or ``{path: {key: value}}``);
- ``files``: per shard file, its size in bytes, checksum block size and the
  xxh3-128 digest of every block;
- ``tensors``: the shard index: for each stored (leaf, holder rank), the file,
  byte offset and length of its local tensor, dtype, local shape, and the
  global boxes (regions) it holds;
- ``meta``: free-form JSON for integrations (e.g. Megatron args).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tenplex.errors import LayoutError, ManifestError, PathError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import PTree, TensorLeaf, check_path

__all__ = ["FORMAT", "MANIFEST", "FileRecord", "TensorRecord", "Manifest"]

FORMAT = "tenplex.store/1"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class FileRecord:
    """One shard file: size in bytes, checksum block size in bytes, xxh3-128 hex digest per block."""

    size: int
    block: int
    digests: tuple[str, ...]

    def to_json(self) -> dict:
        return {"size": self.size, "block": self.block, "digests": list(self.digests)}


@dataclass(frozen=True)
class TensorRecord:
    """Where one stored local tensor lives.

    Attributes:
        path: the leaf.
        rank: the lowest rank of the holder class (replicas are stored once).
        file: the shard file's key under the store root.
        offset: byte offset of the tensor's data in the file.
        nbytes: bytes of data.
        shape: the local shape, in elements.
        dtype: the dtype name.
    """

    path: str
    rank: int
    file: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest (see the module docstring)."""

    config: ParallelConfig
    tree: PTree
    values: dict[str, Any]
    files: dict[str, FileRecord]
    tensors: dict[tuple[str, int], TensorRecord]
    meta: dict = field(default_factory=dict)

    def to_json(self, regions: dict | None = None) -> dict:
        tensors = []
        for (path, rank), rec in self.tensors.items():
            item = {"path": path, "rank": rank, "file": rec.file, "offset": rec.offset,
                    "nbytes": rec.nbytes, "shape": list(rec.shape), "dtype": rec.dtype}
            if regions and (path, rank) in regions:
                item["regions"] = [b.to_json() for b in regions[(path, rank)]]
            tensors.append(item)
        return {"format": FORMAT, "config": self.config.to_json(), "tree": self.tree.to_json(),
                "values": self.values, "files": {k: v.to_json() for k, v in self.files.items()},
                "tensors": tensors, "meta": self.meta}

    def dumps(self, regions: dict | None = None) -> bytes:
        return json.dumps(self.to_json(regions), indent=1).encode()

    @classmethod
    def loads(cls, data: bytes, where: str) -> "Manifest":
        """Parse and validate manifest bytes read from ``where``.

        Raises:
            ManifestError: malformed JSON, unknown format version, a missing
                field, an unsafe path, or an index that does not match the tree.
        """
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{where}: malformed JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: expected a JSON object, found {type(obj).__name__}")
        if obj.get("format") != FORMAT:
            raise ManifestError(f"{where}: unknown format {obj.get('format')!r}; "
                                f"this tenplex reads {FORMAT!r}")
        try:
            manifest = cls._from_json(obj)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, (ManifestError,)):
                raise
            if isinstance(exc, (PathError, LayoutError)):
                raise ManifestError(f"{where}: {exc}") from exc
            raise ManifestError(f"{where}: malformed manifest: {exc!r}") from exc
        manifest.check(where)
        return manifest

    @classmethod
    def _from_json(cls, obj: dict) -> "Manifest":
        files = {check_path(k): FileRecord(int(v["size"]), int(v["block"]), tuple(v["digests"]))
                 for k, v in obj["files"].items()}
        tensors = {}
        for t in obj["tensors"]:
            rec = TensorRecord(check_path(t["path"]), int(t["rank"]), check_path(t["file"]),
                               int(t["offset"]), int(t["nbytes"]), tuple(t["shape"]), t["dtype"])
            tensors[(rec.path, rec.rank)] = rec
        return cls(ParallelConfig.from_json(obj["config"]), PTree.from_json(obj["tree"]),
                   dict(obj.get("values", {})), files, tensors, dict(obj.get("meta", {})))

    def check(self, where: str) -> None:
        """Check that the index matches the tree: dtypes, files and byte ranges.

        Raises:
            ManifestError: naming the tensor and the mismatch.
        """
        for (path, rank), rec in self.tensors.items():
            leaf = self.tree.leaves.get(path)
            if not isinstance(leaf, TensorLeaf):
                raise ManifestError(f"{where}: tensor {path} (rank {rank}) is not a tensor leaf of the tree")
            if rec.dtype != leaf.dtype:
                raise ManifestError(f"{where}: tensor {path} (rank {rank}) has dtype {rec.dtype}, "
                                    f"the tree says {leaf.dtype}")
            f = self.files.get(rec.file)
            if f is None or rec.offset < 0 or rec.offset + rec.nbytes > f.size:
                raise ManifestError(f"{where}: tensor {path} (rank {rank}) points outside "
                                    f"file {rec.file}")
        for path, _ in self.tree.values():
            if path not in self.values:
                raise ManifestError(f"{where}: value leaf {path} has no value")

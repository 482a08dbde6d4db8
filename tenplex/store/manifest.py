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

A manifest read from storage is parsed and checked, field by field, by
:func:`tenplex.store.manifest_parse.parse_manifest`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import PTree

__all__ = ["MANIFEST_SCHEMA", "MANIFEST", "FileRecord", "TensorRecord", "Manifest"]

MANIFEST_SCHEMA = "tenplex.store/1"
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
    """A manifest (see the module docstring); built by a writer, or parsed and checked on read."""

    config: ParallelConfig
    tree: PTree
    values: dict[str, Any]
    files: dict[str, FileRecord]
    tensors: dict[tuple[str, int], TensorRecord]
    meta: dict = field(default_factory=dict)
    sharding: Any = field(default=None, compare=False, repr=False)
    """``Sharding(tree, config)`` as the parser built it to check the records (not serialized)."""

    def to_json(self, regions: dict | None = None) -> dict:
        tensors = []
        for (path, rank), rec in self.tensors.items():
            item = {"path": path, "rank": rank, "file": rec.file, "offset": rec.offset,
                    "nbytes": rec.nbytes, "shape": list(rec.shape), "dtype": rec.dtype}
            if regions and (path, rank) in regions:
                item["regions"] = [b.to_json() for b in regions[(path, rank)]]
            tensors.append(item)
        return {"format": MANIFEST_SCHEMA, "config": self.config.to_json(), "tree": self.tree.to_json(),
                "values": self.values, "files": {k: v.to_json() for k, v in self.files.items()},
                "tensors": tensors, "meta": self.meta}

    def dumps(self, regions: dict | None = None) -> bytes:
        """The manifest as UTF-8 JSON; ``regions`` adds each stored tensor's global boxes.

        One top-level key a line, and one item a line within ``tree``, ``values``, ``files``
        and ``tensors``, each item on one line: readable line by line, and encoded by
        the ``json`` module's C encoder (``indent`` makes it fall back to Python's, about
        ten times slower: 0.6 s for a 0.5 GB GPT store's manifest).
        """
        return _lines(self.to_json(regions)).encode()


def _compact(obj) -> str:
    return json.dumps(obj)  # ", " and ": " as with ``indent``: tools that edit the text find them


def _lines(doc: dict) -> str:
    """``doc`` as JSON, top-level keys a line each, and a dict's or list's items a line each below them."""
    out = []
    for key, value in doc.items():
        if isinstance(value, dict) and value:
            items = ",\n  ".join(f"{_compact(k)}: {_compact(v)}" for k, v in value.items())
            out.append(f"{_compact(key)}: {{\n  {items}\n }}")
        elif isinstance(value, list) and value:
            items = ",\n  ".join(_compact(v) for v in value)
            out.append(f"{_compact(key)}: [\n  {items}\n ]")
        else:
            out.append(f"{_compact(key)}: {_compact(value)}")
    return "{\n " + ",\n ".join(out) + "\n}\n"

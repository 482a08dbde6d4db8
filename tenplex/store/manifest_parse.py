"""Parse an untrusted manifest: every field is checked before any shard byte is read.

A manifest can lie about sizes, offsets, counts, dtypes and paths. Each lie
is a :class:`~tenplex.errors.ManifestError` that names the manifest and the
field (``files['shards/x'].digests``, ``tensors[3].nbytes``...), what was
expected and what was found. The stated limits:

- the manifest is at most :data:`MAX_MANIFEST` bytes and its free-form
  parts (``values``, ``meta``) nest at most :data:`MAX_DEPTH` deep; deeper
  or larger JSON is refused, never a ``RecursionError``;
- ``0 < block <=`` :data:`MAX_BLOCK`; ``len(digests) == ceil(size / block)``;
- the config has at most :data:`MAX_WORLD` ranks and holds the tree;
- every stored tensor is the local tensor of one holder class (replicas are
  stored once, under their lowest rank): its shape is the class's local
  shape, ``nbytes == prod(shape) * itemsize``, its dtype the leaf's, its
  byte range lies inside its file, after the 8-byte header length, and
  overlaps no other tensor of the file; every holder class has its tensor;
- every path and file name passes :func:`~tenplex.ptree.tree.check_path`;
- every value leaf has a value (a ``{key: value}`` object when scoped).
"""

from __future__ import annotations

from collections import defaultdict
from math import prod
from typing import Any

from tenplex.errors import ConfigError, LayoutError, ManifestError, PathError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, Scope, check_path
from tenplex.limits import MAX_JSON_BYTES, MAX_JSON_DEPTH, MAX_LAYERS, MAX_WORLD, short
from tenplex.store.bounded_json import load_json
from tenplex.store.manifest import MANIFEST_SCHEMA, FileRecord, Manifest, TensorRecord

__all__ = ["MAX_MANIFEST", "MAX_BLOCK", "MAX_DEPTH", "MAX_WORLD", "parse_manifest"]

MAX_MANIFEST = MAX_JSON_BYTES
"""Largest manifest read, in bytes (:data:`tenplex.limits.MAX_JSON_BYTES`, 256 MiB: a 1 TB
checkpoint in 1 MiB blocks needs ~40 MB)."""

MAX_BLOCK = 1 << 26
"""Largest checksum block, in bytes (64 MiB): a reader holds whole blocks in memory."""

MAX_DEPTH = MAX_JSON_DEPTH
"""Deepest nesting of ``values`` and ``meta`` (:data:`tenplex.limits.MAX_JSON_DEPTH`)."""

_MAX_INT = 1 << 60
_SLACK = 4096  # holder classes beyond the listed records counted before giving up (then: missing records)


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and check manifest bytes read from ``where``.

    Raises:
        ManifestError: naming ``where`` and the field, for oversized, deep or
            malformed JSON, an unknown format version, or any field above
            (see the module docstring).
    """
    # size, depth, containers, long ints; 4 levels of envelope around values and meta (MAX_DEPTH each)
    obj = load_json(data, where, max_bytes=MAX_MANIFEST, max_depth=MAX_DEPTH + 4)
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    if obj.get("format") != MANIFEST_SCHEMA:
        raise ManifestError(f"{where}: unknown format {short(obj.get('format'))}; "
                            f"this tenplex reads {MANIFEST_SCHEMA!r}")
    for key in ("config", "tree", "files", "tensors"):
        if key not in obj:
            raise ManifestError(f"{where}: field {key!r} is missing")
    config = _config(obj["config"], where)
    tree = _tree(obj["tree"], where)
    try:
        sharding = Sharding(tree, config)
    except (ConfigError, LayoutError) as exc:
        raise ManifestError(f"{where}: config {config} cannot hold the tree: {exc}") from None
    files = _files(obj["files"], where)
    tensors = _tensors(obj["tensors"], sharding, files, where)
    values = _values(obj.get("values", {}), tree, where)
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise ManifestError(f"{where}: meta: expected an object, found {type(meta).__name__}")
    _depth(meta, f"{where}: meta")
    return Manifest(config, tree, values, files, tensors, meta, sharding=sharding)


def _count(value: Any, field: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ManifestError(f"{field}: expected an integer in [{lo}, {hi}], found {_short(value)}")
    return value


def _short(value: Any) -> str:
    return short(value)


def _config(obj: Any, where: str) -> ParallelConfig:
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: config: expected an object, found {type(obj).__name__}")
    _no_floats(obj, f"{where}: config")
    for axis in ("dp", "tp", "pp"):
        _count(obj.get(axis), f"{where}: config.{axis}", 1, MAX_WORLD)
    try:
        config = ParallelConfig.from_json(obj)
    except (ConfigError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where}: config: {exc}") from None
    if config.world_size > MAX_WORLD:
        raise ManifestError(f"{where}: config: expected at most {MAX_WORLD} ranks, "
                            f"found {config.world_size}")
    return config


def _no_floats(obj: Any, field: str) -> None:
    """Raise ManifestError at the first number that is not an integer (iteratively).

    A tree and a config hold only integers, strings, booleans and null; the
    readers' ``int(...)`` would truncate ``1.5`` to 1 and fail on ``1e400`` (infinity)
    with an ``OverflowError``.
    """
    if not _has_float(obj):  # the common case, without a field name per item
        return
    stack = [(obj, field)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, float):
            raise ManifestError(f"{at}: expected an integer, found {short(item)}")
        if isinstance(item, dict):
            stack.extend((v, f"{at}.{str(k)[:40]}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))


def _has_float(obj: Any) -> bool:
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _tree(obj: Any, where: str) -> PTree:
    if not isinstance(obj, dict) or not isinstance(obj.get("leaves"), dict):
        raise ManifestError(f"{where}: tree: expected an object with 'leaves'")
    _no_floats(obj, f"{where}: tree")
    _count(obj.get("num_layers", 1), f"{where}: tree.num_layers", 1, MAX_LAYERS)  # sizes a list per layer
    try:
        return PTree.from_json(obj)
    except (LayoutError, PathError, ConfigError, KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where}: tree: {exc}") from None


def _files(obj: Any, where: str) -> dict[str, FileRecord]:
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: files: expected an object, found {type(obj).__name__}")
    out = {}
    for key, item in obj.items():
        field = f"{where}: files[{short(key)}]"
        try:
            check_path(key)
        except PathError as exc:
            raise ManifestError(f"{field}: {exc}") from None
        if not isinstance(item, dict):
            raise ManifestError(f"{field}: expected an object, found {type(item).__name__}")
        size = _count(item.get("size"), f"{field}.size")
        block = _count(item.get("block"), f"{field}.block", 1, MAX_BLOCK)
        digests = item.get("digests")
        nblocks = -(-size // block)
        if not isinstance(digests, list) or len(digests) != nblocks:
            found = f"{len(digests)}" if isinstance(digests, list) else type(digests).__name__
            raise ManifestError(f"{field}.digests: expected {nblocks} digests "
                                f"(ceil(size {size} / block {block})), found {found}")
        for i, d in enumerate(digests):
            if not (isinstance(d, str) and len(d) == 32 and all(c in "0123456789abcdef" for c in d)):
                raise ManifestError(f"{field}.digests[{i}]: expected 32 hex digits (xxh3-128), "
                                    f"found {_short(d)}")
        out[key] = FileRecord(size, block, tuple(digests))
    return out


def _tensors(obj: Any, sharding: Sharding, files: dict[str, FileRecord],
             where: str) -> dict[tuple[str, int], TensorRecord]:
    if not isinstance(obj, list):
        raise ManifestError(f"{where}: tensors: expected a list, found {type(obj).__name__}")
    tree = sharding.tree
    shapes: dict[tuple[str, int], tuple[int, ...]] = {}
    for path, _ in tree.tensors():  # one record per holder class: stop as soon as there are too few
        for holders in sharding.classes(path):
            shapes[(path, holders.ranks[0])] = holders.holding.shape
            if len(shapes) > len(obj) + _SLACK:
                raise ManifestError(f"{where}: tensors: config {sharding.config} places more than "
                                    f"{len(obj) + _SLACK} stored tensors (one per holder class); the "
                                    f"manifest lists {len(obj)}")
    out: dict[tuple[str, int], TensorRecord] = {}
    for i, item in enumerate(obj):
        rec = _tensor(item, f"{where}: tensors[{i}]", shapes, tree, files)
        if (rec.path, rec.rank) in out:
            raise ManifestError(f"{where}: tensors[{i}]: tensor {rec.path} (rank {rec.rank}) "
                                "is listed twice")
        out[(rec.path, rec.rank)] = rec
    for path, rank in shapes:
        if (path, rank) not in out:
            raise ManifestError(f"{where}: no stored tensor holds leaf {path} for rank {rank} "
                                f"(ranks {rank}.. of its holder class)")
    _no_overlaps(out.values(), where)
    return out


def _tensor(item: Any, field: str, shapes: dict, tree: PTree, files: dict) -> TensorRecord:
    if not isinstance(item, dict):
        raise ManifestError(f"{field}: expected an object, found {type(item).__name__}")
    path, key = item.get("path"), item.get("file")
    try:  # a file key or leaf path seen already (checked when files and the tree were) is not checked again
        if not (isinstance(key, str) and key in files):
            check_path(key)
        if not (isinstance(path, str) and path in tree.leaves):
            check_path(path)
    except PathError as exc:
        raise ManifestError(f"{field}: {exc}") from None
    rank = _count(item.get("rank"), f"{field}.rank")
    field = f"{field} ({path}, rank {rank})"
    if (path, rank) not in shapes:
        raise ManifestError(f"{field}: expected a tensor leaf stored under the lowest rank of a "
                            "holder class; the tree and config place no such tensor")
    leaf = tree[path]
    if item.get("dtype") != leaf.dtype:
        raise ManifestError(f"{field}.dtype: expected {leaf.dtype} (the tree's), "
                            f"found {_short(item.get('dtype'))}")
    shape = item.get("shape")
    if not isinstance(shape, list) or [_count(n, f"{field}.shape") for n in shape] != \
            list(shapes[(path, rank)]):
        raise ManifestError(f"{field}.shape: expected {list(shapes[(path, rank)])}, "
                            f"found {_short(shape)}")
    nbytes = _count(item.get("nbytes"), f"{field}.nbytes")
    if nbytes != prod(shape) * leaf.itemsize:
        raise ManifestError(f"{field}.nbytes: expected {prod(shape) * leaf.itemsize} "
                            f"(shape {shape} of {leaf.dtype}), found {nbytes}")
    if key not in files:
        raise ManifestError(f"{field}.file: {key} is not among the manifest's files")
    size = files[key].size
    offset = _count(item.get("offset"), f"{field}.offset", 8)
    if offset + nbytes > size:
        raise ManifestError(f"{field}.offset: bytes [{offset}, {offset + nbytes}) lie outside "
                            f"file {key} ({size} bytes)")
    return TensorRecord(path, rank, key, offset, nbytes, tuple(shape), leaf.dtype)


def _no_overlaps(records, where: str) -> None:
    by_file = defaultdict(list)
    for rec in records:
        if rec.nbytes:
            by_file[rec.file].append(rec)
    for key, recs in by_file.items():
        recs.sort(key=lambda r: r.offset)
        for a, b in zip(recs, recs[1:]):
            if b.offset < a.offset + a.nbytes:
                raise ManifestError(f"{where}: tensors {a.path} (rank {a.rank}) "
                                    f"[{a.offset}, {a.offset + a.nbytes}) and {b.path} "
                                    f"(rank {b.rank}) [{b.offset}, {b.offset + b.nbytes}) "
                                    f"overlap in file {key}")


def _values(obj: Any, tree: PTree, where: str) -> dict:
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: values: expected an object, found {type(obj).__name__}")
    leaves = dict(tree.values())
    for path in obj:
        if path not in leaves:
            raise ManifestError(f"{where}: values[{_short(path)}]: not a value leaf of the tree")
    for path, leaf in leaves.items():
        if path not in obj:
            raise ManifestError(f"{where}: value leaf {path} has no value")
        if leaf.scope is not Scope.GLOBAL and not isinstance(obj[path], dict):
            raise ManifestError(f"{where}: values[{path!r}]: expected {{key: value}} for scope "
                                f"{leaf.scope.value}, found {type(obj[path]).__name__}")
    _depth(obj, f"{where}: values")
    return dict(obj)


def _depth(obj: Any, field: str) -> None:
    """Raise ManifestError if ``obj`` nests deeper than MAX_DEPTH (iteratively: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ManifestError(f"{field}: expected at most {MAX_DEPTH} levels of nesting, found more")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)

"""A corpus of hostile stores: manifests and safetensors headers that lie.

Each case edits a valid local store in place. Where a case edits a shard
file, the manifest's digests are recomputed, so that only the check aimed at
(the header's) can catch the lie. ``CASES`` lists ``(id, edit, error class,
pattern, level)``: the pattern names the file and the field; ``level`` is
``"manifest"`` (caught when the manifest is opened, e.g. by ``inspect``) or
``"shard"`` (caught before a shard file's first read).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tenplex.errors import CorruptShardError, ManifestError, PathError
from tenplex.store.blocks import BlockHasher

MANIFEST = "manifest.json"


def _load(root: Path) -> dict:
    return json.loads((root / MANIFEST).read_text())


def _dump(root: Path, obj) -> None:
    (root / MANIFEST).write_text(obj if isinstance(obj, str) else json.dumps(obj))


def manifest_edit(fn):
    """A case that rewrites the parsed manifest with ``fn(manifest)`` (which may mutate it)."""
    def edit(root: Path) -> None:
        obj = _load(root)
        new = fn(obj)
        _dump(root, obj if new is None else new)
    return edit


def _first_file(m: dict) -> str:
    return m["tensors"][0]["file"]


def _same_file_pair(m: dict) -> tuple[dict, dict]:
    key = _first_file(m)
    recs = [t for t in m["tensors"] if t["file"] == key and t["nbytes"]]
    return recs[0], recs[1]


def _rehash(root: Path, key: str) -> None:
    """Recompute ``key``'s size and block digests in the manifest."""
    m = _load(root)
    data = (root / key).read_bytes()
    hasher = BlockHasher(m["files"][key]["block"])
    hasher.update(data)
    m["files"][key].update(size=len(data), digests=hasher.finish())
    _dump(root, m)


def header_edit(fn):
    """A case that rewrites the first shard file's JSON header (same length), then rehashes."""
    def edit(root: Path) -> None:
        key = _first_file(_load(root))
        data = bytearray((root / key).read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        header.pop("__metadata__", None)  # room for longer edits
        new = fn(header)
        text = (new if isinstance(new, bytes) else
                json.dumps(header if new is None else new, separators=(",", ":")).encode())
        assert len(text) <= n, "edit made the header longer"
        data[8:8 + n] = text + b" " * (n - len(text))
        (root / key).write_bytes(bytes(data))
        _rehash(root, key)
    return edit


def _length_beyond_file(root: Path) -> None:
    key = _first_file(_load(root))
    data = bytearray((root / key).read_bytes())
    data[:8] = struct.pack("<Q", 2 * len(data))
    (root / key).write_bytes(bytes(data))
    _rehash(root, key)


def _tensors_by_start(header: dict) -> list[str]:
    names = [k for k in header if k != "__metadata__"]
    return sorted(names, key=lambda k: header[k]["data_offsets"][0])


def _st_out_of_range(h: dict) -> None:
    h[_tensors_by_start(h)[-1]]["data_offsets"][1] = 1 << 40


def _st_overlap(h: dict) -> None:
    first, second = _tensors_by_start(h)[:2]
    a, b = h[second]["data_offsets"]
    h[second]["data_offsets"] = [h[first]["data_offsets"][0], h[first]["data_offsets"][0] + b - a]


def _st_shape(h: dict) -> None:
    name = _tensors_by_start(h)[0]
    h[name]["shape"] = [s + 1 for s in h[name]["shape"]]


def _st_dtype(h: dict) -> None:
    name = next(k for k in _tensors_by_start(h) if h[k]["dtype"] == "BF16")
    h[name]["dtype"] = "F16"


def _deep_manifest(root: Path) -> None:
    text = (root / MANIFEST).read_text().rstrip().rstrip("}")
    depth = 200_000
    (root / MANIFEST).write_text(text + ', "extra": ' + "[" * depth + "]" * depth + "}")


def _text_edit(fn):
    """A case that rewrites the manifest's text with ``fn(text)``."""
    def edit(root: Path) -> None:
        (root / MANIFEST).write_text(fn((root / MANIFEST).read_text()))
    return edit


def _link_outside(what: str):
    """A case that moves ``what`` (the manifest, ``shards/`` or the first shard file) beside the
    store and leaves a symlink to it: a valid file, outside the checkpoint's root."""
    def edit(root: Path) -> None:
        import os
        rel = _first_file(_load(root)) if what == "first-shard" else what
        outside = root.parent / {"manifest.json": "outside.json", "shards": "outside"}.get(what, "outside.safetensors")
        os.replace(root / rel, outside)
        os.symlink(outside, root / rel)
    return edit


def _nested(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


F = r"files\['shards/[^']+'\]"
T = r"tensors\[\d+\] \([^)]+\)"
M = r"/manifest\.json: "
S = r"/shards/[^:]+\.safetensors: safetensors header"

CASES = [
    ("block-zero", manifest_edit(lambda m: m["files"][_first_file(m)].update(block=0)),
     ManifestError, M + F + r"\.block: expected an integer in \[1, 67108864\], found 0", "manifest"),
    ("block-huge", manifest_edit(lambda m: m["files"][_first_file(m)].update(block=1 << 40)),
     ManifestError, M + F + r"\.block: expected an integer in \[1, \d+\], found 1099511627776",
     "manifest"),
    ("digests-empty", manifest_edit(lambda m: m["files"][_first_file(m)].update(digests=[])),
     ManifestError, M + F + r"\.digests: expected \d+ digests \(ceil\(size \d+ / block 256\)\), found 0",
     "manifest"),
    ("digest-not-hex", manifest_edit(lambda m: m["files"][_first_file(m)]["digests"].__setitem__(0, "z" * 32)),
     ManifestError, M + F + r"\.digests\[0\]: expected 32 hex digits", "manifest"),
    ("size-float", manifest_edit(lambda m: m["files"][_first_file(m)].update(size=1.5)),
     ManifestError, M + F + r"\.size: expected an integer .* found 1\.5", "manifest"),
    ("nbytes-lie", manifest_edit(lambda m: m["tensors"][0].update(nbytes=m["tensors"][0]["nbytes"] + 4)),
     ManifestError, M + T + r"\.nbytes: expected \d+ \(shape .*\), found \d+", "manifest"),
    ("shape-lie", manifest_edit(lambda m: m["tensors"][0].update(shape=[1, 2, 3])),
     ManifestError, M + T + r"\.shape: expected \[.*\], found \[1, 2, 3\]", "manifest"),
    ("offset-beyond-file", manifest_edit(lambda m: m["tensors"][0].update(
        offset=m["files"][m["tensors"][0]["file"]]["size"])),
     ManifestError, M + T + r"\.offset: bytes \[\d+, \d+\) lie outside file shards/", "manifest"),
    ("offset-negative", manifest_edit(lambda m: m["tensors"][0].update(offset=-5)),
     ManifestError, M + T + r"\.offset: expected an integer in \[8, ", "manifest"),
    ("overlap", manifest_edit(lambda m: _same_file_pair(m)[1].update(offset=_same_file_pair(m)[0]["offset"])),
     ManifestError, M + r"tensors .* overlap in file shards/", "manifest"),
    ("file-dotdot", manifest_edit(lambda m: m["tensors"][0].update(file="../../x.safetensors")),
     ManifestError, M + r"tensors\[0\]: path '\.\./\.\./x\.safetensors': segment '\.\.' is not allowed",
     "manifest"),
    ("file-absolute", manifest_edit(lambda m: m["tensors"][0].update(file="/etc/passwd")),
     ManifestError, M + r"tensors\[0\]: path '/etc/passwd': expected a relative", "manifest"),
    ("files-key-dotdot", manifest_edit(lambda m: m["files"].update({"../evil": m["files"][_first_file(m)]})),
     ManifestError, M + r"files\['\.\./evil'\]: path .* not allowed", "manifest"),
    ("rank-not-lowest", manifest_edit(lambda m: next(
        t for t in m["tensors"] if t["path"] == "model/final_norm/weight").update(rank=1)),
     ManifestError, M + r"tensors\[\d+\] \(model/final_norm/weight, rank 1\): expected a tensor leaf "
     r"stored under the lowest rank", "manifest"),
    ("rank-string", manifest_edit(lambda m: m["tensors"][0].update(rank="0")),
     ManifestError, M + r"tensors\[0\]\.rank: expected an integer", "manifest"),
    ("duplicate", manifest_edit(lambda m: m["tensors"].append(dict(m["tensors"][0]))),
     ManifestError, M + r"tensors\[\d+\]: tensor .* is listed twice", "manifest"),
    ("missing-record", manifest_edit(lambda m: m.update(tensors=m["tensors"][1:])),
     ManifestError, M + r"no stored tensor holds leaf .* for rank \d+", "manifest"),
    ("tensors-not-list", manifest_edit(lambda m: m.update(tensors={})),
     ManifestError, M + r"tensors: expected a list, found dict", "manifest"),
    ("files-missing", manifest_edit(lambda m: m.pop("files") and None),
     ManifestError, M + r"field 'files' is missing", "manifest"),
    ("not-an-object", manifest_edit(lambda m: "[1, 2]"),
     ManifestError, M + r"expected a JSON object, found list", "manifest"),
    ("config-huge", manifest_edit(lambda m: m["config"].update(dp=10 ** 9)),
     ManifestError, M + r"config\.dp: expected an integer in \[1, 65536\], found 1000000000", "manifest"),
    ("value-not-a-leaf", manifest_edit(lambda m: m["values"].update(nope=1)),
     ManifestError, M + r"values\['nope'\]: not a value leaf of the tree", "manifest"),
    ("deep-json", _deep_manifest,
     ManifestError, M + r"expected at most 68 levels of nesting, found 200\d\d\d", "manifest"),
    ("deep-meta", manifest_edit(lambda m: m.update(meta={"x": _nested(200)})),
     ManifestError, M + r"expected at most 68 levels of nesting, found 20\d", "manifest"),
    ("deep-meta-within-document", manifest_edit(lambda m: m.update(meta={"x": _nested(64)})),
     ManifestError, M + r"meta: expected at most 64 levels of nesting", "manifest"),
    # issue 20
    ("long-integer", _text_edit(lambda t: t.replace('"size": ', '"size": ' + "9" * 5000, 1)),
     ManifestError, M + r"malformed JSON: an integer of 50\d\d digits \(at most 40\)", "manifest"),
    ("many-containers", _text_edit(lambda t: t.rstrip().rstrip("}") + ', "extra": [' + "[]," * (1 << 22) + "[]]}"),
     ManifestError, M + r"expected at most 4194304 arrays and objects, found \d+", "manifest"),
    ("holder-classes-before-records", manifest_edit(lambda m: m["config"].update(dp=32768)),
     ManifestError, M + r"tensors: config dp=32768,tp=2,pp=1 places more than \d+ stored tensors", "manifest"),
    ("manifest-links-outside", _link_outside(MANIFEST),
     PathError, M + r"resolves to .*outside\.json, outside the checkpoint directory", "manifest"),
    ("shards-dir-links-outside", _link_outside("shards"),
     PathError, r"/shards/[^:]+\.safetensors: resolves to .*/outside/[^,]+, outside the checkpoint", "shard"),
    ("shard-file-links-outside", _link_outside("first-shard"),
     PathError, r"/shards/[^:]+\.safetensors: resolves to .*outside\.safetensors, outside the checkpoint",
     "shard"),
    ("st-length-beyond-file", _length_beyond_file,
     CorruptShardError, r"/shards/[^:]+\.safetensors: safetensors header length: expected at most "
     r"\d+ bytes \(file of \d+ bytes\), found \d+", "shard"),
    ("st-offsets-out-of-range", header_edit(_st_out_of_range),
     CorruptShardError, S + r": tensor '[^']+': data_offsets: expected \[start, end\] with "
     r"0 <= start <= end <= \d+", "shard"),
    ("st-overlap", header_edit(_st_overlap),
     CorruptShardError, S + r": tensors '[^']+' \[\d+, \d+\) and '[^']+' \[\d+, \d+\) overlap", "shard"),
    ("st-dtype-shape-disagree", header_edit(_st_shape),
     CorruptShardError, S + r": tensor '[^']+': dtype \w+ and shape \[.*\] make \d+ bytes, "
     r"data_offsets \[\d+, \d+\] hold \d+", "shard"),
    ("st-dtype-not-the-manifest", header_edit(_st_dtype),
     CorruptShardError, S + r", tensor '[^']+': dtype: the manifest says bfloat16, the header float16",
     "shard"),
    ("st-malformed-json", header_edit(lambda h: b"{nope"),
     CorruptShardError, S + r": malformed JSON", "shard"),
    ("st-not-an-object", header_edit(lambda h: b"[]"),
     CorruptShardError, S + r": expected a JSON object, found list", "shard"),
]

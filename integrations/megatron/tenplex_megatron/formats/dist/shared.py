"""A ``torch_dist`` directory's opened source as JSON, and a source rebuilt from it.

:func:`share_dist` is run by the process that opened the directory
(:func:`~tenplex_megatron.formats.dist.source.open_dist`: ``.metadata`` read
through the allow-listed unpickler and checked against the files, each
item's header located, ``common.pt`` and the byte objects checked, the tied
copies compared); :func:`open_shared_dist` by the others, which then read no
``.metadata``, ``common.pt`` or item header: each stored chunk arrives as
``[DCP key, chunk offsets, [file, offset, shape, dtype]]`` (its box is its
offsets and its shape) and is checked by :mod:`tenplex_megatron.formats.shared`
(inside a ``.distcp`` file of the size process 0 saw, a known dtype); each
tensor's chunks must tile its global size (inside it, disjoint, covering it); where a
chunk is read, its shape and dtype are checked against the model's again
(:meth:`DistSource._chunk_ref`). The RNG states arrive as the byte ranges of
their objects (``{"tp=T,pp=P": [DCP key, file, offset, length]}``): a process
reads and unpickles (allow-listed, :func:`~tenplex_megatron.torchfiles.safe_load.safe_load`)
those it needs, as one process would.
"""

from __future__ import annotations

import io
import os
from math import prod
from typing import Any

from tenplex.errors import CorruptShardError, ManifestError
from tenplex.limits import MAX_WORLD, short
from tenplex.ptree.region import Box, intersect
from tenplex.store.paths import open_regular, resolve_inside

from tenplex_megatron.dcp.checks import MAX_KEY, MAX_OBJECT_BYTES, item_file
from tenplex_megatron.dcp.records import MetadataIndex, TensorStorageMetadata
from tenplex_megatron.formats.dist.read import FoundDist, rng_coords
from tenplex_megatron.formats.dist.source import DistSource
from tenplex_megatron.formats.shared import description_from, field, ref_from, ref_json, share_common
from tenplex_megatron.torchfiles.safe_load import safe_load

__all__ = ["share_dist", "open_shared_dist", "SharedDistSource"]


def share_dist(source: DistSource) -> dict:
    """The shared form of an opened ``torch_dist`` source (JSON; see :mod:`tenplex_megatron.formats.shared`)."""
    root, md = source.root, source.md
    chunks, files, sizes = [], set(), {}
    for key, item in md.state_dict_metadata.items():
        if type(item) is TensorStorageMetadata:
            for c in item.chunks:
                ref = source._refs[MetadataIndex(key, c.offsets)]
                files.add(ref.file)
                chunks.append([key, list(c.offsets), ref_json(ref, root)])
            sizes[key] = list(item.size)
    rng = {}
    for coord, fqns in sorted(rng_coords(md).items()):
        rng[coord] = []
        for fqn in fqns:
            info = md.storage_data[MetadataIndex(fqn)]
            path, _ = item_file(root, info.relative_path)
            files.add(path)
            rng[coord].append([fqn, info.relative_path, info.offset, info.length])
    flat = []  # dp_zero_gather_scatter state: each leaf's place in its object's pickle
    for (path, t, p), ref in sorted(source._flat_refs.items()):
        files.add(ref.file)
        flat.append([path, t, p, ref_json(ref, root)])
    out = share_common(source, root, files)
    out.update(chunks=chunks, sizes=sizes, rng=rng, flat=flat)
    return out


class SharedDistSource(DistSource):
    """A :class:`DistSource` rebuilt from a shared form: no ``.metadata``, chunks and RNG states by byte ranges."""

    def __init__(self, found: FoundDist, boxes: dict[str, list[Box]], rng: dict[str, tuple]):
        super().__init__(found)
        self.boxes, self.rng = boxes, rng

    def chunk_boxes(self, key: str) -> list[Box]:
        boxes = self.boxes.get(key)
        if boxes is None:
            raise ManifestError(f"{self.root}: the source description from process 0 has no tensor item {key}")
        return boxes

    def rng_objects(self, key: str) -> list[tuple[str, Any]]:
        out = []
        for fqn, path, offset, length in self.rng.get(key, []):
            f, _ = open_regular(path, path)
            with f:
                f.seek(offset)
                data = f.read(length)
            self.count(len(data))
            if len(data) != length:
                raise CorruptShardError(f"{path} [{fqn}]: read {len(data)} of {length} bytes")
            out.append((fqn, safe_load(io.BytesIO(data), f"{path} [{fqn}]")))
        return out

    def check_objects(self) -> None:
        """Checked by process 0, which read them; this process reads no byte object."""


def _rng(shared: dict, root: str, sizes: dict[str, int], what: str) -> dict[str, list[tuple]]:
    """``{"tp=T,pp=P": [(DCP key, path, offset, length), ...]}``, each range inside its shared file."""
    out = {}
    for coord, items in field(shared, "rng", dict, what).items():
        if not isinstance(items, list) or not 0 < len(items) <= MAX_WORLD:
            raise ManifestError(f"{what}: RNG state {short(coord, 40)} is {short(items, 120)}; expected a "
                                f"list of 1 to {MAX_WORLD} objects")
        out[coord] = []
        for item in items:
            if not isinstance(item, list) or len(item) != 4 or not isinstance(item[0], str) or \
                    item[1] not in sizes or not all(type(n) is int and n >= 0 for n in item[2:]) or \
                    item[2] + item[3] > sizes[item[1]] or item[3] > MAX_OBJECT_BYTES:
                raise ManifestError(f"{what}: RNG state {short(coord, 40)} is {short(item, 120)}; expected "
                                    f"[key, shared file, offset, length] inside the file, at most "
                                    f"{MAX_OBJECT_BYTES} bytes")
            out[coord].append((item[0], os.path.join(root, item[1]), item[2], item[3]))
    return out


def _check_tiling(boxes: dict[str, list[Box]], sizes: dict, what: str) -> None:
    """Each tensor's chunks lie inside its global size, share no element, and cover it.

    Raises:
        ManifestError: naming the tensor and the chunk.
    """
    for key, found in boxes.items():
        size = sizes.get(key)
        if not isinstance(size, list) or len(size) != len(found[0].sizes) or \
                not all(type(n) is int and n >= 0 for n in size):
            raise ManifestError(f"{what}: {key}: global size {short(size, 80)}; expected "
                                f"{len(found[0].sizes)} non-negative ints")
        for box in found:
            if any(o + n > m for o, n, m in zip(box.offsets, box.sizes, size)):
                raise ManifestError(f"{what}: {key}: chunk {box} lies outside the tensor's size {size}")
        if sum(prod(b.sizes) for b in found) != prod(size):
            raise ManifestError(f"{what}: {key}: its chunks hold {sum(prod(b.sizes) for b in found)} "
                                f"elements; the tensor has {prod(size)}")
        ordered = sorted(found, key=lambda b: b.offsets[:1])
        for i, box in enumerate(ordered):  # disjoint: compare the chunks whose first-axis ranges meet
            for other in ordered[i + 1:]:
                if box.offsets and other.offsets[0] >= box.offsets[0] + box.sizes[0]:
                    break
                if prod(box.sizes) and prod(other.sizes) and intersect(box, other) is not None:
                    raise ManifestError(f"{what}: {key}: chunks {box} and {other} overlap")


def open_shared_dist(path: str, shared: Any) -> SharedDistSource:
    """The source :func:`share_dist` described, for the checkpoint at ``path`` (the same path).

    Raises:
        ManifestError, ConfigError, PathError: a malformed form, a folder outside ``path``, or
            one that does not fit the model or the files on disk
            (see :func:`tenplex_megatron.formats.shared.description_from`).
    """
    what = f"{path}: the source description from process 0"
    root = field(field(field(shared, "meta", dict, what), "megatron", dict, what), "root", str, what)
    if os.path.realpath(root) != os.path.realpath(path):  # the data folder: path or an iteration folder in it
        resolve_inside(path, root, what)
    desc, sizes = description_from(shared, "dist", root, what)
    refs, boxes = {}, {}
    for item in field(shared, "chunks", list, what):
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str) or \
                not 0 < len(item[0]) <= MAX_KEY or not isinstance(item[1], list):
            raise ManifestError(f"{what}: a chunk is {short(item, 120)}; expected [key, offsets, tensor]")
        key, offsets, ref = item
        ref = ref_from(ref, root, sizes, f"{what}: {key}")
        if len(offsets) != len(ref.shape) or not all(type(o) is int and o >= 0 for o in offsets):
            raise ManifestError(f"{what}: {key}: chunk offsets {short(offsets, 80)} for a "
                                f"{len(ref.shape)}-d chunk; expected as many non-negative ints")
        index = MetadataIndex(key, offsets)
        if index in refs:
            raise ManifestError(f"{what}: {key}: chunk at {offsets} is sent twice")
        refs[index] = ref
        boxes.setdefault(key, []).append(Box(tuple(offsets), ref.shape))
    _check_tiling(boxes, field(shared, "sizes", dict, what), what)
    flat = _flat(shared, desc, root, sizes, what)
    return SharedDistSource(FoundDist(desc, None, 0, refs, flat), boxes, _rng(shared, root, sizes, what))


def _flat(shared: dict, desc, root: str, sizes: dict[str, int], what: str) -> dict:
    """``{(optimizer leaf, t, p): TensorRef}`` of a ``dp_zero_gather_scatter`` source, each inside its file."""
    out = {}
    for item in field(shared, "flat", list, what):
        if not isinstance(item, list) or len(item) != 4 or not isinstance(item[0], str) or \
                not item[0].startswith("optimizer/") or item[0] not in desc.tree.leaves or \
                not all(type(n) is int for n in item[1:3]) or not 0 <= item[1] < desc.config.tp or \
                not 0 <= item[2] < desc.config.pp:
            raise ManifestError(f"{what}: an optimizer buffer place is {short(item, 120)}; expected "
                                f"[optimizer leaf, tp rank, pp rank, tensor] at tp={desc.config.tp}, pp={desc.config.pp}")
        out[(item[0], item[1], item[2])] = ref_from(item[3], root, sizes, f"{what}: {item[0]}")
    return out

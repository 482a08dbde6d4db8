"""A ``torch_dist`` directory as a shard source: local tensors read from the DCP chunks that overlap them.

DCP stores each saved box (a *chunk*) of a global tensor as a ``torch.save``
blob at a recorded byte range of a ``.distcp`` file
(``Metadata.storage_data[MetadataIndex(key, offsets)]``). For a rank's
local tensor, :class:`DistSource` intersects each of its pieces with the
chunks of its DCP key and reads, per intersection, only the contiguous run
of the chunk's bytes that covers it. Where a chunk's tensor bytes start was
found when the metadata was checked (its blob's zip directory and pickle: a
few KB, parsed once: :func:`tenplex_megatron.dcp.checks.check_metadata`).
"""

from __future__ import annotations

import os
import threading
from math import prod
from typing import Any

import numpy as np
import torch

from tenplex.errors import ManifestError
from tenplex.limits import short
from tenplex.ptree.config import Coord
from tenplex.ptree.region import Box, flat_start, intersect, is_contiguous, relative, to_slices
from tenplex.ptree.sharding import Piece
from tenplex.ptree.shards import piece_view
from tenplex.ptree.tree import torch_dtype

from tenplex_megatron.formats.main_params import check_main_params
from tenplex_megatron.formats.dist.buffers import flat_index, optimizer_buffers
from tenplex_megatron.formats.dist.dp_zero import DP_ZERO
from tenplex_megatron.formats.dist.keys import EXTRA_KEY, chain_prefix, dist_key, optimizer_prefix
from tenplex_megatron.formats.dist.model_space import MODEL_SPACE, model_space_pieces
from tenplex_megatron.formats.dist.read import DcpRecord, FoundDist, describe_dist, rng_coords
from tenplex_megatron.dcp.records import MetadataIndex
from tenplex_megatron.dcp.safe import read_objects
from tenplex_megatron.torchfiles.jsonable import to_jsonable
from tenplex_megatron.model.layouts import spec_of
from tenplex_megatron.torchfiles.ptfile import TensorRef, read_runs
from tenplex_megatron.formats.source import MegatronSource, empty_extra_state, extra_state_note
from tenplex_megatron.model.tied import check_tied

__all__ = ["DistSource", "open_dist", "chunk_path"]


def chunk_path(root: str, relative_path: str) -> str:
    """The ``.distcp`` file a chunk lives in; the recorded name must be a plain file name.

    Raises:
        ManifestError: for a path that would leave ``root``.
    """
    name = str(relative_path)
    if not name or name != os.path.basename(name) or name in (".", "..") or "\\" in name:
        raise ManifestError(f"{root}/.metadata: storage path {name!r} is not a file name inside the "
                            "checkpoint directory")
    return os.path.join(root, name)


class DistSource(MegatronSource):
    """A megatron-core ``torch_dist`` directory as a ``ShardSource`` (see :func:`open_dist`)."""

    def __init__(self, found: FoundDist):
        super().__init__(found.desc)
        self.md, self.root = found.md, self.meta["megatron"]["root"]
        self.optim = self.meta["megatron"]["optimizer"]
        self.count(found.bytes_read)
        self._chunk_lock = threading.Lock()
        self._chunks: dict[str, dict] = {}
        self._refs: dict[MetadataIndex, TensorRef] = found.refs
        self._flat_refs: dict = found.flat_refs or {}  # dp_zero_gather_scatter state: TensorRefs in its objects
        self._rng_keys: dict | None = None  # rng_coords(md), found once (it scans every key)

    # -- where a local tensor lies ----------------------------------------------------
    def locate(self, path: str, coord: Coord) -> DcpRecord:
        leaf = self.tree[path]
        dtype = torch_dtype(leaf.dtype)
        if path.startswith("optimizer/"):
            state, model = path.split("/")[1], "model/" + path.split("/", 2)[2]
            spec = spec_of(self.desc.cfg, model)
            if self.optim == "dp_reshardable":
                return self._flat_record(spec, state, coord, dtype)
            if self.optim == DP_ZERO:
                ref = self._flat_refs.get((path, coord.tp, coord.pp))
                if ref is None:
                    raise ManifestError(f"{self.root}: {path} is in no optimizer buffer of the rank at {coord}")
                return ref
            prefix = optimizer_prefix(self.optim, state, self.desc.cfg.params_dtype)
            if self.meta["megatron"].get("chained_prefix"):
                prefix = chain_prefix(spec) + prefix
        else:
            spec, prefix = spec_of(self.desc.cfg, path), ""
        held = self.sharding.holding(path, coord)
        key, lead, _ = dist_key(self.desc.cfg, spec, self.meta["megatron"].get("names", "local"))
        pieces = held.pieces
        if prefix and self.optim == MODEL_SPACE:  # each tp shard flattened (model_space.py)
            pieces = model_space_pieces(self.sharding.physical_shape(leaf), pieces, f"{self.root}: {prefix + key}")
        return DcpRecord(prefix + key, lead, pieces, held.shape, dtype)

    def _flat_record(self, spec, state, coord, dtype) -> DcpRecord:
        found = flat_index(self.desc.cfg, self.config, spec.path, coord)
        if found is None:
            raise ManifestError(f"{self.root}: {spec.path} is in no optimizer buffer of the rank at {coord}")
        buf, b, start, numel = found
        key = buf.key(b, state, self.meta["megatron"]["buffer_dtypes"])
        shape = self.sharding.tp_local(spec.leaf, buf.split)[0]
        piece = Piece(Box((start,), (numel,)), 0, (numel,), Box((0,), (numel,)))
        return DcpRecord(key, (), (piece,), shape, dtype)

    def copies(self, path: str, tp_rank: int) -> dict:
        if not (path.startswith("optimizer/") and self.optim in ("dp_reshardable", DP_ZERO)):
            return {}  # megatron-core stores one copy of a tied model tensor
        return {p: self.locate(path, Coord(0, tp_rank, p)) for p in (0, self.config.pp - 1)}

    # -- reading ----------------------------------------------------------------------
    def chunk_boxes(self, key: str) -> list[Box]:
        """The stored chunks of DCP tensor ``key``, in ``.metadata``'s order.

        Raises:
            ManifestError: no tensor item ``key``.
        """
        item = self.md.state_dict_metadata.get(key)
        if item is None or not hasattr(item, "chunks"):
            raise ManifestError(f"{self.root}/.metadata: no tensor item {key}")
        return [Box(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in item.chunks]

    def _chunk_index(self, key: str) -> dict:
        index = self._chunks.get(key)
        if index is None:
            index = {}
            for box in self.chunk_boxes(key):
                index.setdefault(box.offsets[0] if box.sizes and box.sizes[0] == 1 else None,
                                 []).append(box)
            with self._chunk_lock:
                self._chunks[key] = index
        return index

    def _chunk_ref(self, key: str, box: Box, dtype: torch.dtype) -> TensorRef:
        ref = self._refs.get(MetadataIndex(key, box.offsets))
        if ref is None:
            raise ManifestError(f"{self.root}/.metadata: chunk {box} of {key} has no tensor item")
        if ref.shape != box.sizes or ref.dtype != dtype:
            raise ManifestError(f"{ref.file}: chunk {box} of {key} holds a {list(ref.shape)} {ref.dtype} "
                                f"tensor; the model expects {list(box.sizes)} {dtype}")
        return ref

    def fetch(self, rec: DcpRecord | TensorRef, starts, ends) -> tuple[torch.Tensor, int]:
        """``rec``'s local tensor; every chunk run that overlaps the byte runs is read (a
        ``dp_zero_gather_scatter`` leaf's: the runs of its place in its object)."""
        if isinstance(rec, TensorRef):
            return rec.read(starts, ends)
        out = torch.empty(rec.shape, dtype=rec.dtype)
        itemsize, total = rec.dtype.itemsize, 0
        runs = None if starts is None else (np.asarray(starts), np.asarray(ends))
        index = self._chunk_index(rec.key)
        candidates = index.get(rec.prefix[0], []) + index.get(None, []) if rec.prefix else \
            [c for group in index.values() for c in group]
        n_pre = len(rec.prefix)
        for piece in rec.pieces:
            gbox = Box(rec.prefix + piece.box.offsets, (1,) * n_pre + piece.box.sizes)
            for chunk in candidates:
                inter = intersect(gbox, chunk)
                if inter is None:
                    continue
                local = relative(Box(inter.offsets[n_pre:], inter.sizes[n_pre:]), piece.box)
                if runs is not None and not _overlaps(piece, local, itemsize, runs):
                    continue
                ref = self._chunk_ref(rec.key, chunk, rec.dtype)
                total += _fill(out, piece, local, ref, relative(inter, chunk), chunk.sizes)
        return out, total

    def chunk_ref(self, key: str, box: Box, dtype: torch.dtype) -> TensorRef:
        """Where the tensor bytes of chunk ``box`` of ``key`` lie (found when the metadata was
        checked: :func:`tenplex_megatron.dcp.checks.check_metadata`).

        Raises:
            ManifestError: no such chunk, or one that does not hold a ``dtype`` tensor of its size.
        """
        if not any(box in group for group in self._chunk_index(key).values()):
            raise ManifestError(f"{self.root}/.metadata: {key} has no chunk {box}")
        return self._chunk_ref(key, box, dtype)

    def fetch_chunk(self, key: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        """The whole stored chunk ``box`` of ``key``."""
        tensor, n = self.chunk_ref(key, box, dtype).read()
        self.count(n)
        return tensor

    # -- values and checks ------------------------------------------------------------
    def rng_objects(self, key: str) -> list[tuple[str, Any]]:
        """The DCP keys and unpickled byte objects of the RNG state ``key`` (``"tp=T,pp=P"``), in
        :func:`~tenplex_megatron.formats.dist.read.rng_coords` order; ``[]`` where none is stored."""
        if self._rng_keys is None:
            self._rng_keys = rng_coords(self.md)
        out = []
        for fqn in self._rng_keys.get(key, []):
            out.append((fqn, read_objects(self.root, self.md, fqn).get(fqn)))
            self.count(self.md.storage_data[MetadataIndex(fqn)].length)
        return out

    def read_value(self, path: str, key: str) -> Any:
        """A value leaf; for ``megatron/rng_state`` the coordinate's states by dp-cp rank: its one
        ``rng_state_list`` (every dp rank restores entry 0, or with ``data_parallel_random_init``
        entry dp rank), or, stored per rank (:func:`~tenplex_megatron.formats.dist.keys.rng_objects`),
        each rank's own state in rank order.

        Raises:
            ManifestError: an RNG object is not ``[rng_state_list]`` with a non-empty list, or the
                per-rank lists neither hold one state each nor are all alike in length.
        """
        if path != "megatron/rng_state":
            return super().read_value(path, key)
        lists = []
        for fqn, obj in self.rng_objects(key):
            if not isinstance(obj, list) or len(obj) != 1 or not isinstance(obj[0], list) or not obj[0]:
                raise ManifestError(f"{self.root}: {fqn} holds {short(obj, 80)}; expected [rng states]")
            lists.append((fqn, obj[0]))
        if not lists:
            return None
        if len(lists) > 1 and all(len(states) == 1 for _, states in lists):
            return to_jsonable([states[0] for _, states in lists], f"{self.root}: {lists[0][0]}")
        for fqn, states in lists[1:]:  # data_parallel_random_init: every rank holds every dp rank's
            if len(states) != len(lists[0][1]):
                raise ManifestError(f"{self.root}: {fqn} holds {len(states)} RNG states, {lists[0][0]} "
                                    f"{len(lists[0][1])}; expected one each or all alike")
        return to_jsonable(lists[0][1], f"{self.root}: {lists[0][0]}")

    def check_objects(self) -> None:
        """Extra states must be empty (``[None]``) and ``dp_reshardable`` bucket sizes the layout's.

        Raises:
            ManifestError: naming the object and what it holds.
        """
        dropped = []
        for key, obj in read_objects(self.root, self.md, "decoder.layers.").items():
            if EXTRA_KEY.match(key) and not empty_extra_state(obj):
                if not isinstance(obj, list) or not all(isinstance(o, torch.Tensor) for o in obj):
                    raise ManifestError(f"{self.root}: {key} holds {type(obj).__name__}; expected a "
                                        "TransformerEngine extra state (a uint8 tensor) or None")
                dropped.append(key)
        if dropped:
            self.desc.notes.append(extra_state_note(len(dropped), dropped[0]))
        if self.optim != "dp_reshardable":
            return
        cfg, config = self.desc.cfg, self.config
        want: dict = {}
        for buf in optimizer_buffers(cfg, config):
            want.setdefault(buf.object("per_bucket_numel_unpadded"), []).append(
                [n for _, n, _ in buf.layout(cfg, config)])
        for key, sizes in want.items():
            got = read_objects(self.root, self.md, key).get(key)
            found = _bucket_sizes(got)
            if found != sizes:
                raise ManifestError(f"{self.root}: {key} records buckets {found}; the model's "
                                    f"single-bucket layout has {sizes} per buffer (bucketed buffers are "
                                    "not supported)")


def _bucket_sizes(obj: Any) -> list | None:
    """``[[bucket numel, ...] per buffer]`` of a stored ``[[{(param_dtype, grad_dtype): [...]}, ...]]``."""
    try:
        (per_buffer,) = obj
        out = []
        for per_dtype in per_buffer:
            (sizes,) = per_dtype.values()
            out.append([int(n) for n in sizes])
        return out
    except (TypeError, ValueError, IndexError, AttributeError, KeyError):
        return None


def _overlaps(piece: Piece, local: Box, itemsize: int, runs) -> bool:
    """Whether the bytes of ``local`` (a box of ``piece``) may meet any requested run."""
    lo = (piece.offset + flat_start(Box(tuple(a + b for a, b in zip(piece.local.offsets, local.offsets)),
                                        local.sizes), piece.view)) * itemsize
    last = tuple(a + b + s - 1 for a, b, s in zip(piece.local.offsets, local.offsets, local.sizes))
    hi = (piece.offset + flat_start(Box(last, (1,) * len(last)), piece.view) + 1) * itemsize
    starts, ends = runs
    return bool(np.any((starts < hi) & (ends > lo)))


def _fill(out: torch.Tensor, piece: Piece, local: Box, ref: TensorRef, box: Box, sizes) -> int:
    """Copy elements ``box`` of a stored chunk into ``local`` of ``piece`` in ``out``; the bytes read.

    Where both are one contiguous run, the bytes are read straight into ``out``.
    """
    where = Box(tuple(a + b for a, b in zip(piece.local.offsets, local.offsets)), local.sizes)
    if is_contiguous(where, piece.view) and is_contiguous(box, sizes):
        isz = ref.dtype.itemsize
        start = (piece.offset + flat_start(where, piece.view)) * isz
        n = prod(local.sizes) * isz
        base = ref.offset + flat_start(box, sizes) * isz - start
        raw = out.view(-1).view(torch.uint8).numpy()
        return read_runs(ref.file, base, np.array([start]), np.array([start + n]), raw)
    data, n = _read_box(ref, box, sizes)
    piece_view(out, piece)[to_slices(local)].copy_(data.reshape(local.sizes))
    return n


def _read_box(ref: TensorRef, box: Box, sizes: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """Elements ``box`` of a stored row-major tensor of ``sizes``: one read of the run that covers them."""
    first = flat_start(box, sizes)
    last = flat_start(Box(tuple(o + s - 1 for o, s in zip(box.offsets, box.sizes)), (1,) * len(sizes)),
                      sizes)
    span = ref.narrow(first, last + 1 - first, (last + 1 - first,))
    flat, n = span.read()
    strides = [1] * len(sizes)
    for axis in range(len(sizes) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * sizes[axis + 1]
    return torch.as_strided(flat, box.sizes, strides), n


def open_dist(root: str, model_config: dict | None = None, iteration: int | str | None = None) -> DistSource:
    """A :class:`DistSource` over ``root``, its objects and tied copies checked.

    Raises:
        ManifestError, ConfigError: see :func:`describe_dist`; also a
            non-empty extra state, a bucket layout tenplex does not write, or
            tied copies that differ, or fp32 main params that differ from the weights
            (:func:`~tenplex_megatron.formats.main_params.check_main_params`).
    """
    source = DistSource(describe_dist(root, model_config, iteration))
    source.check_objects()
    check_tied(source)
    check_main_params(source)
    return source

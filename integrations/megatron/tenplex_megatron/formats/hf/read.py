"""A Hugging Face model directory as a Megatron shard source (the import), read by byte ranges.

The directory is described as a Megatron GPT at tp = pp = ep = 1: the
model config comes from ``config.json`` (:mod:`.hfconfig`), the tree is
megatron-core's, and each Megatron tensor is built on demand from its HF
tensors (the inverse transforms), each read from its file by its byte
range. Any Megatron writer (``megatron-dist``, ``megatron-legacy``) or the
tenplex store then writes it at any parallel config through the planner.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from tenplex.errors import ConfigError, ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import torch_dtype

from tenplex_megatron.formats.description import Description
from tenplex_megatron.formats.hf import transforms as tf
from tenplex_megatron.formats.hf.catalog import families
from tenplex_megatron.formats.hf.family import TRANSFORMS, Transform, generic_key
from tenplex_megatron.formats.hf.fields import ModelFields
from tenplex_megatron.formats.hf.hfconfig import args_from_config
from tenplex_megatron.formats.hf.hfdir import StoredTensor, hf_open, read_config, tensors
from tenplex_megatron.formats.hf.rows import PARTIAL_MIN_BYTES, read_exact, read_runs, row_map
from tenplex_megatron.formats.hf.mapping import geometry
from tenplex_megatron.formats.source import MegatronSource
from tenplex_megatron.model.config import MegatronConfig, args_to_json
from tenplex_megatron.model.layouts import megatron_tree

_INV_FREQ = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""The rotary embedding's ``inv_freq`` buffer: persistent (in the state dict) in transformers before
v4.31, so the checkpoints of that time hold one per layer; derived, never a weight."""

__all__ = ["describe_hf", "open_hf", "HFSource", "Found"]


@dataclass(frozen=True)
class _Record:
    """How one Megatron tensor is made: its HF tensors, the transform, its padded rows."""

    path: str
    parts: tuple[StoredTensor, ...]
    transform: Transform
    rows: int


@dataclass
class Found:
    """A described HF directory: the description and each Megatron tensor's record."""

    desc: Description
    records: dict
    geo: tf.Geometry


def _family(config: dict, where: str):
    known = families()
    kind = config.get("model_type")
    if kind not in known:
        arch = config.get("architectures")
        raise ConfigError(f"{where}: model_type {kind!r} ({arch}); tenplex imports {', '.join(sorted(known))}")
    return known[kind]


def describe_hf(path: str, overrides: dict | None = None) -> Found:
    """Describe the HF model directory ``path`` as a Megatron GPT at tp = pp = 1 (headers only).

    Args:
        path: the directory.
        overrides: Megatron args that win over those made from ``config.json``
            (e.g. ``make_vocab_size_divisible_by``).

    Raises:
        ConfigError: an unknown family or a setting Megatron cannot run.
        ManifestError: tensors missing, left over, or of the wrong shape.
        CorruptShardError: a safetensors header that lies (:mod:`~tenplex_megatron.formats.hf.hfdir`).
    """
    where = os.path.join(path, "config.json")
    config = read_config(path)
    family = _family(config, where)
    stored = tensors(path)
    dtypes = {t.dtype for t in stored.values()}
    args = {**args_from_config(config, family, where), **dict(overrides or {})}
    args.setdefault("params_dtype", "torch." + (dtypes.pop() if len(dtypes) == 1 else config.get("dtype", "float32")))
    args.update(bf16=args["params_dtype"] == "torch.bfloat16", fp16=args["params_dtype"] == "torch.float16")
    cfg = MegatronConfig.from_args(argparse.Namespace(**args))
    fields = ModelFields.from_args(args)
    geo = geometry(cfg, fields)
    tree = megatron_tree(cfg)
    records, used = {}, set()
    for leaf_path, leaf in tree.tensors():
        key, layer, expert = generic_key(leaf_path)
        names = family.names.get(key)
        if names is None:
            raise ConfigError(f"{where}: {family.architecture} has no name for Megatron tensor {leaf_path}")
        hf = [n.format(i=layer, e=expert) for n in names]
        missing = [n for n in hf if n not in stored]
        if missing:
            raise ManifestError(f"{path}: {family.architecture} model lacks {missing[0]} (for {leaf_path})")
        used.update(hf)
        records[leaf_path] = _Record(leaf_path, tuple(stored[n] for n in hf), TRANSFORMS.get(key, Transform.COPY),
                                     cfg.padded_vocab(1) if TRANSFORMS.get(key) is Transform.VOCAB else 0)
    def place(name):
        return stored[name].file, stored[name].start, stored[name].end

    kept = {place(n) for n in used}  # a name of a used tensor's bytes (a tied alias) is not extra
    left = sorted(n for n in set(stored) - used if place(n) not in kept)
    buffers = [n for n in left if _INV_FREQ.search(n) and len(stored[n].shape) == 1]
    extra = [n for n in left if n not in buffers]
    if extra:
        raise ManifestError(f"{path}: tensor {extra[0]} (and {len(extra) - 1} more) has no place in a Megatron "
                            f"{family.name} model of this config")
    notes = [f"imported from {family.architecture}: weights only, iteration 0"]
    if buffers:
        notes.append(f"ignored {len(buffers)} rotary_emb.inv_freq buffers ({buffers[0]}, ...): derived from "
                     "rope_theta, not weights (transformers before v4.31 saved them; it ignores them on load)")
    values = {"megatron/iteration": 0, "megatron/checkpoint_version": 3.0, "megatron/args": args_to_json(args)}
    meta = {"megatron": {"format": "hf", "root": path, "config": cfg.to_json(), "optimizer": None,
                         "buffer_dtypes": None, "hf_family": family.name}}
    desc = Description(cfg, ParallelConfig(), tree, values, meta, notes)
    return Found(desc, records, geo)


class HFSource(MegatronSource):
    """An HF model directory as a ``ShardSource`` at tp = pp = 1 (see :func:`open_hf`)."""

    def __init__(self, found: Found):
        super().__init__(found.desc)
        self.records, self.geo = found.records, found.geo
        self.dtype = torch_dtype(found.desc.cfg.params_dtype)

    def locate(self, path: str, coord) -> _Record:
        record = self.records.get(path)
        if record is None:
            raise ManifestError(f"{self.where}: no HF tensor makes {path}")
        return record

    def fetch(self, record: _Record, starts, ends) -> tuple[torch.Tensor, int]:
        """The Megatron tensor of ``record`` with at least the byte runs ``[starts, ends)`` read, and the
        bytes read: only the HF rows and columns the runs need where the transform just moves rows
        (:mod:`.rows`), otherwise (or without runs, or for a small record) its HF tensors read whole.

        Raises:
            ManifestError: a file shorter than its header says; runs outside the tensor.
            CorruptShardError, PathError: a file missing, not regular, or outside its directory.
            ShardError: HF tensors whose shapes the transform cannot join (q, k, v rows; gate and up).
        """
        if starts is not None and len(starts) and sum(t.end - t.start for t in record.parts) >= PARTIAL_MIN_BYTES:
            codes = row_map(record, self.geo)  # computed per read (cheap), not kept: bounded memory
            if codes is not None:
                return read_runs(record, codes, np.asarray(starts, np.int64), np.asarray(ends, np.int64),
                                 self.dtype)
        parts = [_read(t).to(self.dtype) for t in record.parts]
        n = sum(t.end - t.start for t in record.parts)
        t = record.transform
        if t is Transform.QKV:
            out = tf.qkv_in(*parts, self.geo)
        elif t is Transform.GATE_UP:
            out = tf.gate_up_in(*parts)
        elif t is Transform.NORM:
            out = tf.norm_in(parts[0], self.geo)
        elif t is Transform.HEAD_NORM:
            out = tf.norm_in(tf.rope_rows_in(parts[0], self.geo), self.geo)
        elif t is Transform.VOCAB:
            table = tf.vocab_in(parts[0], self.geo)
            out = torch.zeros((record.rows,) + tuple(table.shape[1:]), dtype=self.dtype)
            out[: table.shape[0]] = table
        else:
            out = parts[0]
        return out.contiguous(), n


def _read(t: StoredTensor) -> torch.Tensor:
    """One stored tensor, read by its byte range (unbuffered: exactly its bytes)."""
    out = torch.empty(t.shape, dtype=torch_dtype(t.dtype))
    view = out.view(-1).view(torch.uint8).numpy() if out.numel() else np.empty(0, np.uint8)
    f, _ = hf_open(t.file, buffering=0)  # the one path rule (a hub cache snapshot's blobs too)
    with f:
        f.seek(t.start)
        read_exact(f, memoryview(view), t, 0)
    return out


def open_hf(path: str, overrides: dict | None = None) -> HFSource:
    """An :class:`HFSource` over the HF model directory ``path`` (see :func:`describe_hf`)."""
    return HFSource(describe_hf(path, overrides))

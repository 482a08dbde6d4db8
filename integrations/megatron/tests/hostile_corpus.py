"""The hostile-input corpus: one tampered file per case, made at test time from real files.

A session makes one real megatron-core checkpoint in both formats (tp1 pp1
dp1, distributed optimizer, ``fully_reshardable``): ``dist/`` holds DCP
``.metadata``, ``__0_*.distcp`` and ``common.pt``; ``legacy/`` holds
``model_optim_rng.pt`` and ``distrib_optim.pt``. Each :class:`Case` copies one
of them and tampers with one file: a hostile pickle spliced in place of one
value, a record rewritten, a path or length changed. Payloads that would run
code create ``ctx.marker`` (an absolute path) or ``pwned`` in the current
directory, so a test can see that nothing ran.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import struct
from dataclasses import dataclass
from typing import Callable

import torch

from hostile_pickles import (META, build, call, dump_metadata, first_tensor_item, glob2, glob4,
                             integer, item_bytes, load_own_metadata, make_fifo, mapping, newobj,
                             pt_blob, pt_edit, pt_records, replace_value, repoint, shell,
                             splice_metadata, strip_frames, tensor_args, tensor_pickle, text, tup,
                             typed_tensor_pickle)
from mcore_helpers import run_worker

from tenplex.errors import CorruptShardError, ManifestError, PathError, UnsafePickleError

MODEL = ("--layers 2 --hidden 32 --heads 4 --query-groups 2 --ffn 48 --swiglu --position rope "
         "--untie --vocab 64 --make-vocab-size-divisible-by 16 --seq 8 --batch 2 --train-steps 1 "
         "--dist-opt --sharding-type fully_reshardable")
MODEL_PT = "iter_0000010/mp_rank_00/model_optim_rng.pt"
DOPT_PT = "iter_0000010/mp_rank_00/distrib_optim.pt"
CWD_MARKER = "pwned"

_made: dict[str, pathlib.Path] = {}


def real_checkpoint(root: pathlib.Path) -> pathlib.Path:
    """``root`` holding ``dist/`` and ``legacy/`` written by real megatron-core (once per process)."""
    if "real" not in _made:
        run_worker(1, 1, MODEL, "--save", "both", "--save-dir", str(root))
        _made["real"] = root
    return _made["real"]


@dataclass
class Ctx:
    marker: pathlib.Path  # absolute path a payload would create


@dataclass(frozen=True)
class Case:
    """One hostile file.

    Attributes:
        id: the test id.
        fmt: ``"dist"`` or ``"legacy"``: which real directory is copied.
        file: the tampered file (relative to the directory); errors must name its basename.
        error: the tenplex error the Python API raises.
        message: a regex the one-line message must match.
        make: ``make(directory, ctx)`` tampers with the copy.
        api: the lowest API that must refuse it: ``metadata`` (``read_metadata``),
            ``pt`` (``safe_load``), ``objects`` (``read_objects``).
        command: the CLI command that reads it (``reshard`` reads every byte object).
    """

    id: str
    fmt: str
    file: str
    error: type
    message: str
    make: Callable[[pathlib.Path, Ctx], None]
    api: str
    command: str = "inspect"


def _touch(ctx: Ctx) -> str:
    return f"touch {ctx.marker}"


# ---------------------------------------------------------------- DCP .metadata payloads

def _meta(payload: Callable[[Ctx], bytes]):
    return lambda d, ctx: splice_metadata(d, payload(ctx))


_DOTTED4 = glob4(META, "os.system")
_SIZE = glob4("torch", "Size")
_STORAGE_META = newobj(glob4(META, "StorageMeta"))
_HUGE_TEXT = b"X" + struct.pack("<I", 0xFFFFFFF0)


def _huge_frame(d: pathlib.Path, ctx: Ctx) -> None:
    data = strip_frames((d / ".metadata").read_bytes())
    (d / ".metadata").write_bytes(data[:2] + b"\x95" + struct.pack("<Q", 1 << 62) + data[2:])


def _truncate(rel: str):
    def make(d: pathlib.Path, ctx: Ctx) -> None:
        p = d / rel
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return make


def _edit_md(edit: Callable) -> Callable:
    def make(d: pathlib.Path, ctx: Ctx) -> None:
        md = load_own_metadata(d)
        edit(d, md)
        dump_metadata(d, md)
    return make


def _set_info(**change) -> Callable:
    """Change the storage record of the first tensor's first chunk; values may be callables of (d, info)."""
    def edit(d, md):
        _, _, _, index = first_tensor_item(md)
        info = md.storage_data[index]
        md.storage_data[index] = dataclasses.replace(
            info, **{k: v(d, info) if callable(v) else v for k, v in change.items()})
    return edit


def _outside(d: pathlib.Path, info) -> pathlib.Path:
    out = d.parent / "outside.distcp"
    shutil.copy(d / info.relative_path, out)
    return out


def _symlink(d: pathlib.Path, info) -> str:
    (d / "link.distcp").symlink_to(_outside(d, info))
    return "link.distcp"


def _fifo(d: pathlib.Path, info) -> str:
    make_fifo(d / "pipe.distcp")
    return "pipe.distcp"


def _share_bytes(d, md):
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
    same = [(MetadataIndex(k, c.offsets), md.storage_data[MetadataIndex(k, c.offsets)])
            for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
            for c in v.chunks]
    (i0, a), (i1, b) = [x for x in same if x[1].relative_path == same[0][1].relative_path][:2]
    md.storage_data[i1] = dataclasses.replace(b, offset=a.offset)


def _chunk_gap(d, md):
    _, item, chunk, _ = first_tensor_item(md, multi_row=True)
    item.chunks[0] = dataclasses.replace(chunk, sizes=torch.Size([chunk.sizes[0] - 1, *chunk.sizes[1:]]))


def _chunk_overlap(d, md):
    _, item, chunk, _ = first_tensor_item(md, multi_row=True)
    rows, rest = chunk.sizes[0], list(chunk.sizes[1:])
    a, b = rows // 2 + 1, rows // 2 - 1  # [0, a) and [b, b + rows - a): same volume, rows [b, a) twice
    item.chunks[:] = [dataclasses.replace(chunk, sizes=torch.Size([a, *rest])),
                      dataclasses.replace(chunk, offsets=torch.Size([b, *[0] * len(rest)]),
                                          sizes=torch.Size([rows - a, *rest]))]


def _dtype_lie(d, md):
    _, item, _, _ = first_tensor_item(md)
    item.properties.dtype = torch.bfloat16


def _huge_tensor(d, md):
    _, item, chunk, _ = first_tensor_item(md)
    big = torch.Size([1 << 40, 1 << 20])
    item.size, item.chunks[:] = big, [dataclasses.replace(chunk, offsets=torch.Size([0, 0]), sizes=big)]


def _item_pickle(pickle_bytes: Callable[[Ctx], bytes], extra: dict | None = None, objects=False):
    """Replace a tensor item (or a byte object) with a torch archive holding ``pickle_bytes``."""
    def make(d: pathlib.Path, ctx: Ctx) -> None:
        md = load_own_metadata(d)
        if objects:
            from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
            key = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
            index = MetadataIndex(key)
        else:
            index = first_tensor_item(md)[3]
        records = pt_records(item_bytes(d, md.storage_data[index]))
        records = {**records, "data.pkl": pickle_bytes(ctx), **(extra or {})}
        repoint(d, md, index, pt_blob(records))
        dump_metadata(d, md)
    return make


def _big_object(d, md):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    key = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    with open(d / "big.distcp", "wb") as f:
        f.truncate(300 << 20)  # sparse: no disk used
    info = md.storage_data[MetadataIndex(key)]
    md.storage_data[MetadataIndex(key)] = dataclasses.replace(
        info, relative_path="big.distcp", offset=0, length=300 << 20)


_U = UnsafePickleError
_NOT_ALLOWED = r"global {} is not in the {} allow-list"
_SIXTEEN = {"data/999": bytes(16)}

META_CASES = [
    Case("meta-dotted-os-system", "dist", ".metadata", _U,
         _NOT_ALLOWED.format(r"torch\.distributed\.checkpoint\.metadata\.os\.system", "DCP metadata"),
         _meta(lambda c: shell(_DOTTED4, _touch(c))), "metadata"),
    Case("meta-dotted-cwd", "dist", ".metadata", _U, r"os\.system is not in the DCP metadata allow-list",
         _meta(lambda c: shell(_DOTTED4, f"touch {CWD_MARKER}")), "metadata", "verify"),
    Case("meta-open-cwd", "dist", ".metadata", _U, _NOT_ALLOWED.format(r"builtins\.open", "DCP metadata"),
         _meta(lambda c: call(glob4("builtins", "open"), text(CWD_MARKER), text("w"))), "metadata",
         "reshard"),
    Case("meta-nested-reduce-shell", "dist", ".metadata", _U, r"os\.system is not in",
         _meta(lambda c: call(_SIZE, tup(shell(_DOTTED4, _touch(c))))), "metadata"),
    Case("meta-nested-reduce-size", "dist", ".metadata", _U, r"torch\.Size takes one tuple",
         _meta(lambda c: call(_SIZE, tup(call(_SIZE, tup(integer(1)))))), "metadata", "verify"),
    Case("meta-reduce-record", "dist", ".metadata", _U,
         r"REDUCE on torch\.distributed\.checkpoint\.metadata\.Metadata is not allowed",
         _meta(lambda c: call(glob4(META, "Metadata"), b"}")), "metadata", "reshard"),
    Case("meta-build-setstate-shell", "dist", ".metadata", _U, r"os\.system is not in",
         _meta(lambda c: _STORAGE_META + build(mapping((text("__setstate__"), _DOTTED4)))
               + build(text(_touch(c)))), "metadata"),
    Case("meta-build-setstate-field", "dist", ".metadata", _U, r"field '__setstate__' is not one of",
         _meta(lambda c: _STORAGE_META + build(mapping((text("__setstate__"), _SIZE)))), "metadata",
         "verify"),
    Case("meta-build-twice", "dist", ".metadata", _U, r"a second BUILD on the same StorageMeta",
         _meta(lambda c: _STORAGE_META + build(mapping()) + build(mapping())), "metadata", "reshard"),
    Case("meta-build-list", "dist", ".metadata", _U, r"BUILD on list is not allowed",
         _meta(lambda c: b"]" + build(mapping())), "metadata"),
    Case("meta-huge-string", "dist", ".metadata", _U, r"truncated: BINUNICODE needs 4294967280 bytes",
         _meta(lambda c: _HUGE_TEXT), "metadata", "verify"),
    Case("meta-huge-frame", "dist", ".metadata", _U, r"truncated: FRAME of 4611686018427387904 bytes",
         _huge_frame, "metadata", "reshard"),
    Case("meta-truncated", "dist", ".metadata", _U, r"truncated", _truncate(".metadata"), "metadata"),
    Case("meta-relpath-parent", "dist", ".metadata", PathError, r"relative_path '\.\./outside\.distcp' contains '\.\.'",
         _edit_md(_set_info(relative_path=lambda d, i: (_outside(d, i), "../outside.distcp")[1])),
         "metadata", "verify"),
    Case("meta-relpath-absolute", "dist", ".metadata", PathError, r"outside\.distcp' is absolute",
         _edit_md(_set_info(relative_path=lambda d, i: str(_outside(d, i)))), "metadata", "reshard"),
    Case("meta-relpath-symlink", "dist", ".metadata", PathError,
         r"relative_path 'link\.distcp': resolves to .*outside\.distcp, outside the checkpoint directory",
         _edit_md(_set_info(relative_path=_symlink)), "metadata"),
    Case("meta-relpath-fifo", "dist", "pipe.distcp", CorruptShardError, r"not a regular file",
         _edit_md(_set_info(relative_path=_fifo)), "metadata", "verify"),
    Case("meta-length-past-end", "dist", ".distcp", CorruptShardError, r"lie past the end of the file",
         _edit_md(_set_info(length=lambda d, i: (d / i.relative_path).stat().st_size + 1)), "metadata",
         "reshard"),
    Case("meta-huge-length", "dist", ".distcp", CorruptShardError,
         r"\[\d+, 4611686018427387904\) lie past the end", _edit_md(_set_info(offset=0, length=1 << 62)),
         "metadata"),
    Case("meta-items-share-bytes", "dist", ".distcp", CorruptShardError, r"share bytes",
         _edit_md(_share_bytes), "metadata", "verify"),
    Case("meta-chunk-gap", "dist", ".metadata", ManifestError, r"\(a gap or an overlap\)",
         _edit_md(_chunk_gap), "metadata", "reshard"),
    Case("meta-chunk-overlap", "dist", ".metadata", ManifestError, r"chunks at \(0, 0\) and \(\d+, 0\) overlap",
         _edit_md(_chunk_overlap), "metadata"),
    Case("meta-dtype-lie", "dist", ".distcp", CorruptShardError,
         r"holds a \(.*\) torch\.float32 tensor, the metadata says \(.*\) torch\.bfloat16",
         _edit_md(_dtype_lie), "metadata", "verify"),
    Case("meta-huge-tensor", "dist", ".metadata", CorruptShardError,
         r"needs 4611686018427387904 bytes, its item has \d+", _edit_md(_huge_tensor), "metadata",
         "reshard"),
    Case("item-torch-default-global", "dist", "evil.distcp", _U,
         _NOT_ALLOWED.format(r"builtins\.bytearray", "torch file"),
         _item_pickle(lambda c: call(glob2("builtins", "bytearray"), integer(1 << 60)) + b"."),
         "metadata"),
    Case("item-tensor-past-storage", "dist", "evil.distcp", _U,
         r"a tensor of size \(1000,\), stride \(1,\), offset 0 reaches element 1000 of a storage of 4",
         _item_pickle(lambda c: tensor_pickle(4, (1000,), (1,)) + b".", _SIXTEEN), "metadata", "verify"),
    Case("item-numel-lie", "dist", "evil.distcp", _U, r"record data/999 holds 16 bytes",
         _item_pickle(lambda c: tensor_pickle(1 << 40, (4,), (1,)) + b".", _SIXTEEN), "metadata",
         "reshard"),
    Case("object-dotted-global", "dist", "evil.distcp", _U,
         _NOT_ALLOWED.format(r"argparse\._os\.system", "torch file") + r" \(dotted names",
         _item_pickle(lambda c: shell(glob2("argparse", "_os.system"), _touch(c)) + b".", objects=True),
         "objects", "reshard"),
    Case("object-too-large", "dist", ".metadata", CorruptShardError,
         r"byte object .* is 314572800 bytes \(at most 268435456\)", _edit_md(_big_object), "metadata",
         "reshard"),
]


# ---------------------------------------------------------------- .pt payloads (protocol 2)

def _pt(rel: str, key: str, payload: Callable[[Ctx], bytes], extra: dict | None = None):
    return lambda d, ctx: pt_edit(d / rel, lambda data: replace_value(data, key, payload(ctx)), extra)


def _pt_truncated_pickle(rel: str):
    return lambda d, ctx: pt_edit(d / rel, lambda data: data[: len(data) // 2])


def _fifo_file(rel: str):
    return lambda d, ctx: make_fifo(d / rel)


_DOTTED2 = glob2("argparse", "_os.system")
_ENCODE = glob2("_codecs", "encode")
_U4 = call(glob2("numpy", "dtype"), text("u4"), b"\x89", b"\x88") + build(
    tup(integer(3), text("<"), b"N", b"N", b"N", integer(-1), integer(-1), integer(0)))
_RECONSTRUCT = call(glob2("numpy._core.multiarray", "_reconstruct"), glob2("numpy", "ndarray"),
                    tup(integer(0)), call(_ENCODE, text("b"), text("latin1")))


def _pt_cases(prefix: str, fmt: str, rel: str, key: str) -> list[Case]:
    """The pickle attacks that apply to every ``.pt`` file, spliced in place of ``key``'s value."""
    return [
        Case(f"{prefix}-dotted-os-system", fmt, rel, _U,
             _NOT_ALLOWED.format(r"argparse\._os\.system", "torch file") + r" \(dotted names",
             _pt(rel, key, lambda c: shell(_DOTTED2, _touch(c))), "pt"),
        Case(f"{prefix}-open-cwd", fmt, rel, _U, _NOT_ALLOWED.format(r"builtins\.open", "torch file"),
             _pt(rel, key, lambda c: call(glob2("builtins", "open"), text(CWD_MARKER), text("w"))), "pt",
             "verify"),
        Case(f"{prefix}-reduce-namespace", fmt, rel, _U, r"REDUCE on argparse\.Namespace is not allowed",
             _pt(rel, key, lambda c: call(glob2("argparse", "Namespace"))), "pt", "reshard"),
        Case(f"{prefix}-nested-reduce", fmt, rel, _U, r"only encode\(str, 'latin1'\) is allowed",
             _pt(rel, key, lambda c: call(_ENCODE, call(_ENCODE, text("a"), text("latin1")), text("latin1"))),
             "pt"),
        Case(f"{prefix}-build-namespace-setstate", fmt, rel, _U, r"field name '__setstate__'",
             _pt(rel, key, lambda c: newobj(glob2("argparse", "Namespace"))
                 + build(mapping((text("__setstate__"), _ENCODE))) + build(text("x"))), "pt", "verify"),
        Case(f"{prefix}-build-twice", fmt, rel, _U, r"a second BUILD on the same Namespace",
             _pt(rel, key, lambda c: newobj(glob2("argparse", "Namespace")) + build(mapping())
                 + build(mapping())), "pt"),
        Case(f"{prefix}-huge-string", fmt, rel, _U, r"truncated: BINUNICODE needs 4294967280 bytes",
             _pt(rel, key, lambda c: _HUGE_TEXT), "pt", "reshard"),
        Case(f"{prefix}-tensor-past-storage", fmt, rel, _U, r"reaches element 1000 of a storage of 4",
             _pt(rel, key, lambda c: tensor_pickle(4, (1000,), (1,)), _SIXTEEN), "pt"),
        Case(f"{prefix}-truncated-pickle", fmt, rel, _U, r"truncated", _pt_truncated_pickle(rel), "pt",
             "verify"),
        Case(f"{prefix}-truncated-file", fmt, rel, CorruptShardError, r"not a torch zip archive",
             _truncate(rel), "pt", "reshard"),
    ]


PT_CASES = [
    *_pt_cases("common", "dist", "common.pt", "checkpoint_version"),
    *_pt_cases("model", "legacy", MODEL_PT, "checkpoint_version"),
    *_pt_cases("dopt", "legacy", DOPT_PT, "buckets_coalesced"),
    Case("model-reduce-ndarray", "legacy", MODEL_PT, _U, r"REDUCE on numpy\.ndarray is not allowed",
         _pt(MODEL_PT, "checkpoint_version", lambda c: call(glob2("numpy", "ndarray"), tup(integer(1 << 50)))),
         "pt"),
    Case("model-np-object-dtype", "legacy", MODEL_PT, _U, r"only numpy\.dtype\(code, False, True\)",
         _pt(MODEL_PT, "checkpoint_version", lambda c: call(glob2("numpy", "dtype"), text("O"), b"\x89", b"\x88")),
         "pt", "verify"),
    Case("model-np-huge-array", "legacy", MODEL_PT, _U, r"only _reconstruct\(numpy\.ndarray, \(0,\), b'b'\)",
         _pt(MODEL_PT, "checkpoint_version", lambda c: call(
             glob2("numpy._core.multiarray", "_reconstruct"), glob2("numpy", "ndarray"),
             tup(integer(1 << 50)), call(_ENCODE, text("b"), text("latin1")))), "pt", "reshard"),
    Case("model-np-shape-lie", "legacy", MODEL_PT, _U, r"8 bytes of data for shape \(1099511627776,\) of u4",
         _pt(MODEL_PT, "checkpoint_version", lambda c: _RECONSTRUCT + build(tup(
             integer(1), tup(integer(1 << 40)), _U4, b"\x89", call(_ENCODE, text("abcdefgh"), text("latin1"))))),
         "pt"),
    Case("model-build-ordered-dict", "legacy", MODEL_PT, _U, r"only a _metadata dict may be set",
         _pt(MODEL_PT, "checkpoint_version", lambda c: call(glob2("collections", "OrderedDict"))
             + build(mapping((text("__setstate__"), _ENCODE)))), "pt", "verify"),
    Case("model-numel-lie", "legacy", MODEL_PT, _U, r"record data/999 holds 16 bytes, 1099511627776 x",
         _pt(MODEL_PT, "checkpoint_version", lambda c: tensor_pickle(1 << 40, (4,), (1,)), _SIXTEEN),
         "pt", "reshard"),
    Case("model-missing-record", "legacy", MODEL_PT, _U, r"record data/998 does not exist",
         _pt(MODEL_PT, "checkpoint_version", lambda c: tensor_pickle(4, (4,), (1,), key="998")), "pt"),
    Case("model-memo-huge", "legacy", MODEL_PT, _U, r"memo entry 4294967295 was never stored",
         _pt(MODEL_PT, "checkpoint_version", lambda c: b"j" + struct.pack("<I", 0xFFFFFFFF)), "pt",
         "verify"),
    Case("model-fifo", "legacy", MODEL_PT, CorruptShardError, r"not a regular file", _fifo_file(MODEL_PT),
         "pt", "reshard"),
    # a tensor with attributes (_rebuild_from_type_v2): only a plain tensor, rebuilt by _rebuild_tensor_v2,
    # with attributes of plain values
    Case("model-typed-tensor-type", "legacy", MODEL_PT, _U, r"the type is torch\.float32, not torch\.Tensor",
         _pt(MODEL_PT, "checkpoint_version", lambda c: typed_tensor_pickle(
             glob2("torch._utils", "_rebuild_tensor_v2"), glob2("torch", "float32"), mapping()), _SIXTEEN), "pt"),
    Case("model-typed-tensor-func", "legacy", MODEL_PT, _U,
         r"the rebuild function is collections\.OrderedDict, not torch\._utils\._rebuild_tensor_v2",
         _pt(MODEL_PT, "checkpoint_version", lambda c: typed_tensor_pickle(
             glob2("collections", "OrderedDict"), glob2("torch", "Tensor"), mapping()), _SIXTEEN), "pt"),
    Case("model-typed-tensor-state", "legacy", MODEL_PT, _U, r"the attributes must be a dict of at most 64",
         _pt(MODEL_PT, "checkpoint_version", lambda c: typed_tensor_pickle(
             glob2("torch._utils", "_rebuild_tensor_v2"), glob2("torch", "Tensor"),
             mapping((text("main_grad"), tensor_pickle(4, (4,), (1,))))), _SIXTEEN), "pt"),
    Case("model-typed-tensor-past-storage", "legacy", MODEL_PT, _U, r"reaches element 1000 of a storage of 4",
         _pt(MODEL_PT, "checkpoint_version", lambda c: call(
             glob2("torch._tensor", "_rebuild_from_type_v2"), glob2("torch._utils", "_rebuild_tensor_v2"),
             glob2("torch", "Tensor"), tup(*tensor_args(4, (1000,), (1,))), mapping()), _SIXTEEN), "pt"),
    Case("model-bare-tensor-type", "legacy", MODEL_PT, _U, r"REDUCE on torch\.Tensor is not allowed",
         _pt(MODEL_PT, "checkpoint_version", lambda c: call(glob2("torch", "Tensor"), integer(4))), "pt"),
    Case("dopt-rebuild-args", "legacy", DOPT_PT, _U, r"1 arguments \(expected 6 or 7\)",
         _pt(DOPT_PT, "buckets_coalesced", lambda c: call(glob2("torch._utils", "_rebuild_tensor_v2"),
                                                          text("x"))), "pt"),
]

CASES = META_CASES + PT_CASES

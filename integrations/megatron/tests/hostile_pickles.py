"""Tools to tamper with real checkpoint files: pickle opcodes, splicing, archive rewriting.

Nothing here writes a checkpoint from scratch: every edit starts from a file
that real megatron-core (or torch DCP) wrote, and replaces one value, one
record or one field with a hostile one.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import pickletools
import struct

import torch

META = "torch.distributed.checkpoint.metadata"

# ---------------------------------------------------------------- opcodes (what a hostile stream says)


def text(s: str) -> bytes:
    """BINUNICODE (the string opcode both torch's and Python's unpicklers read)."""
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def integer(n: int) -> bytes:
    if -(1 << 31) <= n < 1 << 31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def glob2(module: str, name: str) -> bytes:
    """GLOBAL (protocol 2, what torch.save writes)."""
    return b"c" + f"{module}\n{name}\n".encode()


def glob4(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4, what DCP's pickle.dump writes); resolves dotted names."""
    return text(module) + text(name) + b"\x93"


def tup(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def call(func: bytes, *args: bytes) -> bytes:
    """REDUCE: ``func(*args)``."""
    return func + tup(*args) + b"R"


def newobj(cls: bytes) -> bytes:
    """NEWOBJ: ``cls.__new__(cls)``."""
    return cls + b")\x81"


def build(state: bytes) -> bytes:
    """BUILD: give the object on the stack ``state``."""
    return state + b"b"


def mapping(*pairs: tuple[bytes, bytes]) -> bytes:
    return b"}(" + b"".join(k + v for k, v in pairs) + b"u"


def shell(glob, command: str) -> bytes:
    """``os.system(command)`` reached through the dotted or plain global ``glob(module, name)``."""
    return call(glob, text(command))


# ---------------------------------------------------------------- splicing into real pickles

_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE")
_PUTS = ("MEMOIZE", "BINPUT", "LONG_BINPUT")


def strip_frames(data: bytes) -> bytes:
    """The same pickle without FRAME opcodes (optional hints), so bytes can be spliced in."""
    out, last = [], 0
    for op, _, pos in pickletools.genops(data):
        if op.name == "FRAME":
            out.append(data[last:pos])
            last = pos + 9
    return b"".join(out) + data[last:]


def replace_value(data: bytes, key: str, payload: bytes) -> bytes:
    """Replace the (one-opcode) value that follows the first string ``key`` with ``payload``."""
    data = strip_frames(data)
    ops = list(pickletools.genops(data))
    for i, (op, arg, _) in enumerate(ops):
        if op.name in _STRINGS and arg == key:
            j = i + 1
            while ops[j][0].name in _PUTS:
                j += 1
            return data[:ops[j][2]] + payload + data[ops[j + 1][2]:]
    raise AssertionError(f"key {key!r} not found in the pickle")


# ---------------------------------------------------------------- torch zip archives


def pt_records(data: bytes) -> dict[str, bytes]:
    reader = torch._C.PyTorchFileReader(io.BytesIO(data))
    return {n: reader.get_record(n) for n in reader.get_all_records()}


def pt_write(path: pathlib.Path, records: dict[str, bytes]) -> None:
    """Write ``records`` as a torch zip archive at ``path`` (torch's own writer)."""
    if path.exists():
        path.unlink()
    writer = torch._C.PyTorchFileWriter(str(path))
    for name, blob in records.items():
        if name.startswith(".data/") or name == "version":
            continue  # the writer adds these itself
        writer.write_record(name, blob, len(blob))
    writer.write_end_of_file()


def pt_edit(path: pathlib.Path, pickle_edit=None, extra: dict | None = None) -> None:
    """Rewrite the torch archive at ``path``: ``data.pkl`` through ``pickle_edit``, plus ``extra`` records."""
    records = pt_records(path.read_bytes())
    if pickle_edit is not None:
        records["data.pkl"] = pickle_edit(records["data.pkl"])
    records.update(extra or {})
    pt_write(path, records)


def pt_blob(records: dict[str, bytes], name: str = "item") -> bytes:
    """A torch archive as bytes (for a DCP item), written through a temporary file."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = pathlib.Path(d) / f"{name}.pt"
        pt_write(p, records)
        return p.read_bytes()


def tensor_args(numel: int, size: tuple, stride: tuple, key: str = "999", storage: str = "FloatStorage"
                ) -> list[bytes]:
    """``_rebuild_tensor_v2``'s arguments for storage record ``data/<key>`` with the given numel, size, stride."""
    pid = tup(text("storage"), glob2("torch", storage), text(key), text("cpu"), integer(numel))
    return [pid + b"Q", integer(0), tup(*map(integer, size)), tup(*map(integer, stride)), b"\x89",
            call(glob2("collections", "OrderedDict"))]


def tensor_pickle(numel: int, size: tuple, stride: tuple, key: str = "999",
                  storage: str = "FloatStorage") -> bytes:
    """``_rebuild_tensor_v2`` of storage record ``data/<key>`` with the given numel, size, stride."""
    return call(glob2("torch._utils", "_rebuild_tensor_v2"), *tensor_args(numel, size, stride, key, storage))


def typed_tensor_pickle(func: bytes, new_type: bytes, state: bytes) -> bytes:
    """``_rebuild_from_type_v2(func, new_type, args, state)`` (a tensor with Python attributes, as
    ``torch.save`` writes megatron-core's fp32 main params) of a 4-element record ``data/999``."""
    return call(glob2("torch._tensor", "_rebuild_from_type_v2"), func, new_type,
                tup(*tensor_args(4, (4,), (1,))), state)


# ---------------------------------------------------------------- DCP metadata


def load_own_metadata(root: pathlib.Path):
    """Unpickle a ``.metadata`` that real megatron-core wrote in this test (trusted: ours)."""
    with open(root / ".metadata", "rb") as f:
        return pickle.load(f)


def dump_metadata(root: pathlib.Path, md) -> None:
    with open(root / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=4)


def splice_metadata(root: pathlib.Path, payload: bytes, key: str = "version") -> None:
    path = root / ".metadata"
    path.write_bytes(replace_value(path.read_bytes(), key, payload))


def first_tensor_item(md, multi_row: bool = False):
    """``(key, tensor metadata, chunk, MetadataIndex)`` of the first tensor (with > 1 row if asked)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata) and (not multi_row or item.size[0] > 1):
            chunk = item.chunks[0]
            return key, item, chunk, MetadataIndex(key, chunk.offsets)
    raise AssertionError("no tensor in the metadata")


def item_bytes(root: pathlib.Path, info) -> bytes:
    with open(root / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def repoint(root: pathlib.Path, md, index, blob: bytes, name: str = "evil.distcp") -> None:
    """Write ``blob`` as the file ``name`` and point the item ``index`` at all of it."""
    import dataclasses
    (root / name).write_bytes(blob)
    info = md.storage_data[index]
    md.storage_data[index] = dataclasses.replace(info, relative_path=name, offset=0, length=len(blob))


def make_fifo(path: pathlib.Path) -> None:
    if path.exists():
        path.unlink()
    os.mkfifo(path)

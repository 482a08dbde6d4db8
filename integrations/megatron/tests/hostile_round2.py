"""Files for issue 20's corpus: valid files that torch reads exactly, and tiny files with huge numbers.

Each maker takes a copy of a real megatron-core checkpoint directory (see
:mod:`hostile_corpus`) and rewrites one file. The valid ones (:func:`rezip`,
:func:`case_twin_item`) are read by ``torch.load`` to the same values as the
original; tenplex must read those values too, or refuse.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import zipfile

import torch
from hypothesis import strategies as st

from hostile_pickles import first_tensor_item, item_bytes, load_own_metadata, dump_metadata, repoint


def rezip(path: pathlib.Path) -> None:
    """Rewrite the torch archive at ``path`` with Python's :mod:`zipfile` (stored records, no
    64-byte alignment): a valid archive that ``torch.load`` reads exactly."""
    with zipfile.ZipFile(path) as zin:
        entries = [(info.filename, zin.read(info)) for info in zin.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
        for name, data in entries:
            zout.writestr(name, data)


def own_storages(path: pathlib.Path) -> None:
    """Re-save the legacy ``.pt`` at ``path`` with every model tensor in a storage of its own (as
    Megatron-LM writes without the distributed optimizer's shared buffers): one record per tensor."""
    import argparse
    with torch.serialization.safe_globals([argparse.Namespace]):
        obj = torch.load(path, weights_only=False)
    obj["model"] = type(obj["model"])((k, v.clone() if isinstance(v, torch.Tensor) else v)
                                      for k, v in obj["model"].items())
    torch.save(obj, path)


def case_twin(blob: bytes, record: str = "data/0") -> bytes:
    """The torch archive ``blob`` with its ``record`` replaced by a stored decoy of zeros,
    followed by the real bytes, deflated, under the upper-case name: torch's reader, which
    matches names without regard to case, reads the twin."""
    zin = zipfile.ZipFile(io.BytesIO(blob))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in zin.infolist():
            data = zin.read(info)
            top, _, rest = info.filename.partition("/")
            if rest == record:
                z.writestr(zipfile.ZipInfo(f"{top}/{record}"), bytes(len(data)), compress_type=zipfile.ZIP_STORED)
                z.writestr(zipfile.ZipInfo(f"{top}/{record.upper()}"), data, compress_type=zipfile.ZIP_DEFLATED)
            else:
                z.writestr(info, data)
    return out.getvalue()


def rezip_bytes(blob: bytes, compress: int = zipfile.ZIP_STORED) -> bytes:
    """:func:`rezip` of bytes: the same records, written by Python's zipfile (no 64-byte alignment)."""
    with zipfile.ZipFile(io.BytesIO(blob)) as zin:
        entries = [(info.filename, zin.read(info)) for info in zin.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compress) as zout:
        for name, data in entries:
            zout.writestr(name, data)
    return out.getvalue()


def directory_offsets(blob: bytes) -> list[int]:
    """Where each central directory entry's local-header offset field lies in ``blob`` (no zip64)."""
    end = blob.rfind(b"PK\x05\x06")
    at, count = int.from_bytes(blob[end + 16:end + 20], "little"), int.from_bytes(blob[end + 10:end + 12], "little")
    out = []
    for _ in range(count):
        assert blob[at:at + 4] == b"PK\x01\x02", "not a central directory entry"
        out.append(at + 42)
        at += 46 + sum(int.from_bytes(blob[at + k:at + k + 2], "little") for k in (28, 30, 32))
    return out


@st.composite
def zip_targeted(draw, blob: bytes) -> bytes:
    """``blob`` (a torch archive) with what broke the old readers aimed at: a data record given a
    case twin, the archive re-zipped (records no longer where torch's writer puts them), or one
    record's local-header offset pointed past the end, at another record, or off by a few bytes."""
    kind = draw(st.sampled_from(["twin", "rezip", "rezip", "offset"]))
    names = [n.partition("/")[2] for n in zipfile.ZipFile(io.BytesIO(blob)).namelist()]
    if kind == "twin":
        return case_twin(blob, draw(st.sampled_from([n for n in names if n.startswith("data/")])))
    if kind == "rezip":
        return rezip_bytes(blob, draw(st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])))
    fields = directory_offsets(blob)
    at = draw(st.sampled_from(fields))
    old = int.from_bytes(blob[at:at + 4], "little")
    others = [int.from_bytes(blob[f:f + 4], "little") for f in fields]
    new = draw(st.sampled_from([len(blob) + 64, 0xFFFFFFFF, old + 64, max(old - 64, 0), *others]))
    return blob[:at] + new.to_bytes(4, "little") + blob[at + 4:]


def long_int_pickle(nbytes: int) -> bytes:
    """A pickle fragment pushing an integer of ``nbytes`` bytes (LONG4)."""
    return b"\x8b" + nbytes.to_bytes(4, "little") + b"\x01" * nbytes


def case_twin_item(d: pathlib.Path) -> torch.Tensor:
    """Point the first tensor item of the DCP directory ``d`` at ``evil.distcp``, a
    :func:`case_twin` of its blob; returns what ``torch.load`` reads from it (the true values)."""
    md = load_own_metadata(d)
    index = first_tensor_item(md)[3]
    blob = case_twin(item_bytes(d, md.storage_data[index]))
    repoint(d, md, index, blob)
    dump_metadata(d, md)
    return torch.load(io.BytesIO(blob), weights_only=True)


def args_edit(path: pathlib.Path, **change) -> None:
    """Set fields of ``args`` in the legacy ``.pt`` at ``path`` (re-saved by ``torch.save``)."""
    import argparse
    with torch.serialization.safe_globals([argparse.Namespace]):
        obj = torch.load(path, weights_only=False)
    for k, v in change.items():
        setattr(obj["args"], k, v)
    torch.save(obj, path)


def shared_refs_pickle(depth: int) -> bytes:
    """A protocol-2 pickle of a list nested ``depth`` deep where each level holds the level below
    twice: a few bytes per level, a repr (or a JSON form) of 2**depth leaves."""
    out = [b"\x80\x02", b"]", b"q\x00"]
    for i in range(1, depth):
        out += [b"h", bytes([(i - 1) % 256]), b"h", bytes([(i - 1) % 256]), b"\x86", b"q", bytes([i % 256])]
    return b"".join(out) + b"."


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """``data`` with a few random edits (flips, inserts, deletes, a cut, repeats of one byte)."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "cut", "repeat"]))
        i = draw(st.integers(0, max(len(out) - 1, 0)))
        if kind == "flip" and out:
            out[i] = draw(st.integers(0, 255))
        elif kind == "insert":
            out[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del out[i:i + draw(st.integers(1, 16))]
        elif kind == "cut":
            del out[i:]
        elif kind == "repeat" and out:
            out[i:i] = bytes([out[i]]) * draw(st.sampled_from([2, 100, 5000]))
    return bytes(out)


__all__ = ["zip_targeted", "rezip_bytes", "directory_offsets", "long_int_pickle", "mutated", "own_storages", "rezip", "case_twin", "case_twin_item", "args_edit", "shared_refs_pickle", "pickle"]

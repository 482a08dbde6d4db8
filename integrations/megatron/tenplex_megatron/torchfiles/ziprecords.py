"""Storage records of a ``torch.save`` zip archive: stored, unambiguous, and where torch reads them.

tenplex reads a tensor's bytes in place, at the offset of its storage record
(:mod:`tenplex_megatron.torchfiles.ptfile`). Three things must hold for those
bytes to be the ones ``torch.load`` returns:

- **Stored, not compressed.** ``torch.save`` writes every record uncompressed
  (``ZIP_STORED``: PyTorch's ``caffe2/serialize/inline_container.cc``
  ``writeRecord`` compresses only when asked, and ``torch.save`` never asks),
  but a zip archive may also hold deflated records that torch's reader
  inflates on load. Read in place, a compressed stream would be taken as
  tensor data: wrong values, and no error.
- **One record per name, without regard to case.** torch's reader (miniz's
  ``mz_zip_reader_locate_file``) matches names case-insensitively, so an
  archive holding ``data/0`` and ``DATA/0`` is ambiguous: the record checked
  here need not be the one torch reads. Such an archive is refused.
- **At the offset its own local header gives.** The data of a record starts
  after its local file header (30 bytes, its name and its extra field,
  APPNOTE.TXT 4.3.7). This offset, read from the archive's own headers, must
  equal the one torch's reader reports (``get_record_offset``); torch's
  *computed* offsets (``_checkpoint_offset`` of a meta load, which assume
  torch's own writer's layout) are never used.

The central directory is read with Python's :mod:`zipfile` (directory only).
"""

from __future__ import annotations

import struct
import zipfile

from tenplex.errors import CorruptShardError

__all__ = ["check_stored", "record_sizes", "LOCAL_HEADER"]

LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip local file header: signature, 22 bytes, name length, extra length (30 bytes)."""


def _directory(f, start: int, what: str) -> dict[str, zipfile.ZipInfo]:
    f.seek(start)
    try:
        infos = zipfile.ZipFile(f).infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error) as exc:
        raise CorruptShardError(f"{what}: the zip directory cannot be read ({str(exc)[:120]})") from None
    seen: dict[str, str] = {}
    out: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename.split("/", 1)[-1]
        twin = seen.get(name.casefold())
        if twin is not None:
            raise CorruptShardError(f"{what}: records {twin[:80]!r} and {name[:80]!r} have the same name "
                                    "without regard to case; torch's zip reader cannot tell which it reads")
        seen[name.casefold()] = name
        out[name] = info
    return out


def _data_offset(f, start: int, info: zipfile.ZipInfo, name: str, what: str) -> int:
    f.seek(start + info.header_offset)
    raw = f.read(LOCAL_HEADER.size)
    if len(raw) != LOCAL_HEADER.size:
        raise CorruptShardError(f"{what}: record {name}: its local header at byte {info.header_offset} "
                                "is cut off")
    sig, name_len, extra_len = LOCAL_HEADER.unpack(raw)
    if sig != b"PK\x03\x04":
        raise CorruptShardError(f"{what}: record {name}: no local header at byte {info.header_offset}")
    return info.header_offset + LOCAL_HEADER.size + name_len + extra_len


def record_sizes(f, start: int, what: str) -> dict[str, int]:
    """``{record name: uncompressed bytes}`` of the archive at byte ``start`` of ``f``, from its central
    directory (names without their top folder, as torch's reader names records).

    Read here rather than asked of torch's reader: ``PyTorchFileReader.get_record_size`` is missing
    from torch builds tenplex supports (2.11 has none; seen on a GPU machine), while the directory
    is the same for every version.

    Raises:
        CorruptShardError: the central directory cannot be read, or two records share a name
            without regard to case.
    """
    return {name: info.file_size for name, info in _directory(f, start, what).items()}


def check_stored(f, start: int, records: dict[str, tuple[int, int]] | list[str], what: str) -> None:
    """Refuse the archive at byte ``start`` of the seekable file ``f`` unless each record is stored
    uncompressed, unambiguous, and (where given) where torch's reader says it is.

    Args:
        records: names inside the archive (e.g. ``"data/0"``, without its top folder), or
            ``{name: (offset torch's reader reports, relative to start; bytes expected)}``.

    Raises:
        CorruptShardError: the central directory cannot be read, two records share a name
            without regard to case, a record is missing, compressed, of another size, or its
            data does not start where its local header says torch reads it.
    """
    if not records:
        return
    infos = _directory(f, start, what)
    places = records if isinstance(records, dict) else {}
    for name in records:
        info = infos.get(name)
        if info is None:
            raise CorruptShardError(f"{what}: record {name} is not in the zip directory")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptShardError(f"{what}: record {name} is compressed (zip method {info.compress_type}); "
                                    "torch.save stores tensor records uncompressed and tenplex reads them "
                                    "in place")
        if name not in places:
            continue
        offset, nbytes = places[name]
        if info.file_size != nbytes or info.compress_size != nbytes:
            raise CorruptShardError(f"{what}: record {name} holds {info.file_size} bytes in the zip "
                                    f"directory, its tensor storage needs {nbytes}")
        real = _data_offset(f, start, info, name, what)
        if real != offset:
            raise CorruptShardError(f"{what}: record {name}: its data starts at byte {real} by its "
                                    f"local header, torch's reader says {offset}")

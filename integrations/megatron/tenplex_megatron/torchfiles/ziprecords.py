"""Storage records of a ``torch.save`` zip archive must be stored, not compressed.

tenplex reads a tensor's bytes in place, at the offset torch's zip reader
reports for its record (:mod:`tenplex_megatron.torchfiles.ptfile`). ``torch.save``
writes every record uncompressed (``ZIP_STORED``: PyTorch's
``caffe2/serialize/inline_container.cc`` ``writeRecord`` compresses only when
asked, and ``torch.save`` never asks), but
a zip archive may also hold deflated records that torch's reader inflates
on load. Read in place, such a record's bytes would be its compressed
stream taken as tensor data: wrong values, and no error. So every storage
record's compression method is checked in the archive's central directory
(Python's :mod:`zipfile`, which reads that directory only).
"""

from __future__ import annotations

import zipfile

from tenplex.errors import CorruptShardError

__all__ = ["check_stored"]


def check_stored(f, start: int, records: list[str], what: str) -> None:
    """Refuse the archive at byte ``start`` of the seekable file ``f`` unless each of ``records``
    (names inside the archive, e.g. ``"data/0"``, without its top folder) is stored uncompressed.

    Raises:
        CorruptShardError: the central directory cannot be read, a record is missing from it,
            or a record is compressed (its method is named).
    """
    if not records:
        return
    f.seek(start)
    try:
        infos = {info.filename.split("/", 1)[-1]: info for info in zipfile.ZipFile(f).infolist()}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise CorruptShardError(f"{what}: the zip directory cannot be read ({exc})") from None
    for name in records:
        info = infos.get(name)
        if info is None:
            raise CorruptShardError(f"{what}: record {name} is not in the zip directory")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptShardError(f"{what}: record {name} is compressed (zip method {info.compress_type}); "
                                    "torch.save stores tensor records uncompressed and tenplex reads them "
                                    "in place")

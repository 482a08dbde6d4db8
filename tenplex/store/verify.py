"""Verify a committed checkpoint in bounded memory: every file streamed, block by block.

Each shard file's size and safetensors header are checked against the
manifest (:meth:`StoreReader.check_file`), then the file is read in chunks
of :data:`CHUNK` bytes and each checksum block's xxh3-128 digest is compared
as soon as the block is complete. Several files are verified at once, on
threads; memory stays about ``threads * CHUNK`` bytes whatever the size of
the files (reading whole files held ~17 GB for a 70B model at tp=8, pp=8).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from tenplex.errors import CorruptShardError
from tenplex.store.blocks import BlockHasher
from tenplex.store.reader import StoreReader
from tenplex.store.url import translate_errors

__all__ = ["CHUNK", "verify_store"]

CHUNK = 8 << 20
"""Bytes read per request (8 MiB)."""


class _Stopped(Exception):
    """Another file failed: stop reading this one."""


def verify_store(reader: StoreReader, *, threads: int = 4,
                 progress: Callable[[int, int], None] | None = None) -> dict:
    """Check every shard file of ``reader``'s checkpoint: size, header and every block digest.

    Args:
        reader: the opened checkpoint (its manifest is checked on open).
        threads: files verified at once.
        progress: ``progress(done_bytes, total_bytes)`` after each chunk (from any thread,
            one call at a time).

    Returns:
        ``{"files": n, "bytes": n, "tensors": n}``.

    Raises:
        CorruptShardError: the first file found missing, truncated, with a
            lying header or a block whose digest differs, naming it.
    """
    files = reader.manifest.files
    total = sum(f.size for f in files.values())
    state = {"done": 0}
    lock, stop = threading.Lock(), threading.Event()

    def advance(n: int) -> None:
        if stop.is_set():
            raise _Stopped
        with lock:
            state["done"] += n
            if progress:
                progress(state["done"], total)

    def one(key: str) -> None:
        try:
            reader.check_file(key)
            _stream(reader, key, advance)
        except _Stopped:
            pass
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        futures = [pool.submit(one, key) for key in sorted(files)]
        for future in futures:
            future.result()
    return {"files": len(files), "bytes": total, "tensors": len(reader.manifest.tensors)}


def _stream(reader: StoreReader, key: str, advance: Callable[[int], None]) -> None:
    """Hash file ``key`` in chunks; compare each block's digest as it completes."""
    frec = reader.manifest.files[key]
    hasher = BlockHasher(frec.block)
    checked = 0

    def compare(upto: int) -> None:
        nonlocal checked
        for index in range(checked, upto):
            if hasher.digests[index] != frec.digests[index]:
                raise reader.mismatch(key, index, hasher.digests[index])
        checked = upto

    seen = 0
    for chunk in _chunks(reader, key, frec.size):
        seen += len(chunk)
        hasher.update(chunk)
        compare(len(hasher.digests))
        advance(len(chunk))
    if seen != frec.size:
        raise CorruptShardError(f"{reader.root}/{key}: short read: expected {frec.size} bytes, "
                                f"got {seen}; the file is truncated")
    hasher.finish()
    compare(len(hasher.digests))


def _chunks(reader: StoreReader, key: str, size: int):
    """Consecutive chunks of file ``key``, each at most CHUNK bytes, reusing one buffer locally."""
    root = reader.root
    with translate_errors(f"{root}/{key}"):
        if root.local:
            buf = memoryview(bytearray(min(CHUNK, max(size, 1))))
            left = size
            with root.open_read(key) as f:
                while left:
                    n = f.readinto(buf[:min(left, len(buf))])
                    if not n:
                        return
                    left -= n
                    yield buf[:n]
            return
        for start in range(0, size, CHUNK):
            yield root.fs.cat_file(root.key(key), start=start, end=min(start + CHUNK, size))

"""Count every byte a process reads from the files under a folder (a checkpoint), at the file level.

Used two ways by the read-accounting tests (issue 25: total bytes read by
all processes <= 1.05 x the bytes one process needs):

- in process: ``with counting(root) as c: ...``; ``c.bytes`` is what was read;
- as a torchrun entry point: ``torchrun ... count_reads.py reshard SRC DST ...``
  runs ``python -m tenplex reshard SRC DST ...`` counting the reads from
  files under ``$TENPLEX_COUNT_ROOT`` and writes ``{"rank", "bytes",
  "opens", "uncounted", "files"}`` to ``$TENPLEX_COUNT_OUT/<rank>.json`` when it ends.

What is counted: every byte a file object opened under ``root`` hands to
Python (``read``, ``readinto``, ``readall`` of the raw file, so a buffered
reader's read-ahead counts too). Every reader of a Megatron checkpoint opens
its files with :func:`tenplex.store.paths.open_regular` (``os.open`` then
``os.fdopen``) or ``open``: both are wrapped. ``uncounted`` counts the files
under ``root`` opened (Python's ``open`` audit event) without going through a
wrapper, so a reader that bypassed the counter shows up instead of reading
for free. Not seen: a file C code opens by itself (torch's zip reader given a
path, ``mmap``); the Megatron readers hand torch file objects (the single
process's count equals the readers' own ``bytes_read`` where that is exact).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import sys
import threading
from contextlib import contextmanager

_lock = threading.Lock()


class Counter:
    """Bytes read from files under ``root``, by file (``files``), the wrapped opens and the others."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root) + os.sep
        self.files: dict[str, int] = {}
        self.opens = 0
        self.audited: list[str] = []  # every file under root opened by Python's open or os.open
        self.active = True

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    @property
    def uncounted(self) -> int:
        """Files under ``root`` opened without a counting wrapper (0 when every read was counted)."""
        return len(self.audited) - self.opens

    def inside(self, path) -> bool:
        return isinstance(path, (str, bytes, os.PathLike)) and \
            os.path.realpath(os.fsdecode(path)).startswith(self.root)

    def add(self, path: str, n: int) -> None:
        if n and self.active:
            with _lock:
                self.files[path] = self.files.get(path, 0) + n


def _counting_io(counter: Counter):
    class CountingFileIO(io.FileIO):
        def read(self, size=-1):
            data = super().read(size)
            counter.add(self.name_, len(data or b""))
            return data

        def readall(self):
            data = super().readall()
            counter.add(self.name_, len(data))
            return data

        def readinto(self, b):
            n = super().readinto(b)
            counter.add(self.name_, n or 0)
            return n
    return CountingFileIO


_counters: list[Counter] = []


def _audit(event, args):
    if event == "open" and _counters and args and args[0] is not None and not isinstance(args[0], int):
        for c in _counters:
            if c.active and c.inside(args[0]) and os.path.isfile(args[0]):  # not a failed open
                with _lock:
                    c.audited.append(os.fsdecode(args[0]))


_hooked = False


@contextmanager
def counting(root: str):
    """Count the bytes read from files under ``root`` while the block runs (a :class:`Counter`)."""
    global _hooked
    counter = Counter(root)
    raw_io = _counting_io(counter)
    fdopen, bopen = os.fdopen, builtins.open

    def wrap(fd: int, path: str, buffering: int):
        counter.opens += 1
        raw = raw_io(fd, "r", closefd=True)
        raw.name_ = path
        return raw if buffering == 0 else io.BufferedReader(raw, buffering if buffering > 1 else 8192)

    def counted_fdopen(fd, mode="r", buffering=-1, *args, **kwargs):
        if isinstance(fd, int) and mode == "rb" and not args and not kwargs:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path.startswith(counter.root):
                return wrap(fd, path, buffering)
        return fdopen(fd, mode, buffering, *args, **kwargs)

    def counted_open(file, mode="r", buffering=-1, *args, **kwargs):
        if mode == "rb" and not args and not kwargs and not isinstance(file, int) and counter.inside(file):
            return wrap(os.open(file, os.O_RDONLY), os.path.realpath(os.fsdecode(file)), buffering)
        return bopen(file, mode, buffering, *args, **kwargs)

    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True
    os.fdopen, builtins.open = counted_fdopen, counted_open
    _counters.append(counter)
    try:
        yield counter
    finally:
        os.fdopen, builtins.open = fdopen, bopen
        counter.active = False
        _counters.remove(counter)


def main() -> None:
    """torchrun entry point: ``tenplex ARGS`` with the reads under ``$TENPLEX_COUNT_ROOT`` counted."""
    from tenplex.cli.main import main as tenplex_main

    with counting(os.environ["TENPLEX_COUNT_ROOT"]) as counter:
        code = tenplex_main(sys.argv[1:])
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(os.environ["TENPLEX_COUNT_OUT"], f"{rank}.json"), "w") as f:
        json.dump({"rank": int(rank), "bytes": counter.bytes, "opens": counter.opens,
                   "uncounted": counter.uncounted, "files": counter.files,
                   "opened": counter.audited}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as tenplex.cli.main.run: no interpreter teardown


if __name__ == "__main__":
    main()

"""A reshard under torchrun whose target format writes in parts (Megatron): one commit, fail together.

:func:`reshard_parts` is the branch of
:func:`tenplex.distributed_reshard.reshard_distributed` for a target format
with ``parts = True`` (the protocol's write in parts,
:mod:`tenplex.formats.protocol`). Process 0 picks the run's token; every
process calls ``fmt.write(source, dst, to, part=Part(rank, size, token))``,
which writes, fsyncs and reports its share of the files (the format splits
them by bytes); the reports travel to process 0, which calls ``fmt.commit``
once (Megatron: the iteration folder renamed into place, the tracker file
last). A failure anywhere (an exception, SIGTERM from torchrun's agent, a
silent process) fails every process through the
:class:`~tenplex.transform.guard.TransferGuard`; each part removes its own
files as it unwinds, and process 0 removes the run's temporary folder.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from tenplex.errors import AlreadyExistsError, CorruptShardError
from tenplex.formats.protocol import Part

__all__ = ["reshard_parts", "ProcessStats"]


@dataclass(frozen=True)
class ProcessStats:
    """What one process did.

    Attributes:
        process: its rank in the group.
        ranks: the target ranks whose files it wrote.
        bytes_read: bytes it fetched from the source's files (whole checksum blocks for a store).
        bytes_needed: unique source bytes its files need.
        bytes_written: tensor bytes it wrote.
        seconds: its wall time, from entering the reshard to reporting its files.
        bytes_shared: edge blocks it took from another process of its host
            (:mod:`tenplex.store.hostcache`) instead of reading them again.
    """

    process: int
    ranks: list[int]
    bytes_read: int
    bytes_needed: int
    bytes_written: int
    seconds: float
    bytes_shared: int = 0



class _Counter:
    """Adds this process's written bytes to a store key, at most every ``every`` seconds.

    ``total`` is the last total it was told (the whole job's, for a format's writer)."""

    def __init__(self, store, every: float = 0.2):
        self.store, self.every = store, every
        self.sent, self.done, self.last, self.total = 0, 0, 0.0, 0
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.done, self.total = done, total
            if now - self.last >= self.every or done == total:
                self.flush(now)

    def flush(self, now: float | None = None) -> None:
        delta, self.sent = self.done - self.sent, self.done
        self.last = time.monotonic() if now is None else now
        if delta and self.store is not None:
            try:
                self.store.add("progress", delta)
            except Exception:  # progress only: the guard reports a lost store
                pass


def _watch(store, total, progress, stop: threading.Event) -> None:
    """Process 0: feed ``progress(done, total)`` from every process's counts until ``stop``
    (``total``: bytes, or a callable giving them)."""
    while not stop.wait(0.2):
        try:
            n = total() if callable(total) else total
            progress(min(store.add("progress", 0), n), n)
        except Exception:
            return


def _token(guard, comm) -> str:
    """The run's token: process 0's, the same on every process."""
    mine = uuid.uuid4().hex if comm.rank == 0 else None
    return json.loads(guard.gather("cleared", json.dumps(mine).encode())[0])


def reshard_parts(guard, comm, fmt, source, dst, to, opts: dict, progress, start: float):
    """Write this process's part of ``fmt`` at ``dst``; process 0 commits; ``(stats, files)``.

    Args:
        guard: the active transfer guard (phases, gathers, failures).
        comm: the group.
        fmt: the target format (``parts = True``).
        source: the opened source.
        dst, to, opts: as :func:`tenplex.reshard` (``opts``: the format options).
        progress: ``progress(done, total)`` on process 0, fed by every process's counts.
        start: ``time.perf_counter()`` when the reshard began.

    Returns:
        ``(stats, files, (padding, notes))``: every process's :class:`ProcessStats`, in process
        order; the files committed; the parts' padding lines and notes, each line once, in
        process order (a part notes what it derived for its own files).

    Raises:
        CorruptShardError: the commit was refused (a file missing or of another size).
        TransferError: a process failed, died or timed out (the guard's).
    """
    part = Part(comm.rank, comm.size, _token(guard, comm))
    guard.phase("write")
    counter = _Counter(guard.store if guard.active else None)
    stop = threading.Event()
    watcher = None
    if comm.rank == 0 and progress is not None and guard.active:
        watcher = threading.Thread(target=_watch, args=(guard.store, lambda: counter.total, progress, stop),
                                   name="tenplex-progress", daemon=True)
        watcher.start()
    try:
        result = fmt.write(source, dst, to, **{**opts, "progress": counter if guard.active else progress,
                                               "part": part})
        counter.flush()
        report = dict(result.part)
        mine = ProcessStats(comm.rank, report.pop("ranks", []), source.bytes_read, result.bytes_needed or 0,
                            result.bytes_written, time.perf_counter() - start)
        blob = json.dumps({"stats": asdict(mine), "part": report, "padding": list(result.padding),
                           "notes": list(result.notes)}).encode()
        written = [json.loads(b) for b in guard.gather("written", blob)]
    except BaseException:
        if comm.rank == 0:
            fmt.abort(dst, part=part, everything=True)
        raise
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
    guard.phase("confirm")
    error, files = None, 0
    if comm.rank == 0:
        try:
            files = fmt.commit(dst, to, [w["part"] for w in written], part=part, **opts).files
        except (CorruptShardError, AlreadyExistsError) as exc:
            error = str(exc)
            fmt.abort(dst, part=part, everything=True)
        if progress is not None:
            progress(counter.total, counter.total)
    error, files = json.loads(guard.gather("committed", json.dumps([error, files]).encode())[0])
    if error is not None:
        with guard.agreeing():
            raise CorruptShardError(error)
    remarks = tuple(tuple(dict.fromkeys(line for w in written for line in w[key]))
                    for key in ("padding", "notes"))
    return [ProcessStats(**w["stats"]) for w in written], files, remarks

"""Fail together: one process's failure reaches every process of a transfer within a bounded time.

Every process of a guarded transfer (:func:`tenplex.reconfigure`,
:func:`tenplex.recover`, :func:`tenplex.save_distributed`) runs it inside a
:class:`TransferGuard`. The guard's control plane is the group's key-value
store (``Comm.store``, torchrun's rendezvous store), not the process group's
collectives, so no wait outlasts what it states:

- **Publishing.** An exception on any process is published under this
  transfer's ``error`` key by compare-and-set: the first failure wins, and
  every process raises :class:`~tenplex.errors.TransferError` with that one
  message (the process where it began chains the original exception).
  Errors that every process raises alike from data all of them hold (a
  :class:`PlanError` about mismatched arguments, a :class:`ShardError` about
  a local state, a :class:`MissingDataError` from planning: raised inside
  :meth:`TransferGuard.agreeing`) keep their types.
- **Waiting.** Gathers go through the store: the last process to arrive
  sets a key, and the others block on it (``Store.wait``, on a second
  connection to the store, so the heartbeat thread keeps its own, in waits
  of at most ``WAIT_SLICE`` seconds so that signal handlers run), so a
  gather ends as soon as the last process arrives; a published failure
  sets the same keys. A store that cannot open a second connection is
  polled (every 1 to 50 ms). Rounds of point-to-point transfers are waited
  on by a helper thread while the caller watches for a published failure
  every 50 ms.
- **Heartbeats.** Every process bumps a counter every ``beat`` seconds
  (``timeout / 8``, between 50 ms and 1 s) and watches the next process's
  (a ring, so the store serves O(processes) requests per beat). A process
  silent for ``timeout`` seconds (killed, or never joined) is declared
  failed by its watcher.

Bounds, per process: an exception anywhere is raised everywhere within about
a beat; a process that dies, within ``timeout`` plus a beat (at once when a
peer was exchanging bytes with it: its connections close); a process that
hangs alive, at the process group's own timeout (gloo's point-to-point ops
and the store's waits end there). After a TransferError the process group
may still have operations in flight: destroy it and form a new one.

Keys live under ``tenplex/<group name>/<n>/``, where ``n`` counts this
group's guarded transfers; each process removes its own large keys when a
transfer succeeds.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FuturesTimeout
from typing import Callable

import torch.distributed as dist

from tenplex.errors import TransferError
from tenplex.transform.comm import Comm, first_line

__all__ = ["TransferGuard", "DEFAULT_TIMEOUT", "PHASES"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a process may stay silent (dead, or not yet joined) before a transfer fails everywhere."""

PHASES = ("plan", "agree", "first round", "middle round", "local copy", "store read", "confirm")
"""The phases of a transfer, in order (``save_distributed`` has ``agree``, ``write``, ``confirm``)."""

LINGER = 10.0
"""Seconds process 0 keeps the store up, at most, until every process has left a transfer."""

WAIT_SLICE = 0.5
"""Seconds one blocking store wait lasts at most before control returns to Python (signals)."""

WAITER_EXIT = 5.0
"""Seconds a transfer's end waits, at most, for its helper thread to leave a wait that failed."""

GATHERS = ("inputs", "agree", "confirm", "cleared", "written", "committed")
"""Every gather name a guarded transfer may use (a published failure releases all of them)."""


class TransferGuard:
    """The fail-together context of one transfer on one process (see the module docstring).

    Args:
        comm: the communicator; without peers or a store the guard only
            tracks phases, and errors propagate unchanged.
        timeout: seconds a peer may stay silent before the transfer fails
            everywhere (> 0).
        what: the operation, for messages (``"reconfigure"``...).

    Raises:
        ValueError: ``timeout`` is not positive.
        TransferError: (inside the ``with`` block) a failure on any process.
    """

    def __init__(self, comm: Comm, *, timeout: float = DEFAULT_TIMEOUT, what: str = "transfer"):
        if not timeout > 0:
            raise ValueError(f"{what}: timeout must be > 0 seconds, got {timeout!r}")
        self.comm, self.timeout, self.what = comm, float(timeout), what
        self.beat = min(1.0, max(0.05, self.timeout / 8))
        self.phase_name = "start"
        self.label = f"process {comm.rank}"
        self.active = comm.size > 1 and comm.store is not None
        self._raised: TransferError | None = None
        self._agreed: BaseException | None = None
        self._names: list[str] = []
        self.pending: list = []
        """Posted exchanges not yet waited for (the executor keeps it); aborted after a failure."""

    # -- context ---------------------------------------------------------------
    def __enter__(self) -> "TransferGuard":
        if not self.active:
            return self
        base = self.comm.store
        with self._store_op():
            seq = base.add(f"tenplex/{self.comm.name}/seq/{self.comm.rank}", 1)
        self.store = dist.PrefixStore(f"tenplex/{self.comm.name}/{seq}", base)
        hang = getattr(base, "timeout", None)
        self.hang = max(self.timeout, hang.total_seconds() if hang is not None else 0.0)
        self._abort = threading.Event()
        self._stop = threading.Event()
        self._store_lost: BaseException | None = None
        self._message: str | None = None  # the published failure, once seen
        self._beats = threading.Thread(target=self._heartbeat, name="tenplex-heartbeat", daemon=True)
        self._beats.start()
        self._waiter = _Waiter()
        self._wait_store = None  # a second connection for blocking waits, opened at the first gather
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.active:
            return False
        try:
            if exc is None:
                self._forget()
                return False
            if exc is self._raised:
                return False
            winner = self._publish(f"{self.what}: {self.label} failed in phase "
                                   f"{self.phase_name!r}: {first_line(exc)}")
        finally:
            if exc is not None and self.pending:  # after publishing: peers learn the cause first
                self.comm.abort()
            self._close()
        if exc is self._agreed or not isinstance(exc, Exception):
            return False
        raise TransferError(winner) from exc

    def _close(self) -> None:
        """Stop the helper threads, then leave: every process acknowledges it needs the store no
        more, and process 0 (the store's host when the group came from MASTER_ADDR) keeps it up
        until all have, for at most ``LINGER`` seconds, from a thread that outlives the call."""
        self._stop.set()
        self._beats.join()
        self._waiter.close(WAITER_EXIT)
        self._wait_store = None
        try:
            self.store.add("left", 1)
        except Exception:  # the store is gone already: nothing to keep up
            return
        if self.comm.rank == 0:
            threading.Thread(target=self._linger, name="tenplex-linger", daemon=False).start()

    def _linger(self) -> None:
        end = time.monotonic() + min(self.timeout, LINGER)
        try:
            while self.store.add("left", 0) < self.comm.size and time.monotonic() < end:
                time.sleep(0.01)
        except Exception:
            pass

    def describe(self, label: str) -> None:
        """Name this process in messages (e.g. ``"process 2 (old rank 3, new rank 2)"``)."""
        self.label = label

    @contextlib.contextmanager
    def agreeing(self):
        """A block whose errors every process raises alike, from data all of them hold.

        Such an error keeps its type (and message) on every process instead of
        becoming a TransferError; it is still published, so a process that
        did not raise it stops too.
        """
        try:
            yield
        except Exception as exc:
            self._agreed = exc
            raise

    def phase(self, name: str) -> None:
        """Enter phase ``name`` (one of :data:`PHASES`); raise at once if a peer has failed."""
        self.phase_name = name
        if self.active and self._abort.is_set():
            raise self._learned()
        self.comm._on_phase(name)

    # -- waits -----------------------------------------------------------------
    def gather(self, name: str, data: bytes) -> list[bytes]:
        """Every process's ``data``, in process order, through the store (no collective).

        Raises:
            TransferError: a process failed, died or never joined.
        """
        if name not in GATHERS:
            raise ValueError(f"gather {name!r} is not one of {GATHERS}")
        if not self.active:
            return [bytes(data)]
        self._names.append(name)
        s, n = self.store, self.comm.size
        with self._store_op():
            s.set(f"{name}/{self.comm.rank}", data)
            if s.add(f"{name}/count", 1) == n:
                s.set(f"{name}/done", b"1")
        delay, start = 0.001, time.monotonic()
        while True:
            self._block(f"{name}/done", start)
            with self._store_op():
                if s.check([f"{name}/done"]):  # set by the last arrival, or by a failure
                    if s.add(f"{name}/count", 0) < n:
                        raise self._learned()
                    return s.multi_get([f"{name}/{p}" for p in range(n)])
            if self._abort.is_set():
                raise self._learned()
            if time.monotonic() - start > self.hang:
                raise self._hung()
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _hung(self) -> TransferError:
        return self._fail(f"{self.what}: {self.label} waited {self.hang:g} s in phase "
                          f"{self.phase_name!r} for the other processes; one is hung")

    def _block(self, key: str, start: float) -> None:
        """Block until ``key`` is set, for at most :data:`WAIT_SLICE` seconds (and never past
        ``self.hang`` seconds after ``start``), on a second connection to the store: a TCPStore
        client runs one request at a time, and the heartbeat thread must not wait behind this
        one. The caller loops. Each return to Python lets signal handlers run: torchrun stops the
        other workers with SIGTERM when one fails, and a process blocked in one long ``wait``
        would run its handler (and remove its files) only when the wait ended, at the hang
        bound, when torchrun's SIGKILL may already have come. Returns at once, leaving the
        caller to poll, where the store cannot open a second connection."""
        if self._wait_store is None:
            try:
                self._wait_store = self.store.clone()
            except Exception:  # a store without clone(): poll
                self._wait_store = False
        if self._wait_store is False:
            return
        left = self.hang - (time.monotonic() - start)
        try:
            self._wait_store.wait([key], datetime.timedelta(seconds=max(0.001, min(WAIT_SLICE, left))))
        except Exception as exc:
            if time.monotonic() - start >= self.hang:
                raise self._hung() from exc
            if _is_wait_timeout(exc):
                return
            with self._store_op():  # the store is gone: the one message every process raises
                raise exc

    def wait(self, wait: Callable[[], None]) -> None:
        """Run ``wait`` (a posted exchange's ``wait()``) on the helper thread; return when it is done.

        Raises:
            TransferError: the exchange failed here, or a peer failed elsewhere.
        """
        if not self.active:
            wait()
            return
        future = self._waiter.submit(wait)
        while True:
            try:
                future.result(timeout=0.05)
                return
            except FuturesTimeout:
                if self._abort.is_set():
                    raise self._learned() from None
            except Exception as exc:  # a TransferError from Comm already names process and peers
                detail = str(exc).strip().splitlines()[0] if isinstance(exc, TransferError) else first_line(exc)
                raise self._fail(f"{self.what}: {self.label} failed in phase {self.phase_name!r}: "
                                 f"{detail}") from exc

    # -- failures --------------------------------------------------------------
    def _fail(self, message: str) -> TransferError:
        """Publish ``message`` (the first failure wins) and return the error to raise."""
        self._raised = TransferError(self._publish(message))
        return self._raised

    def _learned(self) -> TransferError:
        """The error another process published (or the store's loss)."""
        message = self._message
        if message is None and self._store_lost is not None:
            message = self._lost_message()
        if message is None:
            try:
                message = self.store.get("error").decode(errors="replace")
            except Exception as exc:
                self._store_lost = exc
                message = self._lost_message()
        self._raised = TransferError(message)
        return self._raised

    def _publish(self, message: str) -> str:
        """Compare-and-set the error key; release every gather; the winning message."""
        try:
            winner = self.store.compare_set("error", "", message).decode(errors="replace")
            self._message = winner
            for name in GATHERS:
                self.store.set(f"{name}/done", b"1")
            self._abort.set()
            return winner
        except Exception as exc:
            self._store_lost = exc
            return self._lost_message()

    def _lost_message(self) -> str:
        return (f"{self.what}: the store of process group {self.comm.name} is unreachable "
                f"({type(self._store_lost).__name__}); the process hosting it (rank 0 when the "
                "group was initialized from MASTER_ADDR) may have died")

    def _store_op(self):
        return _StoreOp(self)

    def _heartbeat(self) -> None:
        """Beat, watch the next process's beat, and notice published failures."""
        me, n = self.comm.rank, self.comm.size
        watched = (me + 1) % n
        last, changed = None, time.monotonic()
        while True:
            try:
                self.store.add(f"hb/{me}", 1)
                if self.store.check(["error"]):
                    self._message = self.store.get("error").decode(errors="replace")
                    self._abort.set()
                    for name in GATHERS:  # the publisher sets them too, unless it died first
                        self.store.set(f"{name}/done", b"1")
                    return
                value = self.store.add(f"hb/{watched}", 0)
            except Exception as exc:  # the store is gone: every wait fails with the same message
                self._store_lost = exc
                self._abort.set()
                return
            now = time.monotonic()
            if value != last:
                last, changed = value, now
            elif now - changed > self.timeout:
                state = "never joined" if value == 0 else "stopped"
                self._publish(f"{self.what}: process {watched} {state}: no heartbeat for "
                              f"{self.timeout:g} s (noticed by process {me} in phase {self.phase_name!r})")
                return
            if self._stop.wait(self.beat):
                return

    def _forget(self) -> None:
        """Delete this process's keys of every gather but the last (all peers have read them)."""
        try:
            for name in self._names[:-1]:
                self.store.delete_key(f"{name}/{self.comm.rank}")
        except Exception:  # cleanup only: the transfer has succeeded
            pass


def _is_wait_timeout(exc: BaseException) -> bool:
    """Whether a store ``wait`` ended by its timeout (the key is not set yet), not by a lost store.

    torch raises ``DistStoreError`` ("wait timeout after ...") for the first and ``DistNetworkError``
    for the second; releases without those classes raise ``RuntimeError`` whose text says timeout.
    """
    if isinstance(exc, getattr(dist, "DistNetworkError", ())):
        return False
    return isinstance(exc, getattr(dist, "DistStoreError", ())) or "timeout" in str(exc).lower()


class _StoreOp:
    """Translate store failures into the one TransferError every process raises alike."""

    def __init__(self, guard: TransferGuard):
        self.guard = guard

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, TransferError) or not isinstance(exc, Exception):
            return False
        self.guard._store_lost = exc
        self.guard._raised = TransferError(self.guard._lost_message())
        raise self.guard._raised from exc


class _Waiter:
    """One daemon thread that runs blocking waits in order (a daemon: one stuck in a dead
    peer's wait never keeps the process from exiting)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tenplex-wait", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> Future:
        future: Future = Future()
        self._queue.put((future, fn))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller's thread
                future.set_exception(exc)

    def close(self, timeout: float) -> None:
        """Stop the thread, and wait up to ``timeout`` seconds for it to end. After a failure it
        may still be inside a wait that the abort made fail; a process that exits while a thread
        is inside a gloo wait is killed by the C++ runtime (SIGABRT, "terminate called without
        an active exception": the wait returns during interpreter shutdown, the thread cannot
        take the GIL and is unwound through C++ frames that may not throw)."""
        self._queue.put(None)
        self._thread.join(timeout)

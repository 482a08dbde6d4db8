"""The demo's job processes: start them, collect their records, and report a failed one with its cause.

The processes are started once (spawn) and run every run in turn; this
process hosts the key-value store their process groups are formed through.
A worker that fails sends its exception's type, last message line and
traceback; one that dies without a word (killed) is found by its exit code.
Either way :class:`WorkerError` names the worker and the cause on one line
and carries the worker's whole traceback (``tenplex --debug`` prints it).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue as queue_mod
import signal
import socket

from tenplex.errors import TenplexError

__all__ = ["WorkerError", "run_workers", "report_error"]


class WorkerError(TenplexError, RuntimeError):
    """A worker process failed.

    Attributes:
        worker: the worker's number.
        cause: ``"<ExceptionType>: <last line of its message>"``, or how it died.
        worker_traceback: the worker's whole traceback (``None`` if it died without one).
    """

    def __init__(self, what: str, worker: int, cause: str, worker_traceback: str | None = None):
        super().__init__(f"{what}: worker {worker} failed: {cause}")
        self.worker, self.cause, self.worker_traceback = worker, cause, worker_traceback


def report_error(queue, process: int, exc: BaseException, where: str = "") -> None:
    """In a worker: put ``exc`` on ``queue`` as ``("error", process, type name, last message line,
    traceback, where)``; ``where`` says what the worker was doing (e.g. ``"run elastic, phase 2"``)."""
    import traceback

    text = str(exc).strip().splitlines()
    queue.put(("error", process, type(exc).__name__, text[-1] if text else "",
               "".join(traceback.format_exception(exc)), where))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _died(code: int) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} without a report"


def run_workers(what: str, nprocs: int, target, args: tuple, on_record, timeout: float = 900.0) -> None:
    """Run ``target(process, port, *args, queue)`` in ``nprocs`` processes until each reports done.

    Args:
        what: names the job in errors (``"demo"``).
        nprocs: the number of processes.
        target: a picklable function; it puts records on the queue and
            ``("done", process)`` at the end, or ``("error", process, type name,
            last message line, traceback)``.
        args: its arguments after ``(process, port)``.
        on_record: called with every other record.
        timeout: seconds without any record before the run is given up.

    Raises:
        WorkerError: a worker reported an error, died, or went silent for ``timeout``.
    """
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(p, port, *args, q)) for p in range(nprocs)]
    for p in procs:
        p.start()
    done, silent = set(), 0.0
    try:
        while len(done) < nprocs:
            try:
                item = q.get(timeout=2)
            except queue_mod.Empty:
                silent += 2
                dead = next((i for i, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
                if dead is not None:
                    _drain_error(q, what)
                    raise WorkerError(what, dead, _died(procs[dead].exitcode))
                if silent >= timeout:
                    raise WorkerError(what, min(set(range(nprocs)) - done), f"no report for {timeout:.0f} s")
                continue
            silent = 0.0
            if item[0] == "done":
                done.add(item[1])
            elif item[0] == "error":
                killed = _killed(procs)   # peers of a killed worker fail too; name the first cause
                if killed is not None:
                    raise WorkerError(what, killed, _died(procs[killed].exitcode))
                raise _error(what, item)
            else:
                on_record(item)
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        del store


def _error(what: str, item) -> WorkerError:
    _, worker, kind, line, text, where = item
    return WorkerError(f"{what} {where}".strip(), worker, f"{kind}: {line}" if line else kind, text)


def _killed(procs, wait: float = 1.0):
    """A worker killed by a signal (after ``wait`` seconds for one to show), or ``None``."""
    import time

    end = time.time() + wait
    while True:
        killed = next((i for i, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0), None)
        if killed is not None or time.time() >= end:
            return killed
        time.sleep(0.1)


def _drain_error(q, what: str) -> None:
    """A worker that reported its error before dying: raise that report."""
    while True:
        try:
            item = q.get(timeout=1)
        except queue_mod.Empty:
            return
        if item[0] == "error":
            raise _error(what, item)

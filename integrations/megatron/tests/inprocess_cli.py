"""Run ``tenplex`` in this process, seen from outside the way a subprocess is seen.

A ``tenplex`` subprocess spends seconds importing torch before it reads a
byte; :func:`run_cli` calls :func:`tenplex.cli.main.main` instead and returns
the same :class:`subprocess.CompletedProcess` a subprocess run would: the exit
status the console script would exit with (``sys.exit(main())``, or 1 and a
traceback for an escaped exception, as the interpreter does) and everything
that process would have printed:

* ``sys.stdout``/``sys.stderr`` are redirected, and file descriptors 1 and 2
  too (C and C++ code such as torch's writes there directly);
* warnings are recorded under Python's default filters (``DeprecationWarning``
  and the like hidden, everything else shown once) and each adds its formatted
  text to stderr, as an interpreter's ``showwarning`` would;
* an exception escaping a thread (``threading.excepthook``) or raised where it
  cannot propagate (``sys.unraisablehook``, e.g. in ``__del__``) is printed to
  stderr, as an interpreter prints it; garbage is collected before returning so
  that finalizers have run.

The command runs in a daemon thread with a time limit, so a hang (a FIFO opened
for reading) fails the caller instead of the whole session, and with ``cwd`` as
the process's working directory. What cannot be seen in-process (interpreter
start-up and shutdown, ``atexit``) is for the few real-subprocess tests.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings

_DEFAULT_FILTERS = (  # CPython's defaults without -W / PYTHONWARNINGS / dev mode (warnings docs)
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None),
    ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None),
)


@contextlib.contextmanager
def _fd_captured(fd: int):
    """Point file descriptor ``fd`` at a temporary file; yields a list that receives its text."""
    out: list[str] = []
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield out
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


@contextlib.contextmanager
def _warnings_shown(err: io.StringIO):
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        for action, category, module in reversed(_DEFAULT_FILTERS):
            warnings.filterwarnings(action, category=category, module=module or "")
        try:
            yield
        finally:
            seen = set()
            for w in caught:
                key = (w.category, str(w.message), w.filename, w.lineno)
                if key not in seen:  # "default": once per location and text
                    seen.add(key)
                    err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))


@contextlib.contextmanager
def _hooks_print_to(err: io.StringIO):
    saved_thread, saved_unraisable = threading.excepthook, sys.unraisablehook

    def thread_hook(args):
        err.write(f"Exception in thread {args.thread.name if args.thread else '?'}:\n")
        err.write("".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))

    def unraisable_hook(u):
        err.write(f"Exception ignored in: {u.object!r}\n")
        err.write("".join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)))

    threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook
    try:
        yield
    finally:
        threading.excepthook, sys.unraisablehook = saved_thread, saved_unraisable


def _exit_status(err: io.StringIO, call) -> int:
    """What ``sys.exit(call())`` makes of the process's exit status, as the interpreter does."""
    try:
        code = call()
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - the interpreter prints it and exits 1
        err.write(traceback.format_exc())
        return 1
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    err.write(f"{code}\n")
    return 1


def run_cli(argv: list[str], cwd=None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``tenplex *argv`` in this process; returns (args, returncode, stdout, stderr) as text.

    ``returncode`` is ``"timeout"`` (and stderr says so) when the command did not finish within
    ``timeout`` seconds; the command's thread is then left behind (a daemon).
    """
    from tenplex.cli.main import main

    out, err, status = io.StringIO(), io.StringIO(), []
    here = os.getcwd()
    sys.stdout.flush()
    sys.stderr.flush()
    with _fd_captured(1) as fd_out, _fd_captured(2) as fd_err, \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            _warnings_shown(err), _hooks_print_to(err):
        os.chdir(cwd or here)
        try:
            thread = threading.Thread(target=lambda: status.append(_exit_status(err, lambda: main(argv))),
                                      name="tenplex-cli", daemon=True)
            thread.start()
            thread.join(timeout)
            gc.collect()
        finally:
            os.chdir(here)
    if not status:
        return subprocess.CompletedProcess(["tenplex", *argv], "timeout", "", f"timed out after {timeout} s")
    return subprocess.CompletedProcess(["tenplex", *argv], status[0], out.getvalue() + fd_out[0],
                                       err.getvalue() + fd_err[0])


def tenplex(*args: str) -> subprocess.CompletedProcess:
    """``tenplex *args`` in this process, as a ``tenplex`` subprocess would run it."""
    return run_cli(list(args), timeout=300)

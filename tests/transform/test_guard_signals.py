"""A process blocked in a guarded gather runs its SIGTERM handler at once.

torchrun stops the other workers with SIGTERM when one fails, and SIGKILLs them if they have not
exited some seconds later. A worker that handles SIGTERM (``tenplex reshard`` under torchrun removes
its own files there) must get to run the handler while it waits for a peer that will never come.
On e776760 the gather blocked in one store ``wait`` until the guard's hang bound (here 60 s), so
the handler ran only then: this test failed with ``TimeoutExpired``.
"""

import signal
import subprocess
import sys
import time

CHILD = r"""
import datetime, os, signal, sys
import torch.distributed as dist
from tenplex.transform.guard import TransferGuard

class Comm:  # two processes; the second never comes
    rank, size, name = 0, 2, "signals"
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    def _on_phase(self, name): pass
    def abort(self): pass

def stop(sig, frame):
    print("SIGTERM handled", flush=True)
    os._exit(7)

signal.signal(signal.SIGTERM, stop)
with TransferGuard(Comm(), timeout=60.0, what="test") as guard:
    guard.phase("agree")
    print("waiting", flush=True)
    guard.gather("agree", b"mine")
print("gather returned", flush=True)
"""


def test_sigterm_reaches_a_process_waiting_in_a_gather():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "waiting"
        time.sleep(1.0)  # inside the store's wait by now
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=10)  # the hang bound is 60 s
        assert child.returncode == 7, out
        assert "SIGTERM handled" in out
        assert time.monotonic() - sent < 10
    finally:
        child.kill()
        child.wait()

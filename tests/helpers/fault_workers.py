"""Worker processes for the fail-together tests: a fault injected at one phase of a live transfer.

The fault hook is :meth:`Comm._on_phase`, a private method the transfer calls
as it enters each phase; :class:`FaultComm` overrides it in the victim
process only. No public knob of tenplex is involved.
"""

import faulthandler
import json
import os
import signal
import threading
import time
import traceback

import torch
import torch.distributed as dist

import tenplex
from tenplex.errors import TransferError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.transform.comm import TorchComm

from tests.helpers.rendezvous import init_group


TREE = gpt_tree(GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=4, ffn=64, vocab=100,
                        swiglu=True, tied=True, dtype="bfloat16", optimizer="adam"))
SRC, DST = P(dp=2, tp=2), P(dp=1, tp=4)
BUDGET = 16 << 10      # chunks of 4 KiB: every process runs many rounds
GROUP_TIMEOUT = 120    # the process group's own timeout: far beyond the guard's


class FaultComm(TorchComm):
    """A TorchComm that raises, or SIGKILLs its own process, as the transfer enters ``phase``."""

    def __init__(self, phase: str, action: str, out_dir: str):
        super().__init__()
        self.phase, self.action, self.out_dir = phase, action, out_dir

    def _on_phase(self, phase: str) -> None:
        if phase != self.phase:
            return
        write(self.out_dir, "fault", {"time": time.time(), "phase": phase})
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault in phase {phase}")


def write(out_dir: str, name: str, data) -> None:
    tmp = os.path.join(out_dir, f"{name}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(out_dir, f"{name}.json"))


def faulty(rank: int, victim: int, phases: list[str], action: str, timeout: float,
           out_dir: str) -> None:
    """For each phase, in a new process group: reconfigure SRC -> DST on 4 processes while
    ``victim`` raises or dies at that phase. A process that raised forms the next group."""
    # A crash in C++ (SIGABRT, SIGSEGV) leaves every thread's Python stack here for the test to show.
    faulthandler.enable(open(os.path.join(out_dir, f"stacks-{rank}.txt"), "w"), all_threads=True)
    try:
        local = materialize(TREE, random_state(TREE, SRC, 5), SRC, rank)
        before = {p: t.clone() for p, t in local.items() if isinstance(t, torch.Tensor)}
        for case, phase in enumerate(phases):
            init_group(rank, 4, f"{out_dir}/{case}/rendezvous", GROUP_TIMEOUT)
            comm = FaultComm(phase, action, f"{out_dir}/{case}") if rank == victim else TorchComm()
            dist.barrier()
            try:
                tenplex.reconfigure(local, TREE, SRC, DST, comm=comm, memory_budget=BUDGET,
                                    timeout=timeout, renumber=False)  # renumbered, nothing moves
                outcome = {"error": None}
            except TransferError as err:
                outcome = {"error": str(err), "cause": repr(err.__cause__)}
            outcome["time"] = time.time()
            # The transfer's helper threads are gone when it returns (process 0's store linger
            # may outlive it by design: a non-daemon thread, joined before the interpreter exits).
            outcome["threads"] = [t.name for t in threading.enumerate()
                                  if t.name.startswith("tenplex-") and t.name != "tenplex-linger"]
            outcome["intact"] = all(bitwise_equal(before[p], local[p]) for p in before)
            write(f"{out_dir}/{case}", f"outcome-{rank}", outcome)
            dist.destroy_process_group()
    except BaseException:
        write(out_dir, f"crash-{rank}", traceback.format_exc())
        raise

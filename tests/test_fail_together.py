"""Fail together within a bounded time: a fault in one process at each phase of a live transfer.

Four gloo processes reconfigure dp=2,tp=2 -> dp=1,tp=4. One of them raises,
or kills itself with SIGKILL, as the transfer enters a phase. Every other
process must raise TransferError with the same message within the guard's
timeout plus a margin (the process group's own timeout is 120 s), and every
old state must be bit for bit unchanged. After a kill, no process may be
alive past that bound; after a raise, every process forms a new group for
the next phase's case.
"""

import json
import multiprocessing as mp
import signal
import time

import pytest

from tests.helpers import fault_workers as fw


pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
CTX = mp.get_context("spawn")
TIMEOUT = 6.0     # the guard's timeout (seconds a process may stay silent)
MARGIN = 25.0     # for a loaded 2-core machine; process start-up is not timed, only the failure
STARTUP = 180.0   # spawn, import torch, rendezvous: not what is tested
PHASES = ["plan", "agree", "first round", "middle round", "local copy", "confirm"]
VICTIM = 1


def _read(path):
    return json.loads(path.read_text()) if path.exists() else None


def _start(tmp_path, victim, phases, action):
    for case in range(len(phases)):
        (tmp_path / str(case)).mkdir()
    procs = [CTX.Process(target=fw.faulty, args=(r, victim, phases, action, TIMEOUT, str(tmp_path)))
             for r in range(4)]
    for p in procs:
        p.start()
    return procs


def _await_fault(tmp_path, case: int, deadline: float) -> dict:
    while (fault := _read(tmp_path / str(case) / "fault.json")) is None:
        crashes = [c.read_text() for c in tmp_path.glob("crash-*.json")]
        assert not crashes and time.time() < deadline, crashes or f"case {case}: no fault injected"
        time.sleep(0.1)
    return fault


def _stacks(tmp_path) -> str:
    """What faulthandler wrote for processes that crashed in C++ (empty files for the others)."""
    return "\n".join(f"{f.name}:\n{f.read_text()}" for f in sorted(tmp_path.glob("stacks-*.txt"))
                     if f.stat().st_size)


def _check_case(tmp_path, case: int, phase: str, action: str, fault: dict, survivors: list[int]):
    outcomes = {r: _read(tmp_path / str(case) / f"outcome-{r}.json") for r in survivors}
    assert all(o is not None for o in outcomes.values()), (phase, outcomes)
    errors = {r: o["error"] for r, o in outcomes.items()}
    assert all(e is not None for e in errors.values()), (phase, outcomes)
    assert len(set(errors.values())) == 1, (phase, errors)       # the same error everywhere
    message = errors[survivors[0]]
    if action == "raise":
        assert f"process {VICTIM}" in message, message
        assert f"failed in phase {phase!r}: RuntimeError: injected fault in phase {phase}" in message
        assert "injected fault" in outcomes[VICTIM]["cause"]
    for r, o in outcomes.items():
        assert o["time"] - fault["time"] < TIMEOUT + MARGIN, (phase, r, o, fault)
        assert o["intact"], f"{phase}: process {r}'s old state changed"
        assert not o["threads"], f"{phase}: process {r} left {o['threads']} running"
    return message


def test_raise_at_each_phase_fails_every_process_together(tmp_path):
    procs = _start(tmp_path, VICTIM, PHASES, "raise")
    try:
        deadline = time.time() + STARTUP
        for case, phase in enumerate(PHASES):
            fault = _await_fault(tmp_path, case, deadline)
            deadline = fault["time"] + TIMEOUT + MARGIN + 60  # the next group's start-up
        for p in procs:
            p.join(max(0.1, fault["time"] + TIMEOUT + MARGIN - time.time()))
        assert not any(p.is_alive() for p in procs), "a process outlived the last failed transfer"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0, 0, 0], _stacks(tmp_path)
    for case, phase in enumerate(PHASES):
        fault = _read(tmp_path / str(case) / "fault.json")
        _check_case(tmp_path, case, phase, "raise", fault, [0, 1, 2, 3])


def _kill_case(tmp_path, victim: int, phase: str):
    procs = _start(tmp_path, victim, [phase], "kill")
    try:
        fault = _await_fault(tmp_path, 0, time.time() + STARTUP)
        for p in procs:
            p.join(max(0.1, fault["time"] + TIMEOUT + MARGIN - time.time()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not alive, f"processes {alive} alive {TIMEOUT + MARGIN:g} s after the fault"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    survivors = [r for r in range(4) if r != victim]
    assert procs[victim].exitcode == -signal.SIGKILL
    assert all(procs[r].exitcode == 0 for r in survivors), ([p.exitcode for p in procs], _stacks(tmp_path))
    return _check_case(tmp_path, 0, phase, "kill", fault, survivors)


@pytest.mark.parametrize("phase", PHASES)
def test_kill_at_each_phase_fails_every_survivor_together(tmp_path, phase):
    message = _kill_case(tmp_path, VICTIM, phase)
    assert f"process {VICTIM}" in message or "peers [1" in message or ", 1]" in message, message


def test_store_host_killed_mid_transfer_fails_every_survivor_alike(tmp_path):
    """Process 0 hosts the rendezvous store here (MASTER_ADDR): its death takes the control plane."""
    message = _kill_case(tmp_path, 0, "middle round")
    assert "unreachable" in message, message

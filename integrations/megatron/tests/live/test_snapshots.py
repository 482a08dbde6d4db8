"""tenplex_megatron.live's host-local snapshots: a real megatron-core GPT restarted on one of two
simulated hosts recovers from that host's snapshots plus the checkpoint, and trains on (issue 24).

The restart is simulated with fresh processes (torch.multiprocessing); the same
recovery under real torchrun agents is tests/test_snapshot_torchrun.py (core API).
"""

import socket

import pytest

from tenplex.ptree.config import ParallelConfig
from tenplex.transform.planner import make_plan

from mcore_helpers import TESTS

from live.test_live_api import CTX, _read

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(target, n, out):
    port = _port()
    procs = [CTX.Process(target=target, args=(p, port, out)) for p in range(n)]
    for p in procs:
        p.start()
    return [p.join(600) or p.exitcode for p in procs]


def _resumed_like_the_reference(out) -> dict:
    """The new job's results, once checked: it went on from the step-2 checkpoint (the step-3
    snapshots would need host B's optimizer half) with the losses of the run without a failure."""
    import live_snapshots as ls

    old, new = _read(out, "old"), _read(out, "new")
    reference = old["reference"]
    assert [old["losses"][str(k)] for k in range(1, ls.STEPS + 1)] == reference[:ls.STEPS]
    assert new["step"] == ls.CHECKPOINT and new["rolled_back_to"] is None
    losses = {int(k): v for k, v in new["losses"].items()}
    assert sorted(losses) == list(range(ls.CHECKPOINT + 1, ls.FINAL + 1))
    diff = max(abs(v - reference[k - 1]) for k, v in losses.items())
    assert diff <= 1e-6, (diff, losses, reference)         # fp32: only dp's reduction order differs
    return new


def test_megatron_job_restarted_on_one_host_recovers_from_its_snapshots(tmp_path):
    import live_snapshots as ls
    import live_survivors as s
    import live_workers as w
    from tenplex_megatron.demo.job import live_spec

    out = str(tmp_path)
    assert _run(ls.old_job, 4, out) == [0, 0, 0, 0], [f.read_text() for f in tmp_path.glob("error-*.json")]
    assert _run(ls.new_job, 2, out) == [0, 0], [f.read_text() for f in tmp_path.glob("error-*.json")]
    new = _resumed_like_the_reference(tmp_path)
    config, target = ParallelConfig.parse(ls.CONFIG), ParallelConfig.parse(ls.NEW)
    tree = live_spec(s.model(), w.options(True)).tree(config, target)
    plan = make_plan(tree, config, target, alive={0, 1}, store_fallback=True)
    assert new["store"] == plan.totals.store > 0           # only what host A's snapshots lack


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (torchrun starts its workers in their own sessions)."""
    import os
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _agent(port, snapshots, out, is_host, log):
    import os
    import subprocess
    import sys
    env = dict(os.environ, TENPLEX_SNAPSHOT_DIR=snapshots, OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")      # see tests/test_snapshot_torchrun.py
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=2",
           "--max_restarts=1", "--monitor_interval=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
           f"--rdzv_conf=is_host={int(is_host)},last_call_timeout=15,join_timeout=300",
           str(TESTS / "snapshot_torchrun_worker.py"), out]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_megatron_job_under_torchrun_loses_a_host_and_recovers_from_the_other(tmp_path):
    """Two torchrun agents (--nnodes=1:2) as two hosts; host B's agent and workers SIGKILLed after
    step 3; torchrun restarts host A's workers at world size 2, which recover through
    live.recover_from_snapshots and train on with the losses of the run without a failure."""
    import os
    import signal
    import time

    import live_snapshots as ls
    import live_survivors as s
    import live_workers as w
    from tenplex_megatron.demo.job import live_spec

    port = _port()
    out = tmp_path / "out"
    out.mkdir()
    logs = [open(tmp_path / f"agent-{h}.log", "w") for h in "ab"]
    a = _agent(port, str(tmp_path / "host-a"), str(out), True, logs[0])
    time.sleep(3)
    b = _agent(port, str(tmp_path / "host-b"), str(out), False, logs[1])
    try:
        deadline = time.time() + 600
        while len(list(out.glob("ready-*"))) < 4 and time.time() < deadline and a.poll() is None:
            time.sleep(1)
        assert len(list(out.glob("ready-*"))) == 4, (tmp_path / "agent-a.log").read_text()[-3000:]
        for pid in [b.pid] + _descendants(b.pid):     # host B is lost: its agent and workers
            os.kill(pid, signal.SIGKILL)
        b.wait()
        (out / "host-lost").touch()
        a.wait(timeout=600)
    finally:
        for p in (a, b):
            if p.poll() is None:
                for pid in _descendants(p.pid) + [p.pid]:
                    os.kill(pid, signal.SIGKILL)
        for f in logs:
            f.close()
    assert a.returncode == 0, [f.read_text() for f in out.glob("error-*.json")] or \
        (tmp_path / "agent-a.log").read_text()[-4000:]
    new = _resumed_like_the_reference(out)
    # the old ranks host A held: its snapshot folders
    held = {int(d.name[5:]) for d in (tmp_path / "host-a" / "job").iterdir() if d.name.startswith("rank-")}
    assert len(held) == 2
    config, target = ParallelConfig.parse(ls.CONFIG), ParallelConfig.parse(ls.NEW)
    tree = live_spec(s.model(), w.options(True)).tree(config, target)
    plan = make_plan(tree, config, target, alive=held, store_fallback=True)
    assert new["store"] == plan.totals.store > 0

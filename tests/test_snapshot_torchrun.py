"""examples/snapshot_torchrun.py under torchrun --nnodes=1:2 with two simulated hosts (issue 24).

Two torchrun agents on this machine are the two hosts, each with its own
snapshot folder (``TENPLEX_SNAPSHOT_DIR``) and two workers. Host A hosts the
rendezvous store. After the workers' last step, host B's agent and workers are
SIGKILLed; torchrun restarts host A's workers at world size 2, and they
recover from host A's snapshots plus the global checkpoint.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.torchrun_reshard import descendants

ROOT = pathlib.Path(__file__).parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _agent(port: int, snapshots: str, out: str, is_host: bool, log) -> subprocess.Popen:
    # a fresh worker store per rendezvous round: with the shared one (the default), the first
    # attempt's gloo keys are still there after the restart, and the new workers connect to dead ports
    env = dict(os.environ, TENPLEX_SNAPSHOT_DIR=snapshots, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    conf = f"is_host={int(is_host)},last_call_timeout=15,join_timeout=300"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=2",
           "--max_restarts=1", "--monitor_interval=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_conf={conf}",
           str(ROOT / "examples" / "snapshot_torchrun.py"), out]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_a_lost_host_is_recovered_from_the_surviving_hosts_snapshots(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    logs = [open(tmp_path / f"agent-{h}.log", "w") for h in "ab"]
    a = _agent(port, str(tmp_path / "host-a"), str(out), True, logs[0])
    time.sleep(3)
    b = _agent(port, str(tmp_path / "host-b"), str(out), False, logs[1])
    try:
        deadline = time.time() + 400
        while len(list(out.glob("ready-*"))) < 4 and time.time() < deadline and a.poll() is None:
            time.sleep(1)
        assert len(list(out.glob("ready-*"))) == 4, (tmp_path / "agent-a.log").read_text()[-3000:]
        workers = descendants(b.pid)                  # torchrun starts its workers in their own sessions
        for pid in [b.pid] + workers:                  # host B is lost: its agent and workers
            os.kill(pid, signal.SIGKILL)
        b.wait()
        (out / "host-lost").touch()
        a.wait(timeout=400)
    finally:
        for p in (a, b):
            if p.poll() is None:
                for pid in descendants(p.pid) + [p.pid]:
                    os.kill(pid, signal.SIGKILL)
        for f in logs:
            f.close()
    text = (tmp_path / "agent-a.log").read_text()
    assert a.returncode == 0, text[-4000:]
    last = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    # the checkpoint is of step 2, the latest snapshots of step 3: the previous buffers (step 2) are used
    assert last["recovered_step"] == 2 and last["bit_exact"] is True and last["final_step"] == 5
    assert len(last["sources"]) == 2
    assert last["store_bytes"] == last["lost_bytes"] > 0      # only what no surviving snapshot held

"""tenplex_megatron.live's host-local snapshots: a real megatron-core GPT restarted on one of two
simulated hosts recovers from that host's snapshots plus the checkpoint, and trains on (issue 24).

The restart is simulated with fresh processes (torch.multiprocessing); the same
recovery under real torchrun agents is tests/test_snapshot_torchrun.py (core API).
"""

import socket

import pytest

from tenplex.ptree.config import ParallelConfig
from tenplex.transform.planner import make_plan

from test_live_megatron import CTX, _read

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


def test_megatron_job_restarted_on_one_host_recovers_from_its_snapshots(tmp_path):
    import live_snapshots as ls
    import live_survivors as s
    import live_workers as w
    from tenplex_megatron.demo.job import live_spec

    out = str(tmp_path)
    assert _run(ls.old_job, 4, out) == [0, 0, 0, 0], [f.read_text() for f in tmp_path.glob("error-*.json")]
    assert _run(ls.new_job, 2, out) == [0, 0], [f.read_text() for f in tmp_path.glob("error-*.json")]
    old, new = _read(tmp_path, "old"), _read(tmp_path, "new")
    reference = old["reference"]
    assert [old["losses"][str(k)] for k in range(1, ls.STEPS + 1)] == reference[:ls.STEPS]
    # the checkpoint is of step 2: the step-3 snapshots would need host B's optimizer half
    assert new["step"] == ls.CHECKPOINT and new["rolled_back_to"] is None
    losses = {int(k): v for k, v in new["losses"].items()}
    assert sorted(losses) == list(range(ls.CHECKPOINT + 1, ls.FINAL + 1))
    diff = max(abs(v - reference[k - 1]) for k, v in losses.items())
    assert diff <= 1e-6, (diff, losses, reference)         # fp32: only dp's reduction order differs
    config, target = ParallelConfig.parse(ls.CONFIG), ParallelConfig.parse(ls.NEW)
    tree = live_spec(s.model(), w.options(True)).tree(config, target)
    plan = make_plan(tree, config, target, alive={0, 1}, store_fallback=True)
    assert new["store"] == plan.totals.store > 0           # only what host A's snapshots lack

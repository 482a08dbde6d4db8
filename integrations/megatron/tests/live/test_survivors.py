"""Survivors alone (issue 24): a SIGKILLed rank of four, three survivors go on without a
replacement on two processes, then a newcomer grows the world back to four."""

import json

import pytest

from tenplex.ptree.config import ParallelConfig
from tenplex.transform.planner import make_plan
from tenplex_megatron.demo.job import live_spec

from live.test_live_api import CTX, _read, _store

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_survivors_go_on_alone_then_grow_back_with_a_newcomer(tmp_path):
    import live_survivors as s
    import live_workers as w

    store, port = _store()
    procs = [CTX.Process(target=s.survivor, args=(p, port, str(tmp_path))) for p in range(4)]
    for p in procs:
        p.start()
    procs[s.KILL].join(300)
    assert procs[s.KILL].exitcode == -9, [f.read_text() for f in tmp_path.glob("error-*.json")]
    store.set("lost", json.dumps([s.KILL]))
    joiner = CTX.Process(target=s.newcomer, args=(port, str(tmp_path)))
    joiner.start()
    rest = [p for i, p in enumerate(procs) if i != s.KILL] + [joiner]
    codes = [p.join(600) or p.exitcode for p in rest]
    errors = [f.read_text() for f in tmp_path.glob("error-*.json")]
    assert codes == [0, 0, 0, 0] and not errors, errors
    got = _read(tmp_path, "survivors")
    assert got["failure"]["step"] == s.DURING, got
    losses = {int(k): v for k, v in got["losses"].items()}
    assert sorted(losses) == list(range(1, s.STEPS + 1))
    assert [losses[k] for k in range(1, s.DURING)] == got["reference"][:s.DURING - 1]   # before: bit for bit
    diff = max(abs(losses[k] - got["reference"][k - 1]) for k in losses)
    assert diff <= 1e-6, (diff, got)                     # fp32: only dp's reduction order differs
    assert got["rolled_back_to"] is None and got["step"] == s.DURING - 1
    # only what no survivor held (rank 1's optimizer shard) was read from the checkpoint
    config, alone = ParallelConfig.parse(s.CONFIG), ParallelConfig.parse(s.ALONE)
    tree = live_spec(s.model(), w.options(True)).tree(config, alone)
    plan = make_plan(tree, config, alone, alive={0, 2, 3}, store_fallback=True)
    assert got["store"] == plan.totals.store > 0
    assert got["grown_sent"] == got["grown_lower_bound"]
    # survivors 0, 2, 3 are numbered 0, 1, 2; the newcomer is 3
    numbers = {p: _read(tmp_path, f"numbers-{p}") for p in (0, 2, 3)}
    assert [numbers[p]["after_recovery"] for p in (0, 2, 3)] == [0, 1, 2]
    assert [numbers[p]["in_alone"] for p in (0, 2, 3)] == [True, True, False]
    newcomer = _read(tmp_path, "newcomer")
    assert newcomer["rank"] == 3
    assert {int(k): v for k, v in newcomer["losses"].items()} == {k: losses[k] for k in (5, 6)}

"""Live reconfiguration and recovery across gloo processes on CPU (world size <= 4)."""

import json
import multiprocessing as mp
import signal
import time

import pytest

from tenplex.api import save
from tenplex.ptree import materialize

from tests.helpers import elastic_workers as w
from tests.helpers.rendezvous import free_port


pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
CTX = mp.get_context("spawn")


def _run(procs, timeout=180):
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(1, deadline - time.time()))
        if p.is_alive():
            p.kill()
            pytest.fail("a worker hung past the timeout")
    return [p.exitcode for p in procs]


def _read(d, name):
    path = d / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _errors(d):
    return [p.read_text() for p in d.glob("error-*.json")]


def test_reconfigure_through_tp_pp_dp_changes_and_world_changes(tmp_path):
    port = free_port()
    codes = _run([CTX.Process(target=w.sequence, args=(r, 4, port, str(tmp_path))) for r in range(4)])
    assert codes == [0, 0, 0, 0], _errors(tmp_path)
    rows = _read(tmp_path, "sequence")
    assert len(rows) == len(w.SEQUENCE)
    for row in rows:  # bytes moved = the plan's, = the lower bound
        assert row["sent"] == row["planned_moved"] == row["lower_bound"], row


def _recovery(tmp_path, kill, store, tree_name):
    pa, pb = free_port(), free_port()
    survivors = [CTX.Process(target=w.survivor, args=(r, pa, pb, kill, store, str(tmp_path), tree_name))
                 for r in range(4)]
    for p in survivors:
        p.start()
    for r in kill:
        survivors[r].join(60)
        assert survivors[r].exitcode == -signal.SIGKILL
    replacements = [CTX.Process(target=w.replacement, args=(r, pb, kill, store, str(tmp_path), tree_name))
                    for r in kill]
    codes = _run(replacements)
    for r, p in enumerate(survivors):
        if r not in kill:
            p.join(120)
            codes.append(p.exitcode)
    assert all(c == 0 for c in codes), _errors(tmp_path)


def test_recover_lost_rank_from_replicas_without_store_reads(tmp_path):
    _recovery(tmp_path, kill=[3], store=None, tree_name="replicated")
    for r in range(4):
        got = _read(tmp_path, f"recovered-{r}")
        assert got is not None and got["store"] == 0 and got["sent"] > 0


def _checkpoint(tmp_path, tree):
    state = w.global_state(w.CONFIG, tree)
    state["optimizer/step"] = 0
    url = str(tmp_path / "ckpt")
    save(url, tree, w.CONFIG, {r: materialize(tree, state, w.CONFIG, r)
                               for r in range(w.CONFIG.world_size)})
    return url


def test_recover_reads_only_the_lost_region_from_the_store(tmp_path):
    # ranks 1 and 3 are both dp replicas of tp rank 1: that half of every tp-split leaf is gone
    _recovery(tmp_path, kill=[1, 3], store=_checkpoint(tmp_path, w.TREE), tree_name="distributed")
    from tenplex.transform import make_plan
    plan = make_plan(w.TREE, w.CONFIG, w.CONFIG, alive={0, 2}, store_fallback=True)
    reports = [_read(tmp_path, f"recovered-{r}") for r in range(4)]
    assert all(reports)
    # exactly the lost regions: tp rank 1's half of tp-split leaves, and the optimizer shards of
    # the two lost dp ranks (the distributed optimizer keeps no replicas)
    assert reports[0]["store"] == plan.totals.store > 0
    assert reports[0]["steps_kept"] == 7                       # against restarting from step 0


def test_recover_without_store_reports_the_missing_regions(tmp_path):
    _recovery(tmp_path, kill=[1, 3], store=None, tree_name="distributed")
    for r in range(4):
        missing = _read(tmp_path, f"missing-{r}")
        assert missing and "model/layers/0/mlp/fc1/weight" in missing


def test_peer_dying_mid_transfer_fails_cleanly_and_rerun_succeeds(tmp_path):
    pa, pb = free_port(), free_port()
    procs = [CTX.Process(target=w.fault, args=(r, pa, pb, str(tmp_path))) for r in range(4)]
    start = time.time()
    codes = _run(procs, timeout=120)
    assert codes[:3] == [0, 0, 0] and codes[3] == -signal.SIGKILL, _errors(tmp_path)
    assert time.time() - start < 90
    for r in range(3):
        got = _read(tmp_path, f"fault-{r}")
        assert got["first"].startswith("TransferError") and got["rerun"] == "ok", got


def test_agreement_and_rank_declarations_across_four_processes(tmp_path):
    port = free_port()
    codes = _run([CTX.Process(target=w.agreement, args=(r, port, str(tmp_path))) for r in range(4)])
    assert codes == [0, 0, 0, 0], _errors(tmp_path)
    got = [_read(tmp_path, f"agreement-{r}") for r in range(4)]
    for name in w.AGREEMENT:
        outcomes = [g[name] for g in got]
        if name in ("renumbered", "src_of"):  # renumbered survivors: bit-exact (checked in the workers)
            assert all("ok" in o for o in outcomes), (name, outcomes)
            continue
        # the same error, with the same message, on every process, before anything moved
        assert all(o == outcomes[0] for o in outcomes) and "error" in outcomes[0], (name, outcomes)
    expect = {
        "dtype": ("ShardError", "process 2 (old rank 2, new rank 2): leaf optimizer/exp_avg/model/"
                                "layers/0/mlp/fc1/weight: expected dtype float32, found bfloat16"),
        "missing": ("ShardError", "process 1 (old rank 1, new rank 1): leaf model/layers/1/attention/"
                                  "qkv/weight: missing"),
        "args": ("PlanError", "dst is"),
        "duplicate": ("PlanError", "old rank 3 is declared by processes 1 and 2"),
        "contradiction": ("PlanError", "process 1 declares old rank 3, but src_of gives it 2"),
        "lost": ("PlanError", "process 0 declares old rank 1, which is in lost [1]"),
        "undeclared": ("PlanError", "processes [0, 1, 2] hold a local state but declare no old rank"),
    }
    for name, (kind, text) in expect.items():
        assert got[0][name]["error"] == kind and text in got[0][name]["message"], got[0][name]

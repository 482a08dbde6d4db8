"""The live API on a real megatron-core GPT (bf16 params, DDP, DistributedOptimizer) in gloo processes."""

import datetime
import json
import multiprocessing as mp
import socket
import time

import pytest
import torch.distributed as dist

import live_workers as w
from tenplex.ptree.config import ParallelConfig
from tenplex.transform.planner import make_plan
from tenplex_megatron.demo.data import load_corpus
from tenplex_megatron.demo.job import live_spec

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
CTX = mp.get_context("spawn")


def _store():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=120)), port


def _run(procs, timeout=600):
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(1, deadline - time.time()))
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in procs]


def _read(d, name):
    path = d / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _sequence(tmp_path, configs, distributed):
    store, port = _store()
    codes = _run([CTX.Process(target=w.sequence, args=(p, port, str(tmp_path), configs, distributed))
                  for p in range(4)])
    errors = [f.read_text() for f in tmp_path.glob("error-*.json")]
    assert codes == [0, 0, 0, 0] and not errors, errors
    return _read(tmp_path, "start"), _read(tmp_path, "sequence")


def _check_rows(tmp_path, start, rows, configs, distributed):
    opts = w.options(distributed)
    spec, batch = live_spec(w.MODEL, opts), opts.global_batch
    corpus = load_corpus(opts.seq, 1 << 20, w.SEED)
    assert len(rows) == len(configs) - 1
    # export + import alone (the identity change) continue the run bit for bit
    assert rows[0]["old"] == rows[0]["new"] and rows[0]["losses"] == start["uninterrupted"][w.STEPS:]
    for i, row in enumerate(rows):
        old, new = ParallelConfig.parse(row["old"]), ParallelConfig.parse(row["new"])
        assert row["state_equal"], row                                # every tensor, bit for bit
        assert row["losses"] == row["reference"], row                 # two steps = the static run at `new`
        assert row["consumed_before"] == (i + 1) * w.STEPS * batch    # the data position moved with it
        assert row["step"] == (i + 1) * w.STEPS
        assert row["samples"] == [corpus.global_batch(row["consumed_before"] + k * batch, batch).tolist()
                                  for k in range(w.STEPS)]              # the global sample order goes on
        counted = sum(_read(tmp_path, f"sent-{i}-{p}") or 0 for p in range(4))
        tree = spec.tree(old, new)
        plan = make_plan(tree, old, new, **_numbered(row["dst_of"], old, new))
        assert counted == row["sent"] == row["planned_moved"] == row["lower_bound"] == plan.totals.lower_bound
        # renumbered (the default): no more than the contiguous numbering, often less
        contiguous = make_plan(tree, old, new).totals.lower_bound
        assert row["sent"] < contiguous or row["dst_of"] == _contiguous(old, new), (row, contiguous)
        if distributed:
            _no_optimizer_gather(spec.tree(old, new), old, new, plan)


def _contiguous(old, new) -> list:
    return [r if r < new.world_size else None for r in range(max(old.world_size, new.world_size))]


def _numbered(dst_of, old, new) -> dict:
    """make_plan's placements for a change whose transition process ``p`` held old rank ``p``
    and holds new rank ``dst_of[p]`` (one device per process)."""
    from tenplex.transform.placement import Device, Placement
    device = [Device("h", p) for p in range(len(dst_of))]
    process_of = {r: p for p, r in enumerate(dst_of) if r is not None}
    return {"src_placement": Placement(tuple(device[:old.world_size])),
            "dst_placement": Placement(tuple(device[process_of[r]] for r in range(new.world_size)))}


def test_change_sequence_matches_static_runs_bit_for_bit(tmp_path):
    start, rows = _sequence(tmp_path, w.SEQUENCE, True)
    errors = start["errors"]
    assert errors["not distributed"].startswith("ConfigError: ") and "is distributed" in errors["not distributed"]
    assert errors["dtype"].startswith("ShardError: ") and "expected float32" in errors["dtype"]
    assert errors["missing leaf"] == "ShardError: state lacks 'optimizer/exp_avg/output_layer/weight'"
    assert errors["world without membership"].startswith("ConfigError: change to dp=2,tp=2,pp=1 (4 ranks)")
    assert errors["untouched"] is True           # a refused import wrote nothing
    _check_rows(tmp_path, start, rows, w.SEQUENCE, True)


def test_plain_optimizer_change_sequence_matches_static_runs_bit_for_bit(tmp_path):
    """megatron-core's plain mixed-precision optimizer (bf16 params, fp32 main params; no
    distributed optimizer): its state is replicated across dp, and moves the same way."""
    start, rows = _sequence(tmp_path, w.PLAIN_SEQUENCE, False)
    _check_rows(tmp_path, start, rows, w.PLAIN_SEQUENCE, False)


def _no_optimizer_gather(tree, old, new, plan):
    """Optimizer state stays dp-sharded: each element on exactly one dp rank, and each new rank
    receives at most the shard it then holds (an all-gather would send every rank the whole)."""
    from math import prod
    from tenplex.ptree.sharding import Sharding
    sharding = Sharding(tree, new)
    optimizer = [p for p, _ in tree.tensors() if p.startswith("optimizer/")]

    def held(rank):
        coord = new.coord(rank)
        return sum(h.numel * 4 for p in optimizer for h in [sharding.holding(p, coord)] if h is not None)

    for rank in range(new.world_size):
        got = sum(op.nbytes for op in plan.ops if op.dst_rank == rank and op.path.startswith("optimizer/"))
        assert got <= held(rank), (old, new, rank, got, held(rank))
    for t in range(new.tp):
        for s in range(new.pp):
            ranks = [new.rank(new.coord(0)._replace(tp=t, pp=s, dp=d)) for d in range(new.dp)]
            whole = sum(4 * prod(sharding.tp_local(tree[p], t)[0]) for p in optimizer
                        if s in sharding.stages(tree[p]))
            assert sum(held(r) for r in ranks) == whole


def test_sigkilled_rank_is_rebuilt_from_replicas_and_training_goes_on(tmp_path):
    import live_recovery as r
    store, port = _store()
    procs = [CTX.Process(target=r.recovery, args=(p, port, str(tmp_path), 0, False)) for p in range(4)]
    for p in procs:
        p.start()
    for s, sc in enumerate(r.SCENARIOS):
        procs[sc.kill].join(300)
        assert procs[sc.kill].exitcode == -9, [f.read_text() for f in tmp_path.glob("error-*.json")]
        store.set(f"s{s}/lost", json.dumps([sc.kill]))
        procs[sc.kill] = CTX.Process(target=r.recovery, args=(sc.kill, port, str(tmp_path), s, True))
        procs[sc.kill].start()
    codes = _run([], 0) or [p.join(600) or p.exitcode for p in procs]
    errors = [f.read_text() for f in tmp_path.glob("error-*.json")]
    assert codes == [0, 0, 0, 0] and not errors, errors
    results = [_read(tmp_path, f"scenario-{s}") for s in range(len(r.SCENARIOS))]
    for s, (sc, got) in enumerate(zip(r.SCENARIOS, results)):
        assert got["failure"]["step"] == sc.during, got                      # killed during training
        losses = {int(k): v for k, v in got["losses"].items()}
        assert [losses[k] for k in sorted(losses)] == got["reference"], got   # as if nothing had happened
        mine = _read(tmp_path, f"replacement-{s}")
        assert mine["resumed_at"] == got["resumed_at"]
    replicas, same_step, older = results
    assert replicas["resumed_at"] == 4 and replicas["store"] == 0 and replicas["sent"] > 0
    assert same_step["resumed_at"] == 5 and 0 < same_step["store"] and same_step["rolled_back_to"] is None
    assert older["rolled_back_to"] == 2 and older["resumed_at"] == 3

"""Live expert-parallel changes: ``tenplex.reconfigure`` across 4 gloo processes, bit for bit.

Every process knows the global state (``random_state`` with a fixed seed), so after each change
it checks its own new shards against ``materialize(global state, new config, its rank)``: if
every process holds exactly its shards, the assembled global state is bit-exact.
"""

import datetime
import json
import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

from tests.helpers.rendezvous import free_port


pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
CTX = mp.get_context("spawn")
WORLD = 4


def _spec():
    from tenplex.models import GPTSpec
    return GPTSpec(num_layers=4, hidden=16, heads=4, query_groups=2, ffn=32, vocab=64, seq_len=8,
                   swiglu=True, num_experts=4, moe_ffn=16, shared_expert_ffn=16, expert_bias=True,
                   dtype="bfloat16", optimizer="distributed_adam", bucket_numel=2000,
                   make_vocab_size_divisible_by=8)


def _sequence():
    from tenplex.ptree import ParallelConfig as P
    # ep 1 -> 2 -> 4, then expert tp, cp, virtual stages, a smaller world and back
    return [P(dp=4), P(dp=4, ep=2), P(dp=4, ep=4), P(dp=2, tp=2, ep=2), P(dp=2, tp=2, ep=4, etp=1),
            P(dp=2, cp=2, ep=4, etp=1), P(dp=2, pp=2, vpp=2, ep=2), P(dp=2, ep=2), P(dp=4, ep=1)]


def _reconfigure(local, tree, src, dst, src_of):
    import tenplex
    return tenplex.reconfigure(local, tree, src, dst, src_of=src_of, memory_budget=1 << 15)


def _check(state, tree, config, rank, tensors, values):
    from tenplex.ptree import materialize
    from tenplex.ptree.shards import bitwise_equal
    from tenplex.ptree.tree import Scope

    expected = materialize(tree, {**tensors, **values}, config, rank)
    assert set(state) == set(expected), sorted(set(state) ^ set(expected))
    for path, want in expected.items():
        if isinstance(want, torch.Tensor):
            assert bitwise_equal(state[path], want), (rank, path)
        elif tree[path].scope is Scope.GLOBAL:
            assert state[path] == values[path], (rank, path)
        else:
            assert state[path] == values[path].get(tree[path].key(config, rank)), (rank, path)


def worker(rank: int, port: int, out_dir: str) -> None:
    """Reconfigure through the sequence; every step checked bit for bit against the global state."""
    import torch.distributed as dist

    from tenplex.models import gpt_tree, random_state
    from tenplex.ptree import materialize
    from tests.helpers.elastic_workers import expected_values

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        tree = gpt_tree(_spec())
        configs = _sequence()
        state = random_state(tree, configs[0], 17)
        tensors = {p: t for p, t in state.items() if isinstance(t, torch.Tensor)}
        values = {p: v for p, v in state.items() if not isinstance(v, torch.Tensor)}
        local = materialize(tree, state, configs[0], rank)
        rows, src_of = [], None
        for src, dst in zip(configs, configs[1:]):  # renumbered: each goes on with its new rank
            local, rep = _reconfigure(local, tree, src, dst, src_of)
            values = expected_values(values, src, dst, tree)
            src_of = rep.dst_of
            if src_of[rank] is not None:
                _check(local, tree, dst, src_of[rank], tensors, values)
            else:
                assert local is None
            rows.append({"src": str(src), "dst": str(dst), "sent": rep.sent,
                         "planned_moved": rep.planned_moved, "lower_bound": rep.lower_bound})
        if rank == 0:
            with open(os.path.join(out_dir, "rows.json"), "w") as f:
                json.dump(rows, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def test_live_expert_parallel_changes_are_bit_exact(tmp_path):
    port = free_port()
    procs = [CTX.Process(target=worker, args=(r, port, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.time() + 400
    for p in procs:
        p.join(max(1, deadline - time.time()))
        if p.is_alive():
            p.kill()
    errors = [f.read_text() for f in tmp_path.glob("error-*.txt")]
    assert [p.exitcode for p in procs] == [0] * WORLD, errors
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["dst"] for r in rows] == [str(c) for c in _sequence()[1:]]
    for row in rows:  # bytes sent = the plan's bytes moved = the lower bound
        assert row["sent"] == row["planned_moved"] == row["lower_bound"], row
    # each ep change sends bytes: expert weights, and optimizer state that changes buffer part
    assert rows[0]["sent"] > 0 and rows[1]["sent"] > 0

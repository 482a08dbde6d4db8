"""Worker processes for the multi-process elastic tests (gloo on CPU).

Every worker knows the global state (``random_state`` with a fixed seed), so
after each change it checks its own new shards against
``materialize(global state, new config, its rank)``: if every process holds
exactly its shards, the assembled global state is bit-exact.
"""

import datetime
import json
import os
import signal
import traceback

import torch
import torch.distributed as dist

import tenplex
from tenplex.errors import MissingDataError, TransferError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.ptree.tree import Scope
from tenplex.transform.comm import TorchComm

SPEC = GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=4, ffn=64, vocab=100, swiglu=True,
               tied=True, dtype="bfloat16", optimizer="distributed_adam", bucket_numel=2000,
               make_vocab_size_divisible_by=8)
TREE = gpt_tree(SPEC)
# plain Adam: optimizer state is replicated across dp, so a lost dp replica can be rebuilt from
# its twin (with the distributed optimizer each dp rank holds a different shard: see the store test)
REPLICATED = gpt_tree(GPTSpec(**{**SPEC.__dict__, "optimizer": "adam"}))
SEED = 11
FIRST = P(dp=1, tp=2)
# the paper's three kinds of change, each reversed, then changes that grow and shrink the world
SEQUENCE = [P(dp=1, tp=4), P(dp=1, tp=2), P(dp=1, tp=2, pp=2), P(dp=1, tp=2), P(dp=2, tp=2),
            P(dp=1, tp=2), P(dp=2, tp=1, pp=2), P(dp=3, tp=1), P(dp=1, tp=1, pp=2), P(dp=4, tp=1)]


def init(rank: int, world: int, port: int, timeout: float = 20) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def global_state(config, tree=None):
    return random_state(tree or TREE, config, SEED)


def expected_values(values: dict, src, dst, tree=None) -> dict:
    """Values carried by coordinate: scoped values survive at coordinates that still exist;
    a new coordinate has none."""
    out = {}
    for path, leaf in (tree or TREE).values():
        if leaf.scope is Scope.GLOBAL:
            out[path] = values[path]
        else:
            keys = {leaf.key(dst, r) for r in range(dst.world_size)}
            out[path] = {k: values[path].get(k) for k in keys}
    return out


def check(state, config, rank, values, tensors, tree=None) -> None:
    tree = tree or TREE
    expected = materialize(tree, {**tensors, **values}, config, rank)
    assert set(state) == set(expected), sorted(set(state) ^ set(expected))
    for path in expected:
        leaf = tree[path]
        if isinstance(expected[path], torch.Tensor):
            assert bitwise_equal(state[path], expected[path]), (rank, path)
        elif leaf.scope is Scope.GLOBAL:
            assert state[path] == values[path], (rank, path)
        else:
            assert state[path] == values[path].get(leaf.key(config, rank)), (rank, path)


TREES = {"distributed": TREE, "replicated": REPLICATED}


def report(out_dir: str, name: str, data) -> None:
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(data, f)


def sequence(rank: int, world: int, port: int, out_dir: str) -> None:
    """Reconfigure through SEQUENCE; every step checked bit for bit."""
    init(rank, world, port)
    tensors = {p: t for p, t in global_state(FIRST).items() if isinstance(t, torch.Tensor)}
    values = {p: v for p, v in global_state(FIRST).items() if not isinstance(v, torch.Tensor)}
    local = materialize(TREE, global_state(FIRST), FIRST, rank) if rank < FIRST.world_size else None
    config, rows, src_of = FIRST, [], None
    for target in SEQUENCE:  # renumbered (the default): each process goes on with its new rank
        local, rep = tenplex.reconfigure(local, TREE, config, target, src_of=src_of,
                                         memory_budget=1 << 17)
        values = expected_values(values, config, target)
        src_of = rep.dst_of
        if src_of[rank] is not None:
            check(local, target, src_of[rank], values, tensors)
        else:
            assert local is None
        rows.append({"src": str(config), "dst": str(target), "sent": rep.sent,
                     "planned_moved": rep.planned_moved, "lower_bound": rep.lower_bound})
        config = target
    if rank == 0:
        report(out_dir, "sequence", rows)
    dist.destroy_process_group()


def _train_until_killed(rank: int, kill: set, steps: int = 4) -> int:
    """Pretend to train (all-reduces); ranks in ``kill`` SIGKILL themselves at step 2."""
    done = 0
    try:
        for step in range(steps):
            x = torch.ones(8)
            dist.all_reduce(x)
            if rank in kill and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            done += 1
    except RuntimeError:
        pass  # a peer died: gloo reports it at once
    dist.destroy_process_group()
    return done


CONFIG = P(dp=2, tp=2)


def survivor(rank: int, port_a: int, port_b: int, kill: list, store: str | None, out_dir: str,
             tree_name: str) -> None:
    """Train in group A until peers die, then recover in group B with the replacements."""
    try:
        tree = TREES[tree_name]
        init(rank, 4, port_a)
        local = materialize(tree, global_state(CONFIG, tree), CONFIG, rank)
        local["optimizer/step"] = 7  # progress made since the checkpoint (step 0)
        _train_until_killed(rank, set(kill))
        init(rank, 4, port_b)
        _recover(rank, local, kill, store, out_dir, tree)
    except BaseException:
        report(out_dir, f"error-{rank}", traceback.format_exc())
        raise


def replacement(rank: int, port_b: int, kill: list, store: str | None, out_dir: str,
                tree_name: str) -> None:
    try:
        init(rank, 4, port_b)
        _recover(rank, None, kill, store, out_dir, TREES[tree_name])
    except BaseException:
        report(out_dir, f"error-{rank}", traceback.format_exc())
        raise


def _recover(rank, local, kill, store, out_dir, tree) -> None:
    src_of = [None if r in kill else r for r in range(4)]
    values = global_state(CONFIG, tree)
    try:
        state, rep = tenplex.recover(local, tree, CONFIG, CONFIG, lost=set(kill), store=store,
                                     src_of=src_of, step_path="optimizer/step")
    except MissingDataError as err:
        report(out_dir, f"missing-{rank}", sorted(err.missing))
        dist.destroy_process_group()
        return
    tensors = {p: t for p, t in values.items() if isinstance(t, torch.Tensor)}
    vals = {p: v for p, v in values.items() if not isinstance(v, torch.Tensor)}
    vals["optimizer/step"] = 7
    check(state, CONFIG, rank, vals, tensors, tree)
    report(out_dir, f"recovered-{rank}", {"store": rep.store, "sent": rep.sent, "local": rep.local,
                                          "steps_kept": rep.steps_kept})
    dist.destroy_process_group()


class KillingComm(TorchComm):
    """Posts the ``at``-th exchange round's sends and receives, then kills its own process."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.round = at, 0

    def start(self, sends, recvs):
        self.round += 1
        if self.round == self.at:
            ops = [dist.P2POp(dist.isend, t, p) for p, t in sends]
            ops += [dist.P2POp(dist.irecv, t, p) for p, t in recvs]
            if ops:
                dist.batch_isend_irecv(ops)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().start(sends, recvs)


def fault(rank: int, port_a: int, port_b: int, out_dir: str) -> None:
    """Rank 3 dies mid-transfer: every survivor must get a TransferError, then a rerun succeeds."""
    try:
        tree = REPLICATED
        init(rank, 4, port_a, timeout=15)
        local = materialize(tree, global_state(CONFIG, tree), CONFIG, rank)
        before = {p: t.clone() for p, t in local.items() if isinstance(t, torch.Tensor)}
        comm = KillingComm(at=1) if rank == 3 else TorchComm()
        target = P(dp=1, tp=4)
        try:
            tenplex.reconfigure(local, tree, CONFIG, target, comm=comm, memory_budget=1 << 16,
                                renumber=False)  # renumbered, the change would move nothing
            outcome = "finished"
        except TransferError as err:
            outcome = f"TransferError: {err}"
        dist.destroy_process_group()
        # the state held before the transfer is untouched
        assert all(bitwise_equal(before[p], local[p]) for p in before)
        # rerun with the survivors: rank 3's shards live on in their dp replica (rank 1)
        init(rank, 3, port_b)
        rerun = P(dp=3, tp=1)
        state, _ = tenplex.reconfigure(local, tree, CONFIG, rerun, src_of=[0, 1, 2], dst_of=[0, 1, 2],
                                       alive={0, 1, 2})
        values = global_state(CONFIG, tree)
        tensors = {p: t for p, t in values.items() if isinstance(t, torch.Tensor)}
        check(state, rerun, rank, expected_values({p: v for p, v in values.items()
                                                   if not isinstance(v, torch.Tensor)}, CONFIG, rerun),
              tensors, tree)
        report(out_dir, f"fault-{rank}", {"first": outcome, "rerun": "ok"})
        dist.destroy_process_group()
    except BaseException:
        report(out_dir, f"error-{rank}", traceback.format_exc())
        raise


# -- agreement and rank declarations (one process group, one scenario after another) --------

def _scenario(rank: int, name: str):
    """Run scenario ``name`` on this process; returns what it got (state or error)."""
    tree, truth = REPLICATED, global_state(CONFIG, REPLICATED)
    local = materialize(tree, truth, CONFIG, rank)
    if name == "dtype" and rank == 2:
        local["optimizer/exp_avg/model/layers/0/mlp/fc1/weight"] = \
            local["optimizer/exp_avg/model/layers/0/mlp/fc1/weight"].to(torch.bfloat16)
    if name == "missing" and rank == 1:
        del local["model/layers/1/attention/qkv/weight"]
    if name in ("dtype", "missing", "args"):
        dst = P(dp=4, tp=1) if name == "args" and rank == 3 else P(dp=1, tp=4)
        return tenplex.reconfigure(local, tree, CONFIG, dst)
    # recovery after losing old rank 1: survivors 0, 2, 3 are renumbered 0, 1, 2 (as torchrun
    # does); process 3 is a replacement. Each survivor holds its old rank's state.
    old = [0, 2, 3, None][rank]
    state = None if old is None else materialize(tree, truth, CONFIG, old)
    kwargs = {"old_rank": old}
    if name == "src_of":
        kwargs = {"src_of": [0, 2, 3, None]}
    elif name == "duplicate" and rank == 1:
        kwargs = {"old_rank": 3}
    elif name == "contradiction":
        kwargs = {"src_of": [0, 2, 3, None], "old_rank": 3 if rank == 1 else old}
    elif name == "lost":
        kwargs = {"old_rank": 1 if rank == 0 else old}
    elif name == "undeclared":
        kwargs = {}
    out, rep = tenplex.recover(state, tree, CONFIG, CONFIG, lost={1}, **kwargs)
    values = {p: v for p, v in truth.items() if not isinstance(v, torch.Tensor)}
    tensors = {p: t for p, t in truth.items() if isinstance(t, torch.Tensor)}
    check(out, CONFIG, rank, values, tensors, tree)   # new rank = process rank, bit for bit
    return {"sent": rep.sent, "store": rep.store}


AGREEMENT = ["dtype", "missing", "args", "renumbered", "src_of", "duplicate", "contradiction",
             "lost", "undeclared"]


def agreement(rank: int, port: int, out_dir: str) -> None:
    """Every scenario of AGREEMENT in one process group; each outcome reported per process."""
    try:
        init(rank, 4, port, timeout=60)
        results = {}
        for name in AGREEMENT:
            try:
                results[name] = {"ok": _scenario(rank, name)}
            except Exception as exc:  # reported: the test compares processes
                results[name] = {"error": type(exc).__name__, "message": str(exc)}
        report(out_dir, f"agreement-{rank}", results)
        dist.destroy_process_group()
    except BaseException:
        report(out_dir, f"error-{rank}", traceback.format_exc())
        raise

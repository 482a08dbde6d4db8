"""Workers for ``reconfigure(..., out=)`` across four gloo processes (tests/test_elastic_out.py).

Every process runs the same scenarios in one process group, one after another, and reports
per scenario what it got: ``ok`` (its new shards equal ``materialize`` of the global state bit
for bit, live in the ``out`` tensors it passed, and equal the fresh-tensor path's) or the error's
type and message, and whether its ``out`` tensors were written.
"""

import traceback

import torch
import torch.distributed as dist

import tenplex
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.shards import bitwise_equal
from tenplex.ptree.tree import torch_dtype

from tests.helpers.elastic_workers import REPLICATED, global_state, init, report

SRC, DST = P(dp=2, tp=2), P(dp=1, tp=4)
POISON = 7
"""What every ``out`` tensor is filled with before a call: a call that fails before anything moves
leaves it so."""

SCENARIOS = ["in_place", "dtype", "shape", "device", "missing", "shares_old", "renumbered"]
WRONG = "optimizer/exp_avg/model/layers/0/mlp/fc1/weight"


def _out(rank: int) -> dict:
    """Tensors of new rank ``rank``'s local shapes and dtypes, touched (filled with POISON)."""
    sharding, coord = Sharding(REPLICATED, DST), DST.coord(rank)
    out = {}
    for path, leaf in REPLICATED.tensors():
        held = sharding.holding(path, coord)
        if held is not None:
            out[path] = torch.full(held.shape, POISON, dtype=torch_dtype(leaf.dtype))
    return out


def _scenario(rank: int, name: str, local: dict, truth: dict):
    out = _out(rank)
    kwargs = {"renumber": name == "renumbered"}
    if name == "dtype" and rank == 2:
        out[WRONG] = out[WRONG].to(torch.float64)
    if name == "shape" and rank == 1:
        out[WRONG] = out[WRONG].reshape(-1)
    if name == "device" and rank == 3:
        out[WRONG] = torch.empty(out[WRONG].shape, dtype=out[WRONG].dtype, device="meta")
    if name == "missing" and rank == 0:
        del out[WRONG]
    if name == "shares_old" and rank == 2:
        out[WRONG] = local[WRONG].view(-1)[: out[WRONG].numel()].view(out[WRONG].shape)
    before = {p: t.clone() for p, t in local.items() if isinstance(t, torch.Tensor)}
    given = dict(out)
    try:
        state, _ = tenplex.reconfigure(local, REPLICATED, SRC, DST, out=out, **kwargs)
    except Exception as exc:
        untouched = all(bool((t == POISON).all()) for p, t in given.items()
                        if t.device.type != "meta" and not (name == "shares_old" and p == WRONG))
        return {"error": type(exc).__name__, "message": str(exc), "out_untouched": untouched}
    expected = materialize(REPLICATED, truth, DST, rank)
    fresh, _ = tenplex.reconfigure(local, REPLICATED, SRC, DST, renumber=False)
    for path, want in expected.items():
        if isinstance(want, torch.Tensor):
            assert state[path] is given[path], (rank, path)  # the caller's tensor, filled in place
            assert bitwise_equal(state[path], want), (rank, path)
            assert bitwise_equal(state[path], fresh[path]), (rank, path)
        else:
            assert state[path] == want == fresh[path], (rank, path)
    assert set(state) == set(expected) == set(fresh)
    assert all(bitwise_equal(local[p], t) for p, t in before.items())  # the old state is untouched
    return {"ok": True}


def run(rank: int, port: int, out_dir: str) -> None:
    """Every scenario of SCENARIOS in one process group; each outcome reported per process."""
    try:
        init(rank, 4, port, timeout=60)
        truth = global_state(SRC, REPLICATED)
        local = materialize(REPLICATED, truth, SRC, rank)
        results = {}
        for name in SCENARIOS:
            try:
                results[name] = _scenario(rank, name, local, truth)
            except Exception as exc:  # reported: the test compares processes
                results[name] = {"error": type(exc).__name__, "message": str(exc), "where": "check",
                                 "trace": traceback.format_exc()}
        report(out_dir, f"out-{rank}", results)
        dist.destroy_process_group()
    except BaseException:
        report(out_dir, f"error-{rank}", traceback.format_exc())
        raise

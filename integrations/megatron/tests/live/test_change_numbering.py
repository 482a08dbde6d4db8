"""A growing live change computes its numbering first and forms the new group once, in that order.

The processes and their group are stood in for (a membership that records what it forms, and a
transfer that renumbers as ``tenplex.reconfigure`` does); the tree is the live tests' real
megatron-core GPT's. The transfer itself is tested end to end in ``test_live_api.py``.
"""

import importlib
import json

import pytest

import live_workers as w
from tenplex.elastic import ReconfigureReport, default_mapping
from tenplex.ptree.config import ParallelConfig
from tenplex.transform.assign import best_numbering
from tenplex_megatron.demo.job import live_spec

live_change = importlib.import_module("tenplex_megatron.live.change")  # the package exports change()


class _Store:
    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value

    def get(self, key):
        return self.kv[key]

    def wait(self, keys, timeout):
        assert all(k in self.kv for k in keys), keys


class _Membership:
    """Process ``process`` of a job whose group is ``members``; records every group it forms."""

    def __init__(self, process, members):
        self.process, self.members, self.generation = process, list(members), 1
        self.rank = self.members.index(process) if process in self.members else None
        self.store, self.timeout, self.formed = _Store(), None, []

    def form(self, size, name=None, order=None):
        order = list(range(size)) if order is None else list(order)
        self.formed.append(order)
        self.generation += 1
        self.members, self.size = order, size
        self.rank = order.index(self.process) if self.process in order else None
        return self.rank is not None


def _renumbering_transfer(calls):
    """tenplex.reconfigure's numbering without processes: renumbered unless dst_of is given."""
    def transfer(state, tree, old, new, *, renumber, src_of=None, dst_of=None):
        calls.append({"src_of": src_of, "dst_of": dst_of, "renumber": renumber})
        size = max(old.world_size, new.world_size)
        bound = None
        if dst_of is None:
            src_of, dst_of = default_mapping(size, old, new)
            if renumber:
                dst_of, bound = best_numbering(tree, old, new, src_of, range(old.world_size), given=dst_of)
        return state, ReconfigureReport(dst_of=list(dst_of), placement_bound=bound)
    return transfer


@pytest.mark.parametrize("process", [0, 1, 2, 3])
def test_growing_renumbered_change_forms_the_new_group_once(monkeypatch, process):
    # dp=1,tp=1,pp=2 -> dp=1,tp=2,pp=2 (the demo's 2 -> 4 workers): the contiguous numbering would
    # put old rank 1 (stage 1) on stage 0, so the new group is renumbered
    old, new = ParallelConfig.parse("dp=1,tp=1,pp=2"), ParallelConfig.parse("dp=1,tp=2,pp=2")
    tree = live_spec(w.MODEL, w.options()).tree(old, new)
    numbering, bound = best_numbering(tree, old, new, [0, 1, None, None], range(2), given=[0, 1, 2, 3])
    assert numbering != [0, 1, 2, 3]
    order = [None] * 4
    for t, rank in enumerate(numbering):
        order[rank] = t
    calls = []
    monkeypatch.setattr(live_change, "transfer", _renumbering_transfer(calls))
    membership = _Membership(process, [0, 1])
    state = {"held": process} if process < 2 else None
    out, report = live_change._moved(state, tree, old, new, membership, None, True)
    assert membership.formed == [order], f"formed {membership.formed}, expected once in {order}"
    assert out == state and report.dst_of == numbering and report.placement_bound == bound
    # the transfer runs in the new group: rank i's process holds the old rank it held before
    assert calls == [{"src_of": [t if t < 2 else None for t in order], "dst_of": [0, 1, 2, 3],
                      "renumber": False}]
    if membership.rank == 0:
        assert json.loads(membership.store.get("tenplex/change/2/report"))["dst_of"] == numbering


def test_growing_change_without_renumbering_keeps_the_contiguous_group(monkeypatch):
    old, new = ParallelConfig.parse("dp=1,tp=1,pp=2"), ParallelConfig.parse("dp=1,tp=2,pp=2")
    tree = live_spec(w.MODEL, w.options()).tree(old, new)
    monkeypatch.setattr(live_change, "transfer", _renumbering_transfer([]))
    membership = _Membership(0, [0, 1])
    _, report = live_change._moved({"held": 0}, tree, old, new, membership, None, False)
    assert membership.formed == [[0, 1, 2, 3]] and report.dst_of == [0, 1, 2, 3]

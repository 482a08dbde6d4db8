"""SIGKILL a process that saves or reshards, at many points; the last commit survives."""

import multiprocessing as mp
import os
import signal

import pytest

from tenplex.api import load_global, reshard, save, verify
from tenplex.errors import ManifestError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.store import StoreReader

SPEC = GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=2, ffn=64, vocab=100,
               optimizer="distributed_adam", bucket_numel=3000)
A = P(dp=2, tp=2)


def _shards(seed):
    tree = gpt_tree(SPEC)
    state = random_state(tree, A, seed)
    return tree, state, {r: materialize(tree, state, A, r) for r in range(A.world_size)}


def _killer(kill_at):
    """A progress callback that SIGKILLs its own process at the ``kill_at``-th event."""
    count = {"n": 0, "kinds": []}

    def on_event(event, nbytes):
        count["n"] += 1
        if count["n"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    return on_event


def _save_child(url, kill_at):
    tree, _, shards = _shards(seed=2)
    save(url, tree, A, shards, block=4096, progress=_killer(kill_at), threads=1)


def _reshard_child(src, dst, kill_at):
    reshard(src, dst, P(dp=1, tp=1, pp=2), events=_killer(kill_at), threads=1)


def _events(kind):
    """How many events a full run emits (counted in-process, no kill)."""
    seen = []
    if kind == "save":
        tree, _, shards = _shards(seed=2)
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            save(f"{d}/x", tree, A, shards, block=4096, threads=1, progress=lambda e, n: seen.append(e))
    return seen


def _run(target, *args):
    proc = mp.get_context("fork").Process(target=target, args=args)
    proc.start()
    proc.join(60)
    return proc.exitcode


def test_killed_save_leaves_previous_checkpoint_and_nothing_visible(tmp_path):
    tree, state, shards = _shards(seed=1)
    save(str(tmp_path / "step1"), tree, A, shards, block=4096)
    events = _events("save")
    # between tensors (mid-shard), after whole files, just before and just after the manifest
    points = sorted({1, 2, len(events) // 3, events.index("file") + 1, len(events) - 2,
                     len(events) - 1, len(events)})
    for kill_at in points:
        target = str(tmp_path / f"step2-{kill_at}")
        assert _run(_save_child, target, kill_at) == -signal.SIGKILL
        verify(str(tmp_path / "step1"))
        got = load_global(str(tmp_path / "step1"))
        assert all(bitwise_equal(got[p], state[p]) for p, _ in tree.tensors())
        committed = events[kill_at - 1] == "committed"
        if committed:
            verify(target)
        else:
            with pytest.raises(ManifestError, match="not a committed checkpoint"):
                StoreReader(target)
            # a rerun succeeds
            _, state2, shards2 = _shards(seed=2)
            save(target, tree, A, shards2)
            assert bitwise_equal(load_global(target)["model/final_norm/weight"],
                                 state2["model/final_norm/weight"])


def test_killed_reshard_leaves_source_intact(tmp_path):
    tree, state, shards = _shards(seed=3)
    src = str(tmp_path / "src")
    save(src, tree, A, shards, block=4096)
    for kill_at in (1, 5, 17, 40):
        dst = str(tmp_path / f"dst-{kill_at}")
        code = _run(_reshard_child, src, dst, kill_at)
        verify(src)
        if code == -signal.SIGKILL:
            with pytest.raises(ManifestError):
                StoreReader(dst)
            reshard(src, dst, P(dp=1, tp=1, pp=2))
        got = load_global(dst)
        assert all(bitwise_equal(got[p], state[p]) for p, _ in tree.tensors())

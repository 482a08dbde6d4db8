"""SIGKILL a process that saves or reshards, at many points; the last commit survives.

Kill points are progress calls (``progress(done_bytes, total_bytes)`` comes
after each tensor written; its last call, ``done == total``, comes before
the commit), and the two sides of the manifest's commit (before the
no-replace link of the fsynced temporary, and after it). Every kill is
asserted to have happened.
"""

import multiprocessing as mp
import os
import signal
import tempfile

import pytest

import tenplex.store.commit as commit_module
from tenplex.api import load_global, reshard, save, verify
from tenplex.errors import ManifestError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.store import StoreReader

SPEC = GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=2, ffn=64, vocab=100,
               optimizer="distributed_adam", bucket_numel=3000)
A = P(dp=2, tp=2)
B = P(dp=1, tp=1, pp=2)


def _shards(seed):
    tree = gpt_tree(SPEC)
    state = random_state(tree, A, seed)
    return tree, state, {r: materialize(tree, state, A, r) for r in range(A.world_size)}


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(kill_at):
    """In the child: a progress callback, or commit hooks, that SIGKILL the process at ``kill_at``.

    ``kill_at`` is an int (the n-th progress call), ``"link"`` (the manifest's
    temporary is written and fsynced, not yet linked) or ``"linked"`` (just after).
    """
    if kill_at == "link":
        commit_module.os.link = lambda *a: _die()
        return None
    if kill_at == "linked":
        link = os.link

        def link_then_die(*args):
            link(*args)
            _die()
        commit_module.os.link = link_then_die
        return None
    count = {"n": 0}

    def on_progress(done, total):
        count["n"] += 1
        if count["n"] == kill_at:
            _die()
    return on_progress


def _save_child(url, kill_at):
    tree, _, shards = _shards(seed=2)
    save(url, tree, A, shards, block=4096, progress=_arm(kill_at), threads=1)


def _reshard_child(src, dst, kill_at):
    reshard(src, dst, B, progress=_arm(kill_at), threads=1, block=4096)


def _calls(fn) -> int:
    """How many progress calls a full run makes (counted in-process, no kill)."""
    calls = []
    with tempfile.TemporaryDirectory() as d:
        fn(d, lambda done, total: calls.append((done, total)))
    assert calls[-1][0] == calls[-1][1] and len(calls) > 3
    return len(calls)


def _run(target, *args):
    proc = mp.get_context("fork").Process(target=target, args=args)
    proc.start()
    proc.join(120)
    return proc.exitcode


def test_killed_save_leaves_previous_checkpoint_and_nothing_visible(tmp_path):
    tree, state, shards = _shards(seed=1)
    save(str(tmp_path / "step1"), tree, A, shards, block=4096)
    _, _, shards2 = _shards(seed=2)
    n = _calls(lambda d, cb: save(f"{d}/x", tree, A, shards2, block=4096, threads=1, progress=cb))
    for kill_at in (1, 2, n // 3, n - 1, n, "link", "linked"):
        target = str(tmp_path / f"step2-{kill_at}")
        assert _run(_save_child, target, kill_at) == -signal.SIGKILL, kill_at
        verify(str(tmp_path / "step1"), progress=False)
        got = load_global(str(tmp_path / "step1"))
        assert all(bitwise_equal(got[p], state[p]) for p, _ in tree.tensors())
        if kill_at == "linked":  # the manifest was linked: committed and complete
            verify(target, progress=False)
            continue
        with pytest.raises(ManifestError, match="not a committed checkpoint"):
            StoreReader(target)
        # a rerun succeeds beside the killed writer's files
        _, state2, shards2 = _shards(seed=2)
        save(target, tree, A, shards2)
        assert bitwise_equal(load_global(target)["model/final_norm/weight"],
                             state2["model/final_norm/weight"])


def test_killed_reshard_leaves_source_intact(tmp_path):
    tree, state, shards = _shards(seed=3)
    src = str(tmp_path / "src")
    save(src, tree, A, shards, block=4096)
    n = _calls(lambda d, cb: reshard(src, f"{d}/x", B, threads=1, block=4096, progress=cb))
    for kill_at in (1, n // 2, n, "link"):
        dst = str(tmp_path / f"dst-{kill_at}")
        assert _run(_reshard_child, src, dst, kill_at) == -signal.SIGKILL, kill_at
        verify(src, progress=False)
        with pytest.raises(ManifestError, match="not a committed checkpoint"):
            StoreReader(dst)
        reshard(src, dst, B)
        got = load_global(dst)
        assert all(bitwise_equal(got[p], state[p]) for p, _ in tree.tensors())

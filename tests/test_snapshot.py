"""Host-local snapshots (issue 24): double buffering, hostile files, and recovery after a restart
with fewer hosts, bit for bit against the known global state."""

import json
import multiprocessing as mp
import os
import socket

import pytest
import torch

import tenplex
from tenplex.errors import CorruptShardError, StoreError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.snapshot import Snapshotter, read_head
from tenplex.snapshot_recover import load_snapshot, local_offers

CTX = mp.get_context("spawn")
OLD, NEW = ParallelConfig.parse("dp=2,tp=2,pp=1"), ParallelConfig.parse("dp=1,tp=2,pp=1")


def _tree(optimizer="distributed_adam"):
    return gpt_tree(GPTSpec(num_layers=2, hidden=64, heads=4, query_groups=4, ffn=128, vocab=1000,
                            optimizer=optimizer, dtype="bfloat16", bucket_numel=4096))


def _truth(tree, step):
    truth = random_state(tree, OLD, seed=step)
    truth["optimizer/step"] = step
    return truth


def _equal(state, tree, config, rank, truth):
    want = materialize(tree, truth, config, rank)
    assert sorted(want) == sorted(state)
    for p, t in want.items():
        assert bitwise_equal(state[p], t) if isinstance(t, torch.Tensor) else state[p] == t, p


def test_a_snapshot_reads_back_bit_for_bit_and_a_crash_mid_copy_keeps_the_last_one(tmp_path):
    tree = _tree()
    snaps = Snapshotter(tree, OLD, 1, root=str(tmp_path))
    for step in (1, 2):
        snaps.save(materialize(tree, _truth(tree, step), OLD, 1), step)
        snaps.wait()
    head = read_head(snaps.dir)
    assert head == {"latest": 1, "previous": 0}
    _equal(load_snapshot(str(tmp_path), "job", 1, 1, tree), tree, OLD, 1, _truth(tree, 2))
    _equal(load_snapshot(str(tmp_path), "job", 1, 0, tree), tree, OLD, 1, _truth(tree, 1))
    # the third snapshot dies mid-copy: the second is still the latest, whole
    bad = materialize(tree, _truth(tree, 3), OLD, 1)
    path = next(p for p, v in bad.items() if isinstance(v, torch.Tensor) and p.startswith("optimizer/"))
    bad[path] = _Exploding(bad[path])
    snaps.save(bad, 3)
    with pytest.raises(StoreError, match="snapshot of rank 1"):
        snaps.wait()
    assert read_head(snaps.dir) == {"latest": 1, "previous": None}   # slot 0 was being overwritten
    offers, skipped = local_offers(str(tmp_path), "job")
    assert [o[:3] for o in offers] == [[1, 2, 1]] and not skipped
    _equal(load_snapshot(str(tmp_path), "job", 1, 1, tree), tree, OLD, 1, _truth(tree, 2))


class _Exploding(torch.Tensor):
    """A tensor whose bytes cannot be read: the copy fails part-way through a slot."""

    @staticmethod
    def __new__(cls, t):
        return torch.Tensor._make_subclass(cls, t)

    def detach(self):
        raise OSError("disk gone mid-copy")


class _Stuck(torch.Tensor):
    """A tensor whose copy never ends: it says so in a file, then sleeps (its process gets killed)."""

    marker = ""

    @staticmethod
    def __new__(cls, t):
        return torch.Tensor._make_subclass(cls, t)

    def detach(self):
        import time
        open(_Stuck.marker, "w").close()
        time.sleep(120)


def _killed_mid_copy(root: str, marker: str) -> None:
    tree = _tree()
    snaps = Snapshotter(tree, OLD, 1, root=root)
    snaps.save(materialize(tree, _truth(tree, 1), OLD, 1), 1)
    snaps.wait()
    state = materialize(tree, _truth(tree, 2), OLD, 1)
    path = [p for p, v in state.items() if isinstance(v, torch.Tensor)][-1]
    _Stuck.marker = marker
    state[path] = _Stuck(state[path])
    snaps.save(state, 2)
    snaps.wait()


@pytest.mark.multiprocess
def test_a_process_killed_mid_copy_leaves_the_previous_snapshot_whole(tmp_path):
    import signal
    import time

    marker = str(tmp_path / "copying")
    proc = CTX.Process(target=_killed_mid_copy, args=(str(tmp_path), marker))
    proc.start()
    deadline = time.time() + 120
    while not os.path.exists(marker) and time.time() < deadline and proc.is_alive():
        time.sleep(0.05)
    assert os.path.exists(marker)
    os.kill(proc.pid, signal.SIGKILL)                 # mid-copy into slot 1
    proc.join()
    tree = _tree()
    folder = os.path.join(str(tmp_path), "job", "rank-1")
    assert read_head(folder) == {"latest": 0, "previous": None}
    assert os.path.getsize(os.path.join(folder, "slot-1.bin")) > 0      # the copy had begun
    offers, skipped = local_offers(str(tmp_path), "job")
    assert [o[:3] for o in offers] == [[1, 1, 0]] and not skipped       # only the whole one is offered
    _equal(load_snapshot(str(tmp_path), "job", 1, 0, tree), tree, OLD, 1, _truth(tree, 1))


def test_a_lying_snapshot_is_refused_with_what_was_expected(tmp_path):
    tree = _tree()
    snaps = Snapshotter(tree, OLD, 0, root=str(tmp_path))
    snaps.save(materialize(tree, _truth(tree, 1), OLD, 0), 1)
    snaps.wait()
    meta_path = os.path.join(snaps.dir, "slot-0.json")
    meta = json.loads(open(meta_path).read())
    entry = meta["tensors"][1]
    meta["tensors"][1] = [entry[0], entry[1], entry[2], entry[3] + 8, entry[4]]
    open(meta_path, "w").write(json.dumps(meta))
    with pytest.raises(CorruptShardError, match="aligned to 64"):
        load_snapshot(str(tmp_path), "job", 0, 0, tree)
    meta["tensors"][1] = [entry[0], "float32", entry[2], entry[3], entry[4]]
    open(meta_path, "w").write(json.dumps(meta))
    with pytest.raises(CorruptShardError, match=f"entry {entry[0]}: expected"):
        load_snapshot(str(tmp_path), "job", 0, 0, tree)
    with open(os.path.join(snaps.dir, "slot-0.bin"), "ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptShardError, match="bytes, found"):
        load_snapshot(str(tmp_path), "job", 0, 0, tree)
    open(meta_path, "w").write('{"rank": "0"}')
    offers, skipped = local_offers(str(tmp_path), "job")
    assert offers == [] and "expected 'config' of type dict" in skipped[0]


# -- a restart with one host fewer -------------------------------------------------------------

def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(rank, size, port):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)


def _old_job(rank, port, roots, url, steps, checkpoint_step, optimizer):
    """Old rank ``rank`` on host ``rank // 2``: snapshots of each step, the global checkpoint at one."""
    import torch.distributed as dist
    _group(rank, 4, port)
    tree = _tree(optimizer)
    snaps = Snapshotter(tree, OLD, rank, root=roots[rank // 2])
    for step in range(1, steps + 1):
        state = materialize(tree, _truth(tree, step), OLD, rank)
        snaps.save(state, step)
        if step == checkpoint_step:
            tenplex.save_distributed(state, tree, OLD, url)
        snaps.wait()
    dist.barrier()
    dist.destroy_process_group()


def _new_job(rank, port, root, url, out, optimizer):
    """After the restart: host A alone, two processes at NEW."""
    import torch.distributed as dist
    _group(rank, 2, port)
    tree = _tree(optimizer)
    done = tenplex.recover_from_snapshots(tree, NEW, root=root, store=url)
    _equal(done.state, tree, NEW, rank, _truth(tree, done.step))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step": done.step, "sources": done.sources, "store": done.report.store,
                       "sent": done.report.sent, "old": str(done.old), "rolled_back": done.rolled_back}, f)
    dist.destroy_process_group()


def _run(target, args_of, n):
    procs = [CTX.Process(target=target, args=args_of(r)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    return [p.exitcode for p in procs]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer,checkpoint_step,want_step", [
    ("distributed_adam", 2, 2),     # lost optimizer shards from the checkpoint of the snapshots' step
    ("distributed_adam", 1, 1),     # checkpoint older than the latest snapshots: the previous buffers
    ("adam", None, 2),              # replicas hold everything: no checkpoint needed
])
def test_restart_on_fewer_hosts_recovers_from_the_survivors_snapshots(tmp_path, optimizer, checkpoint_step,
                                                                       want_step):
    from tenplex.transform.planner import make_plan

    roots = [str(tmp_path / "host-a"), str(tmp_path / "host-b")]
    url = f"file://{tmp_path}/ckpt" if checkpoint_step else None
    port = _port()
    assert _run(_old_job, lambda r: (r, port, roots, url, 2, checkpoint_step, optimizer), 4) == [0] * 4
    # host B is gone: the restarted job runs two processes on host A
    out, port = str(tmp_path / "out.json"), _port()
    assert _run(_new_job, lambda r: (r, port, roots[0], url, out, optimizer), 2) == [0, 0]
    got = json.loads(open(out).read())
    assert got["step"] == want_step and got["sources"] == [0, 1] and got["old"] == str(OLD)
    assert not got["rolled_back"]
    plan = make_plan(_tree(optimizer), OLD, NEW, alive={0, 1}, store_fallback=url is not None)
    assert got["store"] == plan.totals.store          # only what no surviving snapshot holds
    assert (got["store"] > 0) == (optimizer == "distributed_adam")

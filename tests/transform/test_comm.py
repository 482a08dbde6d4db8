"""Unit tests, in one process: LocalComm, the fail-together guard over an in-memory store,
byte streams, and chunk sizes that follow a process's real peers."""

import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tenplex.errors import TransferError
from tenplex.ptree import ParallelConfig as P
from tenplex.ptree.layout import Layout, Split, Stage
from tenplex.ptree.tree import PTree, TensorLeaf
from tenplex.transform import make_plan
from tenplex.transform.comm import Comm, LocalComm
from tenplex.transform.distributed import execute_distributed
from tenplex.transform.guard import TransferGuard
from tenplex.transform.streams import ALIGN, MIN_CHUNK, Stream, chunk_shares, copy_bytes


# -- LocalComm -----------------------------------------------------------------------------

def test_local_comm_has_no_peers():
    comm = LocalComm()
    assert (comm.rank, comm.size, comm.store) == (0, 1, None)
    comm.start([], [])()                      # nothing to move: a no-op wait
    comm.exchange([], [])
    assert comm.all_gather_bytes(b"abc") == [b"abc"]
    comm.barrier()
    comm.abort()


def test_local_comm_refuses_peers_naming_them():
    with pytest.raises(TransferError, match=r"no peers; asked to exchange with \[1, 2\]"):
        LocalComm().start([(1, torch.zeros(1))], [(2, torch.zeros(1))])


def test_guard_without_peers_passes_errors_through_unchanged():
    seen = []

    class Recording(LocalComm):
        def _on_phase(self, phase):
            seen.append(phase)

    with pytest.raises(KeyError):
        with TransferGuard(Recording(), timeout=1) as guard:
            guard.phase("plan")
            assert guard.gather("inputs", b"x") == [b"x"]
            guard.wait(lambda: None)
            raise KeyError("model/x")
    assert seen == ["plan"]
    with pytest.raises(ValueError, match="timeout must be > 0"):
        TransferGuard(LocalComm(), timeout=0)
    with pytest.raises(ValueError, match="not one of"):
        with TransferGuard(LocalComm()) as guard:
            guard.gather("bogus", b"")


# -- the guard over an in-memory store, one thread per "process" ---------------------------

class StoreComm(Comm):
    """A process of a group whose only link is a shared in-memory store (no data plane)."""

    def __init__(self, rank, size, store):
        self.rank, self.size, self.store, self.name = rank, size, store, "threads"

    def start(self, sends, recvs):
        raise AssertionError("no data plane here")


def _threads(size, body, store=None):
    store = store or dist.HashStore()
    results = [None] * size

    def run(rank):
        try:
            results[rank] = ("ok", body(rank, StoreComm(rank, size, store)))
        except BaseException as exc:  # reported to the test
            results[rank] = ("error", exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a guard wait never ended"
    return results


def test_guard_gathers_in_process_order():
    def body(rank, comm):
        with TransferGuard(comm, timeout=5) as guard:
            first = guard.gather("inputs", f"p{rank}".encode())
            second = guard.gather("agree", bytes([rank]))
        return first, second

    results = _threads(3, body)
    for kind, (first, second) in results:
        assert kind == "ok" and first == [b"p0", b"p1", b"p2"] and second == [b"\0", b"\1", b"\2"]


def test_an_exception_on_one_process_reaches_every_other_as_the_same_transfer_error():
    def body(rank, comm):
        with TransferGuard(comm, timeout=30, what="reconfigure") as guard:
            guard.describe(f"process {rank} (old rank {rank})")
            guard.phase("local copy")
            if rank == 2:
                raise KeyError("model/layers/0/mlp/fc1/weight")
            guard.gather("confirm", b"")

    start = time.monotonic()
    results = _threads(4, body)
    assert time.monotonic() - start < 10          # not the 30 s timeout: the error is published
    messages = {str(exc) for kind, exc in results}
    assert all(kind == "error" and isinstance(exc, TransferError) for kind, exc in results)
    assert messages == {"reconfigure: process 2 (old rank 2) failed in phase 'local copy': "
                        "KeyError: 'model/layers/0/mlp/fc1/weight'"}
    assert isinstance(results[2][1].__cause__, KeyError)


def test_a_process_that_never_joins_fails_the_others_after_the_timeout():
    def body(rank, comm):
        if rank == 1:
            return "absent"
        with TransferGuard(comm, timeout=0.5) as guard:
            guard.gather("inputs", b"")

    start = time.monotonic()
    results = _threads(3, body)
    assert 0.5 <= time.monotonic() - start < 20
    errors = {str(exc) for kind, exc in results if kind == "error"}
    assert len(errors) == 1 and "process 1 never joined: no heartbeat for 0.5 s" in errors.pop()


def test_an_agreed_error_keeps_its_type_everywhere():
    from tenplex.errors import PlanError

    def body(rank, comm):
        with TransferGuard(comm, timeout=5) as guard:
            everyone = guard.gather("inputs", bytes([rank % 2]))
            with guard.agreeing():
                if len(set(everyone)) > 1:
                    raise PlanError("the processes disagree")

    results = _threads(3, body)
    assert all(kind == "error" and type(exc) is PlanError for kind, exc in results)


# -- byte streams ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_copy_bytes_moves_any_byte_range_of_a_strided_region(dtype):
    base = torch.arange(7 * 9 * 11, dtype=torch.float32).reshape(7, 9, 11).to(dtype)
    region = base[1:6, 2:8, 3:10]                 # strided on every axis
    raw = region.contiguous().view(torch.uint8).reshape(-1)
    rng = np.random.default_rng(0)
    for _ in range(50):
        a, b = sorted(rng.integers(0, raw.numel() + 1, size=2).tolist())
        flat = torch.zeros(b - a, dtype=torch.uint8)
        copy_bytes(region, a, b, flat, to_flat=True)
        assert torch.equal(flat, raw[a:b])
        target = torch.zeros_like(base)
        view = target[1:6, 2:8, 3:10]
        copy_bytes(view, a, b, flat, to_flat=False)
        assert torch.equal(view.contiguous().view(torch.uint8).reshape(-1)[a:b], raw[a:b])


def test_a_stream_cut_in_chunks_reassembles_bit_for_bit():
    src = [torch.randn(13, 17)[:, 3:14], torch.randn(5).to(torch.bfloat16), torch.randn(4, 4)[::2]]
    dst = [torch.zeros_like(t) for t in src]
    nbytes = np.array([t.numel() * t.element_size() for t in src])
    out = Stream([0, 1, 2], nbytes, 64, lambda r: src[r])
    back = Stream([0, 1, 2], nbytes, 64, lambda r: dst[r])
    for r in range(out.chunks):
        buf = torch.empty(out.chunk_size(r), dtype=torch.uint8)
        out.pack(r, buf)
        back.unpack(r, buf)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(src, dst))


def test_chunk_shares_follow_real_peers_not_the_world_size():
    budget = 64 << 20
    # 1024 processes, each sends to one peer only (a shift by one)
    src = np.arange(1024)
    shares = chunk_shares(src, (src + 1) % 1024, 1024, budget)
    assert (shares == budget // 4).all()          # 2 streams each (one out, one in)
    # one process that talks to 100 peers gets a smaller share; its peers keep theirs
    shares = chunk_shares(np.zeros(100, int), np.arange(1, 101), 1024, budget)
    assert shares[0] == budget // 200 // ALIGN * ALIGN and shares[1] == budget // 2
    assert chunk_shares(np.zeros(1, int), np.ones(1, int), 2, 100)[0] == MIN_CHUNK


# -- the executor's chunks at a large world size ------------------------------------------

class SendOnly(Comm):
    """Process 0 of a 64-process group; records the size of every buffer it sends."""

    def __init__(self):
        self.rank, self.size, self.sizes = 0, 64, []

    def start(self, sends, recvs):
        assert not recvs
        self.sizes += [t.numel() * t.element_size() for _, t in sends]
        return lambda: None


def test_execute_distributed_chunks_follow_the_plans_peers_at_64_processes():
    # 40 leaves of 200 KB each: below the direct-transfer size, so they are packed in chunks
    tree = PTree({f"w{i}": TensorLeaf((50, 1000), "float32", Layout(Stage.of_layer(0)))
                  for i in range(40)}, num_layers=1)
    plan = make_plan(tree, P(), P())
    local = {f"w{i}": torch.randn(50, 1000) for i in range(40)}
    src_of = [0] + [None] * 63                    # process 0 holds the old rank ...
    dst_of = [None, 0] + [None] * 62              # ... process 1 the new one: one peer each
    comm = SendOnly()
    budget = 8 << 20
    execute_distributed(plan, tree, local, comm, src_of, dst_of, memory_budget=budget)
    assert sum(comm.sizes) == 40 * 200_000
    assert max(comm.sizes) == budget // 2         # not budget / (4 * 63) -> 64 KiB


# -- rounds: two in flight, chunks capped -------------------------------------------------

class Timeline(Comm):
    """Process 0 of a two-process group that only sends: records when each batch is posted and
    when it is waited for, and the size of every message."""

    def __init__(self):
        self.rank, self.size, self.events, self.sizes = 0, 2, [], []

    def start(self, sends, recvs):
        assert not recvs
        k = sum(1 for e in self.events if e[0] == "post")
        self.events.append(("post", k))
        self.sizes += [t.numel() * t.element_size() for _, t in sends]
        return lambda: self.events.append(("wait", k))


def _packed_tree(leaves: int):
    """``leaves`` leaves of 200 KB: below the direct-transfer size, so they travel in chunks."""
    tree = PTree({f"w{i}": TensorLeaf((50, 1000), "float32", Layout(Stage.of_layer(0)))
                  for i in range(leaves)}, num_layers=1)
    return tree, {f"w{i}": torch.randn(50, 1000) for i in range(leaves)}


def test_the_next_round_is_posted_before_the_current_one_is_waited_for():
    # 8 MB in chunks of 256 KiB: round r + 1 is packed and posted while round r moves
    tree, local = _packed_tree(40)
    comm = Timeline()
    _, stats = execute_distributed(make_plan(tree, P(), P()), tree, local, comm, [0, None],
                                   [None, 0], memory_budget=512 << 10)
    assert stats.rounds > 4 and sum(comm.sizes) == 40 * 200_000
    at = {e: i for i, e in enumerate(comm.events)}
    for r in range(1, stats.rounds):
        assert at[("post", r)] < at[("wait", r - 1)], comm.events
        if r >= 2:  # round r reuses round r - 2's buffers: posted only once that one is done
            assert at[("post", r)] > at[("wait", r - 2)], comm.events


def test_chunks_stay_small_under_a_large_budget():
    # 12 MB to one peer with a 1 GiB budget: several chunks of at most MAX_CHUNK, not one of 12 MB
    from tenplex.transform.exchange import MAX_CHUNK

    tree, local = _packed_tree(60)
    comm = Timeline()
    _, stats = execute_distributed(make_plan(tree, P(), P()), tree, local, comm, [0, None],
                                   [None, 0], memory_budget=1 << 30)
    assert sum(comm.sizes) == 60 * 200_000
    assert max(comm.sizes) == stats.chunk == MAX_CHUNK and stats.rounds == 2
    assert stats.peak_buffer <= 2 * MAX_CHUNK
    # a stream shorter than its chunk share holds a buffer of its own length, not of the share
    tree, local = _packed_tree(1)
    _, stats = execute_distributed(make_plan(tree, P(), P()), tree, local, Timeline(), [0, None],
                                   [None, 0], memory_budget=1 << 30)
    assert stats.peak_buffer == stats.chunk == 200_000


# -- regions contiguous at one end only are used in place there ----------------------------

class Recorder(Comm):
    """One process of a two-process group: keeps what it sends, fills its receives in order
    from ``incoming`` (gloo matches a pair's messages in order; sizes must be equal)."""

    def __init__(self, rank, incoming=()):
        self.rank, self.size, self.sent, self.received = rank, 2, [], []
        self.incoming = list(incoming)

    def start(self, sends, recvs):
        self.sent += [t for _, t in sends]
        for _, t in recvs:
            data = self.incoming.pop(0)
            assert data.numel() == t.numel(), "message sizes differ between the two ends"
            t.copy_(data)
            self.received.append(t)
        return lambda: None


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("grow", [True, False])
def test_a_region_contiguous_at_one_end_only_is_sent_or_received_in_place(grow):
    # a row-parallel weight: tp 1 -> 2 makes [:, 512:] strided in the source and whole rows of
    # the target; tp 2 -> 1 makes it the whole source shard and strided in the target
    tree = PTree({"w": TensorLeaf((256, 1024), "float32",
                                  Layout(Stage.of_layer(0), split=Split(axis=1)))}, num_layers=1)
    full = torch.randn(256, 1024)
    src, dst = (P(tp=1), P(tp=2)) if grow else (P(tp=2), P(tp=1))
    src_of, dst_of = ([0, None], [0, 1]) if grow else ([0, 1], [0, None])
    plan = make_plan(tree, src, dst)
    sender, receiver = (0, 1) if grow else (1, 0)
    shards = {r: {"w": full[:, 512 * r: 512 * (r + 1)].contiguous() if src.tp == 2 else full}
              for r in range(src.world_size)}
    out_comm = Recorder(sender)
    execute_distributed(plan, tree, shards.get(src_of[sender]), out_comm, src_of, dst_of)
    in_comm = Recorder(receiver, out_comm.sent)
    out, _ = execute_distributed(plan, tree, shards.get(src_of[receiver]), in_comm, src_of, dst_of)
    want = full[:, 512:] if grow else full
    assert torch.equal(out["w"].view(torch.int32), want.contiguous().view(torch.int32))
    assert sum(t.numel() for t in out_comm.sent) == 256 * 512 * 4
    if grow:  # received straight into the new shard
        assert all(_storage(t) == _storage(out["w"]) for t in in_comm.received)
    else:     # sent straight from the old shard
        assert all(_storage(t) == _storage(shards[1]["w"]) for t in out_comm.sent)

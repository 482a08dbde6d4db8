"""Workers for tests/test_comm_gloo_devices.py: a gloo group of two devices per process.

Each worker writes ``result-<rank>.json``, or ``error-<rank>.txt`` with its traceback.
"""

import functools
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

import tenplex
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.transform.comm import PART_BYTES, TorchComm

from tests.helpers.rendezvous import init_group
from tests.store.helpers import assert_same_shards

# a state whose change tp=2 -> pp=2 moves messages of several PART_BYTES each way
SPEC = GPTSpec(num_layers=2, hidden=512, heads=8, query_groups=8, ffn=2048, vocab=8192, swiglu=False,
               tied=False, dtype="bfloat16", optimizer="adam", make_vocab_size_divisible_by=128)
SRC, DST = P(dp=1, tp=2), P(dp=1, tp=1, pp=2)


class CountingComm(TorchComm):
    """A TorchComm that records into how many parts each message it posts was cut."""

    def __init__(self):
        super().__init__()
        self.cuts = []

    def _parts(self, tensor):
        parts = super()._parts(tensor)
        self.cuts.append(len(parts))
        return parts


def _two_devices(body):
    """Run ``body(rank, out_dir)`` in a gloo group of two devices per process (``lo,lo``);
    a failure is written to ``error-<rank>.txt`` and raised."""
    @functools.wraps(body)
    def worker(rank: int, rendezvous: str, out_dir: str) -> None:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo,lo"
        try:
            init_group(rank, 2, rendezvous, timeout=60)
            result = body(rank, out_dir)
            if result is not None:
                with open(f"{out_dir}/result-{rank}.json", "w") as f:
                    json.dump(result, f)
        except BaseException:
            with open(f"{out_dir}/error-{rank}.txt", "w") as f:
                f.write(traceback.format_exc())
            raise
    return worker


def _data(rank: int, nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))


@_two_devices
def run(rank: int, out_dir: str) -> dict:
    """An exchange of a message of two parts and a small one, then a live change; checked bit for bit."""
    peer = 1 - rank
    comm = CountingComm()
    big, small = _data(rank, 2 * PART_BYTES + 3), _data(rank, 100).view(torch.bfloat16)
    got_big, got_small = torch.empty_like(big), torch.empty_like(small)
    comm.exchange([(peer, big), (peer, small)], [(peer, got_big), (peer, got_small)])
    exchange = {"devices": comm.devices, "cuts": comm.cuts,
                "equal": bool(torch.equal(got_big, _data(peer, 2 * PART_BYTES + 3))
                              and torch.equal(got_small.view(torch.uint8), _data(peer, 100)))}
    tree = gpt_tree(SPEC)
    state = random_state(tree, SRC, 3)
    comm.cuts = []
    new, report = tenplex.reconfigure(materialize(tree, state, SRC, rank), tree, SRC, DST, comm=comm,
                                      renumber=False)
    assert_same_shards(materialize(tree, state, DST, rank), new, f"process {rank}")
    dist.destroy_process_group()
    return {"exchange": exchange, "live": {"cuts": max(comm.cuts), "sent": report.sent, "equal": True}}


@_two_devices
def abort_run(rank: int, out_dir: str) -> dict | None:
    """Process 1 aborts while process 0 waits on a receive on each of the two gloo devices.

    Process 1 stays alive 6 s after its abort (a process that failed and reports), so the
    receives fail only if its abort closed the connections of every device: one it missed
    would fail only when process 1 exits. The group is broken afterwards (not destroyed).
    """
    comm = TorchComm()
    if rank == 1:
        comm.barrier()
        comm.abort()
        time.sleep(6)
        return None
    works = [dist.irecv(torch.empty(8, dtype=torch.uint8), src=1, tag=k) for k in range(2)]
    comm.barrier()
    start, seconds = time.monotonic(), []
    for work in works:
        try:
            work.wait()
        except RuntimeError:  # gloo: the connection was closed
            pass
        seconds.append(time.monotonic() - start)
    return {"devices": comm.devices, "seconds": seconds}

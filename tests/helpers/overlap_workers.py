"""Workers for ``test_store_reads_overlap.py``: a recovery whose store reads can only finish once a
round of point-to-point transfers has landed.

Process 0 survives (old rank 0 of ``dp=1,tp=2``); process 1 replaces the lost old rank 1. Process
1 receives the tp-replicated leaves from process 0 and reads its tp shards from the store. Its
store reads are wrapped to wait until one of its receive rounds has completed: if the reads ran
before the first round (one after another on the calling thread), they would wait in vain.
"""

import json
import os
import threading
import traceback

import torch.distributed as dist

import tenplex
import tenplex.elastic as elastic
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.transform.comm import TorchComm
from tests.helpers.rendezvous import init_group

TREE = gpt_tree(GPTSpec(num_layers=2, hidden=64, heads=4, query_groups=4, ffn=128, vocab=100,
                        dtype="bfloat16", optimizer="adam"))
CONFIG = P(dp=1, tp=2)
SEED = 3
WAIT = 30.0   # seconds a store read waits for a round; far beyond a round's time


class SignallingComm(TorchComm):
    """TorchComm that sets ``received`` once a round with receives has completed."""

    def __init__(self):
        super().__init__()
        self.received = threading.Event()

    def start(self, sends, recvs):
        wait = super().start(sends, recvs)

        def done():
            wait()
            if recvs:
                self.received.set()
        return done


def state():
    return random_state(TREE, CONFIG, SEED)


def worker(rank: int, rendezvous: str, url: str, out: str) -> None:
    try:
        init_group(rank, 2, rendezvous)
        comm = SignallingComm()
        read_region, waits = elastic.read_region, []

        def read_after_a_round(reader, path, box):
            # after one read waited in vain, the others do not wait again
            waits.append(comm.received.wait(WAIT) if all(waits) else False)
            return read_region(reader, path, box)

        elastic.read_region = read_after_a_round
        truth = state()
        mine = materialize(TREE, truth, CONFIG, 0) if rank == 0 else None
        new, report = tenplex.recover(mine, TREE, CONFIG, CONFIG, lost={1}, store=url, comm=comm,
                                      old_rank=0 if rank == 0 else None, timeout=120)
        want = materialize(TREE, truth, CONFIG, rank)
        exact = sorted(new) == sorted(want) and all(
            bitwise_equal(want[p], new[p]) if hasattr(want[p], "dtype") else want[p] == new[p] for p in want)
        result = {"exact": exact, "reads": len(waits), "all_waited_for_a_round": all(waits),
                  "received": comm.received.is_set(), "store": report.store, "sent": report.sent}
        dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"overlap-{rank}.json"), "w") as f:
        json.dump(result, f)

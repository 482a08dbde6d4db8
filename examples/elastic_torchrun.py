"""A torchrun job whose parallel config changes, and which loses a worker, without a checkpoint.

Run:  torchrun --standalone --nproc_per_node=4 examples/elastic_torchrun.py

1. Four workers hold a GPT-style state at dp=2,tp=2 and "train" (bump the step).
2. Live change to dp=1,tp=4 inside the same processes: `tenplex.reconfigure`.
3. Stage the state to a host-memory store (as before an elastic restart), and
   load one rank's shards back under another config: `tenplex.stage` / `tenplex.load`.
4. Rank 3's state is lost: the others rebuild it from replicas with `tenplex.recover`
   (rank 3 stands in for a replacement that starts empty).
Every step is checked against the known global state, bit for bit.
"""

import os
import tempfile

import torch
import torch.distributed as dist

import tenplex
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig, materialize
from tenplex.ptree.shards import bitwise_equal


def check(state, tree, config, rank, truth):
    expected = materialize(tree, truth, config, rank)
    assert all(bitwise_equal(state[p], t) for p, t in expected.items() if isinstance(t, torch.Tensor))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tree = gpt_tree(GPTSpec(num_layers=2, hidden=64, heads=4, query_groups=4, ffn=128, vocab=1000,
                            optimizer="adam", dtype="bfloat16"))
    old, new = ParallelConfig.parse("dp=2,tp=2"), ParallelConfig.parse("dp=1,tp=4")
    truth = random_state(tree, old, seed=0)
    state = materialize(tree, truth, old, rank)
    state["optimizer/step"] = 100

    state, report = tenplex.reconfigure(state, tree, old, new, report=True)
    check(state, tree, new, rank, truth)
    if rank == 0:
        print(f"live {old} -> {new}: sent {report.sent} bytes (lower bound {report.lower_bound}) "
              f"in {report.seconds:.3f} s")

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="tenplex-example-", dir=shm) if rank == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder)
    url = f"file://{holder[0]}/step-100"
    tenplex.stage(state, tree, new, url)
    restarted = tenplex.load(url, ParallelConfig.parse("dp=2,tp=1,pp=2"), rank)
    check(restarted, tree, ParallelConfig.parse("dp=2,tp=1,pp=2"), rank, truth)
    if rank == 0:
        print(f"staged at {new} to {url}; rank 0 loaded its shards at dp=2,tp=1,pp=2")

    back = tenplex.reconfigure(state, tree, new, old)          # to dp=2,tp=2 again, with replicas
    back["optimizer/step"] = 130                               # 30 more steps since the staged store
    lost = {3}
    survivor_state = None if rank in lost else back
    recovered, rep = tenplex.recover(survivor_state, tree, old, old, lost=lost, store=url,
                                     step_path="optimizer/step")
    check(recovered, tree, old, rank, truth)
    if rank == 0:
        print(f"recovered rank 3 from its dp replica: {rep.sent} bytes sent, {rep.store} read "
              f"from the store; {rep.steps_kept} steps kept")
    dist.barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(holder[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A torchrun job whose parallel config changes, and which loses a worker, without a checkpoint.

Run:  torchrun --standalone --nproc_per_node=4 examples/elastic_torchrun.py

1. Four workers hold a GPT-style state at dp=2,tp=2 and "train" (bump the step).
2. Live change to dp=1,tp=4 inside the same processes: `tenplex.reconfigure`.
3. Save the state with every worker writing its own shards (as before an elastic
   restart), and load one rank's shards back under another config:
   `tenplex.save_distributed` / `tenplex.load`. The store must be one every new
   worker can read (a shared filesystem or s3://); all workers here share one host.
4. Rank 1's state is lost. The survivors are renumbered (as torchrun does after a
   restart): each declares the old rank it held (`old_rank=`), and the process
   that takes the last place starts empty, as a replacement. `tenplex.recover`
   rebuilds every shard from the dp replicas.
Every step is checked against the known global state, bit for bit.
"""

import os
import shutil
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

    state, report = tenplex.reconfigure(state, tree, old, new, timeout=60)
    me = report.dst_of[rank]                        # renumbered to keep the most bytes in place
    check(state, tree, new, me, truth)
    if rank == 0:
        print(f"live {old} -> {new}: sent {report.sent} bytes (lower bound {report.lower_bound}) "
              f"in {report.seconds:.3f} s")

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    holder = [tempfile.mkdtemp(prefix="tenplex-example-", dir=shm) if rank == 0 else None]
    dist.broadcast_object_list(holder)
    url = f"file://{holder[0]}/step-100"
    tenplex.save_distributed(state, tree, new, url, rank=me)
    restarted = tenplex.load(url, ParallelConfig.parse("dp=2,tp=1,pp=2"), rank)
    check(restarted, tree, ParallelConfig.parse("dp=2,tp=1,pp=2"), rank, truth)
    if rank == 0:
        print(f"saved at {new} to {url}; rank 0 loaded its shards at dp=2,tp=1,pp=2")

    back, rep = tenplex.reconfigure(state, tree, new, old, src_of=report.dst_of)  # dp=2,tp=2 again
    check(back, tree, old, rep.dst_of[rank], truth)
    # Old rank 1 is lost, after 30 more steps. torchrun renumbers the survivors (old ranks
    # 0, 2, 3) as processes 0, 1, 2; process 3 is the replacement. Here each process takes the
    # state its survivor would hold: in a real job every survivor keeps its own.
    survivors = [0, 2, 3]
    old_rank = survivors[rank] if rank < len(survivors) else None
    held = None
    if old_rank is not None:
        held = materialize(tree, truth, old, old_rank)
        held["optimizer/step"] = 130
    recovered, rep = tenplex.recover(held, tree, old, old, lost={1}, old_rank=old_rank, store=url,
                                     step_path="optimizer/step")
    check(recovered, tree, old, rank, truth)
    if rank == 0:
        print(f"recovered lost rank 1 with renumbered survivors: {rep.sent} bytes sent, "
              f"{rep.store} read from the store; {rep.steps_kept} steps kept")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(holder[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

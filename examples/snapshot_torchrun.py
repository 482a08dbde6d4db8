"""Host-local snapshots that outlive torchrun's workers: recovery after a host is lost.

Run on two hosts (or two agents on one machine, each with its own snapshot folder):

    TENPLEX_SNAPSHOT_DIR=/dev/shm/tenplex torchrun --nnodes=1:2 --nproc_per_node=2 --max_restarts=1 \\
        --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 examples/snapshot_torchrun.py OUT

1. Four workers (two per host) hold a GPT-style state at dp=2,tp=2 with a
   distributed Adam (optimizer state dp-sharded: each host holds half of it).
   Each step changes every tensor elementwise (a stand-in for training whose
   result does not depend on the parallel config, so every state is known
   exactly). Each worker snapshots its state into its host's shared memory
   every step (``tenplex.Snapshotter``), and the job saves a global
   checkpoint at step ``CHECKPOINT`` (``tenplex.save_distributed``, to OUT).
2. After step ``STEPS`` the workers wait until OUT/host-lost exists; one
   host is lost first (its agent and workers killed). The other host's next
   collective fails, and torchrun restarts its workers at the smaller world
   (``--nnodes=1:2``).
3. The restarted workers (dp=1,tp=2) call ``tenplex.recover_from_snapshots``:
   the state comes from the surviving host's snapshots; only the lost host's
   optimizer half is read from the checkpoint. The snapshots of the newest
   step whose gaps the checkpoint can fill (its own step) are used.
4. Training goes on to ``FINAL``; the state is checked bit for bit against
   the run without a failure after every step. The last line is JSON.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import tenplex
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig, materialize
from tenplex.ptree.shards import bitwise_equal

CONFIGS = {4: "dp=2,tp=2,pp=1", 2: "dp=1,tp=2,pp=1"}
STEPS, CHECKPOINT, FINAL = 3, 2, 5


def train(state: dict, step: int) -> dict:
    """One "step": every float tensor x becomes x * (1 + step / 8), elementwise, so the result is the
    same on any config (and padding stays zero)."""
    out = {p: v * (1 + step / 8) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
           for p, v in state.items()}
    out["optimizer/step"] = step
    return out


def truth(tree, step: int) -> dict:
    """The global state after ``step`` steps of the run without a failure."""
    state = random_state(tree, ParallelConfig.parse(CONFIGS[4]), seed=0)
    state["optimizer/step"] = 0
    for k in range(1, step + 1):
        state = train(state, k)
    return state


def same(state, tree, config, rank, step) -> bool:
    want = materialize(tree, truth(tree, step), config, rank)
    return all(bitwise_equal(state[p], t) if isinstance(t, torch.Tensor) else state[p] == t for p, t in want.items())


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ParallelConfig.parse(CONFIGS[world])
    url = f"file://{out}/checkpoint"
    tree = gpt_tree(GPTSpec(num_layers=2, hidden=64, heads=4, query_groups=4, ffn=128, vocab=1024,
                            optimizer="distributed_adam", dtype="bfloat16", bucket_numel=4096))
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        state = materialize(tree, truth(tree, 0), config, rank)
        snaps = tenplex.Snapshotter(tree, config, rank)     # this host's /dev/shm (TENPLEX_SNAPSHOT_DIR)
        for step in range(1, STEPS + 1):
            snaps.wait()                                     # the last snapshot is whole before the state changes
            state = train(state, step)
            snaps.save(state, step)                          # copies while the next step computes
            if step == CHECKPOINT:
                tenplex.save_distributed(state, tree, config, url)
        snaps.wait()
        dist.barrier()
        open(os.path.join(out, f"ready-{rank}"), "w").close()
        while not os.path.exists(os.path.join(out, "host-lost")):   # the test kills one host, then says so
            time.sleep(0.2)
        dist.barrier()                                       # fails on the surviving host: torchrun restarts it
        raise RuntimeError("the barrier should have failed: no host was lost")
    done = tenplex.recover_from_snapshots(tree, config, store=url)
    checks = [same(done.state, tree, config, rank, done.step)]
    state = done.state
    for step in range(done.step + 1, FINAL + 1):
        state = train(state, step)
        checks.append(same(state, tree, config, rank, step))
    results = [None] * world
    dist.all_gather_object(results, all(checks))
    if rank == 0:
        from tenplex.transform.planner import make_plan
        lost = make_plan(tree, done.old, config, alive=set(done.sources), store_fallback=True).totals.store
        print(f"restart at {config}: recovered step {done.step} from the snapshots of old ranks "
              f"{done.sources} ({done.report.sent} bytes sent, {done.report.store} read from the checkpoint)")
        print(json.dumps({"recovered_step": done.step, "sources": done.sources, "store_bytes": done.report.store,
                          "lost_bytes": lost, "bit_exact": all(results), "final_step": FINAL}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

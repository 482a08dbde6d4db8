"""Worker processes for save_distributed: each process writes its own rank's shards.

Every worker rebuilds the same global state (fixed seed), saves its rank's
shards under ``config`` to its URL, and reports the outcome. A worker may be
given its own URL (a per-host directory), or a fault at a phase.
"""

import json
import os
import traceback

import torch.distributed as dist

import tenplex
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.transform.comm import TorchComm

from tests.helpers.rendezvous import init_group


SPEC = GPTSpec(num_layers=2, hidden=64, heads=4, query_groups=2, ffn=128, vocab=300, swiglu=True,
               tied=True, dtype="bfloat16", optimizer="distributed_adam", bucket_numel=5000)
TREE = gpt_tree(SPEC)
SEED = 7


def truth(config):
    return random_state(TREE, config, SEED)


class FailAt(TorchComm):
    def __init__(self, phase):
        super().__init__()
        self.phase = phase

    def _on_phase(self, phase):
        if phase == self.phase:
            raise OSError(f"injected: disk full in phase {phase}")


def stage(rank: int, world: int, rendezvous: str, config_text: str, url: str, storage_options,
          block: int, fail_phase: str | None, out_dir: str) -> None:
    try:
        init_group(rank, world, rendezvous)
        config = P.parse(config_text)
        local = materialize(TREE, truth(config), config, rank)
        comm = FailAt(fail_phase) if fail_phase and rank == world - 1 else None
        try:
            tenplex.save_distributed(local, TREE, config, url, comm=comm, block=block,
                                     storage_options=storage_options, timeout=20)
            outcome = {"error": None}
        except Exception as exc:  # reported: the test compares processes
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        with open(os.path.join(out_dir, f"stage-{rank}.json"), "w") as f:
            json.dump(outcome, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"crash-{rank}.json"), "w") as f:
            json.dump(traceback.format_exc(), f)
        raise

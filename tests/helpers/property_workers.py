"""A pool of 4 gloo processes that run the multi-process differential property, example by example.

For an example ``(spec, A, B, lost, block, seed, root)`` every worker:

1. ``save_distributed``: the processes of A's ranks save their shards of the
   global state ``x`` at A, with checksum blocks of ``block`` bytes;
2. ``load``: every rank of B loads its shards from that checkpoint;
3. ``recover``: the survivors (A's ranks not in ``lost``, renumbered 0, 1, ...
   as torchrun does, each declaring its old rank) and empty replacements
   rebuild B's shards, reading what no survivor holds from the checkpoint.

Both results must equal ``materialize(x, B, r)`` bit for bit. Each step runs
in its own subgroup of the world group, so a failed example leaves the pool usable.
"""

import traceback

import torch
import torch.distributed as dist

import tenplex
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.ptree.shards import bitwise_equal
from tenplex.ptree.tree import Scope

from tests.helpers.rendezvous import init_group


def compare(tree, got, x, config, rank) -> list[str]:
    """Differences between ``got`` and ``materialize(x, config, rank)``; values of coordinates
    the source config did not have are ``None``."""
    want = materialize(tree, x, config, rank)
    problems = [f"leaves differ: {sorted(set(got) ^ set(want))}"] if set(got) != set(want) else []
    for path, value in want.items():
        if path not in got:
            continue
        leaf = tree[path]
        if isinstance(value, torch.Tensor):
            if not bitwise_equal(got[path], value):
                problems.append(f"{path} differs")
        elif leaf.scope is Scope.GLOBAL:
            if got[path] != value:
                problems.append(f"value {path}: {got[path]!r} != {value!r}")
        elif got[path] not in (value, None):
            problems.append(f"value {path}: {got[path]!r} != {value!r}")
    return problems


def run_example(rank: int, example: dict) -> list[str]:
    spec, seed = GPTSpec(**example["spec"]), example["seed"]
    tree = gpt_tree(spec)
    a, b = P.parse(example["a"]), P.parse(example["b"])
    lost, url = set(example["lost"]), example["url"]
    x = random_state(tree, a, seed)
    problems = []
    # 1. save_distributed at A, by the processes of A's ranks
    group = dist.new_group(list(range(a.world_size)))
    if rank < a.world_size:
        tenplex.save_distributed(materialize(tree, x, a, rank), tree, a, url, group=group,
                                 block=example["block"], timeout=30)
    dist.destroy_process_group(group)
    dist.barrier()
    # 2. load at B
    if rank < b.world_size:
        problems += [f"load: {p}" for p in compare(tree, tenplex.load(url, b, rank), x, b, rank)]
    # 3. recover A -> B: renumbered survivors, then replacements
    survivors = [r for r in range(a.world_size) if r not in lost]
    n = max(len(survivors), b.world_size)
    group = dist.new_group(list(range(n)))
    if rank < n:
        old = survivors[rank] if rank < len(survivors) else None
        state = materialize(tree, x, a, old) if old is not None else None
        out, rep = tenplex.recover(state, tree, a, b, lost=lost, old_rank=old, store=url,
                                   group=group, memory_budget=1 << 16, timeout=30)
        if rank < b.world_size:
            problems += [f"recover: {p}" for p in compare(tree, out, x, b, rank)]
        else:
            problems += [] if out is None else ["recover: a process without a new rank got a state"]
    dist.destroy_process_group(group)
    dist.barrier()
    return problems


def serve(rank: int, rendezvous: str, inbox, outbox) -> None:
    init_group(rank, 4, rendezvous)
    torch.set_num_threads(1)
    while (example := inbox.get()) is not None:
        try:
            outbox.put((rank, run_example(rank, example)))
        except Exception:  # reported to the test, which fails the example
            outbox.put((rank, [traceback.format_exc()]))
    dist.destroy_process_group()

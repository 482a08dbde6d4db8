"""Workers for the live megatron-core tests: a real GPT (bf16, DDP, DistributedOptimizer) through changes.

Each worker is one job process (``process``), started with torch.multiprocessing
(spawn); the test process hosts the key-value store the job's groups are
formed through. Results are JSON files in ``out``.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback

import torch

from tenplex.ptree.config import ParallelConfig
from tenplex.transform.comm import TorchComm

from tenplex_megatron.model.config import MegatronConfig

MODEL = MegatronConfig(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256,
                       make_vocab_size_divisible_by=64, untie_embeddings_and_output_weights=True,
                       position_embedding_type="rope", max_position_embeddings=32, params_dtype="bfloat16")
SEED = 1234
STEPS = 2
SEQUENCE = ["dp=1,tp=2,pp=1", "dp=1,tp=2,pp=1", "dp=2,tp=2,pp=1", "dp=2,tp=1,pp=1", "dp=2,tp=1,pp=2",
            "dp=2,tp=1,pp=1", "dp=1,tp=1,pp=1", "dp=1,tp=2,pp=1", "dp=2,tp=2,pp=1", "dp=1,tp=1,pp=2",
            "dp=4,tp=1,pp=1"]
"""Identity; dp doubled; tp halved; pp doubled; pp halved; dp halved; tp doubled; dp doubled; a mixed
change that shrinks the world (4 -> 2), then one that grows it (2 -> 4)."""
PLAIN_SEQUENCE = ["dp=1,tp=2,pp=1", "dp=1,tp=2,pp=1", "dp=2,tp=1,pp=1", "dp=1,tp=1,pp=2", "dp=2,tp=2,pp=1"]
"""With the plain mixed-precision optimizer (no distributed optimizer): identity; tp halved and dp
doubled; dp halved and pp doubled; pp halved, tp and dp doubled (the world grows 2 -> 4)."""


def options(distributed: bool = True):
    from tenplex_megatron.demo.job import JobOptions
    return JobOptions(global_batch=8, micro_batch=2, seq=32, lr=3e-3, seed=SEED,
                      distributed_optimizer=distributed)


class CountingComm(TorchComm):
    """torch.distributed point-to-point that counts the bytes this process sends."""

    sent = 0

    def start(self, sends, recvs):
        CountingComm.sent += sum(t.numel() * t.element_size() for _, t in sends)
        return super().start(sends, recvs)


def write(out: str, name: str, obj) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, os.path.join(out, f"{name}.json"))


def setup(process: int, port: int):
    from tenplex_megatron import cpu_shim
    cpu_shim.apply_optimizer_patches()
    torch.set_num_threads(1)
    import torch.distributed as dist
    from tenplex_megatron.live.group import Membership
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    return Membership(store, process, timeout=datetime.timedelta(seconds=120))


def start(config, corpus, steps: int, tree=None, opts=None):
    """Fresh parts at ``config`` from the step-0 state; ``steps`` steps; ``(parts, losses)``."""
    import torch.distributed as dist
    from tenplex.ptree.shards import materialize
    from tenplex_megatron.demo.job import build, initial_state, live_spec, train_step
    from tenplex_megatron.live.state import import_state

    opts = opts or options()
    spec = live_spec(MODEL, opts)
    tree = tree or spec.tree(config)
    parts = build(MODEL, opts, config)
    import_state(materialize(tree, initial_state(tree, SEED), config, dist.get_rank()), *parts,
                 spec=spec, tree=tree)
    return parts, [train_step(parts, corpus, k * opts.global_batch, opts)[0] for k in range(steps)]


def misuse(parts, spec, config) -> dict:
    """What export, import and change say when used wrongly (nothing is changed by them)."""
    import dataclasses

    from tenplex.errors import TenplexError
    from tenplex_megatron.live.change import change
    from tenplex_megatron.live.state import export_state, import_state

    def error(call):
        try:
            call()
        except TenplexError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    good = export_state(*parts, spec=spec, consumed_samples=0)
    broken = {p: v for p, v in good.items() if p != "optimizer/exp_avg/output_layer/weight"}
    before = {p: v.clone() for p, v in export_state(*parts, spec=spec, consumed_samples=0).items()
              if isinstance(v, torch.Tensor)}
    out = {
        "not distributed": error(lambda: export_state(*parts, spec=dataclasses.replace(
            spec, distributed_optimizer=False), consumed_samples=0)),
        "dtype": error(lambda: export_state(*parts, spec=dataclasses.replace(
            spec, model=dataclasses.replace(spec.model, params_dtype="float32")), consumed_samples=0)),
        "missing leaf": error(lambda: import_state(broken, *parts, spec=spec)),
        "world without membership": error(lambda: change(parts, None, spec=spec, old=config,
                                                         new=ParallelConfig(dp=2, tp=2), consumed_samples=0,
                                                         seed=SEED)),
    }
    after = export_state(*parts, spec=spec, consumed_samples=0)
    out["untouched"] = all(torch.equal(before[p], after[p]) for p in before)
    return out


def assembled(tree, config, directory: str) -> dict:
    from tenplex.ptree.shards import assemble
    shards = {r: torch.load(os.path.join(directory, f"rank-{r}.pt"), weights_only=True)
              for r in range(config.world_size)}
    return assemble(tree, config, shards, padded=True)


def sequence(process: int, port: int, out: str, configs=tuple(SEQUENCE), distributed: bool = True) -> None:
    """The change sequence ``configs``; per change, the post-change state and steps against a static
    run at the new config. ``distributed``: megatron-core's DistributedOptimizer, else its plain
    mixed-precision optimizer."""
    try:
        _sequence(process, port, out, configs, distributed)
    except BaseException:
        write(out, f"error-{process}", traceback.format_exc())
        raise


def _sequence(process: int, port: int, out: str, configs, distributed: bool) -> None:
    import torch.distributed as dist
    from tenplex.ptree.shards import materialize
    from tenplex_megatron.demo.data import load_corpus
    from tenplex_megatron.demo.job import build, live_spec, train_step
    from tenplex_megatron.live.change import change
    from tenplex_megatron.live.group import destroy_parallel_state, init_parallel_state
    from tenplex_megatron.live.state import export_state, import_state

    membership = setup(process, port)
    opts = options(distributed)
    spec = live_spec(MODEL, opts)
    corpus = load_corpus(opts.seq, 1 << 20, SEED)
    configs = [ParallelConfig.parse(c) for c in configs]
    parts, consumed, rows = None, 0, []
    if membership.form(configs[0].world_size):
        init_parallel_state(configs[0], SEED)
        _, uninterrupted = start(configs[0], corpus, 2 * STEPS, opts=opts)
        parts, losses = start(configs[0], corpus, STEPS, opts=opts)
        consumed = STEPS * opts.global_batch
        if process == 0:
            write(out, "start", {"uninterrupted": uninterrupted, "losses": losses,
                                 "errors": misuse(parts, spec, configs[0]) if distributed else None})
    for i, (old, new) in enumerate(zip(configs, configs[1:])):
        tree = spec.tree(old, new)
        snapshot = os.path.join(out, f"change-{i}")
        if parts is not None:
            os.makedirs(snapshot, exist_ok=True)
            torch.save(export_state(*parts, spec=spec, consumed_samples=consumed, tree=tree),
                       os.path.join(snapshot, f"rank-{dist.get_rank()}.pt"))
            dist.barrier()
        CountingComm.sent = 0
        done = change(parts, lambda c: build(MODEL, opts, c), spec=spec, old=old, new=new,
                      consumed_samples=consumed, seed=SEED, membership=membership, comm=CountingComm)
        parts = done.parts
        if done.report is not None:
            write(out, f"sent-{i}-{process}", CountingComm.sent)
        if parts is None:
            continue
        rank = dist.get_rank()
        consumed = done.imported.consumed_samples
        # the post-change state, bit for bit, against the pre-change state assembled and cut for `new`
        want = materialize(tree, assembled(tree, old, snapshot), new, rank)
        got = export_state(*parts, spec=spec, consumed_samples=consumed, tree=tree)
        state_equal = sorted(want) == sorted(got) and all(
            torch.equal(want[p], got[p]) if isinstance(want[p], torch.Tensor) else want[p] == got[p]
            for p in want if p != "rng/states")
        # a static run at `new` from the same state, built and imported without tenplex.reconfigure
        reference = build(MODEL, opts, new)
        import_state(want, *reference, spec=spec, tree=tree)
        ref = [train_step(reference, corpus, consumed + k * opts.global_batch, opts)[0] for k in range(STEPS)]
        del reference
        losses, samples = [], []
        for k in range(STEPS):
            loss, idx = train_step(parts, corpus, consumed, opts)
            losses.append(loss)
            samples.append(idx)
            consumed += opts.global_batch
        rows.append({"change": i, "old": str(old), "new": str(new), "losses": losses, "reference": ref,
                     "state_equal": state_equal, "consumed_before": done.imported.consumed_samples,
                     "samples": samples, "step": done.imported.step,
                     "sent": done.report.sent, "lower_bound": done.report.lower_bound,
                     "planned_moved": done.report.planned_moved, "seconds": done.seconds,
                     "dst_of": done.report.dst_of})
    if parts is not None:
        destroy_parallel_state()
    if process == 0:
        write(out, "sequence", rows)
    write(out, f"done-{process}", True)

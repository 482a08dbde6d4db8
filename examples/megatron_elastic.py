"""A megatron-core GPT training loop (``pretrain_gpt`` style) whose (dp, tp, pp) changes while it trains.

Run:  torchrun --standalone --nproc_per_node=4 examples/megatron_elastic.py [--dtype bfloat16]

megatron-core builds the model, its DDP and distributed optimizer, and runs
its own pipeline schedule. Between phases the running job moves to the next
(dp, tp, pp) with one call, ``tenplex_megatron.live.change``: the state goes
from process to process (no checkpoint), workers a phase does not need are
parked. A static run at the first config follows, for comparison. The lines
tenplex adds are marked ``# tenplex``; docs/megatron.md shows them.

The last line printed is one JSON object: ``max_loss_diff`` (elastic against
static, per step), ``samples_match`` (the same global samples in the same
order), ``reconfig_s`` (wall time of all changes, export to import, on rank
0), ``moved_over_lower_bound`` (bytes moved over the planner's lower bound) and
``moved_over_placement_bound`` (over the placement-free bound: no numbering of the
processes moves less; ``live.change`` renumbers them to keep the most bytes in place).
"""

import argparse
import json

import torch
import torch.distributed as dist

if not torch.cuda.is_available():   # megatron-core on a CPU-only machine (gloo)
    from tenplex_megatron import cpu_shim
    cpu_shim.apply_optimizer_patches()

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from tenplex.ptree import ParallelConfig
from tenplex_megatron import live
from tenplex_megatron.model.config import MegatronConfig

SCHEDULE = [("dp=2,tp=2,pp=1", 4), ("dp=1,tp=1,pp=2", 4), ("dp=1,tp=2,pp=2", 4), ("dp=4,tp=1,pp=1", 4)]
VOCAB, SEQ, GLOBAL_BATCH, MICRO_BATCH, LR = 128, 32, 8, 2, 3e-3


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def setup_model_and_optimizer(config: ParallelConfig, cfg: MegatronConfig):
    """What Megatron-LM's ``setup_model_and_optimizer`` returns: model chunks, optimizer, scheduler."""
    dtype = getattr(torch, cfg.params_dtype)
    tc = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size, tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    model = GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=cfg.padded_vocab(config.tp), max_sequence_length=SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    if tc.bf16:
        model = Float16Module(tc, model)
    ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, bf16=tc.bf16, params_dtype=dtype, use_distributed_optimizer=True,
        clip_grad=1.0), [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=1000,
        lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=1000, wd_incr_style="constant")
    tc.finalize_model_grads_func, tc.grad_scale_func = finalize_model_grads, optimizer.scale_loss
    return [ddp], optimizer, scheduler


def sample(index: int) -> torch.Tensor:
    """Sample ``index`` of the dataset: an arithmetic sequence mod VOCAB (learnable), SEQ + 1 tokens."""
    g = torch.Generator().manual_seed(index)
    start, step = torch.randint(VOCAB, (2,), generator=g).tolist()
    return (start + (step % 7 + 1) * torch.arange(SEQ + 1)) % VOCAB


def global_order(consumed: int) -> list[int]:
    """The sample indices of the global batch after ``consumed`` samples (one seeded order)."""
    order = torch.randperm(100_000, generator=torch.Generator().manual_seed(7))
    return order[consumed:consumed + GLOBAL_BATCH].tolist()


def train_step(parts, consumed: int) -> tuple[float, list[int]]:
    """Megatron-LM's ``train_step``: its pipeline schedule over this dp rank's micro-batches, then the optimizer.

    Micro-batch ``m`` of dp rank ``d`` is the slice ``(m * dp + d)`` of the global batch
    (``MegatronPretrainingSampler``), so the global batch does not depend on dp.
    """
    model, optimizer, scheduler = parts
    dp, d = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    order = global_order(consumed)
    n = GLOBAL_BATCH // (MICRO_BATCH * dp)
    batches = [torch.stack([sample(i) for i in order[(m * dp + d) * MICRO_BATCH:(m * dp + d + 1) * MICRO_BATCH]])
               for m in range(n)]
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    pos = torch.arange(SEQ).expand(MICRO_BATCH, -1)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        output = model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:])
        return output, lambda out: (out.float().mean(), {"lm loss": out.float().mean().detach()})

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=model,
                                         num_microbatches=n, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                         forward_only=False)
    dist.barrier()   # commit point: every rank steps, or none (see tenplex_megatron.live.recover)
    optimizer.step()
    scheduler.step(increment=1)
    loss = torch.zeros(1, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        loss[0] = sum(float(x["lm loss"]) for x in losses) / n / dp
    dist.all_reduce(loss)
    return float(loss[0]), order


def run(schedule, args, membership, spec):
    """Train through ``schedule`` [(config, steps)]; returns losses, samples and the changes (rank 0)."""
    cfg, seed = spec.model, args.seed
    build = lambda c: setup_model_and_optimizer(c, cfg)
    config = ParallelConfig.parse(schedule[0][0])
    parts, consumed, losses, samples, changes = None, 0, [], [], []
    if membership.form(config.world_size):
        live.init_parallel_state(config, seed)
        parts = live.Parts(*build(config))
    for index, (text, steps) in enumerate(schedule):
        new = ParallelConfig.parse(text)
        if index:
            # tenplex: move the running job to the new (dp, tp, pp), on every process
            done = live.change(parts, build, spec=spec, old=config, new=new, consumed_samples=consumed,
                               seed=seed, membership=membership)
            parts, config = done.parts, new
            if parts is not None:
                consumed = done.imported.consumed_samples
            changes.append(done)
        for _ in range(steps if parts is not None else 0):
            loss, order = train_step(parts, consumed)
            consumed += GLOBAL_BATCH
            losses.append(loss)
            samples.append(order)
    parts = None
    live.destroy_parallel_state()
    membership.leave()
    return losses, samples, changes


def main() -> None:
    args = parse_args()
    # tenplex: once, before training: what the job's state tree depends on, and its process groups
    model = MegatronConfig(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                           vocab_size=VOCAB, make_vocab_size_divisible_by=32, position_embedding_type="rope",
                           untie_embeddings_and_output_weights=True, max_position_embeddings=SEQ,
                           params_dtype=args.dtype)
    spec = live.LiveSpec(model, distributed_optimizer=True, grad_reduce_in_fp32=True)
    membership = live.Membership.from_env()
    elastic, samples, changes = run(SCHEDULE, args, membership, spec)
    static, static_samples, _ = run([(SCHEDULE[0][0], sum(s for _, s in SCHEDULE))], args, membership, spec)
    if membership.process == 0:
        for done, (text, _) in zip(changes, SCHEDULE[1:]):
            print(f"to {text}: {done.seconds:.2f} s, moved {done.report.sent} bytes "
                  f"(lower bound {done.report.lower_bound}, placement-free bound "
                  f"{done.report.placement_bound}; new ranks of the processes {done.report.dst_of})")
        print(json.dumps({
            "max_loss_diff": max(abs(a - b) for a, b in zip(elastic, static)),
            "samples_match": samples == static_samples,
            "reconfig_s": round(sum(d.seconds for d in changes), 3),
            "moved_over_lower_bound": sum(d.report.sent for d in changes)
            / sum(d.report.lower_bound for d in changes),
            "moved_over_placement_bound": sum(d.report.sent for d in changes)
            / sum(d.report.placement_bound for d in changes),
        }), flush=True)


if __name__ == "__main__":
    main()

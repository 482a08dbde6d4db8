"""A megatron-core GPT training job on CPU: what ``pretrain_gpt`` builds, and one training step.

- model: ``GPTModel`` (local layer spec), in ``Float16Module`` for bf16,
  wrapped in megatron-core's ``DistributedDataParallel``;
- optimizer: ``get_megatron_optimizer`` (Adam; the ``DistributedOptimizer``
  by default) and an ``OptimizerParamScheduler``;
- step: megatron-core's own pipeline schedule (``get_forward_backward_func``)
  with ``finalize_model_grads``, then ``optimizer.step()``, as Megatron-LM's
  ``train_step`` does.

Data order follows Megatron-LM's ``MegatronPretrainingSampler``: step ``k``
consumes the global batch ``order[consumed : consumed + global_batch]``;
micro-batch ``m`` of dp rank ``d`` is its slice
``[(m * dp + d) * micro_batch, (m * dp + d + 1) * micro_batch)``, so the
global batch and the sample order do not depend on dp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import torch_dtype

from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.live.change import Parts
from tenplex_megatron.live.spec import LiveSpec

__all__ = ["JobOptions", "build", "live_spec", "train_step", "initial_state"]


@dataclass(frozen=True)
class JobOptions:
    """Training options (Megatron-LM's names).

    Attributes:
        global_batch: samples per step, ``micro_batch * dp`` divides it.
        micro_batch: samples per micro-batch.
        seq: tokens per sample.
        lr: Adam's learning rate (constant schedule).
        distributed_optimizer: ``use_distributed_optimizer``.
        clip_grad: gradient clipping norm (0: off).
        seed: the run's seed.
    """

    global_batch: int = 8
    micro_batch: int = 2
    seq: int = 64
    lr: float = 3e-3
    distributed_optimizer: bool = True
    clip_grad: float = 1.0
    seed: int = 1234


def live_spec(cfg: MegatronConfig, opts: JobOptions) -> LiveSpec:
    """The :class:`LiveSpec` of the job :func:`build` makes."""
    return LiveSpec(cfg, distributed_optimizer=opts.distributed_optimizer, grad_reduce_in_fp32=True)


def initial_state(tree, seed: int) -> dict:
    """The same global step-0 state at every config: N(0, 0.02) weights, unit norm weights, zero
    biases (in the params' dtype), fp32 main params equal to them, zero moments, step 0."""
    import zlib

    out: dict = {}
    for path, leaf in tree.tensors():
        if not path.startswith("model/"):
            continue
        if "layernorm" in path and path.endswith("weight"):
            value = torch.ones(leaf.shape)
        elif path.endswith("bias"):
            value = torch.zeros(leaf.shape)
        else:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(path.encode()))
            value = torch.randn(leaf.shape, generator=gen) * 0.02
        out[path] = value.to(torch_dtype(leaf.dtype))
    for path, leaf in tree.tensors():
        if path.startswith("optimizer/param/"):
            out[path] = out["model/" + path.removeprefix("optimizer/param/")].float()
        elif path.startswith("optimizer/"):
            out[path] = torch.zeros(leaf.shape)
    out.update({"optimizer/step": 0, "optimizer/scheduler": None, "data/consumed_samples": 0,
                "rng/states": {}})   # per (tp, pp) coordinate: none yet, seeded fresh
    return out


def _transformer_config(cfg: MegatronConfig, config: ParallelConfig):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch_dtype(cfg.params_dtype)
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size, kv_channels=cfg.kv_channels,
        gated_linear_unit=cfg.swiglu, activation_func=F.silu if cfg.swiglu else F.gelu,
        normalization=cfg.normalization, add_bias_linear=cfg.add_bias_linear,
        tensor_model_parallel_size=config.tp, pipeline_model_parallel_size=config.pp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)


def build(cfg: MegatronConfig, opts: JobOptions, config: ParallelConfig) -> Parts:
    """Model chunks, optimizer and scheduler at ``config`` (``parallel_state`` must be up)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    tc = _transformer_config(cfg, config)
    model = GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(normalization=cfg.normalization),
                     vocab_size=cfg.padded_vocab(config.tp), max_sequence_length=cfg.max_position_embeddings,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     parallel_output=True, share_embeddings_and_output_weights=cfg.tied,
                     position_embedding_type=cfg.position_embedding_type)
    if tc.bf16:
        model = Float16Module(tc, model)
    ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=opts.distributed_optimizer), module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=opts.lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        use_distributed_optimizer=opts.distributed_optimizer, clip_grad=opts.clip_grad, bf16=tc.bf16,
        params_dtype=tc.params_dtype), [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=opts.lr, max_lr=opts.lr, min_lr=opts.lr, lr_warmup_steps=0, lr_decay_steps=1000,
        lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=1000, wd_incr_style="constant")
    tc.finalize_model_grads_func = finalize_model_grads
    tc.grad_scale_func = optimizer.scale_loss
    return Parts([ddp], optimizer, scheduler)


def _micro_batches(corpus, consumed: int, opts: JobOptions, dp: int, dp_rank: int):
    idx = corpus.global_batch(consumed, opts.global_batch)
    mb, n = opts.micro_batch, opts.global_batch // (opts.micro_batch * dp)
    return [corpus.samples[idx[(m * dp + dp_rank) * mb:(m * dp + dp_rank + 1) * mb]] for m in range(n)], idx


def train_step(parts: Parts, corpus, consumed: int, opts: JobOptions) -> tuple[float, list[int]]:
    """One step on the global batch after ``consumed`` samples.

    Returns:
        The global batch's mean loss (on every rank) and its sample indices.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp = ps.get_data_parallel_world_size()
    batches, idx = _micro_batches(corpus, consumed, opts, dp, ps.get_data_parallel_rank())
    seq = opts.seq
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1).view(1, 1, seq, seq)
    pos = torch.arange(seq).unsqueeze(0).expand(opts.micro_batch, -1).contiguous()

    def forward_step(data, model):
        tokens = next(data)
        out = model(tokens[:, :-1].contiguous(), pos, mask, labels=tokens[:, 1:].contiguous())

        def loss_func(output):
            loss = output.float().mean()
            # the schedule divides the returned loss in place; report a copy
            return loss, {"lm loss": loss.detach().clone()}
        return out, loss_func

    for chunk in parts.model:
        chunk.zero_grad_buffer()
    parts.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=parts.model,
        num_microbatches=len(batches), seq_length=seq, micro_batch_size=opts.micro_batch,
        forward_only=False)
    # commit point: no rank updates its state unless every rank got here, so after a failure
    # all survivors hold the state of one step (see tenplex_megatron.live.recover)
    dist.barrier()
    parts.optimizer.step()
    parts.scheduler.step(increment=1)
    value = torch.zeros(1, dtype=torch.float64)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        value[0] = sum(float(x["lm loss"]) for x in losses) / len(losses) / dp
    dist.all_reduce(value)
    return float(value[0]), idx.tolist()

"""The one worker: build, train, save, load and run a real megatron-core GPTModel on CPU, dense or
with experts (EP, expert TP), virtual pipeline (VPP) and context parallel (CP).

Launch with torchrun; world size = tp * cp * pp * dp (dp is inferred). This file runs it with the
dense tests' defaults; moe_worker.py and hf_worker.py run it with the MoE tests' defaults
(mcore_args.PRESETS: the flags are the same)::

    torchrun --nproc_per_node=2 integrations/megatron/tests/mcore_worker.py \
        --tp 2 --pp 1 --layers 2 --hidden 64 --heads 4 --query-groups 2 \
        --ffn 128 --swiglu --position rope --untie --vocab 100 \
        --save legacy --save-dir /tmp/mcore_x --logits-out /tmp/mcore_x.safetensors

Actions, in this order (each optional):

1. build the model (``get_gpt_layer_local_spec``, ``use_cpu_initialization``; one GPTModel per
   virtual chunk with ``--vpp``); with ``--train-steps`` > 0 or ``--optimizer`` each chunk is
   wrapped in Megatron ``DistributedDataParallel`` and an Adam ``get_megatron_optimizer`` is built
   (``--dist-opt`` turns on the distributed optimizer); ``--dump-dir D`` writes per-rank
   state_dict / sharded_state_dict key tables to D;
2. ``--fresh-logits-out F``: the freshly initialized model's logits;
3. ``--load legacy|dist --load-dir D``: load a legacy per-rank checkpoint (must match this
   parallelism) or a ``dist_checkpointing`` directory (any); optimizer state is loaded too when an
   optimizer exists and the checkpoint has it (``--no-load-optim`` skips it); ``--load-rng``
   restores the RNG states and prints ``RNG tp=T pp=P dp=D <digest>`` lines; ``--hf-save D``
   converts the loaded model in memory and ``save_pretrained``s it (mcore_hf.py);
   ``--loaded-logits-out F``: the loaded model's logits;
4. ``--train-steps N``: N Adam steps on a fixed global batch; prints ``LOSS step=<i> <value>``
   lines (rank 0); ``--check-replicas`` then prints the largest difference of the parameters over
   their replicas (``REPLICA`` lines);
5. ``--save legacy|dist|both --save-dir D`` (both: D/legacy and D/dist); ``--dist-layout megatron``
   writes Megatron-LM's ``--save`` layout (``iter_NNNNNNN`` and the tracker), ``--save-rng`` the
   rng_state ShardedObject, ``--dist-args off`` leaves args out of common.pt, ``--names te`` builds
   TransformerEngine's layer structure (te_spec.py: its names and parameter order) and saves TE's
   extra states (te_names.py);
6. ``--logits-out F``: forward pass on a fixed token batch; the last stage gathers logits over tp,
   trims vocab padding and writes F (``.safetensors`` or ``.pt``; key ``logits``, shape
   ``[batch, seq, vocab]``, fp32); ``--tokens-out F``: the input tokens (``[batch, seq]`` int64);
7. ``--train-after-save N``: N more steps (``LOSS`` lines go on from step ``--train-steps``): the
   job that was not interrupted, for comparing with one resumed from the checkpoint;
8. each ``--also-load FMT DIR FRESH LOGITS``, in order: the model (and optimizer) is built again
   from the seed, its logits written to FRESH, DIR loaded as ``--load FMT`` would load it, and the
   logits written to LOGITS (one process group checks several checkpoints; each load starts from a
   freshly built model, so nothing carries over from an earlier one).

Model flags beyond the obvious ones: ``--bf16`` (bf16 params, fp32 main params and grad reduction;
``--fp16`` the same in fp16, with megatron-core's dynamic loss scaler from 2**10),
``--qk-layernorm``, ``--add-qkv-bias``, ``--eps``, ``--rotary-base``, ``--rotary-interleaved``,
``--rope-scaling F``; experts: ``--experts E --topk K --moe-ffn F --shared-ffn F``,
``--moe-layer-freq N|[1,0,..]``, ``--expert-bias`` (sigmoid router + aux-loss-free expert_bias),
``--pre-softmax``, ``--grouped-gemm``, ``--dispatcher allgather|alltoall``, ``--distinct-experts``
(each expert's weights drawn from its global id); parallelism: ``--tp --pp --vpp --cp --ep --etp``
(etp defaults to tp), ``--sp on|off`` (default on when tp > 1 and experts); ``--legacy-writer
expert_dp0|dp0`` (who writes model_optim_rng.pt; Megatron-LM: expert-data-parallel rank 0);
``--strict on|off`` (load_state_dict strictness); ``--device cuda``: the model on this process's GPU
(``LOCAL_RANK``) with NCCL and none of the CPU workarounds below, as Megatron-LM runs it (checkpoints
then hold ``cuda:N`` storages and CUDA generator states).

CPU workarounds (NOTES.md fact 1; none apply to a dense model at cp = 1):
  * moe_utils.te_general_gemm = None (NameError without TE; --no-te-gemm-fix to see it);
  * --sp on: WrappedTorchNorm is built without SP and its params are marked
    sequence_parallel (the torch norm asserts not sequence_parallel; MoE + tp>1
    training requires SP);
  * --cp N: the model config keeps context_parallel_size=1 and every cp rank runs the full sequence
    ("cp emulation": weights, DDP buffers, optimizer sharding and checkpoints are laid out exactly
    as at cp=N; the attention maths is not split; rope's get_pos_emb_on_this_cp_rank is the
    identity); --cp-in-config puts cp in the config (fails, fact 1).

Environment switches: R13_SINGLETON=1 (singleton_local_shards in the sharded metadata),
R13_ADAPT_CHAINED=1 (fit common.pt optimizer param_groups to this run's chained optimizers when
ep changes 1 <-> >1, fact 6.7), R13_FAKE_GG=1 with --grouped-gemm (build the legacy GroupedMLP
without the grouped_gemm package; no forward), R13_LOAD_STRICT=<StrictHandling value> for
dist_checkpointing.load, TENPLEX_DEBUG_OPT=1 (Adam state checksums, ``OPT`` lines).

Output lines: RANK (coords per rank), LOSS step=i v, LOGITS path shape sum, LEGACY_WRITE rank dir,
LOADED fmt dir, RNG ..., REPLICA ..., ADAPT ..., and ``TIME <phase> <seconds>`` by rank 0.
"""

from __future__ import annotations

import os
import random
import sys
import time

_T0 = time.time()
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))

from mcore_args import padded_vocab_size, parse_args  # noqa: E402
from mcore_checkpoint import CheckpointMixin, log0  # noqa: E402
from mcore_run import RunMixin  # noqa: E402


def patch_torch_norm_for_sp():
    """Sequence parallelism with the local spec on CPU (NOTES.md fact 1).

    megatron-core's WrappedTorchNorm asserts ``not config.sequence_parallel``
    (transformer/torch_norm.py); MoE + tp > 1 in training mode requires SP
    (moe_layer.py::MoELayer.forward raises ValueError otherwise). This builds the
    torch norm from a config copy without SP and marks its params
    ``sequence_parallel=True`` like TE/Apex norms do, so finalize_model_grads
    all-reduces their grads over tp (_allreduce_non_tensor_model_parallel_grads).
    """
    import copy

    from megatron.core.transformer import torch_norm

    orig = torch_norm.WrappedTorchNorm.__new__
    if getattr(orig, "_r13", False):
        return

    def new(cls, config, hidden_size, eps=1e-5, **kw):
        sp = config.sequence_parallel
        if sp:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = orig(cls, config, hidden_size, eps, **kw)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", sp)
        return norm

    new._r13 = True
    torch_norm.WrappedTorchNorm.__new__ = new


def apply_cpu_patches(a) -> None:
    """The CPU workarounds the flags need (NOTES.md fact 1); none for a dense model at cp = 1."""
    import numpy as np
    from tenplex_megatron import cpu_shim

    (cpu_shim.apply_optimizer_patches if a.optimizer else cpu_shim.apply)()
    if not hasattr(np, "product"):  # megatron-core <= 0.13's checkpoint validation (numpy 2 removed it)
        np.product = np.prod
    if a.experts and not a.no_te_gemm_fix:
        # without TE, moe_utils never binds te_general_gemm (NameError in the router)
        import megatron.core.transformer.moe.moe_utils as moe_utils

        moe_utils.te_general_gemm = None
    if a.sp == "on":
        patch_torch_norm_for_sp()
    if a.grouped_gemm and os.environ.get("R13_FAKE_GG") == "1":
        # the legacy GroupedMLP without the grouped_gemm package (no forward:
        # GroupedMLP.forward asserts bf16 and calls grouped_gemm.ops.gmm)
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    if a.cp > 1 and not a.cp_in_config:
        # cp emulation: every cp rank runs the full sequence, so rope must not slice
        # positions per cp rank (rotary_pos_embedding.py uses parallel_state's cp group)
        from megatron.core.models.common.embeddings import rotary_pos_embedding

        rotary_pos_embedding.get_pos_emb_on_this_cp_rank = lambda emb, seq_dim, cp_group: emb


class Worker(CheckpointMixin, RunMixin):
    def __init__(self, a):
        import torch
        import torch.distributed as dist

        if a.device == "cpu":
            apply_cpu_patches(a)
        else:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        from megatron.core import parallel_state as ps

        self.a, self.torch, self.dist, self.ps = a, torch, dist, ps
        t = time.time()
        dist.init_process_group("gloo" if a.device == "cpu" else "nccl")
        self.world = dist.get_world_size()
        assert self.world % (a.tp * a.pp * a.cp) == 0, "world size must be a multiple of tp*pp*cp"
        ps.initialize_model_parallel(
            tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
            virtual_pipeline_model_parallel_size=a.vpp, context_parallel_size=a.cp,
            expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
        self.dp = self.world // (a.tp * a.pp * a.cp)
        self.reseed()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.cp_rank = ps.get_context_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.edp_rank = ps.get_expert_data_parallel_rank()
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        self.padded_vocab = padded_vocab_size(a.vocab, a.make_vocab_size_divisible_by, a.tp)
        self.dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
        print(f"RANK {dist.get_rank()} tp={self.tp_rank} cp={self.cp_rank} dp={self.dp_rank} "
              f"pp={self.pp_rank} etp={self.etp_rank} ep={self.ep_rank} edp={self.edp_rank}", flush=True)
        log0(f"TIME init {time.time() - t:.2f} (since process start {time.time() - _T0:.2f})")
        self.build()

    def reseed(self):
        """Python's, torch's and megatron-core's tensor-parallel RNGs, from ``--seed``."""
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        random.seed(self.a.seed)
        self.torch.manual_seed(self.a.seed)
        model_parallel_cuda_manual_seed(self.a.seed)

    # ------------------------------------------------------------------ build
    def transformer_config(self):
        import torch.nn.functional as F
        from megatron.core.transformer.transformer_config import TransformerConfig

        a = self.a
        moe = {}
        if a.experts:
            moe = dict(
                num_moe_experts=a.experts, moe_router_topk=a.topk,
                moe_ffn_hidden_size=a.moe_ffn or a.ffn, moe_grouped_gemm=a.grouped_gemm,
                moe_token_dispatcher_type=a.dispatcher, moe_aux_loss_coeff=a.aux_coeff,
                moe_router_load_balancing_type="aux_loss" if a.aux_coeff else "none",
                moe_layer_freq=a.moe_layer_freq,
                moe_shared_expert_intermediate_size=a.shared_ffn,
                expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
            if a.expert_bias:
                moe.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                           moe_router_bias_update_rate=1e-2)
        config = TransformerConfig(
            num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
            num_query_groups=a.query_groups, ffn_hidden_size=a.ffn, gated_linear_unit=a.swiglu,
            activation_func=F.silu if a.swiglu else F.gelu, normalization=a.norm,
            add_bias_linear=a.bias == "on", tensor_model_parallel_size=a.tp,
            pipeline_model_parallel_size=a.pp, virtual_pipeline_model_parallel_size=a.vpp,
            context_parallel_size=a.cp if a.cp_in_config else 1,
            sequence_parallel=a.sp == "on", pipeline_dtype=self.dtype, params_dtype=self.dtype,
            bf16=a.bf16, fp16=a.fp16, add_qkv_bias=a.add_qkv_bias, qk_layernorm=a.qk_layernorm,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            init_method_std=0.02,
            account_for_embedding_in_pipeline_split=a.account_for in ("embedding", "both"),
            account_for_loss_in_pipeline_split=a.account_for in ("loss", "both"), **moe)
        # set after the checks of __post_init__, as the HF export's settings always were
        config.layernorm_epsilon = a.eps
        config.rotary_interleaved = a.rotary_interleaved
        config.moe_router_pre_softmax = a.pre_softmax
        return config

    def layer_spec(self, vp_stage):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec, get_gpt_layer_local_spec)

        a = self.a
        if a.experts and a.moe_layer_freq != 1:
            # Megatron-LM uses the block spec when layers differ (dense/MoE pattern)
            spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False,
                                              normalization=a.norm, vp_stage=vp_stage)
        else:
            spec = get_gpt_layer_local_spec(num_experts=a.experts, moe_grouped_gemm=a.grouped_gemm,
                                            qk_layernorm=a.qk_layernorm, normalization=a.norm)
        if a.names == "te":  # TE's layer structure: fused norms, TE's names and parameter order
            from te_spec import te_layer_spec

            spec = te_layer_spec(spec)
        return spec

    def build(self):
        """One ``GPTModel`` per virtual chunk (``vp_stage=i``, like Megatron-LM's model_provider)."""
        from megatron.core.models.gpt import GPTModel

        a, ps = self.a, self.ps
        t = time.time()
        self.config = self.transformer_config()
        self.models = []
        for v in range(a.vpp or 1):
            vp = v if a.vpp else None
            self.models.append(GPTModel(
                config=self.config, transformer_layer_spec=self.layer_spec(vp),
                vocab_size=self.padded_vocab, max_sequence_length=a.max_pos,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                parallel_output=True, share_embeddings_and_output_weights=not a.untie,
                position_embedding_type=a.position, rotary_base=a.rotary_base,
                rope_scaling=a.rope_scaling is not None, rope_scaling_factor=a.rope_scaling or 8.0,
                vp_stage=vp))
            if a.device == "cuda":  # Megatron-LM's get_model: model_module.cuda(torch.cuda.current_device())
                self.models[-1].cuda()
            if a.bf16 or a.fp16:  # Megatron-LM's Float16Module converts the whole model, norms included
                self.models[-1].to(self.dtype)
        self.model = self.models[0]
        if a.distinct_experts:
            self.redraw_experts()
        self.ddps = self.optimizer = self.scheduler = None
        if a.optimizer:
            self.build_optimizer()
        log0(f"TIME build {time.time() - t:.2f}")

    def build_optimizer(self):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        a = self.a
        kw = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=a.dist_opt)
        if a.bucket_size is not None:
            kw["bucket_size"] = a.bucket_size
        # Megatron-LM (training.py::get_model): chunks after the first get disable_bucketing=True
        self.ddps = [DistributedDataParallel(self.config, DistributedDataParallelConfig(**kw), module=m,
                                             disable_bucketing=(i > 0))
                     for i, m in enumerate(self.models)]
        self.opt_config = OptimizerConfig(
            optimizer="adam", lr=a.lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
            adam_eps=1e-8, use_distributed_optimizer=a.dist_opt, clip_grad=1.0, bf16=a.bf16,
            fp16=a.fp16, initial_loss_scale=2.0 ** 10, params_dtype=self.dtype)
        self.optimizer = get_megatron_optimizer(self.opt_config, self.ddps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=a.lr, min_lr=a.lr / 10, lr_warmup_steps=0,
            lr_decay_steps=100, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
            wd_incr_steps=100, wd_incr_style="constant")

    def redraw_experts(self):
        """Expert ``local_experts.j`` of layer ``l`` on ep rank ``r`` gets N(0, 0.02) weights seeded by
        ``(l, r * E / ep + j)`` and the expert-tensor-parallel rank (its etp shard): experts differ by
        their global id, and an expert's etp shards differ, whatever ep and etp saved them
        (megatron-core's CPU initialization gives ep ranks the same local experts)."""
        import re

        a, torch = self.a, self.torch
        assert a.pp == 1 and not a.vpp, "--distinct-experts needs pp = 1 (layer names are global)"
        per, shard = a.experts // a.ep, self.ps.get_expert_tensor_parallel_rank()
        for name, p in self.model.named_parameters():
            m = re.search(r"layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)", name)
            if m:
                layer, g = int(m.group(1)), self.ep_rank * per + int(m.group(2))
                gen = torch.Generator().manual_seed(10_000 + 1000 * shard + 100 * layer + 10 * g + int(m.group(3)[-1]))
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def _load(w, fmt: str, root: str) -> None:
    (w.load_legacy if fmt == "legacy" else w.load_dist)(root)


def _save(w, a) -> None:
    if a.save in ("legacy", "both"):
        w.save_legacy(a.save_dir if a.save == "legacy" else os.path.join(a.save_dir, "legacy"))
    if a.save in ("dist", "both"):
        w.save_dist(a.save_dir if a.save == "dist" else os.path.join(a.save_dir, "dist"))


def _also_load(w, a) -> None:
    for i, (fmt, load_dir, fresh, logits_out) in enumerate(a.also_load):
        assert fmt in ("legacy", "dist"), fmt
        w.reseed()
        w.build()
        w.write_logits(fresh)
        _load(w, fmt, load_dir)
        w.write_logits(logits_out)
        if a.also_load_optim_dir:
            assert w.world == 1, "--also-load-optim-dir reads whole parameters: one process"
            w.torch.save(w.optim_by_name(), os.path.join(a.also_load_optim_dir, f"optim{i}.pt"))


def main(argv=None, preset: str = "dense") -> int:
    """Run the actions the flags ask for, in the order of the module docstring; 0 on success."""
    a = parse_args(argv, preset)
    w = Worker(a)
    if a.dump_dir:
        w.dump_keys(a.dump_dir)
    if a.fresh_logits_out:
        w.write_logits(a.fresh_logits_out)
    t, cpu = time.time(), time.process_time()
    if a.load != "none":
        _load(w, a.load, a.load_dir)
    if a.hf_save:
        from mcore_hf import save_pretrained

        save_pretrained(w, a.hf_save)
        print(f"TIME hf_convert {time.time() - t:.2f}", flush=True)
        print(f"TIME hf_convert_cpu {time.process_time() - cpu:.2f}", flush=True)  # every thread's CPU seconds
    if a.loaded_logits_out:
        w.write_logits(a.loaded_logits_out)
    w.optim_summary("after_load")
    if a.train_steps > 0:
        w.train(a.train_steps)
    if a.check_replicas:
        w.check_replicas()
    if a.dump_dir and a.optimizer:
        w.dump_buffers(a.dump_dir)
    w.optim_summary("before_save")
    _save(w, a)
    if a.logits_out:
        w.write_logits(a.logits_out)
    if a.tokens_out:
        w.write_tokens(a.tokens_out)
    if a.train_after_save > 0:
        w.train(a.train_after_save, first=a.train_steps)
    _also_load(w, a)
    log0(f"TIME total {time.time() - _T0:.2f}")
    w.dist.barrier()
    w.dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

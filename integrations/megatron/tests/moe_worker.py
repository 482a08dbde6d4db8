"""Build, train, save, load and run a real megatron-core 0.16.1 GPTModel on CPU,
with experts (EP, expert TP), virtual pipeline (VPP) and context parallel (CP).
Facts behind it: integrations/megatron/NOTES.md section 8.

An extension of integrations/megatron/tests/mcore_worker.py (same flags and
output lines) for issue 13. Launch with torchrun; world = tp*cp*dp*pp::

    W=integrations/megatron/tests/moe_worker.py
    MOE="--layers 4 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope \
         --untie --vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --experts 4 --topk 2"
    torchrun --nproc_per_node=2 $W --ep 2 $MOE --save both --save-dir /tmp/x --logits-out /tmp/x/ref.pt
    torchrun --nproc_per_node=1 $W --ep 1 $MOE --load dist --load-dir /tmp/x/dist --logits-out /tmp/x/out.pt

New flags (beyond mcore_worker.py):
  --cp N         context_parallel_size in parallel_state. The local spec's
                 DotProductAttention asserts cp == 1, so the model config keeps
                 context_parallel_size=1 and every cp rank runs the full sequence
                 ("cp emulation": weights, DDP buffers, optimizer sharding and
                 checkpoints are laid out exactly as at cp=N; the attention maths
                 is not split). --cp-in-config puts cp in the config (fails, fact 1).
  --ep, --etp    expert_model_parallel_size, expert_tensor_parallel_size (default tp)
  --vpp N        virtual pipeline chunks per stage (one GPTModel per chunk,
                 vp_stage=i, like Megatron-LM's model_provider)
  --experts E, --topk K, --moe-ffn F, --shared-ffn F, --moe-layer-freq N|[1,0,..],
  --expert-bias (sigmoid router + aux-loss-free expert_bias), --grouped-gemm,
  --dispatcher allgather|alltoall, --sp on|off (default: on when tp>1 and experts)
  --dump-dir D   write per-rank state_dict / sharded_state_dict key tables to D
  --legacy-writer expert_dp0|dp0   who writes model_optim_rng.pt (Megatron-LM:
                 ranks with expert-data-parallel rank 0)
  --check-replicas   after training, max |diff| of params over dp x cp / expert-dp
  --strict on|off    load_state_dict strictness (default on)

CPU workarounds applied here (see FACTS.md fact 1):
  * moe_utils.te_general_gemm = None (NameError without TE; --no-te-gemm-fix to see it);
  * --sp on: WrappedTorchNorm is built without SP and its params are marked
    sequence_parallel (the torch norm asserts not sequence_parallel; MoE + tp>1
    training requires SP);
  * cp emulation: rope's get_pos_emb_on_this_cp_rank is made the identity.

Environment switches: R13_SINGLETON=1 (singleton_local_shards in the sharded
metadata), R13_ADAPT_CHAINED=1 (fit common.pt optimizer param_groups to this run's
chained optimizers when ep changes 1 <-> >1, fact 6.7), R13_FAKE_GG=1 with
--grouped-gemm (build the legacy GroupedMLP without the grouped_gemm package; no
forward), R13_LOAD_STRICT=<StrictHandling value> for dist_checkpointing.load.

Output lines: RANK (coords per rank), LOSS step=i v, LOGITS path shape sum,
LEGACY_WRITE rank dir, REPLICA ..., ADAPT ..., TIME ...
The logits file is torch.save({'logits': [batch, seq, vocab] fp32}) (vocab unpadded).
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import sys
import time

_T0 = time.time()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add = p.add_argument
    for name, default in (("tp", 1), ("pp", 1), ("cp", 1), ("ep", 1), ("layers", 2), ("hidden", 64),
                          ("heads", 4), ("vocab", 128), ("make-vocab-size-divisible-by", 16),
                          ("seed", 1234), ("seq", 8), ("batch", 2), ("data-seed", 4321),
                          ("iteration", 10), ("train-steps", 0), ("topk", 2)):
        add(f"--{name}", type=int, default=default)
    for name in ("etp", "vpp", "query-groups", "ffn", "max-pos", "experts", "moe-ffn", "shared-ffn",
                 "bucket-size"):
        add(f"--{name}", type=int, default=None)
    add("--swiglu", action="store_true")
    add("--position", choices=["rope", "learned_absolute"], default="rope")
    add("--untie", action="store_true")
    add("--norm", choices=["LayerNorm", "RMSNorm"], default=None)
    add("--bias", choices=["on", "off"], default=None)
    add("--moe-layer-freq", default="1", help="an int N (MoE on layers i %% N == 0) or a list, e.g. [1,0,1,0]")
    add("--expert-bias", action="store_true")
    add("--aux-coeff", type=float, default=0.0)
    add("--grouped-gemm", action="store_true")
    add("--dispatcher", default="allgather")
    add("--sp", choices=["on", "off"], default=None)
    add("--cp-in-config", action="store_true")
    add("--names", choices=["local", "te"], default="local",
        help="te: legacy files under TransformerEngine's names and torch_dist keys as the TE spec's "
             "(megatron-core's own sharded_state_dict_keys_map; moe_checkpoint.te_prefixes)")
    add("--no-te-gemm-fix", action="store_true", help="do not set moe_utils.te_general_gemm = None")
    add("--load", choices=["none", "legacy", "dist"], default="none")
    add("--load-dir", default=None)
    add("--no-load-optim", action="store_true")
    add("--strict", choices=["on", "off"], default="on")
    add("--save", choices=["none", "legacy", "dist", "both"], default="none")
    add("--save-dir", default=None)
    add("--legacy-writer", choices=["expert_dp0", "dp0"], default="expert_dp0")
    add("--logits-out", default=None)
    add("--fresh-logits-out", default=None)
    add("--loaded-logits-out", default=None, help="logits right after the load, before training")
    add("--more-steps", type=int, default=0, help="after saving and --logits-out, train this many more "
        "steps (a static run's continuation)")
    add("--dump-dir", default=None)
    add("--check-replicas", action="store_true", help="after training: params equal across dp_cp / expert-dp?")
    add("--optimizer", action="store_true")
    add("--dist-opt", action="store_true")
    add("--sharding-type", default="fully_reshardable",
        choices=["fully_reshardable", "dp_reshardable", "fully_sharded_model_space"])
    add("--lr", type=float, default=1e-3)
    a = p.parse_args(argv)
    a.query_groups = a.query_groups or a.heads
    a.ffn = a.ffn or 4 * a.hidden
    a.norm = a.norm or ("RMSNorm" if a.swiglu else "LayerNorm")
    a.bias = a.bias or ("off" if a.swiglu else "on")
    a.max_pos = a.max_pos or a.seq
    a.etp = a.etp or a.tp
    freq = ast.literal_eval(a.moe_layer_freq)  # an int N (MoE on layers i % N == 0) or a [1, 0, ...] list
    if not (type(freq) is int and freq >= 1 or isinstance(freq, list) and set(freq) <= {0, 1}
            and len(freq) == a.layers):
        p.error(f"--moe-layer-freq {a.moe_layer_freq!r}: give an int >= 1 or a 0/1 list of {a.layers} layers")
    a.moe_layer_freq = freq
    if a.sp is None:
        a.sp = "on" if (a.tp > 1 and a.experts) else "off"
    if a.train_steps > 0:
        a.optimizer = True
    return a


def patch_torch_norm_for_sp():
    """Sequence parallelism with the local spec on CPU (fact 1).

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


from mcore_worker import padded_vocab_size  # noqa: E402
from moe_checkpoint import CheckpointMixin, log0  # noqa: E402
from moe_run import RunMixin  # noqa: E402


class Worker(CheckpointMixin, RunMixin):
    def __init__(self, a: argparse.Namespace):
        import torch
        import torch.distributed as dist

        from tenplex_megatron import cpu_shim

        (cpu_shim.apply_optimizer_patches if a.optimizer else cpu_shim.apply)()
        if a.experts and not a.no_te_gemm_fix:
            # Fact 1: without TE, moe_utils never binds te_general_gemm (NameError in the router).
            import megatron.core.transformer.moe.moe_utils as moe_utils

            moe_utils.te_general_gemm = None
        if a.sp == "on":
            patch_torch_norm_for_sp()
        if a.grouped_gemm and os.environ.get("R13_FAKE_GG") == "1":
            # Build the legacy GroupedMLP without the grouped_gemm package (no forward:
            # GroupedMLP.forward asserts bf16 and calls grouped_gemm.ops.gmm).
            from megatron.core.transformer.moe import grouped_gemm_util

            grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
        if a.cp > 1 and not a.cp_in_config:
            # cp emulation: every cp rank runs the full sequence, so rope must not slice
            # positions per cp rank (rotary_pos_embedding.py uses parallel_state's cp group).
            from megatron.core.models.common.embeddings import rotary_pos_embedding

            rotary_pos_embedding.get_pos_emb_on_this_cp_rank = lambda emb, seq_dim, cp_group: emb
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        self.a, self.torch, self.dist, self.ps = a, torch, dist, ps
        dist.init_process_group("gloo")
        self.world = dist.get_world_size()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
            virtual_pipeline_model_parallel_size=a.vpp, context_parallel_size=a.cp,
            expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
        self.dp = self.world // (a.tp * a.pp * a.cp)
        random.seed(a.seed)
        torch.manual_seed(a.seed)
        model_parallel_cuda_manual_seed(a.seed)
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
        print(f"RANK {dist.get_rank()} tp={self.tp_rank} cp={self.cp_rank} dp={self.dp_rank} "
              f"pp={self.pp_rank} etp={self.etp_rank} ep={self.ep_rank} edp={self.edp_rank}", flush=True)
        self.build()

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
        return TransformerConfig(
            num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
            num_query_groups=a.query_groups, ffn_hidden_size=a.ffn, gated_linear_unit=a.swiglu,
            activation_func=F.silu if a.swiglu else F.gelu, normalization=a.norm,
            add_bias_linear=a.bias == "on", tensor_model_parallel_size=a.tp,
            pipeline_model_parallel_size=a.pp, virtual_pipeline_model_parallel_size=a.vpp,
            context_parallel_size=a.cp if a.cp_in_config else 1,
            sequence_parallel=a.sp == "on",
            pipeline_dtype=self.torch.float32, params_dtype=self.torch.float32,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            init_method_std=0.02, **moe)

    def layer_spec(self, vp_stage):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec, get_gpt_layer_local_spec)

        a = self.a
        if a.experts and a.moe_layer_freq != 1:
            # Megatron-LM uses the block spec when layers differ (dense/MoE pattern).
            return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False,
                                              normalization=a.norm, vp_stage=vp_stage)
        return get_gpt_layer_local_spec(num_experts=a.experts, moe_grouped_gemm=a.grouped_gemm,
                                        normalization=a.norm)

    def build(self):
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
                position_embedding_type=a.position, vp_stage=vp))
        if a.names == "te":
            from moe_checkpoint import use_te_dist_names

            for m in self.models:
                use_te_dist_names(m)
        self.model = self.models[0]
        self.ddps = None
        self.optimizer = None
        self.scheduler = None
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
        # Megatron-LM (training.py::get_model): chunks after the first get disable_bucketing=True.
        self.ddps = [DistributedDataParallel(self.config, DistributedDataParallelConfig(**kw), module=m,
                                             disable_bucketing=(i > 0))
                     for i, m in enumerate(self.models)]
        self.opt_config = OptimizerConfig(
            optimizer="adam", lr=a.lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
            adam_eps=1e-8, use_distributed_optimizer=a.dist_opt, clip_grad=1.0, bf16=False,
            fp16=False, params_dtype=self.torch.float32)
        self.optimizer = get_megatron_optimizer(self.opt_config, self.ddps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=a.lr, min_lr=a.lr / 10, lr_warmup_steps=0,
            lr_decay_steps=100, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
            wd_incr_steps=100, wd_incr_style="constant")


def main(argv=None) -> int:
    a = parse_args(argv)
    w = Worker(a)
    if a.dump_dir:
        w.dump_keys(a.dump_dir)
    if a.fresh_logits_out:
        w.write_logits(a.fresh_logits_out)
    if a.load == "legacy":
        w.load_legacy(a.load_dir)
    elif a.load == "dist":
        w.load_dist(a.load_dir)
    if a.loaded_logits_out:
        w.write_logits(a.loaded_logits_out)
    if a.train_steps > 0:
        w.train()
    if a.check_replicas:
        w.check_replicas()
    if a.dump_dir and a.optimizer:
        w.dump_buffers(a.dump_dir)
    if a.save in ("legacy", "both"):
        w.save_legacy(a.save_dir if a.save == "legacy" else os.path.join(a.save_dir, "legacy"))
    if a.save in ("dist", "both"):
        w.save_dist(a.save_dir if a.save == "dist" else os.path.join(a.save_dir, "dist"))
    if a.logits_out:
        w.write_logits(a.logits_out)
    if a.more_steps:
        a.train_steps = a.more_steps
        w.train()
    log0(f"TIME total {time.time() - _T0:.2f}")
    w.dist.barrier()
    w.dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

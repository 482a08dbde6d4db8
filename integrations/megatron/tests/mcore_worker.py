"""Build, train, save, load and run a real megatron-core GPTModel on CPU.

Launch with torchrun; world size = tp * pp * dp (dp is inferred)::

    torchrun --nproc_per_node=2 integrations/megatron/tests/mcore_worker.py \
        --tp 2 --pp 1 --layers 2 --hidden 64 --heads 4 --query-groups 2 \
        --ffn 128 --swiglu --position rope --untie --vocab 100 \
        --save legacy --save-dir /tmp/mcore_x --logits-out /tmp/mcore_x.safetensors

Actions, in this order (each optional):

1. build the model (``get_gpt_layer_local_spec``, ``use_cpu_initialization``);
   with ``--train-steps`` > 0 or ``--optimizer`` the model is wrapped in
   Megatron ``DistributedDataParallel`` and an Adam ``get_megatron_optimizer``
   is built (``--dist-opt`` turns on the distributed optimizer);
2. ``--load legacy|dist --load-dir D``: load a legacy per-rank checkpoint (must
   match this tp/pp) or a ``dist_checkpointing`` directory (any tp/pp/dp);
   optimizer state is loaded too when an optimizer exists and the checkpoint
   has it (``--no-load-optim`` skips it);
3. ``--train-steps N``: N Adam steps on a fixed global batch; prints
   ``LOSS step=<i> <value>`` lines (rank 0);
4. ``--save legacy|dist --save-dir D``;
5. ``--logits-out F``: forward pass on a fixed token batch; the last stage
   gathers logits over tp, trims vocab padding and writes F (``.safetensors``
   or ``.pt``; key ``logits``, shape ``[batch, seq, vocab]``, fp32);
6. ``--train-after-save N``: N more steps (``LOSS`` lines go on from step
   ``--train-steps``): the job that was not interrupted, for comparing with
   one resumed from the checkpoint;
7. each ``--also-load FMT DIR FRESH LOGITS``, in order: the model (and
   optimizer) is built again from the seed, its logits written to FRESH, DIR
   loaded as ``--load FMT`` would load it, and the logits written to LOGITS
   (one process group checks several checkpoints; each load starts from a
   freshly built model, so nothing carries over from an earlier one).

Timings are printed as ``TIME <phase> <seconds>`` lines by rank 0.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

_T0 = time.time()
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--query-groups", type=int, default=None, help="GQA groups (default: heads)")
    p.add_argument("--ffn", type=int, default=None, help="ffn hidden size (default 4*hidden)")
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--position", choices=["rope", "learned_absolute"], default="learned_absolute")
    p.add_argument("--untie", action="store_true", help="untie embeddings and output weights")
    p.add_argument("--norm", choices=["LayerNorm", "RMSNorm"], default=None,
                   help="default: RMSNorm with --swiglu, else LayerNorm")
    p.add_argument("--bias", choices=["on", "off"], default=None,
                   help="add_bias_linear; default off with --swiglu, else on")
    p.add_argument("--vocab", type=int, default=100)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2, help="global batch size")
    p.add_argument("--max-pos", type=int, default=None, help="max_position_embeddings (default seq)")
    p.add_argument("--bf16", action="store_true", help="bf16 params (fp32 main params and grad reduction)")
    p.add_argument("--qk-layernorm", action="store_true", help="per-head query/key norms")
    p.add_argument("--add-qkv-bias", action="store_true", help="a bias on linear_qkv only")
    p.add_argument("--data-seed", type=int, default=4321)
    # actions
    p.add_argument("--load", choices=["none", "legacy", "dist"], default="none")
    p.add_argument("--load-dir", default=None)
    p.add_argument("--no-load-optim", action="store_true")
    p.add_argument("--save", choices=["none", "legacy", "dist", "both"], default="none",
                   help="both: legacy under SAVE_DIR/legacy and dist under SAVE_DIR/dist")
    p.add_argument("--dist-args", choices=["on", "off"], default="on",
                   help="put args in a dist checkpoint's common.pt, as Megatron-LM does")
    p.add_argument("--save-rng", action="store_true",
                   help="dist saves: Megatron-LM's rng_state ShardedObject on the (pp, tp) grid")
    p.add_argument("--load-rng", action="store_true",
                   help="restore RNG states from the checkpoint and print 'RNG tp=T pp=P <digest>' lines")
    p.add_argument("--fresh-logits-out", default=None,
                   help="write the freshly initialized model's logits here, before loading")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--dist-layout", choices=["bare", "megatron"], default="bare",
                   help="dist saves: a bare dist_checkpointing folder, or Megatron-LM's --save layout "
                        "(SAVE_DIR/iter_NNNNNNN and latest_checkpointed_iteration.txt)")
    p.add_argument("--iteration", type=int, default=10)
    p.add_argument("--logits-out", default=None)
    p.add_argument("--also-load", nargs=4, action="append", default=[],
                   metavar=("FMT", "DIR", "FRESH", "LOGITS"),
                   help="after the actions above: rebuild, write FRESH logits, load DIR, write LOGITS")
    p.add_argument("--also-load-optim-dir", default=None,
                   help="after each --also-load (in order i), write the loaded Adam state by global "
                        "parameter name to DIR/optim{i}.pt (one process only)")
    # optimizer path
    p.add_argument("--optimizer", action="store_true", help="build DDP + Adam even with 0 steps")
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--train-after-save", type=int, default=0, help="steps after saving (needs --train-steps)")
    p.add_argument("--dist-opt", action="store_true", help="use_distributed_optimizer")
    p.add_argument("--sharding-type", default="fully_reshardable",
                   choices=["fully_reshardable", "dp_reshardable", "fully_sharded_model_space"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bucket-size", type=int, default=None, help="DDP bucket_size (elements)")
    a = p.parse_args(argv)
    if a.query_groups is None:
        a.query_groups = a.heads
    if a.ffn is None:
        a.ffn = 4 * a.hidden
    if a.norm is None:
        a.norm = "RMSNorm" if a.swiglu else "LayerNorm"
    if a.bias is None:
        a.bias = "off" if a.swiglu else "on"
    if a.max_pos is None:
        a.max_pos = a.seq
    if a.train_steps > 0:
        a.optimizer = True
    return a


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's rule (megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding)."""
    multiple = divisible_by * tp
    return ((vocab + multiple - 1) // multiple) * multiple


from mcore_checkpoint import CheckpointMixin, log0  # noqa: E402


class Worker(CheckpointMixin):
    def __init__(self, a: argparse.Namespace):
        import torch
        import torch.distributed as dist

        from tenplex_megatron import cpu_shim

        if a.optimizer:
            cpu_shim.apply_optimizer_patches()
        else:
            cpu_shim.apply()

        from megatron.core import parallel_state as ps

        self.a = a
        self.torch = torch
        self.dist = dist
        self.ps = ps
        t = time.time()
        dist.init_process_group("gloo")
        self.world = dist.get_world_size()
        assert self.world % (a.tp * a.pp) == 0, "world size must be a multiple of tp*pp"
        self.dp = self.world // (a.tp * a.pp)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp
        )
        self.reseed()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        self.padded_vocab = padded_vocab_size(a.vocab, a.make_vocab_size_divisible_by, a.tp)
        self.dtype = torch.bfloat16 if a.bf16 else torch.float32
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
        return TransformerConfig(
            num_layers=a.layers,
            hidden_size=a.hidden,
            num_attention_heads=a.heads,
            num_query_groups=a.query_groups,
            ffn_hidden_size=a.ffn,
            gated_linear_unit=a.swiglu,
            activation_func=F.silu if a.swiglu else F.gelu,
            normalization=a.norm,
            add_bias_linear=a.bias == "on",
            tensor_model_parallel_size=a.tp,
            pipeline_model_parallel_size=a.pp,
            pipeline_dtype=self.dtype,
            params_dtype=self.dtype,
            bf16=a.bf16,
            add_qkv_bias=a.add_qkv_bias,
            qk_layernorm=a.qk_layernorm,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            init_method_std=0.02,
        )

    def build(self):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        a = self.a
        t = time.time()
        self.config = self.transformer_config()
        self.model = GPTModel(
            config=self.config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization=a.norm,
                                                            qk_layernorm=a.qk_layernorm),
            vocab_size=self.padded_vocab,
            max_sequence_length=a.max_pos,
            pre_process=self.first,
            post_process=self.last,
            parallel_output=True,
            share_embeddings_and_output_weights=not a.untie,
            position_embedding_type=a.position,
        )
        if a.bf16:  # Megatron-LM's Float16Module converts the whole model, norms included
            self.model.bfloat16()
        self.ddp = None
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
        ddp_kwargs = dict(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=a.dist_opt,
        )
        if a.bucket_size is not None:
            ddp_kwargs["bucket_size"] = a.bucket_size
        ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
        self.ddp = DistributedDataParallel(self.config, ddp_config, module=self.model)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=a.lr,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            use_distributed_optimizer=a.dist_opt,
            clip_grad=1.0,
            bf16=a.bf16,
            fp16=False,
            params_dtype=self.dtype,
        )
        self.opt_config = opt_config
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=a.lr,
            min_lr=a.lr / 10,
            lr_warmup_steps=0,
            lr_decay_steps=100,
            lr_decay_style="constant",
            start_wd=0.0,
            end_wd=0.0,
            wd_incr_steps=100,
            wd_incr_style="constant",
        )

    # ------------------------------------------------------------------ data
    def batch(self, global_batch: bool = False):
        """Fixed tokens [b, s] (this dp rank's slice unless global_batch), positions, mask, labels."""
        torch = self.torch
        a = self.a
        g = torch.Generator().manual_seed(a.data_seed)
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
        if not global_batch:
            assert a.batch % self.dp == 0, "--batch must be divisible by dp"
            per = a.batch // self.dp
            tokens = tokens[self.dp_rank * per:(self.dp_rank + 1) * per]
        inputs = tokens[:, :-1].contiguous()
        labels = tokens[:, 1:].contiguous()
        b = inputs.shape[0]
        pos = torch.arange(a.seq).unsqueeze(0).expand(b, -1).contiguous()
        # True = masked out (megatron convention). Passing it explicitly avoids
        # get_default_causal_mask, which allocates on device="cuda".
        mask = torch.triu(torch.ones(a.seq, a.seq, dtype=torch.bool), diagonal=1).view(1, 1, a.seq, a.seq)
        return inputs, pos, mask, labels

    def module(self):
        return self.model

    # ------------------------------------------------------------------ fwd/bwd
    def _recv(self, shape, src):
        t = self.torch.empty(shape, dtype=self.dtype)
        self.dist.recv(t, src=src)
        return t

    def pp_neighbors(self):
        ranks = self.ps.get_pipeline_model_parallel_group()
        ranks = self.dist.get_process_group_ranks(ranks)
        prev_r = ranks[self.pp_rank - 1] if not self.first else None
        next_r = ranks[self.pp_rank + 1] if not self.last else None
        return prev_r, next_r

    def forward_step(self, with_labels: bool, global_batch: bool = False, backward: bool = False):
        """One hand-written pipelined forward (and optionally backward) pass.

        Returns the model output on the last stage (loss [b, s] or logits [b, s, v/tp]),
        None elsewhere.
        """
        a = self.a
        inputs, pos, mask, labels = self.batch(global_batch=global_batch)
        b = inputs.shape[0]
        prev_r, next_r = self.pp_neighbors()
        runner = self.ddp if self.ddp is not None else self.model
        h_in = None
        if not self.first:
            h_in = self._recv((a.seq, b, a.hidden), prev_r)
            if backward:
                h_in.requires_grad_(True)
            self.model.set_input_tensor(h_in)
        out = runner(
            inputs if self.first else None,
            pos,
            mask,
            labels=labels if (with_labels and self.last) else None,
        )
        result = None
        if self.last:
            result = out
            if backward:
                out.float().mean().backward()
        else:
            self.dist.send(out.detach().contiguous(), dst=next_r)
            if backward:
                grad = self._recv(tuple(out.shape), next_r)
                out.backward(grad)
        if backward and not self.first:
            self.dist.send(h_in.grad.contiguous(), dst=prev_r)
        return result

    def train(self, steps=None, first=0):
        from megatron.core.distributed import finalize_model_grads

        torch = self.torch
        losses = []
        for step in range(first, first + (self.a.train_steps if steps is None else steps)):
            t = time.time()
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            loss = self.forward_step(with_labels=True, backward=True)
            finalize_model_grads([self.ddp])
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            # Report the global-batch mean loss from the last stage, tp rank 0.
            val = torch.zeros(1)
            if self.last and self.tp_rank == 0:
                val[0] = loss.float().mean().item() / self.dp
            self.dist.all_reduce(val)
            losses.append(val.item())
            log0(f"LOSS step={step} {val.item():.8f} grad_norm={grad_norm} ok={ok} "
                 f"({time.time() - t:.2f}s)")
        return losses

    # ------------------------------------------------------------------ logits
    def write_logits(self, path: str):
        torch = self.torch
        t = time.time()
        runner = self.ddp if self.ddp is not None else self.model
        runner.eval()
        with torch.no_grad():
            out = self.forward_step(with_labels=False, global_batch=True)
        runner.train()
        if self.last:
            tp_group = self.ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(out) for _ in range(self.a.tp)]
            self.dist.all_gather(parts, out.contiguous(), group=tp_group)
            logits = torch.cat(parts, dim=-1)[..., : self.a.vocab].contiguous().float()
            if self.tp_rank == 0 and self.dp_rank == 0:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                if path.endswith(".safetensors"):
                    from safetensors.torch import save_file

                    save_file({"logits": logits}, path)
                else:
                    torch.save({"logits": logits}, path)
                print(f"LOGITS {path} shape={tuple(logits.shape)} "
                      f"sum={logits.double().sum().item():.10f}", flush=True)
        self.dist.barrier()
        log0(f"TIME logits {time.time() - t:.2f}")

def main(argv=None) -> int:
    a = parse_args(argv)
    w = Worker(a)
    if a.fresh_logits_out:
        w.write_logits(a.fresh_logits_out)
    if a.load == "legacy":
        w.load_legacy(a.load_dir)
    elif a.load == "dist":
        w.load_dist(a.load_dir)
    w.optim_summary("after_load")
    if a.train_steps > 0:
        w.train()
    w.optim_summary("before_save")
    if a.save == "legacy":
        w.save_legacy(a.save_dir)
    elif a.save == "dist":
        w.save_dist(a.save_dir)
    elif a.save == "both":
        w.save_legacy(os.path.join(a.save_dir, "legacy"))
        w.save_dist(os.path.join(a.save_dir, "dist"))
    if a.logits_out:
        w.write_logits(a.logits_out)
    if a.train_after_save > 0:
        assert a.train_steps > 0, "--train-after-save needs --train-steps (an optimizer)"
        w.train(a.train_after_save, first=a.train_steps)
    for i, (fmt, load_dir, fresh, logits_out) in enumerate(a.also_load):
        assert fmt in ("legacy", "dist"), fmt
        w.reseed()
        w.build()
        w.write_logits(fresh)
        (w.load_legacy if fmt == "legacy" else w.load_dist)(load_dir)
        w.write_logits(logits_out)
        if a.also_load_optim_dir:
            assert w.world == 1, "--also-load-optim-dir reads whole parameters: one process"
            w.torch.save(w.optim_by_name(), os.path.join(a.also_load_optim_dir, f"optim{i}.pt"))
    log0(f"TIME total {time.time() - _T0:.2f}")
    w.dist.barrier()
    w.dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

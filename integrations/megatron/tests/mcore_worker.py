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
   or ``.pt``; key ``logits``, shape ``[batch, seq, vocab]``, fp32).

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
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "src"))


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
    p.add_argument("--data-seed", type=int, default=4321)
    # actions
    p.add_argument("--load", choices=["none", "legacy", "dist"], default="none")
    p.add_argument("--load-dir", default=None)
    p.add_argument("--no-load-optim", action="store_true")
    p.add_argument("--save", choices=["none", "legacy", "dist", "both"], default="none",
                   help="both: legacy under SAVE_DIR/legacy and dist under SAVE_DIR/dist")
    p.add_argument("--dist-args", choices=["on", "off"], default="on",
                   help="put args in a dist checkpoint's common.pt, as Megatron-LM does")
    p.add_argument("--fresh-logits-out", default=None,
                   help="write the freshly initialized model's logits here, before loading")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--iteration", type=int, default=10)
    p.add_argument("--logits-out", default=None)
    # optimizer path
    p.add_argument("--optimizer", action="store_true", help="build DDP + Adam even with 0 steps")
    p.add_argument("--train-steps", type=int, default=0)
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


def log0(*msg) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*msg, flush=True)


class Worker:
    def __init__(self, a: argparse.Namespace):
        import torch
        import torch.distributed as dist

        from tenplex_megatron import cpu_shim

        if a.optimizer:
            cpu_shim.apply_optimizer_patches()
        else:
            cpu_shim.apply()

        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

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
        random.seed(a.seed)
        torch.manual_seed(a.seed)
        model_parallel_cuda_manual_seed(a.seed)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        self.padded_vocab = padded_vocab_size(a.vocab, a.make_vocab_size_divisible_by, a.tp)
        log0(f"TIME init {time.time() - t:.2f} (since process start {time.time() - _T0:.2f})")
        self.build()

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
            pipeline_dtype=self.torch.float32,
            params_dtype=self.torch.float32,
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
            transformer_layer_spec=get_gpt_layer_local_spec(normalization=a.norm),
            vocab_size=self.padded_vocab,
            max_sequence_length=a.max_pos,
            pre_process=self.first,
            post_process=self.last,
            parallel_output=True,
            share_embeddings_and_output_weights=not a.untie,
            position_embedding_type=a.position,
        )
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
            bf16=False,
            fp16=False,
            params_dtype=self.torch.float32,
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
        t = self.torch.empty(shape, dtype=self.torch.float32)
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

    def train(self):
        from megatron.core.distributed import finalize_model_grads

        torch = self.torch
        losses = []
        for step in range(self.a.train_steps):
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

    # ------------------------------------------------------------------ legacy format
    def megatron_args(self) -> argparse.Namespace:
        """The subset of Megatron-LM's parsed args that matter for a checkpoint reader."""
        a = self.a
        return argparse.Namespace(
            num_layers=a.layers,
            hidden_size=a.hidden,
            ffn_hidden_size=a.ffn,
            num_attention_heads=a.heads,
            group_query_attention=a.query_groups != a.heads,
            num_query_groups=a.query_groups,
            kv_channels=a.hidden // a.heads,
            max_position_embeddings=a.max_pos,
            seq_length=a.seq,
            position_embedding_type=a.position,
            use_rotary_position_embeddings=a.position == "rope",
            add_position_embedding=a.position == "learned_absolute",
            rotary_percent=1.0,
            rotary_base=10000,
            swiglu=a.swiglu,
            untie_embeddings_and_output_weights=a.untie,
            normalization=a.norm,
            add_bias_linear=a.bias == "on",
            add_qkv_bias=a.bias == "on",
            vocab_size=a.vocab,
            padded_vocab_size=self.padded_vocab,
            make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
            tokenizer_type="NullTokenizer",
            vocab_file=None,
            tensor_model_parallel_size=a.tp,
            pipeline_model_parallel_size=a.pp,
            virtual_pipeline_model_parallel_size=None,
            expert_model_parallel_size=1,
            num_experts=None,
            data_parallel_size=self.dp,
            world_size=self.world,
            micro_batch_size=a.batch // self.dp,
            global_batch_size=a.batch,
            consumed_train_samples=a.batch * max(a.train_steps, 0),
            consumed_valid_samples=0,
            train_iters=max(a.train_steps, 0),
            seed=a.seed,
            lr=a.lr,
            min_lr=a.lr / 10,
            optimizer="adam",
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            weight_decay=0.0,
            clip_grad=1.0,
            use_distributed_optimizer=a.dist_opt,
            fp16=False,
            bf16=False,
            params_dtype=self.torch.float32,
            transformer_impl="local",
            ckpt_format="torch",
            use_dist_ckpt=False,
            no_save_optim=not a.optimizer,
            no_save_rng=False,
            data_parallel_random_init=False,
            iteration=a.iteration,
        )

    def legacy_path(self, root: str) -> str:
        sub = f"mp_rank_{self.tp_rank:02d}"
        if self.a.pp > 1:
            sub += f"_{self.pp_rank:03d}"
        return os.path.join(root, f"iter_{self.a.iteration:07d}", sub, "model_optim_rng.pt")

    def rng_state(self):
        import numpy as np
        from megatron.core import tensor_parallel

        torch = self.torch
        return [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                # On CUDA this is torch.cuda.get_rng_state(); CPU stand-in here.
                "cuda_rng_state": torch.get_rng_state(),
                "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
            }
        ]

    def save_legacy(self, root: str):
        torch = self.torch
        t = time.time()
        state = {
            "args": self.megatron_args(),
            "checkpoint_version": 3.0,
            "iteration": self.a.iteration,
            "model": self.model.state_dict_for_save_checkpoint(),
        }
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["opt_param_scheduler"] = self.scheduler.state_dict()
        state["rng_state"] = self.rng_state()
        state["num_floating_point_operations_so_far"] = 0
        path = self.legacy_path(root)
        if self.optimizer is not None and self.a.dist_opt:
            # Megatron-LM: optimizer.save_parameter_state(<dir>/distrib_optim.pt), all dp ranks
            # take part (gather to dp rank 0).
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.optimizer.save_parameter_state(os.path.join(os.path.dirname(path), "distrib_optim.pt"))
        if self.dp_rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, path)
        self.dist.barrier()
        if self.dist.get_rank() == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(self.a.iteration))
        self.dist.barrier()
        log0(f"TIME save_legacy {time.time() - t:.2f}")

    def load_legacy(self, root: str):
        torch = self.torch
        t = time.time()
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            it = int(f.read().strip())
        self.a.iteration = it
        path = self.legacy_path(root)
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"], strict=True)
        if self.optimizer is not None and not self.a.no_load_optim and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.a.dist_opt:
                self.optimizer.load_parameter_state(
                    os.path.join(os.path.dirname(path), "distrib_optim.pt")
                )
            self._untie_steps()
            if "opt_param_scheduler" in state:
                self.scheduler.load_state_dict(state["opt_param_scheduler"])
        self.dist.barrier()
        log0(f"TIME load_legacy {time.time() - t:.2f}")

    # ------------------------------------------------------------------ dist format
    def sharded_sd_metadata(self):
        md = {"dp_cp_group": self.ps.get_data_parallel_group(with_context_parallel=True),
              "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if self.a.dist_opt:
            md["distrib_optim_sharding_type"] = self.a.sharding_type
        return md

    def save_dist(self, root: str):
        from megatron.core import dist_checkpointing

        t = time.time()
        md = self.sharded_sd_metadata()
        if self.dist.get_rank() == 0:
            os.makedirs(root, exist_ok=True)
        self.dist.barrier()
        sd = self.model.sharded_state_dict(metadata=md)
        if self.optimizer is not None:
            model_sd = sd
            sd = {"model": model_sd,
                  "optimizer": self.optimizer.sharded_state_dict(model_sd, metadata=md),
                  "opt_param_scheduler": self.scheduler.state_dict(),
                  "iteration": self.a.iteration}
        if self.a.dist_args == "on":  # Megatron-LM's generate_state_dict puts these in common.pt
            sd["args"] = self.megatron_args()
            sd["checkpoint_version"] = 3.0
            sd.setdefault("iteration", self.a.iteration)
        dist_checkpointing.save(sd, root, content_metadata=_clean_md(md))
        self.dist.barrier()
        log0(f"TIME save_dist {time.time() - t:.2f}")

    def _fill_adam_state(self):
        """Give every Adam param zero moments and a step, so is_loading sharded_state_dict works.

        A fresh torch Adam has empty state; DistributedOptimizer.state_dict() (called by
        sharded_state_dict) reads ``s["step"]`` of every param and asserts one value.
        """
        torch = self.torch
        for opt in _inner_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    st = opt.state[p]
                    if len(st) == 0:
                        st["exp_avg"] = torch.zeros_like(p.data)
                        st["exp_avg_sq"] = torch.zeros_like(p.data)
                    if "step" not in st:
                        st["step"] = torch.tensor(0.0)

    def _untie_steps(self):
        """After loading, each Adam param needs its own step tensor.

        DistributedOptimizer.load_state_dict assigns ONE step tensor to every param's
        torch-Adam state; torch Adam then increments it once per param per step, so the
        bias correction goes wrong from the second step on (losses drift silently).
        """
        for opt in _inner_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    st = opt.state[p]
                    if "step" in st and isinstance(st["step"], self.torch.Tensor):
                        st["step"] = st["step"].clone()

    def optim_summary(self, tag: str):
        """Print per-param Adam state checksums (rank 0) when TENPLEX_DEBUG_OPT is set."""
        if not os.environ.get("TENPLEX_DEBUG_OPT") or self.optimizer is None:
            return
        for opt in _inner_optimizers(self.optimizer):
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    st = opt.state[p]
                    desc = {k: (round(float(v.double().sum()), 6) if v.numel() > 1 else float(v))
                            for k, v in st.items()}
                    log0(f"OPT {tag} g{gi} p{pi} numel={p.numel()} param={float(p.double().sum()):.6f} {desc}")

    def load_dist(self, root: str):
        from megatron.core import dist_checkpointing

        t = time.time()
        md = self.sharded_sd_metadata()
        with_optim = self.optimizer is not None and not self.a.no_load_optim
        if with_optim:
            saved_md = dist_checkpointing.load_content_metadata(root) or {}
            if "distrib_optim_sharding_type" in saved_md:
                md["distrib_optim_sharding_type"] = saved_md["distrib_optim_sharding_type"]
        sd = self.model.sharded_state_dict(metadata=md)
        if with_optim:
            self._fill_adam_state()
            model_sd = sd
            sd = {"model": model_sd,
                  "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=md),
                  "opt_param_scheduler": None, "iteration": None}
            # Common (non-sharded) entries come back from common.pt.
            del sd["opt_param_scheduler"], sd["iteration"]
        loaded = dist_checkpointing.load(sd, root)
        # save(..., content_metadata=md) stores md in common.pt; load returns it as a key.
        loaded.pop("content_metadata", None)
        if with_optim:
            self.model.load_state_dict(loaded["model"], strict=True)
            self.optimizer.load_state_dict(loaded["optimizer"])
            self._untie_steps()
            if "opt_param_scheduler" in loaded:
                self.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        else:
            # Sharded tensors come back under the structure we passed in (flat model
            # keys); common.pt entries of a checkpoint written with an optimizer
            # (optimizer param_groups, opt_param_scheduler, iteration) come back as
            # extra top-level keys: keep only the model's own keys.
            model_keys = set(self.model.state_dict().keys())
            for extra in ("args", "checkpoint_version", "iteration"):
                loaded.pop(extra, None)
            state = {k: v for k, v in loaded.items() if k in model_keys}
            self.model.load_state_dict(state, strict=True)
        self.dist.barrier()
        log0(f"TIME load_dist {time.time() - t:.2f}")


def _clean_md(md: dict) -> dict:
    return {k: v for k, v in md.items() if k != "dp_cp_group"}


def _inner_optimizers(opt):
    subs = getattr(opt, "chained_optimizers", None) or [opt]
    return [s.optimizer for s in subs]


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
    log0(f"TIME total {time.time() - _T0:.2f}")
    w.dist.barrier()
    w.dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

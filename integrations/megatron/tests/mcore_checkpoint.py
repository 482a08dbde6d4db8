"""The worker's checkpoint formats: Megatron-LM's legacy per-rank files and dist_checkpointing.

Mixed into :class:`mcore_worker.Worker`, which supplies ``a`` (the parsed flags), ``torch``,
``dist``, ``ps`` (megatron's parallel_state), ``models`` (one per virtual chunk; ``model`` is the
first), the optimizer and scheduler, ``dtype`` and the tp/pp/dp/cp/ep ranks.

Legacy rules follow Megatron-LM core_v0.16.1 megatron/training/checkpointing.py:
  * path: get_checkpoint_name -> iter_XXXXXXX/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt
    (_PPP when pp world > 1, _EEE when ep world > 1; tp is the DENSE tp rank);
  * writer: save_checkpoint writes model_optim_rng.pt on ranks with
    mpu.get_expert_data_parallel_rank() == 0;
  * generate_state_dict: key 'model' for one chunk, 'model0', 'model1', ... for vpp;
  * distrib_optim.pt next to it: optimizer.save_parameter_state (all ranks call it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import time


def rng_digest(state: dict) -> str:
    """A digest of one rank's Megatron RNG state (Python, NumPy, torch, device and tracker states)."""
    import numpy as np

    h = hashlib.sha256()
    h.update(repr(state["random_rng_state"]).encode())
    np_state = state["np_rng_state"]
    h.update(repr((np_state[0],) + tuple(np_state[2:])).encode() + np.asarray(np_state[1]).tobytes())
    for key in ("torch_rng_state", "cuda_rng_state"):
        h.update(key.encode() + state[key].numpy().tobytes())
    for name, value in sorted(state["rng_tracker_states"].items()):
        h.update(name.encode() + value.numpy().tobytes())
    return h.hexdigest()[:16]


TRACKER = "latest_checkpointed_iteration.txt"


def megatron_load_dir(root: str) -> str:
    """The folder Megatron-LM's ``load_checkpoint`` loads from ``--load root`` (core_v0.16.1 to 0.19.2,
    ``megatron/training/checkpointing.py``): ``read_metadata`` reads the tracker, then
    ``get_checkpoint_name(root, iteration, release, return_base_dir=True)`` names the iteration
    folder. Without a tracker Megatron-LM starts from scratch; here a folder without one is
    taken as a bare ``dist_checkpointing`` folder (the project's older tests)."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return root
    with open(tracker) as f:
        text = f.read().strip()
    return os.path.join(root, "release" if text == "release" else f"iter_{int(text):07d}")


def write_tracker(root: str, iteration: int) -> None:
    """Megatron-LM's ``save_checkpoint`` writes the tracker last, on rank 0."""
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))


def log0(*msg) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*msg, flush=True)


class CheckpointMixin:
    # ------------------------------------------------------------------ args
    def megatron_args(self) -> argparse.Namespace:
        """The subset of Megatron-LM's parsed args that matter for a checkpoint reader (Megatron-LM's
        names; every setting of the model, the HF export's included)."""
        a = self.a
        return argparse.Namespace(
            num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.ffn, num_attention_heads=a.heads,
            group_query_attention=a.query_groups != a.heads, num_query_groups=a.query_groups,
            kv_channels=a.hidden // a.heads, max_position_embeddings=a.max_pos, seq_length=a.seq,
            position_embedding_type=a.position, use_rotary_position_embeddings=a.position == "rope",
            add_position_embedding=a.position == "learned_absolute", rotary_percent=1.0,
            rotary_base=a.rotary_base, rotary_interleaved=a.rotary_interleaved,
            use_rope_scaling=a.rope_scaling is not None, rope_scaling_factor=a.rope_scaling or 8.0,
            rotary_seq_len_interpolation_factor=None, swiglu=a.swiglu,
            untie_embeddings_and_output_weights=a.untie, normalization=a.norm, norm_epsilon=a.eps,
            apply_layernorm_1p=False, add_bias_linear=a.bias == "on", add_qkv_bias=a.add_qkv_bias,
            qk_layernorm=a.qk_layernorm, multi_latent_attention=False, mtp_num_layers=None,
            vocab_size=a.vocab if a.args_vocab == "on" else None, padded_vocab_size=self.padded_vocab,
            make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
            tokenizer_type="NullTokenizer" if a.args_vocab == "on" else "GPT2BPETokenizer",
            vocab_file=None, tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
            account_for_embedding_in_pipeline_split=a.account_for in ("embedding", "both"),
            account_for_loss_in_pipeline_split=a.account_for in ("loss", "both"),
            virtual_pipeline_model_parallel_size=a.vpp, context_parallel_size=a.cp,
            expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp,
            num_experts=a.experts, moe_router_topk=a.topk, moe_ffn_hidden_size=a.moe_ffn or a.ffn,
            moe_shared_expert_intermediate_size=a.shared_ffn, moe_layer_freq=a.moe_layer_freq,
            moe_grouped_gemm=a.grouped_gemm, moe_router_enable_expert_bias=a.expert_bias,
            moe_router_pre_softmax=a.pre_softmax,
            moe_router_score_function="sigmoid" if a.expert_bias else "softmax",
            moe_router_topk_scaling_factor=None,
            data_parallel_size=self.dp, world_size=self.world, micro_batch_size=a.batch // self.dp,
            global_batch_size=a.batch, consumed_train_samples=a.batch * max(a.train_steps, 0),
            consumed_valid_samples=0, train_iters=max(a.train_steps, 0), seed=a.seed, lr=a.lr,
            min_lr=a.lr / 10, optimizer="adam", adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
            weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=a.dist_opt, fp16=a.fp16, bf16=a.bf16,
            params_dtype=self.dtype, accumulate_allreduce_grads_in_fp32=True,
            transformer_impl="transformer_engine" if a.names == "te" else "local",
            ckpt_format="torch", use_dist_ckpt=False, no_save_optim=not a.optimizer, no_save_rng=False,
            data_parallel_random_init=False, iteration=a.iteration)

    # ------------------------------------------------------------------ legacy format
    def legacy_dir(self, root: str) -> str:
        sub = f"mp_rank_{self.tp_rank:02d}"
        if self.a.pp > 1:
            sub += f"_{self.pp_rank:03d}"
        if self.a.ep > 1:
            sub += f"_{self.ep_rank:03d}"
        return os.path.join(root, f"iter_{self.a.iteration:07d}", sub)

    def legacy_writes(self) -> bool:
        if self.a.legacy_writer == "dp0":
            return self.dp_rank == 0 and self.cp_rank == 0
        return self.edp_rank == 0

    def model_keys(self):
        return ["model"] if len(self.models) == 1 else [f"model{i}" for i in range(len(self.models))]

    def rng_state(self):
        import numpy as np
        from megatron.core import tensor_parallel

        torch = self.torch
        return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                 "torch_rng_state": torch.get_rng_state(),
                 "cuda_rng_state": torch.cuda.get_rng_state() if self.a.device == "cuda" else torch.get_rng_state(),
                 "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}]

    def save_legacy(self, root: str):
        from te_names import to_te_names

        torch = self.torch
        t = time.time()
        state = {"args": self.megatron_args(), "checkpoint_version": 3.0, "iteration": self.a.iteration}
        for k, m in zip(self.model_keys(), self.models):
            state[k] = m.state_dict_for_save_checkpoint()
            if self.a.names == "te":
                state[k] = to_te_names(state[k])
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["opt_param_scheduler"] = self.scheduler.state_dict()
        state["rng_state"] = self.rng_state()
        state["num_floating_point_operations_so_far"] = 0
        d = self.legacy_dir(root)
        if self.optimizer is not None and self.a.dist_opt:
            # Megatron-LM: optimizer.save_parameter_state(<dir>/distrib_optim.pt); all dp ranks
            # take part (gather to dp rank 0)
            os.makedirs(d, exist_ok=True)
            self.optimizer.save_parameter_state(os.path.join(d, "distrib_optim.pt"))
        if self.legacy_writes():
            os.makedirs(d, exist_ok=True)
            torch.save(state, os.path.join(d, "model_optim_rng.pt"))
            print(f"RNG tp={self.tp_rank} pp={self.pp_rank} dp={self.dp_rank} {rng_digest(state['rng_state'][0])}\n",
                  end="", flush=True)
            print(f"LEGACY_WRITE rank={self.dist.get_rank()} {os.path.relpath(d, root)}", flush=True)
        self.dist.barrier()
        if self.dist.get_rank() == 0:
            write_tracker(root, self.a.iteration)
        self.dist.barrier()
        log0(f"TIME save_legacy {time.time() - t:.2f}")

    def load_legacy(self, root: str):
        from te_names import from_te_names

        torch = self.torch
        t = time.time()
        with open(os.path.join(root, TRACKER)) as f:
            self.a.iteration = int(f.read().strip())
        d = self.legacy_dir(root)
        state = torch.load(os.path.join(d, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
        for k, m in zip(self.model_keys(), self.models):
            sd = from_te_names(state[k]) if self.a.names == "te" else state[k]
            m.load_state_dict(sd, strict=self.a.strict == "on")
        if self.a.load_rng:
            self.restore_rng(state["rng_state"])
        if self.optimizer is not None and not self.a.no_load_optim and "optimizer" in state:
            self._load_optimizer(state["optimizer"], state.get("opt_param_scheduler"),
                                 os.path.join(d, "distrib_optim.pt") if self.a.dist_opt else None)
        self._loaded("legacy", root, t)

    def restore_rng(self, states: list) -> None:
        """Megatron-LM's RNG restore (``load_checkpoint``), then a draw from every tracker stream
        (which fails for a state of the wrong generator kind); prints the restored state's digest."""
        import numpy as np
        from megatron.core import tensor_parallel

        torch = self.torch
        state = states[self.dp_rank] if len(states) > 1 else states[0]
        print(f"RNG tp={self.tp_rank} pp={self.pp_rank} dp={self.dp_rank} {rng_digest(state)}\n", end="", flush=True)
        random.setstate(state["random_rng_state"])
        np.random.set_state(state["np_rng_state"])
        torch.set_rng_state(state["torch_rng_state"])
        torch.Generator().set_state(state["cuda_rng_state"])  # the CPU shim's device generator
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.set_states(state["rng_tracker_states"])
        for name in state["rng_tracker_states"]:
            with tracker.fork(name):
                torch.rand(1)

    def rng_per_dp(self) -> bool:
        """Whether Megatron-LM of this megatron-core version keys RNG states by dp rank too: core_v0.16.0
        and 0.16.1 do at ep > 1 (Megatron-LM #2658, reverted by #3736 in 0.17.0)."""
        import megatron.core

        return self.a.ep > 1 and megatron.core.__version__.startswith("0.16.")

    def rng_object(self):
        """Megatron-LM's ``get_rng_state(ckpt_format='torch_dist')``: a ShardedObject on the (pp, tp) grid,
        replicated over the dp-cp ranks, or (:meth:`rng_per_dp`) on the (pp, tp, dp-cp) grid, one per rank."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        dp_cp = self.ps.get_data_parallel_rank(with_context_parallel=True)
        if self.rng_per_dp():
            size = self.ps.get_data_parallel_world_size(with_context_parallel=True)
            return ShardedObject("rng_state", self.rng_state(), (self.a.pp, self.a.tp, size),
                                 (self.pp_rank, self.tp_rank, dp_cp), replica_id=0)
        return ShardedObject("rng_state", self.rng_state(), (self.a.pp, self.a.tp),
                             (self.pp_rank, self.tp_rank), replica_id=dp_cp)

    # ------------------------------------------------------------------ dist format
    def sharded_sd_metadata(self):
        md = {"dp_cp_group": self.ps.get_data_parallel_group(with_context_parallel=True),
              "singleton_local_shards": bool(int(os.environ.get("R13_SINGLETON", "0"))),
              "chained_optim_avoid_prefix": True}
        if self.a.dist_opt:
            md["distrib_optim_sharding_type"] = self.a.sharding_type
        return md

    def model_sharded(self, md):
        return {k: m.sharded_state_dict(metadata=md) for k, m in zip(self.model_keys(), self.models)}

    def save_dist(self, root: str):
        """Megatron-LM's ``generate_state_dict`` for torch_dist: the chunks under ``model``/``model<i>``,
        the optimizer and scheduler, ``iteration``, and (``--dist-args on``) ``args`` in common.pt."""
        from megatron.core import dist_checkpointing

        t = time.time()
        md = self.sharded_sd_metadata()
        save_root = root
        if self.a.dist_layout == "megatron":  # Megatron-LM's --save layout
            root = os.path.join(root, f"iter_{self.a.iteration:07d}")
        if self.dist.get_rank() == 0:
            os.makedirs(root, exist_ok=True)
        self.dist.barrier()
        sd = self.model_sharded(md)
        if self.optimizer is not None:
            sd["optimizer"] = self.optimizer.sharded_state_dict(sd, metadata=md)
            sd["opt_param_scheduler"] = self.scheduler.state_dict()
        sd["iteration"] = self.a.iteration
        if self.a.save_rng:
            sd["rng_state"] = self.rng_object()
            if self.dp_rank == 0 or self.rng_per_dp():
                print(f"RNG tp={self.tp_rank} pp={self.pp_rank} dp={self.dp_rank} "
                      f"{rng_digest(self.rng_state()[0])}\n", end="", flush=True)
        if self.a.dist_args == "on":
            sd["args"] = self.megatron_args()
            sd["checkpoint_version"] = 3.0
        dist_checkpointing.save(sd, root, self.save_strategy(), content_metadata=_clean_md(md))
        self.dist.barrier()
        if save_root != root and self.dist.get_rank() == 0:
            write_tracker(save_root, self.a.iteration)
        self.dist.barrier()
        log0(f"TIME save_dist {time.time() - t:.2f}")

    def save_strategy(self):
        """Megatron-LM's ``save_checkpoint`` for torch_dist (core_v0.16.1 to 0.19.2): the default
        strategy, wrapped by ``FullyParallelSaveStrategyWrapper`` on the dp-cp group when
        ``--ckpt-fully-parallel-save`` (its default), so that each replica's writing is spread over
        the data-parallel ranks; None (``dist_checkpointing.save``'s default) otherwise."""
        if not self.a.fully_parallel_save:
            return None
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                self.ps.get_data_parallel_group(with_context_parallel=True))

    def _adapt_chained(self, opt_sd):
        """Fit a loaded common.pt optimizer entry to this run's chained optimizers
        (``R13_ADAPT_CHAINED=1``; NOTES.md fact 6.7).

        At ep == 1 expert params sit in the dense optimizer (one DistributedOptimizer,
        common.pt 'optimizer' = {'optimizer': {'param_groups'}, 'param_state_sharding_type'});
        at ep > 1 there are two ({0: dense, 1: expert}); DistributedOptimizer.load_state_dict
        matches groups by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr).
        dist_checkpointing.load returns the SAVED common structure merged with this run's
        sharded template, so an ep change fails (KeyError 'optimizer' for ep>1 -> ep=1).
        """
        n = len(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))
        if n == 1 and 0 in opt_sd and 1 in opt_sd:  # saved at ep>1, loading at ep=1
            out = {k: v for k, v in opt_sd.items() if k not in (0, 1)}
            out.update(opt_sd[0])
            print("ADAPT chained {0: dense, 1: expert} -> single (dense param_groups)", flush=True)
            return out
        if n == 2 and "optimizer" in opt_sd and isinstance(opt_sd.get(0), dict):  # ep=1 -> ep>1
            common = {k: opt_sd[k] for k in ("optimizer", "param_state_sharding_type") if k in opt_sd}
            out = {0: {**opt_sd[0], **common}, 1: dict(opt_sd[1])}
            groups = [dict(g, is_expert_parallel=True) for g in common["optimizer"]["param_groups"]]
            out[1].update({**common, "optimizer": {**common["optimizer"], "param_groups": groups}})
            print("ADAPT single -> chained {0: dense, 1: expert (groups with is_expert_parallel=True)}", flush=True)
            return out
        return opt_sd

    def load_dist(self, root: str):
        """Load a torch_dist folder (bare, or a ``--save`` folder with its tracker) at this run's
        parallelism: the chunks, and the optimizer where one exists (unless ``--no-load-optim``)."""
        from megatron.core import dist_checkpointing

        root = megatron_load_dir(root)
        t = time.time()
        md = self.sharded_sd_metadata()
        with_optim = self.optimizer is not None and not self.a.no_load_optim
        if with_optim:
            saved = dist_checkpointing.load_content_metadata(root) or {}
            if "distrib_optim_sharding_type" in saved:
                md["distrib_optim_sharding_type"] = saved["distrib_optim_sharding_type"]
        sd = self.model_sharded(md)
        if with_optim:
            self._fill_adam_state()
            sd["optimizer"] = self.optimizer.sharded_state_dict(sd, is_loading=True, metadata=md)
        if self.a.load_rng:
            sd["rng_state"] = self.rng_object()
        strict = os.environ.get("R13_LOAD_STRICT")  # e.g. "assume_ok_unexpected" / "raise_all"
        loaded = dist_checkpointing.load(sd, root, strict=strict) if strict else dist_checkpointing.load(sd, root)
        if self.a.load_rng:
            self.restore_rng(loaded.pop("rng_state"))
        for k, m in zip(self.model_keys(), self.models):
            m.load_state_dict(loaded[k], strict=self.a.strict == "on")
        if with_optim:
            opt_sd = loaded["optimizer"]
            if os.environ.get("R13_ADAPT_CHAINED") == "1":
                opt_sd = self._adapt_chained(opt_sd)
            self._load_optimizer(opt_sd, loaded.get("opt_param_scheduler"))
        self._loaded("dist", root, t)

    def _load_optimizer(self, opt_sd: dict, scheduler_sd, param_state: str | None = None) -> None:
        """Megatron-LM's optimizer load: the state dict, the distributed optimizer's parameter state
        file (legacy ``distrib_optim.pt``), each Adam param its own step, then the scheduler."""
        self.optimizer.load_state_dict(opt_sd)
        if param_state is not None:
            self.optimizer.load_parameter_state(param_state)
        self._untie_steps()
        if scheduler_sd is not None:
            self.scheduler.load_state_dict(scheduler_sd)

    def _loaded(self, fmt: str, root: str, t: float) -> None:
        self.dist.barrier()
        log0(f"LOADED {fmt} {root}")
        log0(f"TIME load_{fmt} {time.time() - t:.2f}")

    # ------------------------------------------------------------------ optimizer state
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

    def optim_by_name(self) -> dict:
        """``{global parameter name: {"exp_avg", "exp_avg_sq"}}`` of a distributed optimizer that holds
        whole parameters (one process: tp = pp = dp = 1), read from megatron-core's own groups
        (``model_*_groups`` beside ``shard_*_groups``, whose shards key the inner Adam's state)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for sub in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            pairs = [*zip(sub.model_fp32_groups, sub.shard_fp32_groups),
                     *zip(sub.model_float16_groups, sub.shard_fp32_from_float16_groups)]
            for models, shards in pairs:
                for model_param, shard in zip(models, shards):
                    state = sub.optimizer.state.get(shard, {})
                    if "exp_avg" in state:
                        out[names[id(model_param)]] = {
                            k: state[k].detach().clone().view(model_param.shape) for k in ("exp_avg", "exp_avg_sq")}
        return out

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


def _clean_md(md: dict) -> dict:
    return {k: v for k, v in md.items() if k != "dp_cp_group"}


def _inner_optimizers(opt):
    subs = getattr(opt, "chained_optimizers", None) or [opt]
    return [s.optimizer for s in subs]

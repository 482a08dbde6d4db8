"""Checkpoint formats for moe_worker: Megatron-LM legacy per-rank files and torch_dist.

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
import os
import random
import time

from mcore_checkpoint import CheckpointMixin as DenseCheckpointMixin, log0, megatron_load_dir


def te_prefixes(model) -> dict[str, str]:
    """``{local key prefix: TransformerEngine key prefix}`` of every layer of ``model`` (chunk-local).

    Taken from megatron-core's own map, each layer's ``submodules_config.sharded_state_dict_keys_map``
    (core_v0.16.1 ``get_gpt_layer_local_spec``: ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``,
    ``pre_mlp_layernorm.`` -> ``mlp.linear_fc1.layer_norm_``), which renames the local spec's keys to
    the TE spec's. An MoE layer's ``pre_mlp_layernorm`` is its own module in the TE spec
    (``get_gpt_layer_with_transformer_engine_spec``: ``pre_mlp_layernorm=backend.layer_norm() if
    num_experts``), so there only the attention norm is renamed.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    out = {}
    for i, layer in enumerate(model.decoder.layers):
        for local, te in layer.submodules_config.sharded_state_dict_keys_map.items():
            if local == "pre_mlp_layernorm." and isinstance(layer.mlp, MoELayer):
                continue
            out[f"decoder.layers.{i}.{local}"] = f"decoder.layers.{i}.{te}"
    return out


def use_te_dist_names(model) -> None:
    """Make ``model.sharded_state_dict`` use the TE spec's torch_dist keys: each layer's keys map
    without the entries :func:`te_prefixes` drops (an MoE layer's separate ``pre_mlp_layernorm``)."""
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in model.decoder.layers:
        keep = {k: v for k, v in layer.submodules_config.sharded_state_dict_keys_map.items()
                if not (k == "pre_mlp_layernorm." and isinstance(layer.mlp, MoELayer))}
        layer.submodules_config = dataclasses.replace(layer.submodules_config, sharded_state_dict_keys_map=keep)


def to_te_names(state: dict, prefixes: dict) -> dict:
    """A local-spec model state dict under TE's names, as a TE model's ``state_dict`` holds them: norms
    renamed by ``prefixes``; every ``_extra_state`` an empty uint8 tensor (TE's ``get_extra_state``
    without FP8), plus ``self_attention.core_attention._extra_state`` (``TEDotProductAttention``)."""
    import torch

    out = {}
    for key, value in state.items():
        for local, te in prefixes.items():
            if key.startswith(local):
                key = te + key[len(local):]
                break
        if key.endswith("._extra_state"):
            value = torch.empty(0, dtype=torch.uint8)
            if key.endswith(".self_attention.linear_proj._extra_state"):
                out[key.replace("linear_proj", "core_attention")] = torch.empty(0, dtype=torch.uint8)
        out[key] = value
    return out


def from_te_names(state: dict, prefixes: dict) -> dict:
    """:func:`to_te_names` undone, for loading into the local-spec model (extra states must be empty)."""
    out = {}
    for key, value in state.items():
        if key.endswith("._extra_state"):
            assert value is None or value.numel() == 0, (key, value)
            if ".core_attention." in key:
                continue
            value = None
        for local, te in prefixes.items():
            if key.startswith(te):
                key = local + key[len(te):]
                break
        out[key] = value
    return out


class CheckpointMixin(DenseCheckpointMixin):
    """The dense worker's checkpointing (Adam-state helpers, log0), with expert files and chunks."""

    def megatron_args(self) -> argparse.Namespace:
        a = self.a
        return argparse.Namespace(
            num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.ffn,
            num_attention_heads=a.heads, group_query_attention=a.query_groups != a.heads,
            num_query_groups=a.query_groups, kv_channels=a.hidden // a.heads,
            max_position_embeddings=a.max_pos, seq_length=a.seq, position_embedding_type=a.position,
            swiglu=a.swiglu, untie_embeddings_and_output_weights=a.untie, normalization=a.norm,
            add_bias_linear=a.bias == "on", vocab_size=a.vocab, padded_vocab_size=self.padded_vocab,
            make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
            tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
            virtual_pipeline_model_parallel_size=a.vpp, context_parallel_size=a.cp,
            expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp,
            num_experts=a.experts, moe_router_topk=a.topk, moe_ffn_hidden_size=a.moe_ffn or a.ffn,
            moe_shared_expert_intermediate_size=a.shared_ffn, moe_layer_freq=a.moe_layer_freq,
            moe_grouped_gemm=a.grouped_gemm, moe_router_enable_expert_bias=a.expert_bias,
            data_parallel_size=self.dp, world_size=self.world, use_distributed_optimizer=a.dist_opt,
            ckpt_format="torch", iteration=a.iteration, params_dtype=self.torch.float32,
            fp16=False, bf16=False, no_save_optim=not a.optimizer)

    # ------------------------------------------------------------------ legacy
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

    def rng_state(self):
        import numpy as np
        from megatron.core import tensor_parallel

        torch = self.torch
        return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                 "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                 "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}]

    def model_keys(self):
        return ["model"] if len(self.models) == 1 else [f"model{i}" for i in range(len(self.models))]

    def save_legacy(self, root: str):
        torch = self.torch
        t = time.time()
        state = {"args": self.megatron_args(), "checkpoint_version": 3.0, "iteration": self.a.iteration}
        for k, m in zip(self.model_keys(), self.models):
            state[k] = m.state_dict_for_save_checkpoint()
            if self.a.names == "te":
                state[k] = to_te_names(state[k], te_prefixes(m))
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["opt_param_scheduler"] = self.scheduler.state_dict()
        state["rng_state"] = self.rng_state()
        state["num_floating_point_operations_so_far"] = 0
        d = self.legacy_dir(root)
        if self.optimizer is not None and self.a.dist_opt:
            os.makedirs(d, exist_ok=True)
            self.optimizer.save_parameter_state(os.path.join(d, "distrib_optim.pt"))
        if self.legacy_writes():
            os.makedirs(d, exist_ok=True)
            torch.save(state, os.path.join(d, "model_optim_rng.pt"))
            print(f"LEGACY_WRITE rank={self.dist.get_rank()} {os.path.relpath(d, root)}", flush=True)
        self.dist.barrier()
        if self.dist.get_rank() == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(self.a.iteration))
        self.dist.barrier()
        log0(f"TIME save_legacy {time.time() - t:.2f}")

    def load_legacy(self, root: str):
        torch = self.torch
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            self.a.iteration = int(f.read().strip())
        d = self.legacy_dir(root)
        state = torch.load(os.path.join(d, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
        for k, m in zip(self.model_keys(), self.models):
            sd = from_te_names(state[k], te_prefixes(m)) if self.a.names == "te" else state[k]
            m.load_state_dict(sd, strict=self.a.strict == "on")
        if self.optimizer is not None and not self.a.no_load_optim and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.a.dist_opt:
                self.optimizer.load_parameter_state(os.path.join(d, "distrib_optim.pt"))
            self._untie_steps()
            self.scheduler.load_state_dict(state["opt_param_scheduler"])
        self.dist.barrier()
        log0(f"LOADED legacy {root}")

    # ------------------------------------------------------------------ torch_dist
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
        from megatron.core import dist_checkpointing

        t = time.time()
        md = self.sharded_sd_metadata()
        if self.dist.get_rank() == 0:
            os.makedirs(root, exist_ok=True)
        self.dist.barrier()
        sd = self.model_sharded(md)
        if self.optimizer is not None:
            sd["optimizer"] = self.optimizer.sharded_state_dict(sd, metadata=md)
            sd["opt_param_scheduler"] = self.scheduler.state_dict()
        sd["iteration"] = self.a.iteration
        sd["args"] = self.megatron_args()  # Megatron-LM's generate_state_dict puts these in common.pt
        sd["checkpoint_version"] = 3.0
        dist_checkpointing.save(sd, root, content_metadata={k: v for k, v in md.items() if k != "dp_cp_group"})
        self.dist.barrier()
        log0(f"TIME save_dist {time.time() - t:.2f}")

    def _adapt_chained(self, opt_sd):
        """Fact 6: make common.pt's optimizer param_groups fit this run's chained optimizers.

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
        from megatron.core import dist_checkpointing

        root = megatron_load_dir(root)
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
        strict = os.environ.get("R13_LOAD_STRICT")  # e.g. "assume_ok_unexpected" / "raise_all"
        loaded = dist_checkpointing.load(sd, root, strict=strict) if strict else dist_checkpointing.load(sd, root)
        for k, m in zip(self.model_keys(), self.models):
            m.load_state_dict(loaded[k], strict=self.a.strict == "on")
        if with_optim:
            opt_sd = loaded["optimizer"]
            if os.environ.get("R13_ADAPT_CHAINED") == "1":
                opt_sd = self._adapt_chained(opt_sd)
            self.optimizer.load_state_dict(opt_sd)
            self._untie_steps()
            if "opt_param_scheduler" in loaded:
                self.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        self.dist.barrier()
        log0(f"LOADED dist {root}")

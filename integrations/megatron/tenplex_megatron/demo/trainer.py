"""The demo's worker: a real megatron-core GPT, trained with gloo on CPU through changing configs.

megatron-core supplies the model (``GPTModel`` with the local layer spec) and
its tensor- and pipeline-parallel groups. Its training path (the pipeline
schedules, DDP and the distributed optimizer) expects CUDA streams and
events. So the training step is the smallest piece that works on CPU:
- a pipelined forward and backward pass with one micro-batch per step,
  passing the hidden state ``[s, b, h]`` between stages with
  ``dist.send``/``dist.recv`` and ``model.set_input_tensor``;
- gradients averaged over the data-parallel group (all-reduce);
- torch's Adam on every rank's local parameters.

Adam is elementwise, so its update does not depend on how parameters are
sharded. With tp-replicated norms, and no sequence parallelism or tied
embeddings, this is the same arithmetic as Megatron's own step.

A process runs one *group* of consecutive phases with the same number of
workers. Between phases of a group, the state moves live with
:func:`tenplex.reconfigure`. At the end of a group, the state is staged to a
host-memory store, which the next group's new processes load.
"""

from __future__ import annotations

import datetime
import os
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist

import tenplex
from tenplex.ptree.tree import PTree, TensorLeaf, ValueLeaf

from tenplex_megatron.config import MegatronConfig
from tenplex_megatron.layouts import optimizer_path, param_specs
from tenplex_megatron.legacy import rank_keys

__all__ = ["demo_tree", "initial_state", "run_group"]

ADAM = ("exp_avg", "exp_avg_sq")
VALUES = ("optimizer/step", "data/consumed_samples", "data/seed")


def demo_tree(cfg: MegatronConfig) -> PTree:
    """Model parameters, Adam moments (the parameters' layouts), step and data position."""
    leaves: dict[str, Any] = {}
    specs = param_specs(cfg)
    for s in specs:
        leaves[s.path] = s.leaf
    for state in ADAM:
        for s in specs:
            leaves[optimizer_path(state, s.path)] = TensorLeaf(s.leaf.shape, "float32", s.leaf.layout)
    for path in VALUES:
        leaves[path] = ValueLeaf()
    return PTree(leaves, cfg.num_layers)


def initial_state(tree: PTree, seed: int) -> dict[str, Any]:
    """The same initial global model at every config: N(0, 0.02) weights, unit norms, zero biases."""
    out: dict[str, Any] = {}
    for path, leaf in tree.tensors():
        if path.startswith("optimizer/"):
            out[path] = torch.zeros(leaf.shape)
        elif "layernorm" in path and path.endswith("weight"):
            out[path] = torch.ones(leaf.shape)
        elif path.endswith("bias"):
            out[path] = torch.zeros(leaf.shape)
        else:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(path.encode()))
            out[path] = torch.randn(leaf.shape, generator=gen) * 0.02
    out.update({"optimizer/step": 0, "data/consumed_samples": 0, "data/seed": seed})
    return out


class _Model:
    """One phase's megatron-core model, optimizer and parallel state on this process."""

    def __init__(self, cfg: MegatronConfig, config, args):
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig

        ps.initialize_model_parallel(tensor_model_parallel_size=config.tp,
                                     pipeline_model_parallel_size=config.pp)
        model_parallel_cuda_manual_seed(args["seed"])
        self.ps, self.cfg, self.config = ps, cfg, config
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        tc = TransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
            ffn_hidden_size=cfg.ffn_hidden_size, normalization=cfg.normalization,
            add_bias_linear=cfg.add_bias_linear, tensor_model_parallel_size=config.tp,
            pipeline_model_parallel_size=config.pp, pipeline_dtype=torch.float32,
            params_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0,
            attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
            masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
            gradient_accumulation_fusion=False)
        self.model = GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(
            normalization=cfg.normalization), vocab_size=cfg.padded_vocab(config.tp),
            max_sequence_length=args["seq"], pre_process=self.first, post_process=self.last,
            parallel_output=True, share_embeddings_and_output_weights=False,
            position_embedding_type=cfg.position_embedding_type)
        self.params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args["lr"], betas=(0.9, 0.95),
                                          eps=1e-8, foreach=False)
        self.keys = rank_keys(cfg, config, self.pp_rank)
        self.step_count = 0

    def close(self) -> None:
        self.ps.destroy_model_parallel()

    # -- state ------------------------------------------------------------------
    def export(self, values: dict) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, keys in self.keys.items():
            p = self.params[keys[0]]
            out[path] = p.detach().clone().contiguous()
            st = self.optimizer.state.get(p, {})
            for name in ADAM:
                out[optimizer_path(name, path)] = (st[name].detach().clone() if name in st
                                                   else torch.zeros_like(out[path]))
        out.update(values)
        return out

    def load(self, local: dict[str, Any]) -> dict:
        step = int(local["optimizer/step"])
        with torch.no_grad():
            for path, keys in self.keys.items():
                p = self.params[keys[0]]
                p.copy_(local[path])
                if step:
                    self.optimizer.state[p] = {
                        "step": torch.tensor(float(step)),
                        **{n: local[optimizer_path(n, path)].clone() for n in ADAM}}
        return {k: local[k] for k in VALUES}

    # -- one training step --------------------------------------------------------
    def train_step(self, corpus, consumed: int, batch: int) -> tuple[float, list[int]]:
        ps, seq = self.ps, corpus.samples.shape[1] - 1
        dp = ps.get_data_parallel_world_size()
        inputs, labels, idx = corpus.local_batch(consumed, batch, dp, self.dp_rank)
        b = inputs.shape[0]
        pos = torch.arange(seq).unsqueeze(0).expand(b, -1).contiguous()
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1).view(1, 1, seq, seq)
        pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        self.optimizer.zero_grad(set_to_none=False)
        h = None
        if not self.first:
            h = torch.empty(seq, b, self.cfg.hidden_size)
            dist.recv(h, src=pp_ranks[self.pp_rank - 1])
            h.requires_grad_(True)
            self.model.set_input_tensor(h)
        out = self.model(inputs if self.first else None, pos, mask, labels=labels if self.last else None)
        loss = torch.zeros(1)
        if self.last:
            local = out.float().mean()
            local.backward()
            if self.tp_rank == 0:
                loss[0] = local.detach() / dp
        else:
            dist.send(out.detach().contiguous(), dst=pp_ranks[self.pp_rank + 1])
            grad = torch.empty_like(out)
            dist.recv(grad, src=pp_ranks[self.pp_rank + 1])
            out.backward(grad)
        if not self.first:
            dist.send(h.grad.contiguous(), dst=pp_ranks[self.pp_rank - 1])
        if dp > 1:
            group = ps.get_data_parallel_group()
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
                    p.grad.div_(dp)
        self.optimizer.step()
        dist.all_reduce(loss)  # the global-batch mean loss, on every rank
        self.step_count += 1
        return float(loss[0]), idx.tolist()


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))


def run_group(rank: int, world: int, port: int, run: str, phases: list, first_phase: int,
              cfg_json: dict, args: dict, staged_in: str | None, staged_out: str | None,
              queue) -> None:
    """Run consecutive ``phases`` (same worker count) on this process; report through ``queue``.

    Records put on the queue: ``("step", run, phase, step, loss, sample ids)`` from rank 0,
    ``("reconfig", run, phase, how, seconds, moved, lower_bound)``, ``("done", run, rank)``,
    and ``("error", run, rank, text)``.
    """
    import traceback

    try:
        from tenplex_megatron import cpu_shim
        from tenplex_megatron.demo.data import load_corpus

        cpu_shim.apply()
        torch.set_num_threads(1)
        _init(rank, world, port)
        cfg = MegatronConfig.from_json(cfg_json)
        tree = demo_tree(cfg)
        corpus = load_corpus(args["seq"], args["corpus_bytes"], args["seed"])
        local = None
        values = None
        prev = None
        for offset, phase in enumerate(phases):
            index = first_phase + offset
            model = _Model(cfg, phase.config, args)
            t0 = time.perf_counter()
            if prev is None and staged_in is None:
                local = tenplex.materialize(tree, initial_state(tree, args["seed"]), phase.config, rank)
            elif prev is None:
                local = tenplex.load(staged_in, phase.config, rank)
                if rank == 0:
                    queue.put(("reconfig", run, index, "restart: load", time.perf_counter() - t0,
                               0, 0))
            else:
                local, rep = tenplex.reconfigure(local, tree, prev, phase.config, report=True)
                if rank == 0:
                    queue.put(("reconfig", run, index, "live", rep.seconds, rep.sent, rep.lower_bound))
            values = model.load(local)
            consumed = int(values["data/consumed_samples"])
            step0 = int(values["optimizer/step"])
            for k in range(phase.steps):
                loss, idx = model.train_step(corpus, consumed, args["batch"])
                consumed += args["batch"]
                if rank == 0:
                    queue.put(("step", run, index, step0 + k + 1, loss, idx))
            values = {"optimizer/step": step0 + phase.steps, "data/consumed_samples": consumed,
                      "data/seed": args["seed"]}
            local = model.export(values)
            model.close()
            prev = phase.config
        if staged_out is not None:
            t0 = time.perf_counter()
            tenplex.stage(local, tree, prev, staged_out)
            if rank == 0:
                queue.put(("reconfig", run, first_phase + len(phases), "restart: stage",
                           time.perf_counter() - t0, 0, 0))
        dist.barrier()
        queue.put(("done", run, rank))
        dist.destroy_process_group()
    except BaseException:
        queue.put(("error", run, rank, traceback.format_exc()))
        raise

"""Data, pipelined forward/backward over virtual chunks, training, logits and key dumps.

Mixed into mcore_worker.Worker, which supplies ``a`` (the parsed flags), ``torch``, ``dist``, ``ps``
(megatron's parallel_state), ``models`` (one per virtual chunk), ``ddps``, the optimizer, ``dtype``
and the ranks.
"""

from __future__ import annotations

import json
import os
import time

from mcore_checkpoint import log0


class RunMixin:
    # ------------------------------------------------------------------ data
    def batch(self, global_batch: bool = False):
        """Fixed tokens; each dp rank takes its slice. cp ranks (emulated) see the full sequence."""
        torch, a = self.torch, self.a
        g = torch.Generator().manual_seed(a.data_seed)
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
        if not global_batch:
            assert a.batch % self.dp == 0, "--batch must be divisible by dp"
            per = a.batch // self.dp
            tokens = tokens[self.dp_rank * per:(self.dp_rank + 1) * per]
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        pos = torch.arange(a.seq).unsqueeze(0).expand(inputs.shape[0], -1).contiguous()
        mask = torch.triu(torch.ones(a.seq, a.seq, dtype=torch.bool), diagonal=1).view(1, 1, a.seq, a.seq)
        return tuple(t.to(a.device) for t in (inputs, pos, mask, labels))

    # ------------------------------------------------------------------ fwd/bwd
    def _recv(self, shape, src):
        t = self.torch.empty(shape, dtype=self.dtype, device=self.a.device)
        self.dist.recv(t, src=src)
        return t

    def pp_ranks(self):
        return self.dist.get_process_group_ranks(self.ps.get_pipeline_model_parallel_group())

    def forward_step(self, with_labels: bool, global_batch: bool = False, backward: bool = False):
        """Hand-written interleaved pipeline: global chunk c = v*pp + pp_rank, run in order c=0..C-1.

        Returns the last chunk's output (loss [b, s] or logits [b, s, v/tp]) there, None elsewhere.
        """
        a = self.a
        pp, p = a.pp, self.pp_rank
        nchunks = pp * (a.vpp or 1)
        ranks = self.pp_ranks()
        prev_r, next_r = ranks[(p - 1) % pp], ranks[(p + 1) % pp]
        inputs, pos, mask, labels = self.batch(global_batch=global_batch)
        b = inputs.shape[0]
        seq = a.seq // a.tp if a.sp == "on" else a.seq
        result, saved = None, []
        for v, m in enumerate(self.models):
            c = v * pp + p
            runner = self.ddps[v] if self.ddps else m
            h_in = None
            if c > 0:
                h_in = self._recv((seq, b, a.hidden), prev_r)
                if backward:
                    h_in.requires_grad_(True)
                m.set_input_tensor(h_in)
            out = runner(inputs if c == 0 else None, pos, mask,
                         labels=labels if (with_labels and c == nchunks - 1) else None)
            if c == nchunks - 1:
                result = out
            else:
                self.dist.send(out.detach().contiguous(), dst=next_r)
            saved.append((h_in, out))
        if backward:
            for v in reversed(range(len(self.models))):
                c = v * pp + p
                h_in, out = saved[v]
                if c == nchunks - 1:  # fp16: megatron-core's loss scale (Megatron-LM's grad_scale_func)
                    loss = out.float().mean()
                    (loss * self.optimizer.get_loss_scale() if getattr(self.a, "fp16", False) else loss).backward()
                else:
                    out.backward(self._recv(tuple(out.shape), next_r))
                if c > 0:
                    self.dist.send(h_in.grad.contiguous(), dst=prev_r)
        return result

    def train(self, steps: int, first: int = 0) -> list[float]:
        """``steps`` Adam steps on the fixed global batch; ``LOSS step=<i> <value>`` lines (rank 0) number
        them from ``first``. Returns the global-batch mean losses."""
        from megatron.core.distributed import finalize_model_grads

        torch = self.torch
        losses = []
        for step in range(first, first + steps):
            t = time.time()
            for d in self.ddps:
                d.zero_grad_buffer()
            self.optimizer.zero_grad()
            loss = self.forward_step(with_labels=True, backward=True)
            finalize_model_grads(self.ddps)
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            val = torch.zeros(1, device=self.a.device)
            if self.last and self.tp_rank == 0 and self.cp_rank == 0:
                val[0] = loss.float().mean().item() / self.dp
            self.dist.all_reduce(val)
            losses.append(val.item())
            log0(f"LOSS step={step} {val.item():.8f} grad_norm={grad_norm} ok={ok} ({time.time() - t:.2f}s)")
        return losses

    # ------------------------------------------------------------------ logits
    def write_logits(self, path: str):
        """Forward the fixed global batch; the last stage gathers logits over tp, trims the vocab padding
        and writes ``{"logits": [batch, seq, vocab] fp32}`` to ``path`` (safetensors for a
        ``.safetensors`` name, else ``torch.save``)."""
        torch = self.torch
        t = time.time()
        runners = self.ddps or self.models
        for r in runners:
            r.eval()
        with torch.no_grad():
            out = self.forward_step(with_labels=False, global_batch=True)
        for r in runners:
            r.train()
        if self.last:
            parts = [torch.empty_like(out) for _ in range(self.a.tp)]
            self.dist.all_gather(parts, out.contiguous(), group=self.ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)[..., : self.a.vocab].contiguous().float().cpu()
            if self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                if path.endswith(".safetensors"):
                    from safetensors.torch import save_file

                    save_file({"logits": logits}, path)
                else:
                    torch.save({"logits": logits}, path)
                print(f"LOGITS {path} shape={tuple(logits.shape)} sum={logits.double().sum().item():.10f}",
                      flush=True)
        self.dist.barrier()
        log0(f"TIME logits {time.time() - t:.2f}")

    def write_tokens(self, path: str):
        """``torch.save({"tokens": [batch, seq] int64})`` of the logits' input tokens (process 0)."""
        if self.dist.get_rank() == 0:
            self.torch.save({"tokens": self.batch(global_batch=True)[0]}, path)
        self.dist.barrier()

    def check_replicas(self):
        """Print max |diff| of every param across its replica group.

        Expert params (name contains '.experts.') are replicated over expert-dp,
        the rest over dp x cp. Prints one REPLICA line per group kind (rank 0).
        """
        torch, dist, ps = self.torch, self.dist, self.ps
        groups = {"dense/dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
                  "expert/edp": ps.get_expert_data_parallel_group()}
        worst = {k: (0.0, "") for k in groups}
        for m in self.models:
            for name, p in m.named_parameters():
                kind = "expert/edp" if ".experts." in name else "dense/dp_cp"
                g = groups[kind]
                parts = [torch.empty_like(p.data) for _ in range(g.size())]
                dist.all_gather(parts, p.data.contiguous(), group=g)
                d = max((x - parts[0]).abs().max().item() for x in parts)
                if d >= worst[kind][0]:
                    worst[kind] = (d, name)
        for k, (d, name) in worst.items():
            t = torch.tensor([d])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            log0(f"REPLICA {k} max_abs_diff_over_replicas={t.item():.3e} (rank0 worst: {name})")

    # ------------------------------------------------------------------ dumps
    def _describe_sharded(self, key, sh):
        from megatron.core.dist_checkpointing.mapping import (
            ShardedObject, ShardedTensor, ShardedTensorFactory)

        if isinstance(sh, ShardedTensorFactory):
            built = sh.build()
            subs = built.values() if isinstance(built, dict) else (built if isinstance(built, (list, tuple)) else [built])
            return {"factory": True, "key": sh.key,
                    "parts": [self._describe_sharded(key, s) for s in subs]}
        if isinstance(sh, ShardedTensor):
            return {"key": sh.key, "local_shape": list(sh.local_shape), "global_shape": list(sh.global_shape),
                    "global_offset": list(sh.global_offset),
                    "axis_fragmentations": list(sh.axis_fragmentations or ()),
                    "prepend_axis_num": sh.prepend_axis_num, "replica_id": list(sh.replica_id)
                    if isinstance(sh.replica_id, tuple) else sh.replica_id,
                    "flattened_range": None if sh.flattened_range is None else
                    [sh.flattened_range.start, sh.flattened_range.stop],
                    "allow_shape_mismatch": sh.allow_shape_mismatch}
        if isinstance(sh, ShardedObject):
            return {"object": True, "key": sh.key, "global_shape": list(sh.global_shape),
                    "global_offset": list(sh.global_offset), "replica_id": list(sh.replica_id)
                    if isinstance(sh.replica_id, tuple) else sh.replica_id}
        return {"other": type(sh).__name__}

    def dump_keys(self, d: str):
        """rank<r>.json: per chunk, state_dict() (name -> shape|None) and sharded_state_dict entries."""
        os.makedirs(d, exist_ok=True)
        out = {"coords": dict(tp=self.tp_rank, cp=self.cp_rank, dp=self.dp_rank, pp=self.pp_rank,
                              etp=self.etp_rank, ep=self.ep_rank, edp=self.edp_rank), "chunks": []}
        md = self.sharded_sd_metadata()
        for m in self.models:
            sd = m.state_dict()
            ssd = m.sharded_state_dict(metadata=md)
            out["chunks"].append({
                "state_dict": {k: (list(v.shape) if hasattr(v, "shape") else repr(type(v).__name__) + ":" + repr(v)[:40])
                               for k, v in sd.items()},
                "sharded": {k: self._describe_sharded(k, v) for k, v in ssd.items()},
                "params_allreduce_false": [n for n, p in m.named_parameters() if not getattr(p, "allreduce", True)],
            })
        with open(os.path.join(d, f"rank{self.dist.get_rank()}.json"), "w") as f:
            json.dump(out, f, indent=1)
        self.dist.barrier()

    def dump_buffers(self, d: str):
        """buffers_rank<r>.json: DDP dense/expert buffers and the chained optimizers' groups."""
        def names(ddp):
            return {p: n for n, p in ddp.module.named_parameters()}

        out = {"chunks": [], "optimizers": []}
        for ddp in self.ddps:
            nm = names(ddp)
            chunk = {}
            for kind in ("buffers", "expert_parallel_buffers"):
                chunk[kind] = [{
                    "dtype": [str(b.param_dtype), str(b.grad_dtype)], "numel": b.numel,
                    "numel_unpadded": b.numel_unpadded, "bucket_indices": b.bucket_indices,
                    "dp_group": self.dist.get_process_group_ranks(b.data_parallel_group),
                    "gradient_scaling_factor": b.gradient_scaling_factor,
                    "params": sorted(([nm[p], list(v)] for p, v in b.param_index_map.items()),
                                     key=lambda x: x[1][0]),
                } for b in getattr(ddp, kind)]
            out["chunks"].append(chunk)
        subs = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        allnames = {}
        for ci, ddp in enumerate(self.ddps):
            allnames.update({p: f"chunk{ci}:{n}" for p, n in names(ddp).items()})
        for o in subs:
            owned = []
            for gi, gmaps in enumerate(getattr(o, "gbuf_ranges", [])):
                for dt, per_bucket in gmaps.items():
                    for bi, m in enumerate(per_bucket):
                        owned.append({"gbuf_idx": gi, "dtype": str(dt), "bucket": bi,
                                      "params": sorted([[allnames.get(p, "?"), r["gbuf_world"].start, r["gbuf_world"].end,
                                                         r["param"].start, r["param"].end]
                                                        for p, r in m["param_map"].items()], key=lambda x: x[1])})
            out["optimizers"].append({
                "type": type(o).__name__,
                "dp_group": self.dist.get_process_group_ranks(o.data_parallel_group)
                if getattr(o, "data_parallel_group", None) is not None else None,
                "data_parallel_group_idx": getattr(o, "data_parallel_group_idx", None),
                "n_buffers": len(getattr(o, "buffers", [])),
                "per_model_buffers": {str(k): len(v) for k, v in getattr(o, "per_model_buffers", {}).items()},
                "owned_ranges": owned,
            })
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"buffers_rank{self.dist.get_rank()}.json"), "w") as f:
            json.dump(out, f, indent=1)
        self.dist.barrier()

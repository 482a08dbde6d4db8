"""moe_worker.py with the settings a Hugging Face export must carry: norm epsilon, rope base,
interleaved rope, llama3 rope scaling, q/k layernorm, a qkv bias and the router's pre-softmax.

Launch with torchrun as moe_worker.py (same flags and output lines), plus::

  --eps E                 layernorm_epsilon (TransformerConfig; Megatron-LM --norm-epsilon)
  --rotary-base B         GPTModel rotary_base (--rotary-base)
  --rotary-interleaved    TransformerConfig.rotary_interleaved
  --rope-scaling F        GPTModel rope_scaling=True, rope_scaling_factor=F (--use-rope-scaling)
  --qk-layernorm, --add-qkv-bias, --pre-softmax (moe_router_pre_softmax)
  --tokens-out F          torch.save({"tokens": [batch, seq] int64}) of the logits' input tokens

Every setting is also put in the checkpoint's args under Megatron-LM's names.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import moe_worker  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # else --ep would be taken for --eps
    p.add_argument("--eps", type=float, default=1e-5)
    p.add_argument("--rotary-base", type=int, default=10000)
    p.add_argument("--rotary-interleaved", action="store_true")
    p.add_argument("--rope-scaling", type=float, default=None)
    p.add_argument("--qk-layernorm", action="store_true")
    p.add_argument("--add-qkv-bias", action="store_true")
    p.add_argument("--pre-softmax", action="store_true")
    p.add_argument("--tokens-out", default=None)
    p.add_argument("--hf-save", default=None,
                   help="after --load (tp = pp = ep = 1): the whole model in memory to transformers and "
                        "save_pretrained(DIR), timed as 'TIME hf_convert' (load included)")
    p.add_argument("--distinct-experts", action="store_true",
                   help="re-draw each expert's weights from a seed of its layer and global id (megatron-core's "
                        "CPU initialization gives ep ranks the same local experts)")
    extra, rest = p.parse_known_args(argv)
    a = moe_worker.parse_args(rest)
    vars(a).update(vars(extra))
    return a


class Worker(moe_worker.Worker):
    def transformer_config(self):
        c = super().transformer_config()
        a = self.a
        c.layernorm_epsilon = a.eps
        c.rotary_interleaved = a.rotary_interleaved
        c.add_qkv_bias = a.add_qkv_bias
        c.qk_layernorm = a.qk_layernorm
        c.moe_router_pre_softmax = a.pre_softmax
        return c

    def layer_spec(self, vp_stage):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        a = self.a
        return get_gpt_layer_local_spec(num_experts=a.experts, moe_grouped_gemm=a.grouped_gemm,
                                        qk_layernorm=a.qk_layernorm, normalization=a.norm)

    def build(self):
        from megatron.core.models.gpt import GPTModel

        a, ps = self.a, self.ps
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
        self.model = self.models[0]
        if a.distinct_experts:
            self.redraw_experts()
        self.ddps = self.optimizer = self.scheduler = None
        if a.optimizer:
            self.build_optimizer()

    def redraw_experts(self):
        """Expert ``local_experts.j`` of layer ``l`` on ep rank ``r`` gets N(0, 0.02) weights seeded by
        ``(l, r * E / ep + j)`` and the expert-tensor-parallel rank (its etp shard): experts differ by
        their global id, and an expert's etp shards differ, whatever ep and etp saved them."""
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

    def megatron_args(self):
        args = super().megatron_args()
        a = self.a
        vars(args).update(norm_epsilon=a.eps, rotary_base=a.rotary_base, rotary_interleaved=a.rotary_interleaved,
                          use_rope_scaling=a.rope_scaling is not None, rope_scaling_factor=a.rope_scaling or 8.0,
                          rotary_percent=1.0, rotary_seq_len_interpolation_factor=None,
                          qk_layernorm=a.qk_layernorm, add_qkv_bias=a.add_qkv_bias,
                          moe_router_pre_softmax=a.pre_softmax, moe_router_score_function="softmax",
                          moe_router_topk_scaling_factor=None, apply_layernorm_1p=False,
                          multi_latent_attention=False, mtp_num_layers=None)
        return args

    def write_tokens(self, path: str):
        if self.dist.get_rank() == 0:
            inputs = self.batch(global_batch=True)[0]
            self.torch.save({"tokens": inputs}, path)
        self.dist.barrier()


def save_pretrained(w, out: str) -> None:
    """The in-memory conversion: the loaded model's state dict renamed and split into transformers'
    tensors (the same transforms as the hf format), a transformers model built on the meta device,
    ``load_state_dict(strict=True, assign=True)``, ``save_pretrained``."""
    import time

    import torch
    import transformers

    from tenplex_megatron.formats.hf.catalog import choose
    from tenplex_megatron.formats.hf.export import _config_json
    from tenplex_megatron.formats.hf.family import Model, TRANSFORMS, Transform, generic_key
    from tenplex_megatron.formats.hf.fields import ModelFields
    from tenplex_megatron.formats.hf.mapping import Job, apply, geometry
    from tenplex_megatron.model.config import MegatronConfig

    t = time.time()
    args = w.megatron_args()
    cfg, fields = MegatronConfig.from_args(args), ModelFields.from_args(args)
    family, geo = choose(cfg, fields), geometry(cfg, fields)
    tensors = {}
    for key, value in w.model.state_dict().items():
        if key.endswith("_extra_state"):
            continue
        generic, layer, expert = generic_key(key.replace(".", "/"))
        names = tuple(n.format(i=layer, e=expert) for n in family.names[generic])
        tensors.update(apply(Job(key, names, TRANSFORMS.get(generic, Transform.COPY), 0), value, geo, value.dtype))
    config = transformers.AutoConfig.for_model(**_config_json(Model(cfg, fields), family, cfg.params_dtype))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.save_pretrained(out)
    print(f"TIME hf_convert_only {time.time() - t:.2f}", flush=True)


def main(argv=None) -> int:
    a = parse_args(argv)
    w = Worker(a)
    import time

    t, cpu = time.time(), time.process_time()
    if a.load == "legacy":
        w.load_legacy(a.load_dir)
    elif a.load == "dist":
        w.load_dist(a.load_dir)
    if a.hf_save:
        save_pretrained(w, a.hf_save)
        print(f"TIME hf_convert {time.time() - t:.2f}", flush=True)
        print(f"TIME hf_convert_cpu {time.process_time() - cpu:.2f}", flush=True)  # every thread's CPU seconds
    if a.save in ("legacy", "both"):
        w.save_legacy(a.save_dir if a.save == "legacy" else os.path.join(a.save_dir, "legacy"))
    if a.save in ("dist", "both"):
        w.save_dist(a.save_dir if a.save == "dist" else os.path.join(a.save_dir, "dist"))
    if a.logits_out:
        w.write_logits(a.logits_out)
    if a.tokens_out:
        w.write_tokens(a.tokens_out)
    w.dist.barrier()
    w.dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

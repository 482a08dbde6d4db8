"""The one worker's flags (mcore_worker.py, moe_worker.py and hf_worker.py take the same ones).

The entry points differ only in their defaults (``PRESETS``): the dense worker's model has learned
positions, vocab 100 padded to 128 and 16 tokens; the MoE and HF workers' has rope, vocab 128 padded
to 16 and 8 tokens. Every flag is described in ``mcore_worker.py``'s docstring.
"""

from __future__ import annotations

import argparse
import ast

PRESETS = {
    "dense": dict(position="learned_absolute", vocab=100, make_vocab_size_divisible_by=128, seq=16),
    "moe": dict(position="rope", vocab=128, make_vocab_size_divisible_by=16, seq=8),
}


def _model_flags(add) -> None:
    for name, default in (("tp", 1), ("pp", 1), ("cp", 1), ("ep", 1), ("layers", 2), ("hidden", 64),
                          ("heads", 4), ("vocab", None), ("make-vocab-size-divisible-by", None),
                          ("seed", 1234), ("seq", None), ("batch", 2), ("data-seed", 4321),
                          ("iteration", 10), ("train-steps", 0), ("train-after-save", 0), ("topk", 2),
                          ("rotary-base", 10000)):
        add(f"--{name}", type=int, default=default)
    for name in ("etp", "vpp", "query-groups", "ffn", "max-pos", "experts", "moe-ffn", "shared-ffn",
                 "bucket-size"):
        add(f"--{name}", type=int, default=None)
    for name in ("swiglu", "untie", "bf16", "fp16", "qk-layernorm", "add-qkv-bias", "rotary-interleaved", "pre-softmax",
                 "expert-bias", "grouped-gemm", "cp-in-config", "no-te-gemm-fix", "distinct-experts"):
        add(f"--{name}", action="store_true")
    add("--position", choices=["rope", "learned_absolute"])
    add("--norm", choices=["LayerNorm", "RMSNorm"], default=None, help="default: RMSNorm with --swiglu")
    add("--bias", choices=["on", "off"], default=None, help="add_bias_linear; default off with --swiglu")
    add("--eps", type=float, default=1e-5, help="layernorm_epsilon (Megatron-LM --norm-epsilon)")
    add("--rope-scaling", type=float, default=None, help="rope_scaling=True, rope_scaling_factor=F")
    add("--moe-layer-freq", default="1", help="an int N (MoE on layers i %% N == 0) or a list, e.g. [1,0,1,0]")
    add("--aux-coeff", type=float, default=0.0)
    add("--dispatcher", default="allgather")
    add("--sp", choices=["on", "off"], default=None, help="default: on when tp > 1 and experts")
    add("--names", choices=["local", "te"], default="local",
        help="te: legacy files under TransformerEngine's names, torch_dist keys as the TE spec's")


def _action_flags(add) -> None:
    add("--load", choices=["none", "legacy", "dist"], default="none")
    add("--load-dir", default=None)
    add("--no-load-optim", action="store_true")
    add("--load-rng", action="store_true", help="restore RNG states and print 'RNG tp=T pp=P ...' lines")
    add("--strict", choices=["on", "off"], default="on")
    add("--save", choices=["none", "legacy", "dist", "both"], default="none")
    add("--save-dir", default=None)
    add("--dist-args", choices=["on", "off"], default="on", help="args in a dist checkpoint's common.pt")
    add("--account-for", choices=["none", "embedding", "loss", "both"], default="none",
        help="account_for_{embedding,loss}_in_pipeline_split: the first (last) stage counts the "
             "embedding (loss) as a layer and builds one decoder layer less")
    add("--args-vocab", choices=["on", "off"], default="on",
        help="off: the args hold padded_vocab_size only, as Megatron-LM writes them with a tokenizer "
             "other than the NullTokenizer (GPT2BPETokenizer here)")
    add("--save-rng", action="store_true", help="dist saves: the rng_state ShardedObject as Megatron-LM of this megatron-core version makes it")
    add("--fully-parallel-save", action="store_true",
        help="dist saves: Megatron-LM's default --ckpt-fully-parallel-save (the dp-cp ranks share the writing)")
    add("--dist-layout", choices=["bare", "megatron"], default="bare",
        help="dist saves: a bare folder, or SAVE_DIR/iter_NNNNNNN and the tracker (Megatron-LM's --save)")
    add("--legacy-writer", choices=["expert_dp0", "dp0"], default="expert_dp0")
    for name in ("logits-out", "fresh-logits-out", "loaded-logits-out", "tokens-out", "dump-dir", "hf-save",
                 "also-load-optim-dir"):
        add(f"--{name}", default=None)
    add("--also-load", nargs=4, action="append", default=[], metavar=("FMT", "DIR", "FRESH", "LOGITS"))
    add("--check-replicas", action="store_true")
    add("--optimizer", action="store_true", help="build DDP + Adam even with 0 steps")
    add("--dist-opt", action="store_true")
    add("--sharding-type", default="fully_reshardable",
        choices=["fully_reshardable", "dp_reshardable", "fully_sharded_model_space", "dp_zero_gather_scatter"])
    add("--lr", type=float, default=1e-3)
    add("--device", choices=["cpu", "cuda"], default="cpu",
        help="cuda: the model on this process's GPU (LOCAL_RANK), NCCL, no CPU patches")


def parse_args(argv=None, preset: str = "dense") -> argparse.Namespace:
    """The worker's flags with ``PRESETS[preset]`` as defaults, derived defaults filled in.

    Raises:
        SystemExit: a flag is unknown or ``--moe-layer-freq`` is not an int >= 1 or a 0/1 list of
            ``--layers`` entries (argparse's usage error).
    """
    p = argparse.ArgumentParser(allow_abbrev=False)  # else --ep would be taken for --eps
    _model_flags(p.add_argument)
    _action_flags(p.add_argument)
    p.set_defaults(**PRESETS[preset])
    a = p.parse_args(argv)
    a.query_groups = a.query_groups or a.heads
    a.ffn = a.ffn or 4 * a.hidden
    a.norm = a.norm or ("RMSNorm" if a.swiglu else "LayerNorm")
    a.bias = a.bias or ("off" if a.swiglu else "on")
    a.max_pos = a.max_pos or a.seq
    a.etp = a.etp or a.tp
    freq = ast.literal_eval(a.moe_layer_freq)
    if not (type(freq) is int and freq >= 1 or isinstance(freq, list) and set(freq) <= {0, 1}
            and len(freq) == a.layers):
        p.error(f"--moe-layer-freq {a.moe_layer_freq!r}: give an int >= 1 or a 0/1 list of {a.layers} layers")
    a.moe_layer_freq = freq
    if a.sp is None:
        a.sp = "on" if (a.tp > 1 and a.experts) else "off"
    if a.train_steps > 0:
        a.optimizer = True
    if a.train_after_save and not a.optimizer:
        p.error("--train-after-save needs --train-steps (an optimizer)")
    return a


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's rule (megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding)."""
    multiple = divisible_by * tp
    return ((vocab + multiple - 1) // multiple) * multiple

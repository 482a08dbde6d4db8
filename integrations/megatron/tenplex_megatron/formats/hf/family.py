"""Model families: a Megatron GPT's tensors under Hugging Face names, declared as data.

A :class:`Family` is one small declarative record (``families/*.py``): the
HF architecture, the HF name of each megatron-core tensor, the ``config.json``
keys beyond the common ones, and the features it can express. The transform
each tensor needs depends on the megatron-core tensor only
(:data:`TRANSFORMS`), so every family shares them. Plugins add families
with :func:`register`.

A checkpoint's features (:func:`features`) choose the family
(:func:`choose`); a feature that no family (or not the one asked for)
expresses is refused in one line that names it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping

from tenplex.errors import ConfigError

from tenplex_megatron.formats.hf.fields import ModelFields
from tenplex_megatron.model.config import MegatronConfig

__all__ = ["Family", "Transform", "TRANSFORMS", "FEATURES", "DENSE_NAMES", "register", "registered", "features",
           "choose", "generic_key", "Model"]


class Transform(Enum):
    """What one megatron-core tensor becomes (``transforms.py`` holds the maths)."""

    COPY = "copy"          #: the same tensor
    VOCAB = "vocab"        #: padding rows dropped
    NORM = "norm"          #: ``+ 1`` under apply_layernorm_1p
    HEAD_NORM = "head_norm"  #: a q/k norm: NORM, then rope's row order
    QKV = "qkv"            #: fused QKV split per query group into q, k, v (rope's row order on q, k)
    GATE_UP = "gate_up"    #: SwiGLU fc1 split into gate, up


TRANSFORMS: dict[str, Transform] = {
    "embedding/word_embeddings/weight": Transform.VOCAB,
    "output_layer/weight": Transform.VOCAB,
    "decoder/final_layernorm/weight": Transform.NORM,
    "decoder/layers/{i}/input_layernorm/weight": Transform.NORM,
    "decoder/layers/{i}/pre_mlp_layernorm/weight": Transform.NORM,
    "decoder/layers/{i}/self_attention/q_layernorm/weight": Transform.HEAD_NORM,
    "decoder/layers/{i}/self_attention/k_layernorm/weight": Transform.HEAD_NORM,
    "decoder/layers/{i}/self_attention/linear_qkv/weight": Transform.QKV,
    "decoder/layers/{i}/self_attention/linear_qkv/bias": Transform.QKV,
    "decoder/layers/{i}/mlp/linear_fc1/weight": Transform.GATE_UP,
    "decoder/layers/{i}/mlp/linear_fc1/bias": Transform.GATE_UP,
    "decoder/layers/{i}/mlp/experts/{e}/linear_fc1/weight": Transform.GATE_UP,
}
"""The transform of each megatron-core tensor (tree paths without ``model/``); others are COPY."""

_L = "model.layers.{i}"
DENSE_NAMES: dict[str, tuple[str, ...]] = {
    "embedding/word_embeddings/weight": ("model.embed_tokens.weight",),
    "decoder/layers/{i}/input_layernorm/weight": (f"{_L}.input_layernorm.weight",),
    "decoder/layers/{i}/self_attention/linear_qkv/weight": tuple(f"{_L}.self_attn.{x}_proj.weight" for x in "qkv"),
    "decoder/layers/{i}/self_attention/linear_qkv/bias": tuple(f"{_L}.self_attn.{x}_proj.bias" for x in "qkv"),
    "decoder/layers/{i}/self_attention/linear_proj/weight": (f"{_L}.self_attn.o_proj.weight",),
    "decoder/layers/{i}/self_attention/linear_proj/bias": (f"{_L}.self_attn.o_proj.bias",),
    "decoder/layers/{i}/pre_mlp_layernorm/weight": (f"{_L}.post_attention_layernorm.weight",),
    "decoder/layers/{i}/mlp/linear_fc1/weight": (f"{_L}.mlp.gate_proj.weight", f"{_L}.mlp.up_proj.weight"),
    "decoder/layers/{i}/mlp/linear_fc1/bias": (f"{_L}.mlp.gate_proj.bias", f"{_L}.mlp.up_proj.bias"),
    "decoder/layers/{i}/mlp/linear_fc2/weight": (f"{_L}.mlp.down_proj.weight",),
    "decoder/layers/{i}/mlp/linear_fc2/bias": (f"{_L}.mlp.down_proj.bias",),
    "decoder/final_layernorm/weight": ("model.norm.weight",),
    "output_layer/weight": ("lm_head.weight",),
}
"""Llama's names, which the other families extend."""

FEATURES: dict[str, str] = {
    "experts": "experts (num_experts)",
    "qkv_bias": "a bias on linear_qkv only (add_qkv_bias)",
    "linear_bias": "biases on every linear layer (add_bias_linear)",
    "qk_norm": "query/key layernorm (qk_layernorm)",
    "router_pre_softmax": "a router that softmaxes before top-k (moe_router_pre_softmax)",
    "gelu_mlp": "a non-gated MLP (swiglu off)",
    "layernorm": "LayerNorm (HF families here use RMSNorm)",
    "learned_positions": "learned absolute position embeddings",
    "mla": "multi-latent attention (MLA)",
    "mtp": "multi-token prediction layers (MTP)",
    "shared_experts": "shared experts (moe_shared_expert_intermediate_size)",
    "expert_bias": "a router expert bias (moe_router_enable_expert_bias)",
    "sigmoid_router": "a sigmoid router score function",
    "topk_scaling": "a router top-k scaling factor (moe_router_topk_scaling_factor)",
    "partial_rotary": "partial rotary embeddings (rotary_percent < 1)",
    "rope_interpolation": "rope sequence-length interpolation (rotary_seq_len_interpolation_factor)",
    "moe_layer_pattern": "dense layers between MoE layers (moe_layer_freq != 1)",
}
"""Every feature the exporter detects, with the phrase a refusal names it by."""


@dataclass(frozen=True)
class Model:
    """What a family's ``config`` entries read: the model config and the extra fields."""

    cfg: MegatronConfig
    fields: ModelFields


@dataclass(frozen=True)
class Family:
    """One HF model family, declared.

    Attributes:
        name: the ``--hf-arch`` value (HF ``model_type``).
        architecture: ``config.json``'s ``architectures`` entry.
        names: ``{megatron-core tree path (no "model/"): HF names}``, with ``{i}``
            for the layer and ``{e}`` for the global expert id; a tuple holds one
            name per output of the tensor's transform.
        config: ``{config.json key: value(Model)}`` beyond the common keys.
        supports: the features of :data:`FEATURES` it expresses.
        requires: features it must have (for the inference; e.g. Qwen3's q/k norms).
    """

    name: str
    architecture: str
    names: Mapping[str, tuple[str, ...]]
    config: Mapping[str, Callable[[Model], Any]] = field(default_factory=dict)
    supports: frozenset = frozenset()
    requires: frozenset = frozenset()


_REGISTRY: dict[str, Family] = {}
_ORDER: list[str] = []


def register(family: Family) -> Family:
    """Add ``family`` (later registrations are tried first by :func:`choose`).

    Raises:
        ConfigError: a name already registered, or a feature not in :data:`FEATURES`.
    """
    unknown = (family.supports | family.requires) - set(FEATURES)
    if unknown:
        raise ConfigError(f"family {family.name}: unknown features {sorted(unknown)}")
    if family.name in _REGISTRY:
        raise ConfigError(f"family {family.name} is already registered")
    _REGISTRY[family.name] = family
    _ORDER.insert(0, family.name)
    return family


def registered() -> dict[str, Family]:
    """``{name: family}`` of every family registered so far (``catalog.families()`` adds the built-in ones)."""
    return {name: _REGISTRY[name] for name in _ORDER}


def features(cfg: MegatronConfig, fields: ModelFields) -> list[str]:
    """The checkpoint's features (keys of :data:`FEATURES`), in that table's order."""
    moe = bool(cfg.num_moe_experts)
    found = {
        "experts": moe,
        "qkv_bias": cfg.add_qkv_bias and not cfg.add_bias_linear,
        "linear_bias": cfg.add_bias_linear,
        "qk_norm": cfg.qk_layernorm,
        "router_pre_softmax": moe and fields.moe_router_pre_softmax,
        "gelu_mlp": not cfg.swiglu,
        "layernorm": cfg.normalization != "RMSNorm",
        "learned_positions": cfg.position_embedding_type != "rope",
        "mla": fields.multi_latent_attention,
        "mtp": bool(fields.mtp_num_layers),
        "shared_experts": moe and bool(cfg.moe_shared_expert_intermediate_size),
        "expert_bias": moe and cfg.moe_router_enable_expert_bias,
        "sigmoid_router": moe and fields.moe_router_score_function != "softmax",
        "topk_scaling": moe and fields.moe_router_topk_scaling_factor not in (None, 1.0),
        "partial_rotary": fields.rotary_percent != 1.0,
        "rope_interpolation": fields.rotary_seq_len_interpolation_factor not in (None, 1.0),
        "moe_layer_pattern": moe and cfg.moe_layer_freq != 1,
    }
    return [name for name in FEATURES if found[name]]


def _uncovered(family: Family, found: list[str]) -> str | None:
    for name in found:
        if name not in family.supports:
            return name
    return None


def choose(cfg: MegatronConfig, fields: ModelFields, name: str | None = None) -> Family:
    """The family for a checkpoint: ``name`` (``--hf-arch``), or the first that fits its features.

    Raises:
        ConfigError: an unknown ``name``; or, in one line, the first feature the
            asked-for family (or every family) does not express.
    """
    known = registered()
    found = features(cfg, fields)
    if name is not None:
        family = known.get(name)
        if family is None:
            raise ConfigError(f"--hf-arch {name}: unknown; expected one of {', '.join(sorted(known))}")
        missing = _uncovered(family, found)
        if missing is not None:
            raise ConfigError(f"cannot export to {name}: the checkpoint has {FEATURES[missing]}, "
                              f"which {family.architecture} does not express")
        return family
    fitting = [f for n, f in known.items() if _uncovered(f, found) is None
               and f.requires <= set(found)]  # the latest registered first
    if fitting:
        return fitting[0]
    best = min(known.values(), key=lambda f: (len([x for x in found if x not in f.supports])
                                              + len(f.requires - set(found)), f.name))
    missing = _uncovered(best, found)
    if missing is None:
        return _refuse_required(best, found)
    raise ConfigError(f"cannot export to Hugging Face: the checkpoint has {FEATURES[missing]}, "
                      f"which no family ({', '.join(sorted(known))}) expresses with its other features")


def _refuse_required(family: Family, found: list[str]):
    need = sorted(family.requires - set(found))[0]
    raise ConfigError(f"cannot export to Hugging Face: the closest family, {family.name}, needs "
                      f"{FEATURES[need]}, which the checkpoint lacks")


_LAYER = re.compile(r"^decoder/layers/(\d+)/")
_EXPERT = re.compile(r"/mlp/experts/(\d+)/")


def generic_key(path: str) -> tuple[str, int | None, int | None]:
    """``(key with {i} and {e}, layer, expert)`` of a model tree path (``model/`` stripped)."""
    key = path.removeprefix("model/")
    layer = expert = None
    m = _LAYER.match(key)
    if m:
        layer = int(m.group(1))
        key = _LAYER.sub("decoder/layers/{i}/", key, count=1)
    m = _EXPERT.search(key)
    if m:
        expert = int(m.group(1))
        key = _EXPERT.sub("/mlp/experts/{e}/", key, count=1)
    return key, layer, expert

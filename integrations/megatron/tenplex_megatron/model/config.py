"""The Megatron GPT model config tenplex needs, read from Megatron's ``args``.

Megatron-LM stores its command-line ``args`` (an ``argparse.Namespace``) in
every checkpoint. tenplex reads the fields below from it, or from an
explicit JSON config when a checkpoint has no args.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from tenplex.errors import ConfigError
from tenplex.limits import short

from tenplex_megatron.model.unmodeled import check_modeled
from tenplex_megatron.model.vocab import padded_vocab_size
from tenplex_megatron.model.limits import check_fields

__all__ = ["MegatronConfig", "padded_vocab_size", "args_to_json", "json_to_args", "stage_layers",
           "uneven_args", "args_for"]


@dataclass(frozen=True)
class MegatronConfig:
    """A Megatron GPT model's shape.

    Attributes:
        num_layers, hidden_size, ffn_hidden_size, num_attention_heads: as Megatron.
        num_query_groups: key/value groups (``num_attention_heads`` without GQA).
        kv_channels: per-head size (default ``hidden_size // num_attention_heads``).
        swiglu: SwiGLU MLP (fc1 is ``[gate; up]``).
        vocab_size: the logical (tokenizer) vocabulary size, or, with ``vocab_padded_from``, the
            padded size the args held.
        make_vocab_size_divisible_by: Megatron's padding base.
        vocab_padded_from: None, or the padding multiple ``M`` (``make_vocab_size_divisible_by * tp``
            at the saver's tp) when the args held only ``padded_vocab_size`` (Megatron-LM sets
            ``vocab_size`` for the NullTokenizer only): the tokenizer's size is then one of
            ``vocab_size - M + 1 .. vocab_size``, and a target tp whose padding depends on which
            is refused (:func:`check_target_vocab`).
        untie_embeddings_and_output_weights: separate output layer.
        position_embedding_type: ``"learned_absolute"`` or ``"rope"``.
        max_position_embeddings: rows of the learned position table.
        add_bias_linear: linear layers have biases.
        add_qkv_bias: the fused QKV linear has a bias even without ``add_bias_linear``
            (megatron-core ``TransformerConfig.add_qkv_bias``).
        qk_layernorm: per-head norms of queries and keys
            (``self_attention.q_layernorm`` / ``k_layernorm``, ``[kv_channels]``, replicated).
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        params_dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        num_moe_experts: experts per MoE layer (Megatron-LM ``args.num_experts``), or None
            for a dense model.
        moe_ffn_hidden_size: an expert's ffn size (default ``ffn_hidden_size``).
        moe_shared_expert_intermediate_size: the shared expert's ffn size, or None.
        moe_router_enable_expert_bias: the router keeps an ``expert_bias`` buffer ``[E]`` fp32.
        moe_layer_freq: MoE layer pattern: an int N puts experts on layers ``i % N == 0``, a
            list has 1 for an MoE layer and 0 for a dense one
            (megatron-core ``gpt_layer_specs.py::get_gpt_decoder_layer_specs``).
        moe_grouped_gemm: experts kept as TE grouped GEMMs: legacy keys
            ``mlp.experts.linear_fc1.weight{j}`` instead of ``mlp.experts.local_experts.{j}.linear_fc1.weight``.
        transformer_impl: the layer spec's modules (Megatron-LM ``--transformer-impl``): ``"local"``
            (megatron-core's local spec) or ``"transformer_engine"`` (TE's spec, Megatron-LM's
            default). It decides the order of ``named_parameters()``, hence of optimizer state kept
            by position (:func:`~tenplex_megatron.model.layouts.param_order`); the readers set it
            from the checkpoint's keys where they tell (TE's norm names), from the args otherwise.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    swiglu: bool = False
    make_vocab_size_divisible_by: int = 128
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: int = 1024
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    normalization: str = "LayerNorm"
    params_dtype: str = "float32"
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_layer_freq: int | tuple = 1
    moe_grouped_gemm: bool = False
    transformer_impl: str = "local"
    vocab_padded_from: int | None = None

    def __getstate__(self) -> dict:
        """The fields only: what is derived from the config (:mod:`tenplex_megatron.model.derived`) stays behind."""
        return {k: v for k, v in self.__dict__.items() if k != "_derived"}

    def __post_init__(self) -> None:
        check_fields(vars(self), "MegatronConfig")
        if self.make_vocab_size_divisible_by < 1:
            raise ConfigError(f"MegatronConfig: make_vocab_size_divisible_by={self.make_vocab_size_divisible_by}; "
                              "expected at least 1 (Megatron-LM pads the vocabulary to a multiple of it)")
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if self.num_moe_experts and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size or 4 * self.hidden_size)
        if isinstance(self.moe_layer_freq, tuple) and len(self.moe_layer_freq) != self.num_layers:
            raise ConfigError(f"MegatronConfig: moe_layer_freq lists {len(self.moe_layer_freq)} layers, "
                              f"num_layers={self.num_layers}")
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"MegatronConfig: num_query_groups={self.num_query_groups} does not "
                              f"divide num_attention_heads={self.num_attention_heads}")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ConfigError(f"MegatronConfig: unknown position_embedding_type "
                              f"{self.position_embedding_type!r}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"MegatronConfig: unknown normalization {self.normalization!r}")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ConfigError(f"MegatronConfig: transformer_impl: expected one of {', '.join(TRANSFORMER_IMPLS)}, "
                              f"found {short(self.transformer_impl)}")

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def qkv_bias(self) -> bool:
        """Whether ``linear_qkv`` has a bias (megatron-core: ``add_bias_linear or add_qkv_bias``)."""
        return self.add_bias_linear or self.add_qkv_bias

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has experts (``moe_layer_freq``'s pattern)."""
        if not self.num_moe_experts:
            return False
        freq = self.moe_layer_freq
        return bool(freq[layer]) if isinstance(freq, tuple) else layer % int(freq) == 0

    @property
    def dist_per_layer(self) -> bool:
        """Whether ``torch_dist`` keys the layers one by one (``decoder.layers.<l>.*``, no layer axis).

        megatron-core 0.16.1 does so when ``moe_layer_freq`` is an int above 1 or a list, whatever
        the pattern and whether or not the model has experts
        (``transformer/transformer_block.py::TransformerBlock.sharded_state_dict``); otherwise it
        stacks every layer on a leading axis.
        """
        return isinstance(self.moe_layer_freq, tuple) or int(self.moe_layer_freq) > 1

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    @classmethod
    def from_args(cls, args: Any, overrides: Mapping | None = None) -> "MegatronConfig":
        """Read the config from Megatron's ``args`` (a Namespace or a mapping).

        ``overrides`` (attribute names as above) win over ``args``; with no
        ``args`` at all they must hold a whole config.

        Raises:
            ConfigError: if a required field is missing. Megatron-LM's args
                hold the logical vocabulary size only as ``vocab_size`` (set for
                the NullTokenizer); otherwise the tokenizer's size must be given
                as the override ``vocab_size``, because ``padded_vocab_size``
                depends on tp. Also if the args say ``moe_single_grouped_weight`` or
                ``moe_single_grouped_bias`` (megatron-core 0.19 with TE >= 2.14: a grouped
                linear's experts in one stacked parameter, not ``weight{i}`` each).
        """
        overrides = dict(overrides or {})
        if args is None:
            return cls.from_json(overrides)
        a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
        check_modeled(a)
        padded_from = None
        for flag in ("moe_single_grouped_weight", "moe_single_grouped_bias"):
            if a.get(flag):
                raise ConfigError(f"Megatron args: {flag}=True (each grouped linear's experts in one stacked "
                                  "parameter): tenplex models one parameter per expert (weight{i}, "
                                  "bias{i}); save the checkpoint with it off")
        if "vocab_size" in overrides:
            a = {**a, "vocab_size": overrides["vocab_size"]}
        if not a.get("vocab_size"):
            padded, tp = a.get("padded_vocab_size"), a.get("tensor_model_parallel_size")
            if not padded or not tp:
                raise ConfigError(f"Megatron args have padded_vocab_size={padded}, tensor_model_parallel_size="
                                  f"{tp} and no vocab_size; pass the tokenizer's vocabulary size with "
                                  "--model-config (a JSON file such as {\"vocab_size\": 50257})")
            a = {**a, "vocab_size": padded}  # the padded rows stand for the tokenizer's (check_target_vocab)
            padded_from = _divisible_by(a) * int(tp)
        try:
            return cls._from_args(a).with_overrides(
                {**{k: v for k, v in overrides.items() if k != "vocab_size"},
                 **({"vocab_padded_from": padded_from} if padded_from else {})})
        except KeyError as exc:
            raise ConfigError(f"Megatron args lack {exc.args[0]!r}; pass an explicit model config") from None

    @classmethod
    def _from_args(cls, a: dict) -> "MegatronConfig":
        groups = a.get("num_query_groups") if a.get("group_query_attention") else None
        return cls(
            num_layers=int(a["num_layers"]), hidden_size=int(a["hidden_size"]),
            num_attention_heads=int(a["num_attention_heads"]), vocab_size=int(a["vocab_size"]),
            ffn_hidden_size=a.get("ffn_hidden_size"), num_query_groups=groups,
            kv_channels=a.get("kv_channels"), swiglu=bool(a.get("swiglu", False)),
            make_vocab_size_divisible_by=_divisible_by(a),
            untie_embeddings_and_output_weights=bool(a.get("untie_embeddings_and_output_weights", False)),
            position_embedding_type=a.get("position_embedding_type", "learned_absolute"),
            max_position_embeddings=int(a.get("max_position_embeddings") or 1024),
            add_bias_linear=bool(a.get("add_bias_linear", True)),
            add_qkv_bias=bool(a.get("add_qkv_bias", False)),
            qk_layernorm=bool(a.get("qk_layernorm", False)),
            normalization=a.get("normalization", "LayerNorm"),
            params_dtype=str(a.get("params_dtype", "float32")).removeprefix("torch."),
            num_moe_experts=a.get("num_experts") or None, moe_ffn_hidden_size=a.get("moe_ffn_hidden_size"),
            moe_shared_expert_intermediate_size=a.get("moe_shared_expert_intermediate_size"),
            moe_router_enable_expert_bias=bool(a.get("moe_router_enable_expert_bias", False)),
            moe_layer_freq=_layer_freq(a.get("moe_layer_freq", 1)),
            moe_grouped_gemm=bool(a.get("moe_grouped_gemm", False)),
            # args from before Megatron-LM had the flag (or from other tools) do not say: the local spec
            transformer_impl=a.get("transformer_impl") or "local",
        )

    def with_impl(self, names: str) -> "MegatronConfig":
        """This config with the ``transformer_impl`` of naming scheme ``names`` (``"te"`` or ``"local"``,
        :data:`~tenplex_megatron.model.layouts.NAMES`)."""
        impl = "transformer_engine" if names == "te" else "local"
        return self if impl == self.transformer_impl else self.with_overrides({"transformer_impl": impl})

    def with_overrides(self, overrides: Mapping | None) -> "MegatronConfig":
        """This config with the given fields replaced."""
        return type(self).from_json({**self.to_json(), **dict(overrides or {})}) if overrides else self

    @classmethod
    def from_json(cls, obj: Mapping | str) -> "MegatronConfig":
        """From a JSON object (or its text) with the attribute names above."""
        obj = json.loads(obj) if isinstance(obj, str) else dict(obj)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ConfigError(f"MegatronConfig: unknown fields {unknown}")
        return cls(**obj)

    def to_json(self) -> dict:
        """JSON; the MoE fields and ``transformer_impl`` only where they differ from a dense local-spec model's."""
        out = asdict(self)
        for name in _OMITTED_DEFAULTS:
            if out[name] == _OMITTED_DEFAULTS[name]:
                del out[name]
        if isinstance(out.get("moe_layer_freq"), tuple):
            out["moe_layer_freq"] = list(out["moe_layer_freq"])
        return out

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)


TRANSFORMER_IMPLS = ("local", "transformer_engine")
"""Megatron-LM's ``--transformer-impl`` choices tenplex models (``inference_optimized`` is not one)."""

_OMITTED_DEFAULTS = {"transformer_impl": "local", "num_moe_experts": None, "moe_ffn_hidden_size": None,
                 "moe_shared_expert_intermediate_size": None, "moe_router_enable_expert_bias": False,
                 "moe_layer_freq": 1, "moe_grouped_gemm": False, "vocab_padded_from": None}
"""Fields left out of :meth:`MegatronConfig.to_json` at these values (a dense local-spec model's)."""


def _divisible_by(a: dict) -> int:
    """Megatron-LM's ``make_vocab_size_divisible_by`` (128 where the args leave it unset)."""
    value = a.get("make_vocab_size_divisible_by")
    return 128 if value is None else int(value)


def _layer_freq(value: Any) -> int | tuple:
    """Megatron-LM's ``moe_layer_freq``: an int, a list, or its string form ``"([1]*2+[0]*2)"``."""
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text)
        match = re.fullmatch(r"\[([01](?:\s*,\s*[01])*)\]", text)
        if not match:
            raise ConfigError(f"Megatron args: moe_layer_freq={value!r} is not an int or a [0/1, ...] list "
                              "(tenplex evaluates no expressions)")
        return tuple(int(v) for v in match.group(1).split(","))
    return int(value or 1)


def args_to_json(args: Any) -> dict:
    """Megatron args as JSON-able data (torch dtypes become ``"torch.float32"``, others repr)."""
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    out = {}
    for k, v in a.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (str, int, float, bool)) or x is None for x in v):
            out[k] = list(v)
        else:
            text = short(v, 4096)  # bounded: a value from a file may be a DAG with an exponential repr
            out[k] = text if text.startswith("torch.") and not isinstance(v, (dict, list, tuple)) \
                else {"__repr__": text}
    return out


def json_to_args(obj: Mapping) -> argparse.Namespace:
    """Inverse of :func:`args_to_json` as far as possible (torch dtypes restored)."""
    from tenplex_megatron.torchfiles.safe_load import TORCH_DTYPES  # noqa: PLC0415  (torch only when needed)

    values = {}
    for k, v in obj.items():
        if isinstance(v, str) and v.startswith("torch.") and v[6:] in TORCH_DTYPES:
            values[k] = TORCH_DTYPES[v[6:]]
        elif isinstance(v, dict) and "__repr__" in v:
            continue
        else:
            values[k] = v
    return argparse.Namespace(**values)


def stage_layers(args: Any, num_layers: int, pp: int) -> tuple[int, ...] | None:
    """Layers per pipeline stage from Megatron's uneven-pipeline args, or None for an even split.

    Megatron-LM allows the first and the last stage their own layer counts
    (``decoder_first_pipeline_num_layers``, ``decoder_last_pipeline_num_layers``);
    the other stages share the rest evenly. With ``account_for_embedding_in_pipeline_split``
    (``account_for_loss_in_pipeline_split``) the embedding (the loss) counts as a layer of the
    first (last) stage, which builds one decoder layer less (megatron-core 0.16
    ``transformer_block.py::get_num_layers_to_build``).

    Raises:
        ConfigError: if the rest does not split evenly over the middle stages; the embedding or
            loss is counted with virtual pipeline stages (a shorter first or last chunk, which
            tenplex does not model); ``pipeline_model_parallel_layout`` is set.
    """
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    if a.get("pipeline_model_parallel_layout"):
        raise ConfigError(f"Megatron args: pipeline_model_parallel_layout="
                          f"{short(a['pipeline_model_parallel_layout'], 60)}: tenplex reads pipeline splits given "
                          "by decoder_first/last_pipeline_num_layers or account_for_{embedding,loss}_in_pipeline_split")
    counted = [bool(a.get(f"account_for_{part}_in_pipeline_split")) for part in ("embedding", "loss")]
    if pp > 1 and any(counted):
        return _counted_stages(a, num_layers, pp, *counted)
    first, last = a.get("decoder_first_pipeline_num_layers"), a.get("decoder_last_pipeline_num_layers")
    if pp == 1 or (first is None and last is None):
        return None
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle < 0 or (middle == 0 and rest) or (middle and rest % middle):
        raise ConfigError(f"uneven pipeline: first={first}, last={last} layers leave {rest} layers "
                          f"for {middle} middle stages of pp={pp}")
    even = rest // middle if middle else 0
    layers = [even] * pp
    if first is not None:
        layers[0] = first
    if last is not None:
        layers[-1] = last
    return tuple(layers)


def _counted_stages(a: dict, num_layers: int, pp: int, embedding: bool, loss: bool) -> tuple[int, ...] | None:
    """The stages of :func:`stage_layers` when the embedding and/or loss count as layers."""
    vpp = a.get("virtual_pipeline_model_parallel_size")
    if vpp and vpp > 1:
        raise ConfigError(f"Megatron args: account_for_embedding/loss_in_pipeline_split with vpp={vpp} "
                          "shortens the first or last virtual stage, which tenplex does not model")
    total = num_layers + embedding + loss
    if total % pp:
        raise ConfigError(f"Megatron args: {num_layers} layers with the embedding={embedding} and loss={loss} "
                          f"counted do not split evenly over pp={pp}")
    layers = [total // pp] * pp
    layers[0] -= embedding
    layers[-1] -= loss
    return None if len(set(layers)) == 1 else tuple(layers)


def uneven_args(layers: tuple[int, ...] | None) -> dict:
    """Megatron-LM args for ``layers`` per stage.

    Raises:
        ConfigError: if only the first and last stages cannot express it.
    """
    if layers is None or len(set(layers)) == 1:
        return {"decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None}
    middle = layers[1:-1]
    if len(set(middle)) > 1:
        raise ConfigError(f"Megatron-LM allows uneven first and last stages only; {list(layers)} "
                          "has uneven middle stages")
    return {"decoder_first_pipeline_num_layers": layers[0], "decoder_last_pipeline_num_layers": layers[-1]}


def args_for(args: Any, cfg: MegatronConfig, config: Any) -> argparse.Namespace:
    """Megatron-LM ``args`` rewritten for the parallel ``config`` (the one rewrite every writer uses).

    Args:
        args: the source's args: a Namespace, a mapping, or :func:`args_to_json`'s
            JSON form (torch dtypes restored); ``None`` gives an empty Namespace.
        cfg: the model config (gives the padded vocabulary at the new tp).
        config: the target :class:`~tenplex.ptree.config.ParallelConfig`.

    Returns:
        A new Namespace whose ``tensor_model_parallel_size``,
        ``pipeline_model_parallel_size``, ``data_parallel_size``, ``context_parallel_size``,
        ``expert_model_parallel_size``, ``expert_tensor_parallel_size``,
        ``world_size``, ``padded_vocab_size`` and every pipeline-layout field
        (:func:`pipeline_args`) describe ``config``, ``transformer_impl`` is ``cfg``'s (where the
        args have the field or ``cfg`` is TE's); every other field is the source's.

    Raises:
        ConfigError: if ``config``'s stages cannot be written as Megatron-LM args.
    """
    if isinstance(args, argparse.Namespace):
        out = argparse.Namespace(**vars(args))
    else:
        out = json_to_args(args or {})
    out.tensor_model_parallel_size, out.pipeline_model_parallel_size = config.tp, config.pp
    out.data_parallel_size = config.dp
    out.world_size = config.world_size
    out.context_parallel_size = config.cp
    out.expert_model_parallel_size, out.expert_tensor_parallel_size = config.ep, config.etp
    out.padded_vocab_size = cfg.padded_vocab(config.tp)
    if "transformer_impl" in vars(out) or cfg.transformer_impl != "local":
        out.transformer_impl = cfg.transformer_impl
    vars(out).update(pipeline_args(config))
    return out


def pipeline_args(config: Any) -> dict:
    """Every Megatron-LM arg the pipeline layout is derived from, for ``config``.

    Megatron-LM core_v0.16.1 ``arguments.py::validate_args`` recomputes
    ``virtual_pipeline_model_parallel_size`` from ``num_layers_per_virtual_pipeline_stage`` or
    ``num_virtual_stages_per_pipeline_rank`` (at most one may be set), builds the stages from
    ``pipeline_model_parallel_layout`` when given, and moves layers for
    ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``. The
    target's layout is written as ``num_virtual_stages_per_pipeline_rank`` (vpp) and the uneven
    first and last stages (:func:`uneven_args`); the other fields are cleared, so that nothing
    of the source's layout remains.
    """
    vpp = config.vpp if config.vpp > 1 else None
    return {"virtual_pipeline_model_parallel_size": vpp, "num_virtual_stages_per_pipeline_rank": vpp,
            "num_layers_per_virtual_pipeline_stage": None, "pipeline_model_parallel_layout": None,
            "account_for_embedding_in_pipeline_split": False, "account_for_loss_in_pipeline_split": False,
            **uneven_args(config.stage_layers)}

"""Tree and layouts of a Megatron GPT model, and its key names in every format.

One table, :func:`param_specs`, lists the model's parameters in Megatron's
``named_parameters()`` order (megatron-core's local layer spec), each with:

- its tree path (``model/decoder/layers/3/mlp/linear_fc1/weight``, global layer);
- its megatron-core key (``decoder.layers.{i}.mlp.linear_fc1.weight``, stage-local
  layer ``{i}`` in per-rank state dicts);
- its legacy Megatron-LM key (``language_model.encoder.layers.{i}.mlp.dense_h_to_4h.weight``);
- its ``dist_checkpointing`` key, layers stacked on a leading axis
  (``decoder.layers.mlp.linear_fc1.weight``; norms under TE-style names such
  as ``decoder.layers.self_attention.linear_qkv.layer_norm_weight``);
- its layout (Megatron's tensor-parallel rules, ``tensor_parallel/layers.py``):
  fused QKV column-parallel on whole query groups, in Megatron's interleaved
  per-group order ``[q heads of g; k_g; v_g]``; ``linear_proj`` and
  ``linear_fc2`` row-parallel; SwiGLU ``linear_fc1`` as two parts
  ``[gate; up]``; embeddings and output layer vocab-parallel, padded to a
  multiple of ``make_vocab_size_divisible_by * tp``; norms and row-parallel
  biases replicated. A tied output layer is the word embedding on the first
  and last stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import groupby

from tenplex.errors import ConfigError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.layout import Expert, Layout, Padding, Split, Stage, StageKind
from tenplex.ptree.tree import PTree, Scope, TensorLeaf, ValueLeaf

from tenplex_megatron.model.derived import derived
from tenplex_megatron.model.config import MegatronConfig

__all__ = ["check_attention_tp", "check_names", "NAMES", "TE_KEYS_MAP", "ParamSpec", "param_specs", "megatron_tree", "OPTIMIZER_STATES", "CHECKPOINT_VALUES",
           "EXTRA_STATE_LINEARS", "optimizer_path", "rank_keys", "param_order", "spec_of",
           "extra_state_keys", "chunk_keys"]

OPTIMIZER_STATES = ("param", "exp_avg", "exp_avg_sq")
"""Adam state per parameter: fp32 main param, first and second moments."""

CHECKPOINT_VALUES = {
    "megatron/iteration": ValueLeaf(),
    "megatron/checkpoint_version": ValueLeaf(),
    "megatron/args": ValueLeaf(),
    "megatron/opt_param_scheduler": ValueLeaf(),
    "megatron/optimizer": ValueLeaf(),
    "megatron/num_floating_point_operations_so_far": ValueLeaf(),
    "megatron/rng_state": ValueLeaf(Scope.COORD, ("tp", "pp")),
    "megatron/extra": ValueLeaf(),
}
"""Value leaves of a Megatron checkpoint (JSON). RNG state is kept per (tp, pp) coordinate.
``megatron/extra`` carries other top-level entries that are the same on every rank
(e.g. Megatron-LM's ``rerun_state_machine``), as they are."""

NAMES = ("local", "te")
"""Naming schemes: megatron-core's local layer spec (``get_gpt_layer_local_spec``) and
TransformerEngine's (``get_gpt_layer_with_transformer_engine_spec``, Megatron-LM's default
``--transformer-impl transformer_engine``)."""

TE_KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""A layer's local-spec key prefixes and their TE names: megatron-core's own
``sharded_state_dict_keys_map`` of the local spec (core_v0.16.1 ``models/gpt/gpt_layer_specs.py``,
applied by ``TransformerLayer.sharded_state_dict``; the tests compare the two). TE fuses these norms
into ``TELayerNormColumnParallelLinear``, so a TE model's own state dict uses the TE names too.
An MoE layer under TE keeps a separate ``pre_mlp_layernorm`` (the TE spec builds it when
``num_experts``), in both formats; the local spec's map still renames it in ``torch_dist``."""

def check_names(names: str) -> str:
    """``names`` if it is a naming scheme (:data:`NAMES`).

    Raises:
        ConfigError: for anything else.
    """
    if names not in NAMES:
        raise ConfigError(f"naming scheme {names!r}: expected one of {', '.join(NAMES)}")
    return names


EXTRA_STATE_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv",
                       "mlp.linear_fc1", "mlp.linear_fc2")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter in every naming scheme (see the module docstring).

    ``layer`` is the global layer index, or ``None`` outside the layers;
    ``mcore`` and ``legacy`` hold ``{i}`` for the chunk-local layer index and,
    for an expert's tensors, ``{j}`` for its local expert id on its ep rank
    (``expert`` is the global id, ``j = expert % (E / ep)``). An expert's
    ``legacy`` names are the grouped-GEMM ones (``mlp.experts.linear_fc1.weight{j}``,
    megatron-core ``TEGroupedMLP``), its ``mcore`` names the ``SequentialMLP`` ones.
    ``param`` is False for buffers kept in the model state but not trained
    (the router's ``expert_bias``): they have no optimizer state.
    """

    path: str
    mcore: str
    legacy: tuple[str, ...]
    dist: str
    layer: int | None
    leaf: TensorLeaf
    no_weight_decay: bool
    expert: int | None = None
    param: bool = True
    te: str | None = None
    te_dist: str | None = None

    def keys(self, local_layer: int | None, ep: int) -> list[str]:
        """Accepted state-dict keys (megatron-core local spec first, TE's last) at chunk-local
        layer ``local_layer``."""
        fmt = {} if local_layer is None else {"i": local_layer}
        if self.expert is not None:
            fmt["j"] = self.leaf.layout.expert.local_index(ep)
        return [self.mcore.format(**fmt)] + [k.format(**fmt) for k in self.legacy] \
            + ([self.te.format(**fmt)] if self.te else [])

    def dist_name(self, names: str = "local") -> str:
        """The ``torch_dist`` key (stacked form) under naming scheme ``names`` (:data:`NAMES`)."""
        return self.te_dist if names == "te" and self.te_dist else self.dist


def optimizer_path(state: str, path: str) -> str:
    """The tree path of Adam ``state`` for parameter ``path``."""
    return f"optimizer/{state}/{path.removeprefix('model/')}"


def param_specs(cfg: MegatronConfig) -> list[ParamSpec]:
    """Every parameter (and model buffer), in Megatron's ``named_parameters()`` order."""
    return list(_param_specs(cfg))


def _spec_index(cfg: MegatronConfig) -> dict[str, ParamSpec]:
    return derived(cfg, "spec_index", lambda: {s.path: s for s in _param_specs(cfg)})


def _param_specs(cfg: MegatronConfig) -> tuple[ParamSpec, ...]:
    return derived(cfg, "param_specs", lambda: _make_param_specs(cfg))


def _make_param_specs(cfg: MegatronConfig) -> tuple[ParamSpec, ...]:
    dt, h = cfg.params_dtype, cfg.hidden_size
    vocab = Layout(Stage(StageKind.FIRST_AND_LAST) if cfg.tied else Stage(StageKind.FIRST),
                   Split(0, unit="padded_vocab_size"), Padding(0, cfg.make_vocab_size_divisible_by))
    out = [_spec("embedding.word_embeddings.weight", ("language_model.embedding.word_embeddings.weight",),
                 None, (cfg.vocab_size, h), dt, vocab, False)]
    if cfg.position_embedding_type == "learned_absolute":
        out.append(_spec("embedding.position_embeddings.weight",
                         ("language_model.embedding.position_embeddings.weight",), None,
                         (cfg.max_position_embeddings, h), dt, Layout(Stage(StageKind.FIRST)), False))
    for i in range(cfg.num_layers):
        out.extend(_layer(cfg, i))
    last = Layout(Stage(StageKind.LAST))
    out.extend(_norm(cfg, "decoder.final_layernorm", ("language_model.encoder.final_norm",
                                                      "language_model.encoder.final_layernorm"),
                     None, last))
    if not cfg.tied:
        out.append(_spec("output_layer.weight", ("language_model.output_layer.weight",), None,
                         (cfg.vocab_size, h), dt,
                         Layout(Stage(StageKind.LAST), Split(0, unit="padded_vocab_size"),
                                Padding(0, cfg.make_vocab_size_divisible_by)), False))
    return tuple(out)


def _spec(mcore, legacy, layer, shape, dtype, layout, no_wd, dist=None) -> ParamSpec:
    path = "model/" + mcore.replace("{i}", str(layer)).replace(".", "/")
    return ParamSpec(path, mcore, tuple(legacy), dist or mcore.replace(".{i}", ""), layer,
                     TensorLeaf(shape, dtype, Layout(layout.stage if layer is None else
                                                     Stage.of_layer(layer), layout.split,
                                                     layout.padding)), no_wd)


def _norm(cfg, mcore, legacy, layer, layout, dist=None, size=None, te=False) -> list[ParamSpec]:
    """A norm's weight (and bias); ``te``: its TE names come from :data:`TE_KEYS_MAP` (fused into the
    next linear in a dense layer; in an MoE layer only ``input_layernorm`` is)."""
    names = ["weight"] + (["bias"] if cfg.normalization == "LayerNorm" else [])
    out = []
    for n in names:
        spec = _spec(f"{mcore}.{n}", tuple(f"{l}.{n}" for l in legacy), layer, (size or cfg.hidden_size,),
                     cfg.params_dtype, layout, True, None if dist is None else f"{dist}_{n}")
        if te:
            head, _, last = mcore.rpartition(".")
            fused = TE_KEYS_MAP[last + "."]
            if last == "pre_mlp_layernorm" and cfg.is_moe_layer(layer):  # a separate module under TE
                spec = replace(spec, te_dist=spec.mcore.replace(".{i}", ""))
            else:
                spec = replace(spec, te=f"{head}.{fused}{n}")
        out.append(spec)
    return out


def _layer(cfg: MegatronConfig, i: int) -> list[ParamSpec]:
    dt, h, d = cfg.params_dtype, cfg.hidden_size, cfg.kv_channels
    rep = Layout()
    # tp may exceed the query groups (megatron-core attention.py: num_query_groups < world_size):
    # linear_qkv is then cut into tp equal row blocks, which need not hold whole groups; the
    # rule on tp is :func:`check_attention_tp`'s
    qkv = Layout(split=Split(0, unit="linear_qkv rows"))
    proj = Layout(split=Split(1, granularity=d, unit="num_attention_heads"))
    F = cfg.ffn_hidden_size
    fc1 = Layout(split=Split(0, parts=(F, F) if cfg.swiglu else None, unit="ffn_hidden_size"))
    fc2 = Layout(split=Split(1, unit="ffn_hidden_size"))
    L = "language_model.encoder.layers.{i}"
    D = "decoder.layers.{i}"
    out = _norm(cfg, f"{D}.input_layernorm", (f"{L}.input_norm", f"{L}.input_layernorm"), i, rep,
                dist="decoder.layers.self_attention.linear_qkv.layer_norm", te=True)
    out.append(_spec(f"{D}.self_attention.linear_proj.weight", (f"{L}.self_attention.dense.weight",),
                     i, (h, cfg.num_attention_heads * d), dt, proj, False))
    if cfg.add_bias_linear:
        out.append(_spec(f"{D}.self_attention.linear_proj.bias", (f"{L}.self_attention.dense.bias",),
                         i, (h,), dt, rep, True))
    out.append(_spec(f"{D}.self_attention.linear_qkv.weight",
                     (f"{L}.self_attention.query_key_value.weight",), i, (cfg.qkv_rows, h), dt, qkv, False))
    if cfg.qkv_bias:
        out.append(_spec(f"{D}.self_attention.linear_qkv.bias",
                         (f"{L}.self_attention.query_key_value.bias",), i, (cfg.qkv_rows,), dt, qkv, True))
    if cfg.qk_layernorm:  # per-head norms, [kv_channels], replicated (attention.py: SelfAttention)
        for which in ("q", "k"):
            out.extend(_norm(cfg, f"{D}.self_attention.{which}_layernorm", (), i, rep, size=d))
    out.extend(_norm(cfg, f"{D}.pre_mlp_layernorm",
                     (f"{L}.post_attention_norm", f"{L}.post_attention_layernorm"), i, rep,
                     dist="decoder.layers.mlp.linear_fc1.layer_norm", te=True))
    if cfg.is_moe_layer(i):
        return out + _moe(cfg, i)
    rows = 2 * F if cfg.swiglu else F
    out.append(_spec(f"{D}.mlp.linear_fc1.weight", (f"{L}.mlp.dense_h_to_4h.weight",), i, (rows, h), dt,
                     fc1, False))
    if cfg.add_bias_linear:
        out.append(_spec(f"{D}.mlp.linear_fc1.bias", (f"{L}.mlp.dense_h_to_4h.bias",), i, (rows,), dt,
                         fc1, True))
    out.append(_spec(f"{D}.mlp.linear_fc2.weight", (f"{L}.mlp.dense_4h_to_h.weight",), i, (h, F), dt,
                     fc2, False))
    if cfg.add_bias_linear:
        out.append(_spec(f"{D}.mlp.linear_fc2.bias", (f"{L}.mlp.dense_4h_to_h.bias",), i, (h,), dt,
                         rep, True))
    return out


def _moe(cfg: MegatronConfig, i: int) -> list[ParamSpec]:
    """An MoE layer's MLP (megatron-core ``MoELayer``: ``TopKRouter``, ``SequentialMLP``,
    ``SharedExpertMLP``), in ``named_parameters()`` order; the router's ``expert_bias``
    is a persistent buffer (``param=False``)."""
    dt, h, E, D = cfg.params_dtype, cfg.hidden_size, cfg.num_moe_experts, "decoder.layers.{i}.mlp"
    rep = Layout()
    out = [_spec(f"{D}.router.weight", (), i, (E, h), dt, rep, False)]
    if cfg.moe_router_enable_expert_bias:
        bias = _spec(f"{D}.router.expert_bias", (), i, (E,), "float32", rep, True)
        out.append(ParamSpec(bias.path, bias.mcore, (), bias.dist, i, bias.leaf, True, param=False))
    F = cfg.moe_ffn_hidden_size
    shapes = {"linear_fc1": ((2 * F if cfg.swiglu else F, h),
                             Split(0, parts=(F, F) if cfg.swiglu else None, unit="moe_ffn_hidden_size")),
              "linear_fc2": ((h, F), Split(1, unit="moe_ffn_hidden_size"))}
    for g in range(E):
        for linear, (shape, split) in shapes.items():
            path = f"model/decoder/layers/{i}/mlp/experts/{g}/{linear}/weight"
            leaf = TensorLeaf(shape, dt, Layout(Stage.of_layer(i), split, expert=Expert(g, E)))
            out.append(ParamSpec(path, f"{D}.experts.local_experts.{{j}}.{linear}.weight",
                                 (f"{D}.experts.{linear}.weight{{j}}",),
                                 f"decoder.layers.mlp.experts.experts.{linear}.weight", i, leaf, False, g))
    Fs = cfg.moe_shared_expert_intermediate_size
    if Fs:
        fc1 = Layout(split=Split(0, parts=(Fs, Fs) if cfg.swiglu else None,
                                 unit="moe_shared_expert_intermediate_size"))
        out.append(_spec(f"{D}.shared_experts.linear_fc1.weight", (), i,
                         (2 * Fs if cfg.swiglu else Fs, h), dt, fc1, False))
        out.append(_spec(f"{D}.shared_experts.linear_fc2.weight", (), i, (h, Fs), dt,
                         Layout(split=Split(1, unit="moe_shared_expert_intermediate_size")), False))
    return out


def extra_state_keys(cfg: MegatronConfig, layer: int, ep: int, names: str = "local") -> list[str]:
    """The ``_extra_state`` keys of global layer ``layer``, chunk-local index ``{i}``.

    A ``SequentialMLP`` has one per local expert and linear; a grouped-GEMM
    expert block one per grouped linear (``TEGroupedLinear``). Under TE names
    (``names="te"``) the attention's ``core_attention`` (``TEDotProductAttention``) has one too.
    """
    D = "decoder.layers.{i}"
    keys = [f"{D}.self_attention.linear_proj", f"{D}.self_attention.linear_qkv"]
    if names == "te":
        keys.insert(0, f"{D}.self_attention.core_attention")
    if not cfg.is_moe_layer(layer):
        keys += [f"{D}.mlp.linear_fc1", f"{D}.mlp.linear_fc2"]
    else:
        linears = ("linear_fc1", "linear_fc2")
        if cfg.moe_grouped_gemm:
            keys += [f"{D}.mlp.experts.{n}" for n in linears]
        else:
            keys += [f"{D}.mlp.experts.local_experts.{j}.{n}" for j in range(cfg.num_moe_experts // ep)
                     for n in linears]
        if cfg.moe_shared_expert_intermediate_size:
            keys += [f"{D}.mlp.shared_experts.{n}" for n in linears]
    return [k + "._extra_state" for k in keys]


def check_attention_tp(cfg: MegatronConfig, tp: int) -> None:
    """megatron-core's rule for tp over attention (core_v0.16.1 ``transformer/attention.py``,
    ``Attention.__init__``): tp divides the heads, and either divides the query groups or is a
    multiple of them (then each group's key/value heads are used by ``tp / groups`` ranks).

    Raises:
        ConfigError: naming the heads, the groups and tp.
    """
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    if heads % tp or (groups % tp and tp % groups):
        raise ConfigError(f"tp={tp} does not divide num_query_groups={groups}, nor is a multiple of it "
                          f"that divides num_attention_heads={heads} (megatron-core attention.py)")


def megatron_tree(cfg: MegatronConfig, optimizer: bool = False) -> PTree:
    """The tree of a Megatron GPT model (and, with ``optimizer``, its Adam state).

    Optimizer state (fp32 main params and moments) has its parameter's layout,
    dense across dp: Megatron's checkpoint formats store it gathered (model
    space for ``fully_reshardable``, whole flat buffers for ``dp_reshardable``
    and ``distrib_optim.pt``).
    """
    leaves: dict = {}
    specs = param_specs(cfg)
    for s in specs:
        leaves[s.path] = s.leaf
    if optimizer:
        for state in OPTIMIZER_STATES:
            for s in (s for s in specs if s.param):
                leaves[optimizer_path(state, s.path)] = TensorLeaf(s.leaf.shape, "float32", s.leaf.layout)
    leaves.update(CHECKPOINT_VALUES)
    return PTree(leaves, cfg.num_layers)


def spec_of(cfg: MegatronConfig, path: str) -> ParamSpec:
    """The parameter spec of tree path ``path`` (a model path)."""
    spec = _spec_index(cfg).get(path)
    if spec is None:
        raise KeyError(path)
    return spec


def _places(spec: ParamSpec, cfg: MegatronConfig, config: ParallelConfig) -> list[tuple[int, int]]:
    """``(stage, virtual chunk)`` of each copy of ``spec`` (first-stage tensors in chunk 0 of stage 0,
    last-stage ones in the last chunk of the last stage, as megatron's pre/post-process chunks)."""
    if spec.layer is not None:
        return [config.chunk_of_layer(spec.layer, cfg.num_layers)]
    last = (config.pp - 1, config.vpp - 1)
    kind = spec.leaf.layout.stage.kind
    if kind is StageKind.FIRST:
        return [(0, 0)]
    if kind is StageKind.LAST:
        return [last]
    return [(0, 0)] if config.pp == 1 else [(0, 0), last]


def chunk_keys(cfg: MegatronConfig, config: ParallelConfig, pp_rank: int, chunk: int = 0,
               ep_rank: int = 0) -> dict[str, list[str]]:
    """``{tree path: [accepted state-dict keys, megatron-core first]}`` of one model chunk.

    The chunk is virtual chunk ``chunk`` of pipeline stage ``pp_rank`` on ep
    rank ``ep_rank`` (which holds experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``,
    named by their local ids ``0 .. E / ep - 1``). Layer indices in the keys
    are chunk-local (Megatron-LM's ``model0``, ``model1``, ... each start at 0).
    A tied embedding on the last stage (pp > 1) is read from the last stage's
    ``output_layer.weight`` (megatron-core) or ``word_embeddings_for_head.weight``
    (Megatron-LM).
    """
    out: dict[str, list[str]] = {}
    last = (pp_rank, chunk) == (config.pp - 1, config.vpp - 1)
    for spec in param_specs(cfg):
        if (pp_rank, chunk) not in _places(spec, cfg, config):
            continue
        expert = spec.leaf.layout.expert
        if expert is not None and expert.owner(config.ep) != ep_rank:
            continue
        local = None if spec.layer is None else spec.layer - config.first_layer(pp_rank, cfg.num_layers, chunk)
        keys = spec.keys(local, config.ep)
        if spec.path.endswith("word_embeddings/weight") and last and config.pp > 1 and cfg.tied:
            keys = (keys if pp_rank == 0 else []) + ["output_layer.weight", "word_embeddings_for_head.weight"]
        out[spec.path] = keys
    return out


def rank_keys(cfg: MegatronConfig, config: ParallelConfig, pp_rank: int, ep_rank: int = 0
              ) -> dict[str, list[str]]:
    """:func:`chunk_keys` of every chunk of stage ``pp_rank`` (one dict; with vpp > 1 the
    chunks' keys overlap, so use :func:`chunk_keys` per chunk)."""
    out: dict[str, list[str]] = {}
    for v in range(config.vpp):
        out.update(chunk_keys(cfg, config, pp_rank, v, ep_rank))
    return out


def param_order(cfg: MegatronConfig, config: ParallelConfig, pp_rank: int, chunk: int = 0,
                ep_rank: int = 0) -> list[ParamSpec]:
    """A model chunk's parameters in ``named_parameters()`` order (no buffers), under the layer spec
    of ``cfg.transformer_impl``.

    The order of optimizer state kept by position (the distributed optimizer's flat buffers,
    a non-distributed optimizer's param groups) follows it. On the last stage of a tied pipeline
    the embedding copy is the output layer, registered last (megatron-core ``GPTModel``). Under
    TransformerEngine's spec a layer's ``input_layernorm`` is ``IdentityOp`` and its parameters
    live in ``self_attention.linear_qkv`` (``TELayerNormColumnParallelLinear``), registered before
    its ``weight`` (TE ``LayerNormLinear.__init__``: ``layer_norm_weight``, ``layer_norm_bias``,
    then ``weight``, ``bias``), which megatron-core's ``SelfAttention`` builds after
    ``linear_proj`` (``Attention.__init__``): so the norm moves from first in the layer to after
    ``linear_proj``. ``pre_mlp_layernorm`` keeps its place under both (fused into ``linear_fc1``,
    first in ``mlp``; a separate module in an MoE layer).

    Grouped-GEMM experts under TE (``--moe-grouped-gemm``: megatron-core ``TEGroupedMLP``) hold
    each linear's local experts in one module: ``TEGroupedMLP.__init__`` builds ``linear_fc1``,
    then ``linear_fc2``, and TE's ``GroupedLinear.__init__`` registers ``weight0``, ``weight1``, ...
    (each ``bias{i}`` after its ``weight{i}``). So a layer's expert parameters are every local
    expert's ``linear_fc1`` weight, then every ``linear_fc2`` one, where ``SequentialMLP`` has
    each expert's pair in turn.
    """
    keys = chunk_keys(cfg, config, pp_rank, chunk, ep_rank)
    specs = [s for s in param_specs(cfg) if s.path in keys and s.param]
    if cfg.tied and config.pp > 1 and (pp_rank, chunk) == (config.pp - 1, config.vpp - 1):
        emb = next(s for s in specs if s.path.endswith("word_embeddings/weight"))
        specs = [s for s in specs if s is not emb] + ([emb] if pp_rank != 0 else [])
    if cfg.transformer_impl == "transformer_engine":
        if cfg.moe_grouped_gemm:
            specs = _grouped_order(specs)
        specs = _te_order(specs)
    return specs


def _grouped_order(specs: list[ParamSpec]) -> list[ParamSpec]:
    """``specs`` with each layer's experts in ``TEGroupedMLP`` order (see :func:`param_order`):
    the ``linear_fc1`` weights of the local experts by id, then the ``linear_fc2`` ones."""
    out: list[ParamSpec] = []
    for (expert, _), group in groupby(specs, key=lambda s: (s.expert is not None, s.layer)):
        run = list(group)  # one layer's experts in SequentialMLP order, or other parameters
        out += sorted(run, key=lambda e: "/linear_fc2/" in e.path) if expert else run  # stable: by id
    return out


def _te_order(specs: list[ParamSpec]) -> list[ParamSpec]:
    """``specs`` with each layer's ``input_layernorm`` parameters moved to just before its
    ``linear_qkv.weight`` (see :func:`param_order`)."""
    norms: dict[int | None, list[ParamSpec]] = {}
    for s in specs:
        if "/input_layernorm/" in s.path:
            norms.setdefault(s.layer, []).append(s)
    out = []
    for s in specs:
        if "/input_layernorm/" in s.path:
            continue
        if s.path.endswith("/self_attention/linear_qkv/weight"):
            out.extend(norms.get(s.layer, []))
        out.append(s)
    return out

"""A GPT-style tree spec, laid out the way Megatron lays out its GPT models.

This knows transformer *structure* (it is used by the tests, benchmarks and
examples); it knows nothing of Megatron's key names or file formats, which
live in the Megatron integration.

Layouts (Megatron's tensor-parallel rules, ``megatron/core/tensor_parallel/layers.py``):

- fused QKV ``[groups * (heads/groups + 2) * head_dim, hidden]``, column
  parallel, in Megatron's interleaved per-group order; split on whole query
  groups;
- attention output projection ``[hidden, heads * head_dim]``, row parallel;
- MLP fc1 ``[ffn, hidden]`` (``[2 * ffn, hidden]`` as ``[gate; up]`` with
  SwiGLU), column parallel; fc2 ``[hidden, ffn]``, row parallel;
- word embeddings ``[vocab, hidden]`` split on the vocabulary, padded to a
  multiple of ``make_vocab_size_divisible_by * tp``; tied to the output layer
  (first and last stage) or with a separate output layer on the last stage;
- norms and row-parallel biases replicated;
- mixture-of-experts MLPs (``num_experts > 0``, see :mod:`tenplex.models.moe`):
  a replicated router, experts with a global expert id each (fc1 column- and
  fc2 row-parallel over expert tp), an optional shared expert laid out like a
  dense MLP.

With ``optimizer="adam"`` each parameter gets fp32 ``exp_avg`` and
``exp_avg_sq`` with the parameter's layout (and an fp32 ``main_param`` when
the parameter is 16-bit). With ``optimizer="distributed_adam"`` those are
dp-sharded through a flat buffer whose members are the parameters in
reverse order, as Megatron's DDP buffers are; the tied word embedding gets a
bucket of its own where it lives on two stages (megatron-core's
``_does_param_require_new_bucket``), and with ep > 1 the experts' ranges come
from the buffer's expert part (:mod:`tenplex.ptree.buffer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tenplex.errors import ConfigError
from tenplex.models.mlp import dense_mlp
from tenplex.models.moe import moe_mlp
from tenplex.ptree.buffer import Bucketing, FlatBuffer
from tenplex.ptree.layout import DPShard, Layout, Padding, Split, Stage, StageKind
from tenplex.ptree.tree import PTree, Scope, TensorLeaf, ValueLeaf

__all__ = ["GPTSpec", "gpt_tree", "GPT3_175B"]


@dataclass(frozen=True)
class GPTSpec:
    """A GPT model's shape.

    Attributes:
        num_layers: transformer layers.
        hidden: hidden size.
        heads: attention heads.
        query_groups: key/value groups (GQA); ``heads`` for multi-head attention.
        ffn: MLP inner size (per half, with SwiGLU).
        vocab: logical vocabulary size.
        seq_len: maximum sequence length (learned position embeddings).
        swiglu: SwiGLU MLP (fc1 is ``[gate; up]``).
        tied: tie the output layer to the word embeddings.
        rope: rotary positions (no position embedding table).
        bias: linear layers have biases.
        layernorm: LayerNorm (weight and bias) rather than RMSNorm (weight).
        dtype: parameter dtype name.
        make_vocab_size_divisible_by: Megatron's vocabulary padding base.
        optimizer: ``None``, ``"adam"`` or ``"distributed_adam"``.
        bucket_numel: distributed-optimizer bucket size, in elements.
        bucketing: which buffer instances ``bucket_numel`` applies to.
        num_experts: experts per MoE layer; 0 for a dense model.
        moe_ffn: expert MLP inner size (per half, with SwiGLU); ``None``: ``ffn``.
        topk: experts each token is routed to (the router's top-k; it does
            not change the state's shapes).
        shared_expert_ffn: the shared expert's inner size; 0 for none.
        shared_expert_gate: the shared expert has a gate weight.
        expert_bias: the router keeps an fp32 expert bias (aux-loss-free
            balancing; a buffer, not optimized).
        moe_layer_freq: layer ``i`` is an MoE layer when ``i % moe_layer_freq == 0``.
    """

    num_layers: int = 2
    hidden: int = 64
    heads: int = 4
    query_groups: int = 4
    ffn: int = 128
    vocab: int = 1000
    seq_len: int = 64
    swiglu: bool = False
    tied: bool = True
    rope: bool = False
    bias: bool = True
    layernorm: bool = True
    dtype: str = "float32"
    make_vocab_size_divisible_by: int = 128
    optimizer: str | None = None
    bucket_numel: int | None = None
    bucketing: Bucketing = Bucketing.ALL
    num_experts: int = 0
    moe_ffn: int | None = None
    topk: int = 2
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False
    expert_bias: bool = False
    moe_layer_freq: int = 1

    def __post_init__(self) -> None:
        if self.heads % self.query_groups or self.hidden % self.heads:
            raise ConfigError(f"GPTSpec: heads={self.heads} must be a multiple of "
                              f"query_groups={self.query_groups} and divide hidden={self.hidden}")
        if self.optimizer not in (None, "adam", "distributed_adam"):
            raise ConfigError(f"GPTSpec: unknown optimizer {self.optimizer!r}")
        if self.num_experts < 0 or self.moe_layer_freq < 1 or \
                (self.num_experts and not 1 <= self.topk <= self.num_experts):
            raise ConfigError(f"GPTSpec: need num_experts >= 0, moe_layer_freq >= 1 and "
                              f"1 <= topk <= num_experts, got num_experts={self.num_experts}, "
                              f"moe_layer_freq={self.moe_layer_freq}, topk={self.topk}")

    def is_moe_layer(self, layer: int) -> bool:
        """True if ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer % self.moe_layer_freq == 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


GPT3_175B = GPTSpec(num_layers=96, hidden=12288, heads=96, query_groups=96, ffn=4 * 12288,
                    vocab=50257, seq_len=2048, dtype="bfloat16", optimizer="distributed_adam",
                    bucket_numel=40_000_000)
"""GPT-3 175B (Brown et al. 2020, table 2.1) with mixed-precision Adam."""


def gpt_tree(spec: GPTSpec) -> PTree:
    """The tree of a GPT model (and its optimizer and job state) for ``spec``."""
    params, buffers_state = _params(spec)
    leaves: dict = {**params, **buffers_state}
    buffers = ()
    if spec.optimizer:
        dist = spec.optimizer == "distributed_adam"
        if dist:
            embedding = "model/embedding/word_embeddings/weight"
            buffers = (FlatBuffer("grad", tuple(reversed(list(params))), align=64,
                                  pad_multiple=128, bucket_numel=spec.bucket_numel,
                                  own_bucket=(embedding,) if spec.tied else (),
                                  bucketing=spec.bucketing),)
        for state in ("exp_avg", "exp_avg_sq") + (("main_param",) if spec.dtype != "float32" else ()):
            for path, leaf in params.items():
                layout = leaf.layout
                if dist:
                    layout = Layout(layout.stage, layout.split, layout.padding, DPShard("grad", path),
                                    layout.expert)
                leaves[f"optimizer/{state}/{path}"] = TensorLeaf(leaf.shape, "float32", layout)
        leaves["optimizer/step"] = ValueLeaf()
    leaves["scheduler/lr"] = ValueLeaf()
    leaves["data/consumed_samples"] = ValueLeaf()
    leaves["rng/tensor_parallel"] = ValueLeaf(Scope.COORD, ("tp", "pp"))
    if spec.num_experts:
        leaves["rng/expert_parallel"] = ValueLeaf(Scope.COORD, ("ep", "etp", "pp"))
    return PTree(leaves, spec.num_layers, buffers)


def _params(spec: GPTSpec) -> tuple[dict[str, TensorLeaf], dict[str, TensorLeaf]]:
    """``(parameters, non-parameter tensors)``, each in module order."""
    dt, h = spec.dtype, spec.hidden
    first, last = Stage(StageKind.FIRST), Stage(StageKind.LAST)
    vocab_layout = Layout(Stage(StageKind.FIRST_AND_LAST) if spec.tied else first,
                          Split(0), Padding(0, spec.make_vocab_size_divisible_by))
    out = {"model/embedding/word_embeddings/weight": TensorLeaf((spec.vocab, h), dt, vocab_layout)}
    if not spec.rope:
        out["model/embedding/position_embeddings/weight"] = TensorLeaf((spec.seq_len, h), dt,
                                                                       Layout(first))
    state = {}
    for i in range(spec.num_layers):
        out.update(_layer(spec, i))
        if spec.is_moe_layer(i):
            params, buffers = moe_mlp(spec, i, f"model/layers/{i}/mlp")
            out.update(params)
            state.update(buffers)
        else:
            out.update(_mlp(spec, i))
    out.update(_norm(spec, "model/final_norm", Layout(last)))
    if not spec.tied:
        out["model/output_layer/weight"] = TensorLeaf(
            (spec.vocab, h), dt, Layout(last, Split(0), Padding(0, spec.make_vocab_size_divisible_by)))
    return out, state


def _norm(spec: GPTSpec, prefix: str, layout: Layout) -> dict[str, TensorLeaf]:
    out = {f"{prefix}/weight": TensorLeaf((spec.hidden,), spec.dtype, layout)}
    if spec.layernorm:
        out[f"{prefix}/bias"] = TensorLeaf((spec.hidden,), spec.dtype, layout)
    return out


def _layer(spec: GPTSpec, i: int) -> dict[str, TensorLeaf]:
    dt, h, d = spec.dtype, spec.hidden, spec.head_dim
    stage = Stage.of_layer(i)
    rep = Layout(stage)
    per_group = spec.heads // spec.query_groups + 2
    qkv_rows = spec.query_groups * per_group * d
    column_qkv = Layout(stage, Split(0, granularity=per_group * d, unit="num_query_groups"))
    row_proj = Layout(stage, Split(1, granularity=d, unit="num_attention_heads"))
    p = f"model/layers/{i}"
    out = _norm(spec, f"{p}/input_norm", rep)
    out[f"{p}/attention/qkv/weight"] = TensorLeaf((qkv_rows, h), dt, column_qkv)
    if spec.bias:
        out[f"{p}/attention/qkv/bias"] = TensorLeaf(
            (qkv_rows,), dt, Layout(stage, Split(0, granularity=per_group * d, unit="num_query_groups")))
    out[f"{p}/attention/proj/weight"] = TensorLeaf((h, spec.heads * d), dt, row_proj)
    if spec.bias:
        out[f"{p}/attention/proj/bias"] = TensorLeaf((h,), dt, rep)
    out.update(_norm(spec, f"{p}/post_attention_norm", rep))
    return out


def _mlp(spec: GPTSpec, i: int) -> dict[str, TensorLeaf]:
    return dense_mlp(spec, f"model/layers/{i}/mlp", Stage.of_layer(i), spec.ffn)

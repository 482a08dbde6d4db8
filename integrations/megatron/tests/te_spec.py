"""TransformerEngine's layer structure for the worker's ``--names te`` models, on CPU.

TE does not run on CPU. Megatron-LM's TE spec (megatron-core ``get_gpt_layer_with_transformer_engine_spec``)
fuses each layer's norms into the next linear (``TELayerNormColumnParallelLinear``; ``input_layernorm``
and, in a dense layer, ``pre_mlp_layernorm`` are ``IdentityOp``). A checkpoint shows this twice: in the
norms' names (``self_attention.linear_qkv.layer_norm_weight``) and in where the norm's parameter sits in
``named_parameters()``, hence in the distributed optimizer's flat buffers and a non-distributed
optimizer's param groups.

:func:`te_layer_spec` turns megatron-core's local spec into that structure: ``linear_qkv`` (and a dense
layer's ``linear_fc1``) become :class:`NormColumnParallelLinear`, megatron-core's own
``ColumnParallelLinear`` with the norm in front. Its parameters are registered in TE's order (TE
``LayerNormLinear.__init__``: ``layer_norm_weight``, ``layer_norm_bias`` for LayerNorm, then ``weight``,
``bias``), and the norm is computed as the local spec computes it (``torch.nn.RMSNorm`` /
``LayerNorm``), so the model's outputs equal the local-spec model's from the same seed (norms draw no
random numbers). An MoE layer keeps a separate ``pre_mlp_layernorm`` (the TE spec builds
``backend.layer_norm()`` when ``num_experts``). Grouped-GEMM experts (``--grouped-gemm``) are
megatron-core's ``TEGroupedMLP`` (what the TE spec builds for them), with :func:`grouped_linear` in
place of TE's ``GroupedLinear``: one parameter per local expert, ``weight0``, ``weight1``, ...
registered in TE's order (TE ``GroupedLinear.__init__``), each expert's tokens multiplied by its
own weight. Everything else (the layer, attention, DDP, the optimizers, every save and load) is
megatron-core's. (:func:`grouped_linear` has no ``sharded_state_dict``: such models save legacy
files only.)
"""

from __future__ import annotations

import dataclasses
import functools


@functools.cache
def norm_column_parallel_linear():
    """The class (built on first use: megatron-core imports are the worker's)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class NormColumnParallelLinear(ColumnParallelLinear):
        """A norm, then megatron-core's ``ColumnParallelLinear``; parameters in TE's order."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            linear = dict(self._parameters)  # weight, bias: registered after the norm's, as TE does
            self._parameters.clear()
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.layer_norm_bias = None
            if config.normalization == "LayerNorm":
                self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
            for p in (self.layer_norm_weight, self.layer_norm_bias):
                if p is not None:  # its gradient is reduced over tp when the input is sequence-parallel
                    setattr(p, "sequence_parallel", config.sequence_parallel)
            self._parameters.update(linear)
            self.norm_eps, self.normalization = config.layernorm_epsilon, config.normalization

        def forward(self, x, *args, **kwargs):
            shape = (x.shape[-1],)
            if self.normalization == "RMSNorm":
                x = F.rms_norm(x, shape, self.layer_norm_weight, self.norm_eps)
            else:
                x = F.layer_norm(x, shape, self.layer_norm_weight, self.layer_norm_bias, self.norm_eps)
            return super().forward(x, *args, **kwargs)

    return NormColumnParallelLinear


@functools.cache
def grouped_linear(parallel_mode: str):
    """A CPU stand-in for megatron-core's ``TEColumnParallelGroupedLinear`` (``parallel_mode="column"``)
    or ``TERowParallelGroupedLinear`` (``"row"``), built on first use.

    Like megatron-core's ``TEGroupedLinear`` with expert parallelism or expert tp (explicit expert
    communication: the token dispatcher moves the tokens, the linear none), the local weights are
    ``[out / etp, in]`` (column) or ``[out, in / etp]`` (row), each marked tensor-parallel along that
    axis (TE ``GroupedLinear.reset_parameters``: the gradient norm counts every etp shard), and
    each parameter's ``allreduce`` is False when ep > 1 (DDP puts it in the expert buffer).
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    class GroupedLinear(torch.nn.Module):
        def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, pg_collection=None):
            super().__init__()
            assert is_expert and not bias, "the stand-in covers bias-free expert linears"
            etp = pg_collection.expt_tp.size() if pg_collection is not None else 1
            if parallel_mode == "column":
                output_size //= etp
            else:
                input_size //= etp
            self.num_gemms = num_gemms
            for i in range(num_gemms):  # TE registers weight{i} (then bias{i}) for each GEMM in turn
                weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
                init_method(weight)
                self.register_parameter(f"weight{i}", weight)
            for param in self.parameters():  # TE reset_parameters: every weight{i} is tensor-parallel
                set_tensor_model_parallel_attributes(param, True, 1 if parallel_mode == "row" else 0, 1)
                setattr(param, "allreduce", not (is_expert and config.expert_model_parallel_size > 1))

        def forward(self, x, m_splits):
            pieces = torch.split(x, list(m_splits))
            return torch.cat([F.linear(piece, getattr(self, f"weight{i}")) for i, piece in enumerate(pieces)]), None

        def get_extra_state(self):  # TE has one (empty without FP8; te_names.py adds it on save)
            return None

        def set_extra_state(self, state):
            assert state is None, state

    return GroupedLinear


def te_layer_spec(spec):
    """``spec`` (a layer ``ModuleSpec`` or a ``TransformerBlockSubmodules``) with TE's layer structure."""
    layers = getattr(spec, "layer_specs", None)
    if layers is not None:
        return dataclasses.replace(spec, layer_specs=[_layer(s) for s in layers])
    return _layer(spec)


def _layer(spec):
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    fused = norm_column_parallel_linear()
    sub = spec.submodules
    attention = dataclasses.replace(sub.self_attention, submodules=dataclasses.replace(
        sub.self_attention.submodules, linear_qkv=fused))
    # TE names need no renaming: the keys map of the local spec is dropped
    changes = dict(input_layernorm=IdentityOp, self_attention=attention, sharded_state_dict_keys_map={})
    if not issubclass(_mlp_class(sub.mlp), MoELayer):
        changes.update(pre_mlp_layernorm=IdentityOp, mlp=_with_fc1(sub.mlp, fused))
    elif _grouped(sub.mlp):
        changes.update(mlp=_te_grouped_experts(sub.mlp))
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, **changes))


def _mlp_class(mlp) -> type:
    """The MLP's class: a ``ModuleSpec``'s module (0.16), or the class of a
    ``functools.partial(MLP.as_mlp_submodule, submodules=...)`` (0.19)."""
    if isinstance(mlp, functools.partial):
        return mlp.func.__self__
    return mlp.module


def _with_fc1(mlp, fc1):
    """The MLP spec with ``linear_fc1`` replaced, in either form of :func:`_mlp_class`."""
    if isinstance(mlp, functools.partial):
        kw = dict(mlp.keywords, submodules=dataclasses.replace(mlp.keywords["submodules"], linear_fc1=fc1))
        return functools.partial(mlp.func, *mlp.args, **kw)
    return dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc1=fc1))


def _grouped(moe) -> bool:
    """Whether an MoE layer's spec has the legacy ``GroupedMLP`` (the local spec's grouped GEMM)."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    return getattr(moe, "submodules", None) is not None and moe.submodules.experts.module is GroupedMLP


def _te_grouped_experts(moe):
    """The MoE spec with TE's grouped experts: ``TEGroupedMLP`` over :func:`grouped_linear`."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    experts = ModuleSpec(module=TEGroupedMLP, submodules=MLPSubmodules(
        linear_fc1=grouped_linear("column"), linear_fc2=grouped_linear("row")))
    return dataclasses.replace(moe, submodules=dataclasses.replace(moe.submodules, experts=experts))

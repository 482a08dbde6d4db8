"""A Megatron checkpoint's fp32 main params agree with its model weights: checked when it is opened.

Megatron's optimizers copy the fp32 main params into the model's parameters after every step, as a
cast (megatron-core ``DistributedOptimizer._copy_main_params_to_model_params`` and
``Float16OptimizerWithFloat16Params._copy_main_params_to_model_params``; with fp32 params the
main param is the parameter), and Megatron-LM syncs the parameters before it saves. So in a
checkpoint ``main.to(param dtype) == param``, element for element.

Optimizer state kept by position (the distributed optimizer's flat buffers, a non-distributed
Adam's param groups) is placed by the parameter order that tenplex derives from the model config
(:func:`~tenplex_megatron.model.layouts.param_order`). If the checkpoint's model was built another
way than the config says (another layer spec, a module tenplex does not model), each state lands on
another parameter's offsets, and a reshard would move it there without a word: that happened to
TransformerEngine checkpoints read in the local spec's order. This check reads the first
:data:`SAMPLE` elements of every parameter and of its main param, where the parameter is stored
first (so every pipeline stage's buffer is sampled), and refuses the checkpoint where they differ.
"""

from __future__ import annotations

import numpy as np
import torch

from tenplex.errors import ManifestError
from tenplex.ptree.tree import torch_dtype

__all__ = ["SAMPLE", "check_main_params"]

SAMPLE = 16
"""Elements compared per parameter (the first ones of its first stored local tensor)."""

MAIN = "optimizer/param/"


def check_main_params(source) -> int:
    """Compare each parameter's first :data:`SAMPLE` elements with its main param's.

    Args:
        source: an opened Megatron source (a :class:`~tenplex_megatron.formats.source.MegatronSource`);
            one without optimizer state passes at once.

    Returns:
        The parameters compared.

    Raises:
        ManifestError: naming the parameter, the rank, and both values, where the main param cast
            to the parameter's dtype differs from the parameter (NaN equals NaN).
    """
    tree, compared = source.tree, 0
    for main in (p for p in tree.leaves if p.startswith(MAIN)):
        path = "model/" + main.removeprefix(MAIN)
        classes = source.sharding.classes(path) if path in tree.leaves else ()
        if not classes:
            continue
        rank = classes[0].ranks[0]
        held = source.sharding.holding(path, source.config.coord(rank))
        n = min(SAMPLE, held.numel if held is not None else 0)
        if not n:
            continue
        weights = _first(source, path, rank, n)
        mains = _first(source, main, rank, n).to(weights.dtype)
        same = (weights == mains) | (weights.isnan() & mains.isnan())
        if not bool(same.all()):
            at = int((~same).nonzero()[0])
            raise ManifestError(
                f"{source.where}: the fp32 main param of {path} (optimizer state) differs from the "
                f"weight at rank {rank}, element {at}: {mains[at].item()!r} against {weights[at].item()!r}. "
                "Megatron copies main params into the weights after each step, so the optimizer state "
                f"is not where the parameter order of transformer_impl={_impl(source)} puts it: the "
                "checkpoint's model was built another way than its args (or --model-config) say")
        compared += 1
    return compared


def _first(source, path: str, rank: int, n: int) -> torch.Tensor:
    """The first ``n`` elements (flat order) of ``path``'s local tensor at ``rank``."""
    itemsize = torch_dtype(source.tree[path].dtype).itemsize
    record = source.locate(path, source.config.coord(rank))  # ``rank`` is its class's first: no lookup table
    local = source.read(record, np.array([0], np.int64), np.array([n * itemsize], np.int64))
    return local.reshape(-1)[:n]


def _impl(source) -> str:
    return str(source.meta.get("megatron", {}).get("config", {}).get("transformer_impl", "local"))

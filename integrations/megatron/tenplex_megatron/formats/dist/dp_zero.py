"""megatron-core's ``dp_zero_gather_scatter`` optimizer state in ``torch_dist`` (megatron-core <= 0.13).

Megatron-LM before core 0.14 saved the distributed optimizer this way with
``--no-ckpt-fully-parallel-save`` (``fully_sharded_model_space`` otherwise:
:mod:`~tenplex_megatron.formats.dist.model_space`):
``DistributedOptimizer.sharded_param_state_dp_zero`` gathers each (tp, pp)
rank's flat buffers on its first data-parallel rank and saves them as one
byte object, ``optimizer.distributed.dp_group_idx_<m>.param_state/shard_0_1``
with ``m = t + tp * p``: a ``torch.save`` of ``[state]``, where ``state`` is
what Megatron-LM's legacy ``distrib_optim.pt`` holds
(``{"buckets_coalesced": True, chunk: {(param_dtype, grad_dtype): {"param",
"exp_avg", "exp_avg_sq", "numel_unpadded"}}}``). tenplex reads its pickle
through the restricted unpickler, tensors as byte ranges inside the
``.distcp`` file (:func:`~tenplex_megatron.torchfiles.ptfile.load_refs` on
the item's window), and places each parameter's state as it does a
``distrib_optim.pt``'s (:func:`~tenplex_megatron.model.flatbuf.distrib_optim_refs`).
Checked against megatron-core 0.13.1's own save (``tests/formats/test_megatron_core_013.py``).
"""

from __future__ import annotations

from tenplex.errors import ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding

from tenplex_megatron.dcp.checks import item_file
from tenplex_megatron.dcp.records import MetadataIndex
from tenplex_megatron.formats.dist.buffers import chained
from tenplex_megatron.formats.dist.keys import object_key
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.flatbuf import distrib_optim_refs
from tenplex_megatron.torchfiles.ptfile import load_refs

__all__ = ["DP_ZERO", "zero_refs"]

DP_ZERO = "dp_zero_gather_scatter"
"""The ``param_state_sharding_type`` of this layout."""


def zero_refs(cfg: MegatronConfig, config: ParallelConfig, sharding: Sharding, root: str, md
              ) -> tuple[dict, tuple[str, str], int]:
    """Where each optimizer leaf's state lies: ``({(leaf path, t, p): TensorRef}, (param_dtype,
    grad_dtype), bytes read)``.

    Raises:
        ManifestError: experts at ep > 1 (two chained optimizers: not read), a missing object, or a
            pickle or structure :func:`~tenplex_megatron.model.flatbuf.distrib_optim_refs` refuses.
    """
    if chained(cfg, config):
        raise ManifestError(f"{root}: {DP_ZERO} optimizer state of experts at ep={config.ep} (two chained "
                            "optimizers) is not supported; save it again with --ckpt-fully-parallel-save")
    out, dtypes, n = {}, None, 0
    for m in range(config.tp * config.pp):
        key = object_key(m, "param_state")
        info = md.storage_data.get(MetadataIndex(key))
        if info is None:
            raise ManifestError(f"{root}: {key} is missing; tenplex never invents optimizer state")
        path, _ = item_file(root, info.relative_path)
        where = f"{path} [{key}]"
        obj, read = load_refs(path, info.offset, info.length, what=where)
        n += read
        if not isinstance(obj, list) or len(obj) != 1:
            raise ManifestError(f"{where}: holds {type(obj).__name__}; expected [optimizer state]")
        refs, dtypes = distrib_optim_refs(cfg, config, sharding, m % config.tp, m // config.tp, 0, obj[0], where)
        out.update(refs)
    return out, dtypes, n

"""megatron-core ``torch_dist`` directories, described from DCP's metadata and read by byte ranges.

A directory holds PyTorch DCP files (``.metadata``, ``__R_I.distcp``),
``common.pt`` (the non-sharded part: iteration, scheduler, optimizer param
groups, args) and ``metadata.json``. :func:`describe_dist` reads only
``.metadata`` (through :mod:`tenplex_megatron.dcp.safe`'s allow-listed
unpickler), each tensor item's header and ``common.pt``, and checks every key against the model config
(:mod:`tenplex_megatron.formats.dist.keys`): an unknown key, a missing one, or a
shape or dtype other than the model's is an error. :class:`DistSource`
reads a rank's local tensor from the DCP chunks that overlap it: each chunk
is a ``torch.save`` blob at a recorded byte range of a ``.distcp`` file,
whose tensor bytes were located when its header was checked
(:func:`tenplex_megatron.torchfiles.ptfile.tensor_ref`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from tenplex.errors import ConfigError, ManifestError
from tenplex.limits import short
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Piece, Sharding
from tenplex.ptree.tree import torch_dtype
from tenplex.store.paths import check_inside

from tenplex_megatron.model.config import MegatronConfig, args_to_json
from tenplex_megatron.model.vocab import check_vocab
from tenplex_megatron.formats.dist.buffers import chained, expected_flat
from tenplex_megatron.formats.dist.dp_zero import DP_ZERO, zero_refs
from tenplex_megatron.formats.dist.model_space import MODEL_SPACE, check_steps
from tenplex_megatron.formats.dist.keys import (COMMON_STATE, DP_OBJECTS, FLAT_KEY, OBJECT_KEY, RNG_KEY, classify,
                                       dist_names,
                                       expected_tensors, is_dist, known_extra_state, object_key)
from tenplex_megatron.dcp.records import BytesStorageMetadata, TensorStorageMetadata
from tenplex_megatron.dcp.safe import read_checked, read_objects
from tenplex_megatron.formats.description import Description
from tenplex_megatron.formats.folders import locate
from tenplex_megatron.model.flatbuf import FLAT_DTYPE, buffer_layout
from tenplex_megatron.torchfiles.jsonable import to_jsonable
from tenplex_megatron.model.layouts import megatron_tree
from tenplex_megatron.model.limits import SCALARS, check_args, check_scalars
from tenplex_megatron.model.parallel import parallel_config
from tenplex_megatron.torchfiles.safe_load import safe_load

__all__ = ["is_dist", "describe_dist", "DcpRecord", "read_common", "rng_coords", "FoundDist"]

_COMMON_KNOWN = {"content_metadata", "iteration", "opt_param_scheduler", "optimizer", "args",
                 "checkpoint_version", "num_floating_point_operations_so_far"}


def read_common(root: str, md: Any = None) -> dict:
    """The common (non-sharded) state: ``common.pt``, or megatron-core 0.19's ``common_state`` item, or ``{}``.

    megatron-core up to 0.18 saves it as ``common.pt`` (``common_backend: torch`` in
    ``metadata.json``); 0.19 saves it as a DCP byte object, :data:`COMMON_STATE`, a ``torch.save``
    archive of ``[common dict]`` inside a ``.distcp`` file (``metadata.json`` without
    ``common_backend``), and still reads a ``common.pt`` where one exists. Which one is there is
    told from the files, not from ``metadata.json``. Both are unpickled with the same allow-list
    (:func:`tenplex_megatron.torchfiles.safe_load.safe_load`).

    Raises:
        ManifestError: it is not a dict (or a one-item list of one), or an unsafe pickle.
    """
    path = os.path.join(root, "common.pt")
    check_inside(root, [path, os.path.join(root, ".metadata"), os.path.join(root, "metadata.json")])  # issue 20
    if os.path.exists(path):
        common = safe_load(path)
        where = path
    else:
        md = md if md is not None else read_checked(root)[0]
        if COMMON_STATE not in md.state_dict_metadata:
            return {}
        common = read_objects(root, md, COMMON_STATE).get(COMMON_STATE)
        where = f"{root} [{COMMON_STATE}]"
        if isinstance(common, list) and len(common) == 1:
            common = common[0]
    if not isinstance(common, dict):
        raise ManifestError(f"{where}: expected a dict, found {type(common).__name__}")
    return common


@dataclass(frozen=True)
class DcpRecord:
    """A rank's local tensor made of boxes of one DCP tensor.

    Attributes:
        key: the DCP key.
        prefix: leading coordinates in the DCP tensor (the layer of a stacked key).
        pieces: the boxes (global coordinates without ``prefix``) and their places locally.
        shape: the local tensor's shape.
        dtype: its dtype.
    """

    key: str
    prefix: tuple[int, ...]
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _chained(optimizer: dict, where: str) -> tuple[dict, list | None]:
    """``common.pt``'s optimizer entry and the expert optimizer's groups: at ep > 1 megatron-core
    saves ``{0: dense, 1: expert}`` (``ChainedOptimizer.sharded_state_dict``)."""
    if set(optimizer) != {0, 1}:
        return optimizer, None
    dense, expert = optimizer[0], optimizer[1]
    if not isinstance(dense, dict) or not isinstance(expert, dict):
        raise ManifestError(f"{where}/common.pt: chained optimizer entries are not dicts")
    inner = expert.get("optimizer") if isinstance(expert.get("optimizer"), dict) else expert
    return dense, inner.get("param_groups", [])


def _optim_type(common: dict, keys, where: str = "") -> str | None:
    """``"fully_reshardable"``/``"dp_reshardable"``/``"fully_sharded_model_space"``/
    ``"dp_zero_gather_scatter"`` (distributed optimizer; the last two megatron-core <= 0.13's:
    :mod:`~tenplex_megatron.formats.dist.model_space`, :mod:`~tenplex_megatron.formats.dist.dp_zero`),
    ``"adam"`` (a
    non-distributed one: ``{"state": {"common_step"}, "param_groups"}``, megatron-core
    ``FP32Optimizer.sharded_state_dict``; over bf16/fp16 params the same under ``"optimizer"``,
    ``Float16OptimizerWithFloat16Params.sharded_state_dict``, whose ``fp32_from_fp16_params``
    are DCP tensors, :func:`~tenplex_megatron.formats.dist.keys.optimizer_prefix`) or None."""
    optimizer = common.get("optimizer") or {}
    inner = optimizer.get("optimizer")
    if inner is not None and not isinstance(inner, dict):
        raise ManifestError(f"{where}/common.pt: optimizer.optimizer is {type(inner).__name__}; expected a dict")
    if "state" in optimizer or "param_groups" in optimizer or "fp32_from_fp16_params" in optimizer or (
            isinstance(inner, dict) and "state" in inner):
        return "adam"
    kind = optimizer.get("param_state_sharding_type") \
        or (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if kind is None and any(k.startswith("optimizer.state.") for k in keys):
        kind = "fully_reshardable"
    if kind is None and any(FLAT_KEY.match(k) for k in keys):
        kind = "dp_reshardable"
    if kind not in (None, "fully_reshardable", "dp_reshardable", MODEL_SPACE, DP_ZERO):
        raise ManifestError(f"{where}: distributed optimizer state of sharding type {short(kind)} is not "
                            f"supported (tenplex reads fully_reshardable, dp_reshardable, {MODEL_SPACE} and "
                            f"{DP_ZERO}): save it again with --ckpt-fully-parallel-save")
    return kind


def _grid(cfg, args, md, optim, where) -> tuple[int, int]:
    """The saver's (tp, pp): from args, else the RNG objects' grid, else buffers or vocab rows."""
    tp = getattr(args, "tensor_model_parallel_size", None)
    pp = getattr(args, "pipeline_model_parallel_size", None)
    if tp and pp:
        return tp, pp
    grids = {(int(m.group(4)), int(m.group(3))) for k in md.state_dict_metadata
             if (m := RNG_KEY.match(k))}
    if len(grids) == 1:
        return grids.pop()
    if optim == "dp_reshardable":
        return _buffer_grid(cfg, md, where)
    rows = md.state_dict_metadata["embedding.word_embeddings.weight"].size[0] \
        if "embedding.word_embeddings.weight" in md.state_dict_metadata else None
    tree = megatron_tree(cfg)
    for t in (1, 2, 4, 8, 16, 32, 64):
        if cfg.num_query_groups % t:  # a guess: only tps that hold whole query groups (the rows
            continue  # past vocab_size would be dropped on a wrong guess)
        if rows is None or cfg.padded_vocab(t) == rows:
            try:
                tree.validate(ParallelConfig(tp=t))
            except ConfigError:
                continue
            return t, 1
    raise ConfigError(f"{where}: the checkpoint stores {rows} vocabulary rows, but vocab_size="
                      f"{cfg.vocab_size} (make_vocab_size_divisible_by={cfg.make_vocab_size_divisible_by}) "
                      "pads to that at no tp this model allows; tenplex neither truncates nor invents "
                      "vocabulary rows: give the tokenizer's vocabulary size with --model-config")


def _buffer_grid(cfg, md, where) -> tuple[int, int]:
    sizes = {(int(m.group(1)), int(m.group(5))): v.size[0] for k, v in md.state_dict_metadata.items()
             if (m := FLAT_KEY.match(k)) and m.group(6) == "param" and not k.startswith("chained_1.")}
    groups = 1 + max((g for g, _ in sizes), default=0)
    matches = []
    for tp in (t for t in range(1, groups + 1) if groups % t == 0):
        config = ParallelConfig(1, tp, groups // tp)
        try:
            megatron_tree(cfg).validate(config)
        except ConfigError:
            continue
        want = {(t + tp * p, b): n for p in range(config.pp)
                for b, (_, n, _) in enumerate(buffer_layout(cfg, config, p, 1)) for t in range(tp)}
        if want == sizes:
            matches.append((tp, groups // tp))
    if len(matches) != 1:
        raise ConfigError(f"{where}: cannot tell the saver's tp and pp from {groups} optimizer buffer "
                          f"groups ({len(matches)} candidates); the checkpoint has no args")
    return matches[0]


def _check_keys(cfg, sharding, md, optim, dtypes, where, names: str = "local",
                chained_prefix: bool = False) -> tuple[str, str] | None:
    """Every DCP key is known and holds what the model config says; returns the buffer dtypes."""
    expected = expected_tensors(cfg, sharding, optim, names, chained_prefix)
    config = sharding.config
    found_flat: set = set()
    for key, item in md.state_dict_metadata.items():
        kind = classify(key)
        if isinstance(item, TensorStorageMetadata) and key in expected:
            shape, dtype, _, _ = expected[key]
            if tuple(item.size) != shape or item.properties.dtype != torch_dtype(dtype):
                raise ManifestError(f"{where}: {key} is stored as {list(item.size)} "
                                    f"{item.properties.dtype}; the model config gives {list(shape)} "
                                    f"torch.{dtype} (tenplex never casts or reshapes on read)")
        elif isinstance(item, TensorStorageMetadata) and kind == "flat" and optim == "dp_reshardable":
            dtypes = dtypes or FLAT_KEY.match(key).group(3, 4)
            numel = expected_flat(cfg, config, dtypes).get(key)
            if numel is None or tuple(item.size) != (numel,) or item.properties.dtype != FLAT_DTYPE:
                raise ManifestError(f"{where}: optimizer buffer {key} ({list(item.size)} "
                                    f"{item.properties.dtype}) does not fit the model's buffer layout at "
                                    f"{config} (megatron-core's distributed optimizers)")
            found_flat.add(key)
        elif isinstance(item, BytesStorageMetadata) and key == COMMON_STATE:
            continue  # megatron-core 0.19's common state (read_common)
        elif isinstance(item, BytesStorageMetadata) and kind in ("extra_state", "rng", "dp_object"):
            _check_object(key, kind, cfg, config, where, optim)
        else:
            raise ManifestError(f"{where}: unknown key {key}; tenplex keeps every tensor of a checkpoint, "
                                "and this one is not part of the model config")
    missing = sorted(set(expected) - set(md.state_dict_metadata))
    if optim == "dp_reshardable":
        dtypes = dtypes or ("torch.float32", "torch.float32")
        missing += sorted(set(expected_flat(cfg, config, dtypes)) - found_flat)
    if missing:
        raise ManifestError(f"{where}: tensor {missing[0]} is missing"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                            + "; tenplex never invents model or optimizer state")
    return dtypes


def _check_object(key, kind, cfg, config, where, optim=None) -> None:
    ok = True
    if kind == "extra_state":
        ok = known_extra_state(cfg, key)
    elif kind == "rng":
        p, t, d, pp, tp, dp = (None if g is None else int(g) for g in RNG_KEY.match(key).groups())
        ok = (pp, tp) == (config.pp, config.tp) and p < pp and t < tp and (d is None) == (dp is None) \
            and (d is None or (dp == config.dp * config.cp and d < dp))
    elif kind == "dp_object":
        m, name = OBJECT_KEY.match(key).groups()
        ok = int(m) < config.world_size and (name in DP_OBJECTS or (name == "param_state" and optim == DP_ZERO))
    if not ok:
        raise ManifestError(f"{where}: object {key} does not fit the model (num_layers="
                            f"{cfg.num_layers}, tp={config.tp}, pp={config.pp}, dp*cp={config.dp * config.cp})")


def _check_rng_ranks(md, config, where: str) -> None:
    """A coordinate's RNG states on the (pp, tp, dp) grid (:func:`~tenplex_megatron.formats.dist.keys.rng_objects`)
    are there for every dp-cp rank, or the coordinate is refused (the ranks without one could not load).

    Raises:
        ManifestError: naming the coordinate and the dp-cp ranks it lacks.
    """
    for coord, keys in rng_coords(md).items():
        ranks = [int(d) for d in (RNG_KEY.match(k).group(3) for k in keys) if d is not None]
        missing = sorted(set(range(config.dp * config.cp)) - set(ranks))
        if ranks and missing:
            raise ManifestError(f"{where}: RNG state of {coord} is stored per dp-cp rank (rng_state/shard_"
                                f"<pp>.<tp>.<dp>_...) but not for dp-cp ranks {missing[:8]}")


def _adam_body(optimizer: dict, params_dtype: str, root: str) -> dict:
    """The ``{"state", "param_groups"}`` of a non-distributed optimizer's ``common.pt`` entry: the entry
    itself over fp32 params (megatron-core ``FP32Optimizer``), its ``"optimizer"`` over bf16/fp16
    params (``Float16OptimizerWithFloat16Params``, beside ``fp32_from_fp16_params``, whose tensors
    are DCP items and leave at most empty lists here).

    Raises:
        ManifestError: the entry has the other optimizer's form or no groups, or
            ``fp32_from_fp16_params`` holds anything but (nested) empty lists.
    """
    fp32 = params_dtype == "float32"
    flat = "state" in optimizer or "param_groups" in optimizer
    if flat != fp32:
        raise ManifestError(f"{root}/common.pt: a non-distributed optimizer over {params_dtype} params is "
                            + ("FP32Optimizer's {state, param_groups}" if fp32 else
                               "Float16OptimizerWithFloat16Params' {optimizer: {state, param_groups}}")
                            + f" in megatron-core; found the entries {sorted(map(str, optimizer))}")
    left = optimizer.get("fp32_from_fp16_params", [])
    while isinstance(left, (list, tuple)) and left and all(isinstance(g, (list, tuple)) for g in left):
        left = [x for g in left for x in g]
    if left != [] and left != ():
        found = type(left[0] if isinstance(left, (list, tuple)) else left).__name__
        raise ManifestError(f"{root}/common.pt: fp32_from_fp16_params holds {found} values; "
                            "expected its tensors as DCP items (optimizer.state.fp32_param.*)")
    body = optimizer if fp32 else optimizer.get("optimizer") or {}
    if "state" not in body and "param_groups" not in body:
        raise ManifestError(f"{root}/common.pt: the optimizer entry has no state or param_groups "
                            f"(found the entries {sorted(map(str, optimizer))})")
    return body


def _common_step(optimizer: dict, root: str) -> float | None:
    """A non-distributed optimizer's shared Adam step (``state.common_step``; absent before the first step)."""
    state = optimizer.get("state") or {}
    if not isinstance(state, dict) or set(state) - {"common_step"}:
        found = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ManifestError(f"{root}/common.pt: optimizer state holds {found}; expected only common_step "
                            "(megatron-core keeps per-parameter state in the sharded tensors)")
    step = state.get("common_step")
    if step is None:
        return None
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if not isinstance(step, (int, float)) or isinstance(step, bool):
        raise ManifestError(f"{root}/common.pt: optimizer common_step is {type(step).__name__}; expected a number")
    return float(step)


def _dp_groups(cfg, config, root, md) -> tuple[list, list | None]:
    """The dense and expert param groups of a ``dp_reshardable`` checkpoint: in each sub-optimizer's
    ``optimizer`` object of ``dp_group_idx`` 0 (the prefixes are :mod:`tenplex_megatron.formats.dist.buffers`')."""
    out = []
    for prefix in ("chained_0.", "chained_1.") if chained(cfg, config) else ("",):
        key = prefix + object_key(0, "optimizer")
        obj = read_objects(root, md, key).get(key) if key in md.state_dict_metadata else None
        first = obj[0] if isinstance(obj, list) and obj else {}
        out.append(first.get("param_groups", []) if isinstance(first, dict) else [])
    return out[0], (out[1] if len(out) > 1 else None)


def rng_coords(md) -> dict[str, list[str]]:
    """``{"tp=T,pp=P": [DCP key, ...]}`` of the stored RNG states: the coordinate's keys on the
    (pp, tp, dp) grid by dp-cp rank where it has any (megatron-core 0.16's Megatron-LM at ep > 1;
    :func:`~tenplex_megatron.formats.dist.keys.rng_objects`), else its one (pp, tp) key."""
    plain, ranked = {}, {}
    for key in md.state_dict_metadata:
        m = RNG_KEY.match(key)
        if m:
            coord = f"tp={int(m.group(2))},pp={int(m.group(1))}"
            if m.group(3) is None:
                plain[coord] = [key]
            else:
                ranked.setdefault(coord, []).append((int(m.group(3)), key))
    return {**plain, **{c: [k for _, k in sorted(found)] for c, found in ranked.items()}}


class FoundDist(NamedTuple):
    """What :func:`describe_dist` found.

    Attributes:
        desc: the description.
        md: DCP's ``Metadata`` (read with the allow-listed unpickler).
        bytes_read: bytes read to describe it.
        refs: where each tensor item's data lies, ``{MetadataIndex: TensorRef}``.
        flat_refs: ``dp_zero_gather_scatter`` optimizer state, ``{(leaf path, t, p): TensorRef}``
            (:mod:`~tenplex_megatron.formats.dist.dp_zero`); None otherwise.
    """

    desc: Description
    md: Any
    bytes_read: int
    refs: dict
    flat_refs: dict | None = None


def describe_dist(path: str, model_config: dict | None = None, iteration: int | str | None = None
                  ) -> FoundDist:
    """Describe a ``torch_dist`` directory from ``.metadata`` and ``common.pt`` (no tensor is read).

    Args:
        path: a ``--save`` root, an iteration folder, or a bare ``dist_checkpointing`` folder
            (:func:`tenplex_megatron.formats.folders.locate`).
        model_config: model config fields, whole or overriding the args.
        iteration: the iteration to read under a root (default: the tracker's).

    Raises:
        ManifestError: not a ``torch_dist`` directory, an unsafe pickle, an
            unknown, missing or mis-shaped key, or ``singleton_local_shards`` in the
            content metadata (megatron-core's per-layer, per-expert layout).
        ConfigError: no model config can be found, or the stored vocabulary
            rows do not fit it.
    """
    found = locate(path, iteration)
    root = found.dir
    if not is_dist(root):
        raise ManifestError(f"{root}: no metadata.json with sharded_backend 'torch_dist'")
    md, refs = read_checked(root)
    common = read_common(root, md)
    if (common.get("content_metadata") or {}).get("singleton_local_shards") is True:
        raise ManifestError(f"{root}: saved with singleton_local_shards (every layer, expert and SwiGLU half "
                            "its own tensor; NeMo 2's default with megatron-core >= 0.14), which tenplex does "
                            "not read: load it in megatron-core and save it again with "
                            "singleton_local_shards=False (Megatron-LM's layout)")
    args = common.get("args")
    check_args(args, os.path.join(root, "common.pt") if os.path.exists(os.path.join(root, "common.pt"))
               else f"{root} [{COMMON_STATE}]")  # issue 20: bound every count before it sizes a loop
    if model_config is None and args is None:
        kind = "common.pt" if os.path.exists(os.path.join(root, "common.pt")) else \
            f"the {COMMON_STATE} item" if COMMON_STATE in md.state_dict_metadata else "no common state"
        bridge = os.path.lexists(os.path.join(root, "run_config.yaml"))  # Megatron-Bridge keeps its config there
        raise ConfigError(f"{root}: no args in {kind}; pass the model config "
                          "(--model-config FILE.json, see docs/megatron.md)"
                          + ("; its run_config.yaml (Megatron-Bridge's config, which tenplex does not read) "
                             "has the model section's values" if bridge else ""))
    cfg = MegatronConfig.from_args(args, model_config)
    names = dist_names(cfg, md.state_dict_metadata)
    cfg = cfg.with_impl(names)  # the layer spec: the order of dp_reshardable buffers
    optimizer, expert_groups = _chained(common.get("optimizer") or {}, root)
    optim = _optim_type({"optimizer": optimizer}, md.state_dict_metadata, root)
    tp, pp = _grid(cfg, args, md, optim, root)
    config = parallel_config(args, tp, pp)
    emb = md.state_dict_metadata.get("embedding.word_embeddings.weight")
    check_vocab(cfg, args, config.tp, emb.size[0] if emb is not None else None, root)
    tree = megatron_tree(cfg, optimizer=optim is not None)
    sharding = Sharding(tree, config)
    # megatron-core <= 0.13 chained its dense and expert optimizers' keys (chained_0., chained_1.)
    prefixed = optim == MODEL_SPACE and chained(cfg, config) and \
        any(k.startswith("chained_") for k in md.state_dict_metadata)
    dtypes = _check_keys(cfg, sharding, md, optim, None, root, names, prefixed)
    _check_rng_ranks(md, config, root)
    nbytes = sum(os.path.getsize(os.path.join(root, f)) for f in (".metadata", "common.pt")
                 if os.path.exists(os.path.join(root, f)))
    unknown = sorted(set(optimizer) - {"optimizer", "param_state_sharding_type", "grad_scaler"}
                     - ({"state", "param_groups", "fp32_from_fp16_params"} if optim == "adam" else set())
                     - ({"param_state"} if optim == MODEL_SPACE else set()))
    if unknown:
        raise ManifestError(f"{root}/common.pt: optimizer entries {unknown} are not supported")
    groups: Any = (optimizer.get("optimizer") or {}).get("param_groups", [])
    step = None
    if optim == "adam":
        body = _adam_body(optimizer, cfg.params_dtype, root)
        groups, step = body.get("param_groups") or [], _common_step(body, root)
    flat: dict = {}
    if optim in ("dp_reshardable", DP_ZERO):
        groups, expert_groups = _dp_groups(cfg, config, root, md)
    if optim == DP_ZERO:
        flat, dtypes, read = zero_refs(cfg, config, sharding, root, md)
        nbytes += read
    if optim == MODEL_SPACE:
        for sub, sub_groups in ((optimizer, groups), ((common.get("optimizer") or {}).get(1), expert_groups)):
            if isinstance(sub, dict):
                check_steps(sub.get("param_state"), sub_groups, f"{root}/common.pt")
    extra = {k: to_jsonable(v, f"common.pt {k}") for k, v in common.items() if k not in _COMMON_KNOWN}
    values = {
        "megatron/iteration": common.get("iteration", found.iteration if found.iteration is not None else 0),
        "megatron/checkpoint_version": common.get("checkpoint_version"),
        "megatron/args": args_to_json(args) if args is not None else None,
        "megatron/opt_param_scheduler": to_jsonable(common.get("opt_param_scheduler"), "opt_param_scheduler"),
        "megatron/optimizer": None if optim is None else
        {"param_groups": to_jsonable(groups, "optimizer param_groups"), "step": step,
         "grad_scaler": to_jsonable(optimizer.get("grad_scaler"), "grad_scaler"),
         **({"expert_param_groups": to_jsonable(expert_groups, "expert param_groups")} if expert_groups else {})},
        "megatron/num_floating_point_operations_so_far": common.get("num_floating_point_operations_so_far"),
        "megatron/rng_state": sorted(rng_coords(md)),
        "megatron/extra": extra or None,
    }
    check_scalars(values, SCALARS, os.path.join(root, "common.pt"))  # issue 20: no walk over a hostile value
    meta = {"megatron": {"format": "dist", "root": root, "config": cfg.to_json(), "optimizer": optim, "names": names,
                         **({"chained_prefix": True} if prefixed else {}),
                         "buffer_dtypes": list(dtypes) if dtypes else None,
                         "content_metadata": to_jsonable(common.get("content_metadata") or {})}}
    return FoundDist(Description(cfg, config, tree, values, meta, sharding=sharding), md, nbytes, refs, flat)

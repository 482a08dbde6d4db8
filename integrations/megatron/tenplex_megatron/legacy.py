"""Megatron-LM's per-rank checkpoint layout, described from its files' metadata and read by byte ranges.

``ROOT/latest_checkpointed_iteration.txt`` names the iteration;
``ROOT/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holds, for tp rank
``TT`` and pipeline rank ``PPP`` (suffix only when pp > 1), a dict with
``model``, ``optimizer``, ``opt_param_scheduler``, ``iteration``, ``args``,
``rng_state`` and ``checkpoint_version`` (Megatron-LM's
``megatron/training/checkpointing.py``); ``distrib_optim.pt`` beside it holds
the distributed optimizer's buffers gathered over dp. Layer indices in
``model`` are stage-local.

Files are opened with :func:`tenplex_megatron.ptfile.load_refs`: only their
pickles are read (Megatron's allow-list, no code runs); tensors become byte
ranges. :func:`describe_legacy` checks every key, shape and dtype against
the model config and refuses what it does not know; :class:`LegacySource`
reads a rank's tensors by byte ranges.

Adam state of a non-distributed optimizer is mapped to parameters **by
name**: torch numbers parameters in ``param_groups`` order, and Megatron
builds its groups from ``named_parameters()`` (weight decay; no decay for
biases and norms, ``wd_mult == 0``), so each index is matched to its
parameter's name, and a missing moment is an error.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from tenplex.errors import ConfigError, ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import torch_dtype

from tenplex_megatron.config import MegatronConfig, args_to_json, check_vocab, stage_layers
from tenplex_megatron.description import Description
from tenplex_megatron.flatbuf import distrib_optim_refs
from tenplex_megatron.jsonable import to_jsonable
from tenplex_megatron.layouts import megatron_tree, optimizer_path, param_order, rank_keys  # rank_keys: re-exported
from tenplex_megatron.ptfile import TensorRef, load_refs
from tenplex_megatron.safe_load import open_regular
from tenplex_megatron.source import MegatronSource
from tenplex_megatron.tied import check_tied

__all__ = ["TRACKER", "is_legacy", "describe_legacy", "open_legacy", "LegacySource", "rank_dir_name",
           "iteration_dir_name", "rank_keys"]

TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?$")
_KNOWN = {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
          "rng_state", "num_floating_point_operations_so_far"}


def is_legacy(root: str) -> bool:
    return os.path.isfile(os.path.join(root, TRACKER))


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """``mp_rank_TT`` (pp = 1) or ``mp_rank_TT_PPP``."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")


def iteration_dir_name(iteration) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def _iteration_dir(root: str) -> tuple[str, int | str]:
    path = os.path.join(root, TRACKER)
    if not os.path.lexists(path):
        raise ManifestError(f"{root}: no {TRACKER}; not a Megatron-LM checkpoint")
    f, _ = open_regular(path, path)
    with f:
        text = f.read(64).decode("utf-8", "replace").strip()
    if text == "release":
        return os.path.join(root, "release"), "release"
    if not text.isdigit() or len(text) > 12:
        raise ManifestError(f"{root}/{TRACKER}: expected an iteration number, found {text[:20]!r}")
    return os.path.join(root, iteration_dir_name(int(text))), int(text)


def _rank_dirs(iter_dir: str) -> dict[tuple[int, int], str]:
    if not os.path.isdir(iter_dir):
        raise ManifestError(f"{iter_dir}: the iteration directory named by {TRACKER} is missing")
    found = {}
    for name in sorted(os.listdir(iter_dir)):
        m = _RANK_DIR.match(name)
        if m:
            found[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(iter_dir, name)
    if not found:
        raise ManifestError(f"{iter_dir}: no mp_rank_* directories")
    return found


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _grid(args, dirs: dict, iter_dir: str) -> tuple[int, int]:
    """The grid the files should form: from args where they say it, else from the directories."""
    tp = getattr(args, "tensor_model_parallel_size", None) or max(t for t, _ in dirs) + 1
    pp = getattr(args, "pipeline_model_parallel_size", None) or max(p for _, p in dirs) + 1
    for t in range(tp):
        for p in range(pp):
            if (t, p) not in dirs:
                raise ManifestError(f"{iter_dir}: {rank_dir_name(t, p, pp)} is missing "
                                    f"(expected tp={tp} x pp={pp} rank directories)")
    extra = sorted(k for k in dirs if k[0] >= tp or k[1] >= pp)
    if extra:
        raise ConfigError(f"{iter_dir}: rank directories {[rank_dir_name(t, p, pp) for t, p in extra]} "
                          f"lie outside the args' grid tp={tp} x pp={pp}")
    return tp, pp


def _check_ref(ref: Any, shape, dtype, what: str) -> TensorRef:
    if not isinstance(ref, TensorRef):
        raise ManifestError(f"{what}: expected a tensor, found {type(ref).__name__}")
    if ref.shape != tuple(shape) or ref.dtype != dtype:
        raise ManifestError(f"{what}: stored as {list(ref.shape)} {ref.dtype}; the model config gives "
                            f"{list(shape)} {dtype} (tenplex never casts or reshapes on read)")
    return ref


def _model_refs(cfg, config, sharding, t, p, model: dict, where: str) -> dict:
    out, used = {}, set()
    for path, keys in rank_keys(cfg, config, p).items():
        key = next((k for k in keys if k in model), None)
        if key is None:
            raise ManifestError(f"{where}: key {keys[0]} (leaf {path}) is missing")
        leaf = sharding.tree[path]
        out[(path, t, p)] = _check_ref(model[key], sharding.tp_local(leaf, t)[0],
                                       torch_dtype(leaf.dtype), f"{where}: {key}")
        used.update(k for k in keys if k in model)
    for key, value in model.items():
        if key in used:
            continue
        if key.endswith("_extra_state"):
            if value is not None:
                raise ManifestError(f"{where}: {key} holds {type(value).__name__} state (e.g. FP8 "
                                    "metadata); tenplex carries only empty extra state")
            continue
        raise ManifestError(f"{where}: unexpected key {key}; tenplex keeps every tensor of a "
                            "checkpoint, and this one is not part of the model config")
    return out


def _optimizer_kind(first: dict, has_distrib: bool, iter_dir: str) -> str | None:
    optim = first.get("optimizer")
    if optim is None:
        return None
    if not isinstance(optim, dict):
        raise ManifestError(f"{iter_dir}: the optimizer entry is a {type(optim).__name__}, not a dict")
    if has_distrib:
        return "distrib_optim"
    inner = optim.get("optimizer", optim) if isinstance(optim.get("optimizer"), dict) else optim
    if "state" in inner:
        return "adam"
    raise ManifestError(f"{iter_dir}: the optimizer's parameter state is missing "
                        "(no Adam state and no distrib_optim.pt)")


def _adam_refs(cfg, config, sharding, t, p, optim: dict, model_refs: dict, where: str) -> dict:
    inner = optim["optimizer"] if "state" not in optim else optim
    main = optim.get("fp32_from_fp16_params")
    specs, state, out = param_order(cfg, config, p), inner.get("state", {}), {}
    for g, group in enumerate(inner.get("param_groups", [])):
        no_wd = float(group.get("wd_mult", 1.0)) == 0.0
        members = [s for s in specs if s.no_weight_decay == no_wd]
        if len(members) != len(group["params"]):
            raise ManifestError(f"{where}: optimizer group with wd_mult={group.get('wd_mult')} has "
                                f"{len(group['params'])} params; the model config gives {len(members)}")
        for j, (spec, idx) in enumerate(zip(members, group["params"])):
            shape = sharding.tp_local(spec.leaf, t)[0]
            st = state.get(idx, {})
            for name in ("exp_avg", "exp_avg_sq"):
                if name not in st:
                    raise ManifestError(f"{where}: Adam {name} of {spec.path} (optimizer index {idx}) is "
                                        "missing; tenplex never invents optimizer state")
                out[(optimizer_path(name, spec.path), t, p)] = _check_ref(
                    st[name], shape, torch_dtype("float32"), f"{where}: optimizer state {idx} {name}")
            if main is not None:
                ref = main[g][j] if g < len(main) and j < len(main[g]) else None
                ref = _check_ref(ref, shape, torch_dtype("float32"),
                                 f"{where}: fp32_from_fp16_params[{g}][{j}] ({spec.path})")
            else:
                ref = model_refs[(spec.path, t, p)]
                if ref.dtype != torch_dtype("float32"):
                    raise ManifestError(f"{where}: {spec.path} is {ref.dtype} and the optimizer keeps no "
                                        "fp32 main params (fp32_from_fp16_params)")
            out[(optimizer_path("param", spec.path), t, p)] = ref
    return out


def _steps(optim: dict) -> list[Any]:
    """The ``step`` entries (tensors as refs) of a non-distributed Adam state dict."""
    inner = optim if "state" in optim else optim["optimizer"]
    return [st["step"] for st in (inner.get("state") or {}).values() if "step" in st]


_OPTIMIZER_KEYS = {"state", "param_groups", "optimizer", "fp32_from_fp16_params", "grad_scaler"}


def _optimizer_meta(optim: dict, where: str) -> dict:
    """The optimizer's param groups (without ``params``) and grad scaler, as JSON; ``step`` later.

    Megatron's optimizers save ``{"state", "param_groups"}`` (``FP32Optimizer``),
    ``{"optimizer", "fp32_from_fp16_params", "grad_scaler"}`` (``Float16OptimizerWithFloat16Params``)
    or ``{"optimizer", "grad_scaler"}`` (``DistributedOptimizer``).

    Raises:
        ManifestError: for any other entry (tenplex would not carry it).
    """
    unknown = sorted(set(optim) - _OPTIMIZER_KEYS)
    if unknown:
        raise ManifestError(f"{where}: optimizer entries {unknown} are not supported")
    inner = optim["optimizer"] if isinstance(optim.get("optimizer"), dict) else optim
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.get("param_groups", [])]
    return {"param_groups": to_jsonable(groups, f"{where}: optimizer param_groups"), "step": None,
            "grad_scaler": to_jsonable(optim.get("grad_scaler"), f"{where}: grad_scaler")}


def _extra(files: dict, iter_dir: str) -> dict:
    """Top-level entries Megatron tenplex does not model, identical in every file (else an error)."""
    out: dict = {}
    for (t, p), state in files.items():
        for key in sorted(set(state) - _KNOWN):
            if key.startswith("model") and key[5:].isdigit():
                raise ManifestError(f"{iter_dir}: {key} (virtual pipeline chunks) is not supported")
            value = to_jsonable(state[key], f"{iter_dir}: top-level entry {key}")
            if key in out and out[key] != value:
                raise ManifestError(f"{iter_dir}: top-level entry {key} differs between rank files; "
                                    "tenplex carries only entries that are the same on every rank")
            out[key] = value
    if any(set(s) - _KNOWN != set(out) for s in files.values()):
        raise ManifestError(f"{iter_dir}: top-level entries {sorted(out)} are not in every rank file")
    return out


def _vocab_rows(cfg, config, first_stage: dict) -> int | None:
    """The padded vocabulary rows the files hold: tp x the first stage's embedding rows."""
    keys = rank_keys(cfg, config, 0).get("model/embedding/word_embeddings/weight", [])
    model = _flatten(dict(first_stage.get("model") or {}))
    ref = next((model[k] for k in keys if k in model), None)
    return ref.shape[0] * config.tp if isinstance(ref, TensorRef) and ref.shape else None


def _load(path: str) -> tuple[Any, int]:
    obj, n = load_refs(path)
    if not isinstance(obj, dict):
        raise ManifestError(f"{path}: expected a dict, found {type(obj).__name__}")
    return obj, n


class Found(NamedTuple):
    """What :func:`describe_legacy` found.

    Attributes:
        desc: the description.
        refs: ``{(leaf path, tp rank, pp rank): TensorRef}`` of every stored local tensor.
        rng_refs: ``{"tp=T,pp=P": rng_state}`` as stored (tensors as refs).
        steps: the Adam ``step`` entries of the first file (refs or numbers).
        bytes_read: bytes read to describe it.
    """

    desc: Description
    refs: dict
    rng_refs: dict
    steps: list
    bytes_read: int


def describe_legacy(root: str, model_config: dict | None = None, threads: int = 8) -> Found:
    """Describe a Megatron-LM per-rank checkpoint from its files' pickles (no tensor is read).

    Args:
        root: the checkpoint root (holding ``latest_checkpointed_iteration.txt``).
        model_config: model config fields, whole or overriding the files' ``args``.
        threads: files opened at once.

    Returns:
        A :class:`Found`.

    Raises:
        ManifestError: a missing tracker, iteration or ``mp_rank_*`` directory, a
            file that needs unsafe unpickling, a missing, unexpected or
            mis-shaped key, or a missing Adam moment.
        ConfigError: the args and the directory grid disagree.
    """
    iter_dir, iteration = _iteration_dir(root)
    dirs = _rank_dirs(iter_dir)
    model_files = {k: os.path.join(d, "model_optim_rng.pt") for k, d in dirs.items()}
    distrib = {k: os.path.join(d, "distrib_optim.pt") for k, d in dirs.items()
               if os.path.exists(os.path.join(d, "distrib_optim.pt"))}
    with ThreadPoolExecutor(max(1, threads)) as pool:
        loaded = dict(zip(model_files, pool.map(_load, model_files.values())))
        opt_loaded = dict(zip(distrib, pool.map(_load, distrib.values())))
    nbytes = sum(n for _, n in loaded.values()) + sum(n for _, n in opt_loaded.values())
    files = {k: v for k, (v, _) in loaded.items()}
    first = files[min(files)]
    args = first.get("args")
    tp, pp = _grid(args, dirs, iter_dir)
    cfg = MegatronConfig.from_args(args, model_config)
    config = ParallelConfig(1, tp, pp, stage_layers=stage_layers(args, cfg.num_layers, pp))
    check_vocab(cfg, args, tp, _vocab_rows(cfg, config, files[(0, 0)]), iter_dir)
    if distrib and len(distrib) != len(dirs):
        raise ManifestError(f"{iter_dir}: distrib_optim.pt is in {len(distrib)} of {len(dirs)} "
                            "rank directories")
    kind = _optimizer_kind(first, bool(distrib), iter_dir)
    tree = megatron_tree(cfg, optimizer=kind is not None)
    sharding = Sharding(tree, config)
    refs: dict = {}
    buffer_dtypes = None
    for (t, p), state in files.items():
        where = model_files[(t, p)]
        if not isinstance(state.get("model"), dict):
            raise ManifestError(f"{where}: no model state dict")
        model = _model_refs(cfg, config, sharding, t, p, _flatten(dict(state["model"])), where)
        refs.update(model)
        if kind == "adam":
            refs.update(_adam_refs(cfg, config, sharding, t, p, state["optimizer"], model, where))
        elif kind == "distrib_optim":
            found, dtypes = distrib_optim_refs(cfg, config, sharding, t, p, opt_loaded[(t, p)][0],
                                               distrib[(t, p)])
            if buffer_dtypes not in (None, list(dtypes)):
                raise ManifestError(f"{distrib[(t, p)]}: buffer dtypes {dtypes} differ from another "
                                    f"rank's {buffer_dtypes}")
            refs.update(found)
            buffer_dtypes = list(dtypes)
    rng_refs = {f"tp={t},pp={p}": s["rng_state"] for (t, p), s in files.items() if "rng_state" in s}
    values = {
        "megatron/iteration": iteration,
        "megatron/checkpoint_version": first.get("checkpoint_version"),
        "megatron/args": args_to_json(args) if args is not None else None,
        "megatron/opt_param_scheduler": to_jsonable(first.get("opt_param_scheduler"), "opt_param_scheduler"),
        "megatron/optimizer": None if kind is None else _optimizer_meta(first["optimizer"], iter_dir),
        "megatron/num_floating_point_operations_so_far": first.get("num_floating_point_operations_so_far"),
        "megatron/rng_state": sorted(rng_refs),
        "megatron/extra": _extra(files, iter_dir) or None,
    }
    meta = {"megatron": {"format": "legacy", "root": root, "config": cfg.to_json(), "optimizer": kind,
                         "buffer_dtypes": buffer_dtypes}}
    steps = _steps(first["optimizer"]) if kind == "adam" else []
    return Found(Description(cfg, config, tree, values, meta), refs, rng_refs, steps, nbytes)


class LegacySource(MegatronSource):
    """A Megatron-LM per-rank checkpoint as a ``ShardSource`` (see :func:`open_legacy`)."""

    def __init__(self, found: Found):
        super().__init__(found.desc)
        self.refs, self.rng_refs, self.steps = found.refs, found.rng_refs, found.steps
        self.count(found.bytes_read)

    def locate(self, path: str, coord) -> TensorRef:
        ref = self.refs.get((path, coord.tp, coord.pp))
        if ref is None:
            raise ManifestError(f"{self.where}: no stored tensor holds {path} at tp={coord.tp}, pp={coord.pp}")
        return ref

    def copies(self, path: str, t: int) -> dict[int, TensorRef]:
        """``{pp rank: ref}`` of every stored copy of ``path`` at tp rank ``t``."""
        return {p: r for (q, tt, p), r in self.refs.items() if q == path and tt == t}

    def read_value(self, path: str, key: str) -> Any:
        if path == "megatron/rng_state":
            state = self.rng_refs.get(key)
            return None if state is None else to_jsonable(self._resolve(state), f"rng_state {key}")
        if path == "megatron/optimizer" and self.desc.values.get(path) is not None:
            steps = {float(self._resolve(s)) for s in self.steps}
            return {**self.desc.values[path], "step": steps.pop() if len(steps) == 1 else None}
        return super().read_value(path, key)

    def _resolve(self, obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            tensor, n = obj.read()
            self.count(n)
            return tensor
        if isinstance(obj, dict):
            return {k: self._resolve(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._resolve(v) for v in obj)
        return obj


def open_legacy(root: str, model_config: dict | None = None, threads: int = 8) -> LegacySource:
    """A :class:`LegacySource` over the checkpoint at ``root``; tied embedding copies compared first.

    Raises:
        ManifestError, ConfigError: see :func:`describe_legacy`; also when the
            first and last stages' copies of a tied embedding differ.
    """
    source = LegacySource(describe_legacy(root, model_config, threads))
    check_tied(source)
    return source

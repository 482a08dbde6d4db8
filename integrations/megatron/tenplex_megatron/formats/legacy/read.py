"""Megatron-LM's per-rank checkpoint layout, described from its files' metadata and read by byte ranges.

``ROOT/latest_checkpointed_iteration.txt`` names the iteration;
``ROOT/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holds, for tp rank
``TT`` and pipeline rank ``PPP`` (suffix only when pp > 1), a dict with
``model``, ``optimizer``, ``opt_param_scheduler``, ``iteration``, ``args``,
``rng_state`` and ``checkpoint_version`` (Megatron-LM's
``megatron/training/checkpointing.py``); ``distrib_optim.pt`` beside it holds
the distributed optimizer's buffers gathered over dp. Layer indices in
``model`` are stage-local.

Files are opened with :func:`tenplex_megatron.torchfiles.ptfile.load_refs`: only their
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

from tenplex.errors import ConfigError, ManifestError, TenplexError
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import torch_dtype
from tenplex.store.paths import check_inside

from tenplex_megatron.formats.main_params import check_main_params
from tenplex_megatron.model.config import MegatronConfig, args_to_json
from tenplex_megatron.model.vocab import check_vocab
from tenplex_megatron.formats.description import Description
from tenplex_megatron.formats.folders import TRACKER, iteration_dir_name, locate
from tenplex_megatron.model.flatbuf import distrib_optim_refs
from tenplex_megatron.torchfiles.jsonable import to_jsonable
from tenplex_megatron.model.layouts import (chunk_keys, megatron_tree, optimizer_path, param_order,
                                      param_specs, rank_keys)  # rank_keys: re-exported
from tenplex_megatron.formats.legacy.grid import legacy_grid, legacy_writers, rank_dir_name, rank_dirs
from tenplex_megatron.formats.legacy.optimizer_meta import adam_steps, optimizer_meta, optimizer_subs
from tenplex_megatron.model.limits import SCALARS, check_args, check_scalars
from tenplex_megatron.torchfiles.ptfile import TensorRef, load_refs
from tenplex_megatron.formats.source import MegatronSource, empty_extra_state, extra_state_note
from tenplex_megatron.model.tied import check_tied

__all__ = ["TRACKER", "is_legacy", "describe_legacy", "open_legacy", "LegacySource", "rank_dir_name",
           "iteration_dir_name", "rank_keys"]

_RANK_PREFIX = re.compile(r"mp_rank_\d{2}")
_KNOWN = {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
          "rng_state", "num_floating_point_operations_so_far"}


def is_legacy(path: str) -> bool:
    """Whether ``path`` (a ``--save`` root or an iteration folder) holds ``mp_rank_*`` folders."""
    try:
        d = locate(path).dir
        return any(_RANK_PREFIX.match(n) for n in os.listdir(d))
    except (OSError, TenplexError):
        return False


def save_root_fault(path: str) -> str | None:
    """What keeps ``path`` from being read as a Megatron checkpoint, or None (not one, or nothing found
    wrong here): a ``--save`` root (a folder with the tracker file), or a folder with a
    ``metadata.json`` or a PyTorch DCP ``.metadata`` that no format claimed. Raises nothing."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in (TRACKER, "metadata.json", ".metadata")):
        return None
    try:
        rank_dirs(locate(path).dir)
    except TenplexError as err:
        return str(err)
    except OSError:
        return None
    return None


def _iteration_dir(root: str, iteration=None) -> tuple[str, int | str | None]:
    found = locate(root, iteration)
    return found.dir, found.iteration


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _check_ref(ref: Any, shape, dtype, what: str) -> TensorRef:
    if not isinstance(ref, TensorRef):
        raise ManifestError(f"{what}: expected a tensor, found {type(ref).__name__}")
    if ref.shape != tuple(shape) or ref.dtype != dtype:
        raise ManifestError(f"{what}: stored as {list(ref.shape)} {ref.dtype}; the model config gives "
                            f"{list(shape)} {dtype} (tenplex never casts or reshapes on read)")
    return ref


def _model_refs(cfg, config, sharding, t, p, e, v, model: dict, where: str, schemes: set,
                writer, names: set, dropped: list) -> dict:
    """Refs of chunk ``v``'s tensors in a rank file of (tp ``t``, pp ``p``, ep ``e``).

    Dense tensors are taken from the files of dense dp x cp rank 0 (ep rank
    0's, when etp == tp; the others hold replicas, checked for presence
    only); expert ``j`` of ep rank ``e`` is global expert ``e * E / ep + j``,
    split at the writer's expert-tp rank (keyed by it). ``schemes`` collects
    the expert naming schemes seen (``"sequential"`` or ``"grouped"``);
    ``writer`` is the ``Coord`` of the rank that wrote the file; ``names`` collects the norms'
    naming schemes seen (``"local"`` or ``"te"``, :data:`~tenplex_megatron.model.layouts.NAMES`),
    ``dropped`` the non-empty (FP8) extra states.
    """
    dense = writer.dense_dp_first
    out, used = {}, set()
    keyed = chunk_keys(cfg, config, p, v, e)
    te_names = {s.path: keyed[s.path][-1] for s in param_specs(cfg) if s.te and s.path in keyed}
    for path, keys in keyed.items():
        key = next((k for k in keys if k in model), None)
        if key is None:
            raise ManifestError(f"{where}: key {keys[0]} (leaf {path}) is missing")
        te = te_names.get(path)
        if te is not None:
            names.add("te" if key == te else "local")
        leaf = sharding.tree[path]
        split = t
        if leaf.layout.expert is not None:
            schemes.add("sequential" if key == keys[0] else "grouped")
            split = writer.etp
        elif not dense:
            used.update(k for k in keys if k in model)
            continue
        out[(path, split, p)] = _check_ref(model[key], sharding.tp_local(leaf, split)[0],
                                           torch_dtype(leaf.dtype), f"{where}: {key}")
        used.update(k for k in keys if k in model)
    for key, value in model.items():
        if key in used:
            continue
        if key.endswith("_extra_state"):
            if not empty_extra_state(value):
                if not isinstance(value, TensorRef):
                    raise ManifestError(f"{where}: {key} holds {type(value).__name__}; expected a "
                                        "TransformerEngine extra state (a uint8 tensor) or None")
                dropped.append(f"{where}: {key}")
            continue
        raise ManifestError(f"{where}: unexpected key {key}; tenplex keeps every tensor of a "
                            "checkpoint, and this one is not part of the model config")
    return out


def _optimizer_kind(first: dict, has_distrib: bool, iter_dir: str) -> str | None:
    optim = first.get("optimizer")
    if optim is None:
        return None
    subs = optimizer_subs(optim, iter_dir)
    if has_distrib:
        return "distrib_optim"
    inner = [o.get("optimizer", o) if isinstance(o.get("optimizer"), dict) else o for o in subs]
    if all("state" in i for i in inner):
        return "adam"
    raise ManifestError(f"{iter_dir}: the optimizer's parameter state is missing "
                        "(no Adam state and no distrib_optim.pt)")


def _sub_specs(cfg, config, p, e, v, n_subs: int, where: str) -> list[list]:
    """Parameters of each sub-optimizer: all (one), or ``[dense, experts]`` (two, ep > 1)."""
    specs = param_order(cfg, config, p, v, e)
    if n_subs == 1:
        if config.ep > 1 and any(s.expert is not None for s in specs):
            raise ManifestError(f"{where}: one optimizer, but ep={config.ep} keeps experts in their own")
        return [specs]
    return [[s for s in specs if s.expert is None], [s for s in specs if s.expert is not None]]


def _adam_refs(cfg, config, sharding, t, p, e, optim, model_refs: dict, where: str, writer) -> dict:
    """A non-distributed Adam's refs in the file of (``t``, ``p``, ``e``) written by ``writer``: dense
    state from dense dp x cp rank 0's files, expert state keyed by the writer's expert-tp rank."""
    subs = optimizer_subs(optim, where)
    out = {}
    for sub, specs in zip(subs, _sub_specs(cfg, config, p, e, 0, len(subs), where)):
        if not writer.dense_dp_first:
            specs = [s for s in specs if s.expert is not None]
            if not specs:
                continue
        split = writer.etp if specs and all(s.expert is not None for s in specs) else t
        out.update(_adam_sub(sharding, split, p, sub, specs, model_refs, where))
    return out


def _adam_sub(sharding, t, p, optim: dict, specs: list, model_refs: dict, where: str) -> dict:
    inner = optim["optimizer"] if "state" not in optim else optim
    main = optim.get("fp32_from_fp16_params")
    state, out = inner.get("state", {}), {}
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


def _model_keys(vpp: int) -> set[str]:
    """``model``, or ``model0`` .. ``model{vpp-1}`` (Megatron-LM's ``generate_state_dict``)."""
    return {"model"} if vpp == 1 else {f"model{v}" for v in range(vpp)}


def _extra(files: dict, iter_dir: str, vpp: int) -> dict:
    """Top-level entries Megatron tenplex does not model, identical in every file (else an error)."""
    out: dict = {}
    known = (_KNOWN - {"model"}) | _model_keys(vpp)
    for state in files.values():
        for key in sorted(set(state) - known):
            if key.startswith("model"):
                raise ManifestError(f"{iter_dir}: {key}: the args give vpp={vpp} model chunks "
                                    f"({sorted(_model_keys(vpp))})")
            value = to_jsonable(state[key], f"{iter_dir}: top-level entry {key}")
            if key in out and out[key] != value:
                raise ManifestError(f"{iter_dir}: top-level entry {key} differs between rank files; "
                                    "tenplex carries only entries that are the same on every rank")
            out[key] = value
    if any(set(s) - known != set(out) for s in files.values()):
        raise ManifestError(f"{iter_dir}: top-level entries {sorted(out)} are not in every rank file")
    return out


def _vocab_rows(cfg, config, first_stage: dict) -> int | None:
    """The padded vocabulary rows the files hold: tp x the first stage's embedding rows."""
    keys = rank_keys(cfg, config, 0).get("model/embedding/word_embeddings/weight", [])
    model = _flatten(dict(first_stage.get("model" if config.vpp == 1 else "model0") or {}))
    ref = next((model[k] for k in keys if k in model), None)
    return ref.shape[0] * config.tp if isinstance(ref, TensorRef) and ref.shape else None


def _load(path: str) -> tuple[Any, int]:
    obj, n = load_refs(path)
    if not isinstance(obj, dict) and not (path.endswith("distrib_optim.pt") and isinstance(obj, list)):
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


def describe_legacy(root: str, model_config: dict | None = None, threads: int = 8,
                    iteration: int | str | None = None) -> Found:
    """Describe a Megatron-LM per-rank checkpoint from its files' pickles (no tensor is read).

    Args:
        root: the ``--save`` root (holding ``latest_checkpointed_iteration.txt``), or an
            iteration folder (:func:`tenplex_megatron.formats.folders.locate`).
        model_config: model config fields, whole or overriding the files' ``args``.
        threads: files opened at once.
        iteration: the iteration to read under a root (default: the tracker's).

    Returns:
        A :class:`Found`.

    Raises:
        ManifestError: a missing tracker, iteration or ``mp_rank_*`` directory, a
            file that needs unsafe unpickling, a missing, unexpected or
            mis-shaped key, or a missing Adam moment.
        ConfigError: the args and the directory grid disagree.
    """
    iter_dir, iteration = _iteration_dir(root, iteration)
    dirs = rank_dirs(iter_dir)
    model_files = {k: os.path.join(d, "model_optim_rng.pt") for k, d in dirs.items()}
    distrib = {k: os.path.join(d, "distrib_optim.pt") for k, d in dirs.items()
               if os.path.exists(os.path.join(d, "distrib_optim.pt"))}
    check_inside(root, [*model_files.values(), *distrib.values()])  # issue 20: the one path rule
    with ThreadPoolExecutor(max(1, threads)) as pool:
        loaded = dict(zip(model_files, pool.map(_load, model_files.values())))
        opt_loaded = dict(zip(distrib, pool.map(_load, distrib.values())))
    nbytes = sum(n for _, n in loaded.values()) + sum(n for _, n in opt_loaded.values())
    scaler_reads: list[int] = []  # bytes of the grad scaler's tensors, read to describe it
    first = loaded[min(loaded)][0]
    args = first.get("args")
    check_args(args, model_files[min(loaded)])  # issue 20: bound every count before it sizes a loop
    config, mapped = legacy_grid(args, dirs, iter_dir)
    by_dir = {v: k for k, v in mapped.items()}
    files = {by_dir[dirs[k]]: v for k, (v, _) in loaded.items()}
    opt_files = {by_dir[dirs[k]]: v for k, (v, _) in opt_loaded.items()}
    opt_paths = {by_dir[dirs[k]]: v for k, v in distrib.items()}
    cfg = MegatronConfig.from_args(args, model_config)
    if cfg.num_moe_experts and cfg.num_moe_experts % config.ep:
        raise ConfigError(f"{iter_dir}: ep={config.ep} does not divide num_moe_experts={cfg.num_moe_experts}")
    check_vocab(cfg, args, config.tp, _vocab_rows(cfg, config, files[(0, 0, 0)]), iter_dir)
    if distrib and len(distrib) != len(dirs):
        raise ManifestError(f"{iter_dir}: distrib_optim.pt is in {len(distrib)} of {len(dirs)} "
                            "rank directories")
    kind = _optimizer_kind(first, bool(distrib), iter_dir)
    tree = megatron_tree(cfg, optimizer=kind is not None)
    sharding = Sharding(tree, config)
    writers = {k: config.coord(r) for k, r in legacy_writers(config).items()}  # who wrote each file
    refs: dict = {}
    schemes: set = set()
    names: set = set()
    dropped: list = []
    buffer_dtypes = None
    for (t, p, e), state in sorted(files.items()):
        where = model_files[next(k for k, d in dirs.items() if d == mapped[(t, p, e)])]
        model = {}
        for v, key in enumerate(sorted(_model_keys(config.vpp))):
            if not isinstance(state.get(key), dict):
                raise ManifestError(f"{where}: no {key} state dict")
            model.update(_model_refs(cfg, config, sharding, t, p, e, v, _flatten(dict(state[key])),
                                     f"{where} [{key}]", schemes, writers[(t, p, e)], names, dropped))
        if len(schemes) > 1:
            raise ManifestError(f"{where}: expert keys mix the sequential (local_experts.{{j}}.linear_fc1) "
                                "and grouped-GEMM (linear_fc1.weight{j}) names (Megatron-LM #924)")
        if len(names) > 1:
            raise ManifestError(f"{iter_dir}: norm keys mix megatron-core's local names (input_layernorm) and "
                                "TransformerEngine's (self_attention.linear_qkv.layer_norm_weight)")
        # the names tell the layer spec, hence the order of the optimizer state kept by position
        cfg = cfg.with_impl(next(iter(names), "local"))
        refs.update(model)
        if kind == "adam":
            if config.vpp > 1:
                raise ManifestError(f"{where}: a non-distributed optimizer with vpp={config.vpp} is not "
                                    "supported (use the distributed optimizer)")
            refs.update(_adam_refs(cfg, config, sharding, t, p, e, state["optimizer"], model, where,
                                   writers[(t, p, e)]))
        elif kind == "distrib_optim":
            found, dtypes = distrib_optim_refs(cfg, config, sharding, t, p, e, opt_files[(t, p, e)],
                                               opt_paths[(t, p, e)], writers[(t, p, e)])
            if buffer_dtypes not in (None, list(dtypes)):
                raise ManifestError(f"{opt_paths[(t, p, e)]}: buffer dtypes {dtypes} differ from another "
                                    f"rank's {buffer_dtypes}")
            refs.update(found)
            buffer_dtypes = list(dtypes)
    if len(schemes) > 1:
        raise ManifestError(f"{iter_dir}: expert keys mix the sequential (local_experts.{{j}}.linear_fc1) "
                            "and grouped-GEMM (linear_fc1.weight{j}) names (Megatron-LM #924)")
    rng_refs = _rng_by_rank(files, writers, config, iter_dir)
    files = {k[:2]: s for k, s in files.items() if writers[k].dense_dp_first}
    values = {
        "megatron/iteration": iteration if iteration is not None else first.get("iteration", 0),
        "megatron/checkpoint_version": first.get("checkpoint_version"),
        "megatron/args": args_to_json(args) if args is not None else None,
        "megatron/opt_param_scheduler": to_jsonable(first.get("opt_param_scheduler"), "opt_param_scheduler"),
        "megatron/optimizer": None if kind is None else optimizer_meta(first["optimizer"], iter_dir,
                                                                           scaler_reads.append),
        "megatron/num_floating_point_operations_so_far": first.get("num_floating_point_operations_so_far"),
        "megatron/rng_state": sorted(rng_refs),
        "megatron/extra": _extra(files, iter_dir, config.vpp) or None,
    }
    check_scalars(values, SCALARS, model_files[min(loaded)])  # issue 20: no walk over a hostile value
    meta = {"megatron": {"format": "legacy", "root": root, "config": cfg.to_json(), "optimizer": kind,
                         "buffer_dtypes": buffer_dtypes}}
    if schemes:
        meta["megatron"]["expert_names"] = schemes.pop()
    meta["megatron"]["names"] = names.pop() if names else "local"
    steps = adam_steps(first["optimizer"]) if kind == "adam" else []
    notes = [extra_state_note(len(dropped), dropped[0])] if dropped else []
    return Found(Description(cfg, config, tree, values, meta, notes, sharding), refs, rng_refs, steps,
                 nbytes + sum(scaler_reads))


def _rng_by_rank(files: dict, writers: dict, config, where: str) -> dict[str, list]:
    """``{"tp=T,pp=P": RNG states by dp-cp rank}`` of the files' ``rng_state`` lists.

    Each ``(tp, pp, ep)`` file holds its writer's ``[state]`` (at ep > 1 the writers of one (tp, pp)
    are ranks of different ep ranks, whose expert-parallel streams differ): each goes under its
    writer's dp-cp rank (``dp * cp + cp``), None where no file holds a rank's. A list of more
    (``data_parallel_random_init``: every dp rank's) is taken whole from dp-cp rank 0's file.
    """
    out: dict[str, dict] = {}
    for k, state in sorted(files.items()):
        if "rng_state" in state:
            c = writers[k]
            out.setdefault(f"tp={k[0]},pp={k[1]}", {})[c.dp * config.cp + c.cp] = state["rng_state"]
    merged = {}
    for coord, by_rank in out.items():
        first = by_rank.get(0)
        if first is not None and not (isinstance(first, list) and len(first) == 1):
            merged[coord] = first
        elif all(isinstance(v, list) and len(v) == 1 for v in by_rank.values()):
            merged[coord] = [by_rank[d][0] if d in by_rank else None for d in range(max(by_rank) + 1)]
        else:
            raise ManifestError(f"{where}: rng_state of {coord}: the files hold lists of "
                                f"{sorted({len(v) if isinstance(v, list) else -1 for v in by_rank.values()})} "
                                "states; expected one state each (or every dp rank's in dp-cp rank 0's file)")
    return merged


class LegacySource(MegatronSource):
    """A Megatron-LM per-rank checkpoint as a ``ShardSource`` (see :func:`open_legacy`)."""

    def __init__(self, found: Found):
        super().__init__(found.desc)
        self.refs, self.rng_refs, self.steps = found.refs, found.rng_refs, found.steps
        self.count(found.bytes_read)

    def locate(self, path: str, coord) -> TensorRef:
        split = coord.etp if self.tree[path].layout.expert is not None else coord.tp
        ref = self.refs.get((path, split, coord.pp))
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


def open_legacy(root: str, model_config: dict | None = None, threads: int = 8,
                iteration: int | str | None = None) -> LegacySource:
    """A :class:`LegacySource` over the checkpoint at ``root``; tied embedding copies compared first.

    Raises:
        ManifestError, ConfigError: see :func:`describe_legacy`; also when the
            first and last stages' copies of a tied embedding differ, or the fp32 main params
            differ from the weights (:func:`~tenplex_megatron.formats.main_params.check_main_params`).
    """
    source = LegacySource(describe_legacy(root, model_config, threads, iteration))
    check_tied(source)
    check_main_params(source)
    return source

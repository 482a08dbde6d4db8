"""Megatron-LM's legacy rank directories: ``mp_rank_TT[_PPP][_EEE]``, and the grid they form.

Megatron-LM core_v0.16.1 ``megatron/training/checkpointing.py::get_checkpoint_name``
names a rank's directory by its **dense** tp rank ``TT``, its pipeline rank
``PPP`` (only when pp > 1) and its expert-parallel rank ``EEE`` (only when
ep > 1); cp, dp, expert dp and expert tp never appear. ``mp_rank_00_001`` is
pp rank 1 or ep rank 1: only the args (``pipeline_model_parallel_size``,
``expert_model_parallel_size``) tell which. Files are written by the ranks with
expert-data-parallel rank 0 (``save_checkpoint``), so with ``etp == tp`` every
``(tp, pp, ep)`` directory exists; with ``etp != tp`` some ranks overwrite each
other's files or dense shards are missing (megatron-core 0.16.1), and tenplex
refuses such checkpoints.
"""

from __future__ import annotations

import argparse
import os
import re

from tenplex.errors import ConfigError, ManifestError
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.config import stage_layers

__all__ = ["rank_dir_name", "rank_dirs", "legacy_grid", "parallel_config"]

_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """``mp_rank_TT``, with ``_PPP`` when pp > 1 and ``_EEE`` when ep > 1."""
    return (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
            + (f"_{ep_rank:03d}" if ep > 1 else ""))


def rank_dirs(iter_dir: str) -> dict[tuple[int, ...], str]:
    """``{(TT, [NNN, [NNN]]): path}`` of the ``mp_rank_*`` directories, numbers as named."""
    if not os.path.isdir(iter_dir):
        raise ManifestError(f"{iter_dir}: the iteration directory named by the tracker is missing")
    found = {}
    for name in sorted(os.listdir(iter_dir)):
        m = _RANK_DIR.match(name)
        if m:
            found[tuple(int(g) for g in m.groups() if g is not None)] = os.path.join(iter_dir, name)
    if not found:
        raise ManifestError(f"{iter_dir}: no mp_rank_* directories")
    return found


def _arg(a: dict, name: str, default=None):
    value = a.get(name)
    return default if value is None else value


def legacy_grid(args, dirs: dict, iter_dir: str) -> tuple[ParallelConfig, dict[tuple[int, int, int], str]]:
    """The parallel config of the files and ``{(tp, pp, ep): directory}``.

    The degrees come from the args where they say them, else from the
    directory names (two numbers: tp and pp, as for a dense model). The
    config's dp is the args' ``data_parallel_size`` (at least what the expert
    grid needs).

    Raises:
        ManifestError: a directory of the grid is missing.
        ConfigError: a directory lies outside the args' grid, the names do
            not fit the args, or ``expert_tensor_parallel_size != tensor_model_parallel_size``.
    """
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    widths = {len(k) for k in dirs}
    if len(widths) > 1:
        raise ConfigError(f"{iter_dir}: rank directories mix naming forms {sorted(widths)}")
    tp = _arg(a, "tensor_model_parallel_size") or max(k[0] for k in dirs) + 1
    pp = _arg(a, "pipeline_model_parallel_size") or (max(k[1] for k in dirs) + 1 if widths == {2} else 1)
    ep = _arg(a, "expert_model_parallel_size", 1)
    etp = _arg(a, "expert_tensor_parallel_size", tp)
    if a.get("num_experts") and etp != tp:
        raise ConfigError(f"{iter_dir}: expert_tensor_parallel_size={etp} differs from "
                          f"tensor_model_parallel_size={tp}; megatron-core 0.16.1's legacy files then "
                          "overwrite each other (etp > tp) or lack dense shards (etp < tp): use torch_dist")
    width = 1 + (pp > 1) + (ep > 1)
    if widths != {width}:
        raise ConfigError(f"{iter_dir}: rank directories have {widths.pop() - 1} numbers after the tp rank; "
                          f"the args' pp={pp}, ep={ep} give {width - 1}")
    mapped = {}
    for key, path in dirs.items():
        rest = list(key[1:])
        p = rest.pop(0) if pp > 1 else 0
        e = rest.pop(0) if ep > 1 else 0
        mapped[(key[0], p, e)] = path
    want = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
    for t, p, e in sorted(want - set(mapped)):
        raise ManifestError(f"{iter_dir}: {rank_dir_name(t, p, pp, e, ep)} is missing (expected "
                            f"tp={tp} x pp={pp}" + (f" x ep={ep}" if ep > 1 else "") + " rank directories)")
    extra = sorted(set(mapped) - want)
    if extra:
        raise ConfigError(f"{iter_dir}: rank directories {[rank_dir_name(*k[:2], pp, k[2], ep) for k in extra]} "
                          f"lie outside the args' grid tp={tp} x pp={pp} x ep={ep}")
    return parallel_config(args, tp, pp), mapped


def parallel_config(args, tp: int, pp: int) -> ParallelConfig:
    """The saver's parallel config: ``tp``, ``pp`` and the args' cp, ep, etp, vpp and uneven stages.

    dp is the args' ``data_parallel_size``, raised to what the expert grid
    needs (``etp * ep * pp`` must divide the world); Megatron files hold
    tensors gathered over dp, so dp sizes nothing on disk.

    Raises:
        ConfigError: the degrees do not form a config.
    """
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    cp = _arg(a, "context_parallel_size", 1)
    ep = _arg(a, "expert_model_parallel_size", 1)
    etp = _arg(a, "expert_tensor_parallel_size", tp)
    vpp = _arg(a, "virtual_pipeline_model_parallel_size", 1)
    dp = _arg(a, "data_parallel_size", 1)
    while (dp * tp * cp * pp) % (etp * ep * pp):
        dp += 1
    layers = a.get("num_layers")
    stages = stage_layers(args, int(layers), pp) if layers else None
    return ParallelConfig(dp, tp, pp, stage_layers=stages, cp=cp, ep=ep, etp=etp, vpp=vpp)

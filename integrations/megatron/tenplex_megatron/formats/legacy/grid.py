"""Megatron-LM's legacy rank directories: ``mp_rank_TT[_PPP][_EEE]``, and the grid they form.

Megatron-LM core_v0.16.1 ``megatron/training/checkpointing.py::get_checkpoint_name``
names a rank's directory by its **dense** tp rank ``TT``, its pipeline rank
``PPP`` (only when pp > 1) and its expert-parallel rank ``EEE`` (only when
ep > 1); cp, dp, expert dp and expert tp never appear. ``mp_rank_00_001`` is
pp rank 1 or ep rank 1: only the args (``pipeline_model_parallel_size``,
``expert_model_parallel_size``) tell which. Files are written by the ranks with
expert-data-parallel rank 0 (``save_checkpoint``), so with ``etp == tp`` every
``(tp, pp, ep)`` directory exists; with ``etp != tp`` only some do, and they
hold every rank's state only when ``etp < tp`` and tp divides ``etp * ep``
(:func:`check_expert_files`); otherwise ranks overwrite each other's files or
dense shards are missing, and tenplex refuses such checkpoints.
"""

from __future__ import annotations

import argparse
import os
import re

from tenplex.errors import ConfigError, ManifestError
from tenplex.limits import short
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.formats.folders import sharded_backend
from tenplex_megatron.model.parallel import arg as _arg, parallel_config

__all__ = ["rank_dir_name", "rank_dirs", "legacy_grid", "legacy_writers", "check_expert_files"]

_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """``mp_rank_TT``, with ``_PPP`` when pp > 1 and ``_EEE`` when ep > 1."""
    return (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
            + (f"_{ep_rank:03d}" if ep > 1 else ""))


def _listing(folder: str, most: int = 6) -> str:
    """What ``folder`` holds, for an error: its first names (each cut to 40 characters, as repr shows them)."""
    names = sorted(os.listdir(folder))
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(short(n, 40) for n in names[:most]) + more if names else "nothing"


def rank_dirs(iter_dir: str) -> dict[tuple[int, ...], str]:
    """``{(TT, [NNN, [NNN]]): path}`` of the ``mp_rank_*`` directories, numbers as named."""
    if not os.path.isdir(iter_dir):
        raise ManifestError(f"{iter_dir}: the iteration directory named by the tracker is missing")
    found = {}
    for name in sorted(os.listdir(iter_dir)):
        m = _RANK_DIR.match(name)
        if m:
            found[tuple(int(g) for g in m.groups() if g is not None)] = os.path.join(iter_dir, name)
    if not found:  # nor a torch_dist folder (the dist format would have claimed it): say which parts lack
        raise ManifestError(f"{iter_dir}: not a Megatron checkpoint folder: expected mp_rank_* directories "
                            "(--ckpt-format torch) or a metadata.json saying torch_dist (--ckpt-format "
                            f"torch_dist), found {_listing(iter_dir)}{_other_format(iter_dir)}")
    return found


def _other_format(folder: str) -> str:
    """What else ``folder`` holds, for the error above: ``"; it holds ..."``, or ``""``.

    A PyTorch DCP checkpoint (a ``.metadata`` file) without megatron-core's ``metadata.json`` is what
    Megatron-LM writes for ``--ckpt-format torch_dcp`` and ``fsdp_dtensor`` (its
    ``_get_checkpoint_format`` takes such a folder for one of them); a ``metadata.json`` naming
    another backend (``zarr``, megatron-core's older one) is megatron-core's but not ``torch_dist``.
    Raises nothing (:func:`~tenplex_megatron.formats.folders.sharded_backend`).
    """
    backend = sharded_backend(folder)
    if backend is not None:
        return (f"; its metadata.json names the sharded backend {short(backend, 40)}: tenplex reads "
                "torch_dist; load it in Megatron-LM and save it again with --ckpt-format torch_dist")
    if os.path.isfile(os.path.join(folder, ".metadata")):
        return ("; it holds a PyTorch DCP checkpoint without megatron-core's metadata.json (Megatron-LM's "
                "--ckpt-format torch_dcp or fsdp_dtensor), which tenplex does not read: load it in "
                "Megatron-LM and save it again with --ckpt-format torch_dist")
    return ""


def legacy_grid(args, dirs: dict, iter_dir: str) -> tuple[ParallelConfig, dict[tuple[int, int, int], str]]:
    """The parallel config of the files and ``{(tp, pp, ep): directory}``.

    The degrees come from the args where they say them, else from the
    directory names (two numbers: tp and pp, as for a dense model). The
    config's dp is the args' ``data_parallel_size`` (at least what the expert
    grid needs).

    Raises:
        ManifestError: a directory of the grid is missing.
        ConfigError: a directory lies outside the args' grid, the names do
            not fit the args, or an MoE model's ``expert_tensor_parallel_size`` makes
            Megatron-LM's files collide or miss shards (:func:`check_expert_files`).
    """
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    widths = {len(k) for k in dirs}
    if len(widths) > 1:
        raise ConfigError(f"{iter_dir}: rank directories mix naming forms {sorted(widths)}")
    tp = _arg(a, "tensor_model_parallel_size") or max(k[0] for k in dirs) + 1
    pp = _arg(a, "pipeline_model_parallel_size") or (max(k[1] for k in dirs) + 1 if widths == {2} else 1)
    ep = _arg(a, "expert_model_parallel_size", 1)
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
    config = parallel_config(args, tp, pp)
    if a.get("num_experts"):
        check_expert_files(config, iter_dir)
    want = legacy_writers(config)
    for t, p, e in sorted(set(want) - set(mapped)):
        grid = f"tp={tp} x pp={pp}" + (f" x ep={ep}" if ep > 1 else "")
        raise ManifestError(f"{iter_dir}: {rank_dir_name(t, p, pp, e, ep)} is missing (expected {grid} rank "
                            "directories" + ("" if config.etp == tp else f", written at {config}") + ")")
    extra = sorted(set(mapped) - set(want))
    if extra:
        raise ConfigError(f"{iter_dir}: rank directories {[rank_dir_name(*k[:2], pp, k[2], ep) for k in extra]} "
                          f"lie outside the args' grid tp={tp} x pp={pp} x ep={ep}, or no rank of {config} "
                          "writes them")
    return config, mapped


def legacy_writers(config: ParallelConfig) -> dict[tuple[int, int, int], int]:
    """``{(tp, pp, ep): rank}``: the rank whose ``model_optim_rng.pt`` each directory holds.

    Megatron-LM core_v0.16.1 ``save_checkpoint`` writes from the ranks with
    expert-data-parallel rank 0, each into ``get_checkpoint_name``'s directory of
    its dense tp, pp and ep ranks (the lowest such rank is named; see
    :func:`check_expert_files` for when there is only one). With ``etp == tp``
    every ``(tp, pp, ep)`` has one; with ``etp < tp`` only some (e.g. tp 2, ep 2,
    etp 1 writes ``mp_rank_00_000`` and ``mp_rank_01_001``).
    """
    out: dict[tuple[int, int, int], int] = {}
    for rank in range(config.world_size):
        c = config.coord(rank)
        if c.edp == 0:
            out.setdefault((c.tp, c.pp, c.ep), rank)
    return out


def check_expert_files(config: ParallelConfig, where: str) -> None:
    """Megatron-LM's legacy files of an MoE model at ``config`` are complete and do not collide.

    Every rank loads the directory of its (dense tp, pp, ep) ranks
    (``get_checkpoint_name``: no expert-tp rank in the name), written by the
    rank with expert-dp rank 0 there. That holds each rank's expert shards
    only when every rank and its directory's writer share the expert-tp rank:
    ``etp == tp``, or ``etp < tp`` with tp dividing ``etp * ep``.

    Raises:
        ConfigError: naming two ranks whose expert-tp shards share one file, or
            a rank whose file no rank writes.
    """
    if config.etp == config.tp:
        return
    writers = legacy_writers(config)
    rule = ("Megatron-LM core_v0.16.1's legacy files (checkpointing.py get_checkpoint_name: "
            "mp_rank_TT[_PPP][_EEE] with the dense tp rank, written by expert-dp rank 0 in save_checkpoint) "
            "hold an MoE model only with etp == tp, or etp < tp with tp dividing etp*ep; use torch_dist")
    for rank in range(config.world_size):
        c = config.coord(rank)
        name = rank_dir_name(c.tp, c.pp, config.pp, c.ep, config.ep)
        writer = writers.get((c.tp, c.pp, c.ep))
        if writer is None:
            raise ConfigError(f"{where}: at {config} no rank writes {name}, which rank {rank} loads; {rule}")
        w = config.coord(writer)
        if w.etp != c.etp:
            raise ConfigError(f"{where}: at {config} ranks {writer} and {rank} (expert-tp ranks {w.etp} and "
                              f"{c.etp}) share {name}: their expert shards collide; {rule}")

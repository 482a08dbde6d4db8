"""Megatron-LM's ``--save`` folder: the tracker file, iteration folders, and where a checkpoint lies.

Megatron-LM (``megatron/training/checkpointing.py``, core_v0.16.1 to
core_v0.19.2) saves both formats under the ``--save`` root::

    ROOT/latest_checkpointed_iteration.txt     "5" (or "release")
    ROOT/iter_0000005/                          legacy: mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
                                                torch_dist: metadata.json, .metadata, *.distcp, [common.pt]

``load_checkpoint`` reads the tracker first (``read_metadata``), then the
iteration folder (``get_checkpoint_name(..., return_base_dir=True)`` for
torch_dist), and tells the format from what that folder holds
(``_get_checkpoint_format``). tenplex accepts the root (the tracker's
iteration, or ``--iteration N``), an iteration folder itself, and, for
torch_dist, a bare ``dist_checkpointing`` folder; it writes the root layout
with the tracker last, so ``--load OUT`` resumes at the source's iteration.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from typing import NamedTuple

from tenplex.errors import ManifestError, TenplexError

from tenplex_megatron.torchfiles.safe_load import open_regular

__all__ = ["TRACKER", "Located", "locate", "read_tracker", "iteration_dir_name", "write_tracker",
           "iterations", "sharded_backend"]

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"iter_(\d{7,12})$")


def iteration_dir_name(iteration) -> str:
    """``iter_NNNNNNN`` (seven digits at least), or ``release``."""
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


class Located(NamedTuple):
    """Where a Megatron checkpoint's files lie.

    Attributes:
        dir: the folder holding them (an iteration folder, or a bare torch_dist folder).
        iteration: the iteration its folder name or the tracker gives, ``"release"``, or
            None (a bare folder: the files say it).
        root: the ``--save`` root holding the tracker, or None.
    """

    dir: str
    iteration: int | str | None
    root: str | None


def read_tracker(root: str) -> int | str:
    """The iteration ``ROOT/latest_checkpointed_iteration.txt`` names (an int, or ``"release"``).

    Raises:
        ManifestError: the file is not a regular file, or holds no iteration number.
    """
    path = os.path.join(root, TRACKER)
    f, _ = open_regular(path, path, root=root)
    with f:
        text = f.read(64).decode("utf-8", "replace").strip()
    if text == "release":
        return "release"
    if not text.isdigit() or len(text) > 12:
        raise ManifestError(f"{path}: expected an iteration number or 'release', found {text[:20]!r}")
    return int(text)


def sharded_backend(folder: str) -> str | None:
    """The ``sharded_backend`` that ``folder``'s ``metadata.json`` names (megatron-core
    ``dist_checkpointing``: ``"torch_dist"``, or an older backend such as ``"zarr"``), or None where
    there is no readable one. The file is opened under the path rule (a regular file inside
    ``folder``) and 4 KiB of it at most are read. Raises nothing."""
    path = os.path.join(folder, "metadata.json")
    try:
        f, _ = open_regular(path, path, root=folder)
        with f:
            backend = json.loads(f.read(4096)).get("sharded_backend")
    except (OSError, ValueError, AttributeError, TenplexError):
        return None
    return backend if isinstance(backend, str) else None


def iterations(root: str) -> list[int | str]:
    """The iteration folders under ``root``, as iterations, sorted (``"release"`` last)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found: list = sorted(int(m.group(1)) for n in names if (m := _ITER_DIR.match(n))
                         and os.path.isdir(os.path.join(root, n)))
    return found + (["release"] if os.path.isdir(os.path.join(root, "release")) else [])


def _iteration_of_name(path: str) -> int | str | None:
    name = os.path.basename(os.path.normpath(path))
    if name == "release":
        return "release"
    m = _ITER_DIR.match(name)
    return int(m.group(1)) if m else None


def locate(path: str, iteration: int | str | None = None) -> Located:
    """Where the checkpoint at ``path`` lies, as Megatron-LM's ``load_checkpoint`` finds it.

    Args:
        path: a ``--save`` root (with the tracker, or with iteration folders),
            an iteration folder, or a bare torch_dist folder.
        iteration: the iteration to pick under a root (``--iteration``); default the tracker's.

    Raises:
        ManifestError: the tracker is unreadable, or the iteration asked for (or named
            by the tracker) has no folder.
    """
    has_tracker = os.path.lexists(os.path.join(path, TRACKER))
    found = iterations(path)
    if has_tracker or (found and _iteration_of_name(path) is None):
        if iteration is None:
            iteration = read_tracker(path) if has_tracker else None
        if iteration is None:
            raise ManifestError(f"{path}: no {TRACKER}, and iteration folders {found[:8]}; "
                                "pick one with --iteration N")
        if iteration != "release":
            iteration = int(iteration)
        d = os.path.join(path, iteration_dir_name(iteration))
        if not os.path.isdir(d):
            said = "asked for" if not has_tracker or iteration != read_tracker(path) else f"named by {TRACKER}"
            raise ManifestError(f"{d}: the iteration folder {said} is missing (iteration folders "
                                f"present: {found[:8] or 'none'})")
        return Located(d, iteration, path)
    own = _iteration_of_name(path)
    if iteration is not None and own is not None and own != (iteration if iteration == "release"
                                                              else int(iteration)):
        raise ManifestError(f"{path}: an iteration folder of iteration {own}; --iteration {iteration} "
                            "picks one under a --save root")
    return Located(path, own, None)


def write_tracker(root: str, iteration: int | str) -> None:
    """Write ``ROOT/latest_checkpointed_iteration.txt`` atomically (temp name, then rename)."""
    tmp = os.path.join(root, f".{TRACKER}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        f.write(str(iteration))
    os.replace(tmp, os.path.join(root, TRACKER))

"""Agree before any byte moves: same inputs, same plan, and local state that matches the tree.

Each process checks its own local state against what its rank must hold
(:func:`local_problems`) and reports what it was called with. After one
gather, every process holds every report, so the checks below raise the
same error, with the same message, on every process.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import torch
import xxhash

from tenplex.errors import PlanError, ShardError
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, TensorLeaf, torch_dtype

__all__ = ["tree_digest", "local_problems", "out_problems", "check_same_inputs", "check_local_state",
           "check_same_plan"]

MAX_LISTED = 8
"""Problems named in one message; the rest are counted."""


def tree_digest(tree: PTree) -> str:
    """xxh3-128 hex digest of the tree spec's canonical JSON."""
    return xxhash.xxh3_128_hexdigest(json.dumps(tree.to_json(), sort_keys=True,
                                                separators=(",", ":")).encode())


def local_problems(tree: PTree, sharding: Sharding, rank: int | None, local: Mapping[str, Any] | None,
                   device: str | torch.device | None) -> list[str]:
    """What is wrong with ``local`` as the state of ``rank`` under ``sharding.config``.

    Every tensor leaf the rank holds must be present, a contiguous
    ``torch.Tensor`` of the leaf's dtype and the local shape, on ``device``
    (its type, and its index when ``device`` names one; ``None``: any
    device). Every value leaf
    must be present and JSON-serializable. Leaves the rank does not hold are
    not looked at.

    Returns:
        One line per problem, naming the leaf, what was expected and what was
        found (empty when the state matches).
    """
    if rank is None:
        return [] if local is None else ["holds a local state but no old rank"]
    if local is None:
        return ["holds no local state (local_state=None)"]
    want = torch.device(device) if device is not None else None
    coord = sharding.config.coord(rank)
    out = []
    for path, leaf in tree.tensors():
        held = sharding.holding(path, coord)
        if held is not None:
            problem = _tensor_problem(leaf, held.shape, local.get(path, _MISSING), want)
            if problem:
                out.append(f"leaf {path}: {problem}")
    for path, _ in tree.values():
        if path not in local:
            out.append(f"value leaf {path}: missing")
            continue
        try:
            json.dumps(local[path])
        except (TypeError, ValueError) as exc:
            out.append(f"value leaf {path}: not JSON-serializable ({exc})")
    return out


_MISSING = object()


def out_problems(tree: PTree, sharding: Sharding, rank: int | None, out: Mapping[str, Any],
                 device: str | torch.device | None, old: Mapping[str, Any] | None = None) -> list[str]:
    """What is wrong with ``out`` as the tensors to receive ``rank``'s new state into.

    ``out`` must hold, for every tensor leaf ``rank`` holds under ``sharding.config``, a
    contiguous ``torch.Tensor`` of the leaf's dtype and local shape on ``device`` (as
    :func:`local_problems` checks a local state), and nothing else; none of its tensors may
    share memory with a tensor of ``old`` (the state the transfer reads).

    Returns:
        One line per problem, each starting with ``out=``, naming the leaf, what was expected
        and what was found (empty when ``out`` fits).
    """
    if rank is None:
        return ["out= was given, but this process holds no new rank"]
    want = torch.device(device) if device is not None else None
    coord = sharding.config.coord(rank)
    held_paths, lines = set(), []
    for path, leaf in tree.tensors():
        held = sharding.holding(path, coord)
        if held is not None:
            held_paths.add(path)
            problem = _tensor_problem(leaf, held.shape, out.get(path, _MISSING), want)
            if problem:
                lines.append(f"out= leaf {path}: {problem}")
    extra = [p for p in out if p not in held_paths]
    if extra:
        lines.append(f"out= has {len(extra)} entries that are no tensor leaf new rank {rank} holds "
                     f"(first: {extra[0]})")
    olds = {t.untyped_storage().data_ptr() for t in (old or {}).values()
            if isinstance(t, torch.Tensor) and t.numel()}
    shared = [p for p in held_paths if isinstance(out.get(p), torch.Tensor) and out[p].numel()
              and out[p].untyped_storage().data_ptr() in olds]
    if shared:
        lines.append(f"out= leaf {shared[0]}: expected memory of its own, found it shares memory with "
                     f"the old local state ({len(shared)} leaves do)")
    return lines


def _tensor_problem(leaf: TensorLeaf, shape: tuple[int, ...], t: Any, want: torch.device | None) -> str:
    if t is _MISSING:
        return f"missing (expected a {leaf.dtype} tensor of shape {list(shape)})"
    if not isinstance(t, torch.Tensor):
        return f"expected a {leaf.dtype} tensor, found {type(t).__name__}"
    if t.dtype != torch_dtype(leaf.dtype):
        return f"expected dtype {leaf.dtype}, found {str(t.dtype).removeprefix('torch.')}"
    if tuple(t.shape) != tuple(shape):
        return f"expected local shape {list(shape)}, found {list(t.shape)}"
    if want is not None and (t.device.type != want.type
                             or (want.index is not None and t.device.index != want.index)):
        return f"expected device {want}, found {t.device}"
    if not t.is_contiguous():
        return "expected a contiguous tensor, found a strided view"
    return ""


def check_same_inputs(what: str, everyone: Sequence[Mapping], field: str = "inputs") -> None:
    """Raise PlanError unless every process was called with the same ``everyone[p][field]``.

    Raises:
        PlanError: naming the first argument that differs and two processes' values.
    """
    first = everyone[0][field]
    for p, item in enumerate(everyone):
        mine = item[field]
        if mine != first:
            key = next(k for k in sorted(set(first) | set(mine)) if first.get(k) != mine.get(k))
            raise PlanError(f"{what}: the processes were called with different arguments: "
                            f"{key} is {_short(first.get(key))} on process 0 but "
                            f"{_short(mine.get(key))} on process {p}")


def check_local_state(what: str, everyone: Sequence[Mapping], labels: Sequence[str]) -> None:
    """Raise ShardError if any process reported problems with its local state (see :func:`local_problems`).

    Raises:
        ShardError: listing up to :data:`MAX_LISTED` problems, each with its
            process (``labels[p]``), leaf, expected and found.
    """
    lines = [f"{labels[p]}: {line}" for p, item in enumerate(everyone) for line in item["problems"]]
    if lines:
        more = f"; and {len(lines) - MAX_LISTED} more" if len(lines) > MAX_LISTED else ""
        what_state = "local state or out=" if any(" out= " in line for line in lines) else "local state"
        raise ShardError(f"{what}: {what_state} does not match the tree: "
                         + "; ".join(lines[:MAX_LISTED]) + more)


def check_same_plan(what: str, digests: Sequence[str]) -> None:
    """Raise PlanError unless every process computed the same plan digest.

    Raises:
        PlanError: naming the processes whose plan differs from process 0's.
    """
    differ = [p for p, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise PlanError(f"{what}: processes {differ} computed a plan different from process 0's "
                        f"(digest {digests[differ[0]]} against {digests[0]}); the inputs agree, so "
                        "the processes run different versions of tenplex or of its dependencies")


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 200 else text[:197] + "..."

"""Rank grids: megatron-core 0.16's rank generation as pure arithmetic.

megatron-core (``parallel_state.initialize_model_parallel``) builds two
``RankGenerator`` grids over the same ranks, both in one order string
(default ``"tp-cp-ep-dp-pp"``, first axis fastest-varying in the rank):

- the **dense grid** ``TP x CP x DP x PP`` (its ``ep`` is 1): attention,
  dense MLPs, embeddings, norms, routers;
- the **expert grid** ``ETP x EP x EDP x PP`` (its ``cp`` is 1, ``tp`` is the
  expert-tensor-parallel size and ``dp`` the expert-data-parallel size
  ``EDP = world / (ETP * EP * PP)``): the experts ("MoE parallel folding").

Axes an order string leaves out are appended at its end (``RankGenerator``
raises if such an axis has size > 1). A rank's index in one of its groups is
its position in the group's sorted ranks (``torch.distributed.new_group``
sorts them), which on a grid is the mixed-radix number of the group's axes in
order. Every function here is pure.
"""

from __future__ import annotations

from tenplex.errors import ConfigError

__all__ = ["TOKENS", "DEFAULT_ORDER", "full_order", "grid_sizes", "strides", "decompose",
           "compose", "group_index"]

TOKENS = ("tp", "cp", "ep", "dp", "pp")
"""megatron-core's order tokens."""

DEFAULT_ORDER = ("tp", "cp", "ep", "dp", "pp")
"""megatron-core 0.16's default ``order="tp-cp-ep-dp-pp"``."""

_DEFAULT_NEIGHBOUR = {"cp": ("after", "tp"), "ep": ("before", "dp")}


def full_order(order: tuple[str, ...] | str) -> tuple[str, ...]:
    """All five tokens in rank order: ``order`` with ``cp`` and ``ep`` placed if it lacks them.

    A missing ``cp`` goes right after ``tp`` and a missing ``ep`` right before
    ``dp``, as in megatron's default order. Where megatron appends a missing
    axis instead, that axis has size 1, so the ranks are the same.

    Raises:
        ConfigError: if ``order`` repeats or names an unknown token, or lacks
            ``tp``, ``dp`` or ``pp``.
    """
    names = tuple(order.split("-")) if isinstance(order, str) else tuple(order)
    if len(set(names)) != len(names) or not set(names) <= set(TOKENS) \
            or not {"tp", "dp", "pp"} <= set(names):
        raise ConfigError(f"ParallelConfig: order must name tp, dp and pp (and may name cp, ep) "
                          f"once each, got {order!r}")
    out = list(names)
    for token, (where, neighbour) in _DEFAULT_NEIGHBOUR.items():
        if token not in out:
            at = out.index(neighbour)
            out.insert(at + 1 if where == "after" else at, token)
    return tuple(out)


def grid_sizes(grid: str, tp: int, cp: int, ep: int, dp: int, pp: int, etp: int,
               edp: int) -> dict[str, int]:
    """The size of each order token on the ``"dense"`` or ``"expert"`` grid."""
    if grid == "dense":
        return {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    return {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}


def strides(order: tuple[str, ...], sizes: dict[str, int]) -> dict[str, int]:
    """Rank stride of each token: the product of the sizes of the tokens before it."""
    out, stride = {}, 1
    for token in order:
        out[token] = stride
        stride *= sizes[token]
    return out


def decompose(rank: int, order: tuple[str, ...], sizes: dict[str, int]) -> dict[str, int]:
    """The coordinate of ``rank`` on each token of one grid."""
    out = {}
    for token in order:
        rank, out[token] = divmod(rank, sizes[token])
    return out


def compose(coords: dict[str, int], order: tuple[str, ...], sizes: dict[str, int]) -> int:
    """The rank at ``coords`` (one coordinate per token) on one grid."""
    rank = 0
    for token in reversed(order):
        rank = rank * sizes[token] + coords[token]
    return rank


def group_index(coords: dict[str, int], tokens: tuple[str, ...], order: tuple[str, ...],
                sizes: dict[str, int]) -> int:
    """A rank's index in its group over ``tokens`` (e.g. ``("dp", "cp")``, megatron's dp-cp group)."""
    index, scale = 0, 1
    for token in order:
        if token in tokens:
            index += coords[token] * scale
            scale *= sizes[token]
    return index

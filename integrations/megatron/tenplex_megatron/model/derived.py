"""What is derived from one model config (parameter specs, shardings, buffer layouts), kept with that config.

An operation reads one :class:`~tenplex_megatron.model.config.MegatronConfig`
(from the args) and asks for its specs, its tree's sharding at a parallel
config, its optimizer buffers, ... many times. Each is built once per config
*object* and kept inside it, so it lives as long as the operation holds the
config and goes with it: there is no process-global cache keyed on configs.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

__all__ = ["derived"]

_SLOT = "_derived"


def derived(cfg: Any, key: Hashable, build: Callable[[], Any]) -> Any:
    """``build()``, made once per ``(cfg object, key)`` and kept in ``cfg``.

    Args:
        cfg: a frozen dataclass instance (the model config); its fields, equality,
            hash and JSON form are not touched.
        key: what is derived (e.g. ``("buffers", parallel_config)``).
        build: makes it; it must depend on ``cfg`` and ``key`` only.

    Returns:
        The derived object (shared: do not modify it).
    """
    memo = cfg.__dict__.get(_SLOT)
    if memo is None:
        memo = {}
        object.__setattr__(cfg, _SLOT, memo)
    if key not in memo:
        memo[key] = build()
    return memo[key]

"""Split a target's shard files across processes: balanced by bytes, source reads not repeated.

A reshard under torchrun (:mod:`tenplex.distributed_reshard`) gives each
process whole target files to write. Two target files that cut the same
stored tensor (tensor-parallel slices of one layer, or expert slices) need
the same source checksum blocks: a column cut needs a piece of every row,
so every block. Written by two processes, those blocks are read twice. So
the ranks of one pipeline stage (whatever its tensor-, context-, expert-
or data-parallel sizes: they cut the same stored tensors) form one unit, and units, not files, are
balanced across processes (longest first, onto the least loaded process).
A unit is split (into halves by rank) only while there are fewer units than
processes, or the busiest process holds more than ``slack`` times the mean:
then the split unit's shared blocks are read once per process holding part
of it, the price of keeping every process busy.
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence

from tenplex.ptree.config import ParallelConfig
from tenplex.store.safetensors_format import Entry

__all__ = ["split_files", "split_weights", "SLACK"]

SLACK = 1.15
"""The busiest process may hold this many times the mean bytes before a unit is split."""


def _units(entries: Mapping[int, object], unit_of: Callable[[int], Hashable]) -> list[list[int]]:
    """Ranks grouped by ``unit_of(rank)``, each group sorted by rank."""
    groups: dict = {}
    for rank in sorted(entries):
        groups.setdefault(unit_of(rank), []).append(rank)
    return list(groups.values())


def _assign(units: list[list[int]], weight: Mapping[int, int], n: int) -> list[list[list[int]]]:
    """Longest-processing-time-first: each unit, heaviest first, to the least loaded process."""
    loads = [0] * n
    out: list[list[list[int]]] = [[] for _ in range(n)]
    for unit in sorted(units, key=lambda u: (-sum(weight[r] for r in u), u[0])):
        p = min(range(n), key=lambda i: (loads[i], i))
        out[p].append(unit)
        loads[p] += sum(weight[r] for r in unit)
    return out


def split_files(entries: Mapping[int, Sequence[Entry]], n: int, config: ParallelConfig | None = None,
                slack: float = SLACK) -> list[list[int]]:
    """The target ranks whose files each of ``n`` processes writes.

    Args:
        entries: ``{rank: [Entry, ...]}``, the target's files (:meth:`StoreWriter.entries`).
        n: the number of processes (>= 1).
        config: the target config; its pipeline stages are the units (default: each rank its own).
        slack: the imbalance (busiest over mean bytes) allowed before a unit is split.

    Returns:
        ``n`` sorted lists of ranks; every rank of ``entries`` is in exactly one
        (a process may get none when there are fewer files than processes).
    """
    return split_weights({r: sum(e.nbytes for e in es) for r, es in entries.items()}, n, config, slack)


def split_weights(weights: Mapping[int, int], n: int, config: ParallelConfig | None = None,
                  slack: float = SLACK) -> list[list[int]]:
    """:func:`split_files` for any target's files: ``weights`` is ``{rank: bytes of its files}``.

    Used by formats that write in parts (:class:`tenplex.formats.protocol.Part`),
    whose files are named by the target rank that writes them.
    """
    if n < 1:
        raise ValueError(f"split_files: expected n >= 1 processes, got {n}")
    weight = {r: max(1, int(w)) for r, w in weights.items()}
    units = _units(weight, (lambda r: config.coord(r).pp) if config is not None else (lambda r: r))
    total = sum(weight.values())
    while True:
        parts = _assign(units, weight, n)
        loads = [sum(weight[r] for u in p for r in u) for p in parts]
        splittable = [u for u in units if len(u) > 1]
        short = len(units) < n
        if not splittable or not (short or max(loads) > slack * total / n):
            break
        if short:
            unit = max(splittable, key=lambda u: sum(weight[r] for r in u))
        else:  # the busiest process's largest splittable unit
            busiest = parts[loads.index(max(loads))]
            mine = [u for u in busiest if len(u) > 1]
            if not mine:
                break
            unit = max(mine, key=lambda u: sum(weight[r] for r in u))
        units.remove(unit)
        half = len(unit) // 2
        units += [unit[:half], unit[half:]]
    return [sorted(r for u in p for r in u) for p in parts]

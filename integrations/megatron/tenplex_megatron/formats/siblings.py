"""Leaves built once for sibling target ranks: ranks whose files are written at the same time.

A Megatron writer writes a file per target rank, each rank's leaves built
from the source by the store executor. Where tensor-parallel ranks cut a
stored tensor across its rows (``linear_proj``, ``linear_fc2``: a column
range of every row), each rank needs a piece of every checksum block of the
stored tensor, and a tenplex store reads and verifies whole blocks: built
one rank at a time, as they once were, a ``tp=8`` target read every such
tensor eight times (``tenplex reshard`` of a 443 MB store to ``tp=8
--format megatron-legacy`` read 1.00 GB).

:class:`SiblingLeaves` builds a leaf for every sibling rank that holds it in
one executor call (one read of the union of their byte ranges) and keeps
the siblings' tensors until their writers ask for them. The writers write
sibling files at the same time and in the same leaf order (see
:func:`tp_siblings`), so a kept tensor waits about as long as one leaf takes
to write. What is kept is bounded (:data:`SHARE_BYTES`): past the bound the
oldest kept leaves are dropped (a leaf a sibling's writer never asks for, such
as a replicated norm that only ``tp`` rank 0 writes, goes that way), and a
rank whose leaf was dropped, or that does not fit, builds it alone, as before
(more reads, the same bytes out).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Iterable

from tenplex.ptree.config import ParallelConfig

__all__ = ["SiblingLeaves", "SHARE_BYTES", "tp_siblings", "Stopped"]

SHARE_BYTES = 256 << 20
"""Bytes of siblings' leaves kept for their writers at most (256 MiB)."""


class Stopped(Exception):
    """Raised to a sibling's writer after another writer of its group failed (:meth:`SiblingLeaves.stop`);
    the caller reports that writer's error, not this."""


def tp_siblings(to: ParallelConfig, ranks: Iterable[int]) -> list[tuple[int, ...]]:
    """``ranks`` grouped by their coordinates other than ``tp`` and ``etp``, each group sorted,
    groups in the order of their first rank: the ranks whose files cut the same stored tensors
    differently (``tp_siblings(dp=1,tp=2,pp=2, range(4)) == [(0, 1), (2, 3)]``)."""
    groups: dict = {}
    for rank in sorted(ranks):
        groups.setdefault(to.coord(rank)._replace(tp=0, etp=0), []).append(rank)
    return [tuple(g) for g in groups.values()]


class SiblingLeaves:
    """Target leaves built once for a group of sibling ranks, each handed to its rank once.

    Args:
        runner: the store executor (:class:`tenplex.store.execute.StorePlanRunner`).
        to: the target config.
        limit: bytes of siblings' leaves kept at most (default: :data:`SHARE_BYTES` when made;
            0 builds every leaf for its own rank alone).

    Thread-safe: writers of different ranks call :meth:`get` from their own threads.
    """

    def __init__(self, runner, to: ParallelConfig, limit: int | None = None):
        self.runner, self.to = runner, to
        self.limit = SHARE_BYTES if limit is None else limit
        self._siblings: dict[int, tuple[int, ...]] = {}
        self._kept: OrderedDict = OrderedDict()  # (path, rank) -> (tensor, bytes), oldest first
        self._building: dict[tuple[str, int], Future] = {}
        self._held = 0  # bytes kept or reserved for a build under way
        self._served: set[tuple[str, int]] = set()  # handed out: never built for that rank again
        self._stopped = False
        self._lock = threading.Lock()

    def group(self, groups: Iterable[Iterable[int]]) -> None:
        """Declare sibling groups (each a set of ranks written at the same time), in place of the
        earlier ones, and undo :meth:`stop`; a rank in no group is built alone."""
        self._stopped = False
        self._siblings = {}
        for g in groups:
            members = tuple(sorted(g))
            for rank in members:
                self._siblings[rank] = members

    def group_of(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` is built with (itself alone where it has no group)."""
        return self._siblings.get(rank, (rank,))

    def _nbytes(self, path: str, rank: int) -> int:
        held = self.runner.D.holding(path, self.to.coord(rank))
        return 0 if held is None else held.numel * self.runner.tree[path].itemsize

    def get(self, path: str, rank: int):
        """Target ``rank``'s local tensor of ``path`` as the executor gives it (a tensor or a list
        of parts), or None where the rank holds no part of it.

        Raises:
            Stopped: after :meth:`stop`, until :meth:`clear`.
            Whatever the executor raises, in every sibling that waited for the build.
        """
        if self._stopped:
            raise Stopped(f"{path} for target rank {rank}: not built, a sibling file's writer failed")
        siblings = self._siblings.get(rank, ())
        if len(siblings) < 2:
            return self.runner.leaf(path, [rank]).get(rank)
        with self._lock:
            self._served.add((path, rank))
            kept = self._kept.pop((path, rank), None)
            if kept is not None:
                self._held -= kept[1]
                return kept[0]
            waiting = self._building.get((path, rank))
            if waiting is None:
                sizes = self._claim(path, rank, siblings)
                future = Future()
                for r in [rank, *sizes]:
                    self._building[(path, r)] = future
        if waiting is not None:
            waiting.result()
            with self._lock:
                kept = self._kept.pop((path, rank), None)
                if kept is not None:
                    self._held -= kept[1]
            # dropped to make room before this writer came for it: built alone
            return kept[0] if kept is not None else self.runner.leaf(path, [rank]).get(rank)
        return self._build(path, rank, sizes, future)

    def _claim(self, path: str, rank: int, siblings: tuple[int, ...]) -> dict[int, int]:
        """The siblings to build ``path`` for now besides ``rank``, with their bytes (reserved in
        :attr:`_held` until the build ends); under the lock.

        ``rank`` and the siblings not served yet (nor kept, nor being built), those after
        ``rank`` first (the writers run about in step), as many as the bound holds after
        dropping the oldest kept leaves: a leaf whose siblings' parts exceed the bound (a 70B
        model's ``linear_fc2`` at tp 8: 59 MB a rank) is read once per group that fits, not
        once per rank."""
        after = [r for r in siblings if r > rank] + [r for r in siblings if r < rank]
        sizes = {r: self._nbytes(path, r) for r in after if (path, r) not in self._served
                 and (path, r) not in self._kept and (path, r) not in self._building}
        others = [r for r in after if sizes.get(r)]
        wanted = sum(sizes[r] for r in others)
        while self._kept and self._held + wanted > self.limit:  # the oldest kept leaves go first
            _, (_, nbytes) = self._kept.popitem(last=False)
            self._held -= nbytes
        chosen: dict[int, int] = {}
        for r in others:
            if self._held + sizes[r] > self.limit:
                break
            chosen[r] = sizes[r]
            self._held += sizes[r]
        return chosen

    def _build(self, path: str, rank: int, others: dict[int, int], future: Future):
        """Build ``path`` for ``rank`` and ``others`` (``{rank: bytes}`` from :meth:`_claim`) and
        keep the others' tensors; their reservation becomes what is kept."""
        try:
            got = self.runner.leaf(path, [rank, *others])
        except BaseException as exc:
            with self._lock:
                self._held -= sum(others.values())
                for r in [rank, *others]:
                    self._building.pop((path, r), None)
            future.set_exception(exc)
            raise
        with self._lock:
            self._building.pop((path, rank), None)
            for r, nbytes in others.items():
                self._building.pop((path, r), None)
                self._kept[(path, r)] = (got.get(r), nbytes)  # already counted in _held
        future.set_result(None)
        return got.get(rank)

    def stop(self) -> None:
        """Make every later :meth:`get` raise :class:`Stopped` until the next :meth:`group`: a
        writer failed, and its siblings stop at their next leaf instead of finishing their files
        (so do the builds they had queued, which may run after :meth:`clear`)."""
        self._stopped = True

    def clear(self) -> None:
        """Drop every kept leaf (a writer that stopped early leaves its siblings' leaves behind)."""
        with self._lock:
            self._kept.clear()
            self._served.clear()
            self._held = 0



"""Host-local snapshots of a megatron-core job, and recovery from them after torchrun's restart.

:class:`Snapshots` wraps :class:`tenplex.Snapshotter` around
:func:`~tenplex_megatron.live.state.export_state`; :func:`recover_from_snapshots`
wraps :func:`tenplex.recover_from_snapshots` and rebuilds the job (``parallel_state``,
``build``, :func:`~tenplex_megatron.live.state.import_state`) at the new config.

The snapshot holds the state in the tree ``spec.tree(config)``; recovery plans
with ``spec.tree(old, new)``. Where megatron-core's buffers at the two configs
need another description of the distributed optimizer's buckets than at
``config`` alone, the snapshot's entries do not match it and recovery raises
``CorruptShardError`` (nothing is read wrongly): load the checkpoint then.
"""

from __future__ import annotations

import time
from typing import Callable

from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.live.change import Parts, _resume
from tenplex_megatron.live.recover import Recovered
from tenplex_megatron.live.spec import LiveSpec
from tenplex_megatron.live.state import export_state

__all__ = ["Snapshots", "recover_from_snapshots"]


class Snapshots:
    """Snapshots of this rank's live state into host-local shared memory.

    Args:
        spec: the job's :class:`LiveSpec`.
        config: the config the job runs at.
        rank: this process's rank (default: its rank in the default group).
        root, job: as :class:`tenplex.Snapshotter` (default ``$TENPLEX_SNAPSHOT_DIR``
            or ``/dev/shm/tenplex``).
    """

    def __init__(self, spec: LiveSpec, config: ParallelConfig, rank: int | None = None, *,
                 root: str | None = None, job: str = "job"):
        import torch.distributed as dist

        from tenplex.snapshot import Snapshotter

        self.spec, self.config = spec, config
        self.tree = spec.tree(config)
        rank = dist.get_rank() if rank is None else rank
        self._snaps = Snapshotter(self.tree, config, rank, root=root, job=job)

    def save(self, parts: Parts, *, consumed_samples: int, step: int) -> None:
        """Export this rank's state and start copying it (returns at once; :meth:`wait` before
        ``optimizer.step()``)."""
        state = export_state(*parts, spec=self.spec, consumed_samples=consumed_samples, tree=self.tree)
        self._snaps.save(state, step)

    def wait(self) -> None:
        """Block until the snapshot in flight is whole (``StoreError`` if it failed)."""
        self._snaps.wait()


def recover_from_snapshots(build: Callable[[ParallelConfig], tuple], *, spec: LiveSpec, new: ParallelConfig,
                           seed: int, store: str | None = None, root: str | None = None,
                           job: str = "job") -> Recovered:
    """After torchrun's restart: the job at ``new`` from the surviving hosts' snapshots.

    Every process of the restarted job calls it, with the default group up
    (``torch.distributed.init_process_group``); process ``p`` takes rank ``p``
    of ``new``. Only what no surviving snapshot holds is read from ``store``
    (the last :func:`~tenplex_megatron.live.recover.save_checkpoint`), and only
    if it is of the snapshots' step; otherwise every rank loads ``store``.

    Returns:
        :class:`Recovered` (``rolled_back_to``: the checkpoint's step if every
        rank loaded it); ``parts`` is ``None`` on a process without a rank of ``new``.
    """
    import tenplex

    start = time.perf_counter()
    done = tenplex.recover_from_snapshots(lambda old: spec.tree(old, new), new, root=root, job=job,
                                          store=store)
    rolled_back = done.step if done.rolled_back else None
    if done.state is None:
        return Recovered(None, None, done.report, time.perf_counter() - start, rolled_back)
    tree = spec.tree(done.old, new) if done.old is not None else spec.tree(new)
    resumed = _resume(done.state, build, spec, new, seed, tree, done.report, start)
    return Recovered(resumed.parts, resumed.imported, done.report, resumed.seconds, rolled_back)

"""Process groups for a job whose world changes, and megatron-core's parallel state on top.

megatron-core's ``parallel_state.initialize_model_parallel`` takes the whole
default process group as the world (``world_size = tp * pp * dp``), so a
change of world size needs a new default group. :class:`Membership` re-forms
it through one key-value store that outlives every group (torchrun's agent
store): the job's processes are numbered once (``process``, torchrun's first
``RANK``); a config of world size ``W`` runs on processes ``0 .. W-1``
(process ``p`` holds rank ``p``), or on the processes a live change chose
to keep the most bytes in place, in its order (``form(W, order=...)``),
and the others are parked until a later config needs them. Every process calls :meth:`Membership.form` at the same
points. Unnamed groups are numbered by generation; a process that joins late
(a replacement, a newcomer) learns the generation from process 0's
announcements in the store, so every group is named the same on every
process, whoever joined when (see :meth:`Membership.form`).
"""

from __future__ import annotations

import datetime
import json
import os

import torch

from tenplex.transform.assign import import_solvers

__all__ = ["Membership", "init_parallel_state", "destroy_parallel_state"]

_KEYS = "tenplex/membership"
"""Store keys of the group announcements (``enter/g``: its size, ``formed/g``, ``generation``)."""


class Membership:
    """The default process group over a changing set of the job's processes.

    Args:
        store: a ``torch.distributed.Store`` every process can reach for the
            job's whole life.
        process: this process's number, ``0 <= process < processes``.
        backend: the backend of every group (``"gloo"``; ``"nccl"`` on GPUs).
        timeout: the groups' timeout.
    """

    def __init__(self, store, process: int, *, backend: str = "gloo",
                 timeout: datetime.timedelta = datetime.timedelta(minutes=5)):
        self.store, self.process, self.backend, self.timeout = store, process, backend, timeout
        self.generation: int | None = None   # unnamed groups formed; None until known (see form)
        self.size = 0
        self.members: list[int] = []   # the last group's processes, in rank order (known: formed it)
        self.rank: int | None = None   # this process's rank in it (None: parked)
        import_solvers()  # at start, not in the first renumbered change

    @classmethod
    def from_env(cls, **kwargs) -> "Membership":
        """Under torchrun: this process is ``RANK``; the store is torchrun's agent store
        (``MASTER_ADDR:MASTER_PORT``), hosted by the agent, so no worker has to stay.

        The agent's store outlives torchrun's restarts, so its keys are
        prefixed with ``TORCHELASTIC_RESTART_COUNT``: restarted workers start
        afresh."""
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=not agent and rank == 0, wait_for_workers=False,
                              timeout=kwargs.get("timeout", datetime.timedelta(minutes=5)))
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"tenplex/restart-{restart}", store), rank, **kwargs)

    def leave(self, *, abort: bool = False) -> None:
        """Leave the current default group.

        Args:
            abort: after a peer failed, close the connections of every group
                this process is in (the default group and all its subgroups,
                through :meth:`tenplex.transform.comm.TorchComm.abort`), so that
                peers blocked on this process fail now instead of at the groups'
                timeout. Needed with megatron-core's DDP: its gradient hooks hold
                the model, and so its groups, in a reference cycle through
                autograd that Python's garbage collector cannot free. Only
                after a failure: a healthy peer may still be finishing its last
                collective.
        """
        import gc

        import torch.distributed as dist

        if dist.is_initialized():
            if abort:
                _abort_all()
            dist.destroy_process_group()
        gc.collect()
        self.size = 0
        self.rank = None

    def form(self, size: int, name: str | None = None, order: list[int] | None = None) -> bool:
        """Leave the current default group; processes ``order`` (default ``0 .. size-1``) form
        a new one, process ``order[i]`` at rank ``i``.

        Every group is named the same on every process, whoever joined when:

        - an unnamed group is number ``g`` (its generation); process 0 announces
          each ``g`` and its members in the store (whether or not it is one of
          them), and a process that does not know the job's generation yet (a
          newcomer, or a replacement) takes the first announced group that needs it;
        - after any group is formed, its members go on from the highest
          generation any of them knew, so a replacement that met the survivors
          in a named group continues in step with them.

        Args:
            size: the new group's size.
            name: the group's name in the store (default: the next generation
                number); processes that meet on purpose, e.g. survivors and a
                replacement after a failure, pass the same name.
            order: the group's processes in rank order (``size`` distinct
                process numbers; the same on every process): a live change
                renumbered to keep the most bytes in place
                (``ReconfigureReport.dst_of``, see :func:`~tenplex_megatron.live.change`).

        Returns:
            Whether this process is in the new group (at rank :attr:`rank`).

        Raises:
            ValueError: ``order`` is not ``size`` distinct process numbers.
        """
        import torch.distributed as dist

        members = list(range(size)) if order is None else [int(p) for p in order]
        if len(members) != size or len(set(members)) != size or min(members, default=0) < 0:
            raise ValueError(f"Membership.form: order must be {size} distinct process numbers, "
                             f"found {order}")
        key = name
        if name is None:
            if self.generation is None and self.process != 0:
                if self.process not in members:
                    self.leave()
                    return False
                self.generation = self._announced() - 1
                members = json.loads(self.store.get(f"{_KEYS}/enter/{self.generation + 1}"))
            self.generation = (self.generation or 0) + 1
            key = str(self.generation)
            if self.process == 0:
                self.store.set(f"{_KEYS}/enter/{key}", json.dumps(members))
                self.store.set(f"{_KEYS}/generation", key)
        self.leave()
        self.size, self.members = size, members
        if self.process not in members:
            return False
        self.rank = members.index(self.process)
        group = dist.PrefixStore(f"tenplex/group/{key}", self.store)
        self._agree(group, size)
        dist.init_process_group(self.backend, store=group, rank=self.rank, world_size=size,
                                timeout=self.timeout)
        if name is None and self.rank == 0:
            self.store.set(f"{_KEYS}/formed/{key}", "1")
        return True

    def _announced(self) -> int:
        """The generation of the first unnamed group process 0 forms that needs this process.

        Groups already formed (``formed/g`` set) and groups this process is not
        a member of are skipped; the loop waits for process 0's next announcement.
        """
        g = int(self.store.get(f"{_KEYS}/generation")) if self.store.check([f"{_KEYS}/generation"]) else 1
        while True:
            self.store.wait([f"{_KEYS}/enter/{g}"], self.timeout)
            if self.process in json.loads(self.store.get(f"{_KEYS}/enter/{g}")) and \
                    not self.store.check([f"{_KEYS}/formed/{g}"]):
                return g
            g += 1

    def _agree(self, group, size: int) -> None:
        """Members of the group being formed go on from the highest generation any of them knew.

        A compare-and-set maximum in the group's store, then a barrier on it
        (one ``add`` per member, one key the last one sets), so every member
        reads the final value; O(1) store operations per process.
        """
        if self.generation is not None:
            while True:
                seen = group.get("generation").decode() if group.check(["generation"]) else ""
                if seen and int(seen) >= self.generation:
                    break
                if group.compare_set("generation", seen, str(self.generation)).decode() == str(self.generation):
                    break
        if group.add("arrived", 1) == size:
            group.set("ready", "1")
        group.wait(["ready"], self.timeout)
        if group.check(["generation"]):
            self.generation = int(group.get("generation"))


def _abort_all() -> None:
    """Close the connections of every process group of this process (see :meth:`Membership.leave`)."""
    import torch.distributed as dist
    from tenplex.transform.comm import TorchComm

    world = dist.group.WORLD
    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            if dist.get_world_size(pg) >= 2:
                TorchComm(None if pg is world else pg).abort()
        except Exception:   # a group this process is not in, or one already broken
            pass


def init_parallel_state(config, seed: int) -> None:
    """``parallel_state`` at ``config`` over the default group, seeded as Megatron-LM seeds a fresh run.

    ``megatron/training/initialize.py::_set_random_seed``: seed ``seed + 100 * pp_rank`` for
    torch's generator and ``model_parallel_cuda_manual_seed`` (the tracker's streams).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=config.tp,
                                 pipeline_model_parallel_size=config.pp)
    base = seed + 100 * ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(base)
    model_parallel_cuda_manual_seed(base)


def destroy_parallel_state() -> None:
    """Drop megatron-core's parallel state and every reference it keeps to a process group.

    megatron-core 0.16.1's ``destroy_model_parallel`` leaves some groups set
    (``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo twin,
    ``_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS``); a group kept alive keeps its
    connections open, and after a failure peers blocked on this process would
    wait for the timeout. So every module-level group left is dropped too.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    for name, value in list(vars(ps).items()):
        items = value if isinstance(value, (list, tuple)) else [value]
        if name.startswith("_") and items and all(isinstance(v, dist.ProcessGroup) for v in items):
            setattr(ps, name, None)

"""A small communicator over torch.distributed that also works in one process.

The executors talk to peers only through :class:`Comm`: batched
point-to-point transfers and an all-gather of small byte strings. With no
process group (:class:`LocalComm`), there are no peers, and the collectives
return this process's own data. As in PyTorch DCP's ``_DistWrapper``,
planner tests then need no processes.

Backend failures (a peer that died, a timeout) are translated at this
boundary into :class:`~tenplex.errors.TransferError`, which names this rank
and the peers involved.
"""

from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist

from tenplex.errors import TransferError

__all__ = ["Comm", "LocalComm", "TorchComm"]


class Comm:
    """The interface executors use. ``rank`` and ``size`` are this group's."""

    rank: int = 0
    size: int = 1

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Send each ``(peer, tensor)`` and fill each ``(peer, tensor)`` from its peer; all in flight at once."""
        self.start(sends, recvs)()

    def start(self, sends, recvs):
        """Post an exchange; returns ``wait()``, which blocks until it is done (and raises on failure)."""
        raise NotImplementedError

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class LocalComm(Comm):
    """One process, no peers."""

    def start(self, sends, recvs):
        if sends or recvs:
            raise TransferError("LocalComm: a single process has no peers to exchange with")
        return lambda: None

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]

    def barrier(self) -> None:
        pass


class TorchComm(Comm):
    """torch.distributed point-to-point (gloo on CPU, NCCL on GPU) over ``group``.

    Args:
        group: the process group (default: the world).
        device: where transfer buffers live (``cpu`` for gloo, ``cuda`` for NCCL).
    """

    def __init__(self, group=None, device: str | torch.device = "cpu"):
        if not dist.is_initialized():
            raise TransferError("TorchComm: torch.distributed is not initialized")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = torch.device(device)

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def start(self, sends, recvs):
        ops = [dist.P2POp(dist.isend, t, self._global(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group) for p, t in recvs]
        if not ops:
            return lambda: None
        peers = sorted({p for p, _ in sends} | {p for p, _ in recvs})
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses on peer failure
            raise self._failed(peers, exc) from exc

        def wait() -> None:
            try:
                for work in works:
                    work.wait()
            except Exception as exc:
                raise self._failed(peers, exc) from exc
        return wait

    def _failed(self, peers, exc) -> TransferError:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return TransferError(f"rank {self.rank}: transfer with peers {peers} failed: {text}")

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        try:
            size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            sizes = [torch.zeros_like(size) for _ in range(self.size)]
            dist.all_gather(sizes, size, group=self.group)
            longest = max(int(s.item()) for s in sizes)
            buf = torch.zeros(longest, dtype=torch.uint8, device=self.device)
            if data:
                buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            bufs = [torch.zeros_like(buf) for _ in range(self.size)]
            dist.all_gather(bufs, buf, group=self.group)
        except Exception as exc:
            raise TransferError(f"rank {self.rank}: all-gather failed: "
                                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
        return [bytes(b[: int(s.item())].cpu().numpy()) for b, s in zip(bufs, sizes)]

    def barrier(self) -> None:
        try:
            dist.barrier(group=self.group)
        except Exception as exc:
            raise TransferError(f"rank {self.rank}: barrier failed: {exc}") from exc


def default_timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)

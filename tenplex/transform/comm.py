"""A small communicator over torch.distributed that also works in one process.

The executors talk to peers only through :class:`Comm`:

- the data plane: batched point-to-point transfers (:meth:`Comm.start`);
- the control plane: a key-value store shared by every process of the
  group (:attr:`Comm.store`, the job's ``torch.distributed`` store), which
  :class:`~tenplex.transform.guard.TransferGuard` uses to agree, to confirm
  and to fail together with bounded waits;
- an all-gather of small byte strings and a barrier over the process group
  (plain collectives, unguarded).

With no process group (:class:`LocalComm`), there are no peers, and the
collectives return this process's own data. As in PyTorch DCP's
``_DistWrapper``, planner tests then need no processes.

Backend failures (a peer that died, a timeout) are translated at this
boundary into :class:`~tenplex.errors.TransferError`, which names this rank
and the peers involved.
"""

from __future__ import annotations

import datetime
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from tenplex.errors import TransferError

__all__ = ["Comm", "LocalComm", "TorchComm"]

ABORT_TAG = 0x7E4A
"""The first tag of the receives :meth:`TorchComm.abort` times out on, one per gloo device (never sent)."""

PART_BYTES = 4 << 20
"""Smallest part (bytes) a message is cut into on a gloo group of several devices."""

Wait = Callable[[], None]
"""``wait()`` blocks until a posted exchange is done, and raises TransferError if it failed."""


class Comm:
    """The interface executors use.

    Attributes:
        rank, size: this process's rank in the group, and the group's size.
        store: the group's ``torch.distributed`` key-value store (a
            ``c10d.Store``), or ``None`` when there are no peers.
        name: a name unique to the group, under which store keys live.
    """

    rank: int = 0
    size: int = 1
    store = None
    name: str = "local"

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Send each ``(peer, tensor)`` and fill each ``(peer, tensor)`` from its peer; all in flight at once."""
        self.start(sends, recvs)()

    def start(self, sends: Sequence[tuple[int, torch.Tensor]],
              recvs: Sequence[tuple[int, torch.Tensor]]) -> Wait:
        """Post an exchange; returns ``wait()``, which blocks until it is done (and raises on failure).

        Raises:
            TransferError: the backend refused to post (e.g. a peer is gone).
        """
        raise NotImplementedError

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (a plain collective: it blocks on a failed peer
        until the backend's timeout; guarded transfers gather through the store instead)."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Block until every rank calls it (a plain collective, like :meth:`all_gather_bytes`)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Make every point-to-point operation still in flight on this process fail at once.

        Called after a failed transfer: a wait blocked on a peer that will
        never send would otherwise last until the backend's timeout, and a
        process exiting with such a wait open is killed by the C++ runtime.
        The process group is unusable afterwards. Does nothing here.
        """

    def _on_phase(self, phase: str) -> None:
        """Called by :class:`~tenplex.transform.guard.TransferGuard` as a transfer enters each phase.

        Private: a test worker overrides it to inject faults (raise, or kill
        the process) at a chosen phase. Does nothing here.
        """


class LocalComm(Comm):
    """One process, no peers."""

    def start(self, sends, recvs) -> Wait:
        if sends or recvs:
            peers = sorted({p for p, _ in sends} | {p for p, _ in recvs})
            raise TransferError(f"LocalComm: a single process has no peers; asked to exchange with {peers}")
        return lambda: None

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def barrier(self) -> None:
        pass


class TorchComm(Comm):
    """torch.distributed point-to-point (gloo on CPU, NCCL on GPU) over ``group``.

    Args:
        group: the process group (default: the world).
        device: where transfer buffers live (``cpu`` for gloo, ``cuda`` for NCCL).
        store: the control-plane store every process of ``group`` can reach;
            default the one ``torch.distributed.init_process_group`` set up
            (torchrun's rendezvous store).

    On a gloo group of several devices (``GLOO_SOCKET_IFNAME=eth0,eth0,...``:
    one TCP connection per pair per device, each served by its own thread),
    a message of at least ``2 * PART_BYTES`` goes as up to one part per device,
    part ``k`` with tag ``k``: torch's ``ProcessGroupGloo`` sends a message with
    tag ``t`` over device ``t % devices``. Sender and receiver cut a message of
    the same size alike, and every process of a gloo group has the same
    devices (gloo connects each device's full mesh when the group is made).
    ``bench/gloo_channels.py``: 2.2 to 2.7 times the bytes per second with 4
    devices on a 16-core host.

    Attributes:
        devices: the gloo devices of ``group`` (1 for another backend, or where
            torch does not say).

    Raises:
        TransferError: torch.distributed is not initialized.
    """

    def __init__(self, group=None, device: str | torch.device = "cpu", store=None):
        if not dist.is_initialized():
            raise TransferError("TorchComm: torch.distributed is not initialized")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = torch.device(device)
        pg = group if group is not None else dist.group.WORLD
        self.name = f"pg-{pg.group_name}"
        if store is None:  # torch < 2.6 has no public accessor: the default (rendezvous) store
            get = getattr(pg, "get_group_store", None)
            store = get() if get is not None else dist.distributed_c10d._get_default_store()
        self.store = store
        self.devices = _gloo_devices(pg) if self.device.type == "cpu" else 1

    def _parts(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor`` as the parts it travels in (see the class): byte views, or itself whole."""
        nbytes = tensor.numel() * tensor.element_size()
        count = min(self.devices, nbytes // PART_BYTES)
        if count < 2 or not tensor.is_contiguous():  # gloo refuses a non-contiguous tensor anyway
            return [tensor]
        return list(tensor.reshape(-1).view(torch.uint8).chunk(count))

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def start(self, sends, recvs) -> Wait:
        ops = [dist.P2POp(dist.isend, part, self._global(p), self.group, tag=tag)
               for p, t in sends for tag, part in enumerate(self._parts(t))]
        ops += [dist.P2POp(dist.irecv, part, self._global(p), self.group, tag=tag)
                for p, t in recvs for tag, part in enumerate(self._parts(t))]
        if not ops:
            return lambda: None
        peers = sorted({p for p, _ in sends} | {p for p, _ in recvs})
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses on peer failure
            raise self._failed(peers, exc) from exc
        cuda = self.device.type == "cuda"

        def wait() -> None:
            try:
                for work in works:
                    work.wait()
                if cuda:  # NCCL's wait() only orders streams: block until the bytes have landed
                    torch.cuda.current_stream(self.device).synchronize()
            except Exception as exc:
                raise self._failed(peers, exc) from exc
        return wait

    def abort(self) -> None:
        """gloo: a timed-out wait makes gloo close every connection of the group's device it
        was posted on (its own "application timeout" path), so every operation in flight there
        fails at once, here and at the peers; one such wait per device (tags ``ABORT_TAG + k``
        land on device ``(ABORT_TAG + k) % devices``). Other backends: ``ProcessGroup.abort()``
        (NCCL: ncclCommAbort; untested here)."""
        if self.size < 2:
            return
        pg = self.group if self.group is not None else dist.group.WORLD
        try:
            if dist.get_backend(self.group) != "gloo":
                pg.abort()
                return
        except Exception:  # a group already broken: nothing is left in flight
            return
        for k in range(self.devices):
            try:
                probe = torch.empty(1, dtype=torch.uint8)
                work = dist.irecv(probe, src=self._global((self.rank + 1) % self.size), group=self.group,
                                  tag=ABORT_TAG + k)
                work.wait(datetime.timedelta(milliseconds=1))
            except Exception:  # the expected timeout (or a device already broken)
                pass

    def _failed(self, peers, exc) -> TransferError:
        return TransferError(f"process {self.rank}: transfer with peers {peers} failed: {first_line(exc)}")

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
            raise TransferError(f"process {self.rank}: all-gather failed: {first_line(exc)}") from exc
        return [bytes(b[: int(s.item())].cpu().numpy()) for b, s in zip(bufs, sizes)]

    def barrier(self) -> None:
        try:
            dist.barrier(group=self.group)
        except Exception as exc:
            raise TransferError(f"process {self.rank}: barrier failed: {first_line(exc)}") from exc


def first_line(exc: BaseException) -> str:
    """``exc``'s type and the first line of its message (backend errors append stack dumps)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line[:300]}" if line else type(exc).__name__


def _gloo_devices(pg) -> int:
    """The devices of gloo group ``pg`` (its ``ProcessGroupGloo`` options), else 1."""
    try:
        backend = pg._get_backend(torch.device("cpu"))
        if not isinstance(backend, dist.ProcessGroupGloo):
            return 1
        return max(1, len(backend.options._devices))
    except (AttributeError, RuntimeError, TypeError):  # another backend, or a torch that does not say
        return 1

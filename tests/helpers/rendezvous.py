"""Process groups for multi-process tests without a port picked in advance; free ports.

A free port chosen by the test and bound later by process 0 can be taken by
another job in between (EADDRINUSE). Here process 0 hosts the TCP store on a
port the kernel assigns, and tells the others through a file.
"""

import datetime
import os
import socket
import time

import torch.distributed as dist


def init_group(rank: int, world: int, rendezvous: str, timeout: float = 120) -> None:
    """``init_process_group("gloo")`` for ``rank`` of ``world``; ``rendezvous`` is a file path
    (not yet existing) that every process is given."""
    delta = datetime.timedelta(seconds=timeout)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=delta,
                              wait_for_workers=False)
        with open(rendezvous + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(rendezvous + ".tmp", rendezvous)
    else:
        deadline = time.time() + timeout
        while not os.path.exists(rendezvous):
            if time.time() > deadline:
                raise TimeoutError(f"process 0 never published {rendezvous}")
            time.sleep(0.05)
        with open(rendezvous) as f:
            port = int(f.read())
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=delta)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=delta)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers that cannot take port 0,
    or a ``TCPStore`` one process binds before the others start; see the race above)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

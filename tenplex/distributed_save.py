"""Save a running job's state to one checkpoint, each rank writing its own shards.

:func:`save_distributed` is the save half of an elastic restart: the old
workers save before they exit, and the new workers :func:`tenplex.load`
only the byte ranges they need. It runs inside a
:class:`~tenplex.transform.guard.TransferGuard`, so a failure on any process
fails the save on every process within ``timeout``, and nothing is committed.

The store must be one every new worker can read: a shared filesystem or an
object store (``s3://``). Before committing, process 0 checks that every
shard file exists with its recorded size at the URL the manifest will name:
with per-host directories (``/dev/shm`` on several hosts), the files of the
other hosts are missing there, and the save fails instead of committing a
manifest that points at files no one can find.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from tenplex.errors import AlreadyExistsError, CorruptShardError, PlanError, bounded_entry
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.ptree.tree import PTree, Scope
from tenplex.store.blocks import DEFAULT_BLOCK
from tenplex.store.gathered import commit_gathered, records_from_json, remove_token_files
from tenplex.store.writer import StoreWriter
from tenplex.transform.agree import check_local_state, check_same_inputs, local_problems, tree_digest
from tenplex.transform.comm import Comm, LocalComm, TorchComm
from tenplex.transform.guard import DEFAULT_TIMEOUT, TransferGuard

__all__ = ["save_distributed"]


@bounded_entry("url")
def save_distributed(local_state: dict[str, Any], tree: PTree, config: ParallelConfig, url: str, *,
                     rank: int | None = None, group=None, comm: Comm | None = None,
                     storage_options: dict | None = None, block: int = DEFAULT_BLOCK,
                     timeout: float = DEFAULT_TIMEOUT) -> None:
    """Save every rank's state to one checkpoint at ``url``, each process writing its own rank's shards.

    Call it on every process of the group, one process per rank of
    ``config``. Each replicated region is written once, by the lowest rank
    holding it. Process 0 commits the manifest after every process has
    written and it has found every file at ``url``.

    Args:
        local_state: this process's ``{path: local tensor or value}`` under
            ``config`` (tensors on any device; they are copied to the host).
        tree: the tree spec (the same everywhere).
        config: the config the state is laid out for; its world size is the group's.
        url: the checkpoint's URL, the same on every process, naming one store
            that every process (and every new worker) can read: a shared
            filesystem or ``s3://``.
        rank: this process's rank under ``config`` (default: its rank in the group).
        group, comm: the process group, or a communicator.
        storage_options: fsspec options.
        block: checksum block size in bytes.
        timeout: seconds a process may stay silent before the save fails everywhere.

    Raises:
        PlanError: the processes' ranks are not one per rank of ``config``,
            or they were called with different arguments; on every process.
        ShardError: a local state does not match the tree; on every process.
        AlreadyExistsError: ``url`` holds a committed checkpoint; on every process.
        CorruptShardError: a shard file is missing or has another size at
            ``url`` as process 0 sees it (the processes do not share one
            store); on every process, and nothing is committed.
        TransferError: a process failed, died or timed out; nothing is committed.
    """
    comm = _comm(group, comm)
    rank = comm.rank if rank is None else rank
    what = "save_distributed"
    with TransferGuard(comm, timeout=timeout, what=what) as guard:
        guard.phase("agree")
        problems = local_problems(tree, Sharding(tree, config), rank, local_state, None) \
            if isinstance(rank, int) and 0 <= rank < config.world_size else []
        inputs = {"config": config.to_json(), "tree": tree_digest(tree), "block": block}
        blob = {"rank": rank, "problems": problems, "inputs": inputs}
        everyone = [json.loads(b) for b in guard.gather("agree", json.dumps(blob).encode())]
        with guard.agreeing():  # every process holds `everyone`: the same error everywhere
            check_same_inputs(what, everyone)
            ranks = [e["rank"] for e in everyone]
            if sorted(ranks) != list(range(config.world_size)):
                raise PlanError(f"{what}: the processes hold ranks {ranks}; {config} needs each of "
                                f"0..{config.world_size - 1} exactly once")
            check_local_state(what, everyone, [f"process {p} (rank {r})" for p, r in enumerate(ranks)])
        writer = _open(guard, comm, url, tree, config, storage_options, block)
        guard.phase("write")
        try:
            for path, _, _ in writer.entries().get(rank, []):
                writer.write(rank, path, local_state[path].detach().cpu())
            records = {k: asdict(v) for k, v in writer.records().items()}
            values = {p: local_state.get(p) for p, _ in tree.values()}
            blob = json.dumps({"rank": rank, "records": records, "values": values}).encode()
            written = [json.loads(b) for b in guard.gather("written", blob)]
        except BaseException:  # before every process has written, process 0 cannot have committed
            _remove_own(writer, rank)
            raise
        guard.phase("confirm")
        error = _commit(writer, tree, config, written) if comm.rank == 0 else None
        error = json.loads(guard.gather("committed", json.dumps(error).encode())[0])
        if error is not None:
            with guard.agreeing():
                _remove_own(writer, rank)
                raise CorruptShardError(error)


def _comm(group, comm: Comm | None) -> Comm:
    if comm is not None:
        return comm
    import torch.distributed as dist
    return TorchComm(group) if dist.is_initialized() else LocalComm()


def _open(guard: TransferGuard, comm: Comm, url, tree, config, storage_options, block) -> StoreWriter:
    """Process 0 refuses a committed ``url`` and clears leftovers; then every process opens a writer."""
    exists = None
    writer = None
    if comm.rank == 0:
        try:
            writer = StoreWriter(url, tree, config, storage_options=storage_options, block=block,
                                 clear=True)
        except AlreadyExistsError as exc:
            exists = str(exc)
    exists = json.loads(guard.gather("cleared", json.dumps(exists).encode())[0])
    if exists is not None:
        with guard.agreeing():
            raise AlreadyExistsError(exists)
    if writer is None:
        writer = StoreWriter(url, tree, config, storage_options=storage_options, block=block,
                             clear=False)
    return writer


def _commit(writer: StoreWriter, tree: PTree, config: ParallelConfig, written: list[dict]) -> str | None:
    """Check every file at the URL the manifest names, then commit; the error, if any (process 0)."""
    records = {}
    for item in written:
        records.update(records_from_json(item["records"]))
    stored = {}
    by_rank = {item["rank"]: item["values"] for item in written}
    for path, leaf in tree.values():
        if leaf.scope is Scope.GLOBAL:
            stored[path] = by_rank[0][path]
        else:
            stored[path] = {leaf.key(config, r): v[path] for r, v in sorted(by_rank.items())}
    return commit_gathered(writer, records, stored, "save_distributed")


def _remove_own(writer: StoreWriter, rank: int) -> None:
    """Remove the shard file this process wrote (nothing was committed)."""
    remove_token_files(writer, [rank])

"""Reshard one checkpoint with many processes (torchrun, Slurm): split files, one commit, fail together.

``torchrun --nproc_per_node=K -m tenplex reshard SRC DST --to ...`` runs
:func:`reshard_distributed` on every process. Each process opens the source
in place (or, for a format that shares an opened source, process 0 opens it
and the others rebuild it from its JSON form: :func:`open_source`; a tenplex
store's other processes check only the files they read); the
target's shard files are split across the processes by bytes
(:func:`tenplex.store.split.split_files`: ranks holding the same tensors stay
on one process, so their shared source blocks are read once); each process
plans the ops of its own files only (``make_plan(..., ranks=)``: op for op the
whole plan's, at a cost that follows its share, not the target's world size),
streams its files from the byte ranges they need and fsyncs them; the
processes report their files' sizes and digests, and process 0 commits the
manifest once, with every target rank's values (:func:`~tenplex.transform.planner.value_ops`)
(:func:`tenplex.store.gathered.commit_gathered`, the commit of
:func:`tenplex.save_distributed`).

Only metadata travels between processes, through the job's key-value store
(torchrun's rendezvous store), inside a
:class:`~tenplex.transform.guard.TransferGuard`:

- an exception on any process reaches every process within about a beat
  (``timeout / 8``, at most 1 s), and each exits with the same message,
  naming the process, its phase and its error;
- a process that dies (SIGKILL) is noticed by torchrun's agent, which stops
  the others with SIGTERM (within its ``--monitor-interval``); the SIGTERM
  becomes an exception here (see :func:`stop_on_sigterm`). Without an agent
  (``srun`` launching every process), the dead process's watcher declares it
  failed after ``timeout`` seconds of silence.

Nothing is committed after a failure: each process removes the files it
wrote, and process 0 also removes those of the others (one token names
every file of the run), so a rerun at ``dst`` starts clean.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from tenplex.errors import AlreadyExistsError, ConfigError, CorruptShardError, TransferError
from tenplex.formats import TENPLEX, detect, get_format
from tenplex.formats.protocol import padding_lines, source_notes
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.sharding import Sharding
from tenplex.store.blocks import DEFAULT_BLOCK
from tenplex.store.execute import StorePlanRunner, target_values
from tenplex.store.hostcache import HostBlockCache, edge_blocks
from tenplex.store.gathered import commit_gathered, records_from_json, remove_token_files
from tenplex.store.split import split_files
from tenplex.store.stream import MAX_OPEN_FILES, stream_targets
from tenplex.store.writer import StoreWriter
from tenplex.transform.agree import check_same_inputs, tree_digest
from tenplex.distributed_parts import ProcessStats, _Counter, _watch, reshard_parts
from tenplex.transform.comm import Comm, TorchComm
from tenplex.transform.guard import TransferGuard
from tenplex.transform.plan import FILL_CODE
from tenplex.transform.planner import make_plan, value_ops

__all__ = ["under_torchrun", "init_group", "stop_on_sigterm", "reshard_distributed", "open_source",
           "DistributedReshardReport", "ProcessStats", "RESHARD_TIMEOUT"]

RESHARD_TIMEOUT = 30.0
"""Seconds a process may stay silent before the reshard fails on every process."""

WHAT = "reshard"

HOST_FOLDER = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
"""Where the processes of one host share edge blocks (a folder per run, removed at the end)."""


def under_torchrun() -> bool:
    """True when the environment names a process of a group of more than one (WORLD_SIZE, RANK, LOCAL_RANK)."""
    try:
        return all(k in os.environ for k in ("RANK", "LOCAL_RANK")) and int(os.environ["WORLD_SIZE"]) > 1
    except (KeyError, ValueError):
        return False


def init_group(timeout: float = 600.0) -> Comm:
    """A gloo process group from the environment (``env://``), and its communicator.

    Args:
        timeout: seconds gloo and the store may wait for a peer.
    """
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    return TorchComm()


def stop_on_sigterm(rank: int) -> None:
    """Turn SIGTERM (how torchrun stops the other workers when one fails) into a TransferError.

    The exception unwinds the reshard, so this process removes its files and
    exits non-zero; call it from the main thread.
    """
    def handler(signum, frame):
        raise TransferError(f"{WHAT}: process {rank} was stopped by SIGTERM (torchrun stops every "
                            "worker when one fails; see its summary for the process that failed first)")
    signal.signal(signal.SIGTERM, handler)


@dataclass(frozen=True)
class DistributedReshardReport:
    """A reshard run by several processes (the same on every process).

    Attributes:
        src_format, format: the source's and the target's format names.
        src, dst: the source's and the target's configs.
        processes: one :class:`ProcessStats` per process.
        files: target files written.
        seconds: wall time on this process, to the commit.
        padding: one line per padded axis whose padded length changed, as the
            single-process :func:`tenplex.reshard` reports them.
        notes: remarks for the user (what the target format dropped or derived):
            every process's, each line once, in process order.
    """

    src_format: str
    format: str
    src: ParallelConfig
    dst: ParallelConfig
    processes: list[ProcessStats]
    files: int
    seconds: float
    padding: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def bytes_read(self) -> int:
        return sum(p.bytes_read for p in self.processes)

    @property
    def bytes_needed(self) -> int:
        return sum(p.bytes_needed for p in self.processes)

    @property
    def bytes_written(self) -> int:
        return sum(p.bytes_written for p in self.processes)

    def to_json(self) -> dict:
        """The report as JSON: totals, and per process bytes and seconds."""
        return {"src_format": self.src_format, "format": self.format, "src": str(self.src),
                "dst": str(self.dst), "files": self.files, "seconds": self.seconds,
                "bytes_read": self.bytes_read, "bytes_needed": self.bytes_needed,
                "bytes_written": self.bytes_written, "padding": list(self.padding),
                "notes": list(self.notes), "processes": [asdict(p) for p in self.processes]}


def reshard_distributed(src: str, dst: str, to: ParallelConfig, *, comm: Comm, format: str | None = None,
                        storage_options: dict | None = None, threads: int = 4, block: int = DEFAULT_BLOCK,
                        max_open_files: int = MAX_OPEN_FILES, progress=None,
                        timeout: float = RESHARD_TIMEOUT, **options) -> DistributedReshardReport:
    """Reshard ``src`` to ``to`` at ``dst`` with every process of ``comm``; call it on each of them.

    The target is a tenplex store, or any format that writes in parts
    (``parts = True``: megatron-legacy, megatron-dist, hf; see
    :mod:`tenplex.formats.protocol` and :func:`tenplex.distributed_parts.reshard_parts`);
    the source may be any installed format.
    ``src``, ``dst`` and the store must be reachable by every process (a
    shared filesystem or an object store).

    Args:
        src, dst, to, format, storage_options, threads, block, max_open_files, options:
            as :func:`tenplex.reshard` (the same on every process).
        comm: the group (:func:`init_group`).
        progress: ``progress(done_bytes, total_bytes)`` on process 0, fed by every process's counts.
        timeout: seconds a process may stay silent before the reshard fails everywhere.

    Returns:
        The report, the same on every process.

    Raises:
        ConfigError: the target format does not write in parts.
        PlanError: the processes were called with different arguments.
        AlreadyExistsError: ``dst`` holds a committed checkpoint.
        CorruptShardError: a file is missing at ``dst`` as process 0 sees it (no shared store).
        TransferError: a process failed, died or timed out; nothing is committed.
    """
    start = time.perf_counter()
    src_fmt = detect(src)
    out_fmt = get_format(format) if format else src_fmt
    if out_fmt.name != TENPLEX and not getattr(out_fmt, "parts", False):
        raise ConfigError(f"{WHAT} under torchrun: target format {out_fmt.name!r} cannot be written by "
                          f"several processes (it does not write in parts); expected a format that "
                          f"does, such as --format {TENPLEX}, or run in one process")
    opts = {**options, "storage_options": storage_options, "threads": threads}
    args = {"src": src, "dst": dst, "to": to.to_json(), "format": out_fmt.name, "block": block,
            "options": {k: v for k, v in sorted(options.items()) if isinstance(v, (str, int, float, bool))}}
    with TransferGuard(comm, timeout=timeout, what=WHAT) as guard:
        guard.phase("agree")
        source = open_source(guard, comm, src_fmt, src, opts, args)
        tree = source.tree
        inputs = {**args, "source": source.config.to_json(), "tree": tree_digest(tree)}
        everyone = [json.loads(b) for b in guard.gather("agree", json.dumps({"inputs": inputs}).encode())]
        with guard.agreeing():
            check_same_inputs(WHAT, everyone)
        if out_fmt.name != TENPLEX:
            stats, files, remarks = reshard_parts(guard, comm, out_fmt, source, dst, to, opts, progress,
                                                  start)
            return DistributedReshardReport(src_fmt.name, out_fmt.name, source.config, to, stats, files,
                                            time.perf_counter() - start, *remarks)
        target = Sharding(tree, to)
        writer = _open(guard, comm, dst, tree, to, source.meta, storage_options, block, target)
        mine = split_files(writer.entries(), comm.size, to)[comm.rank]
        # each process plans the ops of its own files only (the cost follows its share, not the world)
        plan = make_plan(tree, source.config, to, src_sharding=source.sharding, dst_sharding=target,
                         ranks=mine)
        _share_edges(source, plan, mine, writer.token)  # edge blocks: read once per host
        guard.phase("write")
        stats, written = _write(guard, comm, source, plan, writer, mine, threads, max_open_files,
                                progress, start)
        guard.phase("confirm")
        error = None
        if comm.rank == 0:
            records = {}
            for item in written:
                records.update(records_from_json(item["records"]))
            try:
                alive = set(range(source.config.world_size))
                every = replace(plan, values=value_ops(tree, source.config, to, alive))  # all ranks'
                error = commit_gathered(writer, records, target_values(tree, every, source), WHAT)
            except AlreadyExistsError as exc:
                error = str(exc)
        error = json.loads(guard.gather("committed", json.dumps(error).encode())[0])
        if error is not None:
            with guard.agreeing():
                _cleanup(writer, comm)
                raise CorruptShardError(error)
    return DistributedReshardReport(src_fmt.name, out_fmt.name, source.config, to, stats,
                                    sum(len(s.ranks) for s in stats), time.perf_counter() - start,
                                    padding_lines(plan.padding), source_notes(source))


def open_source(guard: TransferGuard, comm: Comm, fmt, src: str, opts: dict, args: dict):
    """The source, opened once by process 0 and shared where the format can (else by every process).

    A format with ``share``/``open_shared`` (:mod:`tenplex.formats.protocol`,
    "Sharing an opened source"): process 0 opens ``src`` and sends the
    source's JSON form to the others with its arguments (gather ``inputs``);
    every process checks that all were called with the same ``args``, then
    the others rebuild the source from it, reading none of its metadata.
    An error opening the source on process 0 stops every process (the
    guard's failure, naming process 0 and its error).

    Raises:
        PlanError: the processes were called with different arguments.
        TenplexError: as the format's ``open_source`` (on process 0) or ``open_shared``.
        TransferError: on the other processes, when process 0 failed to open the source.
    """
    if not hasattr(fmt, "open_shared"):
        return fmt.open_source(src, **opts)
    source, mine = None, {"args": args}
    if comm.rank == 0:  # an error opening it reaches the others through the guard, naming process 0
        source = fmt.open_source(src, **opts)
        mine["shared"] = fmt.share(source)
    everyone = [json.loads(b) for b in guard.gather("inputs", json.dumps(mine).encode())]
    with guard.agreeing():
        check_same_inputs(WHAT, everyone, "args")
    if source is None:  # an error here is this process's own: the guard tells the others
        source = fmt.open_shared(src, everyone[0]["shared"], **opts)
    return source


def _write(guard, comm, source, plan, writer, mine, threads, max_open_files, progress, start):
    """Write this process's files; every process's stats and records, in process order."""
    counter = _Counter(guard.store if guard.active else None)
    writer.progress = counter if guard.active else progress
    stop = threading.Event()
    watcher = None
    if comm.rank == 0 and progress is not None and guard.active:
        watcher = threading.Thread(target=_watch, args=(guard.store, writer.total, progress, stop),
                                   name="tenplex-progress", daemon=True)
        watcher.start()
    runner = StorePlanRunner(source, plan, threads, reuse=True, inline_local=True)
    host = getattr(source, "host_cache", None)
    try:
        stream_targets(runner, writer, threads=threads, max_open_files=max_open_files, ranks=mine)
        counter.flush()
        mine_stats = ProcessStats(comm.rank, mine, source.bytes_read, runner.bytes_needed,
                                  writer.bytes_written, time.perf_counter() - start,
                                  host.bytes_shared if host is not None else 0)
        records = {k: asdict(v) for k, v in writer.records().items()}
        blob = json.dumps({"stats": asdict(mine_stats), "records": records}).encode()
        written = [json.loads(b) for b in guard.gather("written", blob)]
    except BaseException:  # before every process has written, process 0 cannot have committed
        _cleanup(writer, comm)
        raise
    finally:
        runner.close()
        if host is not None:  # after the gather (or a failure): no process reads any more
            shutil.rmtree(host.folder, ignore_errors=True)
        stop.set()
        if watcher is not None:
            watcher.join()
    if progress is not None and comm.rank == 0:
        progress(writer.total, writer.total)
    return [ProcessStats(**w["stats"]) for w in written], written


def _share_edges(source, plan, mine: list[int], token: str):
    """Give a tenplex-store source a host folder for the edge blocks this process shares (or None).

    The edge blocks are those of stored tensors this process reads that it
    shares with stored tensors it does not (:func:`tenplex.store.hostcache.edge_blocks`).
    """
    manifest = getattr(source, "manifest", None)
    if manifest is None or not hasattr(source, "host_cache"):
        return None
    cols = plan.table.cols
    rows = np.isin(cols["dst"], np.asarray(mine, dtype=np.int32)) & (cols["kind"] != FILL_CODE)
    paths = plan.table.paths
    needed = set()
    for p, r in set(zip(cols["path"][rows].tolist(), cols["src"][rows].tolist())):
        rec = source.record(paths[p], r)
        needed.add((rec.path, rec.rank))
    folder = os.path.join(HOST_FOLDER, f"tenplex-reshard-{token}")
    source.host_cache = HostBlockCache(folder, edge_blocks(manifest, needed))
    return source.host_cache


def _open(guard: TransferGuard, comm: Comm, dst, tree, to, meta, storage_options, block,
          sharding) -> StoreWriter:
    """Process 0 refuses a committed ``dst`` and picks the run's file token; then every process opens a writer."""
    answer = None
    writer = None
    if comm.rank == 0:
        try:
            writer = StoreWriter(dst, tree, to, storage_options=storage_options, meta=meta, block=block,
                                 sharding=sharding)
            answer = {"token": writer.token}
        except AlreadyExistsError as exc:
            answer = {"exists": str(exc)}
    answer = json.loads(guard.gather("cleared", json.dumps(answer).encode())[0])
    if "exists" in answer:
        with guard.agreeing():
            raise AlreadyExistsError(answer["exists"])
    if writer is None:
        writer = StoreWriter(dst, tree, to, storage_options=storage_options, meta=meta, block=block,
                             token=answer["token"], sharding=sharding)
    return writer


def _cleanup(writer: StoreWriter, comm: Comm) -> None:
    """Remove this process's files; process 0 also removes every other file of this run (its token)."""
    writer.abort()
    if comm.rank == 0:
        remove_token_files(writer, writer.entries())
        writer.abort()  # the directories it created, now empty

"""``tenplex reshard`` under torchrun: every process runs it, process 0 shows the bar and the summary.

See :mod:`tenplex.distributed_reshard` for how the work is split and
committed, and docs/reshard-torchrun.md for launching it with torchrun or Slurm.
"""

from __future__ import annotations

import json
import sys

from tenplex.distributed_reshard import (DistributedReshardReport, init_group, reshard_distributed,
                                         stop_on_sigterm)
from tenplex.units import format_bytes

__all__ = ["reshard_torchrun"]


def reshard_torchrun(args, options: dict, bar_factory) -> int:
    """Run ``tenplex reshard`` as one process of the torchrun job; the exit code."""
    comm = init_group()
    stop_on_sigterm(comm.rank)
    bar = bar_factory("reshard") if comm.rank == 0 else None
    try:
        report = reshard_distributed(args.src, args.dst, args.to, comm=comm, format=args.format,
                                     progress=bar, timeout=args.timeout, **options)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    if comm.rank == 0:
        _print(args, report)
    return 0


def _print(args, r: DistributedReshardReport) -> None:
    """As the single-process command: padding changes and notes on stderr, the summary on stdout."""
    for line in r.padding:
        print(f"padding: {line}", file=sys.stderr)
    for note in r.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(r.to_json()))
        return
    for p in r.processes:
        print(f"process {p.process}: {len(p.ranks)} files, read {format_bytes(p.bytes_read)} "
              f"(needed {format_bytes(p.bytes_needed)}), wrote {format_bytes(p.bytes_written)} "
              f"in {p.seconds:.2f} s", file=sys.stderr)
    gbps = (r.bytes_read + r.bytes_written) / max(r.seconds, 1e-9) / 1e9
    print(f"resharded {args.src} {r.src} -> {r.dst} with {len(r.processes)} processes: "
          f"read {format_bytes(r.bytes_read)} (needed {format_bytes(r.bytes_needed)}), "
          f"wrote {format_bytes(r.bytes_written)} in {r.seconds:.2f} s ({gbps:.2f} GB/s)")

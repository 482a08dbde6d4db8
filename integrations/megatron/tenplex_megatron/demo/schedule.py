"""A schedule of resource changes: phases of (dp, tp, pp) and steps, checked before anything runs."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tenplex.errors import ConfigError
from tenplex.ptree.config import ParallelConfig

__all__ = ["Phase", "parse_schedule", "check_schedule", "DEFAULT_SCHEDULE", "capacity"]

DEFAULT_SCHEDULE = "dp=2,tp=2,pp=1:6;dp=1,tp=1,pp=2:6;dp=1,tp=2,pp=2:6;dp=4,tp=1,pp=1:6"


@dataclass(frozen=True)
class Phase:
    """``steps`` training steps at ``config``."""

    config: ParallelConfig
    steps: int

    @property
    def workers(self) -> int:
        return self.config.world_size


def parse_schedule(text: str) -> list[Phase]:
    """Parse ``"dp=2,tp=2,pp=1:6;dp=1,tp=1,pp=2:6"`` (config ``:`` steps, ``;`` between phases).

    Raises:
        ConfigError: a malformed entry.
    """
    phases = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        config, _, steps = entry.rpartition(":")
        if not config or not steps.isdigit() or int(steps) < 1:
            raise ConfigError(f"schedule entry {entry!r}: expected 'dp=D,tp=T,pp=P:STEPS' with STEPS >= 1")
        phases.append(Phase(ParallelConfig.parse(config), int(steps)))
    if not phases:
        raise ConfigError(f"schedule {text!r} has no phases")
    return phases


def capacity() -> int:
    """Workers this machine can hold: two per CPU core (gloo processes on CPU)."""
    return 2 * (os.cpu_count() or 1)


def check_schedule(phases: list[Phase], tree, batch: int, max_workers: int, micro_batch: int = 1) -> None:
    """Raise ConfigError for an impossible phase: a tp that does not divide the heads,
    a pp that does not fit the layers, a dp that does not divide the global batch (in
    micro-batches), or more workers than the machine can hold."""
    for i, phase in enumerate(phases, 1):
        where = f"schedule phase {i} ({phase.config})"
        try:
            tree.validate(phase.config)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if batch % phase.config.dp:
            raise ConfigError(f"{where}: dp={phase.config.dp} does not divide the global batch {batch}")
        if phase.workers > max_workers:
            raise ConfigError(f"{where}: needs {phase.workers} workers; this machine holds at most "
                              f"{max_workers} (2 per CPU core; --max-workers to change)")
        if (batch // phase.config.dp) % micro_batch:
            raise ConfigError(f"{where}: the global batch {batch} over dp={phase.config.dp} is not a whole "
                              f"number of micro-batches of {micro_batch}")

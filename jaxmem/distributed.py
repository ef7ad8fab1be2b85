"""Several processes, one run: JAX's own multi-process runtime (``jax.distributed``), started
from flags or the usual environment variables before JAX starts its backends.

Every process runs the same program (SPMD); the mesh (``jaxmem.sharding``) spans all their
devices; each process reads only its rows of every batch; process 0 owns the run directory
(lock, config, metrics, summary, sample, console output) and every process writes its part of
each orbax checkpoint into it (a filesystem all processes share).
"""

from __future__ import annotations

import dataclasses
import os

from jaxmem.config import ConfigError, require

ENV = {
    "coordinator": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessGroup:
    """Who this process is among the run's processes (how a job is launched, not what it
    computes: it is not part of the run config, so a run may resume on another layout of the
    same devices)."""

    coordinator: str | None = None  # host:port of process 0's coordination service
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        require(
            isinstance(self.num_processes, int) and self.num_processes > 0,
            f"--num-processes {self.num_processes!r} must be a positive integer",
        )
        require(
            isinstance(self.process_id, int) and 0 <= self.process_id < self.num_processes,
            f"--process-id {self.process_id!r} must be in 0..{self.num_processes - 1}",
        )
        require(
            self.num_processes == 1 or bool(self.coordinator),
            f"--num-processes {self.num_processes} needs --coordinator HOST:PORT (process 0's "
            f"address), or {ENV['coordinator']}",
        )

    @property
    def multi(self) -> bool:
        return self.num_processes > 1

    @property
    def primary(self) -> bool:
        return self.process_id == 0


def process_group(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> ProcessGroup:
    """From flags, falling back on JAX's environment variables (``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``)."""

    def from_env(name: str) -> int | None:
        raw = os.environ.get(ENV[name])
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{ENV[name]}={raw!r} is not an integer") from None

    coordinator = coordinator or os.environ.get(ENV["coordinator"])
    n = num_processes if num_processes is not None else from_env("num_processes")
    i = process_id if process_id is not None else from_env("process_id")
    return ProcessGroup(coordinator=coordinator, num_processes=n or 1, process_id=i or 0)


def initialize(group: ProcessGroup) -> None:
    """Join the run's processes (``jax.distributed.initialize``); a single process does
    nothing. Call before anything starts JAX's backends."""
    if not group.multi:
        return
    import jax

    jax.distributed.initialize(
        coordinator_address=group.coordinator,
        num_processes=group.num_processes,
        process_id=group.process_id,
    )

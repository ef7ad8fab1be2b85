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


class JoinFailed(RuntimeError):
    """The run's processes did not all join within the timeout (one line, for the user)."""


def _wait_for_coordinator(group: ProcessGroup, timeout_s: int) -> None:
    """Wait until process 0's coordination service accepts connections, at most ``timeout_s``
    seconds. Written by hand because XLA's client, once it tries to register and the deadline
    passes, ends the process in a native abort (exit 134, a C++ stack dump) rather than an
    error Python can report: this check fails first, in one line."""
    import socket
    import time

    host, _, port = (group.coordinator or "").rpartition(":")
    try:
        address = (host.strip("[]") or "localhost", int(port))
    except ValueError:
        raise JoinFailed(
            f"--coordinator {group.coordinator!r} must be HOST:PORT (process 0's address)"
        ) from None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(address, timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise JoinFailed(
                    f"process {group.process_id} of {group.num_processes}: nothing answers at "
                    f"{group.coordinator} after {timeout_s} s ({e.strerror or e}): start process "
                    "0 (--process-id 0 runs the coordinator) with the same --coordinator, or "
                    "raise --join-timeout"
                ) from None
            time.sleep(0.5)


def initialize(group: ProcessGroup, timeout_s: int = 300) -> None:
    """Join the run's processes (``jax.distributed.initialize``) within ``timeout_s`` seconds;
    a single process does nothing. Call before anything starts JAX's backends. Raises
    ``JoinFailed`` naming the coordinator and what to check when they do not all join."""
    if not group.multi:
        return
    if not group.primary:
        _wait_for_coordinator(group, timeout_s)
    import jax

    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes,
            process_id=group.process_id,
            initialization_timeout=timeout_s,
        )
    except Exception as e:  # XLA's coordination service raises its own error types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise JoinFailed(
            f"process {group.process_id} of {group.num_processes} could not join the run's "
            f"processes at {group.coordinator} within {timeout_s} s ({first[:200]}): start "
            "every process (--process-id 0 runs the coordinator) with the same --coordinator "
            "and --num-processes, or raise --join-timeout"
        ) from None

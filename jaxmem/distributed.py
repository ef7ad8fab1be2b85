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
import re
import sys
from typing import Any

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


# ------------------------------------------------------------------------ losing a process
HEARTBEAT_S = 1.0  # how often each process says it is alive
ALIVE = "jaxmem/alive/{}"  # the coordination service's key-value store: a counter per process
DONE = "jaxmem/done/{}"  # set by a process that stops on its own (finished, failed, stopped)


class PeerWatch:
    """Notices a lost process within ``timeout_s`` seconds, whatever the others are doing.

    Each process publishes a counter in the coordination service's key-value store (process 0
    runs the service) every ``HEARTBEAT_S`` and reads the others'. A peer whose counter has not
    moved for ``timeout_s`` (and that did not say it stopped on its own), or a service that has
    not answered for ``timeout_s`` (process 0 is gone), calls ``on_lost(process, seconds)``
    from a watcher thread that makes no call that could block. Written by hand because XLA's
    own heartbeats end a survivor in a native abort (exit 134, a C++ stack dump), after the
    collective it waits in or the checkpoint it writes gives up, rather than in an error Python
    can report; this watch fires first (use a timeout below ``jax.distributed``'s heartbeat
    timeout, 100 s)."""

    def __init__(self, group: ProcessGroup, timeout_s: float, on_lost) -> None:
        import threading

        self.group, self.timeout_s, self.on_lost = group, timeout_s, on_lost
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.others = [i for i in range(group.num_processes) if i != group.process_id]
        # per peer: (its last counter, when it last moved); the service: when it last answered
        self._seen: dict[int, tuple[str | None, float]] = {}
        self._answered = 0.0
        self._done: set[int] = set()
        self._threads = [
            threading.Thread(target=self._beat, name="jaxmem-heartbeat", daemon=True),
            threading.Thread(target=self._judge, name="jaxmem-peer-watch", daemon=True),
        ]

    def start(self) -> PeerWatch:
        import time

        now = time.monotonic()
        self._seen = {i: (None, now) for i in self.others}
        self._answered = now
        for t in self._threads:
            t.start()
        return self

    def stop(self, finished: bool) -> None:
        """Stop watching; ``finished``: this process ended its run normally: say so, so the
        others stop watching it (a process that failed says nothing: its peers take its silence
        for a lost process, and exit rather than wait in a collective without it)."""
        self._stop.set()
        if not finished:
            return
        try:
            _client().key_value_set(DONE.format(self.group.process_id), "1", allow_overwrite=True)
        except Exception:  # the service may be gone already: nothing to tell
            pass

    def _beat(self) -> None:
        import time

        client = _client()
        me, count = self.group.process_id, 0
        while not self._stop.is_set():
            count += 1
            try:
                client.key_value_set(ALIVE.format(me), str(count), allow_overwrite=True)
                # every process's counter and stop mark in two calls, however many there are
                alive = _by_process(client.key_value_dir_get(ALIVE.format("")))
                done = _by_process(client.key_value_dir_get(DONE.format("")))
                seen = {i: "done" if i in done else alive.get(i) for i in self.others}
            except Exception:  # the service does not answer: the judge times it out
                self._stop.wait(HEARTBEAT_S)
                continue
            now = time.monotonic()
            with self._lock:
                self._answered = now
                for i, value in seen.items():
                    if value == "done":
                        self._done.add(i)
                    elif value != self._seen[i][0]:
                        self._seen[i] = (value, now)
            self._stop.wait(HEARTBEAT_S)

    def _silent(self, threshold: float) -> tuple[int, float] | None:
        """A peer (or, seen from another process, process 0's service) silent for more than
        ``threshold`` seconds, and for how long; None: every one has spoken since."""
        import time

        now = time.monotonic()
        with self._lock:
            if self.group.process_id != 0 and now - self._answered > threshold:
                return 0, now - self._answered
            for i, (_, since) in self._seen.items():
                if i not in self._done and now - since > threshold:
                    return i, now - since
        return None

    def _judge(self) -> None:
        while not self._stop.wait(HEARTBEAT_S / 2):
            lost = self._silent(self.timeout_s)
            if lost is not None:
                self.on_lost(*lost)
                return

    def confirm(self) -> None:
        """After a collective failed (gloo reports a peer's closed connection at once): a peer
        that stays silent for a few heartbeats is lost (``on_lost``) without waiting out the
        timeout; returns if every peer keeps speaking for ``timeout_s`` (the failure was not
        a lost process)."""
        import time

        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            lost = self._silent(3 * HEARTBEAT_S)
            if lost is not None:
                self.on_lost(*lost)
                return
            time.sleep(HEARTBEAT_S / 4)


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


def _by_process(entries: list[tuple[str, str]]) -> dict[int, str]:
    """``[("jaxmem/alive/3", "17"), ...]`` -> ``{3: "17", ...}``."""
    out = {}
    for key, value in entries:
        tail = key.rstrip("/").rsplit("/", 1)[-1]
        if tail.isdigit():
            out[int(tail)] = value
    return out


# ------------------------------------------------------- what XLA's client ends in an abort
# When process 0 (the coordination service) goes, XLA's client in every other process ends it
# within a second in LOG(FATAL): "Terminating process because the JAX distributed service
# detected fatal errors", a C++ stack dump, SIGABRT. No Python code runs then (jax does not let
# the client's error callback be set from Python), so a multi-process `jaxmem train` runs its
# work in a forked child and the parent, which starts nothing, reports how the child ended.
FATAL_MARKER = "Check failure stack trace"  # the start of XLA's stack dump (not forwarded)
NATIVE_ABORT = re.compile(r"^[FE]\d{4} [\d:.]+ +\d+ \S+\] (.*)$")  # an absl log line


def supervise(report) -> None:
    """Fork: the child returns and does the work, its stderr piped through the parent; the
    parent forwards stop signals to it, forwards its stderr (but not XLA's native stack dump)
    and exits with its code, or, when it ended in a native abort, calls ``report(reason)`` (a
    line for the user, returned) and exits 1. The child dies with the parent
    (``PR_SET_PDEATHSIG``): a parent killed leaves no process behind. Call before JAX starts
    (no threads yet)."""
    import signal

    read, write = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: on with the work
        os.close(read)
        os.dup2(write, 2)
        os.close(write)
        # its own process group: a terminal's Ctrl-C reaches the parent alone, which forwards it
        # once (twice would be the "second signal" that aborts without saving)
        os.setpgid(0, 0)
        _die_with_parent()
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)
        return
    os.close(write)
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), lambda number, _frame: os.kill(pid, number))
    fatal: list[str] = []
    with os.fdopen(read, errors="replace") as child_err:
        for line in child_err:
            match = NATIVE_ABORT.match(line.strip())
            if match and line.startswith("F"):
                fatal.append(match.group(1))
            if fatal:  # the abort's message and stack dump: summarised below
                continue
            sys.stderr.write(line)
            sys.stderr.flush()
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFEXITED(status) and not fatal:
        os._exit(os.WEXITSTATUS(status))
    number = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    if number in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL, signal.SIGHUP) and not fatal:
        os._exit(128 + number)
    reason = fatal[0] if fatal else f"it ended on {signal.Signals(number).name}"
    print(report(reason), file=sys.stderr, flush=True)
    os._exit(1)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent ends (elsewhere: nothing)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def lost_process(reason: str, process_id: int) -> int | None:
    """Which process a coordination-service failure names: ``Task N`` in a heartbeat timeout,
    process 0 when the service stopped answering; None: neither."""
    named = re.search(r"[Tt]ask (\d+) heartbeat", reason)
    if named:
        return int(named.group(1))
    if process_id != 0 and ("coordination service" in reason or "leader" in reason):
        return 0
    return None


def process_rows(batch_sharding: Any, batch_size: int) -> slice:
    """The rows of a ``batch_size``-row global batch this process feeds its devices under
    ``batch_sharding`` (rows split over the data axis only: processes along a context or tensor
    axis feed the same rows)."""
    index = batch_sharding.addressable_devices_indices_map((batch_size,))
    rows = [i[0].indices(batch_size) for i in index.values()]
    return slice(min(r[0] for r in rows), max(r[1] for r in rows))

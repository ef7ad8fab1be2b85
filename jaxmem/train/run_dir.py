"""A run directory, and what guards it while a run owns it (pure: no JAX, no PyTorch).

The directory holds ``config.yaml`` (the resolved config: ``--config`` repeats the run),
``metrics.jsonl`` (one line per step), ``loss.png``, ``summary.json`` and ``sample.txt``, which
``RunFiles`` writes, and ``checkpoints/`` (``jaxmem.run_layout``). ``RunLock`` holds the directory
for the whole run (``check_in_use`` asks without taking it); ``StopRequests`` turns SIGINT and
SIGTERM into "stop after this step and save it". For the messages of a failed or interrupted run,
``disk_error`` finds the OS write error behind a failure and ``last_verified`` names the checkpoint
to continue from.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console

from jaxmem.config import ConfigError, require
from jaxmem.files import missing_dirs, write_atomic, write_json_atomic
from jaxmem.job import (
    JobConfig,
    config_conflicts,
    merge,
    read_config_file,
    write_config,
)
from jaxmem.run_layout import CHECKPOINT_DIR, newest_verified

CONFIG_FILE = "config.yaml"


# ------------------------------------------------------------------------------------ run files
class RunFiles:
    """The files of a run directory. ``metrics.jsonl`` is appended and flushed at every host
    sync, so a killed run leaves every synced step on disk; a resumed run first drops the lines
    after its checkpoint."""

    def __init__(self, out_dir: str | None, job: JobConfig):
        self.out_dir, self.job = out_dir, job
        self.records: list[dict[str, Any]] = []
        self.config_written = False

    def path(self, name: str) -> str:
        assert self.out_dir is not None
        return os.path.join(self.out_dir, name)

    def start(self, resume_step: int | None) -> str | None:
        """Write the run's config and its metrics up to ``resume_step``. A resumed run's
        ``config.yaml`` is the user's file: rewritten only when this run's settings differ from
        it; returns a line saying what changed (None: nothing to say)."""
        if self.out_dir is None:
            return None
        os.makedirs(self.out_dir, exist_ok=True)
        note = None
        if resume_step is None:
            write_config(self.job, self.path(CONFIG_FILE))
        else:
            note = _update_config(self.job, self.path(CONFIG_FILE))
        self.config_written = resume_step is None or note is not None
        metrics = self.path("metrics.jsonl")
        if resume_step is not None and os.path.exists(metrics):
            # back to the checkpoint's step: a resumed run's file equals an uninterrupted one's
            # (a line cut by a kill mid-write is dropped with the steps after the checkpoint)
            kept = [r for r in read_metrics(metrics)[0] if r["step"] <= resume_step]
            write_atomic(metrics, "".join(json.dumps(r) + "\n" for r in kept))
            self.records = kept
        elif os.path.exists(metrics):
            os.remove(metrics)
        return note

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        self.records.extend(records)
        if self.out_dir is None or not records:
            return
        with open(self.path("metrics.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    def finish(self, summary: dict[str, Any], sample: str | None) -> list[str]:
        if self.out_dir is None:
            return []
        written = [CONFIG_FILE] if self.config_written else []
        written.append("metrics.jsonl")
        write_json_atomic(self.path("summary.json"), summary)
        written.append("summary.json")
        if sample is not None:
            write_atomic(self.path("sample.txt"), sample)
            written.append("sample.txt")
        plot_losses([(self.job.run.framework, self.records)], self.path("loss.png"))
        written.append("loss.png")
        return written


def resumed_settings(out_dir: str, saved: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A resumed run's ``config.yaml``, the run's settings, as settings over its checkpoint's
    (``saved``): what a resumed run may change (its length, logging, evaluation and checkpoint
    cadence: ``jaxmem.job.RESUMABLE_CHANGES``) is taken from the file. ``ConfigError`` naming
    the file for one that does not parse (and the line) or that changes what the checkpoint's
    steps computed (and the settings). None: no file (the checkpoint's settings stand)."""
    path = os.path.join(out_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    settings = read_config_file(path)
    if saved is None:
        return settings
    try:
        edited = JobConfig.from_dict(merge(dict(saved), settings)).to_dict()
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    changed = config_conflicts(saved, edited, names=("checkpoint", "file"))
    require(
        not changed,
        f"--resume: {path} changes what the checkpoint's steps computed: "
        + "; ".join(changed)
        + " (a resumed run changes only its length, logging, evaluation, checkpoints and "
        f"sample); put the file back, or start a new run from it: jaxmem train --config {path} "
        "--out NEW_DIR",
    )
    return settings


def _update_config(job: JobConfig, path: str) -> str | None:
    """Rewrite a resumed run's ``config.yaml`` when ``job`` differs from it; a line saying so."""
    if not os.path.isfile(path):
        write_config(job, path)
        return f"{CONFIG_FILE} was missing: wrote this run's settings to {path}"
    try:
        written = JobConfig.from_dict(read_config_file(path)).to_dict()
    except ConfigError as e:
        write_config(job, path)
        return f"{path} did not read back ({e}): rewrote it with this run's settings"
    changed = config_conflicts(written, job.to_dict(), allowed=(), names=("file", "now"))
    if not changed:
        return None  # the user's file stands, byte for byte
    write_config(job, path)
    return f"updated {path} to this run's settings: " + "; ".join(changed)


def read_metrics(path: str) -> tuple[list[dict[str, Any]], int]:
    """The step records of a ``metrics.jsonl`` and how many lines could not be read (a line a
    killed run left half-written)."""
    records, partial = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                partial += 1
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            else:
                partial += 1
    return records, partial


def finite_losses(records: Sequence[dict[str, Any]]) -> int:
    """How many of a run's step records hold a finite training loss."""
    return sum(1 for r in records if isinstance(r.get("loss"), float) and math.isfinite(r["loss"]))


def plot_losses(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], path: str) -> None:
    """Train (and validation) loss against step for one or more runs, on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, records) in enumerate(runs):
        color = f"C{i}"
        train = [(r["step"], r["loss"]) for r in records if math.isfinite(r["loss"])]
        if train:
            ax.plot(*zip(*train, strict=True), color=color, lw=1, label=f"{label} train")
        val = [
            (r["step"], r["val_loss"])
            for r in records
            if r.get("val_loss") is not None and math.isfinite(r["val_loss"])
        ]
        if val:
            ax.plot(*zip(*val, strict=True), "o--", color=color, label=f"{label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("training loss")
    if ax.get_legend_handles_labels()[0]:  # a run with no finite loss draws nothing
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------- the lock
LOCK_FILE = ".jaxmem.lock"


class RunLock:
    """An exclusive lock on a run directory for the whole run (``fcntl.flock`` on
    ``<run>/.jaxmem.lock``, which holds the owner's pid). The OS releases it when the process
    ends, however it ends; a second run on the directory is refused, naming the owner."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_FILE)
        self._fd: int | None = None
        self.created_dirs: list[str] = []  # the directories acquiring made, innermost first
        self.created_file = False

    def acquire(self) -> None:
        import fcntl

        self.created_dirs = missing_dirs(self.out_dir)
        if self.created_dirs:
            os.makedirs(self.out_dir)
        self.created_file = not os.path.exists(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"run directory {self.out_dir} is in use by process {owner}; wait for it to "
                "finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    def abandon(self) -> None:
        """Remove what acquiring created (the lock file, the directories) when nothing else was
        written, and release. The lock file goes while the lock is held, so no run that starts
        meanwhile can take a lock on a file about to vanish."""
        empty = self.created_file and os.listdir(self.out_dir) == [LOCK_FILE]
        if empty:
            os.remove(self.path)
        self.release()
        if empty:
            for directory in self.created_dirs:
                os.rmdir(directory)


def holds_only_the_lock(out_dir: str) -> bool:
    return not [n for n in os.listdir(out_dir) if n != LOCK_FILE]


def check_in_use(out_dir: str) -> None:
    """Refuse a run directory whose lock another live process holds (without taking it)."""
    import fcntl

    path = os.path.join(out_dir, LOCK_FILE)
    if not os.path.isfile(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        raise ConfigError(
            f"run directory {out_dir} is in use by process {owner}; wait for it to finish or "
            "choose another --out"
        ) from None
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------- stop signals
class StopRequests:
    """SIGINT and SIGTERM ask the loop to stop after the current step (torchtitan and the HF
    Trainer checkpoint on a signal the same way); a second signal aborts at once.

    Python runs a signal's handler once however many times the signal arrived while the main
    thread was busy in native code (a step, a save): two Ctrl-C 50 ms apart would read as one
    and save. The C-level handler also writes one byte per delivery to the wakeup fd
    (``signal.set_wakeup_fd``), so the handler counts deliveries there instead."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, console: Console):
        self.console = console
        self.signal: str | None = None
        self._old: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

    def __enter__(self) -> StopRequests:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._pipe = os.pipe()
            for fd in self._pipe:
                os.set_blocking(fd, False)
            self._old_wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
            for name in self.SIGNALS:
                number = getattr(signal, name)
                self._old[number] = signal.signal(number, self._handle)
        return self

    def _deliveries(self) -> int:
        """Stop signals delivered since the last call (at least the one being handled)."""
        import signal

        numbers = {int(getattr(signal, name)) for name in self.SIGNALS}
        count = 0
        while self._pipe is not None:
            try:
                data = os.read(self._pipe[0], 512)
            except BlockingIOError:
                break
            if not data:
                break
            count += sum(1 for byte in data if byte in numbers)
        return max(count, 1)

    def _handle(self, number: int, frame: Any) -> None:
        import signal

        deliveries = self._deliveries()
        if self.signal is not None or deliveries > 1:  # the second one: abort without saving
            self.signal = self.signal or signal.Signals(number).name
            signal.signal(number, signal.SIG_DFL)
            raise KeyboardInterrupt
        self.signal = signal.Signals(number).name
        self.console.print(
            f"[yellow]{self.signal}: stopping after this step and saving it (again to abort "
            "without saving)[/]"
        )

    def __exit__(self, *exc: object) -> None:
        import signal

        for number, handler in self._old.items():
            signal.signal(number, handler)
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None


# ------------------------------------------------------------------------- what a message names
def last_verified(out_dir: str, every_process: bool = False, launcher: str = "") -> str:
    """The newest checkpoint of a run that verifies, in words, with the command that continues
    from it (for a message): ``every_process``: a JAX multi-process run (each process resumes);
    ``launcher``: what the command runs under (torchrun's)."""
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    step = newest_verified(directory)[0] if os.path.isdir(directory) else None
    if step is None:
        return "none"
    where = ", on every process with its --coordinator/--num-processes/--process-id"
    return (
        f"step {step} in {directory} (continue with: {launcher}jaxmem train --out {out_dir} "
        f"--resume{where if every_process else ''})"
    )


def disk_error(error: BaseException) -> OSError | None:
    """The OS write error behind ``error`` (itself, a cause, or one that orbax/tensorstore report
    in their message, e.g. ENOSPC as RESOURCE_EXHAUSTED), or None."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        text = str(e)
        for errno_name, words in _OS_ERROR_TEXT.items():
            if words in text:
                import errno

                code = getattr(errno, errno_name)
                return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


_OS_ERROR_TEXT = {
    "ENOSPC": "No space left on device",
    "EDQUOT": "Disk quota exceeded",
    "EFBIG": "File too large",
    "EROFS": "Read-only file system",
    "EIO": "Input/output error",
}

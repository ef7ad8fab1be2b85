"""The training job's step loop, shared by both frameworks (pure: no JAX, no PyTorch).

A framework plugs in as a ``Trainer`` (``jaxmem.train.run.JaxTrainer``;
``jaxmem.compare.torch_run.TorchTrainer``): it runs a step without syncing the host, fetches
metrics when asked, evaluates, saves and restores. Everything else is here, once:

1. ``prepare_job`` checks the whole job before anything is written: config, the framework's
   backend support (a callback), the data (exists, well-formed, long enough for ``seq_len``) and
   the run directory (new and writable, or a resumable run whose saved config the new one does
   not contradict). Errors are ``ConfigError`` / ``DataError`` / ``CheckpointError``: one line,
   exit code 2 at the CLI.
2. ``run_job`` trains: batches are a pure function of ``(seed, step)``, built and transferred by
   a background thread; the host syncs only at the progress refresh, validation and checkpoints.
   A non-finite loss stops the run before the next checkpoint, so the last checkpoint on disk is
   always a good one; dynamically scaled (fp16) overflow steps are skipped and counted instead.

The run directory holds ``config.yaml`` (the resolved config: ``--config`` repeats the run),
``metrics.jsonl`` (one line per step), ``loss.png``, ``summary.json``, ``sample.txt`` and
``checkpoints/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from jaxmem import data as data_lib
from jaxmem.config import ConfigError, require
from jaxmem.figures import Figure, format_bytes, render_table
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.job import JobConfig, config_conflicts, write_config
from jaxmem.train.layout import CHECKPOINT_DIR, newest_verified, quarantine

# From most to least device memory at a given size (FLOPs grow the other way).
CHEAPER_POLICIES = ("none", "mlp", "selective", "offload", "full", "nested")


class RunFailed(RuntimeError):
    """The run stopped at run time (non-finite loss, out of memory). The message says what
    happened, what is kept on disk and what to try; the CLI exits with code 1."""


@dataclasses.dataclass(frozen=True)
class PreparedJob:
    job: JobConfig
    dataset: data_lib.Dataset
    out_dir: str | None
    resume_step: int | None  # the checkpoint to continue from (None: a new run)
    # newer checkpoints that do not verify, with why: moved aside when the run starts
    skipped: tuple[tuple[int, str], ...] = ()
    # the process that owns the run directory's files and lock (process 0 of a multi-process
    # run; the others train beside it and write only their part of each checkpoint)
    primary: bool = True
    # what tokenized the text and decodes the sample (jaxmem.hf.tokenizer; None: bytes)
    tokenizer: Any = None


class Trainer(Protocol):
    """One framework's side of a run (see the module docstring)."""

    framework: str  # "jax" or "torch"
    platform: str  # where the steps run ("cpu", "gpu", "cuda", ...)
    compile_s: float | None  # None: nothing compiled (eager)
    planned_bytes: int | None  # the step's compiled plan, when there is one

    def describe(self) -> str:
        """What runs and how, for the run's first line (policy translation, compile time)."""

    def transfer(self, batch: dict[str, np.ndarray]) -> Any:
        """Put a host batch where the step reads it (called on the prefetch thread)."""

    def restore(self, step: int) -> None: ...

    def step(self, batch: Any) -> Any:
        """One optimizer step; returns its metrics without a host sync."""

    def fetch(self, metrics: Any) -> dict[str, Any]:
        """The host values of one step's metrics: ``loss`` and, where known, ``grad_norm`` and
        ``skipped`` (a loss-scaled step with inf/nan gradients)."""

    def val_loss(self) -> float: ...

    def save(self, step: int, extra: dict[str, Any]) -> None: ...

    def memory_label(self) -> str:
        """What the progress bar shows about memory (a plan or a runtime peak, labelled)."""

    def sample(
        self, prompt: np.ndarray, n_new: int, temperature: float, seed: int
    ) -> np.ndarray: ...

    def figures(self) -> list[Figure]:
        """The memory table printed at the end, every figure with how it was obtained."""

    def any_process(self, flag: bool) -> bool:
        """Whether ``flag`` is set in any of the run's processes (one process: ``flag``; several:
        a small collective every call, so that they all decide the same at the same step)."""

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------- prepare
def host_available_bytes() -> int | None:
    """Memory this host can still give a process (``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_resident(
    job: JobConfig, available: int | None, where: str, devices_here: int | None = None
) -> None:
    """Refuse a job whose parameters, gradients and optimizer state alone (analytic, per
    device: ``jaxmem.memory.analytic.model_state_bytes``) exceed the memory ``where`` has:
    no memory policy or precision of activations can make it fit, so training would only run
    out of memory after compiling. ``available``: bytes for the ``devices_here`` devices of
    the mesh this process or host drives (default all of them; a CPU mesh's devices share its
    memory); None: unknown, not checked."""
    from jaxmem.memory.analytic import model_state_bytes

    if available is None:
        return
    state = model_state_bytes(job.model, job.optimizer, job.precision, job.parallel)
    per_device = sum(state.values())
    total = per_device * (devices_here or job.parallel.devices)
    mesh = job.parallel.mesh_text()
    per = f", {format_bytes(per_device)} per device of {mesh}" if job.parallel.sharded else ""
    require(
        total <= available,
        f"{job.preset}'s parameters, gradients and {job.optimizer.name} state alone need "
        f"{format_bytes(total)} (analytic, {job.precision.name}{per}), more than the "
        f"{format_bytes(available)} {where}: no memory policy can make it fit; train it where "
        f"it fits, or see its plan: jaxmem plan --preset {job.preset} --target h100",
    )


def prepare_job(
    job: JobConfig,
    out_dir: str | None,
    *,
    resume: bool = False,
    check_backend: Callable[[JobConfig], None] = lambda job: None,
    primary: bool = True,
) -> PreparedJob:
    """Check everything about ``job`` that can be checked before training; write nothing.
    ``check_backend`` raises ``ConfigError`` for what the framework's backend cannot run.
    A non-``primary`` process of a multi-process run skips the checks that belong to the
    directory's owner (lock, emptiness, writability): process 0 makes them."""
    check_backend(job)
    require(not (resume and out_dir is None), "--resume needs --out, the directory of the run")
    resume_step, skipped = _check_run_dir(job, out_dir, resume, primary)
    if job.run.init_from is not None and resume_step is None:
        _check_init_from(job)  # before anything is written: the weights fit, every one
    tokenizer = job_tokenizer(job)
    dataset = data_lib.load_dataset(
        job.data.path,
        val_fraction=job.data.val_fraction,
        vocab_size=job.model.vocab_size,
        tokenizer=tokenizer,
    )
    need = job.run.seq_len + 2
    for name, tokens in (("train", dataset.train), ("validation", dataset.val)):
        if tokens.size < need:
            raise data_lib.DataError(
                f"seq_len={job.run.seq_len} needs at least {need} tokens but the {name} split "
                f"of {dataset.source} has {tokens.size}; use a shorter --seq-len or more data"
            )
    return PreparedJob(
        job=job,
        dataset=dataset,
        out_dir=out_dir,
        resume_step=resume_step,
        skipped=skipped,
        primary=primary,
        tokenizer=tokenizer,
    )


def model_dir(job: JobConfig) -> str | None:
    """The Hugging Face model directory the job's model comes from: ``run.init_from``, or a
    ``--preset DIR``; None for a named preset."""
    from jaxmem.config import PRESETS

    if job.run.init_from is not None:
        return job.run.init_from
    return None if job.preset in PRESETS else job.preset


def job_tokenizer(job: JobConfig) -> Any:
    """The run's tokenizer: its model directory's ``tokenizer.json`` when there is one, else
    bytes (``ConfigError`` when the directory named in the run's config is gone)."""
    from jaxmem.hf.tokenizer import tokenizer_for

    directory = model_dir(job)
    require(
        directory is None or os.path.isdir(directory),
        f"the run's model directory {directory} does not exist (any more); its tokenizer and "
        "config come from there: put it back or start a new run",
    )
    return tokenizer_for(directory)


def _check_init_from(job: JobConfig) -> None:
    """``--init-from DIR``: the model computes DIR's function and DIR's checkpoint holds every
    weight it needs (read from the safetensors headers, no data)."""
    from jaxmem.hf.config import disagreements, model_config_from_dir
    from jaxmem.hf.files import inventory

    directory = job.run.init_from
    theirs = model_config_from_dir(directory)
    differ = disagreements(job.model, theirs)
    require(
        not differ,
        f"--init-from {directory}: the model ({job.preset}) differs from its config.json: "
        + "; ".join(differ[:4])
        + " (ours vs theirs); drop --preset and the model settings, or give matching ones",
    )
    inventory(directory, job.model)


def _check_in_use(out_dir: str) -> None:
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


def _check_run_dir(
    job: JobConfig, out_dir: str | None, resume: bool, primary: bool = True
) -> tuple[int | None, tuple[tuple[int, str], ...]]:
    """The step to resume from (None: a new run) and the newer steps that do not verify."""
    if out_dir is None or (not primary and not resume):
        return None, ()
    require(
        not (os.path.exists(out_dir) and not os.path.isdir(out_dir)),
        f"--out {out_dir} is a file; give a directory",
    )
    if os.path.isdir(out_dir) and primary:
        _check_in_use(out_dir)
    if not resume:
        if os.path.isdir(out_dir) and not _holds_only_the_lock(out_dir):
            hint = (
                "add --resume to continue it"
                if os.path.isdir(os.path.join(out_dir, CHECKPOINT_DIR))
                else "choose a new directory"
            )
            raise ConfigError(f"--out {out_dir} exists and is not empty; {hint}")
        parent = out_dir if os.path.isdir(out_dir) else os.path.dirname(os.path.abspath(out_dir))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        # Try it (os.access says yes to root even on read-only mounts); nothing is left behind.
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".jaxmem-write-test-", dir=parent))
        except OSError:
            raise ConfigError(
                f"--out {out_dir}: {parent} is not writable; choose another --out"
            ) from None
        return None, ()
    require(
        os.path.isdir(out_dir),
        f"--resume: {out_dir} does not exist; start the run without --resume",
    )
    require(os.access(out_dir, os.W_OK), f"--resume: {out_dir} is not writable")
    from jaxmem.train.checkpoint import latest_checkpoint  # orbax reads a JAX run's layout

    step, saved, skipped = latest_checkpoint(out_dir)
    reasons = "; ".join(f"{s}: {why}" for s, why in skipped)
    require(
        step is not None and saved is not None,
        f"--resume: {out_dir} holds no checkpoint that verifies"
        + (f" ({reasons})" if reasons else "")
        + "; start a new run in another directory",
    )
    conflicts = config_conflicts(saved, job.to_dict())
    require(
        not conflicts,
        f"--resume: the config contradicts the checkpoint in {out_dir}: "
        + "; ".join(conflicts)
        + " (resume with the saved config: drop those flags)",
    )
    require(
        step < job.run.steps,
        f"--resume: {out_dir} is already at step {step} of {job.run.steps}; "
        f"raise --steps above {step} to train further",
    )
    return step, tuple(skipped)


# ------------------------------------------------------------------------------------ run files
class RunFiles:
    """The files of a run directory. ``metrics.jsonl`` is appended and flushed at every host
    sync, so a killed run leaves every synced step on disk; a resumed run first drops the lines
    after its checkpoint."""

    def __init__(self, out_dir: str | None, job: JobConfig):
        self.out_dir, self.job = out_dir, job
        self.records: list[dict[str, Any]] = []

    def path(self, name: str) -> str:
        assert self.out_dir is not None
        return os.path.join(self.out_dir, name)

    def start(self, resume_step: int | None) -> None:
        if self.out_dir is None:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        write_config(self.job, self.path("config.yaml"))
        metrics = self.path("metrics.jsonl")
        if resume_step is not None and os.path.exists(metrics):
            # back to the checkpoint's step: a resumed run's file equals an uninterrupted one's
            # (a line cut by a kill mid-write is dropped with the steps after the checkpoint)
            kept = [r for r in read_metrics(metrics)[0] if r["step"] <= resume_step]
            write_atomic(metrics, "".join(json.dumps(r) + "\n" for r in kept))
            self.records = kept
        elif os.path.exists(metrics):
            os.remove(metrics)

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        self.records.extend(records)
        if self.out_dir is None or not records:
            return
        with open(self.path("metrics.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    def finish(self, summary: dict[str, Any], sample: str | None) -> list[str]:
        if self.out_dir is None:
            return []
        written = ["config.yaml", "metrics.jsonl"]
        write_json_atomic(self.path("summary.json"), summary)
        written.append("summary.json")
        if sample is not None:
            write_atomic(self.path("sample.txt"), sample)
            written.append("sample.txt")
        plot_losses([(self.job.run.framework, self.records)], self.path("loss.png"))
        written.append("loss.png")
        return written


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


# ------------------------------------------------------------------------------------- helpers
def is_out_of_memory(error: BaseException) -> bool:
    """A real out-of-memory from XLA or PyTorch; not a full disk, which tensorstore also reports
    as RESOURCE_EXHAUSTED."""
    if disk_error(error) is not None:
        return False
    text = str(error)
    return (
        "RESOURCE_EXHAUSTED" in text
        or "out of memory" in text.lower()
        or type(error).__name__ == "OutOfMemoryError"  # torch.cuda.OutOfMemoryError
    )


def out_of_memory_message(
    job: JobConfig, planned_bytes: int | None, where: str, *, can_offload: bool
) -> str:
    """What to say when a compile or step runs out of memory: the plan, and what to try."""
    plan = (
        f"the step plans {format_bytes(planned_bytes)} (compiled plan)"
        if planned_bytes is not None
        else "no plan was available"
    )
    name = job.memory.name
    order = [p for p in CHEAPER_POLICIES if can_offload or p != "offload"]
    cheaper = order[order.index(name) + 1 :] if name in order else ["full", "nested"]
    tips = [f"--policy {cheaper[0]}"] if cheaper else []
    if job.run.batch_size > 1:
        tips.append(f"--accum {2 * job.accum.steps} (same batch, smaller microbatches)")
    if job.precision.name == "fp32":
        tips.append("--precision bf16")
    return f"out of memory {where} with policy {name!r}: {plan}; try " + ", or ".join(
        tips or ["a smaller --batch-size or --seq-len"]
    )


def val_batches(dataset: data_lib.Dataset, job: JobConfig) -> list[dict[str, np.ndarray]]:
    """The fixed validation batches (the same for every evaluation, and in both frameworks)."""
    r = job.run
    out = []
    for i in range(r.eval_batches):
        x, y = data_lib.batch_at(dataset.val, i, r.batch_size, r.seq_len, r.seed + 1, "validation")
        out.append({"inputs": x, "targets": y})
    return out


def train_batch(
    dataset: data_lib.Dataset, job: JobConfig, rows: slice | None = None
) -> Callable[[int], dict]:
    """Batch ``step`` of the run: a pure function of ``(seed, step)``; ``rows``: only those
    rows (one process's share of a multi-process run)."""
    r = job.run

    def make(step: int) -> dict[str, np.ndarray]:
        x, y = data_lib.batch_at(
            dataset.train, step, r.batch_size, r.seq_len, r.seed, "train", rows
        )
        return {"inputs": x, "targets": y}

    return make


# What the bar shows before the first host sync: nothing measured yet ("nan" read as divergence)
INITIAL_FIELDS = {"loss": "-", "tps": "-"}


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("{task.fields[mem]}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


# ------------------------------------------------------------------------------- the run dir
LOCK_FILE = ".jaxmem.lock"


class RunLock:
    """An exclusive lock on a run directory for the whole run (``fcntl.flock`` on
    ``<run>/.jaxmem.lock``, which holds the owner's pid). The OS releases it when the process
    ends, however it ends; a second run on the directory is refused, naming the owner."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_FILE)
        self._fd: int | None = None
        self.created_dir = False

    def acquire(self) -> None:
        import fcntl

        if not os.path.isdir(self.out_dir):
            os.makedirs(self.out_dir)
            self.created_dir = True
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
        """Release, and remove what acquiring created when nothing else was written."""
        self.release()
        if self.created_dir and os.listdir(self.out_dir) == [LOCK_FILE]:
            os.remove(self.path)
            os.rmdir(self.out_dir)


def _holds_only_the_lock(out_dir: str) -> bool:
    return not [n for n in os.listdir(out_dir) if n != LOCK_FILE]


class RunInterrupted(RuntimeError):
    """Ctrl-C or SIGTERM: the run stopped after a step (and saved it); the CLI exits with 130."""


class _StopRequests:
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

    def __enter__(self) -> _StopRequests:
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


# ----------------------------------------------------------------------------------------- run
def run_job(
    prepared: PreparedJob, make_trainer: Callable[[], Trainer], console: Console
) -> dict[str, Any]:
    """Train ``prepared.job`` (see the module docstring); returns the summary. The run
    directory is locked first; checkpoints newer than the one resumed from that do not verify
    are moved to ``<run>/quarantine/`` (never deleted); ``make_trainer()`` then builds the
    framework's side (compiling, for JAX)."""
    owns = prepared.out_dir is not None and prepared.primary
    lock = RunLock(prepared.out_dir) if owns else None
    if lock is not None:
        lock.acquire()
        # Checked again under the lock: two runs may both have seen an empty directory.
        if prepared.resume_step is None and not _holds_only_the_lock(prepared.out_dir):
            lock.abandon()
            raise ConfigError(f"--out {prepared.out_dir} exists and is not empty; add --resume")
    elif prepared.out_dir is None:
        console.print(
            "[yellow]no --out: nothing of this run is kept (metrics, checkpoints, sample); "
            "pass --out DIR to keep it[/]"
        )
    try:
        with _StopRequests(console) as stop:
            for step, reason in prepared.skipped if prepared.primary else ():
                where = quarantine(prepared.out_dir, step)
                console.print(
                    f"[yellow]skipped checkpoint {step}: {reason}; moved it to {where}[/]"
                )
            trainer = make_trainer()
            return _train(prepared, trainer, console, stop)
    finally:
        if lock is not None:
            lock.release()


def _train(
    prepared: PreparedJob, trainer: Trainer, console: Console, stop: _StopRequests
) -> dict[str, Any]:
    return _Run(prepared, trainer, console, stop).train()


class _Run:
    """One training run's loop, from the restored state to the summary: the step loop both
    frameworks share. It keeps which checkpoint is the newest that verifies and what it is
    writing, so any failure names both."""

    def __init__(
        self, prepared: PreparedJob, trainer: Trainer, console: Console, stop: _StopRequests
    ):
        self.prepared, self.trainer, self.console, self.stop = prepared, trainer, console, stop
        self.job = prepared.job
        self.start = prepared.resume_step or 0
        self.saves = prepared.out_dir is not None
        self.last_good = self.start  # the newest checkpoint known to verify (0: none)
        self.writing = "the run's files"
        self.files = RunFiles(prepared.out_dir if prepared.primary else None, self.job)
        self.pending: list[tuple[int, Any]] = []
        self.skipped = 0
        self.steps_done = 0
        self.tokens_per_step = self.job.run.batch_size * self.job.run.seq_len

    # -- failures ----------------------------------------------------------------------------
    def where_good(self) -> str:
        if self.saves and self.last_good:
            return f"step {self.last_good} in {self.prepared.out_dir}/{CHECKPOINT_DIR}"
        return "none"

    def failed(self, e: BaseException) -> RunFailed:
        os_error = disk_error(e)
        if os_error is not None:
            return RunFailed(
                f"could not write {self.writing}: {os_error.strerror or os_error}; last "
                f"verified checkpoint: {self.where_good()}; free space there (or choose another "
                "--out) and continue with --resume"
            )
        return RunFailed(
            out_of_memory_message(
                self.job,
                self.trainer.planned_bytes,
                "while training",
                can_offload=getattr(self.trainer, "can_offload", True),
            )
        )

    # -- the run -----------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        self.begin()
        t_start = time.perf_counter()
        self.loop(t_start)
        wall = time.perf_counter() - t_start
        Console(
            file=self.console.file, width=max(self.console.width, 110), quiet=self.console.quiet
        ).print(
            render_table(self.trainer.figures(), f"memory of one training step ({self.job.preset})")
        )
        return self.finish(wall, self.sample())

    def begin(self) -> None:
        """Restore a resumed run, write its config and metrics header, say what runs."""
        prepared, trainer = self.prepared, self.trainer
        try:
            if prepared.resume_step is not None:
                trainer.restore(prepared.resume_step)
            self.writing = f"config.yaml and metrics.jsonl in {prepared.out_dir}"
            self.files.start(prepared.resume_step)
        except Exception as e:
            if disk_error(e) is not None:
                raise self.failed(e) from None
            raise
        if self.stop.signal is not None:
            trainer.close()
            raise RunInterrupted(f"{self.stop.signal} before the first step; nothing was saved")
        job, r = self.job, self.job.run
        self.console.print(
            f"[bold]jaxmem train[/] ({trainer.framework}) preset {job.preset} "
            f"({job.model.n_params / 1e6:.2f} M params), policy {job.memory.name}, precision "
            f"{job.precision.name}, accum {job.accum.steps} ({job.accum.mode}), batch "
            f"{r.batch_size} x seq {r.seq_len}, {job.optimizer.name} lr {job.optimizer.lr}, "
            f"steps {self.start + 1}..{r.steps} on {trainer.platform}; data: "
            f"{prepared.dataset.source} ({prepared.dataset.train.size:,} train / "
            f"{prepared.dataset.val.size:,} val tokens); {trainer.describe()}"
            + (f"; resumed from step {self.start}" if prepared.resume_step is not None else "")
            + (
                f"; weights from {r.init_from}"
                if r.init_from is not None and prepared.resume_step is None
                else ""
            )
        )

    def flush(self) -> list[dict[str, Any]]:
        """The one host sync: the metrics of the steps since the last one."""
        job = self.job
        scaled = job.precision.loss_scale == "dynamic"
        out = []
        for s, handle in self.pending:
            values = self.trainer.fetch(handle)
            rec = {"step": s, "loss": values["loss"], "tokens": s * self.tokens_per_step}
            if "grad_norm" in values:
                rec["grad_norm"] = values["grad_norm"]
            if scaled:
                rec["skipped"] = bool(values["skipped"])
                self.skipped += rec["skipped"]
            elif not math.isfinite(rec["loss"]):
                self.files.append(out)
                fix = "lower --lr" + (
                    "" if job.precision.name == "fp32" else ", or use --precision fp32"
                )
                raise RunFailed(
                    f"loss became {rec['loss']} at step {s}; stopped before checkpointing it "
                    f"(last good checkpoint: {self.where_good()}); {fix}"
                )
            out.append(rec)
        self.pending.clear()
        return out

    def loop(self, t_start: float) -> None:
        r, trainer = self.job.run, self.trainer
        with (
            progress_bar(self.console) as progress,
            data_lib.Prefetcher(
                train_batch(self.prepared.dataset, self.job, getattr(trainer, "local_rows", None)),
                self.start + 1,
                r.steps + 1,
                depth=r.prefetch,
                transfer=trainer.transfer,
            ) as batches,
        ):
            task = progress.add_task(
                "train",
                total=r.steps,
                completed=self.start,
                mem=trainer.memory_label(),
                **INITIAL_FIELDS,
            )
            try:
                for step, batch in batches:
                    self.pending.append((step, trainer.step(batch)))
                    self.steps_done += 1
                    self.after_step(step, progress, task, t_start)
            except (RunFailed, RunInterrupted):
                raise
            except KeyboardInterrupt:
                # a second signal, wherever it landed (a save it cut short is never verified)
                good = last_verified(self.prepared.out_dir) if self.saves else "none (no --out)"
                raise RunInterrupted(
                    f"a second {self.stop.signal or 'signal'} aborted the run without saving; "
                    f"last verified checkpoint: {good}"
                ) from None
            except Exception as e:
                if is_out_of_memory(e) or disk_error(e) is not None:
                    raise self.failed(e) from None
                raise
            finally:
                trainer.close()

    def after_step(self, step: int, progress: Progress, task: Any, t_start: float) -> None:
        """Log, evaluate, checkpoint and stop when the step calls for it (else nothing: the
        host syncs only then)."""
        r, out_dir = self.job.run, self.prepared.out_dir
        is_last = step == r.steps
        # every process of a multi-process run stops after the same step, wherever the signal
        # arrived (a process saving while another steps on would wait for it forever)
        interrupted = self.trainer.any_process(self.stop.signal is not None)
        evaluate = step % r.eval_every == 0 or is_last
        save = self.saves and (step % r.checkpoint_every == 0 or is_last or interrupted)
        if step % r.refresh_every and not (evaluate or save or interrupted):
            return
        records = self.flush()
        if evaluate and not interrupted:
            records[-1]["val_loss"] = self.trainer.val_loss()
            progress.console.print(
                f"step {step}: train loss {records[-1]['loss']:.4f}, "
                f"val loss {records[-1]['val_loss']:.4f}"
            )
        self.writing = f"metrics.jsonl in {out_dir}"
        self.files.append(records)
        if save:
            self.writing = f"checkpoint {step} in {out_dir}/{CHECKPOINT_DIR}"
            self.trainer.save(step, {"loss": records[-1]["loss"], "skipped_steps": self.skipped})
            self.last_good = step
        elapsed = time.perf_counter() - t_start
        progress.update(
            task,
            completed=step,
            loss=f"{records[-1]['loss']:.4f}",
            tps=f"{self.steps_done * self.tokens_per_step / elapsed:,.0f}",
            mem=self.trainer.memory_label(),
        )
        if interrupted:
            raise RunInterrupted(
                f"{self.stop.signal or 'a stop signal to another process'} at step {step}: "
                + (
                    f"saved checkpoint {step} in {out_dir}/{CHECKPOINT_DIR}; continue with: "
                    f"jaxmem train --out {out_dir} --resume"
                    if self.saves
                    else "nothing was saved (no --out)"
                )
            )

    def sample(self) -> str | None:
        """The text sample at the end (cut to fit the position table, saying so), encoded and
        decoded by the run's tokenizer."""
        r, model = self.job.run, self.job.model
        if not r.sample_tokens:
            return None
        tok = self.prepared.tokenizer
        if tok is None:
            from jaxmem.hf.tokenizer import ByteTokenizer

            tok = ByteTokenizer()
        prompt = tok.encode(r.prompt) if r.prompt else np.array([tok.start_id])
        if prompt.size == 0:  # a prompt the tokenizer maps to nothing
            prompt = np.array([tok.start_id])
        room = model.max_seq_len - min(prompt.size, model.max_seq_len - 1)
        if prompt.size > model.max_seq_len - 1 or r.sample_tokens > room:
            self.console.print(
                f"[yellow]sample cut to fit max_seq_len={model.max_seq_len}: the prompt's "
                f"last {min(prompt.size, model.max_seq_len - 1)} tokens and "
                f"{min(r.sample_tokens, room)} new ones (asked for {r.sample_tokens})[/]"
            )
        tokens = self.trainer.sample(prompt, r.sample_tokens, r.temperature, r.seed)
        text = tok.decode(tokens)
        self.console.rule("sample")
        self.console.print(text, markup=False, highlight=False)
        self.console.rule()
        return text

    def finish(self, wall: float, sample: str | None) -> dict[str, Any]:
        """Write the summary, the sample and the plot; say what the run did."""
        trainer, records, out_dir = self.trainer, self.files.records, self.prepared.out_dir
        tokens_per_s = self.steps_done * self.tokens_per_step / wall
        summary = {
            "config": self.job.to_dict(),
            "framework": trainer.framework,
            "init_from": self.job.run.init_from,
            "resumed_from": self.start or None,
            "first_loss": records[0]["loss"] if records else None,
            "final_loss": records[-1]["loss"] if records else None,
            "final_val_loss": next(
                (x["val_loss"] for x in reversed(records) if x.get("val_loss") is not None),
                None,
            ),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_source": "wall clock over this process's training loop (validation "
            "and checkpoint saves included, compile excluded)",
            "wall_s": wall,
            "compile_s": trainer.compile_s,
            "skipped_steps": self.skipped,
            "platform": trainer.platform,
            "host": platform.node(),
            "memory": [dataclasses.asdict(f) for f in trainer.figures()],
            "planned_step_bytes": trainer.planned_bytes,
            # --target's estimated step time for that GPU (an estimate, its assumptions in it)
            "target_step_time": getattr(trainer, "step_time", None),
        }
        self.writing = f"summary.json, sample.txt and loss.png in {out_dir}"
        try:
            written = self.files.finish(summary, sample)
        except OSError as e:
            raise self.failed(e) from None
        first, final, val = summary["first_loss"], summary["final_loss"], summary["final_val_loss"]
        self.console.print(
            f"loss {first:.4f} -> {final:.4f}"
            + (f" (val {val:.4f})" if val is not None else "")
            + f" in {wall:.1f} s, {tokens_per_s:,.0f} tokens/s "
            "(wall clock over the loop incl. validation and checkpoints, compile excluded)"
            + (f"; {self.skipped} fp16 overflow steps skipped" if self.skipped else "")
        )
        if out_dir is not None and self.prepared.primary:
            self.console.print(f"wrote {out_dir}/: {', '.join(written)}, {CHECKPOINT_DIR}/")
        return summary

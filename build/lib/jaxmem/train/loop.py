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
from jaxmem.train.job import JobConfig, config_conflicts, write_config
from jaxmem.train.layout import CHECKPOINT_DIR

# From most to least device memory at a given size (FLOPs grow the other way).
CHEAPER_POLICIES = ("none", "mlp", "selective", "dots", "offload", "full", "nested")


class RunFailed(RuntimeError):
    """The run stopped at run time (non-finite loss, out of memory). The message says what
    happened, what is kept on disk and what to try; the CLI exits with code 1."""


@dataclasses.dataclass(frozen=True)
class PreparedJob:
    job: JobConfig
    dataset: data_lib.Dataset
    out_dir: str | None
    resume_step: int | None  # the checkpoint to continue from (None: a new run)


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

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------- prepare
def prepare_job(
    job: JobConfig,
    out_dir: str | None,
    *,
    resume: bool = False,
    check_backend: Callable[[JobConfig], None] = lambda job: None,
) -> PreparedJob:
    """Check everything about ``job`` that can be checked before training; write nothing.
    ``check_backend`` raises ``ConfigError`` for what the framework's backend cannot run."""
    check_backend(job)
    require(not (resume and out_dir is None), "--resume needs --out, the directory of the run")
    resume_step = _check_run_dir(job, out_dir, resume)
    dataset = data_lib.load_dataset(
        job.data.path, val_fraction=job.data.val_fraction, vocab_size=job.model.vocab_size
    )
    need = job.run.seq_len + 2
    for name, tokens in (("train", dataset.train), ("validation", dataset.val)):
        if tokens.size < need:
            raise data_lib.DataError(
                f"seq_len={job.run.seq_len} needs at least {need} tokens but the {name} split "
                f"of {dataset.source} has {tokens.size}; use a shorter --seq-len or more data"
            )
    return PreparedJob(job=job, dataset=dataset, out_dir=out_dir, resume_step=resume_step)


def _check_run_dir(job: JobConfig, out_dir: str | None, resume: bool) -> int | None:
    if out_dir is None:
        return None
    require(
        not (os.path.exists(out_dir) and not os.path.isdir(out_dir)),
        f"--out {out_dir} is a file; give a directory",
    )
    if not resume:
        if os.path.isdir(out_dir) and os.listdir(out_dir):
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
        return None
    require(
        os.path.isdir(out_dir),
        f"--resume: {out_dir} does not exist; start the run without --resume",
    )
    require(os.access(out_dir, os.W_OK), f"--resume: {out_dir} is not writable")
    from jaxmem.train.checkpoint import latest_checkpoint  # orbax reads a JAX run's layout

    step, saved = latest_checkpoint(out_dir, job.run.framework)
    require(
        step is not None and saved is not None,
        f"--resume: {out_dir} holds no complete checkpoint; start a new run instead",
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
    return step


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
            with open(metrics) as f:
                kept = [json.loads(line) for line in f if line.strip()]
            kept = [r for r in kept if r["step"] <= resume_step]
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
        val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val, strict=True), "o--", color=color, label=f"{label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------- helpers
def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


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


def train_batch(dataset: data_lib.Dataset, job: JobConfig) -> Callable[[int], dict]:
    """Batch ``step`` of the run: a pure function of ``(seed, step)``."""
    r = job.run

    def make(step: int) -> dict[str, np.ndarray]:
        x, y = data_lib.batch_at(dataset.train, step, r.batch_size, r.seq_len, r.seed)
        return {"inputs": x, "targets": y}

    return make


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TextColumn("{task.fields[mem]}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


# ----------------------------------------------------------------------------------------- run
def run_job(prepared: PreparedJob, trainer: Trainer, console: Console) -> dict[str, Any]:
    """Train ``prepared.job`` with ``trainer`` (see the module docstring); returns the summary."""
    job, r = prepared.job, prepared.job.run
    start = prepared.resume_step or 0
    if prepared.resume_step is not None:
        trainer.restore(prepared.resume_step)
    files = RunFiles(prepared.out_dir, job)
    files.start(prepared.resume_step)
    scaled = job.precision.loss_scale == "dynamic"
    console.print(
        f"[bold]jaxmem train[/] ({trainer.framework}) preset {job.preset} "
        f"({job.model.n_params / 1e6:.2f} M params), policy {job.memory.name}, precision "
        f"{job.precision.name}, accum {job.accum.steps} ({job.accum.mode}), batch "
        f"{r.batch_size} x seq {r.seq_len}, {job.optimizer.name} lr {job.optimizer.lr}, steps "
        f"{start + 1}..{r.steps} on {trainer.platform}; data: {prepared.dataset.source} "
        f"({prepared.dataset.train.size:,} train / {prepared.dataset.val.size:,} val tokens); "
        f"{trainer.describe()}"
        + (f"; resumed from step {start}" if prepared.resume_step is not None else "")
    )
    tokens_per_step = r.batch_size * r.seq_len
    pending: list[tuple[int, Any]] = []
    skipped, last_good, steps_done = 0, start, 0
    saves = prepared.out_dir is not None

    def flush() -> list[dict[str, Any]]:
        """The one host sync: the metrics of the steps since the last one."""
        nonlocal skipped
        out = []
        for s, handle in pending:
            values = trainer.fetch(handle)
            rec = {"step": s, "loss": values["loss"], "tokens": s * tokens_per_step}
            if "grad_norm" in values:
                rec["grad_norm"] = values["grad_norm"]
            if scaled:
                rec["skipped"] = bool(values["skipped"])
                skipped += rec["skipped"]
            elif not math.isfinite(rec["loss"]):
                files.append(out)
                where = (
                    f"step {last_good} in {prepared.out_dir}/{CHECKPOINT_DIR}"
                    if saves and last_good
                    else "none"
                )
                raise RunFailed(
                    f"loss became {rec['loss']} at step {s}; stopped before checkpointing it "
                    f"(last good checkpoint: {where}); lower --lr, or use --precision fp32"
                )
            out.append(rec)
        pending.clear()
        return out

    t_start = time.perf_counter()
    with (
        progress_bar(console) as progress,
        data_lib.Prefetcher(
            train_batch(prepared.dataset, job),
            start + 1,
            r.steps + 1,
            depth=r.prefetch,
            transfer=trainer.transfer,
        ) as batches,
    ):
        task = progress.add_task(
            "train",
            total=r.steps,
            completed=start,
            loss=float("nan"),
            tps=0.0,
            mem=trainer.memory_label(),
        )
        try:
            for step, batch in batches:
                pending.append((step, trainer.step(batch)))
                steps_done += 1
                is_last = step == r.steps
                evaluate = step % r.eval_every == 0 or is_last
                save = saves and (step % r.checkpoint_every == 0 or is_last)
                if step % r.refresh_every and not (evaluate or save):
                    continue
                records = flush()
                if evaluate:
                    records[-1]["val_loss"] = trainer.val_loss()
                    progress.console.print(
                        f"step {step}: train loss {records[-1]['loss']:.4f}, "
                        f"val loss {records[-1]['val_loss']:.4f}"
                    )
                files.append(records)
                if save:
                    trainer.save(step, {"loss": records[-1]["loss"], "skipped_steps": skipped})
                    last_good = step
                elapsed = time.perf_counter() - t_start
                progress.update(
                    task,
                    completed=step,
                    loss=records[-1]["loss"],
                    tps=steps_done * tokens_per_step / elapsed,
                    mem=trainer.memory_label(),
                )
        except Exception as e:
            if is_out_of_memory(e):
                raise RunFailed(
                    out_of_memory_message(
                        job,
                        trainer.planned_bytes,
                        "while training",
                        can_offload=getattr(trainer, "can_offload", True),
                    )
                ) from None
            raise
        finally:
            trainer.close()
    wall = time.perf_counter() - t_start
    tokens_per_s = steps_done * tokens_per_step / wall

    Console(file=console.file, width=max(console.width, 110)).print(
        render_table(trainer.figures(), f"memory of one training step ({job.preset})")
    )
    sample = None
    if r.sample_tokens:
        prompt = data_lib.encode(r.prompt) if r.prompt else np.array([data_lib.BOS])
        tokens = trainer.sample(prompt, r.sample_tokens, r.temperature, r.seed)
        sample = data_lib.decode(tokens)
        console.rule("sample")
        console.print(sample, markup=False, highlight=False)
        console.rule()
    summary = {
        "config": job.to_dict(),
        "framework": trainer.framework,
        "resumed_from": start or None,
        "first_loss": files.records[0]["loss"] if files.records else None,
        "final_loss": files.records[-1]["loss"] if files.records else None,
        "final_val_loss": next(
            (x["val_loss"] for x in reversed(files.records) if x.get("val_loss") is not None),
            None,
        ),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_source": "wall clock over this process's training loop (validation and "
        "checkpoint saves included, compile excluded)",
        "wall_s": wall,
        "compile_s": trainer.compile_s,
        "skipped_steps": skipped,
        "platform": trainer.platform,
        "host": platform.node(),
        "memory": [dataclasses.asdict(f) for f in trainer.figures()],
        "planned_step_bytes": trainer.planned_bytes,
    }
    written = files.finish(summary, sample)
    first, final, val = summary["first_loss"], summary["final_loss"], summary["final_val_loss"]
    console.print(
        f"loss {first:.4f} -> {final:.4f}"
        + (f" (val {val:.4f})" if val is not None else "")
        + f" in {wall:.1f} s, {tokens_per_s:,.0f} tokens/s "
        "(wall clock over the loop incl. validation and checkpoints, compile excluded)"
        + (f"; {skipped} fp16 overflow steps skipped" if skipped else "")
    )
    if prepared.out_dir is not None:
        console.print(f"wrote {prepared.out_dir}/: {', '.join(written)}, {CHECKPOINT_DIR}/")
    return summary

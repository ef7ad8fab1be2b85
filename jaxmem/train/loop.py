"""The training job's step loop, shared by both frameworks (pure: no JAX, no PyTorch).

A framework plugs in as a ``Trainer`` (``jaxmem.train.run.JaxTrainer``;
``jaxmem.compare.torch_run.TorchTrainer``): it runs a step without syncing the host, fetches
metrics when asked, evaluates, saves and restores. Everything else is here, once. The job is
checked first (``jaxmem.train.prepare.prepare_job``); then ``run_job`` trains: batches are a pure
function of ``(seed, step)``, built and transferred by a background thread; the host syncs only at
the progress refresh, validation and checkpoints. A non-finite loss stops the run before the next
checkpoint, so the last checkpoint on disk is always a good one; dynamically scaled (fp16)
overflow steps are skipped and counted instead. What a run writes, its lock and its stop signals
are ``jaxmem.train.run_dir``'s.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from jaxmem import data as data_lib
from jaxmem.config import ConfigError
from jaxmem.figures import TABLE_WIDTH, Figure, render_table
from jaxmem.instruct import rows_batch
from jaxmem.job import JobConfig
from jaxmem.policy import policy_label
from jaxmem.run_layout import CHECKPOINT_DIR, quarantine
from jaxmem.train.prepare import PreparedJob, is_out_of_memory, out_of_memory_message
from jaxmem.train.run_dir import (
    RunFiles,
    RunLock,
    StopRequests,
    disk_error,
    holds_only_the_lock,
    last_verified,
)


class RunFailed(RuntimeError):
    """The run stopped at run time (non-finite loss, out of memory). The message says what
    happened, what is kept on disk and what to try; the CLI exits with code 1. ``said``: False
    where another process of the run says the same (the CLI then prints nothing)."""

    def __init__(self, message: str, *, said: bool = True):
        super().__init__(message)
        self.said = said


class RunInterrupted(RuntimeError):
    """Ctrl-C or SIGTERM: the run stopped after a step (and saved it); the CLI exits with 130."""


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


def val_batches(dataset: data_lib.Dataset, job: JobConfig) -> list[dict[str, np.ndarray]]:
    """The fixed validation batches (the same for every evaluation, and in both frameworks)."""
    r = job.run
    out = []
    for i in range(r.eval_batches):
        if dataset.masked:  # instruction data: rows with their loss mask
            out.append(rows_batch(dataset, "val", i, r.batch_size, r.seed + 1))
            continue
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
        if dataset.masked:
            return rows_batch(dataset, "train", step, r.batch_size, r.seed, rows)
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
        if prepared.resume_step is None and not holds_only_the_lock(prepared.out_dir):
            lock.abandon()
            raise ConfigError(f"--out {prepared.out_dir} exists and is not empty; add --resume")
    elif prepared.out_dir is None:
        console.print(
            "[yellow]no --out: nothing of this run is kept (metrics, checkpoints, sample); "
            "pass --out DIR to keep it[/]"
        )
    try:
        with StopRequests(console) as stop:
            for step, reason in prepared.skipped if prepared.primary else ():
                where = quarantine(prepared.out_dir, step)
                console.print(
                    f"[yellow]skipped checkpoint {step}: {reason}; moved it to {where}[/]"
                )
            try:
                trainer = make_trainer()  # loads, compiles: refusals here leave nothing behind
            except BaseException:
                if lock is not None:
                    lock.abandon()
                raise
            return _train(prepared, trainer, console, stop)
    finally:
        if lock is not None:
            lock.release()


def _train(
    prepared: PreparedJob, trainer: Trainer, console: Console, stop: StopRequests
) -> dict[str, Any]:
    return _Run(prepared, trainer, console, stop).train()


class _Run:
    """One training run's loop, from the restored state to the summary: the step loop both
    frameworks share. It keeps which checkpoint is the newest that verifies and what it is
    writing, so any failure names both."""

    def __init__(
        self, prepared: PreparedJob, trainer: Trainer, console: Console, stop: StopRequests
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
        Console(  # its own width, not the terminal's: whole rows and every digit
            file=self.console.file, width=TABLE_WIDTH, quiet=self.console.quiet
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
            note = self.files.start(prepared.resume_step)
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
            f"({job.model.n_params / 1e6:.2f} M params), policy {policy_label(job.memory)}, "
            "precision "
            f"{job.precision.name}, accum {job.accum.steps} ({job.accum.mode}), batch "
            f"{r.batch_size} x seq {r.seq_len}, {job.optimizer.name} {job.optimizer.lr_text}, "
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
        if note is not None:
            self.console.print(note, markup=False, highlight=False)

    def flush(self) -> list[dict[str, Any]]:
        """The one host sync: the metrics of the steps since the last one."""
        job = self.job
        scaled = job.precision.loss_scale == "dynamic"
        out = []
        for s, handle in self.pending:
            values = self.trainer.fetch(handle)
            rec = {"step": s, "loss": values["loss"], "tokens": s * self.tokens_per_step}
            # the learning rate this step's update applied (a constant one: the config's)
            rec["lr"] = values.get("lr", job.optimizer.lr)
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
        trainer, out_dir = self.trainer, self.prepared.out_dir
        # this command's steps (a resumed run's earlier ones ran in another process, in
        # another time): the losses and the time in the summary are theirs
        records = [r for r in self.files.records if r["step"] > self.start]
        tokens_per_s = self.steps_done * self.tokens_per_step / wall
        summary = {
            "config": self.job.to_dict(),
            "framework": trainer.framework,
            "init_from": self.job.run.init_from,
            "resumed_from": self.start or None,
            "first_step": records[0]["step"] if records else None,
            "final_step": records[-1]["step"] if records else None,
            "first_loss": records[0]["loss"] if records else None,
            "final_loss": records[-1]["loss"] if records else None,
            "losses_of": "this command's steps, first_step..final_step (a resumed run's earlier "
            "steps are in metrics.jsonl)",
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
        steps = f"steps {summary['first_step']}..{summary['final_step']}"
        if self.start:
            steps += f" (this command's; resumed from step {self.start})"
        self.console.print(
            f"{steps}: loss {first:.4f} -> {final:.4f}"
            + (f" (val {val:.4f})" if val is not None else "")
            + f" in {wall:.1f} s, {tokens_per_s:,.0f} tokens/s "
            "(wall clock over the loop incl. validation and checkpoints, compile excluded)"
            + (f"; {self.skipped} fp16 overflow steps skipped" if self.skipped else "")
        )
        if out_dir is not None and self.prepared.primary:
            self.console.print(f"wrote {out_dir}/: {', '.join(written)}, {CHECKPOINT_DIR}/")
        return summary

"""The training job behind ``jaxmem train``: validate everything, then train, checkpoint, resume.

Order of work, so that bad input costs nothing:

1. ``prepare_job`` checks the whole job before anything is written: config, backend support
   (offload needs ``pinned_host``; fp16 needs a backend that computes in it), the data (exists,
   well-formed, long enough for ``seq_len``), the run directory (new and writable, or a resumable
   run whose saved config the new one does not contradict). Errors are ``ConfigError`` /
   ``DataError`` / ``CheckpointError``: one line, exit code 2 at the CLI.
2. ``run_training`` compiles the step (an out-of-memory compile or step reports the planned bytes
   and a cheaper policy), restores the latest checkpoint when resuming, and trains. Batches are
   a pure function of ``(seed, step)``, built and put on the device by a background thread. The
   host syncs only at the progress refresh, validation and checkpoints. A non-finite loss stops
   the run before the next checkpoint, so the last checkpoint on disk is always a good one;
   fp16 overflow steps are skipped by the loss scaler and counted instead.

The run directory holds ``config.yaml`` (the resolved config: ``--config`` repeats the run),
``metrics.jsonl`` (one line per step), ``loss.png``, ``summary.json``, ``sample.txt`` and
``checkpoints/``. ``torch_ref.run`` trains the same job with PyTorch and writes the same files.
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
from typing import Any

import jax
import numpy as np
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from jaxmem import data as data_lib
from jaxmem import memory
from jaxmem.checkpoint import CheckpointError, config_conflicts
from jaxmem.config import ConfigError
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.job import RESUMABLE_CHANGES, JobConfig, write_config
from jaxmem.precision import check_precision_backend, get_precision
from jaxmem.remat import HOST_MEMORY_KIND, backend_memory_kinds, check_backend, layers_fn
from jaxmem.train import (
    init_loss_scale,
    lm_loss_fn,
    make_model,
    make_optimizer,
    make_train_step,
    place,
    tree_bytes,
)

EXIT_RUN_FAILED = 1
CHECKPOINT_DIR = "checkpoints"
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


# ------------------------------------------------------------------------------------- prepare
def prepare_job(job: JobConfig, out_dir: str | None, *, resume: bool = False) -> PreparedJob:
    """Check everything about ``job`` that can be checked before training; write nothing."""
    check_backend(job.policy)
    check_precision_backend(get_precision(job.precision))
    for name in ("state_memory", "params_memory"):
        kind = getattr(job.optimizer, name)
        if kind != "device" and kind not in backend_memory_kinds():
            raise ConfigError(
                f"optimizer.{name}={kind!r}, but this backend only has memory kinds "
                f"{list(backend_memory_kinds())}; use 'device'"
            )
    if resume and out_dir is None:
        raise ConfigError("--resume needs --out, the directory of the run to continue")
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
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"--out {out_dir} is a file; give a directory")
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
    if not os.path.isdir(out_dir):
        raise ConfigError(f"--resume: {out_dir} does not exist; start the run without --resume")
    if not os.access(out_dir, os.W_OK):
        raise ConfigError(f"--resume: {out_dir} is not writable")
    step, saved = latest_checkpoint(out_dir, job.run.framework)
    if step is None or saved is None:
        raise ConfigError(
            f"--resume: {out_dir} holds no complete checkpoint; start a new run instead"
        )
    conflicts = config_conflicts(saved, job.to_dict(), allowed=RESUMABLE_CHANGES)
    if conflicts:
        raise ConfigError(
            f"--resume: the config contradicts the checkpoint in {out_dir}: "
            + "; ".join(conflicts)
            + " (resume with the saved config: drop those flags)"
        )
    if step >= job.run.steps:
        raise ConfigError(
            f"--resume: {out_dir} is already at step {step} of {job.run.steps}; "
            f"raise --steps above {step} to train further"
        )
    return step


def latest_checkpoint(out_dir: str, framework: str) -> tuple[int | None, dict | None]:
    """The latest complete checkpoint's step and saved config (``(None, None)`` if none).
    The other framework's layout is read too, so resuming a torch run as a JAX run (or the
    reverse) is refused by the config comparison with a message naming ``run.framework``."""
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        return None, None
    readers = (_torch_latest, _jax_latest) if framework == "torch" else (_jax_latest, _torch_latest)
    for read in readers:
        try:
            step, saved = read(directory)
        except CheckpointError:
            continue
        if step is not None and saved is not None:
            return step, saved
    return None, None


def _jax_latest(directory: str) -> tuple[int | None, dict | None]:
    from jaxmem.checkpoint import RunCheckpointer

    with RunCheckpointer(directory, keep=1) as reader:
        step = reader.latest_step()
        return step, (reader.read_config(step) if step is not None else None)


def _torch_latest(directory: str) -> tuple[int | None, dict | None]:
    from torch_ref.run import TorchCheckpointer

    reader = TorchCheckpointer(directory, keep=1)
    step = reader.latest_step()
    return step, (reader.read_config(step) if step is not None else None)


# ------------------------------------------------------------------------------------ run files
class RunFiles:
    """The files of a run directory, shared by both frameworks. ``metrics.jsonl`` is appended
    and flushed at every host sync, so a killed run leaves every synced step on disk; a resumed
    run first drops the lines after its checkpoint."""

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
            with open(self.path("sample.txt"), "w") as f:
                f.write(sample)
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


def out_of_memory_message(job: JobConfig, planned_bytes: int | None, where: str) -> str:
    """What to say when a compile or step runs out of memory: the plan, and what to try."""
    plan = (
        f"the step plans {memory.format_bytes(planned_bytes)} (compiled plan)"
        if planned_bytes is not None
        else "no plan was available"
    )
    name = job.memory.policy
    order = list(CHEAPER_POLICIES)
    if HOST_MEMORY_KIND not in backend_memory_kinds():
        order.remove("offload")
    cheaper = order[order.index(name) + 1 :] if name in order else ["full", "nested"]
    tips = [f"--policy {cheaper[0]}"] if cheaper else []
    if job.run.batch_size > 1:
        tips.append(f"--accum {2 * job.accum.steps} (same batch, smaller microbatches)")
    if job.precision == "fp32":
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
    r = job.run

    def make(step: int) -> dict[str, np.ndarray]:
        x, y = data_lib.batch_at(dataset.train, step, r.batch_size, r.seq_len, r.seed)
        return {"inputs": x, "targets": y}

    return make


def memory_figures(
    loss_fn: Any,
    params: Any,
    opt_state: Any,
    batch: dict[str, jax.Array],
    plan: dict[str, int],
    accum_steps: int = 1,
) -> list[memory.Figure]:
    """The memory table of one training step. Every figure is measured, with its method.
    Residuals are those of one microbatch (what the backward keeps at a time)."""
    if accum_steps > 1:
        batch = jax.tree_util.tree_map(lambda a: a[: a.shape[0] // accum_steps], batch)
    grads_shape = jax.eval_shape(jax.grad(lambda p: loss_fn(p, batch)[0]), params)
    residuals = memory.summarize_residuals(
        memory.saved_residuals(lambda p: loss_fn(p, batch)[0], params)
    )
    platform_name = jax.devices()[0].platform.upper()
    figures = [
        memory.Figure("parameters", tree_bytes(params), "counted (arrays)"),
        memory.Figure("gradients", tree_bytes(grads_shape), "counted (jax.eval_shape of grad)"),
        memory.Figure("optimizer state", tree_bytes(opt_state), "counted (arrays)"),
        memory.Figure(
            "saved activations, device memory",
            residuals.activation_bytes_device,
            "residual accounting (jaxpr of jax.vjp)",
        ),
        memory.Figure(
            "saved activations, host memory (offloaded)",
            residuals.activation_bytes_host,
            "residual accounting (jaxpr of jax.vjp)",
        ),
        memory.Figure(
            "parameters the backward keeps (not extra)",
            residuals.argument_bytes,
            "residual accounting (jaxpr of jax.vjp)",
        ),
    ]
    plan_source = f"compiled plan (XLA:{platform_name} memory_analysis)"
    figures += [
        memory.Figure("train step: arguments", plan["argument_bytes"], plan_source),
        memory.Figure("train step: outputs", plan["output_bytes"], plan_source),
        memory.Figure("train step: donated (aliased)", plan["alias_bytes"], plan_source),
        memory.Figure("train step: temporaries", plan["temp_bytes"], plan_source),
    ]
    peak = memory.device_peak_bytes()
    if peak is not None:
        figures.append(memory.Figure("device peak", peak, "runtime peak (device.memory_stats)"))
    figures.append(
        memory.Figure(
            "process max RSS (whole process, host)",
            memory.process_max_rss_bytes(),
            "OS (getrusage ru_maxrss)",
        )
    )
    return figures


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
def run_training(prepared: PreparedJob, console: Console | None = None) -> dict[str, Any]:
    """Train ``prepared.job`` (see the module docstring); returns the run summary."""
    job = prepared.job
    if job.run.framework == "torch":
        from torch_ref.run import run_torch_training

        return run_torch_training(prepared, console)
    console = console or Console()
    cfg, r = job.model, job.run
    precision, policy = get_precision(job.precision), job.policy
    model = make_model(cfg, precision, seed=r.seed)
    graphdef, params = nnx.split(model, nnx.Param)
    del model  # params are donated to the step; keep no second reference
    tx = make_optimizer(job.optimizer)
    loss_fn = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
    host_params = job.optimizer.params_memory != "device"
    # parameters kept in host memory are brought to the device inside the jitted evaluation
    eval_fn = jax.jit(lambda p, b: loss_fn(place(p, "device") if host_params else p, b)[1])
    loss_scale = init_loss_scale(precision)
    make_batch = train_batch(prepared.dataset, job)
    first = jax.device_put(make_batch(1))
    t0 = time.perf_counter()
    try:
        if job.accum.mode == "multisteps":
            compiled, opt_state = _multisteps(loss_fn, tx, job.accum.steps, params, first)
        else:
            # optimizer state / parameters kept in host memory between steps enter the
            # compiled step there (it moves them to the device for the update and back)
            opt_state = place(tx.init(params), job.optimizer.state_memory)
            params = place(params, job.optimizer.params_memory)
            step_fn = make_train_step(
                loss_fn, tx, precision=precision, accum=job.accum, opt_cfg=job.optimizer
            )
            compiled = step_fn.lower(params, opt_state, loss_scale, first).compile()
    except Exception as e:
        if is_out_of_memory(e):
            raise RunFailed(out_of_memory_message(job, None, "while compiling")) from None
        raise
    compile_s = time.perf_counter() - t0
    plan = memory.compiled_plan(compiled)
    planned = plan["argument_bytes"] + plan["output_bytes"] - plan["alias_bytes"]
    planned += plan["temp_bytes"]
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, opt_state))
    figures = memory_figures(loss_fn, *shapes, first, plan, job.accum.steps)

    files = RunFiles(prepared.out_dir, job)
    ckpt = None
    start = prepared.resume_step or 0
    if prepared.out_dir is not None:
        from jaxmem.checkpoint import RunCheckpointer

        ckpt = RunCheckpointer(os.path.join(prepared.out_dir, CHECKPOINT_DIR), r.keep_checkpoints)
    if prepared.resume_step is not None:
        assert ckpt is not None
        params, opt_state, loss_scale, _, _ = ckpt.restore(
            prepared.resume_step,
            params_like=params,
            opt_state_like=opt_state,
            loss_scale_like=loss_scale,
        )
    files.start(prepared.resume_step)
    valid = [jax.device_put(b) for b in val_batches(prepared.dataset, job)]

    def val_loss(params: Any) -> float:
        sums = [eval_fn(params, b) for b in valid]
        return float(sum(s for s, _ in sums) / sum(n for _, n in sums))

    platform_name = jax.devices()[0].platform
    console.print(
        f"[bold]jaxmem train[/] preset {job.preset} ({cfg.n_params / 1e6:.2f} M params), policy "
        f"{policy.name}, precision {precision.name}, accum {job.accum.steps} ({job.accum.mode}), "
        f"batch {r.batch_size} x seq {r.seq_len}, {job.optimizer.name} lr {job.optimizer.lr}, "
        f"steps {start + 1}..{r.steps} on {platform_name}; data: {prepared.dataset.source} "
        f"({prepared.dataset.train.size:,} train / {prepared.dataset.val.size:,} val tokens); "
        f"compiled in {compile_s:.1f} s, step plans {memory.format_bytes(planned)} "
        f"(compiled plan)"
        + (f"; resumed from step {start}" if prepared.resume_step is not None else "")
    )

    tokens_per_step = r.batch_size * r.seq_len
    pending: list[tuple[int, dict[str, jax.Array]]] = []
    skipped = 0
    last_good = start
    t_start = time.perf_counter()
    steps_done = 0

    def flush() -> list[dict[str, Any]]:
        """The one host sync: the metrics of the steps since the last one."""
        nonlocal skipped
        out = []
        for s, m in pending:
            rec = {"step": s, "loss": float(m["loss"]), "tokens": s * tokens_per_step}
            if "grad_norm" in m:  # not seen by MultiSteps' caller
                rec["grad_norm"] = float(m["grad_norm"])
            if loss_scale is not None:
                rec["skipped"] = not bool(m["grads_finite"])
                skipped += rec["skipped"]
            elif not math.isfinite(rec["loss"]):
                files.append(out)
                saved = f"step {last_good}" if ckpt and last_good else "none"
                raise RunFailed(
                    f"loss became {rec['loss']} at step {s}; stopped before checkpointing it "
                    f"(last good checkpoint: {saved}"
                    + (f" in {prepared.out_dir}/{CHECKPOINT_DIR}" if ckpt else "")
                    + "); lower --lr, or use --precision fp32"
                )
            out.append(rec)
        pending.clear()
        return out

    memory_label = f"plan {memory.format_bytes(planned)}"
    with (
        progress_bar(console) as progress,
        data_lib.Prefetcher(make_batch, start + 1, r.steps + 1, depth=r.prefetch) as batches,
    ):
        task = progress.add_task(
            "train", total=r.steps, completed=start, loss=float("nan"), tps=0.0, mem=memory_label
        )
        try:
            for step, batch in batches:
                params, opt_state, loss_scale, metrics = compiled(
                    params, opt_state, loss_scale, batch
                )
                pending.append((step, metrics))
                steps_done += 1
                is_last = step == r.steps
                evaluate = step % r.eval_every == 0 or is_last
                save = ckpt is not None and (step % r.checkpoint_every == 0 or is_last)
                if step % r.refresh_every and not (evaluate or save):
                    continue
                records = flush()
                if evaluate:
                    records[-1]["val_loss"] = val_loss(params)
                    progress.console.print(
                        f"step {step}: train loss {records[-1]['loss']:.4f}, "
                        f"val loss {records[-1]['val_loss']:.4f}"
                    )
                files.append(records)
                if save:
                    assert ckpt is not None
                    ckpt.save(
                        step,
                        params=params,
                        opt_state=opt_state,
                        loss_scale=loss_scale,
                        run_config=job.to_dict(),
                        extra={"loss": records[-1]["loss"], "skipped_steps": skipped},
                        force=True,
                    )
                    last_good = step
                elapsed = time.perf_counter() - t_start
                peak = memory.device_peak_bytes()
                progress.update(
                    task,
                    completed=step,
                    loss=records[-1]["loss"],
                    tps=steps_done * tokens_per_step / elapsed,
                    mem=memory_label if peak is None else f"peak {memory.format_bytes(peak)}",
                )
        except Exception as e:
            if is_out_of_memory(e):
                raise RunFailed(out_of_memory_message(job, planned, "while training")) from None
            raise
        finally:
            if ckpt is not None:
                ckpt.close()
    jax.block_until_ready(params)
    wall = time.perf_counter() - t_start
    tokens_per_s = steps_done * tokens_per_step / wall

    Console(file=console.file, width=max(console.width, 110)).print(
        memory.render_table(figures, f"memory of one training step ({job.preset})")
    )
    sample = None
    if r.sample_tokens:
        from jaxmem.generate import generate

        tokens = generate(
            graphdef,
            place(params, "device") if host_params else params,
            data_lib.encode(r.prompt) if r.prompt else np.array([data_lib.BOS]),
            r.sample_tokens,
            max_seq_len=cfg.max_seq_len,
            temperature=r.temperature,
            seed=r.seed,
        )
        sample = data_lib.decode(tokens)
        console.rule("sample")
        console.print(sample, markup=False, highlight=False)
        console.rule()
    summary = summarize(job, files.records, wall, tokens_per_s, compile_s, skipped, start)
    summary["memory"] = [dataclasses.asdict(f) for f in figures]
    summary["planned_step_bytes"] = planned
    report(console, summary, files.finish(summary, sample), prepared.out_dir)
    return summary


def _multisteps(loss_fn: Any, tx: Any, k: int, params: Any, batch: dict) -> tuple[Any, Any]:
    """``optax.MultiSteps`` accumulation as a step with the scan step's signature: the jitted
    micro-step (compiled once, for one microbatch) runs ``k`` times per step, the parameters
    changing on the k-th. Returns ``(step, opt_state)``; the step's ``.plan`` is the micro-step's
    compiled plan."""
    from jaxmem.train import make_multisteps_step, valid_tokens

    multi, micro_step = make_multisteps_step(loss_fn, tx, k)
    opt_state = multi.init(params)

    def split(b: dict, i: int) -> dict:
        return {key: v[i * (v.shape[0] // k) : (i + 1) * (v.shape[0] // k)] for key, v in b.items()}

    micro = micro_step.lower(params, opt_state, split(batch, 0), valid_tokens(batch)).compile()

    def step(params, opt_state, loss_scale, batch):
        n_total = valid_tokens(batch)
        loss_sum = 0.0
        for i in range(k):
            params, opt_state, m = micro(params, opt_state, split(batch, i), n_total)
            loss_sum = loss_sum + m["loss_sum"]
        return params, opt_state, loss_scale, {"loss": loss_sum / n_total}

    step.memory_analysis = micro.memory_analysis  # type: ignore[attr-defined]
    return step, opt_state


def summarize(
    job: JobConfig,
    records: Sequence[dict[str, Any]],
    wall: float,
    tokens_per_s: float,
    compile_s: float,
    skipped: int,
    start: int,
) -> dict[str, Any]:
    vals = [r for r in records if r.get("val_loss") is not None]
    return {
        "config": job.to_dict(),
        "framework": job.run.framework,
        "resumed_from": start or None,
        "first_loss": records[0]["loss"] if records else None,
        "final_loss": records[-1]["loss"] if records else None,
        "final_val_loss": vals[-1]["val_loss"] if vals else None,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_source": "wall clock over this process's training loop (validation and "
        "checkpoint saves included, compile excluded)",
        "wall_s": wall,
        "compile_s": compile_s,
        "skipped_steps": skipped,
        "platform": jax.devices()[0].platform,
        "host": platform.node(),
    }


def report(console: Console, summary: dict[str, Any], written: list[str], out: str | None):
    first, final, val = summary["first_loss"], summary["final_loss"], summary["final_val_loss"]
    console.print(
        f"loss {first:.4f} -> {final:.4f}"
        + (f" (val {val:.4f})" if val is not None else "")
        + f" in {summary['wall_s']:.1f} s, {summary['tokens_per_s']:,.0f} tokens/s "
        "(wall clock over the loop incl. validation and checkpoints, compile excluded)"
        + (
            f"; {summary['skipped_steps']} fp16 overflow steps skipped"
            if summary["skipped_steps"]
            else ""
        )
    )
    if out is not None:
        console.print(f"wrote {out}/: {', '.join(written)}, {CHECKPOINT_DIR}/")

"""What a training job is checked against before anything is written (pure: no JAX, no PyTorch).

``prepare_job`` checks the whole job: config, the framework's backend support (a callback), the
data (exists, well-formed, long enough for ``seq_len``), ``--init-from``'s weights and the run
directory (new and writable, or a resumable run whose saved config the new one does not
contradict), and returns the ``PreparedJob`` that ``jaxmem.train.loop.run_job`` trains. Errors are
``ConfigError`` / ``DataError`` / ``CheckpointError``: one line, exit code 2 at the CLI.
``check_resident`` refuses a job whose parameters and optimizer state alone exceed the memory
there is (``host_available_bytes`` on a CPU host); ``out_of_memory_message`` says what to try when
a compile or a step runs out of memory all the same.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from jaxmem import data as data_lib
from jaxmem import instruct
from jaxmem.config import ConfigError, require
from jaxmem.figures import format_bytes
from jaxmem.files import check_can_create
from jaxmem.job import JobConfig, config_conflicts
from jaxmem.run_layout import CHECKPOINT_DIR
from jaxmem.train.run_dir import check_in_use, disk_error, holds_only_the_lock, resumed_settings

# From most to least device memory at a given size (FLOPs grow the other way).
CHEAPER_POLICIES = ("none", "mlp", "selective", "offload", "full", "nested")


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
    device, a LoRA job's frozen base as stored: ``jaxmem.memory.analytic.model_state_bytes``)
    exceed the memory ``where`` has: no memory policy or precision of activations can make it
    fit, so training would only run out of memory after compiling. ``available``: bytes for the
    ``devices_here`` devices of the mesh this process or host drives (default all of them; a CPU
    mesh's devices share its memory); None: unknown, not checked."""
    from jaxmem.memory.analytic import model_state_bytes

    if available is None:
        return
    state = model_state_bytes(
        job.model, job.optimizer, job.precision, job.parallel, adapters=job.adapters
    )
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
    _check_tokenizer_fits(job, tokenizer)  # before tokenizing: an id past the embedding
    instruction = instruct.instruction_dir(job.data.path)
    if instruction is not None:  # token rows with a loss mask (jaxmem prepare of JSON Lines)
        dataset = instruct.load_instruction(instruction, job.model.vocab_size, tokenizer)
    else:
        dataset = data_lib.load_dataset(
            job.data.path,
            val_fraction=job.data.val_fraction,
            vocab_size=job.model.vocab_size,
            tokenizer=tokenizer,
        )
    if dataset.masked:
        require(
            dataset.seq_len == job.run.seq_len,
            f"--data {job.data.path} is instruction data prepared in rows of --seq-len "
            f"{dataset.seq_len}, not {job.run.seq_len}: train with --seq-len {dataset.seq_len} "
            "or prepare it again",
        )
    else:
        data_lib.check_split_sizes(
            dataset.train.size, dataset.val.size, job.run.seq_len, dataset.source
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


def _check_tokenizer_fits(job: JobConfig, tokenizer: Any) -> None:
    """A model directory's tokenizer gives only ids the model has an embedding row for."""
    directory = getattr(tokenizer, "directory", None)
    if directory is None:  # bytes: the data's ids are checked against vocab_size as read
        return
    require(
        tokenizer.vocab_size <= job.model.vocab_size,
        f"{tokenizer.description} has {tokenizer.vocab_size:,} token ids but the model's "
        f"vocab_size is {job.model.vocab_size:,} (config.json of {directory} or the model "
        f"settings): ids {job.model.vocab_size:,} and up would have no embedding; give a "
        "tokenizer.json and a config.json that belong together",
    )


def _check_init_from(job: JobConfig) -> None:
    """``--init-from DIR``: the model computes DIR's function and DIR's checkpoint holds every
    weight it needs (read from the safetensors headers, no data)."""
    from jaxmem.hf.config import check_model_dir, disagreements, model_config_from_dir
    from jaxmem.hf.files import inventory

    directory = job.run.init_from
    check_model_dir(directory, "--init-from")
    theirs = model_config_from_dir(directory)
    differ = disagreements(job.model, theirs)
    require(
        not differ,
        f"--init-from {directory}: the model ({job.preset}) differs from its config.json: "
        + "; ".join(differ[:4])
        + " (ours vs theirs); drop --preset and the model settings, or give matching ones",
    )
    inventory(directory, job.model)


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
        check_in_use(out_dir)
    if not resume:
        if os.path.isdir(out_dir) and not holds_only_the_lock(out_dir):
            hint = (
                "add --resume to continue it"
                if os.path.isdir(os.path.join(out_dir, CHECKPOINT_DIR))
                else "choose a new directory"
            )
            raise ConfigError(f"--out {out_dir} exists and is not empty; {hint}")
        check_can_create(out_dir, "--out")
        return None, ()
    require(
        os.path.isdir(out_dir),
        f"--resume: {out_dir} does not exist; start the run without --resume",
    )
    require(os.access(out_dir, os.W_OK), f"--resume: {out_dir} is not writable")
    from jaxmem.train.checkpoint import latest_checkpoint  # orbax reads a JAX run's layout

    step, saved, skipped = latest_checkpoint(out_dir)
    require(
        step is not None or skipped or not holds_only_the_lock(out_dir),
        f"--resume: {out_dir} has no run yet (it is empty); the same command without --resume "
        "starts one there",
    )
    resumed_settings(out_dir, saved)  # config.yaml parses and contradicts no checkpointed step
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

"""``jaxmem train`` in JAX: the ``Trainer`` that ``jaxmem.train.loop.run_job`` drives.

``prepare`` checks the job against this backend (offload needs ``pinned_host``; fp16 a backend
that computes in it; optimizer state or parameters in ``pinned_host`` need that memory kind),
then the generic checks of ``jaxmem.train.prepare.prepare_job``. ``run_training`` compiles the
step ``jaxmem.step.build.build_step`` builds for the job (an out-of-memory compile reports a
cheaper policy), restores the latest checkpoint when resuming, and trains through the shared
loop. Parameters and optimizer state are donated to the
step; the host syncs only when the loop fetches metrics.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np
from rich.console import Console

from jaxmem.config import ConfigError
from jaxmem.data import PAD
from jaxmem.distributed import process_rows
from jaxmem.figures import Figure, format_bytes, rss_figure
from jaxmem.job import JobConfig
from jaxmem.memory import residuals
from jaxmem.memory.remat import backend_memory_kinds, check_backend
from jaxmem.memory.targets import Target
from jaxmem.model import make_model
from jaxmem.model.flash import KERNEL_NAMES
from jaxmem.policy import HOST_MEMORY_KIND, policy_label
from jaxmem.run_layout import CHECKPOINT_DIR
from jaxmem.sharding import (
    ensure_cpu_devices,
    mesh,
    per_device_bytes,
    sharded_bytes,
)
from jaxmem.step import stream
from jaxmem.step.build import build_step
from jaxmem.step.frozen import counts_line, with_dropout_seed
from jaxmem.step.scaling import init_loss_scale
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import (
    check_precision_backend,
    place,
    tree_bytes,
    valid_tokens,
)
from jaxmem.train.loop import RunFailed, run_job, train_batch, val_batches
from jaxmem.train.prepare import (
    PreparedJob,
    check_resident,
    host_available_bytes,
    is_out_of_memory,
    out_of_memory_message,
    prepare_job,
)


def check_jax_backend(job: JobConfig) -> None:
    """Raise ``ConfigError`` for what this JAX backend cannot run."""
    if job.parallel.sharded:
        ensure_cpu_devices(job.parallel.devices)  # before anything starts JAX's backends
        mesh(job.parallel)  # raises, naming the device count, if this process lacks them
    check_backend(job.memory)
    check_precision_backend(job.precision)
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    here = max(1, job.parallel.devices // jax.process_count())  # this process's devices
    if stats and stats.get("bytes_limit"):
        limit = stats["bytes_limit"] * here
        check_resident(job, limit, f"{here} x {device.device_kind} hold", here)
    else:
        check_resident(job, host_available_bytes(), "this host has available", here)
    kinds = {n: getattr(job.optimizer, n) for n in ("state_memory", "params_memory")}
    if job.optimizer.stream:
        kinds["stream"] = "pinned_host"
    for name, kind in kinds.items():
        if kind != "device" and kind not in backend_memory_kinds():
            raise ConfigError(
                f"optimizer.{name}={kind!r}, but this backend only has memory kinds "
                f"{list(backend_memory_kinds())}; use 'device'"
                if name != "stream"
                else "optimizer.stream needs host memory (pinned_host), but this backend only "
                f"has memory kinds {list(backend_memory_kinds())}; drop --stream"
            )


def prepare(
    job: JobConfig, out_dir: str | None, *, resume: bool = False, primary: bool = True
) -> PreparedJob:
    """Check everything about ``job`` that can be checked before training; write nothing
    (``primary``: this process owns the run directory; see ``jaxmem.distributed``)."""
    return prepare_job(
        job, out_dir, resume=resume, check_backend=check_jax_backend, primary=primary
    )


def host_value(x: jax.Array) -> np.ndarray:
    """A replicated result as numpy on this host (this process's copy: a multi-process array
    is not fully addressable, so ``float(x)`` would refuse it)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_shards[0].data)


def memory_figures(
    loss_fn: Any,
    params: Any,
    opt_state: Any,
    batch: dict[str, Any],
    plan: dict[str, int],
    accum_steps: int = 1,
    shardings: Any = None,
    mesh_text: str = "",
    trainable: Any = None,
) -> list[Figure]:
    """The memory table of one training step. Every figure is measured, with its method.
    Residuals are those of one microbatch (what the backward keeps at a time). Over a mesh
    (``shardings``): parameters and optimizer state also per device, from each leaf's shard
    shape; residuals are the whole microbatch's (every device's rows); the plan is per device.
    ``trainable`` (``jaxmem.step.frozen.Trainable``): gradients of its trained subtree only."""
    if accum_steps > 1:
        batch = jax.tree_util.tree_map(lambda a: a[: a.shape[0] // accum_steps], batch)
    trained, frozen = trainable.split(params) if trainable is not None else (params, None)

    def trained_loss(t: Any, f: Any) -> Any:
        return loss_fn(t if f is None else trainable.merge(t, f), batch)[0]

    grads_shape = jax.eval_shape(jax.grad(trained_loss), trained, frozen)
    summary = residuals.summarize_residuals(
        residuals.saved_residuals(lambda p: loss_fn(p, batch)[0], params)
    )
    vjp = "residual accounting (jaxpr of jax.vjp)"
    figures = [
        Figure("parameters", tree_bytes(params), "counted (arrays)"),
        Figure("gradients", tree_bytes(grads_shape), "counted (jax.eval_shape of grad)"),
        Figure("optimizer state", tree_bytes(opt_state), "counted (arrays)"),
        Figure("saved activations, device memory", summary.activation_bytes_device, vjp),
        Figure("saved activations, host memory (offloaded)", summary.activation_bytes_host, vjp),
        Figure("parameters the backward keeps (not extra)", summary.argument_bytes, vjp),
    ]
    source = f"compiled plan (XLA:{jax.devices()[0].platform.upper()} memory_analysis)"
    if shardings is not None:
        shard = f"shard shapes ({mesh_text})"
        figures[0:0] = [
            Figure("parameters, per device", sharded_bytes(params, shardings.params), shard),
            Figure(
                "optimizer state, per device",
                sharded_bytes(opt_state, shardings.opt_state),
                shard,
            ),
        ]
        figures = [
            Figure(f"{f.quantity} (whole batch, all devices)", f.nbytes, f.source)
            if f.quantity.startswith(("saved activations", "parameters the backward"))
            else f
            for f in figures
        ]
        source = source[:-1] + f", per device, {mesh_text})"
    figures += [
        Figure("train step: arguments", plan["argument_bytes"], source),
        Figure("train step: outputs", plan["output_bytes"], source),
        Figure("train step: donated (aliased)", plan["alias_bytes"], source),
        Figure("train step: temporaries", plan["temp_bytes"], source),
    ]
    return figures


def target_plan_figures(
    step_fn: Any, args: tuple, target: Target, job: JobConfig
) -> tuple[list[Figure], dict[str, Any] | None]:
    """This very train step (scan accumulation, state on the device: the CLI refuses the rest)
    compiled for a GPU ``target`` without a GPU: its plan's lines, and its estimated step time
    (``jaxmem.memory.step_time.of_plan``: with its MFU and assumptions; None for a streamed or
    sharded step)."""
    from jaxmem.memory.gpu_plan import compile_for
    from jaxmem.memory.step_time import of_plan
    from jaxmem.memory.work import work_of_hlo

    source = f"compiled plan ({target.compiler()})"
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    compiled = compile_for(step_fn, shapes, target)
    plan = residuals.compiled_plan(compiled)
    peak = residuals.planned_peak(plan)
    r = job.run
    estimate = None
    # a streamed or sharded step's traffic is counted from shapes where it is planned (jaxmem
    # plan / memory --target); here only one device's ordinary step is priced
    if not job.optimizer.stream and not job.parallel.sharded:
        work = work_of_hlo(compiled.as_text(), f"per-kernel count of the {target.name} plan")
        estimate = of_plan(
            work, target, job.model, job.precision, r.batch_size, r.seq_len, adapters=job.adapters
        )
    return [
        Figure(f"{target.name} plan: temporaries", plan["temp_bytes"], source),
        Figure(f"{target.name} plan: host memory (offloaded)", plan["host_temp_bytes"], source),
        Figure(
            f"{target.name} plan: planned peak (of {format_bytes(target.device_memory_bytes)})",
            peak,
            source + ": arguments + outputs - aliased + temporaries",
        ),
    ], estimate


def device_peak_figures() -> list[Figure]:
    """The device's runtime peak so far (``memory_stats()["peak_bytes_in_use"]``), beside the
    plan; none on backends that do not report it (CPU). Read after the steps ran."""
    peak = residuals.device_peak_bytes()
    if peak is None:
        return []
    return [Figure("device peak", peak, "runtime peak (device.memory_stats peak_bytes_in_use)")]


class JaxTrainer:
    """jaxmem's side of ``jaxmem.train.loop.run_job``: the step ``build_step`` builds for the
    job (``StepSpec.of_job``), compiled once, donating."""

    framework = "jax"

    def __init__(
        self, prepared: PreparedJob, console: Console | None = None, target: Target | None = None
    ):
        job = self.job = prepared.job
        console = console or Console()
        cfg, r = job.model, job.run
        self.platform = jax.devices()[0].platform
        self.can_offload = HOST_MEMORY_KIND in backend_memory_kinds()
        weights = None
        if r.init_from is not None and prepared.resume_step is None:
            from jaxmem.model.hf import load_hf_weights, read_hf_weights

            # read (every tensor checked finite) before the random init compiles anything
            weights = read_hf_weights(r.init_from, cfg, job.precision.param_dtype)
        model = make_model(cfg, job.precision, seed=r.seed, adapters=job.adapters)
        self.attention_kernel = model.attention_kernel  # which fused kernel this backend runs
        if weights is not None:
            load_hf_weights(model, r.init_from, weights)
        self.spec = StepSpec.of_job(job, loss_mask=prepared.dataset.masked)
        self.built, params = build_step(self.spec, model)
        del model  # params are donated to the step; keep no second reference
        self.graphdef, self.shardings = self.built.graphdef, self.built.shardings
        self.processes = jax.process_count()
        self.local_rows = None  # a multi-process run reads only this process's rows
        if self.processes > 1:
            self.local_rows = process_rows(self.shardings.batch, r.batch_size)
        # where host-resident parameters go on the device (None: device 0)
        self._where = self.shardings.params if self.shardings is not None else None
        self.host_params = job.optimizer.params_memory != "device" or job.optimizer.stream
        self.streamed = job.optimizer.stream
        self.step_time: dict[str, Any] | None = None  # a GPU target's estimate (--target)
        self._eval = self.built.eval_loss
        self.loss_scale = init_loss_scale(job.precision)
        first = self.transfer(train_batch(prepared.dataset, job, self.local_rows)(1))
        # the run's first line says the adapters and what trains (``describe``)
        self.adapters_text = counts_line(job.adapters, params) if job.adapters.enabled else None
        console.print(
            f"compiling the train step ({cfg.n_params / 1e6:.2f} M params, policy "
            f"{policy_label(job.memory)}, {job.precision.name}, batch {r.batch_size} x seq "
            f"{r.seq_len}, accum {job.accum.steps}) on {self.platform}..."
        )
        self._compile(params, first)
        plan = residuals.compiled_plan(self._step)
        self.planned_bytes = residuals.planned_peak(plan)
        self._figures = self._memory_figures(first, plan)
        if target is not None and target.is_gpu:
            self._plan_for(target, first, console)
        self._valid = [self.transfer(self._local(b)) for b in val_batches(prepared.dataset, job)]
        self.ckpt = None
        if prepared.out_dir is not None:
            from jaxmem.train.checkpoint import RunCheckpointer

            self.ckpt = RunCheckpointer(
                os.path.join(prepared.out_dir, CHECKPOINT_DIR), r.keep_checkpoints
            )

    def _compile(self, params: Any, first: dict[str, jax.Array]) -> None:
        """Place ``params`` and the optimizer's state where the step takes them and compile the
        step for ``first``'s shapes (``self.lowered``: the program, before XLA compiles it); an
        out-of-memory compile reports a cheaper policy."""
        t0 = time.perf_counter()
        try:
            params, opt_state = self.built.state(params)
            opt_state = with_dropout_seed(opt_state, self.job.run.seed)  # adapter dropout's
            if self.job.accum.mode == "multisteps":
                self._step, self.lowered = _multisteps(self.built, params, opt_state, first)
            else:
                self.lowered = self.built.step.lower(params, opt_state, self.loss_scale, first)
                self._step = self.lowered.compile()
        except Exception as e:
            if is_out_of_memory(e):
                raise RunFailed(
                    out_of_memory_message(
                        self.job, None, "while compiling", can_offload=self.can_offload
                    )
                ) from None
            raise
        self.compile_s = time.perf_counter() - t0
        self.params, self.opt_state = params, opt_state

    def _memory_figures(self, first: dict[str, jax.Array], plan: dict[str, int]) -> list[Figure]:
        """The memory table of the compiled step (``memory_figures``; a streamed stack's host
        bytes counted from its arrays)."""
        job = self.job
        shapes = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (self.params, self.opt_state)
        )
        figures = memory_figures(
            self.built.plain_loss,
            *shapes,
            first,
            plan,
            job.accum.steps,
            self._placed_by(self.built.placement) if self.streamed else self.shardings,
            job.parallel.mesh_text(),
            trainable=self.built.trainable,
        )
        if self.streamed:
            _, stack = stream.split(self.params)
            figures.append(
                Figure(
                    "streamed stack in host memory (parameters + optimizer state)"
                    + (", per device" if self.shardings is not None else ""),
                    per_device_bytes((stack, self.opt_state[1])),
                    "counted (arrays in pinned_host)",
                )
            )
        return figures

    def _plan_for(self, target: Target, first: dict[str, jax.Array], console: Console) -> None:
        """This step compiled for a GPU ``target`` without a GPU: its plan's figures and, where
        priced, its estimated step time."""
        console.print(f"planning the same step for {target.description} (no GPU needed)...")
        args = (self.params, self.opt_state, self.loss_scale, first)
        figures, self.step_time = target_plan_figures(self.built.step, args, target, self.job)
        self._figures += figures
        if self.step_time is not None:
            console.print(f"{target.name} plan: {self.step_time['line']}")
            console.print(
                f"  an estimate, not a measurement: {self.step_time['assumptions']}",
                style="dim",
            )
        else:
            console.print(
                f"{target.name} plan: no step-time estimate for a streamed or sharded step "
                "here (jaxmem plan --target prices it, with its transfers from shapes)",
                style="dim",
            )

    def _placed_by(self, where: stream.Placement | None) -> Any:
        """The step's shardings with a streamed step's placement (None: one device)."""
        if self.shardings is None or where is None:
            return None
        return dataclasses.replace(self.shardings, params=where.params, opt_state=where.opt_state)

    def describe(self) -> str:
        where = ""
        if self.shardings is not None:
            where = f" per device, {self.job.parallel.mesh_text()}"
        kernel = KERNEL_NAMES.get(self.attention_kernel)
        return (
            (f"{self.adapters_text}; " if self.adapters_text else "")
            + f"compiled in {self.compile_s:.1f} s, step plans {format_bytes(self.planned_bytes)}"
            f"{where} (compiled plan)" + (f"; fused attention: {kernel}" if kernel else "")
        )

    def transfer(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        if self.processes > 1:  # this process's rows of the global batch
            assert self.shardings is not None
            return {
                k: jax.make_array_from_process_local_data(self.shardings.batch, v)
                for k, v in batch.items()
            }
        if self.shardings is not None:
            return jax.device_put(batch, self.shardings.batch)  # each device its rows
        return jax.device_put(batch)

    def _local(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.local_rows is None:
            return batch
        return {k: v[self.local_rows] for k, v in batch.items()}

    def restore(self, step: int) -> None:
        assert self.ckpt is not None
        self.params, self.opt_state, self.loss_scale, _, _ = self.ckpt.restore(
            step,
            params_like=self.params,
            opt_state_like=self.opt_state,
            loss_scale_like=self.loss_scale,
        )

    def step(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        self.params, self.opt_state, self.loss_scale, metrics = self._step(
            self.params, self.opt_state, self.loss_scale, batch
        )
        return metrics

    def fetch(self, metrics: dict[str, jax.Array]) -> dict[str, Any]:
        out: dict[str, Any] = {"loss": float(host_value(metrics["loss"]))}
        if "grad_norm" in metrics:  # not seen by MultiSteps' caller
            out["grad_norm"] = float(host_value(metrics["grad_norm"]))
        if "lr" in metrics:  # a scheduled learning rate (else the config's, constant)
            out["lr"] = float(host_value(metrics["lr"]))
        if self.loss_scale is not None:
            out["skipped"] = not bool(host_value(metrics["grads_finite"]))
        return out

    def val_loss(self) -> float:
        sums = [self._eval(self.params, b) for b in self._valid]
        if self.processes == 1:
            return float(sum(s for s, _ in sums) / sum(n for _, n in sums))
        total = sum(float(host_value(s)) for s, _ in sums)
        return total / sum(float(host_value(n)) for _, n in sums)

    def save(self, step: int, extra: dict[str, Any]) -> None:
        assert self.ckpt is not None
        self.ckpt.save(
            step,
            params=self.params,
            opt_state=self.opt_state,
            loss_scale=self.loss_scale,
            run_config=self.job.to_dict(),
            extra=extra,
            force=True,
        )

    def memory_label(self) -> str:
        peak = residuals.device_peak_bytes()
        if peak is not None:
            return f"peak {format_bytes(peak)}"
        return f"plan {format_bytes(self.planned_bytes)}"

    def sample(self, prompt: np.ndarray, n_new: int, temperature: float, seed: int) -> np.ndarray:
        from jaxmem.model.generate import generate

        jax.block_until_ready(self.params)
        params = place(self.params, "device", self._where) if self.host_params else self.params
        if self.processes > 1:
            # every process samples the same tokens from its own full copy (generation is a
            # small, sequential program: not worth sharding)
            from jax.experimental import multihost_utils

            params = jax.tree.map(
                jax.numpy.asarray, multihost_utils.process_allgather(params, tiled=True)
            )
        return generate(
            self.graphdef,
            params,
            prompt,
            n_new,
            max_seq_len=self.job.model.max_seq_len,
            temperature=temperature,
            seed=seed,
            pad=PAD if PAD < self.job.model.vocab_size else 0,
        )

    def figures(self) -> list[Figure]:
        return [*self._figures, *device_peak_figures(), rss_figure()]

    def any_process(self, flag: bool) -> bool:
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.array([int(flag)]))))

    def close(self) -> None:
        jax.block_until_ready(self.params)
        if self.ckpt is not None:
            self.ckpt.close()


def run_training(
    prepared: PreparedJob, console: Console | None = None, target: Target | None = None
) -> dict[str, Any]:
    """Train ``prepared.job`` in JAX; returns the run summary. With a GPU ``target`` the memory
    table also shows this step's plan compiled for it (without a GPU)."""
    console = console or Console()
    return run_job(prepared, lambda: JaxTrainer(prepared, console, target), console)


def _multisteps(built: Any, params: Any, opt_state: Any, batch: dict) -> tuple[Any, Any]:
    """``optax.MultiSteps`` accumulation as a step with the scan step's signature: the jitted
    micro-step (``built.step``, compiled once, for one microbatch) runs ``k`` times per step,
    the parameters changing on the k-th. Returns ``(step, lowered micro-step)``; the step's
    ``memory_analysis`` is the micro-step's compiled plan."""
    k = built.spec.accum.steps

    def split(b: dict, i: int) -> dict:
        return {key: v[i * (v.shape[0] // k) : (i + 1) * (v.shape[0] // k)] for key, v in b.items()}

    lowered = built.step.lower(params, opt_state, split(batch, 0), valid_tokens(batch))
    micro = lowered.compile()

    def step(params, opt_state, loss_scale, batch):
        n_total = valid_tokens(batch)
        loss_sum, lr = 0.0, None
        for i in range(k):
            params, opt_state, m = micro(params, opt_state, split(batch, i), n_total)
            loss_sum = loss_sum + m["loss_sum"]
            lr = m.get("lr") if lr is None else lr  # the k-th call's update: the same count
        metrics = {"loss": loss_sum / n_total}
        return params, opt_state, loss_scale, metrics if lr is None else {**metrics, "lr": lr}

    step.memory_analysis = micro.memory_analysis  # type: ignore[attr-defined]
    return step, lowered

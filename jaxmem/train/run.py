"""``jaxmem train`` in JAX: the ``Trainer`` that ``jaxmem.train.loop.run_job`` drives.

``prepare`` checks the job against this backend (offload needs ``pinned_host``; fp16 a backend
that computes in it; optimizer state or parameters in ``pinned_host`` need that memory kind),
then the generic checks of ``jaxmem.train.loop.prepare_job``. ``run_training`` compiles the step
(an out-of-memory compile reports a cheaper policy), restores the latest checkpoint when
resuming, and trains through the shared loop. Parameters and optimizer state are donated to the
step; the host syncs only when the loop fetches metrics.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from rich.console import Console

from jaxmem.config import ConfigError
from jaxmem.data import PAD
from jaxmem.figures import Figure, format_bytes, rss_figure
from jaxmem.job import JobConfig
from jaxmem.memory import residuals
from jaxmem.memory.remat import backend_memory_kinds, check_backend, layers_fn
from jaxmem.memory.targets import Target
from jaxmem.model import make_model
from jaxmem.model.flash import KERNEL_NAMES
from jaxmem.policy import HOST_MEMORY_KIND
from jaxmem.run_layout import CHECKPOINT_DIR
from jaxmem.sharding import (
    ensure_cpu_devices,
    mesh,
    parallel_loss,
    per_device_bytes,
    sharded_bytes,
    step_shardings,
)
from jaxmem.step import stream
from jaxmem.step.scaling import init_loss_scale
from jaxmem.step.train_step import (
    check_precision_backend,
    lm_loss_fn,
    make_multisteps_step,
    make_optimizer,
    make_train_step,
    place,
    stack_accumulating_loss,
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
) -> list[Figure]:
    """The memory table of one training step. Every figure is measured, with its method.
    Residuals are those of one microbatch (what the backward keeps at a time). Over a mesh
    (``shardings``): parameters and optimizer state also per device, from each leaf's shard
    shape; residuals are the whole microbatch's (every device's rows); the plan is per device."""
    if accum_steps > 1:
        batch = jax.tree_util.tree_map(lambda a: a[: a.shape[0] // accum_steps], batch)
    grads_shape = jax.eval_shape(jax.grad(lambda p: loss_fn(p, batch)[0]), params)
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
        estimate = of_plan(work, target, job.model, job.precision, r.batch_size, r.seq_len)
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
    """jaxmem's side of ``jaxmem.train.loop.run_job``: a compiled, donating step."""

    framework = "jax"

    def __init__(
        self, prepared: PreparedJob, console: Console | None = None, target: Target | None = None
    ):
        job = self.job = prepared.job
        console = console or Console()
        cfg, r = job.model, job.run
        self.platform = jax.devices()[0].platform
        self.can_offload = HOST_MEMORY_KIND in backend_memory_kinds()
        model = make_model(cfg, job.precision, seed=r.seed)
        self.attention_kernel = model.attention_kernel  # which fused kernel this backend runs
        if r.init_from is not None and prepared.resume_step is None:
            from jaxmem.model.hf import load_hf_weights

            load_hf_weights(model, r.init_from)  # prepare_job checked every tensor
        self.graphdef, params = nnx.split(model, nnx.Param)
        del model  # params are donated to the step; keep no second reference
        tx = make_optimizer(job.optimizer)
        self.shardings = None
        self.processes = jax.process_count()
        self.local_rows = None  # a multi-process run reads only this process's rows
        if self.processes > 1:
            rows = r.batch_size // self.processes
            self.local_rows = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
        if job.parallel.sharded:
            # the same step over a mesh: parameters and optimizer state placed by the strategy
            # (the state created sharded: jit(tx.init) would otherwise return it replicated)
            self.shardings = step_shardings(
                job.parallel,
                params,
                jax.eval_shape(tx.init, params),
                state_memory=job.optimizer.state_memory,
                params_memory=job.optimizer.params_memory,
            )
            params = jax.device_put(params, self.shardings.params)
        layers = layers_fn(job.memory, cfg.n_layers)
        chunks = job.memory.loss_chunks
        plain_loss = lm_loss_fn(self.graphdef, layers_fn=layers, loss_chunks=chunks)
        self._where = None  # where host-resident parameters go on the device (None: device 0)

        def make_loss(lf: Any) -> Any:
            return lm_loss_fn(self.graphdef, layers_fn=lf, loss_chunks=chunks)

        make_parallel_loss = make_loss  # the loss as the strategy runs it, of a layers_fn
        if self.shardings is not None:
            mesh_ = self.shardings.mesh
            self._where = self.shardings.params

            def make_parallel_loss(lf: Any) -> Any:
                return parallel_loss(make_loss, lf, job.parallel, mesh_)

        loss_fn = make_parallel_loss(layers)
        loss_into = stack_accumulating_loss(make_parallel_loss, job.memory, cfg.n_layers, job.accum)
        self.host_params = job.optimizer.params_memory != "device" or job.optimizer.stream
        self.streamed = job.optimizer.stream
        self.step_time: dict[str, Any] | None = None  # a GPU target's estimate (--target)
        # parameters kept in host memory are brought to the device inside the jitted evaluation
        # (a streamed stack block by block, as the step does)
        eval_loss = (
            make_parallel_loss(stream.streamed_layers_fn(layers)) if self.streamed else loss_fn
        )
        self._eval = jax.jit(
            lambda p, b: eval_loss(
                place(p, "device", self._where) if self.host_params and not self.streamed else p,
                b,
            )[1]
        )
        self.loss_scale = init_loss_scale(job.precision)
        first = self.transfer(train_batch(prepared.dataset, job, self.local_rows)(1))
        t0 = time.perf_counter()
        console.print(
            f"compiling the train step ({cfg.n_params / 1e6:.2f} M params, policy "
            f"{job.memory.name}, {job.precision.name}, batch {r.batch_size} x seq {r.seq_len}, "
            f"accum {job.accum.steps}) on {self.platform}..."
        )
        where = None  # a streamed step's placement over the mesh
        try:
            if job.accum.mode == "multisteps":
                self._step, opt_state = _multisteps(loss_fn, tx, job.accum.steps, params, first)
            else:
                # optimizer state / parameters kept in host memory between steps enter the
                # compiled step there (it moves them to the device for the update and back)
                if self.streamed:
                    # the stack's parameters and state live in host memory between steps and
                    # stream through the step block by block (jaxmem.step.stream)
                    if self.shardings is not None:
                        where = stream.placement(tx, params, self.shardings, job.parallel)
                    params, opt_state = stream.place(params, stream.init_state(tx, params), where)
                elif self.shardings is not None:
                    opt_state = jax.jit(tx.init, out_shardings=self.shardings.opt_state)(params)
                else:
                    opt_state = place(tx.init(params), job.optimizer.state_memory)
                    params = place(params, job.optimizer.params_memory)
                step_fn = (
                    stream.make_streamed_step(
                        make_parallel_loss,
                        layers,
                        tx,
                        accum_steps=job.accum.steps,
                        accum_dtype=jax.numpy.dtype(job.precision.accum_dtype),
                        shardings=self.shardings,
                        placement=where,
                        update=job.optimizer.stream_update or "device",
                    )
                    if self.streamed
                    else make_train_step(
                        loss_fn,
                        tx,
                        precision=job.precision,
                        accum=job.accum,
                        opt_cfg=job.optimizer,
                        shardings=self.shardings,
                        loss_into=loss_into,
                    )
                )
                self._step = step_fn.lower(params, opt_state, self.loss_scale, first).compile()
        except Exception as e:
            if is_out_of_memory(e):
                raise RunFailed(
                    out_of_memory_message(
                        job, None, "while compiling", can_offload=self.can_offload
                    )
                ) from None
            raise
        self.compile_s = time.perf_counter() - t0
        self.params, self.opt_state = params, opt_state
        plan = residuals.compiled_plan(self._step)
        self.planned_bytes = residuals.planned_peak(plan)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, opt_state))
        self._figures = memory_figures(
            plain_loss,
            *shapes,
            first,
            plan,
            job.accum.steps,
            self._placed_by(where) if self.streamed else self.shardings,
            job.parallel.mesh_text(),
        )
        if self.streamed:
            _, stack = stream.split(params)
            self._figures.append(
                Figure(
                    "streamed stack in host memory (parameters + optimizer state)"
                    + (", per device" if self.shardings is not None else ""),
                    per_device_bytes((stack, opt_state[1])),
                    "counted (arrays in pinned_host)",
                )
            )
        if target is not None and target.is_gpu:
            console.print(f"planning the same step for {target.description} (no GPU needed)...")
            figures, self.step_time = target_plan_figures(
                step_fn, (params, opt_state, self.loss_scale, first), target, job
            )
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
        self._valid = [self.transfer(self._local(b)) for b in val_batches(prepared.dataset, job)]
        self.ckpt = None
        if prepared.out_dir is not None:
            from jaxmem.train.checkpoint import RunCheckpointer

            self.ckpt = RunCheckpointer(
                os.path.join(prepared.out_dir, CHECKPOINT_DIR), r.keep_checkpoints
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
            f"compiled in {self.compile_s:.1f} s, step plans {format_bytes(self.planned_bytes)}"
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


def _multisteps(loss_fn: Any, tx: Any, k: int, params: Any, batch: dict) -> tuple[Any, Any]:
    """``optax.MultiSteps`` accumulation as a step with the scan step's signature: the jitted
    micro-step (compiled once, for one microbatch) runs ``k`` times per step, the parameters
    changing on the k-th. Returns ``(step, opt_state)``; the step's ``memory_analysis`` is the
    micro-step's compiled plan."""
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

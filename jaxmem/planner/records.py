"""One training step's memory record in JAX: the same categories as torch_ref's
(``jaxmem.compare.records.torch_record``), every figure measured or derived as its ``*_source``
field says; nothing is filled in unmeasured (a figure a backend cannot give is ``None``).

Records can be built from shapes alone (``abstract=True``: ``jax.ShapeDtypeStruct`` parameters,
no weights allocated) so large presets are planned ahead of time from a laptop. The compiled plan
is the local backend's (``target=LOCAL``) or, for a GPU target, XLA:CUDA's, compiled without the
GPU (``jaxmem.memory.gpu_plan``). XLA:CPU's plan is far from a GPU's (it keeps remat only under
scan and erases host offload); every record names the compiler and target of its plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmem.config import AccumConfig, ConfigError, ModelConfig, OptimizerConfig
from jaxmem.data import lm_batch
from jaxmem.figures import process_max_rss_bytes
from jaxmem.memory import analytic
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.memory.remat import layers_fn
from jaxmem.memory.residuals import (
    bytes_by_name,
    device_peak_bytes,
    plan_of_lowered,
    saved_residuals,
    summarize_residuals,
)
from jaxmem.memory.residuals import (
    planned_peak as peak_of_plan,
)
from jaxmem.memory.targets import LOCAL, Target
from jaxmem.model import make_model
from jaxmem.model.flash import KERNEL_NAMES
from jaxmem.parallel import ParallelConfig, tensor_share
from jaxmem.policy import MemoryPolicy
from jaxmem.precision import Precision
from jaxmem.sharding import mesh, parallel_loss, sharded_bytes, step_shardings
from jaxmem.step.scaling import init_loss_scale
from jaxmem.step.train_step import (
    lm_loss_fn,
    make_optimizer,
    make_train_step,
    stack_accumulating_loss,
    tree_bytes,
)

RECORD_FIELDS = (
    "framework",
    "policy",
    "precision",
    "params_bytes",
    "grads_bytes",
    "opt_state_bytes",
    "saved_activation_bytes_device",
    "saved_activation_bytes_host",
    "analytic_activation_bytes",
    "compiled_temp_bytes",
    "flops",
    "model_flops",
    "peak_bytes",
    "peak_source",
    "saved_by_name",
    "saved_argument_bytes",
    "saved_parameter_copy_bytes",
    "analytic_source",
    "accum",
)


def lm_step_batch(cfg: ModelConfig, batch: int, seq_len: int, abstract: bool) -> dict[str, Any]:
    """The deterministic batch a record measures (shapes only when ``abstract``)."""
    if abstract:
        spec = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
        return {"inputs": spec, "targets": spec}
    inputs, targets = lm_batch(cfg, batch, seq_len, seed=0)
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}


def _local_key(devices: int = 1) -> str:
    """What a local plan is compiled for (``residuals.plan_of_lowered``)."""
    return f"local:{jax.devices()[0].platform}:{devices}"


def _compile(step: Any, args: tuple, target: Target) -> tuple[dict[str, int], str]:
    """The compiled plan of ``step`` for ``target`` (deviceless for a GPU target;
    ``compiled_plan``), and which compiler made it."""
    if target.is_gpu:
        from jaxmem.memory.gpu_plan import compile_lowered, lower_placed, on_target, plan_key

        lowered = lower_placed(step, on_target(args, target))
        plan = plan_of_lowered(lowered, plan_key(target), compile_lowered, with_work=True)
        return plan, target.compiler()
    plan = plan_of_lowered(step.lower(*args), _local_key())
    return plan, f"XLA:{jax.devices()[0].platform.upper()} (local backend)"


def _compile_sharded(
    parallel: ParallelConfig,
    make_loss: Any,
    policy: MemoryPolicy,
    n_layers: int,
    tx: Any,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    accum_cfg: AccumConfig,
    args: tuple,
    target: Target,
) -> tuple[Any, Any, str]:
    """The train step over a mesh of ``parallel.devices`` devices (this backend's, or a GPU
    target's without any GPU), compiled from shapes: ``(shardings, plan, compiler)`` (the plan:
    ``compiled_plan``, per device)."""
    params, opt_state, scale, data = args
    devices = None
    if target.is_gpu:
        from jaxmem.memory.gpu_plan import target_devices

        devices = target_devices(target, parallel.devices)
    m = mesh(parallel, devices)
    loss = parallel_loss(make_loss, layers_fn(policy, n_layers), parallel, m)
    loss_into = stack_accumulating_loss(
        lambda lf: parallel_loss(make_loss, lf, parallel, m), policy, n_layers, accum_cfg
    )
    shardings = step_shardings(
        parallel,
        params,
        opt_state,
        state_memory=opt_cfg.state_memory,
        params_memory=opt_cfg.params_memory,
        m=m,
    )
    step = make_train_step(
        loss,
        tx,
        precision=precision,
        opt_cfg=opt_cfg,
        accum=accum_cfg,
        shardings=shardings,
        loss_into=loss_into,
    )

    placed_args = (
        _placed(params, shardings.params),
        _placed(opt_state, shardings.opt_state),
        _everywhere(scale, shardings.replicated),  # None (no loss scaling) stays None
        _everywhere(data, shardings.batch),
    )
    plan, compiler = _compile_on_mesh(step, placed_args, target, parallel)
    return shardings, plan, compiler


def _placed(tree: Any, where: Any) -> Any:
    """``tree``'s leaves as shape structs placed by the matching shardings of ``where``."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, where
    )


def _everywhere(tree: Any, sharding: Any) -> Any:
    """``tree``'s leaves as shape structs all placed by ``sharding``."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
    )


def _compile_on_mesh(
    step: Any, placed_args: tuple, target: Target, parallel: ParallelConfig
) -> tuple[dict[str, int], str]:
    """The plan of ``step`` from ``placed_args`` (shape structs placed on the mesh's devices) and
    which compiler made it, per device of ``parallel``'s mesh."""
    if target.is_gpu:
        from jaxmem.memory.gpu_plan import compile_lowered, lower_placed, plan_key

        lowered = lower_placed(step, placed_args)
        plan = plan_of_lowered(
            lowered, plan_key(target, parallel.devices), compile_lowered, with_work=True
        )
        return plan, f"{target.compiler()}, per device of {parallel.mesh_text()}"
    plan = plan_of_lowered(step.lower(*placed_args), _local_key(parallel.devices))
    platform = jax.devices()[0].platform.upper()
    return plan, f"XLA:{platform} (local backend), per device of {parallel.mesh_text()}"


def step_time(plan: Any, target: Target, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """``jaxmem.memory.step_time.of_plan`` (None for the local backend or a plan without its
    work)."""
    from jaxmem.memory.step_time import of_plan

    return of_plan(getattr(plan, "work", None), target, *args, **kwargs)


def _platform(target: Target) -> str:
    """The platform the step is planned for: the target's (a GPU's), or this backend's."""
    return "gpu" if target.is_gpu else jax.devices()[0].platform


def plan_step(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    batch: int,
    seq_len: int,
    target: Target = LOCAL,
    accum: int = 1,
    parallel: ParallelConfig | None = None,
) -> dict[str, Any]:
    """Only the compiled plan of the train step ``jax_record`` plans (from shapes; no residual
    accounting, no FLOPs): the compiler, the plan's bytes and its planned peak (arguments +
    outputs - aliased + temporaries; per device over ``parallel``'s mesh). Cheap enough to
    search for the largest batch that fits, or for ``jaxmem plan``'s candidates. A streamed
    step (``opt_cfg.stream``) is ``stream_plan``'s."""
    if opt_cfg.stream:
        return stream_plan(cfg, policy, precision, opt_cfg, batch, seq_len, target, accum, parallel)
    model = nnx.eval_shape(lambda: make_model(cfg, precision, platform=_platform(target)))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(opt_cfg)
    opt_state = jax.eval_shape(tx.init, params)
    data = lm_step_batch(cfg, batch, seq_len, abstract=True)
    accum_cfg = _accum_config(accum, batch)
    args = (params, opt_state, init_loss_scale(precision), data)
    if parallel is not None and parallel.sharded:
        parallel.check_batch(batch, accum)
    *_, plan, compiler = _compile_step(
        graphdef, cfg.n_layers, policy, tx, precision, opt_cfg, accum_cfg, args, target, parallel
    )
    state_link = 0
    if target.is_gpu and opt_cfg.state_memory == "pinned_host":  # in and out every step
        shards = 1
        if parallel is not None and parallel.sharded:  # the state's shards (jaxmem.sharding)
            shards = parallel.tp * (parallel.data if parallel.strategy != "dp" else 1)
        state_link = 2 * tree_bytes(opt_state) // shards
    return {
        "compiler": compiler,
        "compiled_plan": plan,
        "planned_peak_bytes": peak_of_plan(plan),
        "step_time": step_time(
            plan, target, cfg, precision, batch, seq_len, parallel, state_link_bytes=state_link
        ),
    }


def stream_plan(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    batch: int,
    seq_len: int,
    target: Target = LOCAL,
    accum: int = 1,
    parallel: ParallelConfig | None = None,
) -> dict[str, Any]:
    """The compiled plan of a streamed step (``optimizer.stream``, ``jaxmem.step.stream``), with
    what a deviceless plan cannot show counted from shapes; over ``parallel``'s mesh (dp, zero1,
    fsdp: ``jaxmem.step.stream.placement``), one device's, every figure from its shards.

    XLA compiles the step with the stack's parameters and state arriving in device memory (a
    deviceless compile drops argument memory kinds) and moving them to host memory inside; the
    plan's host bytes and its device temporaries (the blocks' fetched parameters, gradients
    leaving block by block, the block-by-block update) are XLA's. From shapes: the host-resident
    stack (parameters and state), left out of the device's arguments and counted once in host
    memory (the plan's in-step copy of it is not made where they already live there), and the
    outputs a donated step writes over its inputs (the plan is compiled without donation:
    XLA's host-offload check refuses a device argument donated to a host output)."""
    from jaxmem.step import stream

    model = nnx.eval_shape(lambda: make_model(cfg, precision, platform=_platform(target)))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(opt_cfg)
    opt_state = jax.eval_shape(lambda p: stream.init_state(tx, p), params)
    data = lm_step_batch(cfg, batch, seq_len, abstract=True)
    _accum_config(accum, batch)
    update = opt_cfg.stream_update or "device"
    scale = init_loss_scale(precision)  # fp16's dynamic loss scale (None otherwise)

    def make_loss(lf: Any) -> Any:
        return lm_loss_fn(graphdef, layers_fn=lf, loss_chunks=policy.loss_chunks)

    def streamed(loss: Any, **where: Any) -> Any:
        return stream.make_streamed_step(
            loss,
            layers_fn(policy, cfg.n_layers),
            tx,
            accum_steps=accum,
            accum_dtype=jnp.dtype(precision.accum_dtype),
            donate=False,
            update=update,
            **where,
        )

    if parallel is None or not parallel.sharded:
        plan, compiler = _compile(streamed(make_loss), (params, opt_state, scale, data), target)
        host_resident = stream.host_bytes(params, opt_state)
        rest, _ = stream.split(params)
        # written over in place when donated
        donated = tree_bytes(rest) + tree_bytes(opt_state[0])
        local = (params, opt_state)
    else:
        plan, compiler, (host_resident, donated), local = _stream_plan_sharded(
            parallel, make_loss, streamed, tx, params, opt_state, scale, data, batch, accum, target
        )
    device_peak = peak_of_plan(plan) - host_resident - donated
    # the plan's host temporaries hold its in-step copy of the resident stack (not made on a
    # real run, where it already lives in host memory) and the stack's new values (written over
    # the old in place); what remains is the gradient and update's host working set
    host_working = plan["host_temp_bytes"] - host_resident
    transfers = stream_transfers(*local, policy, precision, target, accum, update)
    return {
        "compiler": compiler,
        "compiled_plan": plan,
        "planned_peak_bytes": device_peak,
        # the program's own host copies include moving the resident stack to host memory (a
        # deviceless compile's arguments arrive on the device): priced from shapes instead
        "step_time": step_time(
            plan,
            target,
            cfg,
            precision,
            batch,
            seq_len,
            parallel,
            state_link_bytes=transfers["total_bytes"],
            host_update_bytes=transfers.get("host_update", {}).get("bytes", 0),
            program_host_copies=False,
        ),
        "stream": {
            "host_resident_bytes": host_resident,
            "host_working_bytes": host_working,
            "host_peak_bytes": host_resident + host_working,
            "donated_bytes": donated,
            "source": "compiled plan (device temporaries, host bytes), corrected from shapes: "
            "the stack's parameters and optimizer state live in host memory (left out of the "
            "device's arguments), the rest's updated parameters and state are written over "
            "their inputs (donation)",
            "update": update,
            # one device's: its shards of the stack over a mesh
            "transfers": transfers,
        },
    }


def _stream_plan_sharded(
    parallel: ParallelConfig,
    make_loss: Any,
    streamed: Any,
    tx: Any,
    params: Any,
    opt_state: Any,
    scale: Any,
    data: Any,
    batch: int,
    accum: int,
    target: Target,
) -> tuple[dict[str, int], str, tuple[int, int], tuple[Any, Any]]:
    """A streamed step over ``parallel``'s mesh (this backend's devices, or a GPU target's
    without any GPU), compiled from shapes placed as ``jaxmem train`` places them: its plan, the
    compiler, one device's host-resident and donated bytes, and its shards of the parameters and
    optimizer state (shapes)."""
    from jaxmem.step import stream

    parallel.check_batch(batch, accum)
    devices = None
    if target.is_gpu:
        from jaxmem.memory.gpu_plan import target_devices

        devices = target_devices(target, parallel.devices)
    m = mesh(parallel, devices)
    shardings = step_shardings(parallel, params, jax.eval_shape(tx.init, params), m=m)
    where = stream.placement(tx, params, shardings, parallel)
    step = streamed(
        lambda lf: parallel_loss(make_loss, lf, parallel, m),
        shardings=shardings,
        placement=where,
    )

    args = (
        _placed(params, where.params),
        _placed(opt_state, where.opt_state),
        _everywhere(scale, shardings.replicated),  # None (no loss scaling) stays None
        _everywhere(data, shardings.batch),
    )
    plan, compiler = _compile_on_mesh(step, args, target, parallel)
    rest_sh, stack_sh = stream.split(where.params)
    rest, stack = stream.split(params)
    host_resident = sharded_bytes(stack, stack_sh) + sharded_bytes(opt_state[1], where.opt_state[1])
    donated = sharded_bytes(rest, rest_sh) + sharded_bytes(opt_state[0], where.opt_state[0])

    def shards(tree: Any, sh: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(s.shard_shape(tuple(x.shape)), x.dtype), tree, sh
        )

    local = (shards(params, where.params), shards(opt_state, where.opt_state))
    return plan, compiler, (host_resident, donated), local


def stream_transfers(
    params: Any,
    opt_state: Any,
    policy: MemoryPolicy,
    precision: Precision,
    target: Target,
    accum: int = 1,
    update: str = "device",
) -> dict[str, Any]:
    """Bytes a streamed step moves between host and device memory, from shapes, and the time
    they take over the target's host link (an estimate: datasheet bandwidth, no overlap with
    compute assumed or excluded). A ``host`` update moves none of the update's arrays over the
    link: its reads and writes of host memory are estimated instead (``host_update``, at the
    target's assumed host-memory rate)."""
    from jaxmem.memory.targets import rates_for
    from jaxmem.step import stream

    _, stack = stream.split(params)
    p = tree_bytes(stack)
    state = tree_bytes(opt_state[1])
    fetches = 2 if policy.remat else 1  # a remat policy replays the block: fetched again
    moved = {
        "parameters to the device": accum * fetches * p,
        "gradients to host": accum * p,
    }
    if update == "device":
        moved["update: parameters, gradients and state to the device"] = 2 * p + state
        moved["update: parameters and state to host"] = p + state
    if accum > 1:  # each microbatch's gradient added to the running sum, block by block
        moved["accumulation: running sum and gradient in, sum out"] = accum * 3 * p
    total = sum(moved.values())
    rates = rates_for(target)
    out = {
        "bytes": moved,
        "total_bytes": total,
        "seconds": total / rates.host_link,
        "source": f"estimate: bytes from shapes over {rates.host_link / 1e9:.0f} GB/s "
        f"({rates.source})",
    }
    # the same arrays read and written in host memory instead; fp16's overflow check reads the
    # stack's gradient there whatever the update's place
    touched = (2 * p + state) + (p + state) if update == "host" else 0
    checked = p if precision.loss_scale == "dynamic" else 0
    if touched or checked:
        what = [
            "parameters, gradient and state read, parameters and state written" * bool(touched),
            "the gradient read for fp16's overflow check" * bool(checked),
        ]
        out["host_update"] = {
            "bytes": touched + checked,
            "seconds": (touched + checked) / rates.host_memory,
            "source": f"estimate: {'; '.join(w for w in what if w)}, from shapes, at "
            f"{rates.host_memory / 1e9:.0f} GB/s ({rates.host_source})",
        }
    return out


def require_one_device(parallel: ParallelConfig | None) -> None:
    """``jaxmem peak`` explains a streamed step on one device (``stream_plan`` plans it over a
    mesh)."""
    if parallel is not None and parallel.sharded:
        raise ConfigError(
            f"jaxmem peak explains a streamed step on one device: --mesh {parallel.mesh_text()} "
            "with --stream is planned by jaxmem plan (--state-offload) and trained by jaxmem "
            "train; drop --mesh to explain one device's"
        )


def _compile_step(
    graphdef: Any,
    n_layers: int,
    policy: MemoryPolicy,
    tx: Any,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    accum_cfg: AccumConfig,
    args: tuple,
    target: Target,
    parallel: ParallelConfig | None,
) -> tuple[Any, Any, Any, str]:
    """The train step compiled from ``args`` for ``target``, on one device or over
    ``parallel``'s mesh: ``(step, shardings, plan, compiler)`` (``step``: the one-device
    jitted step, None when sharded; ``shardings``: None on one device; ``plan``:
    ``compiled_plan``)."""
    if parallel is not None and parallel.sharded:
        shardings, plan, compiler = _compile_sharded(
            parallel,
            lambda lf: lm_loss_fn(graphdef, layers_fn=lf, loss_chunks=policy.loss_chunks),
            policy,
            n_layers,
            tx,
            precision,
            opt_cfg,
            accum_cfg,
            args,
            target,
        )
        return None, shardings, plan, compiler
    step = _one_device_step(graphdef, policy, n_layers, tx, precision, opt_cfg, accum_cfg)
    plan, compiler = _compile(step, args, target)
    return step, None, plan, compiler


def _one_device_step(
    graphdef: Any,
    policy: MemoryPolicy,
    n_layers: int,
    tx: Any,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    accum: AccumConfig,
) -> Any:
    """The jitted train step on one device (accumulating the stack's gradient in place)."""

    def make_loss(lf: Any) -> Any:
        return lm_loss_fn(graphdef, layers_fn=lf, loss_chunks=policy.loss_chunks)

    return make_train_step(
        make_loss(layers_fn(policy, n_layers)),
        tx,
        precision=precision,
        opt_cfg=opt_cfg,
        accum=accum,
        loss_into=stack_accumulating_loss(make_loss, policy, n_layers, accum),
    )


def runnable_step(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    batch: int,
    seq_len: int,
    accum: int = 1,
) -> tuple[Any, tuple]:
    """The train step ``jax_record`` and ``plan_step`` plan (a streamed one with
    ``opt_cfg.stream``), on this backend's first device, with real inputs placed where it takes
    them: ``(step, args)``; ``step(*args)`` returns ``(params, opt_state, loss_scale, metrics)``
    and donates its inputs, so a loop threads the first three back in. For timing a step and
    reading a device's runtime peak (``benchmarks/gpu_check.py``)."""
    from jaxmem.step import stream

    model = make_model(cfg, precision)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(opt_cfg)
    data = lm_step_batch(cfg, batch, seq_len, abstract=False)
    accum_cfg = _accum_config(accum, batch)
    if not opt_cfg.stream:
        step = _one_device_step(graphdef, policy, cfg.n_layers, tx, precision, opt_cfg, accum_cfg)
        return step, (params, tx.init(params), init_loss_scale(precision), data)
    params, opt_state = stream.place(params, stream.init_state(tx, params))
    step = stream.make_streamed_step(
        lambda lf: lm_loss_fn(graphdef, layers_fn=lf, loss_chunks=policy.loss_chunks),
        layers_fn(policy, cfg.n_layers),
        tx,
        accum_steps=accum,
        accum_dtype=jnp.dtype(precision.accum_dtype),
        update=opt_cfg.stream_update or "device",
    )
    return step, (params, opt_state, init_loss_scale(precision), data)


def _accum_config(accum: int, batch: int) -> AccumConfig:
    config = AccumConfig(steps=accum)
    config.check_batch(batch)
    return config


def _state_offload(opt_state: Any, planned_peak: int, target: Target) -> dict[str, Any]:
    """Optimizer state in ``pinned_host`` under a GPU target, counted from shapes: a deviceless
    compile drops argument memory kinds, so the plan (compiled with the state on the device) is
    the upper bound, the step bringing the whole state in for the update; the lower bound is
    that plan without the state, as if XLA streamed it leaf by leaf."""
    state = tree_bytes(opt_state)
    lower = planned_peak - state
    return {
        "host_bytes": state,
        "device_peak_upper_bytes": planned_peak,
        "device_peak_lower_bytes": lower,
        "fits_lower": lower <= target.device_memory_bytes,
        "source": "analytic: optimizer-state bytes from shapes; a deviceless compile drops "
        "argument memory kinds, so the plan holds the state on the device (upper bound: the "
        "whole state brought in for the update; lower bound: the plan minus the state)",
    }


def jax_record(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    batch: int,
    seq_len: int,
    *,
    abstract: bool = False,
    target: Target = LOCAL,
    accum: int = 1,
    parallel: ParallelConfig | None = None,
) -> dict[str, Any]:
    """Measure one jaxmem training step (or plan it from shapes when ``abstract``; always from
    shapes for a GPU target). ``accum``: the step scans that many microbatches of the batch;
    saved activations and FLOPs are then one microbatch's and the whole step's.

    ``parallel`` (more than one device): the step is planned over a mesh of that many devices
    (this backend's, or one host of the GPU target's) and the record is **per device**:
    parameters, gradients and optimizer state from their shard shapes, saved activations and
    FLOPs of one device's rows of the batch (data parallel: batch / N), the compiled plan of one
    device."""
    sharded = parallel is not None and parallel.sharded
    abstract = abstract or target.is_gpu or sharded
    state_offload = target.is_gpu and opt_cfg.state_memory == "pinned_host"
    if target.is_gpu and opt_cfg.params_memory == "pinned_host":
        # the step brings host-resident parameters to the device for its whole length: the
        # device holds them as if they stayed there, and a deviceless plan cannot tell
        raise ConfigError(
            f"--target {target.name} cannot plan optimizer.params_memory='pinned_host': a "
            "deviceless compile drops argument memory kinds, and the step holds the parameters "
            "on the device throughout anyway; plan with params_memory='device'"
        )
    if state_offload:
        # a deviceless compile drops argument memory kinds: plan the step with the state on the
        # device and count what offloading it moves, analytically (below)
        opt_cfg = dataclasses.replace(opt_cfg, state_memory="device")
    if abstract:
        model = nnx.eval_shape(lambda: make_model(cfg, precision, platform=_platform(target)))
    else:
        model = make_model(cfg, precision)
    kernel = model.attention_kernel
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(opt_cfg)
    opt_state = jax.eval_shape(tx.init, params) if abstract else tx.init(params)
    accum_cfg = _accum_config(accum, batch)
    data = lm_step_batch(cfg, batch, seq_len, abstract)
    n_dev = parallel.data if sharded else 1  # the batch splits over the data axis only
    if sharded:
        parallel.check_batch(batch, accum)
    # one microbatch of one device (its shapes are what the accounting needs)
    micro = (
        data
        if accum == 1 and n_dev == 1
        else lm_step_batch(cfg, batch // accum // n_dev, seq_len, abstract)
    )
    layers = layers_fn(policy, cfg.n_layers)
    loss = lm_loss_fn(graphdef, layers_fn=layers, loss_chunks=policy.loss_chunks)

    def f(p, b):
        return loss(p, b)[0]

    saved = saved_residuals(f, params, micro)
    if sharded and parallel.tensor_parallel:  # one tensor device's share of each residual
        saved = [
            dataclasses.replace(r, nbytes=r.nbytes // tensor_share(r.name, cfg, parallel))
            for r in saved
        ]
    residuals = summarize_residuals(saved)
    flops_of = f
    if kernel == "cudnn":  # an opaque custom call: count its matmuls as the blockwise kernel's
        blockwise = nnx.eval_shape(lambda: make_model(cfg, precision, platform="cpu"))
        blockwise_loss = lm_loss_fn(
            nnx.split(blockwise, nnx.Param)[0], layers_fn=layers, loss_chunks=policy.loss_chunks
        )

        def flops_of(p, b):
            return blockwise_loss(p, b)[0]

    grads = jax.eval_shape(jax.grad(f), params, micro)
    scale = init_loss_scale(precision)
    step, shardings, plan, compiler = _compile_step(
        graphdef,
        cfg.n_layers,
        policy,
        tx,
        precision,
        opt_cfg,
        accum_cfg,
        (params, opt_state, scale, data),
        target,
        parallel if sharded else None,
    )
    planned_peak = peak_of_plan(plan)
    peak, peak_source = None, None
    if not abstract and jax.devices()[0].platform != "cpu":
        step(params, opt_state, scale, data)
        peak = device_peak_bytes()
        peak_source = (
            "runtime peak (device.memory_stats peak_bytes_in_use: the process's high-water mark)"
        )
    if peak is None:
        peak = planned_peak
        peak_source = f"compiled plan ({compiler}): arguments + outputs - aliased + temporaries"
    estimate = analytic.saved_activation_bytes(
        cfg, policy, batch // accum // n_dev, seq_len, precision, parallel if sharded else None
    )
    flops = accum * grad_matmul_flops(flops_of, params, micro)
    model_flops = analytic.model_flops(cfg, batch // n_dev, seq_len)
    if sharded and parallel.tensor_parallel:
        # every block matmul splits over the tensor devices (heads, columns, rows); the LM head
        # (forward and its two backward matmuls) runs whole on each
        head = accum * analytic.head_flops(cfg, batch // accum // n_dev, seq_len)
        flops = head + (flops - head) // parallel.tp
        model_flops = model_flops // parallel.tp
    sizes = {"params": tree_bytes(params), "grads": tree_bytes(grads), "opt": tree_bytes(opt_state)}
    if shardings is not None:  # per device: each leaf's shard
        grads_sharding = shardings.params  # zero1/dp: replicated like the parameters
        sizes = {
            "params": sharded_bytes(params, shardings.params),
            "grads": sharded_bytes(grads, grads_sharding),
            "opt": sharded_bytes(opt_state, shardings.opt_state),
        }
    return {
        "framework": "jax",
        "translation": (
            "jaxmem.memory.remat (jax.checkpoint per block, stack unrolled)"
            if policy.unroll or not policy.layers.is_all
            else "jaxmem.memory.remat (jax.checkpoint under lax.scan)"
        )
        + (
            f"; the LM head and loss in {policy.loss_chunks} chunks "
            "(jaxmem.model.loss.chunked_lm_loss)"
            if policy.loss_chunks
            else ""
        ),
        "policy": policy.name,
        "precision": precision.name,
        "attention_kernel": KERNEL_NAMES.get(kernel, kernel),
        "batch": batch,
        "seq_len": seq_len,
        "accum": accum,
        "planned_from_shapes": abstract,
        "params_bytes": sizes["params"],
        "grads_bytes": sizes["grads"],
        "opt_state_bytes": sizes["opt"],
        "mesh": parallel.mesh_text() if sharded else None,
        "per_device": sharded,
        "saved_activation_bytes_device": residuals.activation_bytes_device,
        "saved_activation_bytes_host": residuals.activation_bytes_host,
        "saved_source": "residual accounting (jaxpr of jax.vjp; parameters excluded)"
        + (
            f"; one tensor device's share by tag (Megatron's layout over tp={parallel.tp}, "
            f"sequence parallel: {'yes' if parallel.sequence_parallel else 'no'}; untagged "
            "residuals whole)"
            if sharded and parallel.tensor_parallel
            else ""
        ),
        "saved_by_name": bytes_by_name(saved),
        "saved_argument_bytes": residuals.argument_bytes,
        "saved_parameter_copy_bytes": residuals.parameter_copy_bytes,
        "analytic_activation_bytes": estimate.device_bytes + estimate.host_bytes,
        "analytic_source": analytic.ANALYTIC_SOURCE,
        "compiled_temp_bytes": plan["temp_bytes"],
        "compiled_plan": plan,
        "flops": flops,  # per device when sharded
        "flops_source": "matmul FLOPs of the gradient's jaxpr (recompute included: hardware FLOPs)"
        + (
            "; per tensor device: the blocks' matmuls over tp, the LM head's whole"
            if sharded and parallel.tensor_parallel
            else ""
        )
        + (
            "; cuDNN's attention counted as the blockwise kernel's (the same FlashAttention-2 "
            "matmuls)"
            if kernel == "cudnn"
            else ""
        ),
        "model_flops": model_flops,
        "peak_bytes": peak,
        "peak_source": peak_source,
        "target": target.name,
        "compiler": compiler,
        "planned_peak_bytes": planned_peak,
        "plan_host_bytes": plan["host_temp_bytes"] + plan["host_argument_bytes"],
        "device_memory_bytes": target.device_memory_bytes,
        # fitting is jaxmem's check: a deviceless compile never fails for lack of memory
        "fits": None
        if target.device_memory_bytes is None
        else planned_peak <= target.device_memory_bytes,
        "state_offload": _state_offload(opt_state, planned_peak, target) if state_offload else None,
        # the state in host memory comes in for the update and goes back (its shards)
        "step_time": step_time(
            plan,
            target,
            cfg,
            precision,
            batch,
            seq_len,
            parallel if sharded else None,
            state_link_bytes=2 * sizes["opt"] if state_offload else 0,
        ),
        # the OS's high-water mark of this whole process (everything so far)
        "process_max_rss_bytes": process_max_rss_bytes(),
        "process_max_rss_source": "OS (getrusage ru_maxrss), whole process so far, host",
    }

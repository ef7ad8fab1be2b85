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

from jaxmem.config import ConfigError, ModelConfig
from jaxmem.data import lm_batch
from jaxmem.figures import process_max_rss_bytes
from jaxmem.memory import analytic
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.memory.residuals import (
    bytes_by_name,
    device_peak_bytes,
    saved_residuals,
    summarize_residuals,
)
from jaxmem.memory.residuals import (
    planned_peak as peak_of_plan,
)
from jaxmem.memory.targets import Target
from jaxmem.model import make_model
from jaxmem.model.flash import KERNEL_NAMES
from jaxmem.parallel import tensor_share
from jaxmem.planner.plans import compile_step, planned, require_one_device, spec_step_time
from jaxmem.policy import MemoryPolicy
from jaxmem.sharding import sharded_bytes
from jaxmem.step.build import BuiltStep, batch_shapes_of, build_step, model_shapes
from jaxmem.step.scaling import init_loss_scale
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import lm_loss_fn, tree_bytes

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


def lm_step_batch(
    cfg: ModelConfig, batch: int, seq_len: int, abstract: bool, *, masked: bool = False
) -> dict[str, Any]:
    """The deterministic batch a record measures (shapes only when ``abstract``); ``masked``:
    with a loss mask, as instruction data has (here the second half of every row counts)."""
    if abstract:
        return batch_shapes_of(batch, seq_len, masked=masked)
    inputs, targets = lm_batch(cfg, batch, seq_len, seed=0)
    data = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    if masked:
        row = (jnp.arange(seq_len) >= seq_len // 2).astype(jnp.int32)
        data["mask"] = jnp.broadcast_to(row, (batch, seq_len))
    return data


def runnable_step(spec: StepSpec) -> tuple[Any, tuple]:
    """The train step ``jax_record`` and ``plan_step`` plan for ``spec`` (one device), on this
    backend's first device, with real inputs placed where it takes them: ``(step, args)``;
    ``step(*args)`` returns ``(params, opt_state, loss_scale, metrics)`` and donates its inputs,
    so a loop threads the first three back in. For timing a step and reading a device's runtime
    peak (``benchmarks/gpu_check.py``)."""
    require_one_device(spec.parallel)
    built, params = build_step(spec, make_model(spec.model, spec.precision, adapters=spec.adapters))
    params, opt_state = built.state(params)
    data = lm_step_batch(
        spec.model, spec.batch, spec.seq_len, abstract=False, masked=spec.loss_mask
    )
    return built.step, (params, opt_state, init_loss_scale(spec.precision), data)


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


def record_spec(spec: StepSpec) -> StepSpec:
    """``spec`` as ``jax_record`` compiles it: a GPU target's optimizer state in host memory is
    planned on the device (a deviceless compile drops argument memory kinds; what offloading it
    moves is counted from shapes) and its parameters must stay on the device."""
    opt, target = spec.optimizer, spec.target
    if target.is_gpu and opt.params_memory == "pinned_host":
        # the step brings host-resident parameters to the device for its whole length: the
        # device holds them as if they stayed there, and a deviceless plan cannot tell
        raise ConfigError(
            f"--target {target.name} cannot plan optimizer.params_memory='pinned_host': a "
            "deviceless compile drops argument memory kinds, and the step holds the parameters "
            "on the device throughout anyway; plan with params_memory='device'"
        )
    if target.is_gpu and opt.state_memory == "pinned_host":
        return spec.replace(optimizer=dataclasses.replace(opt, state_memory="device"))
    return spec


def _saved(spec: StepSpec, built: BuiltStep, params: Any, micro: Any) -> list:
    """The residuals one microbatch's backward keeps (one tensor device's share by tag)."""
    saved = saved_residuals(lambda p, b: built.plain_loss(p, b)[0], params, micro)
    if spec.sharded and spec.parallel.tensor_parallel:
        saved = [
            dataclasses.replace(
                r, nbytes=r.nbytes // tensor_share(r.name, spec.model, spec.parallel)
            )
            for r in saved
        ]
    if spec.sharded and spec.parallel.context_parallel:  # every tensor split by sequence
        saved = [dataclasses.replace(r, nbytes=r.nbytes // spec.parallel.cp) for r in saved]
    return saved


def _flops(spec: StepSpec, built: BuiltStep, kernel: str, params: Any, micro: Any) -> tuple:
    """``(flops, model_flops)`` of the whole step (per tensor device over a tensor axis)."""
    cfg, accum, n_dev = spec.model, spec.accum.steps, spec.data_devices
    loss = built.plain_loss
    if kernel == "cudnn":  # an opaque custom call: count its matmuls as the blockwise kernel's
        blockwise = nnx.eval_shape(lambda: make_model(cfg, spec.precision, platform="cpu"))
        loss = lm_loss_fn(
            nnx.split(blockwise, nnx.Param)[0],
            layers_fn=built.layers,
            loss_chunks=spec.policy.loss.chunks_for(spec.seq_len),
        )
    # the step's own gradient: of the trained subtree only under a frozen base
    of, (trained, frozen) = built.trainable.frozen_loss(lambda p, b: loss(p, b)[0], params)
    flops = accum * grad_matmul_flops(of, trained, micro, frozen)
    model_flops = analytic.model_flops(cfg, spec.batch // n_dev, spec.seq_len, spec.adapters)
    if spec.sharded and spec.parallel.tensor_parallel:
        # every block matmul splits over the tensor devices (heads, columns, rows); the LM head
        # (forward and its two backward matmuls) runs whole on each
        head = accum * analytic.head_flops(cfg, spec.micro_rows, spec.seq_len)
        flops = head + (flops - head) // spec.parallel.tp
        model_flops = model_flops // spec.parallel.tp
    if spec.sharded and spec.parallel.context_parallel:  # each device its S/cp queries' work
        flops, model_flops = flops // spec.parallel.cp, model_flops // spec.parallel.cp
    return flops, model_flops


def _kernel_label(spec: StepSpec, kernel: str) -> str:
    """The attention kernel that runs: under a context axis, the blockwise kernel whatever the
    model's (cuDNN on a GPU), by position on all-gathered keys and values or per chunk round a
    ring."""
    par = spec.parallel
    if not (spec.sharded and par.context_parallel and spec.model.attention == "fused"):
        return KERNEL_NAMES.get(kernel, kernel)
    if par.cp_attention == "ring":
        return f"{KERNEL_NAMES['blockwise']} per chunk, keys and values round a ring"
    return f"{KERNEL_NAMES['blockwise']} by position, on keys and values all-gathered"


def _translation(policy: MemoryPolicy) -> str:
    """How the step runs the policy, in words."""
    return (
        "jaxmem.memory.remat (jax.checkpoint per block, stack unrolled)"
        if policy.unroll or not policy.parts[0].layers.is_all
        else "jaxmem.memory.remat (jax.checkpoint under lax.scan)"
    ) + (f"; {policy.loss.label} (jaxmem.model.loss.chunked_lm_loss)" if policy.loss.label else "")


def _sources(spec: StepSpec, kernel: str) -> dict[str, str]:
    """How the saved bytes and the FLOPs were obtained."""
    parallel, tp = spec.parallel, spec.sharded and spec.parallel.tensor_parallel
    cp = spec.sharded and parallel.context_parallel
    saved = (
        "residual accounting (jaxpr of jax.vjp; parameters excluded)"
        + (
            f"; one tensor device's share by tag (Megatron's layout over tp={parallel.tp}, "
            f"sequence parallel: {'yes' if parallel.sequence_parallel else 'no'}; untagged "
            "residuals whole)"
            if tp
            else ""
        )
        + (
            f"; one context device's share (the sequence split over cp={parallel.cp}: 1/cp of "
            + (
                "each; the keys and values it gathers whole to attend are in the compiled plan "
                "only)"
                if parallel.cp_attention == "gather"
                else "each; the ring's keys and values in flight are in the compiled plan only)"
            )
            if cp
            else ""
        )
    )
    flops = (
        "matmul FLOPs of the gradient's jaxpr (recompute included: hardware FLOPs)"
        + ("; per tensor device: the blocks' matmuls over tp, the LM head's whole" if tp else "")
        + ("; per context device: 1/cp" if cp else "")
        + (
            " (of the one-device count, whose attention computes every key block: the ring "
            "computes (2 cp + 1)/(4 cp) of its attention's, so its count is high)"
            if cp and parallel.cp_attention == "ring"
            else ""
        )
        + (
            "; cuDNN's attention counted as the blockwise kernel's (the same FlashAttention-2 "
            "matmuls)"
            if kernel == "cudnn"
            else ""
        )
    )
    return {"saved_source": saved, "flops_source": flops}


def _peak(spec: StepSpec, built: BuiltStep, args: tuple, abstract: bool, plan, compiler) -> tuple:
    """``(peak, source)``: the device's runtime peak after running the step once where it can
    (arrays on a GPU backend), else the compiled plan's."""
    if not abstract and jax.devices()[0].platform != "cpu":
        built.step(*args)
        peak = device_peak_bytes()
        if peak is not None:
            return peak, (
                "runtime peak (device.memory_stats peak_bytes_in_use: the process's high-water "
                "mark)"
            )
    return peak_of_plan(plan), (
        f"compiled plan ({compiler}): arguments + outputs - aliased + temporaries"
    )


def _arguments(spec: StepSpec, built: BuiltStep, params: Any, abstract: bool) -> tuple:
    """The step's arguments: placed shapes (``BuiltStep.shapes``), or this backend's arrays
    (the optimizer's initial state, the deterministic batch)."""
    if abstract:
        return built.shapes(params)
    data = lm_step_batch(
        spec.model, spec.batch, spec.seq_len, abstract=False, masked=spec.loss_mask
    )
    return (
        params,
        built.tx.init(built.trainable.trained(params)),
        init_loss_scale(spec.precision),
        data,
    )


def _sizes(built: BuiltStep, params: Any, grads: Any, opt_state: Any) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state (per device over a mesh: each leaf's
    shard)."""
    if built.shardings is None:
        return {
            "params": tree_bytes(params),
            "grads": tree_bytes(grads),
            "opt": tree_bytes(opt_state),
        }
    return {
        "params": sharded_bytes(params, built.shardings.params),
        "grads": sharded_bytes(grads, built.shardings.params),  # zero1/dp: as the parameters
        "opt": sharded_bytes(opt_state, built.shardings.opt_state),
    }


def jax_record(spec: StepSpec, *, abstract: bool = False) -> dict[str, Any]:
    """Measure one jaxmem training step (or plan it from shapes when ``abstract``; always from
    shapes for a GPU target). With ``accum`` microbatches the step scans them; saved
    activations and FLOPs are then one microbatch's and the whole step's.

    Over a mesh (``spec.parallel`` of more than one device: this backend's, or one host of the
    GPU target's) the record is **per device**: parameters, gradients and optimizer state from
    their shard shapes, saved activations and FLOPs of one device's rows of the batch (data
    parallel: batch / N), the compiled plan of one device."""
    cfg, policy, target, sharded = spec.model, spec.policy, spec.target, spec.sharded
    abstract = abstract or target.is_gpu or sharded
    state_offload = target.is_gpu and spec.optimizer.state_memory == "pinned_host"
    spec = record_spec(planned(spec))
    model = (
        model_shapes(spec) if abstract else make_model(cfg, spec.precision, adapters=spec.adapters)
    )
    kernel = model.attention_kernel
    built, params = build_step(spec, model)
    args = _arguments(spec, built, params, abstract)
    opt_state = args[1]
    # one microbatch of one device (its shapes are what the accounting needs)
    micro = lm_step_batch(cfg, spec.micro_rows, spec.seq_len, abstract, masked=spec.loss_mask)
    saved = _saved(spec, built, params, micro)
    residuals = summarize_residuals(saved)
    grads = built.grad_shapes(params, micro)
    plan, compiler = compile_step(spec, built.step, args)
    planned_peak = peak_of_plan(plan)
    peak, peak_source = _peak(spec, built, args, abstract, plan, compiler)
    estimate = analytic.saved_activation_bytes(
        cfg,
        policy,
        spec.micro_rows,
        spec.seq_len,
        spec.precision,
        spec.parallel if sharded else None,
    )
    flops, model_flops = _flops(spec, built, kernel, params, micro)
    sizes = _sizes(built, params, grads, opt_state)
    return {
        "framework": "jax",
        "translation": _translation(policy),
        "policy": policy.name,
        "precision": spec.precision.name,
        "attention_kernel": _kernel_label(spec, kernel),
        "batch": spec.batch,
        "seq_len": spec.seq_len,
        "accum": spec.accum.steps,
        "planned_from_shapes": abstract,
        "params_bytes": sizes["params"],
        # a frozen base: the gradients are the trained subtree's, shaped as its parameters
        "trainable_params_bytes": sizes["grads"] if spec.adapters.enabled else sizes["params"],
        "adapters": spec.adapters.label(),
        "grads_bytes": sizes["grads"],
        "opt_state_bytes": sizes["opt"],
        "mesh": spec.parallel.mesh_text() if sharded else None,
        "per_device": sharded,
        "saved_activation_bytes_device": residuals.activation_bytes_device,
        "saved_activation_bytes_host": residuals.activation_bytes_host,
        "saved_by_name": bytes_by_name(saved),
        "saved_argument_bytes": residuals.argument_bytes,
        "saved_parameter_copy_bytes": residuals.parameter_copy_bytes,
        "analytic_activation_bytes": estimate.device_bytes + estimate.host_bytes,
        "analytic_source": analytic.ANALYTIC_SOURCE,
        "compiled_temp_bytes": plan["temp_bytes"],
        "compiled_plan": plan,
        "flops": flops,  # per device when sharded
        "model_flops": model_flops,
        **_sources(spec, kernel),
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
        "step_time": spec_step_time(
            spec, plan, state_link_bytes=2 * sizes["opt"] if state_offload else 0
        ),
        # the OS's high-water mark of this whole process (everything so far)
        "process_max_rss_bytes": process_max_rss_bytes(),
        "process_max_rss_source": "OS (getrusage ru_maxrss), whole process so far, host",
    }

"""A ``StepSpec``'s step compiled for its target, from shapes: the compiled plan, its planned peak
(per device over a mesh) and its estimated step time (``plan_step``), with a streamed step's host
memory and transfers counted from shapes (``stream_plan``). The local backend's plan or, for a
GPU target, XLA:CUDA's compiled without the GPU (``jaxmem.memory.gpu_plan``); every plan names
the compiler and target that made it. ``jaxmem.planner.records`` adds the residual accounting
and FLOPs of a full record; the search compiles its candidates here.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxmem.config import ConfigError
from jaxmem.memory.residuals import plan_of_lowered
from jaxmem.memory.residuals import planned_peak as peak_of_plan
from jaxmem.memory.targets import Target
from jaxmem.parallel import ParallelConfig
from jaxmem.policy import MemoryPolicy
from jaxmem.precision import Precision
from jaxmem.sharding import sharded_bytes
from jaxmem.step.build import BuiltStep, build_step
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import tree_bytes


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


def spec_step_time(spec: StepSpec, plan: Any, **kwargs: Any) -> dict[str, Any] | None:
    """``step_time`` of ``spec``'s plan (per device over its mesh; a context axis's keys and
    values priced apart from the data axis's collectives, ``analytic.context_parallel_bytes``)."""
    from jaxmem.memory.analytic import context_parallel_bytes

    parallel = spec.parallel if spec.sharded else None
    context = 0
    if parallel is not None and parallel.context_parallel:
        context = context_parallel_bytes(
            spec.model, spec.precision, spec.policy, rows=spec.batch // parallel.data,
            seq_len=spec.seq_len, cp=parallel.cp, tp=parallel.tp, form=parallel.cp_attention,
        )  # fmt: skip
    return step_time(
        plan, spec.target, spec.model, spec.precision, spec.batch, spec.seq_len, parallel,
        adapters=spec.adapters, context_bytes=context, **kwargs,
    )  # fmt: skip


def planned(spec: StepSpec) -> StepSpec:
    """``spec`` as a plan compiles it from shapes, refused in one line where it cannot: a
    streamed step without donation (its stack arrives in device memory there, and XLA's
    host-offload check refuses a device argument donated to a host output; ``stream_plan``
    counts what donation saves from shapes)."""
    if spec.accum.mode != "scan":
        raise ConfigError(
            f"accum mode {spec.accum.mode!r} updates once per microbatch, a loop of jitted "
            "micro-steps that only jaxmem train runs; plans compile the scan step: use accum "
            "mode 'scan'"
        )
    return spec.replace(donate=False) if spec.streamed else spec


def compile_spec(spec: StepSpec, model: Any = None) -> tuple[BuiltStep, Any, dict[str, int], str]:
    """``spec``'s step built (``jaxmem.step.build.build_step``) and compiled from shapes for its
    target, on one device or per device of its mesh: ``(built, params, plan, compiler)``
    (``params``: ``model``'s, or the spec's decoder as shapes; ``plan``: ``compiled_plan``)."""
    built, params = build_step(planned(spec), model)
    plan, compiler = compile_step(spec, built.step, built.shapes(params))
    return built, params, plan, compiler


def compile_step(spec: StepSpec, step: Any, args: tuple) -> tuple[dict[str, int], str]:
    """``spec``'s jitted ``step`` compiled from ``args`` for its target, on one device or per
    device of its mesh: ``(plan, compiler)`` (``plan``: ``compiled_plan``)."""
    if spec.sharded:
        return _compile_on_mesh(step, args, spec.target, spec.parallel)
    return _compile(step, args, spec.target)


def lowered_step(spec: StepSpec) -> Any:
    """The program ``plan_step`` and ``jax_record`` compile for ``spec``, lowered (not compiled),
    from shapes placed as ``compile_spec`` places them (a GPU target's single device included)."""
    built, params = build_step(planned(spec))
    args = built.shapes(params)
    if spec.target.is_gpu and not spec.sharded:
        from jaxmem.memory.gpu_plan import lower_placed, on_target

        return lower_placed(built.step, on_target(args, spec.target))
    return built.step.lower(*args)


def _state_shards(spec: StepSpec) -> int:
    """Over how many devices the optimizer state is split (``jaxmem.sharding``'s layout)."""
    parallel = spec.parallel
    if not spec.sharded:
        return 1
    return parallel.tp * (parallel.state_shards if parallel.strategy != "dp" else 1)


def plan_step(spec: StepSpec) -> dict[str, Any]:
    """Only the compiled plan of the train step ``jax_record`` plans (from shapes; no residual
    accounting, no FLOPs): the compiler, the plan's bytes and its planned peak (arguments +
    outputs - aliased + temporaries; per device over the spec's mesh). Cheap enough to search
    for the largest batch that fits, or for ``jaxmem plan``'s candidates. A streamed step
    (``optimizer.stream``) is ``stream_plan``'s."""
    if spec.streamed:
        return stream_plan(spec)
    built, params, plan, compiler = compile_spec(spec)
    state_link = 0
    if spec.target.is_gpu and spec.optimizer.state_memory == "pinned_host":  # in and out every step
        state_link = 2 * tree_bytes(built.init_state(params)) // _state_shards(spec)
    return {
        "compiler": compiler,
        "compiled_plan": plan,
        "planned_peak_bytes": peak_of_plan(plan),
        "step_time": spec_step_time(
            spec,
            plan,
            state_link_bytes=state_link,
        ),
    }


def stream_plan(spec: StepSpec) -> dict[str, Any]:
    """The compiled plan of a streamed step (``optimizer.stream``, ``jaxmem.step.stream``), with
    what a deviceless plan cannot show counted from shapes; over the spec's mesh (dp, zero1,
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

    built, params, plan, compiler = compile_spec(spec)
    opt_state = built.init_state(params)
    update = spec.optimizer.stream_update or "device"
    if spec.sharded:
        where = built.placement
        rest_sh, stack_sh = stream.split(where.params)
        rest, stack = stream.split(params)
        host_resident = sharded_bytes(stack, stack_sh) + sharded_bytes(
            opt_state[1], where.opt_state[1]
        )
        donated = sharded_bytes(rest, rest_sh) + sharded_bytes(opt_state[0], where.opt_state[0])
        local = (_shards(params, where.params), _shards(opt_state, where.opt_state))
    else:
        host_resident = stream.host_bytes(params, opt_state)
        rest, _ = stream.split(params)
        # written over in place when donated
        donated = tree_bytes(rest) + tree_bytes(opt_state[0])
        local = (params, opt_state)
    device_peak = peak_of_plan(plan) - host_resident - donated
    # the plan's host temporaries hold its in-step copy of the resident stack (not made on a
    # real run, where it already lives in host memory) and the stack's new values (written over
    # the old in place); what remains is the gradient and update's host working set
    host_working = plan["host_temp_bytes"] - host_resident
    transfers = stream_transfers(
        *local, spec.policy, spec.precision, spec.target, spec.accum.steps, update
    )
    return {
        "compiler": compiler,
        "compiled_plan": plan,
        "planned_peak_bytes": device_peak,
        # the program's own host copies include moving the resident stack to host memory (a
        # deviceless compile's arguments arrive on the device): priced from shapes instead
        "step_time": spec_step_time(
            spec,
            plan,
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


def _shards(tree: Any, shardings: Any) -> Any:
    """``tree``'s leaves as the shape structs of one device's shard."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(s.shard_shape(tuple(x.shape)), x.dtype), tree, shardings
    )


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
    fetches = 2 if policy.head.remat else 1  # a remat policy replays the block: fetched again
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

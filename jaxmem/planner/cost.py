"""What a plan candidate costs: its estimated step time, before any compile, by the model of
``jaxmem.memory.step_time`` (an **estimate**, with its assumptions stated), each term a named
function of the candidate's choices:

- compute: the gradient's work per microbatch (``WorkModel``: the matmul shapes and the
  memory-bound bytes of its jaxpr, ``jaxmem.memory.work``), times the microbatches, plus
  ``update_bytes`` (the optimizer's update reads and writes parameters, gradient and state) and
  ``accumulation_bytes`` (each further microbatch's gradient added to the running sum), priced
  per kernel (matmuls at an efficiency of their shape, memory-bound work at the HBM's rate);
- host link, collectives and a host update: bytes from shapes (``tensor_parallel_bytes``,
  ``analytic.context_parallel_bytes``, ``data_parallel_bytes``, ``activation_offload_bytes``,
  ``state_transfer_bytes``, ``streamed_bytes``), each hidden under the compute up to
  ``Overlap``'s fraction; ``gpu_step_time`` puts a GPU candidate's terms together;
- matmul FLOPs per device (``device_flops``): what the local backend's order counts and what a
  candidate reports.

The terms take the candidate's choices (stack, precision, rows, mesh, microbatches, where the
state lives), not the candidate: ``jaxmem.planner.space`` enumerates the lattice and prices each
point with them, so this module sits below it.

``WorkModel`` traces each part of a stack (a preset or a per-tag policy) at depths 1 and 2 and
at one and two rows, so that any stack, depth and microbatch is read off four traces: the
counts of the blocks' matmuls and the totals are affine in the number of blocks, and every
dimension and byte count affine in the rows. A nested stack is traced at its depth.

The local backend has no roofline (its rates are not a GPU's): its candidates are ordered by
matmul FLOPs at a nominal rate plus bytes over nominal links (``nominal_seconds``), which is all
a plan for it needs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx

from jaxmem.adapters import AdapterConfig
from jaxmem.config import ModelConfig, OptimizerConfig
from jaxmem.memory import analytic
from jaxmem.memory import step_time as st
from jaxmem.memory.remat import layers_fn
from jaxmem.memory.targets import Rates
from jaxmem.memory.work import Traced, Work, at_rows, combine, trace_jaxpr
from jaxmem.model import make_model
from jaxmem.model.qbase import quantize_base
from jaxmem.policy import POLICIES, EmbeddingReplay, LossPolicy, MemoryPolicy, preset_named
from jaxmem.precision import Precision
from jaxmem.step.train_step import lm_loss_fn

NO_ADAPTERS = AdapterConfig()  # full fine-tuning: every parameter trains


def _part_key(policy: MemoryPolicy) -> Any:
    """One part of a stack: its preset or saved tags, its loss chunks, whether it is unrolled
    (an unrolled stack keeps each block's residuals as arrays of their own, where a scan writes
    them into stacked buffers and slices them out again) and its MLP tiles (more, smaller
    kernels)."""
    policy = policy.replace(embedding=EmbeddingReplay())
    name = preset_named(policy.replace(loss=LossPolicy(), unroll=False, mlp_tile_tokens=0))
    saved = name or ("tags", *policy.head.save)
    return (saved, policy.loss.chunks, policy.unroll, policy.mlp_tile_tokens)


def priced_runs(policy: MemoryPolicy, n_layers: int) -> list[tuple[int, MemoryPolicy]]:
    """``policy``'s stack as the planner fits and prices it, ``[(n_blocks, stack), ...]``: a
    one-part stack whole; a stack of several parts run by run (``MemoryPolicy.runs``), each
    traced as a one-part stack of its block policy under the stack's switches (the whole loss,
    no replay: the FLOP and work models trace the embedding, head and loss with the first)."""
    if len(policy.parts) == 1:
        return [(n_layers, policy)]
    switches = {"unroll": policy.unroll, "use_reentrant": policy.use_reentrant}
    return [(n, MemoryPolicy.of(b, **switches)) for n, b in policy.runs(n_layers)]


@functools.lru_cache(maxsize=64)
def _abstract_model(
    cfg: ModelConfig, precision: Precision, adapters: AdapterConfig, platform: str | None
) -> tuple:
    """``cfg``'s model as shapes, ``(graphdef, params)``, built once per model, precision,
    adapters and platform in a process: a search traces the same one- and two-block models once
    per stack (the tag frontier's 2^units subsets, each preset's fit), and building it was a
    third of each trace. Read only: each trace merges its own module from it."""
    model = nnx.eval_shape(lambda: make_model(cfg, precision, platform=platform, adapters=adapters))
    if adapters.base != "compute":  # packed from shapes (outside the trace: nothing packs)
        quantize_base(model, adapters.base)
    return nnx.split(model, nnx.Param)


def frozen_base_gradient(
    cfg: ModelConfig, policy: MemoryPolicy, precision: Precision, seq: int, rows: int,
    adapters: AdapterConfig = NO_ADAPTERS, platform: str | None = None,
) -> tuple[Any, tuple]:  # fmt: skip
    """The loss whose gradient one microbatch of ``rows`` rows takes under ``policy``, from
    shapes, and its arguments: ``(loss, (trained, batch, frozen))``, ``loss(trained, batch,
    frozen)``. With ``adapters`` the decoder carries them (its base packed as ``adapters.base``)
    and only the trained subtree is differentiated, as the step does (``jaxmem.step.frozen``):
    a frozen base has no weight-gradient matmuls. Without, every parameter is trained."""
    from jaxmem.planner.records import lm_step_batch
    from jaxmem.step.frozen import Trainable

    graphdef, params = _abstract_model(cfg, precision, adapters, platform)
    micro = lm_step_batch(cfg, rows, seq, abstract=True)
    chunks = policy.loss.chunks_for(seq)
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers), loss_chunks=chunks)
    of, (trained, frozen) = Trainable(adapters).frozen_loss(lambda p, b: loss(p, b)[0], params)
    return of, (trained, micro, frozen)


@functools.lru_cache(maxsize=512)
def _trace(cfg: ModelConfig, policy: MemoryPolicy, precision: Precision, seq: int, rows: int,
           adapters: AdapterConfig = NO_ADAPTERS, platform: str = "gpu") -> Traced:  # fmt: skip
    """The work of one microbatch of ``rows`` rows through the gradient under ``policy``
    (kept: each search, and each budget of a benchmark, prices the same parts); ``platform``
    ``"cpu"``: fused attention as the blockwise kernel (a context axis's)."""
    loss, args = frozen_base_gradient(cfg, policy, precision, seq, rows, adapters, platform)
    return trace_jaxpr(jax.make_jaxpr(jax.grad(loss))(*args))


class WorkModel:
    """The gradient's work of one microbatch for any stack (module docstring); ``micro(...,
    blockwise=True)``: with fused attention as jaxmem's blockwise kernel, as a context axis
    runs it."""

    def __init__(self, cfg: ModelConfig, seq_len: int, adapters: AdapterConfig = NO_ADAPTERS):
        self.cfg, self.seq_len, self.adapters = cfg, seq_len, adapters
        self._parts: dict[tuple, tuple[Traced, Traced, Traced, Traced]] = {}

    def _part(
        self, policy: MemoryPolicy, precision: Precision, platform: str = "gpu"
    ) -> tuple[Traced, ...]:
        key = (_part_key(policy), precision.name, platform)
        if key not in self._parts:
            part = policy.replace(embedding=EmbeddingReplay())
            cfg, seq, adapters = self.cfg, self.seq_len, self.adapters
            self._parts[key] = tuple(
                _trace(cfg.replace(n_layers=d), part, precision, seq, r, adapters, platform)
                for d in (1, 2)
                for r in (1, 2)
            )
        return self._parts[key]

    def micro(
        self, policy: MemoryPolicy, precision: Precision, rows: int, blockwise: bool = False
    ) -> tuple[Work, Work]:
        """(the work outside the blocks, the blocks') of one microbatch of ``rows`` rows."""
        platform = "cpu" if blockwise else "gpu"
        if policy.nested:
            whole = _nested(
                self.cfg, policy, precision, self.seq_len, rows, self.adapters, platform
            )
            return whole.work(), Work()
        outside: Work | None = None
        blocks: list[tuple[Work, int]] = []
        for n, part in priced_runs(policy, self.cfg.n_layers):
            d1r1, d1r2, d2r1, d2r2 = self._part(part, precision, platform)
            one, two = at_rows(d1r1, d1r2, rows), at_rows(d2r1, d2r2, rows)
            per_block = combine([(two.work(), 1), (one.work(), -1)])
            if outside is None:  # the embedding, head and loss: the first part's
                outside = combine([(one.work(), 1), (per_block, -1)])
            blocks.append((per_block, n))
        source = "per-operation count of the gradient's jaxpr (elementwise chains assumed fused)"
        return dataclasses.replace(outside or Work(), source=source), combine(blocks, source)


@functools.lru_cache(maxsize=32)
def _nested(cfg: ModelConfig, policy: MemoryPolicy, precision: Precision, seq: int,
            rows: int, adapters: AdapterConfig, platform: str = "gpu") -> Traced:  # fmt: skip
    return _trace.__wrapped__(cfg, policy, precision, seq, rows, adapters, platform)


# ------------------------------------------------------------------------------ the terms
def update_bytes(
    cfg: ModelConfig, opt_cfg: OptimizerConfig, precision: Precision, *, param_shards: int = 1,
    state_shards: int = 1, adapters: AdapterConfig = NO_ADAPTERS,
) -> int:  # fmt: skip
    """Bytes the optimizer's update reads and writes on one device, from shapes: parameters and
    state read and written, the gradient read twice (its norm, then the update); with
    ``adapters``, of the trained parameters only (``analytic.adapter_state``)."""
    if adapters.enabled:
        held = analytic.adapter_state(cfg, adapters, opt_cfg, precision)
        params, state = held.trainable_bytes, held.opt_state_bytes
    else:
        params = analytic.param_bytes(cfg, precision)
        state = analytic.opt_state_bytes(cfg, opt_cfg, precision)
    return 4 * (params // param_shards) + 2 * (state // state_shards)


def accumulation_bytes(
    cfg: ModelConfig, precision: Precision, accum: int, shards: int = 1,
    adapters: AdapterConfig = NO_ADAPTERS,
) -> int:  # fmt: skip
    """Bytes the running gradient sum moves: each microbatch after the first adds its gradient
    (the sum read and written, the gradient read); with ``adapters``, the trained parameters'."""
    grads = (
        analytic.adapter_state(cfg, adapters, OptimizerConfig(), precision).grads_bytes
        if adapters.enabled
        else analytic.param_bytes(cfg, precision)
    )
    return max(0, accum - 1) * 3 * grads // shards


def step_estimate(
    outside: Work,
    blocks: Work,
    device: st.Device,
    *,
    accum: int,
    tp: int,
    memory_bytes: int,
    model_flops: int,
    transfers: st.Transfers,
    compute_dtype: str,
    cp: int = 1,
) -> st.StepTime:
    """The candidate's step time: its compute (``compute``; with tensor parallelism the blocks'
    time over ``tp``, the rest whole; with a context axis everything but the update over
    ``cp``) and its transfers, overlapped per ``Overlap``."""
    whole = st.estimate(
        combine([(outside, accum)], outside.source), device, model_flops=model_flops,
        compute_dtype=compute_dtype,
    )  # fmt: skip
    split = st.estimate(
        combine([(blocks, accum)], blocks.source), device, model_flops=model_flops,
        compute_dtype=compute_dtype,
    )  # fmt: skip
    update = st.estimate(
        Work(memory_bytes=memory_bytes, memory_kernels=0), device, model_flops=model_flops,
        transfers=transfers, compute_dtype=compute_dtype,
    )  # fmt: skip
    parts = (whole, split, update)
    share = (1.0 / cp, 1.0 / (tp * cp), 1.0)
    fields = ("matmul", "attention", "memory_bound")
    summed = {f: sum(getattr(p, f) * k for p, k in zip(parts, share, strict=True)) for f in fields}
    summed["launches"] = sum(p.launches for p in parts)  # every device launches every kernel
    busy = sum(summed.values())
    o = st.DEFAULT.overlap
    exposed = sum(
        max(0.0, t - frac * busy)
        for t, frac in (
            (update.activation_offload, o.activation_offload),
            (update.state, o.state_transfers),
            (update.data_parallel, o.data_parallel),
            (update.tensor_parallel, o.tensor_parallel),
            (update.context_parallel, o.context_parallel),
            (update.host_update, o.host_update),
        )
    )
    flops = (whole.executed_flops + split.executed_flops // tp) // cp
    eff_weight = whole.executed_flops + split.executed_flops / tp
    efficiency = (
        (whole.matmul_efficiency * whole.executed_flops
         + split.matmul_efficiency * split.executed_flops / tp) / eff_weight
        if eff_weight else 0.0
    )  # fmt: skip
    return dataclasses.replace(
        update,
        **summed,
        seconds=busy + exposed,
        executed_flops=flops,
        matmul_efficiency=efficiency,
        source="estimate: per-operation count of the gradient's jaxpr (elementwise chains "
        "assumed fused), before compiling"
        + (
            f"; a context axis's share: 1/cp={cp} of one device's work with the blockwise "
            "attention kernel (the all-gathered form's; high for the ring's)"
            if cp > 1
            else ""
        ),
    )


def nominal_seconds(
    flops: int, rates: Rates, dtype: str, *, link: int, collectives: int, host_update: int
) -> float:
    """The local backend's order: matmul FLOPs at a nominal rate, bytes over nominal links."""
    rate = rates.matmul_flops.get(dtype, rates.matmul_flops["float32"])
    return (
        flops / rate
        + link / rates.host_link
        + collectives / rates.interconnect
        + host_update / rates.host_memory
    )


# -------------------------------------------------------------- the candidate's bytes and FLOPs
def device_flops(
    cfg: ModelConfig, per_row: int, *, rows: int, seq_len: int, tp: int, cp: int = 1
) -> int:
    """Matmul FLOPs one device runs per step (``per_row``: one row's gradient, recompute
    included, ``predict.FlopModel``; ``rows``: the rows of its data-parallel group): with tensor
    parallelism the blocks' matmuls split over ``tp`` devices, the LM head's whole on each;
    with a context axis all of it over ``cp`` (each device its ``S / cp`` tokens, their queries
    against every key: the all-gathered form's count, high for the ring's)."""
    if tp == 1:
        return per_row * rows // cp
    head_per_row = analytic.head_flops(cfg, 1, seq_len)
    return (head_per_row * rows + (per_row - head_per_row) * rows // tp) // cp


def tensor_parallel_bytes(
    cfg: ModelConfig, precision: Precision, policy: MemoryPolicy, *, rows: int, seq_len: int,
    tp: int,
) -> int:  # fmt: skip
    """Bytes per device and step over the interconnect for tensor parallelism, from shapes:
    Megatron-SP's all-gathers and reduce-scatters of one row's ``[S, D]`` activations, 4 per
    block forward, 4 backward (4 more when the block is replayed), each moving ``(tp - 1) / tp``
    of them (ring estimate)."""
    passes = 12 if policy.head.remat else 8
    return int(
        passes
        * (tp - 1)
        / tp
        * rows
        * seq_len
        * cfg.d_model
        * precision.compute_bytes
        * cfg.n_layers
    )


def data_parallel_bytes(
    cfg: ModelConfig, precision: Precision, strategy: str | None, *, data: int, tp: int,
    accum: int,
) -> int:  # fmt: skip
    """Bytes per device and step over the interconnect for data parallelism over ``data``
    devices, from shapes (ring estimate, on one tensor group member's share of the weights):
    dp and zero1 all-reduce the gradient (or reduce-scatter it and gather the parameters),
    fsdp gathers the parameters twice and reduce-scatters the gradient per microbatch; one
    device (``strategy`` None) moves none."""
    ring = 2 * (data - 1) / data if data > 1 else 0.0
    shard = analytic.param_bytes(cfg, precision) / tp
    if strategy in ("dp", "zero1"):
        return int(ring * shard)
    if strategy == "fsdp":
        return int(1.5 * ring * shard * accum)
    return 0


@functools.lru_cache(maxsize=64)
def offloaded_bytes_per_row(cfg: ModelConfig, precision: Precision, seq: int) -> int:
    """Bytes one row's block sends to host memory under ``offload`` (analytic, per block; kept:
    every candidate of a search asks)."""
    one = cfg.replace(n_layers=1)
    return analytic.saved_activation_bytes(one, POLICIES["offload"], 1, seq, precision).host_bytes


def activation_offload_bytes(
    cfg: ModelConfig, precision: Precision, policy: MemoryPolicy, *, rows: int, seq_len: int,
    tp: int,
) -> int:  # fmt: skip
    """Bytes per device and step over the host link for offloaded activations, from shapes:
    each offloading block's tensors out and back in (projections: ``offloaded_bytes_per_row``;
    offloaded block or segment inputs: the analytic model's ``input_host_bytes``, which knows
    ``nested-host``'s segments and a replayed first block), for the device's rows, split over
    tensor devices."""
    per_row = 0
    for n, block in policy.runs(cfg.n_layers):
        if set(block.offload) - {"block_input"}:
            per_row += n * offloaded_bytes_per_row(cfg, precision, seq_len)
    inputs = analytic.saved_activation_bytes(cfg, policy, 1, seq_len, precision).input_host_bytes
    return 2 * (per_row + inputs) * rows // tp


def state_transfer_bytes(
    cfg: ModelConfig, opt_cfg: OptimizerConfig, precision: Precision, *, shards: int
) -> int:
    """Bytes per device and step over the host link for optimizer state kept in host memory,
    from shapes: the device's share of the state (``shards`` ways), in and out."""
    return 2 * analytic.opt_state_bytes(cfg, opt_cfg, precision) // shards


def streamed_bytes(
    cfg: ModelConfig,
    opt_cfg: OptimizerConfig,
    precision: Precision,
    policy: MemoryPolicy,
    accum: int = 1,
    update: str = "device",
    *,
    param_shards: int = 1,
    state_shards: int = 1,
) -> tuple[int, int]:
    """Bytes of a streamed step (from shapes, as ``plans.stream_transfers``): over the host
    link, the stack's parameters in (twice under a replaying policy), its gradient out and, for
    a device update, the update's parameters, gradient and state in and parameters and state
    out; and the bytes of host memory a host update reads and writes instead (the same arrays:
    parameters, gradient and state read, parameters and state written), plus the gradient
    read for fp16's overflow check. Over a mesh, one device's: its shards of the stack's
    parameters (and gradient) and state."""
    per_block = analytic.param_bytes(cfg.replace(n_layers=2), precision) - analytic.param_bytes(
        cfg.replace(n_layers=1), precision
    )
    state_block = analytic.opt_state_bytes(
        cfg.replace(n_layers=2), opt_cfg, precision
    ) - analytic.opt_state_bytes(cfg.replace(n_layers=1), opt_cfg, precision)
    p = per_block * cfg.n_layers // param_shards
    s = state_block * cfg.n_layers // state_shards
    fetches = 2 if policy.head.remat else 1
    summed = accum * 3 * p if accum > 1 else 0  # the running sum added to block by block
    updated = (2 * p + s) + (p + s)
    link = accum * (fetches * p + p) + summed
    checked = p if precision.loss_scale == "dynamic" else 0  # fp16's overflow check, on host
    return (link + updated, checked) if update == "device" else (link, updated + checked)


def gpu_step_time(
    cfg: ModelConfig,
    opt_cfg: OptimizerConfig,
    work: WorkModel,
    device: st.Device,
    policy: MemoryPolicy,
    precision: Precision,
    *,
    batch: int,
    seq_len: int,
    devices: int,
    accum: int,
    strategy: str | None,
    tp: int,
    update: str | None,
    transfers: st.Transfers,
    cp: int = 1,
) -> st.StepTime:
    """A GPU candidate's estimated step time (module docstring): its microbatches' gradient
    work (``work``; under a context axis with the blockwise attention kernel), its update's
    and accumulation's bytes (``update_bytes``, ``accumulation_bytes``; a host update's stack
    in host memory, not here), its transfers."""
    data = devices // (tp * cp)
    rows = batch // data // accum
    blockwise = cp > 1 and cfg.attention == "fused"
    outside, blocks = work.micro(policy, precision, rows, blockwise=blockwise)
    shards = data * cp  # a strategy shards over the data and context devices together
    param_shards = (shards if strategy == "fsdp" else 1) * tp  # what each device holds
    state_shards = (shards if strategy in ("zero1", "fsdp") else 1) * tp  # and updates
    memory = update_bytes(
        cfg, opt_cfg, precision, param_shards=state_shards, state_shards=state_shards,
        adapters=work.adapters,
    ) + accumulation_bytes(cfg, precision, accum, param_shards, work.adapters)  # fmt: skip
    if update == "host":  # the stack's update runs in host memory: only the rest's here
        one, two = (
            update_bytes(cfg.replace(n_layers=n), opt_cfg, precision,
                         param_shards=state_shards, state_shards=state_shards)
            for n in (1, 2)
        )  # fmt: skip
        memory -= cfg.n_layers * (two - one)
    return step_estimate(
        outside,
        blocks,
        device,
        accum=accum,
        tp=tp,
        cp=cp,
        memory_bytes=max(0, memory),
        model_flops=analytic.mfu_flops(cfg, batch // data, seq_len, work.adapters) // (tp * cp),
        transfers=transfers,
        compute_dtype=precision.compute_dtype,
    )

"""The lattice ``jaxmem plan`` searches and its order: what is planned (``Problem``), the choices
searched (``PlanSpace``), one point of them with its estimated cost (``Candidate``), every point
priced and sorted cheapest first (``enumerate_candidates``, ``candidate_order``), and the job a
chosen point runs (``candidate_job``). The terms of the cost are ``jaxmem.planner.cost``'s; the
predictors of bytes and FLOPs are ``jaxmem.planner.predict``'s; the search that compiles
candidates in this order is ``jaxmem.planner.search``.

The lattice (``PlanSpace``): the stack's memory policy — a preset, or the first k blocks under one
preset and the other L - k under another (``jaxmem.policy.mixed_policy``: two consecutive scans;
on identical blocks the order does not change the peak, measured: ``selective:2+full`` and
``full:6+selective`` plan the same bytes on an 8-layer H100 plan) — × microbatch count × where the
optimizer state lives × data-parallel strategy (with a mesh) × the mesh's layout (tensor and
context axes over its devices, the rest a data axis: ``mesh_layouts``) × precision (only when
the user allows it).

Cost (``Candidate.seconds``, an **estimate**, never a measurement): on a GPU target, the step
time ``jaxmem.planner.cost`` estimates before compiling (the gradient's jaxpr read kernel by
kernel: matmuls at a shape-dependent share of the target's peak, memory-bound work at its HBM
bandwidth, host-link and collective bytes with the overlap ``jaxmem.memory.step_time`` states);
on the local backend a nominal order (matmul FLOPs at a nominal rate plus bytes), not a time.

The memory policies searched are ``jaxmem.planner.stacks``'; the FLOP model is taken as its
``FlopCounts`` (``predict.FlopModel``'s protocol): this module sits below the predictors."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from jaxmem.adapters import AdapterConfig
from jaxmem.config import AccumConfig, ConfigError, ModelConfig, OptimizerConfig, require
from jaxmem.job import JobConfig
from jaxmem.memory import analytic
from jaxmem.memory import step_time as st
from jaxmem.memory.step_time import Device, StepTime
from jaxmem.memory.targets import Target, rates_for
from jaxmem.parallel import CP_ATTENTIONS, ParallelConfig
from jaxmem.planner import cost
from jaxmem.planner.stacks import FlopCounts, searched_stacks
from jaxmem.policy import (
    POLICIES,
    EmbeddingReplay,
    LossPolicy,
    MemoryPolicy,
    is_preset,
    preset_named,
    tags_text,
)
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

# placements of the state beside device and pinned_host: the stack's parameters and state
# streamed through host memory (optimizer.stream), updated block by block on the device or in
# host memory (optimizer.stream_update)
STREAMED = "stream"
STREAMED_HOST = "stream-host"
STREAM_UPDATE = {STREAMED: "device", STREAMED_HOST: "host"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSpace:
    """The lattice ``jaxmem plan`` searches."""

    policies: tuple[str, ...] = ("none", "selective", "mlp", "offload", "full", "nested")
    mix: tuple[str, ...] = ("none", "selective", "offload", "full")  # presets mixed in pairs
    accum: tuple[int, ...] = (1, 2, 4, 8)
    state_memory: tuple[str, ...] = ("device", "pinned_host")  # and STREAM_UPDATE's
    strategies: tuple[str, ...] = ("dp", "zero1", "fsdp")
    # tensor-parallel sizes (Megatron's layout with sequence parallelism, ``--mesh ...,tp=T``):
    # each that divides the devices and the model (``ParallelConfig.check_model``) is searched
    tensor: tuple[int, ...] = (1,)
    # context-parallel sizes (the sequence split over devices, ``--mesh ...,cp=C``): each whose
    # product with a tensor size divides the devices, and that the model and sequence allow,
    # is searched, its attention run as ``cp_attention`` says (``ParallelConfig.cp_attention``)
    context: tuple[int, ...] = (1,)
    cp_attention: str = "gather"
    # with a tensor axis, the residual stream split by sequence too (the job's
    # ``parallel.sequence_parallel``)
    sequence_parallel: bool = True
    precisions: tuple[str, ...] = ("fp32",)
    # also the per-tag policies on the Pareto frontier of one block (``jaxmem.planner.tags``),
    # each over the whole stack
    tags: bool = True
    # also each stack unrolled (``MemoryPolicy.unroll``: the same FLOPs, another plan; GPU
    # targets only: XLA:CPU reflects remat only under scan)
    unroll: bool = True
    # also each stack with the head and loss in chunks (``LossPolicy``: the same FLOPs, no
    # logits kept): at most this many, the largest count dividing the sequence (``chunk_count``);
    # 0 (default): the whole loss only (the twins' compiles crowd out the rest of a search where
    # the logits are small: gpt2-1.5b on an H100 at 24 GiB used the compile cap on them)
    loss_chunks: int = 0
    # also each stack whose first block is rematerialised with the embedding lookup replayed
    # (``EmbeddingReplay``: one block input fewer; GPU targets only: XLA:CPU keeps a block's
    # activations outside a loop); off by default: its twins compile fits of their own
    replay_embedding: bool = False
    # also mixes of two per-tag policies (adjacent points of the lower convex hull of the
    # frontier, ``tags.hull``): the first k blocks under one, the rest under the other; with
    # ``tags``
    tag_mixes: bool = True
    # also ``full`` with the block inputs in host memory (``host.OFFLOADED_INPUTS``; GPU
    # targets; skipped where ``Problem.host_memory_bytes`` cannot hold them; jaxmem plan's on)
    offload_inputs: bool = False
    # with ``loss_chunks``: also the loss in tiles of these token counts (each dividing the
    # sequence into more than ``loss_chunks`` chunks), e.g. 1024..16384 at long sequences
    loss_tiles: tuple[int, ...] = ()
    # also ``full`` (and its inputs on host) with each block's MLP in sequence tiles of these
    # token counts (each dividing the sequence, shorter than it; a scanned stack without a
    # tensor axis): one tile's intermediates at a time
    mlp_tiles: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for field in ("policies", "mix"):
            bad = [p for p in getattr(self, field) if p not in POLICIES]
            require(not bad, f"plan {field} {bad} are not presets; valid: {', '.join(POLICIES)}")
        require("nested" not in self.mix, "nested applies to a whole stack: it does not mix")
        bad = [m for m in self.accum if not (isinstance(m, int) and m > 0)]
        require(not bad and self.accum, f"plan microbatch counts {bad} must be positive integers")
        bad = [p for p in self.precisions if p not in PRECISIONS]
        require(not bad, f"plan precisions {bad} are not one of {', '.join(PRECISIONS)}")
        bad = [t for t in self.mlp_tiles if not (isinstance(t, int) and t > 0)]
        require(not bad, f"plan mlp_tiles {bad} must be positive token counts")
        for field in ("tensor", "context"):
            bad = [n for n in getattr(self, field) if not (isinstance(n, int) and n > 0)]
            require(not bad and getattr(self, field), f"plan {field} sizes {bad} must be positive")
        require(
            self.cp_attention in CP_ATTENTIONS,
            f"plan cp_attention={self.cp_attention!r} is not one of {', '.join(CP_ATTENTIONS)}",
        )
        require(
            isinstance(self.loss_chunks, int) and self.loss_chunks >= 0,
            f"plan loss_chunks={self.loss_chunks!r} must be 0 (whole loss only) or a count",
        )


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the lattice, with its estimated cost."""

    policy: MemoryPolicy
    accum: int
    state_memory: str
    strategy: str | None  # None: one device
    precision: str
    flops: int  # per device and step, recompute included (jaxpr count)
    host_bytes: int  # per device and step over the host link (estimate: what offload moves)
    collective_bytes: int  # per device and step over the interconnect (ring estimate)
    seconds: float  # estimated step time (FLOPs / rate + bytes / bandwidths)
    # bytes of host memory a host update reads and writes per step (estimate, from shapes)
    host_update_bytes: int = 0
    tp: int = 1  # tensor-parallel devices (the rest of the mesh: context and data axes)
    cp: int = 1  # context-parallel devices (each row's sequence split over them)
    cp_attention: str = "gather"  # how attention meets the other context devices' keys
    sequence_parallel: bool = True  # with a tensor axis (ParallelConfig.sequence_parallel)
    # the step time's parts, MFU and assumptions (jaxmem.planner.cost; None on the local
    # backend, which is ordered by nominal rates)
    estimate: StepTime | None = dataclasses.field(default=None, compare=False)

    @property
    def stream(self) -> str | None:
        """Where a streamed stack's update runs (device | host); None: not streamed."""
        return STREAM_UPDATE.get(self.state_memory)

    @property
    def family(self) -> tuple:
        # a streamed step is another program (and its update placement another): its plans
        # fit apart
        streamed = ("streamed", self.stream) if self.stream else ()
        unrolled = ("unrolled",) if self.policy.unroll else ()
        tensor = (f"tp={self.tp}",) if self.tp > 1 else ()
        context = (f"cp={self.cp} {self.cp_attention}",) if self.cp > 1 else ()
        replay = ("replay",) if self.policy.embedding.replay else ()
        return (
            self.accum, self.strategy, *tensor, *context, self.precision, *streamed, *unrolled,
            *replay,
        )  # fmt: skip

    @property
    def layout(self) -> tuple[int, int, str]:
        """The mesh's tensor and context axes and the context axis's attention: what, beside
        the strategy, decides the program's sharding."""
        return (self.tp, self.cp, self.cp_attention if self.cp > 1 else "")

    def data(self, devices: int) -> int:
        """Devices on the data-parallel axis (the batch's rows split over these)."""
        return devices // (self.tp * self.cp)

    def describe(self) -> str:
        stack = policy_text(self.policy) + (" (unrolled)" if self.policy.unroll else "")
        parts = [stack, self.precision, f"accum {self.accum}"]
        if self.policy.embedding.replay:
            parts.append("embedding replayed")
        if self.policy.mlp_tile_tokens:
            parts.append(f"MLP in {self.policy.mlp_tile_tokens}-token tiles")
        if self.policy.loss.chunks:
            parts.append(f"loss in {self.policy.loss.chunks} chunks")
        if self.stream == "device":
            parts.append("streamed")
        elif self.stream == "host":
            parts.append("streamed, update on host")
        elif self.state_memory != "device":
            parts.append(f"state {self.state_memory}")
        if self.strategy is not None:
            parts.append(self.strategy)
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}" + (" ring" if self.cp_attention == "ring" else ""))
        return ", ".join(parts)

    def parallel(self, devices: int) -> ParallelConfig:
        """The mesh the candidate runs on (one device: the default)."""
        if self.strategy is None and self.tp == 1 and self.cp == 1:
            return ParallelConfig()
        return ParallelConfig(
            strategy=self.strategy or "dp", devices=devices, tp=self.tp, cp=self.cp,
            cp_attention=self.cp_attention if self.cp > 1 else "gather",
            sequence_parallel=self.sequence_parallel,
        )  # fmt: skip


# the memory model is fitted at two depths of at least 2 blocks (``Problem.fit_depths``): a
# shallower model is compiled whole, candidate by candidate
FIT_MIN_LAYERS = 4


@dataclasses.dataclass
class Problem:
    """What is planned: the model, the step's shape, the target, the mesh and the budget."""

    cfg: ModelConfig
    batch: int
    seq_len: int
    target: Target
    budget_bytes: int
    opt_cfg: OptimizerConfig
    devices: int = 1  # the mesh's devices (data x tensor x context, as a candidate lays them)
    # skip a candidate predicted over the budget by more than this fraction: the memory model's
    # measured error on mixed stacks (compare.tolerances "mixed_stack_prediction")
    slack: float = 0.20
    # LoRA adapters on a frozen base (rank 0: full fine-tuning): the lattice keeps to what
    # an adapter step composes with (``adapter_choice``), and every compile carries them
    adapters: AdapterConfig = AdapterConfig()
    # host bytes one host may keep for the mesh's devices on it (``host.host_share`` of them,
    # each ``predict.candidate_host_bytes``); None: no limit
    host_memory_bytes: int | None = None

    @property
    def compiled_whole(self) -> bool:
        """Under ``FIT_MIN_LAYERS`` blocks each candidate is compiled whole (``fit_depths``)."""
        return self.cfg.n_layers < FIT_MIN_LAYERS

    @property
    def fit_depths(self) -> tuple[int, int]:
        """The two depths each family is compiled at: half the model and the model, up to 16
        blocks (XLA plans a 2-block stack unlike a deep one: gpt2-1.5b's `none` on an H100,
        fitted at 2 and 4 blocks, erred by 11.6 % at 48 blocks, at 8 and 16 by 0.3 %)."""
        d2 = min(self.cfg.n_layers, 16)
        return min(max(2, d2 // 2), d2), d2


def policy_text(policy: MemoryPolicy) -> str:
    """A candidate's stack in words: a preset's or mix's name, or what a per-tag policy keeps."""
    if is_preset(policy) or len(policy.parts) > 1 or not policy.head.remat:
        return policy.name
    return f"keep {tags_text(policy.head.save) or 'block_input'}"


def part_key(policy: MemoryPolicy) -> str | tuple[str, ...]:
    """What identifies one part of a stack (a one-part stack, ``cost.priced_runs``): its preset's
    name, or a per-tag policy's saves (scanned or unrolled alike)."""
    policy = policy.replace(
        unroll=False, loss=LossPolicy(), embedding=EmbeddingReplay(), mlp_tile_tokens=0
    )
    name = preset_named(policy)
    return name if name is not None else ("tags", *policy.head.save)


def tensor_sizes(problem: Problem, space: PlanSpace) -> list[int]:
    """The tensor-parallel sizes searched: those of ``space.tensor`` that divide the devices
    and split the model's heads, MLP and sequence (``ParallelConfig.check_model``)."""
    return sorted({tp for tp, _ in mesh_layouts(problem, space) if tp in space.tensor})


def mesh_layouts(problem: Problem, space: PlanSpace) -> list[tuple[int, int]]:
    """The (tensor, context) sizes searched: each pair of ``space.tensor`` x ``space.context``
    whose product divides the devices and whose mesh the model and sequence allow
    (``ParallelConfig.check_model``: whole heads and MLP columns over the tensor axis, the
    sequence in ``2 cp`` equal chunks, the ring only under fused attention)."""
    out = []
    for tp in space.tensor:
        for cp in space.context:
            if problem.devices % (tp * cp):
                continue
            try:
                ParallelConfig(
                    devices=problem.devices, tp=tp, cp=cp,
                    cp_attention=space.cp_attention if cp > 1 else "gather",
                    sequence_parallel=space.sequence_parallel,
                ).check_model(problem.cfg, problem.seq_len)  # fmt: skip
            except ConfigError:
                continue
            out.append((tp, cp))
    return out


def _streams(problem: Problem, policy: MemoryPolicy, strategy: str | None) -> bool:
    """A streamed step applies (``jaxmem.job.check_stream``): one device or a data-parallel
    mesh, a preset over the whole scanned stack, an elementwise optimizer without clipping."""
    from jaxmem.config import STREAM_OPTIMIZERS

    return (
        (strategy is None) == (problem.devices == 1)
        and len(policy.parts) == 1
        and not policy.embedding.replay
        and not policy.nested
        and not policy.selects
        and not policy.unroll
        and problem.opt_cfg.name in STREAM_OPTIMIZERS
        and not problem.opt_cfg.clips
    )


def adapter_choice(adapters: AdapterConfig, tp: int, strategy: str | None, place: str) -> bool:
    """Whether an adapter step composes with these choices (else ``jaxmem.step.frozen.refusal``
    refuses it): its state on the device, a packed base not under fsdp. True without adapters."""
    packed = adapters.base != "compute"
    ok = place == "device" and not (packed and strategy == "fsdp")
    return ok or not adapters.enabled


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a stack is searched with beside its policy and precision (``_choices``)."""

    tp: int
    cp: int
    accum: int
    strategy: str | None  # None: no state shards (one device, or a tensor axis alone)
    place: str  # where the optimizer state lives (``PlanSpace.state_memory``)

    def data(self, devices: int) -> int:
        return devices // (self.tp * self.cp)


def _context_allows(
    problem: Problem, policy: MemoryPolicy, precision: str, cp: int, place: str
) -> bool:
    """A context axis runs ``policy`` (``jaxmem.job``): each device's ``S / cp`` positions in
    whole MLP and loss tiles, loss chunks a multiple of ``cp``, no streamed stack, no adapter
    dropout (``context_refusal``)."""
    from jaxmem.job import check_loss_chunks

    if cp == 1:
        return True
    if STREAM_UPDATE.get(place) or (problem.adapters.enabled and problem.adapters.dropout):
        return False
    try:
        check_loss_chunks(policy, PRECISIONS[precision], problem.seq_len, cp)
    except ConfigError:
        return False
    return True


def _choices(
    problem: Problem, space: PlanSpace, policy: MemoryPolicy, precision: str,
    layouts: list[tuple[int, int]],
) -> Iterator[Choice]:  # fmt: skip
    """What ``policy``'s stack is searched with: a mesh layout of ``layouts`` (a tensor axis
    under a scanned, untiled stack only; a context axis where ``_context_allows``), a
    microbatch count dividing the batch, a strategy (with devices to shard the state over), a
    placement (host ones on a GPU target, streaming where it applies)."""
    host = problem.target.is_gpu  # XLA:CPU erases host placements: the local lattice has none
    for tp, cp in layouts:
        if tp > 1 and (policy.unroll or policy.nested or policy.mlp_tile_tokens):
            continue  # tensor parallelism runs a scanned, untiled stack (JobConfig)
        data = problem.devices // (tp * cp)
        # the state shards over the data and context devices together (ParallelConfig)
        strategies = space.strategies if data * cp > 1 else (None,)
        for accum in space.accum:
            if problem.batch % (data * accum):
                continue
            for strategy in strategies:
                for place in space.state_memory if host else ("device",):
                    update = STREAM_UPDATE.get(place)
                    if update and (tp > 1 or not _streams(problem, policy, strategy)):
                        continue
                    if not adapter_choice(problem.adapters, tp, strategy, place):
                        continue
                    if not _context_allows(problem, policy, precision, cp, place):
                        continue
                    yield Choice(tp, cp, accum, strategy, place)


def _priced(
    problem: Problem, space: PlanSpace, work: cost.WorkModel, policy: MemoryPolicy,
    precision_name: str, per_row: int, choice: Choice,
) -> Candidate:  # fmt: skip
    """``policy`` under ``choice`` (``_choices``) with its cost for one device
    (``jaxmem.planner.cost``): the estimated step time, or the local backend's nominal order."""
    tp, cp, accum, strategy, place = (
        choice.tp, choice.cp, choice.accum, choice.strategy, choice.place
    )  # fmt: skip
    form = space.cp_attention if cp > 1 else "gather"
    cfg, opt_cfg, seq_len = problem.cfg, problem.opt_cfg, problem.seq_len
    precision = PRECISIONS[precision_name]
    data = choice.data(problem.devices)
    shards = data * cp  # what a strategy shards the state over
    rows = problem.batch // data
    flops = cost.device_flops(cfg, per_row, rows=rows, seq_len=seq_len, tp=tp, cp=cp)
    tensor = cost.tensor_parallel_bytes(
        cfg, precision, policy, rows=rows, seq_len=seq_len // cp, tp=tp
    )
    context = analytic.context_parallel_bytes(
        cfg, precision, policy, rows=rows, seq_len=seq_len, cp=cp, tp=tp, form=form
    )
    collective = (
        tensor
        + context
        + cost.data_parallel_bytes(cfg, precision, strategy, data=shards, tp=tp, accum=accum)
    )
    offloaded = cost.activation_offload_bytes(
        cfg, precision, policy, rows=rows, seq_len=seq_len, tp=tp * cp
    )
    update = STREAM_UPDATE.get(place)
    state, on_host = 0, 0
    if update:  # one device's shards of the stack (jaxmem.sharding's layout)
        state, on_host = cost.streamed_bytes(
            cfg, opt_cfg, precision, policy, accum, update,
            param_shards=data if strategy == "fsdp" else 1,
            state_shards=data if strategy in ("zero1", "fsdp") else 1,
        )  # fmt: skip
    elif place != "device":
        held = (shards if strategy in ("zero1", "fsdp") else 1) * tp
        state = cost.state_transfer_bytes(cfg, opt_cfg, precision, shards=held)
    moved, estimate = offloaded + state, None
    device = Device.of(problem.target)
    if device is None:
        seconds = cost.nominal_seconds(
            flops, rates_for(problem.target), precision.compute_dtype, link=moved,
            collectives=collective, host_update=on_host,
        )  # fmt: skip
    else:
        transfers = st.Transfers(
            activation_offload=offloaded, state=state,
            data_parallel=collective - tensor - context, tensor_parallel=tensor,
            context_parallel=context, host_update=on_host,
        )  # fmt: skip
        estimate = cost.gpu_step_time(
            cfg, opt_cfg, work, device, policy, precision, batch=problem.batch, seq_len=seq_len,
            devices=problem.devices, accum=accum, strategy=strategy, tp=tp, cp=cp,
            update=update, transfers=transfers,
        )  # fmt: skip
        seconds = estimate.seconds
    return Candidate(
        policy, accum, place, strategy, precision_name, flops, moved, collective, seconds,
        host_update_bytes=on_host, tp=tp, cp=cp, cp_attention=form,
        sequence_parallel=space.sequence_parallel, estimate=estimate,
    )  # fmt: skip


def enumerate_candidates(
    problem: Problem, space: PlanSpace, flops: FlopCounts, work: cost.WorkModel | None = None
) -> list[Candidate]:
    """Every candidate of the lattice with its cost (``_priced``; ``work``: the traces), cheapest
    first (``candidate_order``)."""
    work = work or cost.WorkModel(problem.cfg, problem.seq_len, problem.adapters)
    layouts = mesh_layouts(problem, space)
    out = []
    for precision_name in space.precisions:
        precision = PRECISIONS[precision_name]
        for policy in searched_stacks(problem, space, flops, precision):
            per_row = flops.per_row(policy, precision)
            for choice in _choices(problem, space, policy, precision_name, layouts):
                out.append(_priced(problem, space, work, policy, precision_name, per_row, choice))
    out.sort(key=candidate_order)
    return out


_PLACES = ("device", "pinned_host", STREAMED, STREAMED_HOST)


def candidate_order(c: Candidate) -> tuple:
    """The lattice's order: the cheapest first; among equal costs, fewer microbatches, the MLP
    whole, then in the largest tiles (a tiled twin is always compiled when reached: after the
    chunk twins, which a bound often settles without a compile), fewer loss chunks (chunks only
    where it does not fit: they run the head, not the whole step, as a loop of smaller
    matmuls), the state on the device, the scanned stack, then a preset before a per-tag policy
    (the cost counts matmuls only: a per-tag policy with none's FLOPs still recomputes the norms
    and activations), then the stack's name."""
    return (
        c.seconds,
        c.accum,
        1 / c.policy.mlp_tile_tokens if c.policy.mlp_tile_tokens else 0,
        c.policy.loss.chunks,
        c.policy.embedding.replay,
        _PLACES.index(c.state_memory),
        c.policy.unroll,
        len(c.policy.parts) == 1 and not is_preset(c.policy),
        policy_text(c.policy),
    )


def candidate_spec(
    problem: Problem,
    cand: Candidate,
    policy: MemoryPolicy | None = None,
    model: ModelConfig | None = None,
) -> StepSpec:
    """The step the planner compiles for ``cand`` (under ``policy``, at ``model``'s depth: a
    family's fit compiles; by default the candidate's own). It is the step ``jaxmem train``
    runs for ``candidate_job``, but for optimizer state kept in host memory: a deviceless
    compile drops argument memory kinds, so that state is compiled on the device and its bytes
    taken off the plan from shapes (``predict.state_host_bytes``)."""
    return StepSpec(
        model=model or problem.cfg,
        policy=policy or cand.policy,
        precision=PRECISIONS[cand.precision],
        optimizer=dataclasses.replace(
            problem.opt_cfg,
            stream=cand.stream is not None,
            stream_update="host" if cand.stream == "host" else None,
        ),
        batch=problem.batch,
        seq_len=problem.seq_len,
        accum=AccumConfig(steps=cand.accum),
        parallel=cand.parallel(problem.devices),
        target=problem.target,
        adapters=problem.adapters,
    )


def candidate_job(
    job: JobConfig, cand: Candidate, devices: int, batch: int | None = None
) -> JobConfig:
    """``job`` with ``cand``'s choices applied (and ``batch``, where the planned batch is not
    ``job``'s: ``jaxmem plan``'s template, ``template_job``): what ``jaxmem train`` runs."""
    return dataclasses.replace(
        job,
        run=job.run if batch is None else dataclasses.replace(job.run, batch_size=batch),
        memory=cand.policy,
        precision=PRECISIONS[cand.precision],
        accum=dataclasses.replace(job.accum, steps=cand.accum),
        optimizer=dataclasses.replace(
            job.optimizer,
            state_memory="device",
            stream=True,
            # the device update is the default: a streamed command names only the host one
            stream_update="host" if cand.stream == "host" else None,
        )
        if cand.stream
        else dataclasses.replace(
            job.optimizer, state_memory=cand.state_memory, stream=False, stream_update=None
        ),
        parallel=cand.parallel(devices),
    )

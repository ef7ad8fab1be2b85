"""``jaxmem plan``: the cheapest training configuration that fits a memory budget, proved by
compiling it for the target.

The lattice (``PlanSpace``): the stack's memory policy — a preset, or the first k blocks under one
preset and the other L - k under another (``jaxmem.policy.mixed_policy``: two consecutive scans;
on identical blocks the order does not change the peak, measured: ``selective:2+full`` and
``full:6+selective`` plan the same bytes on an 8-layer H100 plan) — × microbatch count × where the
optimizer state lives × data-parallel strategy (with a mesh) × precision (only when the user
allows it).

Cost (``Candidate.seconds``, an **estimate**, never a measurement): on a GPU target, the step
time ``jaxmem.planner.cost`` estimates before compiling (the gradient's jaxpr read kernel by
kernel: matmuls at a shape-dependent share of the target's peak, memory-bound work at its HBM
bandwidth, host-link and collective bytes with the overlap ``jaxmem.memory.step_time`` states);
on the local backend a nominal order (matmul FLOPs at a nominal rate plus bytes), not a time.
Each compiled candidate also carries its compiled plan's own estimate (``Outcome.plan_time``,
the HLO read the same way).

Method: the plan's bytes are predicted from a model fitted from a few compiles — each (preset,
microbatches, strategy, precision) family compiled at two depths (half the model and the model,
up to 16 blocks), the planned peak affine in the depth, a mixed stack taking each part's per-
block slope — then candidates are compiled at the real depth in cost order until one fits; a
candidate whose prediction is over the budget by more than ``slack`` is not compiled (``over
(predicted)``). Each compile calibrates the predictions of candidates mixing the same presets in
the same family (they err alike): those carry its error, and are compiled only within twice the
error calibrated predictions of that pair still showed (at least 1 %, at most ``slack``). On a GPU
target the first fit is confirmed: up to ``confirm`` more candidates that the estimate before
compiling rates faster than the fit's compiled plan are compiled, and one that fits replaces it
when its compiled estimate is lower by more than ``TIE`` (2 %: closer is a tie); a runner-up
whose stack parts already compiled slower than traced carries their ratio (block-weighted)
and is skipped when that rates it no faster, and a fit squeezed by XLA (compiled slower than
traced by more than ``TIE``) is confirmed only against candidates predicted ``HEADROOM`` below
its bytes. The answer is
the cheapest candidate on the lattice whose compiled plan fits, when no skipped candidate's
prediction erred by more than ``slack`` (each compiled candidate's prediction error is reported,
so that can be checked) and, on a GPU target, the two estimates order the candidates alike
beyond the ones confirmed.

What a deviceless compile cannot show is labelled, not guessed: optimizer state in
``pinned_host`` on a GPU target is the plan with the state on the device minus the state's
bytes (a deviceless compile drops argument memory kinds: ``records._state_offload``'s lower
bound); XLA:CPU erases host placements, so the local backend's lattice has no host offload.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from flax import nnx

from jaxmem.config import AccumConfig, ConfigError, ModelConfig, OptimizerConfig, require
from jaxmem.job import JobConfig
from jaxmem.memory import analytic
from jaxmem.memory import step_time as st
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.memory.remat import layers_fn
from jaxmem.memory.step_time import Device, StepTime
from jaxmem.memory.targets import NOMINAL, RATES, Rates, Target, rates_for  # noqa: F401  (re-exported)
from jaxmem.model import make_model
from jaxmem.parallel import ParallelConfig
from jaxmem.planner import cost, tags
from jaxmem.planner.records import lm_step_batch, plan_step
from jaxmem.policy import (
    POLICIES,
    MemoryPolicy,
    can_replay_embedding,
    is_preset,
    mixed_policy,
    preset_named,
    split_policy,
    tags_text,
)
from jaxmem.precision import PRECISIONS, Precision
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import lm_loss_fn

GIB = 2**30
# placements of the state beside device and pinned_host: the stack's parameters and state
# streamed through host memory (optimizer.stream), updated block by block on the device or in
# host memory (optimizer.stream_update)
STREAMED = "stream"
STREAMED_HOST = "stream-host"
STREAM_UPDATE = {STREAMED: "device", STREAMED_HOST: "host"}
USABLE_FRACTION = 0.9  # of a GPU's memory: the CUDA context, cuDNN/cuBLAS workspaces, fragmentation


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
    precisions: tuple[str, ...] = ("fp32",)
    # also the per-tag policies on the Pareto frontier of one block (``jaxmem.planner.tags``),
    # each over the whole stack
    tags: bool = True
    # also each stack unrolled (``MemoryPolicy.unroll``: the same FLOPs, another plan; GPU
    # targets only: XLA:CPU reflects remat only under scan)
    unroll: bool = True
    # also each stack with the head and loss in chunks (``MemoryPolicy.loss_chunks``: the same
    # FLOPs, no logits kept): at most this many, the largest count dividing the sequence
    # (``chunk_count``); 0 (default): the whole loss only. Off by default: where the logits are a
    # small part of the step the twins' compiles crowd out the rest of a search (gpt2-1.5b on an
    # H100 at 24 GiB: the twins of selective:k+full, each within chunk_savings_bound of the
    # budget, used the compile cap before the state-offload plan that fits was reached)
    loss_chunks: int = 0
    # also each stack whose first block is rematerialised with the embedding lookup replayed in
    # its backward (``MemoryPolicy.replay_embedding``: the same FLOPs, one block input fewer kept;
    # GPU targets only: XLA:CPU keeps the activations of a block outside a loop). Its twins
    # compile memory-model fits of their own, so it is off by default: it matters where one
    # block input is a real part of the budget (a shallow model)
    replay_embedding: bool = False
    # also mixes of two per-tag policies (adjacent points of the lower convex hull of the
    # frontier, ``tags.hull``): the first k blocks under one, the rest under the other; with
    # ``tags``
    tag_mixes: bool = True

    def __post_init__(self) -> None:
        for field in ("policies", "mix"):
            bad = [p for p in getattr(self, field) if p not in POLICIES]
            require(not bad, f"plan {field} {bad} are not presets; valid: {', '.join(POLICIES)}")
        require("nested" not in self.mix, "nested applies to a whole stack: it does not mix")
        bad = [m for m in self.accum if not (isinstance(m, int) and m > 0)]
        require(not bad and self.accum, f"plan microbatch counts {bad} must be positive integers")
        bad = [p for p in self.precisions if p not in PRECISIONS]
        require(not bad, f"plan precisions {bad} are not one of {', '.join(PRECISIONS)}")
        require(
            isinstance(self.loss_chunks, int) and self.loss_chunks >= 0,
            f"plan loss_chunks={self.loss_chunks!r} must be 0 (whole loss only) or a count",
        )


def chunk_count(most: int, seq_len: int) -> int:
    """The largest number of loss chunks at most ``most`` that divides ``seq_len`` (0: none)."""
    return max((k for k in range(1, most + 1) if seq_len % k == 0), default=0)


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
    tp: int = 1  # tensor-parallel devices (the rest of the mesh is the strategy's data axis)
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
        replay = ("replay",) if self.policy.replay_embedding else ()
        return (self.accum, self.strategy, *tensor, self.precision, *streamed, *unrolled, *replay)

    def describe(self) -> str:
        stack = policy_text(self.policy) + (" (unrolled)" if self.policy.unroll else "")
        parts = [stack, self.precision, f"accum {self.accum}"]
        if self.policy.replay_embedding:
            parts.append("embedding replayed")
        if self.policy.loss_chunks:
            parts.append(f"loss in {self.policy.loss_chunks} chunks")
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
        return ", ".join(parts)

    def parallel(self, devices: int) -> ParallelConfig:
        """The mesh the candidate runs on (one device: the default)."""
        if self.strategy is None and self.tp == 1:
            return ParallelConfig()
        return ParallelConfig(strategy=self.strategy or "dp", devices=devices, tp=self.tp)


@dataclasses.dataclass
class Problem:
    """What is planned: the model, the step's shape, the target, the mesh and the budget."""

    cfg: ModelConfig
    batch: int
    seq_len: int
    target: Target
    budget_bytes: int
    opt_cfg: OptimizerConfig
    devices: int = 1  # data-parallel devices (a mesh of one axis)
    # skip a candidate predicted over the budget by more than this fraction: the memory model's
    # measured error on mixed stacks (compare.tolerances "mixed_stack_prediction")
    slack: float = 0.20

    @property
    def fit_depths(self) -> tuple[int, int]:
        """The two depths each family is compiled at: half the model and the model, up to 16
        blocks (XLA plans a 2-block stack unlike a deep one: gpt2-1.5b bf16 8 x 1024, 8
        microbatches, H100 plan, `none` grows 0.808 GiB a block from 2 to 4 blocks and 0.7106
        from 4 to 8 and from 8 to 12; fitted at 2 and 4 it erred by 11.6 % at 48 blocks,
        at 8 and 16 by 0.3 %)."""
        d2 = min(self.cfg.n_layers, 16)
        return min(max(2, d2 // 2), d2), d2


def policy_text(policy: MemoryPolicy) -> str:
    """A candidate's stack in words: a preset's or mix's name, or what a per-tag policy keeps."""
    if is_preset(policy) or policy.rest is not None or not policy.remat:
        return policy.name
    return f"keep {tags_text(policy.save) or 'block_input'}"


def _part_key(policy: MemoryPolicy) -> str | tuple[str, ...]:
    """What identifies one part of a stack: its preset's name, or a per-tag policy's saves
    (scanned or unrolled alike)."""
    policy = policy.replace(unroll=False, loss_chunks=0, replay_embedding=False)
    name = preset_named(policy)
    return name if name is not None else ("tags", *policy.save)


# ---------------------------------------------------------------------------------- FLOPs
def _flops_per_row(cfg: ModelConfig, policy: MemoryPolicy, precision: Precision, seq: int) -> int:
    """Matmul FLOPs of one row's gradient (forward, recompute, backward) under ``policy``."""
    model = nnx.eval_shape(lambda: make_model(cfg, precision))
    graphdef, params = nnx.split(model, nnx.Param)
    micro = lm_step_batch(cfg, 1, seq, abstract=True)
    loss = lm_loss_fn(
        graphdef, layers_fn=layers_fn(policy, cfg.n_layers), loss_chunks=policy.loss_chunks
    )
    return grad_matmul_flops(lambda p, b: loss(p, b)[0], params, micro)


class FlopModel:
    """Per-row FLOPs of any stack: ``c + Σ_parts n_blocks · s_preset``, each preset's per-block
    FLOPs ``s`` and the rest ``c`` from traces at depths 1 and 2 (matmul FLOPs are exactly
    affine in the number of blocks under each policy; nested, √L segments, is traced at its
    real depth)."""

    def __init__(self, cfg: ModelConfig, seq_len: int):
        self.cfg, self.seq_len = cfg, seq_len
        self._fit: dict[tuple, tuple[int, int]] = {}
        self._nested: dict[str, int] = {}

    def _part(self, policy: MemoryPolicy, precision: Precision) -> tuple[int, int]:
        key = (_part_key(policy), precision.name)
        if key not in self._fit:
            f1, f2 = (
                _flops_per_row(self.cfg.replace(n_layers=d), policy, precision, self.seq_len)
                for d in (1, 2)
            )
            self._fit[key] = (f1 - (f2 - f1), f2 - f1)
        return self._fit[key]

    def tag_frontier(self, precision: Precision) -> list[tags.TagPoint]:
        """The per-tag policies of one block on the bytes/FLOPs Pareto frontier."""
        return _tag_frontier(self.cfg, precision, self.seq_len)

    def per_row(self, policy: MemoryPolicy, precision: Precision) -> int:
        if policy.nested:
            if precision.name not in self._nested:
                self._nested[precision.name] = _flops_per_row(
                    self.cfg, policy, precision, self.seq_len
                )
            return self._nested[precision.name]
        total = None
        for n, part in split_policy(policy, self.cfg.n_layers):
            c, s = self._part(part, precision)
            total = (c if total is None else total) + n * s
        return total


@functools.lru_cache(maxsize=16)
def _tag_frontier(cfg: ModelConfig, precision: Precision, seq_len: int) -> list[tags.TagPoint]:
    """``tags.frontier`` once per model, precision and sequence length in a process (its
    2^units jaxpr traces are the same for every search of that model: ``--policy auto``,
    repeated budgets)."""
    return tags.frontier(cfg, precision, seq_len, _flops_per_row)


# ---------------------------------------------------------------------------------- memory
def _offloaded_bytes_per_row(cfg: ModelConfig, precision: Precision, seq: int) -> int:
    """Bytes one row's block sends to host memory under ``offload`` (analytic, per block)."""
    one = cfg.replace(n_layers=1)
    return analytic.saved_activation_bytes(one, POLICIES["offload"], 1, seq, precision).host_bytes


class MemoryModel:
    """Planned peak bytes predicted from compiles: for each family (preset, microbatches,
    strategy, precision), the plan at two small depths gives ``a + L · b``; a mixed stack is
    ``max(a_A, a_B) + k · b_A + (L - k) · b_B``; nested is compiled at its real depth."""

    def __init__(self, problem: Problem, compile_fn: Callable[..., int]):
        self.problem, self.compile_fn = problem, compile_fn
        self.fits: dict[tuple, tuple[float, float]] = {}
        self.corrections: dict[tuple, float] = {}
        self.residuals: dict[tuple, list[float]] = {}
        self.compiles = 0

    def _family(self, part: MemoryPolicy, cand: Candidate) -> tuple[float, float]:
        name = _part_key(part)
        if not isinstance(name, str):
            # a per-tag policy: selective's family, each block keeping the analytic difference
            # in bytes per row (the compile of the candidate itself is the proof)
            a, b = self._family(POLICIES["selective"], cand)
            precision = PRECISIONS[cand.precision]
            rows = self.problem.batch // (self.problem.devices // cand.tp * cand.accum)
            cfg, seq = self.problem.cfg, self.problem.seq_len
            delta = tags.block_bytes(cfg, part, seq, precision) - tags.block_bytes(
                cfg, POLICIES["selective"], seq, precision
            )
            return a, b + rows * delta / cand.tp  # the tags' bytes split over tensor devices
        # fitted on the scanned stack; an unrolled one is predicted from its scan's fit (it
        # plans within ~20 % of it: 0.79x to 0.94x measured, offload 2.2x) and calibrated by
        # its own compiles (``observe``): no unrolled fit compiles, which are the slowest
        family = tuple(f for f in cand.family if f != "unrolled")
        key = (name, *family)
        if key not in self.fits:
            d1, d2 = self.problem.fit_depths
            fitted = POLICIES[name]
            if "replay" in family and can_replay_embedding(fitted):
                fitted = fitted.replace(replay_embedding=True)
            peaks = [
                self.compile_fn(
                    self.problem.cfg.replace(n_layers=d),
                    fitted,
                    cand.accum,
                    cand.strategy,
                    cand.precision,
                    cand.stream,
                    **_tensor(cand),
                )
                for d in dict.fromkeys((d1, d2))
            ]
            self.compiles += len(peaks)
            # a model of at most 2 blocks is compiled at its own depth alone: no slope needed
            b = (peaks[-1] - peaks[0]) / (d2 - d1) if d2 > d1 else 0.0
            p1 = peaks[0]
            self.fits[key] = (p1 - d1 * b, b)
        return self.fits[key]

    def predict(self, cand: Candidate) -> float | None:
        """Predicted planned peak (device bytes); None for nested (compiled, not predicted)."""
        if cand.policy.nested:
            return None
        parts = split_policy(cand.policy, self.problem.cfg.n_layers)
        fits = [(n, self._family(p, cand)) for n, p in parts]
        peak = max(a for _, (a, _) in fits) + sum(n * b for n, (_, b) in fits)
        return (
            peak
            + self.corrections.get(self._pair(cand), 0.0)
            - state_host_bytes(self.problem, cand)
        )

    def _pair(self, cand: Candidate) -> tuple:
        """Candidates whose prediction errs alike: the same presets in the same family."""
        parts = split_policy(cand.policy, self.problem.cfg.n_layers)
        return (
            *sorted(str(_part_key(p)) for _, p in parts),
            cand.policy.unroll,
            cand.policy.replay_embedding,
            cand.accum,
            cand.strategy,
            cand.tp,
            cand.precision,
        )

    def observe(self, cand: Candidate, predicted: float | None, compiled: int) -> None:
        """Calibrate: the next predictions of candidates that mix the same presets in the same
        family carry the error this compile showed (mixed stacks of one pair err alike, by the
        overlap of the two parts' working sets; measured)."""
        if predicted is not None:
            key = self._pair(cand)
            if key in self.corrections:  # a calibrated prediction: how far it still erred
                self.residuals.setdefault(key, []).append(abs(compiled - predicted) / compiled)
            self.corrections[key] = self.corrections.get(key, 0.0) + compiled - predicted

    def slack(self, cand: Candidate, default: float) -> float:
        """How far over the budget a prediction may be and still be compiled: ``default``
        until the candidate's pair is calibrated, then twice the largest error calibrated
        predictions of that pair showed (at least 1 %)."""
        errors = self.residuals.get(self._pair(cand))
        if self._pair(cand) not in self.corrections:
            return default
        return min(default, max(0.01, 2 * max(errors))) if errors else min(default, 0.02)


def state_host_bytes(problem: Problem, cand: Candidate) -> int:
    """Optimizer-state bytes per device a candidate keeps in host memory (from shapes); a
    streamed candidate's plan is already its device's (``records.stream_plan``)."""
    if cand.state_memory == "device" or cand.stream:
        return 0
    precision = PRECISIONS[cand.precision]
    total = analytic.opt_state_bytes(problem.cfg, problem.opt_cfg, precision)
    data = problem.devices // cand.tp
    shards = (data if cand.strategy in ("zero1", "fsdp") else 1) * cand.tp
    return total // shards


# ---------------------------------------------------------------------------------- lattice
def _stacks(
    space: PlanSpace,
    n_layers: int,
    host: bool,
    tagged: Iterable[MemoryPolicy] = (),
    hull: Sequence[MemoryPolicy] = (),
) -> list[MemoryPolicy]:
    usable = [p for p in space.policies if host or not POLICIES[p].offload]
    stacks = [POLICIES[p] for p in usable]
    # per-tag policies that keep what no searched preset keeps (a frontier point may be one)
    kept = {(p.remat, frozenset(p.save)) for p in stacks if not p.nested}
    stacks += [p for p in tagged if (p.remat, frozenset(p.save)) not in kept]
    mix = [p for p in space.mix if host or not POLICIES[p].offload]
    for i, a in enumerate(mix):
        for b in mix[i + 1 :]:
            for k in range(1, n_layers):
                stacks.append(mixed_policy(a, k, b))
    # per-tag mixes: neighbours on the hull (fewest bytes first), the one keeping more first
    for lean, rich in itertools.pairwise(hull):
        for k in range(1, n_layers):
            stacks.append(mixed_policy(rich, k, lean))
    return stacks


def tensor_sizes(problem: Problem, space: PlanSpace) -> list[int]:
    """The tensor-parallel sizes searched: those of ``space.tensor`` that divide the devices
    and split the model's heads, MLP and sequence (``ParallelConfig.check_model``)."""
    out = []
    for tp in space.tensor:
        if tp < 1 or problem.devices % tp:
            continue
        try:
            ParallelConfig(devices=problem.devices, tp=tp).check_model(problem.cfg, problem.seq_len)
        except ConfigError:
            continue
        out.append(tp)
    return out


def _tensor(cand: Candidate) -> dict[str, int]:
    """The compile function's tensor-parallel argument, given only where there is one."""
    return {"tp": cand.tp} if cand.tp > 1 else {}


def enumerate_candidates(
    problem: Problem, space: PlanSpace, flops: FlopModel, work: cost.WorkModel | None = None
) -> list[Candidate]:
    """Every candidate of the lattice with its cost, cheapest first (ties: fewer microbatches,
    state on the device, then the stack's name). A GPU target's cost is the estimated step time
    (``jaxmem.planner.cost``, ``work``'s traces); the local backend's the nominal order."""
    cfg, target = problem.cfg, problem.target
    rates = rates_for(target)
    device = Device.of(target)
    work = work or cost.WorkModel(cfg, problem.seq_len)
    host = target.is_gpu  # XLA:CPU erases host placements: the local lattice has none
    n = problem.devices
    sizes = tensor_sizes(problem, space)
    head_per_row = analytic.head_flops(cfg, 1, problem.seq_len)
    out = []
    for precision_name in space.precisions:
        precision = PRECISIONS[precision_name]
        param_bytes = analytic.param_bytes(cfg, precision)
        state = analytic.opt_state_bytes(cfg, problem.opt_cfg, precision)
        offload_row = _offloaded_bytes_per_row(cfg, precision, problem.seq_len)
        frontier = flops.tag_frontier(precision) if space.tags else []
        hull = [t.policy for t in tags.hull(frontier)] if space.tag_mixes else []
        stacks = _stacks(space, cfg.n_layers, host, [t.policy for t in frontier], hull)
        if host and space.replay_embedding:  # a GPU target (XLA:CPU: see PlanSpace)
            stacks += [p.replace(replay_embedding=True) for p in stacks if can_replay_embedding(p)]
        if host and space.unroll:  # a GPU target: each stack unrolled too (nested scans)
            stacks += [p.replace(unroll=True) for p in stacks if not p.nested]
        chunks = chunk_count(space.loss_chunks, problem.seq_len)
        if chunks and precision.loss_scale != "dynamic":  # jaxmem.job.check_loss_chunks
            stacks += [p.replace(loss_chunks=chunks) for p in stacks]
        for policy in stacks:
            per_row = flops.per_row(policy, precision)
            offloaded_blocks = _offloaded_blocks(policy, cfg.n_layers)
            for tp in sizes:
                if tp > 1 and (policy.unroll or policy.nested):
                    continue  # tensor parallelism runs a scanned stack (JobConfig)
                data = n // tp
                rows = problem.batch // data
                strategies: Iterable[str | None] = space.strategies if data > 1 else (None,)
                # per tensor device: the blocks' matmuls split, the LM head's whole
                f = (
                    per_row * rows
                    if tp == 1
                    else head_per_row * rows + (per_row - head_per_row) * rows // tp
                )
                # Megatron-SP's all-gathers and reduce-scatters of one row's [S, D] activations:
                # 4 per block forward, 4 backward (4 more when the block is replayed)
                passes = 12 if policy.remat else 8
                tensor_bytes = int(
                    passes
                    * (tp - 1)
                    / tp
                    * rows
                    * problem.seq_len
                    * cfg.d_model
                    * precision.compute_bytes
                    * cfg.n_layers
                )
                for accum in space.accum:
                    if problem.batch % (data * accum):
                        continue
                    for strategy in strategies:
                        ring = 2 * (data - 1) / data if data > 1 else 0.0
                        shard = param_bytes / tp  # one tensor group member's weights
                        if strategy in ("dp", "zero1"):  # all-reduce (or reduce-scatter + gather)
                            collective = int(ring * shard)
                        elif strategy == "fsdp":  # gather twice, reduce-scatter, per microbatch
                            collective = int(1.5 * ring * shard * accum)
                        else:
                            collective = 0
                        collective += tensor_bytes
                        for place in space.state_memory if host else ("device",):
                            update = STREAM_UPDATE.get(place)
                            if update and (tp > 1 or not _streams(problem, policy, strategy)):
                                continue
                            shards = (data if strategy in ("zero1", "fsdp") else 1) * tp
                            offloaded = 2 * offload_row * rows * offloaded_blocks // tp
                            moved = offloaded
                            on_host = 0
                            if update:
                                # one device's shards of the stack (jaxmem.sharding's layout)
                                link, on_host = _streamed_bytes(
                                    cfg,
                                    problem.opt_cfg,
                                    precision,
                                    policy,
                                    accum,
                                    update,
                                    param_shards=data if strategy == "fsdp" else 1,
                                    state_shards=data if strategy in ("zero1", "fsdp") else 1,
                                )
                                moved += link
                            elif place != "device":
                                moved += 2 * state // shards
                            estimate = None
                            if device is None:
                                seconds = cost.nominal_seconds(
                                    f,
                                    rates,
                                    precision.compute_dtype,
                                    link=moved,
                                    collectives=collective,
                                    host_update=on_host,
                                )
                            else:
                                estimate = _estimate(
                                    problem, work, device, policy, precision, accum, strategy,
                                    tp, update, st.Transfers(
                                        activation_offload=offloaded,
                                        state=moved - offloaded,
                                        data_parallel=collective - tensor_bytes,
                                        tensor_parallel=tensor_bytes,
                                        host_update=on_host,
                                    ),
                                )  # fmt: skip
                                seconds = estimate.seconds
                            out.append(
                                Candidate(
                                    policy,
                                    accum,
                                    place,
                                    strategy,
                                    precision_name,
                                    f,
                                    moved,
                                    collective,
                                    seconds,
                                    on_host,
                                    tp,
                                    estimate,
                                )
                            )
    order = {p: i for i, p in enumerate(("device", "pinned_host", STREAMED, STREAMED_HOST))}
    # among equal costs: fewer microbatches, the whole loss (chunks only where it does not fit:
    # they run the head, not the whole step, as a loop of smaller matmuls), the state on the
    # device, the scanned stack, then a preset before a per-tag policy (the cost counts matmuls
    # only: a per-tag policy with none's FLOPs still recomputes the norms and activations)
    out.sort(
        key=lambda c: (
            c.seconds,
            c.accum,
            c.policy.loss_chunks > 0,
            c.policy.replay_embedding,
            order[c.state_memory],
            c.policy.unroll,
            c.policy.rest is None and not is_preset(c.policy),
            policy_text(c.policy),
        )
    )
    return out


def _estimate(
    problem: Problem,
    work: cost.WorkModel,
    device: Device,
    policy: MemoryPolicy,
    precision: Precision,
    accum: int,
    strategy: str | None,
    tp: int,
    update: str | None,
    transfers: st.Transfers,
) -> StepTime:
    """A GPU candidate's estimated step time (``jaxmem.planner.cost``): its microbatches'
    gradient work, its update's and accumulation's bytes, its transfers."""
    cfg = problem.cfg
    data = problem.devices // tp
    rows = problem.batch // data // accum
    outside, blocks = work.micro(policy, precision, rows)
    param_shards = (data if strategy == "fsdp" else 1) * tp  # what each device holds
    state_shards = (data if strategy in ("zero1", "fsdp") else 1) * tp  # and updates
    memory = cost.update_bytes(
        cfg, problem.opt_cfg, precision, param_shards=state_shards, state_shards=state_shards
    ) + cost.accumulation_bytes(cfg, precision, accum, param_shards)
    if update == "host":  # the stack's update runs in host memory: only the rest's here
        one, two = (
            cost.update_bytes(cfg.replace(n_layers=n), problem.opt_cfg, precision,
                              param_shards=state_shards, state_shards=state_shards)
            for n in (1, 2)
        )  # fmt: skip
        memory -= cfg.n_layers * (two - one)
    return cost.step_estimate(
        outside,
        blocks,
        device,
        accum=accum,
        tp=tp,
        memory_bytes=max(0, memory),
        model_flops=analytic.mfu_flops(cfg, problem.batch // data, problem.seq_len) // tp,
        transfers=transfers,
        compute_dtype=precision.compute_dtype,
    )


def _streams(problem: Problem, policy: MemoryPolicy, strategy: str | None) -> bool:
    """A streamed step applies (``jaxmem.job.check_stream``): one device or a data-parallel
    mesh (dp, zero1, fsdp), a preset over the whole scanned stack, an elementwise optimizer (any
    microbatch count: it sums them in its own scan; fp16 too)."""
    from jaxmem.config import STREAM_OPTIMIZERS

    return (
        (strategy is None) == (problem.devices == 1)
        and policy.rest is None
        and not policy.replay_embedding
        and not policy.nested
        and policy.layers.is_all
        and not policy.unroll
        and problem.opt_cfg.name in STREAM_OPTIMIZERS
    )


def _streamed_bytes(
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
    """Bytes of a streamed step (from shapes, as ``records.stream_transfers``): over the host
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
    fetches = 2 if policy.remat else 1
    summed = accum * 3 * p if accum > 1 else 0  # the running sum added to block by block
    updated = (2 * p + s) + (p + s)
    link = accum * (fetches * p + p) + summed
    checked = p if precision.loss_scale == "dynamic" else 0  # fp16's overflow check, on host
    return (link + updated, checked) if update == "device" else (link, updated + checked)


def _offloaded_blocks(policy: MemoryPolicy, n_layers: int) -> int:
    return sum(n for n, p in split_policy(policy, n_layers) if p.offload)


def candidate_job(job: JobConfig, cand: Candidate, devices: int) -> JobConfig:
    """``job`` with ``cand``'s choices applied: what ``jaxmem train`` runs for it."""
    return dataclasses.replace(
        job,
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


# ---------------------------------------------------------------------------------- search
@dataclasses.dataclass
class Outcome:
    candidate: Candidate
    predicted: float | None = None
    compiled: int | None = None  # planned peak per device, state adjustment applied
    # chosen | fits (compiled estimate not faster) | over (compiled) | over (predicted) |
    # not reached
    status: str = "not reached"
    # the compiled plan's own estimated step time (jaxmem.memory.step_time.of_plan: its HLO's
    # kernels; a GPU target's compiled candidates only)
    plan_time: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {
            "configuration": c.describe(),
            "policy": policy_text(c.policy),
            "save": list(c.policy.save),
            "loss_chunks": c.policy.loss_chunks,
            "accum": c.accum,
            "state_memory": c.state_memory,
            "strategy": c.strategy,
            "tp": c.tp,
            "precision": c.precision,
            "flops": c.flops,
            "host_bytes": c.host_bytes,
            "host_update_bytes": c.host_update_bytes,
            "collective_bytes": c.collective_bytes,
            "estimated_seconds": c.seconds,
            "estimated_mfu": c.estimate.mfu if c.estimate is not None else None,
            "estimate": c.estimate.as_dict() if c.estimate is not None else None,
            "plan_estimated_seconds": self.plan_time["seconds"] if self.plan_time else None,
            "plan_estimated_mfu": self.plan_time["mfu"] if self.plan_time else None,
            "predicted_bytes": None if self.predicted is None else int(self.predicted),
            "compiled_bytes": self.compiled,
            "status": self.status,
        }


@dataclasses.dataclass
class PlanResult:
    problem: Problem
    outcomes: list[Outcome]
    chosen: Outcome | None
    compiler: str
    fit_compiles: int
    candidate_compiles: int
    stopped: bool = False  # the search hit max_compiles before a candidate fitted

    def smallest(self) -> Outcome | None:
        done = [o for o in self.outcomes if o.compiled is not None]
        return min(done, key=lambda o: o.compiled) if done else None

    def max_fit_error(self) -> float | None:
        """The memory model's largest error on compiled candidates; unrolled stacks aside
        (predicted as their scan, not fitted: ``MemoryModel._family``)."""
        errs = [
            abs(o.predicted - o.compiled) / o.compiled
            for o in self.outcomes
            if o.predicted is not None and o.compiled and not o.candidate.policy.unroll
        ]
        return max(errs) if errs else None


def _compiler(problem: Problem) -> Callable[..., tuple[int, str]]:
    precision_of = PRECISIONS

    def compile_peak(
        cfg: ModelConfig,
        policy: MemoryPolicy,
        accum: int,
        strategy: str | None,
        precision: str,
        stream: str | None = None,
        tp: int = 1,
    ) -> tuple[int, str]:
        parallel = (
            ParallelConfig()
            if strategy is None and tp == 1
            else ParallelConfig(strategy=strategy or "dp", devices=problem.devices, tp=tp)
        )
        spec = StepSpec(
            model=cfg,
            policy=policy,
            precision=precision_of[precision],
            optimizer=dataclasses.replace(
                problem.opt_cfg,
                stream=stream is not None,
                stream_update="host" if stream == "host" else None,
            ),
            batch=problem.batch,
            seq_len=problem.seq_len,
            target=problem.target,
            accum=AccumConfig(steps=accum),
            parallel=parallel,
        )
        r = plan_step(spec)
        compile_peak.step_time = r.get("step_time")  # the compiled plan's own estimate
        return r["planned_peak_bytes"], r["compiler"]

    compile_peak.step_time = None
    return compile_peak


# Runners-up compiled after the first fit (GPU targets): the estimate before compiling reads the
# traced program, the compiled plan's reads XLA's, and near ties can swap (gpt2-1.5b, 8 x 1024
# on an H100: keeping the attention probabilities, unrolled, 0.407 s before compiling and 0.540
# s compiled; recomputing them, scanned, 0.412 s and 0.438 s), so the first fit is confirmed
# against the next few candidates. Each costs one compile. A runner-up replaces the fit only
# when its compiled estimate is lower by more than TIE: closer than that, the two are a tie
# within what the model resolves, and the order before compiling (with its tie-breaks: fewer
# microbatches, the state on the device) stands.
CONFIRM = 2
TIE = 0.02
# A first fit whose compiled estimate comes out slower than traced by more than TIE was squeezed
# (XLA rematerializes a plan near the device's capacity): its runners-up are taken only among
# candidates predicted at least HEADROOM below its compiled bytes, where XLA has room.
HEADROOM = 0.10


def _floor_probes(c: Candidate, lean: list[MemoryPolicy], outs: set) -> list[MemoryPolicy]:
    """The leanest stacks of ``c``'s family on the lattice (``outs``), run as ``c``'s stack
    runs: scanned or unrolled, the embedding replayed or not."""
    twins = [
        p.replace(
            unroll=c.policy.unroll,
            replay_embedding=c.policy.replay_embedding and can_replay_embedding(p),
        )
        for p in lean
    ]
    return [p for p in twins if (p, c.family, c.state_memory) in outs]


def _program(c: Candidate, policy: MemoryPolicy) -> tuple:
    """What decides a compiled program at the real depth: ``c``'s settings under ``policy``."""
    return (policy, c.accum, c.strategy, c.tp, c.precision, c.stream)


class _Compiles:
    """One search's compiles: each program at the real depth once, with its compiled plan's own
    estimate (``compile_peak.step_time``, where the compiler sets it), and which compiler ran."""

    def __init__(self, problem: Problem, compile_peak: Callable[..., tuple[int, str]]):
        self.problem, self.compile_peak, self.compiler = problem, compile_peak, ""
        self.at_depth: dict[tuple, int] = {}  # compiled at the real depth, per program
        self.plan_times: dict[tuple, dict | None] = {}

    def peak(self, *args: Any, **kwargs: Any) -> int:
        peak, self.compiler = self.compile_peak(*args, **kwargs)
        return peak

    def candidate(self, c: Candidate, policy: MemoryPolicy) -> int:
        """``c``'s program under ``policy`` compiled (once): its planned peak per device."""
        key = _program(c, policy)
        if key not in self.at_depth:
            self.at_depth[key] = self.peak(
                self.problem.cfg, policy, c.accum, c.strategy, c.precision, c.stream, **_tensor(c)
            )
            self.plan_times[key] = getattr(self.compile_peak, "step_time", None)
        return self.at_depth[key] - state_host_bytes(self.problem, c)


class _TimeCalibration:
    """How far each stack part's compiled estimates came out from the traced ones (compiled /
    traced, per part and family), for confirming a choice: a runner-up made of parts that
    already compiled slower (XLA rematerializing near the device's capacity) carries their
    ratio, block-weighted."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.ratios: dict[tuple, float] = {}

    def _parts(self, c: Candidate) -> list[tuple[int, tuple]]:
        family = (c.accum, c.strategy, c.tp, c.precision, c.stream, c.state_memory)
        parts = split_policy(c.policy, self.n_layers)
        return [(n, (_part_key(p), *family)) for n, p in parts]

    def observe(self, o: Outcome) -> None:
        c = o.candidate
        if o.plan_time is not None and c.seconds > 0 and not c.policy.nested:
            for _, key in self._parts(c):
                self.ratios[key] = o.plan_time["seconds"] / c.seconds

    def calibrated(self, c: Candidate) -> float:
        if c.policy.nested:
            return c.seconds
        parts = self._parts(c)
        blocks = sum(n for n, _ in parts)
        return c.seconds * sum(n * self.ratios.get(k, 1.0) for n, k in parts) / blocks

    def runner_up(self, c: Candidate, chosen: Outcome, memory: MemoryModel) -> str | None:
        """While confirming ``chosen``: "past" when no later candidate can beat it (the order
        before compiling already rates ``c`` no faster than its compiled plan), "skip" when
        ``c``'s parts' calibration says so or ``chosen`` was squeezed and ``c`` plans within
        ``HEADROOM`` of its bytes; None to try ``c``."""
        beat = chosen.plan_time["seconds"] * (1 - TIE)
        if c.seconds >= beat:
            return "past"
        if self.calibrated(c) >= beat:
            return "skip"
        squeezed = chosen.plan_time["seconds"] > chosen.candidate.seconds * (1 + TIE)
        if squeezed and (memory.predict(c) or 0) >= (1 - HEADROOM) * chosen.compiled:
            return "skip"
        return None


def _faster(chosen: Outcome, o: Outcome) -> Outcome:
    """The choice between ``chosen`` and a runner-up ``o`` that fits: ``o`` when its compiled
    estimate is lower by more than ``TIE``; the other is marked as not faster."""
    if o.plan_time is not None and o.plan_time["seconds"] < chosen.plan_time["seconds"] * (1 - TIE):
        chosen.status, o.status = "fits (compiled estimate not faster)", "chosen"
        return o
    o.status = "fits (compiled estimate not faster)"
    return chosen


def search(
    problem: Problem,
    space: PlanSpace = PlanSpace(),
    *,
    max_compiles: int = 40,
    confirm: int = CONFIRM,
    compile_peak: Callable[..., tuple[int, str]] | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> PlanResult:
    """Walk the lattice in cost order, compiling candidates until one fits ``budget_bytes``;
    where the compiled plans carry their own step-time estimate (GPU targets), up to
    ``confirm`` more candidates are compiled while their estimate before compiling is below the
    fitting plan's compiled one, and one that fits replaces it when its compiled estimate is
    lower by more than ``TIE``."""
    compiles = _Compiles(problem, compile_peak or _compiler(problem))
    flops = FlopModel(problem.cfg, problem.seq_len)
    memory = MemoryModel(problem, compiles.peak)
    outcomes = [Outcome(c) for c in enumerate_candidates(problem, space, flops)]
    budget = problem.budget_bytes
    at_depth = compiles.at_depth
    compile_candidate, program = compiles.candidate, _program

    # A family's floor: the leanest whole-stack presets it holds (full, and offload where host
    # memory exists) keep only block inputs on the device, and every other stack but nested
    # keeps more; when they compile over the budget, so does the rest of the family (nested
    # aside), and none of it is compiled.
    outs = {(o.candidate.policy, o.candidate.family, o.candidate.state_memory) for o in outcomes}
    lean = [POLICIES[p] for p in ("full", "offload") if p in space.policies]
    floors: dict[tuple, int] = {}
    chosen, stopped, at_choice = None, False, 0

    def room(n: int) -> bool:
        """Whether ``n`` more compiles are allowed (``confirm`` once a candidate fits)."""
        if chosen is not None:
            return len(at_depth) + n - at_choice <= confirm
        return len(at_depth) + n <= max_compiles

    calibration = _TimeCalibration(problem.cfg.n_layers)

    for o in outcomes:
        c = o.candidate
        if chosen is not None:
            verdict = calibration.runner_up(c, chosen, memory)
            if verdict == "past":
                break
            if verdict == "skip":
                continue
        if c.policy.loss_chunks:
            # the loss-chunk twin of a whole-loss candidate: bounded by its twin's numbers, no
            # fits or floors of its own (they would double the compiles); its compile is the
            # proof (``_chunked_twin_status``)
            o.status = _chunked_twin_status(problem, c, memory, floors, at_depth)
            if o.status:
                continue
        else:
            family = (c.family, c.state_memory)
            probes = _floor_probes(c, lean, outs)
            if not c.policy.nested and c.policy not in probes and floors.get(family, 0) > budget:
                o.status = "over (family floor compiled over)"  # known: no fit compiles needed
                continue
            o.predicted = memory.predict(c)
            slack = memory.slack(c, problem.slack)
            if o.predicted is not None and o.predicted > budget * (1 + slack):
                o.status = "over (predicted)"
                continue
            if not c.policy.nested and probes and c.policy not in probes:
                if family not in floors:
                    if not room(len(probes)):
                        if chosen is not None:  # confirming: skip it, a later one may need none
                            continue
                        stopped = True
                        break
                    progress(f"compiling the floor of {c.describe()}: {[p.name for p in probes]}")
                    floors[family] = min(compile_candidate(c, p) for p in probes)
                if floors[family] > budget:
                    o.status = "over (family floor compiled over)"
                    continue
        if program(c, c.policy) not in at_depth and not room(1):
            stopped = chosen is None
            break
        progress(f"{'confirming against' if chosen else 'compiling'} {c.describe()}")
        o.compiled = compile_candidate(c, c.policy)
        o.plan_time = _with_state_link(compiles.plan_times.get(program(c, c.policy)), problem, c)
        memory.observe(c, o.predicted, o.compiled)
        calibration.observe(o)
        if o.compiled > budget:
            o.status = "over (compiled)"
        elif chosen is None:
            o.status, chosen, at_choice = "chosen", o, len(at_depth)
            if o.plan_time is None:  # no compiled estimate to confirm the order with
                break
        else:
            chosen = _faster(chosen, o)
    return PlanResult(
        problem, outcomes, chosen, compiles.compiler, memory.compiles, len(at_depth), stopped
    )


def _with_state_link(
    plan_time: dict[str, Any] | None, problem: Problem, cand: Candidate
) -> dict[str, Any] | None:
    """A compiled plan's estimate for ``cand``: the plan is compiled with the optimizer state on
    the device (a deviceless compile drops argument memory kinds), so state in ``pinned_host``
    adds its trip over the host link, in and out, from shapes (exposed: ``Overlap``)."""
    if plan_time is None or cand.state_memory != "pinned_host":
        return plan_time
    link = 2 * state_host_bytes(problem, cand) / rates_for(problem.target).host_link
    seconds = plan_time["seconds"] + link
    out = dict(plan_time, seconds=seconds, state=plan_time["state"] + link)
    out["mfu"] = plan_time["mfu"] * plan_time["seconds"] / seconds
    out["hfu"] = plan_time["hfu"] * plan_time["seconds"] / seconds
    out["line"] = plan_time["line"] + f"; + {link:.3g} s of optimizer state over the host link"
    return out


def chunk_savings_bound(problem: Problem, cand: Candidate) -> int:
    """At most what running the loss in chunks takes off a whole-loss plan: the whole loss's
    vocabulary-sized buffers of one device's microbatch, three fp32 ``[rows, S, V]``: its logits,
    their gradient and a working buffer (measured: the head and loss gradient of 8 MiB of logits
    holds 10.0 MiB of temporaries on an H100 plan, 24.0 on XLA:CPU, which gives the gradient a
    buffer of its own; llama-3.2-1b's whole H100 step plans 5,515 MiB less in chunks for 8,016
    MiB of logits). The LM head is whole on every tensor device."""
    rows = problem.batch // (problem.devices // cand.tp * cand.accum)
    return 3 * rows * problem.seq_len * problem.cfg.vocab_size * 4


def _chunked_twin_status(
    problem: Problem,
    cand: Candidate,
    memory: MemoryModel,
    floors: dict[tuple, int],
    at_depth: dict[tuple, int],
) -> str:
    """Why the loss-chunk twin of a whole-loss candidate need not be compiled ('' when it must
    be): its twin's compiled plan, its twin's family floor or, neither compiled, its twin's
    prediction, over the budget by more than chunks can save (``chunk_savings_bound``). The
    prediction is taken without the search's slack: a twin is worth a compile when the logits,
    not the memory model's error, may bring it under."""
    whole = dataclasses.replace(cand, policy=cand.policy.replace(loss_chunks=0))
    budget, bound = problem.budget_bytes, chunk_savings_bound(problem, cand)
    key = (whole.policy, whole.accum, whole.strategy, whole.tp, whole.precision, whole.stream)
    if key in at_depth:
        if at_depth[key] - state_host_bytes(problem, whole) - bound > budget:
            return "over (whole loss compiled over by more than the logits)"
        return ""
    if floors.get((whole.family, whole.state_memory), 0) - bound > budget:
        return "over (whole-loss floor over by more than the logits)"
    predicted = memory.predict(whole)
    if predicted is not None and predicted - bound > budget:
        return "over (whole loss predicted over by more than the logits)"
    return ""


def smallest_plan(result: PlanResult) -> Outcome | None:
    """When nothing fits: the candidate with the smallest compiled plan, compiling the one with
    the smallest prediction if the search compiled none below it."""
    smallest = result.smallest()
    predicted = [o for o in result.outcomes if o.predicted is not None and o.compiled is None]
    if predicted:
        best = min(predicted, key=lambda o: o.predicted)
        if smallest is None or best.predicted < smallest.compiled:
            c = best.candidate
            peak, _ = _compiler(result.problem)(
                result.problem.cfg,
                c.policy,
                c.accum,
                c.strategy,
                c.precision,
                c.stream,
                **_tensor(c),
            )
            best.compiled = peak - state_host_bytes(result.problem, c)
            best.status = "over (compiled)"
            result.candidate_compiles += 1
            smallest = result.smallest()
    return smallest


def default_budget(target: Target) -> tuple[int, str]:
    """The target's memory times ``USABLE_FRACTION``; the local backend has no fixed budget."""
    if target.device_memory_bytes is None:
        raise ConfigError(
            f"--target {target.name} has no fixed memory size: give --budget (e.g. 200MiB)"
        )
    budget = int(target.device_memory_bytes * USABLE_FRACTION)
    return budget, (
        f"{USABLE_FRACTION:.0%} of the {target.description}'s "
        f"{target.device_memory_bytes / GIB:.1f} GiB (the rest: CUDA context, library "
        "workspaces, fragmentation)"
    )


def parse_bytes(text: str) -> int:
    """``70GiB``, ``200MiB``, ``1.5GB``, ``123456`` -> bytes; bad text raises ``ConfigError``."""
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    number = t.rstrip("KMGTIB")
    unit = t[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"budget {text!r} is not a size: give a positive number with a unit, e.g. 70GiB, "
            "512MiB or 1.5GB"
        )
    return int(value * units[unit])

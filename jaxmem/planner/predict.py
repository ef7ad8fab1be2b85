"""The planner's predictors, fitted from traces and compiles so that most of the lattice is
never compiled: matmul FLOPs of any stack (``FlopModel``, exact: affine in the blocks under each
policy) and the planned peak bytes of any candidate (``MemoryModel``: a family's plan at two
depths, calibrated by each compile), with the two memory terms that adjust a plan's bytes
(``state_host_bytes``: optimizer state in host memory; ``chunk_savings_bound``: what the loss in
chunks can take off). ``jaxmem.planner.search`` compiles candidates in the order
``jaxmem.planner.space`` gives and skips the ones these predict over the budget.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jaxmem.adapters import AdapterConfig
from jaxmem.config import ModelConfig
from jaxmem.figures import format_bytes
from jaxmem.memory import analytic
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.planner import tags
from jaxmem.planner.cost import NO_ADAPTERS, frozen_base_gradient, priced_runs
from jaxmem.planner.host import offloaded_activation_bytes
from jaxmem.planner.space import Candidate, PlanSpace, Problem, candidate_spec, part_key
from jaxmem.policy import POLICIES, EmbeddingReplay, MemoryPolicy, can_replay_embedding
from jaxmem.precision import PRECISIONS, Precision


# ---------------------------------------------------------------------------------- FLOPs
def _flops_per_row(
    cfg: ModelConfig, policy: MemoryPolicy, precision: Precision, seq: int,
    adapters: AdapterConfig = NO_ADAPTERS,
) -> int:  # fmt: skip
    """Matmul FLOPs of one row's gradient (forward, recompute, backward) under ``policy``; with
    ``adapters``, of the trained parameters only (a frozen base: no weight-gradient matmuls)."""
    loss, args = frozen_base_gradient(cfg, policy, precision, seq, 1, adapters)
    return grad_matmul_flops(loss, *args)


class FlopModel:
    """Per-row FLOPs of any stack: ``c + Σ_parts n_blocks · s_preset``, each preset's per-block
    FLOPs ``s`` and the rest ``c`` from traces at depths 1 and 2 (matmul FLOPs are exactly
    affine in the number of blocks under each policy; nested, √L segments, is traced at its
    real depth)."""

    def __init__(self, cfg: ModelConfig, seq_len: int, adapters: AdapterConfig = NO_ADAPTERS):
        self.cfg, self.seq_len, self.adapters = cfg, seq_len, adapters
        self._fit: dict[tuple, tuple[int, int]] = {}
        self._nested: dict[str, int] = {}

    def _part(self, policy: MemoryPolicy, precision: Precision) -> tuple[int, int]:
        key = (part_key(policy), precision.name)
        if key not in self._fit:
            f1, f2 = (
                _flops_per_row(
                    self.cfg.replace(n_layers=d), policy, precision, self.seq_len, self.adapters
                )
                for d in (1, 2)
            )
            self._fit[key] = (f1 - (f2 - f1), f2 - f1)
        return self._fit[key]

    def tag_frontier(self, precision: Precision) -> list[tags.TagPoint]:
        """The per-tag policies of one block on the bytes/FLOPs Pareto frontier."""
        return _tag_frontier(self.cfg, precision, self.seq_len, self.adapters)

    def per_row(self, policy: MemoryPolicy, precision: Precision) -> int:
        if policy.nested:
            if precision.name not in self._nested:
                self._nested[precision.name] = _flops_per_row(
                    self.cfg, policy, precision, self.seq_len, self.adapters
                )
            return self._nested[precision.name]
        total = None
        for n, part in priced_runs(policy, self.cfg.n_layers):
            c, s = self._part(part, precision)
            total = (c if total is None else total) + n * s
        return total


@functools.lru_cache(maxsize=16)
def _tag_frontier(
    cfg: ModelConfig, precision: Precision, seq_len: int, adapters: AdapterConfig
) -> list[tags.TagPoint]:
    """``tags.frontier`` once per model, precision, sequence length and adapters in a process
    (its 2^units jaxpr traces are the same for every search of that model: ``--policy auto``,
    repeated budgets)."""
    return tags.frontier(
        cfg, precision, seq_len, functools.partial(_flops_per_row, adapters=adapters)
    )


# ---------------------------------------------------------------------------------- memory
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
        name = part_key(part)
        if not isinstance(name, str):
            # a per-tag policy: selective's family, each block keeping the analytic difference
            # in bytes per row (the compile of the candidate itself is the proof)
            a, b = self._family(POLICIES["selective"], cand)
            precision = PRECISIONS[cand.precision]
            rows = self.problem.batch // (cand.data(self.problem.devices) * cand.accum)
            cfg, seq = self.problem.cfg, self.problem.seq_len
            delta = tags.block_bytes(cfg, part, seq, precision) - tags.block_bytes(
                cfg, POLICIES["selective"], seq, precision
            )
            # the tags' bytes split over tensor devices and, by sequence, context devices
            return a, b + rows * delta / (cand.tp * cand.cp)
        # fitted on the scanned stack; an unrolled one is predicted from its scan's fit (it
        # plans within ~20 % of it: 0.79x to 0.94x measured, offload 2.2x) and calibrated by
        # its own compiles (``observe``): no unrolled fit compiles, which are the slowest
        family = tuple(f for f in cand.family if f != "unrolled")
        key = (name, *family)
        if key not in self.fits:
            d1, d2 = self.problem.fit_depths
            fitted = POLICIES[name]
            if "replay" in family and can_replay_embedding(fitted):
                fitted = fitted.replace(embedding=EmbeddingReplay(True))
            peaks = [
                self.compile_fn(
                    candidate_spec(self.problem, cand, fitted, self.problem.cfg.replace(n_layers=d))
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
        """Predicted planned peak (device bytes); None for nested and for every candidate of a
        model compiled whole (``Problem.compiled_whole``): compiled, not predicted."""
        if cand.policy.nested or self.problem.compiled_whole:
            return None
        parts = priced_runs(cand.policy, self.problem.cfg.n_layers)
        fits = [(n, self._family(p, cand)) for n, p in parts]
        peak = max(a for _, (a, _) in fits) + sum(n * b for n, (_, b) in fits)
        return (
            peak
            + self.corrections.get(self._pair(cand), 0.0)
            - state_host_bytes(self.problem, cand)
        )

    def _pair(self, cand: Candidate) -> tuple:
        """Candidates whose prediction errs alike: the same presets in the same family."""
        parts = priced_runs(cand.policy, self.problem.cfg.n_layers)
        return (
            *sorted(str(part_key(p)) for _, p in parts),
            cand.policy.unroll,
            cand.policy.embedding.replay,
            cand.accum,
            cand.strategy,
            cand.layout,
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


def candidate_host_bytes(problem: Problem, cand: Candidate) -> int:
    """Host bytes per device of a planner candidate (analytic, from shapes): its offloaded
    activations, its optimizer state in host memory, a streamed stack's parameters and state."""
    precision = PRECISIONS[cand.precision]
    rows = problem.batch // cand.data(problem.devices) // cand.accum
    total = offloaded_activation_bytes(  # one tensor device's share of its S / cp positions
        problem.cfg, cand.policy, rows, problem.seq_len // cand.cp, precision, cand.tp
    )
    if cand.stream:  # one device's shards of the stack (as ``cost.streamed_bytes``)
        data = cand.data(problem.devices)  # streamed: no context axis (context_refusal)
        param_shards = data if cand.strategy == "fsdp" else 1
        state_shards = data if cand.strategy in ("zero1", "fsdp") else 1
        params = parameter_bytes(problem, precision) // param_shards
        return total + state_bytes(problem, precision) // state_shards + params
    return total + state_host_bytes(problem, cand)


def state_host_bytes(problem: Problem, cand: Candidate) -> int:
    """Optimizer-state bytes per device a candidate keeps in host memory (from shapes); a
    streamed candidate's plan is already its device's (``plans.stream_plan``)."""
    if cand.state_memory == "device" or cand.stream:
        return 0
    total = state_bytes(problem, PRECISIONS[cand.precision])
    data = cand.data(problem.devices) * cand.cp  # the state shards over data and context
    shards = (data if cand.strategy in ("zero1", "fsdp") else 1) * cand.tp
    return total // shards


def state_bytes(problem: Problem, precision: Precision) -> int:
    """The optimizer state's bytes from shapes: every parameter's, or with adapters the trained
    parameters' alone (``analytic.adapter_state``: a frozen base has none)."""
    cfg, opt_cfg, adapters = problem.cfg, problem.opt_cfg, problem.adapters
    if adapters.enabled:
        return analytic.adapter_state(cfg, adapters, opt_cfg, precision).opt_state_bytes
    return analytic.opt_state_bytes(cfg, opt_cfg, precision)


def parameter_bytes(problem: Problem, precision: Precision) -> int:
    """The parameters' bytes from shapes: with adapters, the frozen base as it is stored
    (packed for an int8 or nf4 base) plus the adapters (``analytic.adapter_state``)."""
    cfg, adapters = problem.cfg, problem.adapters
    if adapters.enabled:
        return analytic.adapter_state(cfg, adapters, problem.opt_cfg, precision).params_bytes
    return analytic.param_bytes(cfg, precision)


def chunk_savings_bound(problem: Problem, cand: Candidate, chunks: int = 0) -> int:
    """At most what running the loss in chunks takes off a whole-loss plan (``chunks`` 0), or
    what more chunks take off a plan in ``chunks``: the vocabulary-sized buffers of one
    device's microbatch, whole or of one chunk, three fp32 ``[rows, tokens, V]``: its logits,
    their gradient and a working buffer (measured: the head and loss gradient of 8 MiB of logits
    holds 10.0 MiB of temporaries on an H100 plan, 24.0 on XLA:CPU, which gives the gradient a
    buffer of its own; llama-3.2-1b's whole H100 step plans 5,515 MiB less in chunks for 8,016
    MiB of logits). The LM head is whole on every tensor device; a context device holds
    ``S / cp`` of the tokens (a chunk count is a multiple of cp)."""
    rows = problem.batch // (cand.data(problem.devices) * cand.accum)
    tokens = problem.seq_len // max(cand.cp, chunks)
    return 3 * rows * tokens * problem.cfg.vocab_size * 4


def argument_floor(problem: Problem, space: PlanSpace) -> tuple[int, str]:
    """A lower bound on any candidate's planned peak per device, from shapes: the step's
    arguments alone (parameters, optimizer state, one microbatch of tokens), placed as the
    leanest choice ``space`` allows places them (split over every device where a strategy or
    tensor parallelism can split them; the state, or the stack's parameters, in host memory
    where the space may put them there), at its narrowest precision. A budget under it fits
    nothing, whatever the policy; the text says how it was obtained. With adapters: the
    frozen base as stored and the trained parameters' state (``parameter_bytes``,
    ``state_bytes``), all on the device (adapter jobs keep them there; a packed base whole)."""
    cfg, n, adapters = problem.cfg, problem.devices, problem.adapters
    host = problem.target.is_gpu and not adapters.enabled
    state_out = host and any(m != "device" for m in space.state_memory)
    stack_out = host and any(m.startswith("stream") for m in space.state_memory)
    fsdp = "fsdp" in space.strategies and adapters.base == "compute"
    split = n > 1 and (fsdp or (max(space.tensor) > 1 and not adapters.enabled))
    state_split = split or (n > 1 and "zero1" in space.strategies)
    block = cfg.replace(n_layers=2).n_params - cfg.replace(n_layers=1).n_params
    floor, said = None, ""
    for name in space.precisions:
        precision = PRECISIONS[name]
        params = parameter_bytes(problem, precision)
        if stack_out:
            params -= cfg.n_layers * block * precision.param_bytes  # streamed from host
        state = 0 if state_out else state_bytes(problem, precision)
        params, state = params // (n if split else 1), state // (n if state_split else 1)
        share = problem.seq_len // max(space.context)  # a context axis splits each row
        tokens = 2 * 4 * share * max(1, problem.batch // (n * max(space.accum)))
        if floor is None or params + state + tokens < floor:
            floor = params + state + tokens
            said = (
                f"parameters {format_bytes(params)}"
                + (" (the stack's streamed from host memory)" if stack_out else "")
                + (f" ({adapters.label()})" if adapters.enabled else "")
                + f" + {problem.opt_cfg.name} state {format_bytes(state)}"
                + (" (in host memory)" if state_out else "")
                + f" + one microbatch of tokens {format_bytes(tokens)}, from shapes, {name}"
                + (f", split over {n} devices" if split else "")
            )
    return floor, said

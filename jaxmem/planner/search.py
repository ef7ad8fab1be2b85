"""``jaxmem plan``: the cheapest training configuration that fits a memory budget, proved by
compiling it for the target.

The lattice, its order and the cost that orders it are ``jaxmem.planner.space``'s (each term of
the cost ``jaxmem.planner.cost``'s); the predictions of bytes and FLOPs are
``jaxmem.planner.predict``'s. Each compiled candidate also carries its compiled plan's own
estimate (``Outcome.plan_time``, the HLO read the same way as the estimate before compiling).

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
from collections.abc import Callable
from typing import Any

from jaxmem.config import ConfigError
from jaxmem.memory.targets import Target, rates_for
from jaxmem.planner.cost import priced_runs
from jaxmem.planner.host import host_share
from jaxmem.planner.plans import plan_step
from jaxmem.planner.predict import (
    FlopModel,
    MemoryModel,
    candidate_host_bytes,
    chunk_savings_bound,
    state_host_bytes,
)
from jaxmem.planner.space import (
    Candidate,
    PlanSpace,
    Problem,
    candidate_spec,
    enumerate_candidates,
    part_key,
    policy_text,
)
from jaxmem.policy import POLICIES, EmbeddingReplay, LossPolicy, MemoryPolicy, can_replay_embedding
from jaxmem.step.spec import StepSpec

GIB = 2**30
USABLE_FRACTION = 0.9  # of a GPU's memory: the CUDA context, cuDNN/cuBLAS workspaces, fragmentation
DEFAULT_SPACE = PlanSpace()


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
            "save": list(c.policy.head.save),
            "loss_chunks": c.policy.loss.chunks,
            "mlp_tile_tokens": c.policy.mlp_tile_tokens,
            "accum": c.accum,
            "state_memory": c.state_memory,
            "strategy": c.strategy,
            "tp": c.tp,
            "cp": c.cp,
            "cp_attention": c.cp_attention if c.cp > 1 else None,
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
    host_skipped: int = 0  # candidates whose host bytes (analytic) exceed the host limit

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


def _compiler(problem: Problem) -> Callable[[StepSpec], tuple[int, str]]:
    """``compile_peak(spec) -> (planned peak, compiler)``: ``plans.plan_step`` of a step the
    search builds (``space.candidate_spec``); its plan's own estimate is left in
    ``compile_peak.step_time``."""

    def compile_peak(spec: StepSpec) -> tuple[int, str]:
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
            embedding=EmbeddingReplay(c.policy.embedding.replay and can_replay_embedding(p)),
        )
        for p in lean
    ]
    return [p for p in twins if (p, c.family, c.state_memory) in outs]


def _twin_floor_probes(c: Candidate, lean: list[MemoryPolicy], outs: set) -> list[MemoryPolicy]:
    """For a loss-chunk twin ``c``: the leanest stacks of its family and state placement on
    the lattice with its MLP tiles, each in the most loss chunks it has there (``outs``), run
    as ``c``'s stack runs.
    A plan in fewer chunks holds at least that plan less one of its chunks' vocabulary buffers
    (``chunk_savings_bound``), so over the budget by more, they bound every twin of the family
    in fewer or as many chunks (``search``)."""
    out = []
    for p in lean:
        p = p.replace(
            unroll=c.policy.unroll,
            embedding=EmbeddingReplay(c.policy.embedding.replay and can_replay_embedding(p)),
            mlp_tile_tokens=c.policy.mlp_tile_tokens,
        )
        counts = [
            q.loss.chunks
            for q, family, place in outs
            if family == c.family and place == c.state_memory
            and q.replace(loss=LossPolicy()) == p
        ]  # fmt: skip
        if counts:
            out.append(p.replace(loss=LossPolicy(chunks=max(counts))))
    return out


def _predicted_over(o: Outcome, memory: MemoryModel, problem: Problem) -> bool:
    """Whether ``o``'s candidate is predicted over the budget by more than the memory model's
    slack for it (``o.predicted`` set, its status too when over)."""
    o.predicted = memory.predict(o.candidate)
    slack = memory.slack(o.candidate, problem.slack)
    if o.predicted is not None and o.predicted > problem.budget_bytes * (1 + slack):
        o.status = "over (predicted)"
        return True
    return False


def _family_floor(
    compiles: _Compiles, c: Candidate, probes: list[MemoryPolicy], cap: int,
    progress: Callable[[str], None],
) -> int:  # fmt: skip
    """``c``'s family floor: its leanest stacks (``probes``) compiled, the least, said."""
    floor = min(compiles.candidate(c, p) for p in probes)
    what = f"floor of {c.describe()} ({', '.join(p.name for p in probes)})"
    progress(_compiled(len(compiles.at_depth), cap, what, floor, compiles.problem.budget_bytes))
    return floor


def _compile_outcome(
    compiles: _Compiles, o: Outcome, runner_up: bool, cap: int, left: int,
    progress: Callable[[str], None],
) -> None:  # fmt: skip
    """``o``'s candidate compiled at the real depth (once), said, with its compiled plan's
    estimate (the state's host trips added, ``_with_state_link``)."""
    c, problem = o.candidate, compiles.problem
    o.compiled = compiles.candidate(c, c.policy)
    what = f"{'runner-up ' if runner_up else ''}{c.describe()}"
    progress(_compiled(len(compiles.at_depth), cap, what, o.compiled, problem.budget_bytes, left))
    plan_time = compiles.plan_times.get(_program(c, c.policy))
    o.plan_time = _with_state_link(plan_time, problem, c)


_STOP = "stop"  # a floor needs compiles past the cap


class _TwinFloors:
    """The loss-chunk twins' family floors: the family's leanest stacks in the most chunks
    (``_twin_floor_probes``), compiled once per family, state placement and MLP tiling (at long
    sequences every stack has a twin per chunk count), each less one of its chunks' buffers
    (``chunk_savings_bound``); over the budget, every twin of the family is. Not compiled while
    confirming a choice, nor for a twin whose own program is already compiled."""

    def __init__(self, problem: Problem, compiles: _Compiles, lean: list[MemoryPolicy],
                 outs: set, progress: Callable[[str], None]):  # fmt: skip
        self.problem, self.compiles, self.lean, self.outs = problem, compiles, lean, outs
        self.progress = progress
        self.floors: dict[tuple, int] = {}
        self.probes: dict[tuple, list[MemoryPolicy]] = {}

    def status(
        self, c: Candidate, confirming: bool, room: Callable[[int], bool], max_compiles: int
    ) -> str:
        """``TWIN_OVER["chunk floor"]`` where ``c``'s floor is over the budget, ``_STOP`` where
        it needs compiles ``room`` does not allow, else ''."""
        if not c.policy.loss.chunks or c.policy.nested or "block_input" in c.policy.offloads:
            return ""
        at_depth, budget = self.compiles.at_depth, self.problem.budget_bytes
        key = (c.family, c.state_memory, c.policy.mlp_tile_tokens)
        if key not in self.probes:
            self.probes[key] = _twin_floor_probes(c, self.lean, self.outs)
        probes = [p for p in self.probes[key] if p.loss.chunks >= c.policy.loss.chunks]
        fresh = _program(c, c.policy) not in at_depth and not confirming
        if not probes or c.policy in probes or not (fresh or key in self.floors):
            return ""
        if key not in self.floors:
            if not room(sum(_program(c, p) not in at_depth for p in probes)):
                return _STOP
            self.floors[key] = min(
                self.compiles.candidate(c, p) - chunk_savings_bound(self.problem, c, p.loss.chunks)
                for p in probes
            )
            names = "; ".join(f"{policy_text(p)}, {p.loss.brief}" for p in probes)
            what = f"chunk floor of {c.describe()} ({names}, less a chunk's logits)"
            self.progress(_compiled(len(at_depth), max_compiles, what, self.floors[key], budget))
        return TWIN_OVER["chunk floor"] if self.floors[key] > budget else ""


def _program(c: Candidate, policy: MemoryPolicy) -> tuple:
    """What decides a compiled program at the real depth: ``c``'s settings under ``policy``."""
    return (policy, c.accum, c.strategy, c.layout, c.precision, c.stream)


class _Compiles:
    """One search's compiles: each program at the real depth once, with its compiled plan's own
    estimate (``compile_peak.step_time``, where the compiler sets it), and which compiler ran."""

    def __init__(
        self,
        problem: Problem,
        compile_peak: Callable[..., tuple[int, str]],
        progress: Callable[[str], None],
    ):
        self.problem, self.compile_peak, self.compiler = problem, compile_peak, ""
        self.progress = progress
        self.at_depth: dict[tuple, int] = {}  # compiled at the real depth, per program
        self.plan_times: dict[tuple, dict | None] = {}

    def peak(self, spec: StepSpec) -> int:
        peak, self.compiler = self.compile_peak(spec)
        return peak

    def fit(self, spec: StepSpec) -> int:
        """A memory-model compile (``spec`` at a fit depth), said as it ends."""
        peak = self.peak(spec)
        self.progress(
            f"memory model: {policy_text(spec.policy)}, accum {spec.accum.steps} at depth "
            f"{spec.model.n_layers}: {_mib(peak)} MiB compiled"
        )
        return peak

    def candidate(self, c: Candidate, policy: MemoryPolicy) -> int:
        """``c``'s program under ``policy`` compiled (once): its planned peak per device."""
        key = _program(c, policy)
        if key not in self.at_depth:
            self.at_depth[key] = self.peak(candidate_spec(self.problem, c, policy))
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
        family = (c.accum, c.strategy, c.layout, c.precision, c.stream, c.state_memory)
        parts = priced_runs(c.policy, self.n_layers)
        return [(n, (part_key(p), *family)) for n, p in parts]

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
    space: PlanSpace = DEFAULT_SPACE,
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
    compiles = _Compiles(problem, compile_peak or _compiler(problem), progress)
    budget = problem.budget_bytes
    memory = MemoryModel(problem, compiles.fit)
    flops = FlopModel(problem.cfg, problem.seq_len, problem.adapters)
    outcomes, host_skipped = _lattice(problem, space, flops, progress)
    at_depth = compiles.at_depth

    # A family's floor: its leanest whole-stack presets (full; offload with host memory); over
    # the budget, so is the rest of the family (nested aside), and none of it is compiled.
    outs = {(o.candidate.policy, o.candidate.family, o.candidate.state_memory) for o in outcomes}
    lean = [POLICIES[p] for p in ("full", "offload") if p in space.policies]
    floors: dict[tuple, int] = {}
    twin_floors = _TwinFloors(problem, compiles, lean, outs, progress)
    chosen, stopped, at_choice = None, False, 0

    def room(n: int) -> bool:
        """Whether ``n`` more compiles are allowed (``confirm`` once a candidate fits)."""
        if chosen is not None:
            return len(at_depth) + n - at_choice <= confirm
        return len(at_depth) + n <= max_compiles

    calibration = _TimeCalibration(problem.cfg.n_layers)

    for i, o in enumerate(outcomes):
        c = o.candidate
        if chosen is not None:
            verdict = calibration.runner_up(c, chosen, memory)
            if verdict == "past":
                break
            if verdict == "skip":
                continue
        if c.policy.loss.chunks or c.policy.mlp_tile_tokens:
            # the loss-chunk or MLP-tile twin of a whole candidate: no fits of its own (they
            # would double the compiles), chunks bounded by the twin's numbers; its compile is
            # the proof (``_chunked_twin_status``; its family's floor: ``_TwinFloors``)
            status = _chunked_twin_status(
                problem, c, memory, floors, at_depth
            ) or twin_floors.status(c, chosen is not None, room, max_compiles)
            if status == _STOP:
                stopped = True
                break
            if status:
                o.status = status
                continue
        else:
            family = (c.family, c.state_memory)
            probes = _floor_probes(c, lean, outs)
            # nested and host-resident block inputs can keep less than the floor: not bounded
            bounded = not c.policy.nested and "block_input" not in c.policy.offloads
            if bounded and c.policy not in probes and floors.get(family, 0) > budget:
                o.status = "over (family floor compiled over)"  # known: no fit compiles needed
                continue
            if _predicted_over(o, memory, problem):
                continue
            if bounded and probes and c.policy not in probes:
                if family not in floors:
                    if not room(len(probes)):
                        if chosen is not None:  # confirming: skip it, a later one may need none
                            continue
                        stopped = True
                        break
                    floors[family] = _family_floor(compiles, c, probes, max_compiles, progress)
                if floors[family] > budget:
                    o.status = "over (family floor compiled over)"
                    continue
        if _program(c, c.policy) not in at_depth and not room(1):
            stopped = chosen is None
            break
        cap = at_choice + confirm if chosen else max_compiles
        left = len(outcomes) - i - 1
        _compile_outcome(compiles, o, chosen is not None, cap, left, progress)
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
        problem, outcomes, chosen, compiles.compiler, memory.compiles, len(at_depth), stopped,
        host_skipped,
    )  # fmt: skip


def _lattice(
    problem: Problem, space: PlanSpace, flops: FlopModel, progress: Callable[[str], None]
) -> tuple[list[Outcome], int]:
    """The candidates in cost order, said before (the FLOP traces take a while) and after, less
    those whose host bytes exceed ``problem.host_memory_bytes`` (said, and counted)."""
    progress("tracing each stack's FLOPs (jaxprs, no compiles)")
    outcomes = [Outcome(c) for c in enumerate_candidates(problem, space, flops)]
    limit, skipped, share = problem.host_memory_bytes, 0, host_share(problem.devices)
    if limit is not None:  # one host's memory, shared by the mesh's devices on it
        kept = [o for o in outcomes if share * candidate_host_bytes(problem, o.candidate) <= limit]
        skipped, outcomes = len(outcomes) - len(kept), kept
        if skipped:
            on = f" x {share} devices on a host" if share > 1 else ""
            progress(
                f"{skipped} candidates skipped: their host bytes (analytic, from shapes){on} "
                f"exceed the host-memory limit {_mib(limit)} MiB"
            )
    progress(f"{len(outcomes)} candidates, in order of estimated cost; compiling until one fits")
    return outcomes, skipped


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _compiled(n: int, cap: int, what: str, peak: int, budget: int, left: int | None = None) -> str:
    """A progress line for the ``n``-th compile of at most ``cap`` (``left``: candidates), short
    enough that a per-tag candidate's name fits 100 columns with it."""
    fits = "over" if peak > budget else "fits"
    return f"compile {n}/{cap}: {what}: {_mib(peak)} MiB, {fits}" + (
        "" if left is None else f"; {left} left"
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


def _chunked_twin_status(
    problem: Problem,
    cand: Candidate,
    memory: MemoryModel,
    floors: dict[tuple, int],
    at_depth: dict[tuple, int],
) -> str:
    """Why the loss-chunk twin of a whole-loss candidate need not be compiled ('' when it must
    be): the same stack compiled in fewer chunks over the budget by more than one of those
    chunks' buffers; its twin's compiled plan, its twin's family floor or, neither compiled,
    its twin's prediction, over the budget by more than chunks can save
    (``chunk_savings_bound``). The
    prediction is taken without the search's slack: a twin is worth a compile when the logits,
    not the memory model's error, may bring it under. A twin with the MLP in tiles is bounded
    by its whole-loss twin's compiled plan only (the same tiles), and with the whole loss is
    compiled when reached: what tiles save is how the compiler schedules the MLP's backward,
    beyond any bound from shapes (XLA:CPU, tiny with d_ff 4,096 at 4 x 256 tokens: 60.6 MiB
    saved where the forward's intermediates are 32 MiB), which floors and fits do not model."""
    if not cand.policy.loss.chunks:
        return ""
    whole = dataclasses.replace(cand, policy=cand.policy.replace(loss=LossPolicy()))
    budget, bound = problem.budget_bytes, chunk_savings_bound(problem, cand)
    key = _program(whole, whole.policy)
    # the same stack compiled in fewer chunks: more save at most one of those chunks' buffers
    held = state_host_bytes(problem, whole)
    for (policy, *rest), peak in at_depth.items():
        fewer = 0 < policy.loss.chunks < cand.policy.loss.chunks
        if fewer and tuple(rest) == key[1:] and policy.replace(loss=LossPolicy()) == whole.policy:
            if peak - held - chunk_savings_bound(problem, cand, policy.loss.chunks) > budget:
                return TWIN_OVER["coarser"]
    if key in at_depth:
        if at_depth[key] - state_host_bytes(problem, whole) - bound > budget:
            return TWIN_OVER["compiled"]
        return ""
    if cand.policy.mlp_tile_tokens:
        return ""
    floor = floors.get((whole.family, whole.state_memory), 0)
    if "block_input" not in whole.policy.offloads and floor - bound > budget:  # it bounds them
        return TWIN_OVER["floor"]
    predicted = memory.predict(whole)
    if predicted is not None and predicted - bound > budget:
        return TWIN_OVER["predicted"]
    return ""


# why a loss-chunk twin was not compiled
TWIN_OVER = {
    "compiled": "over (whole loss compiled over by more than the logits)",
    "floor": "over (whole-loss floor over by more than the logits)",
    "predicted": "over (whole loss predicted over by more than the logits)",
    "chunk floor": "over (family floor in the most chunks over by more than a chunk's logits)",
    "coarser": "over (fewer chunks compiled over by more than one of their chunks' logits)",
}


def smallest_plan(result: PlanResult) -> Outcome | None:
    """When nothing fits: the candidate with the smallest compiled plan, compiling the one with
    the smallest prediction if the search compiled none below it."""
    smallest = result.smallest()
    predicted = [o for o in result.outcomes if o.predicted is not None and o.compiled is None]
    if predicted:
        best = min(predicted, key=lambda o: o.predicted)
        if smallest is None or best.predicted < smallest.compiled:
            c = best.candidate
            peak, _ = _compiler(result.problem)(candidate_spec(result.problem, c))
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

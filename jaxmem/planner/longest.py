"""The longest sequence a model trains on a target at batch 1 (``jaxmem plan --longest``).

At each length the step compiled is the leanest point of the planner's space for long
sequences (``lean_spec``): every block rematerialised (``full``: only its input kept), the
block inputs offloaded to host memory where the target has host memory and the limit
(``--host-memory``) holds them (``full-host``), the MLP in sequence tiles (``mlp_tiles``: one
tile's ``[T, d_ff]`` intermediates at a time), the LM head and loss in tiles of a token count
(``loss_tiles``), the optimizer state in host memory
where allowed (``--state-offload``), the attention the job names (``--attention fused`` keeps
it O(S)). Each length is one compiled plan for the target (``probe``); the lengths tried are
found by doubling, then by affine interpolation of the compiled peaks alternating with
bisection (``search_lengths``), to a step of ``--seq-step`` tokens, and the answer is shown by
two compiled plans: it fits at N, and does not at N + step (or N is the cap).

A context-parallel mesh enters through ``Longest.devices`` (the sequence split over the axis:
the search runs over the whole sequence, in steps the axis divides).

Written by hand: a bracketing search over one integer with a compile per point; no library
plans a JAX step's memory by sequence length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxmem.planner import host
from jaxmem.planner.host import OFFLOADED_INPUTS
from jaxmem.policy import POLICIES, LossPolicy
from jaxmem.step.spec import StepSpec

# tokens per loss tile searched at long sequences, largest first (a larger tile runs fewer,
# larger head matmuls)
TILE_TOKENS = (16384, 8192, 4096, 2048, 1024)
# a tile's three fp32 [tokens, vocab] buffers (logits, softmax, gradient) kept under this share
# of the budget
LOGITS_SHARE = 32


def loss_tiles(seq_len: int, vocab: int, budget: int, cp: int = 1) -> int:
    """Loss chunks for ``seq_len``: tiles of the largest of ``TILE_TOKENS`` that divides a
    device's ``seq_len / cp`` positions and whose logits stay under ``budget / LOGITS_SHARE``
    (else the smallest that divides; else ``cp`` x the largest count up to 8 that divides the
    share, as ``--loss-chunks-search``)."""
    share = seq_len // cp
    tiles = [t for t in TILE_TOKENS if share % t == 0]
    if not tiles:
        return cp * max(k for k in range(1, 9) if share % k == 0)
    small = [t for t in tiles if 3 * t * vocab * 4 <= budget // LOGITS_SHARE]
    return seq_len // (small[0] if small else tiles[-1])


def mlp_tiles(seq_len: int, d_ff: int, budget: int, cp: int = 1) -> int:
    """Tokens per MLP tile for ``seq_len``: the largest of ``TILE_TOKENS`` that divides a
    device's ``seq_len / cp`` positions and whose three ``[T, d_ff]`` intermediates stay under
    ``budget / LOGITS_SHARE`` (else the smallest that divides); 0 (untiled) where none divides
    or one tile is the whole share."""
    share = seq_len // cp
    tiles = [t for t in TILE_TOKENS if share % t == 0 and t < share]
    small = [t for t in tiles if 3 * t * d_ff * 4 <= budget // LOGITS_SHARE]
    return (small or tiles[-1:] or [0])[0]


def lean_spec(base: StepSpec, seq_len: int, budget: int, offload: bool) -> StepSpec:
    """``base`` at batch 1 x ``seq_len`` under the leanest long-sequence policy: ``full`` with
    the block inputs offloaded (``offload``) or kept, the MLP and the loss in tiles."""
    policy = OFFLOADED_INPUTS if offload else POLICIES["full"]
    policy = policy.replace(
        loss=LossPolicy(loss_tiles(seq_len, base.model.vocab_size, budget, base.parallel.cp)),
        mlp_tile_tokens=mlp_tiles(seq_len, base.model.d_ff, budget, base.parallel.cp),
    )
    model = base.model
    if seq_len > model.max_seq_len:  # positions only bound a learned table; RoPE's is computed
        model = model.replace(max_seq_len=seq_len)
    return base.replace(model=model, policy=policy, batch=1, seq_len=seq_len)


@dataclasses.dataclass
class Probe:
    """One length compiled: the plan's device bytes and host bytes, its estimated step time."""

    seq_len: int
    spec: StepSpec
    device_bytes: int  # compiled planned peak, per device, host-resident state taken off
    host_bytes: dict[str, int]  # by reason: compiled offload + analytic state
    step_time: dict[str, Any] | None
    compiler: str
    fits: bool
    host_source: str = ""  # how the host bytes were obtained

    def as_dict(self) -> dict[str, Any]:
        from jaxmem.policy_config import policy_to_dict

        return {
            "seq_len": self.seq_len,
            "policy": policy_to_dict(self.spec.policy),
            "state_memory": self.spec.optimizer.state_memory,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "host_source": self.host_source,
            "step_time": self.step_time,
            "compiler": self.compiler,
            "fits": self.fits,
        }


def compiled_as(spec: StepSpec) -> StepSpec:
    """``spec`` as its plan is compiled: optimizer state in host memory compiled on the device
    (a deviceless compile drops argument memory kinds; its bytes are taken off from shapes)."""
    if spec.optimizer.state_memory != "pinned_host" or spec.streamed:
        return spec
    return spec.replace(optimizer=dataclasses.replace(spec.optimizer, state_memory="device"))


def probe(spec: StepSpec, budget: int, host_allowed: int) -> Probe:
    """``spec`` compiled for its target (``plans.plan_step``). Optimizer state in host memory is
    compiled on the device (a deviceless compile drops argument memory kinds) and taken off
    the plan from shapes, its link time added to the estimate; the offloaded activations' host
    bytes are the compiled plan's ``host_temp_bytes``."""
    from jaxmem.planner.plans import plan_step, spec_step_time

    on_host = compiled_as(spec) is not spec
    plan = plan_step(compiled_as(spec))
    analytic = host.spec_host_bytes(spec)
    state = analytic.get("optimizer state", 0)
    hosted = {k: v for k, v in analytic.items() if k != "offloaded activations"}
    offloaded = plan["compiled_plan"]["host_temp_bytes"]
    source = "offloaded activations: the compiled plan's host bytes; state: from shapes"
    if spec.streamed:  # a streamed plan's host temporaries mix the stack's copies with them
        hosted = {
            "streamed parameters and optimizer state": plan["stream"]["host_resident_bytes"],
            "offloaded activations": analytic.get("offloaded activations", 0),
        }
        source = "from shapes (a streamed plan's host bytes mix the stack's copies in)"
    elif offloaded:
        hosted["offloaded activations"] = offloaded
    timing = plan["step_time"]
    if on_host:
        timing = spec_step_time(spec, plan["compiled_plan"], state_link_bytes=2 * state)
    device = plan["planned_peak_bytes"] - state
    # host bytes per device; one host's limit shared by the mesh's devices on it
    fits = device <= budget and host.spec_host_share(spec) * sum(hosted.values()) <= host_allowed
    hosted = {k: v for k, v in hosted.items() if v}
    return Probe(spec.seq_len, spec, device, hosted, timing, plan["compiler"], fits, source)


def search_lengths(
    measure: Callable[[int], tuple[bool, int] | None], step: int, start: int, cap: int,
    aim: int | None = None,
) -> tuple[int, int | None, dict[int, tuple[bool, int]]]:  # fmt: skip
    """The largest multiple of ``step`` up to ``cap`` where ``measure`` fits: ``(n, n + step or
    None at the cap, every length measured)``; n is 0 when ``step`` does not fit. ``measure(n)``
    -> (fits, planned peak), or None to stop (then the bracket so far is returned, unclosed).
    Doubling from ``start`` until a length does not fit, then affine interpolation of the peaks
    between the bracket's ends, alternating with bisection (a guess that fits is followed by
    the next step at once: together they close the bracket when the interpolation is right);
    ``aim``: the peak the interpolation aims at (the budget; None: bisection only)."""
    seen: dict[int, tuple[bool, int]] = {}

    def at(n: int) -> bool | None:
        if n not in seen:
            got = measure(n)
            if got is None:
                return None
            seen[n] = got
        return seen[n][0]

    n = max(step, min(cap, start // step * step))
    while True:  # doubling
        ok = at(n)
        if ok is None or not ok or n == cap:
            break
        n = min(cap, n * 2)
    lo = max((m for m, (ok, _) in seen.items() if ok), default=0)
    if lo == cap:
        return lo, None, seen
    bisect = False
    while True:
        over = [m for m, (ok, _) in seen.items() if not ok and m > lo]
        if not over:
            return lo, None, seen  # stopped
        hi = min(over)
        if hi - lo <= step:
            return lo, hi, seen
        guess = (lo + hi) // 2
        if not bisect and lo and aim is not None:
            (_, p_lo), (_, p_hi) = seen[lo], seen[hi]
            if p_hi > p_lo:
                guess = lo + int((aim - p_lo) * (hi - lo) / (p_hi - p_lo))
        bisect = not bisect
        guess = min(max(guess // step * step, lo + step), hi - step)
        for m in (guess, guess + step):
            ok = at(m)
            if ok is None:
                return lo, None, seen
            if not ok or m + step >= hi:
                break
        lo = max((m for m, (ok, _) in seen.items() if ok), default=0)


@dataclasses.dataclass
class Longest:
    """The answer: the longest length that fits and the next step's plan that does not."""

    fits: Probe | None  # None: not even one step fits
    over: Probe | None  # None: the cap was reached (or the search stopped)
    capped: bool
    probes: list[Probe]
    step: int
    devices: int = 1  # a context-parallel axis multiplies the sequence one device plans


def plan_longest(
    base: StepSpec, budget: int, host_allowed: int, *, step: int, cap: int, start: int,
    offload: bool, progress: Callable[[str], None] = lambda _: None,
) -> Longest:  # fmt: skip
    """The longest sequence ``base`` trains at batch 1 within ``budget`` device bytes and
    ``host_allowed`` host bytes (``search_lengths`` over ``lean_spec``'s plans). ``offload``:
    the target has host memory the search may use; at each length the block inputs are
    offloaded while their analytic bytes fit the host limit beside the state's."""
    probes: dict[int, Probe] = {}

    def measure(n: int) -> tuple[bool, int]:
        spec = lean_spec(base, n, budget, offload=False)
        if offload:
            with_inputs = lean_spec(base, n, budget, offload=True)
            if host.host_need(with_inputs) <= host_allowed:
                spec = with_inputs
        p = probes[n] = probe(spec, budget, host_allowed)
        where = "over" if not p.fits else "fits"
        progress(
            f"compile {len(probes)}: {n:,} tokens, {spec.policy.name}"
            f"{' (block inputs on host)' if spec.policy.offloads else ''}, loss in "
            f"{spec.policy.loss.chunks} tiles: {p.device_bytes / 2**20:,.1f} MiB on the device, "
            f"{sum(p.host_bytes.values()) / 2**20:,.1f} MiB on the host: {where}"
        )
        return p.fits, p.device_bytes

    lo, hi, _ = search_lengths(measure, step, start, cap, aim=budget)
    ordered = [probes[n] for n in sorted(probes)]
    return Longest(probes.get(lo), probes.get(hi) if hi else None, lo == cap, ordered, step)

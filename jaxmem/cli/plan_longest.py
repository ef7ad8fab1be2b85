"""``jaxmem plan --longest``: the longest sequence the model trains at batch 1 on the target,
searched by ``jaxmem.planner.longest`` and printed with what each answer needs: the command
that runs it, device and host bytes (each labelled how obtained), the estimated step time with
its assumptions, and what holds the peak (``jaxmem peak`` of that plan)."""

from __future__ import annotations

import dataclasses
import shlex

import jaxmem.cli.render as render
from jaxmem.cli.common import UsageError, check_writable, mib, search_progress, usage_errors
from jaxmem.cli.flags import job_argv
from jaxmem.files import write_json_atomic

START_STEPS = 8  # the first length compiled, in --seq-step's


def _base(args, job, problem):
    """The job's step at batch 1, one microbatch; with --state-offload on a GPU target the
    stack streamed through host memory (its parameters, gradients and state: the leanest on the
    device) where the optimizer streams (elementwise, no clipping), else its state in host
    memory (an adapter step keeps its small state on the device). A context axis (``--mesh
    cp=N``, alone or as ``fsdp=1,cp=N``) splits the sequence over its devices; the stack does
    not stream under it (``jaxmem.parallel.context_refusal``) and its state stays on the device,
    sharded over the axis (a sharded step keeps no state in host memory); its attention passes
    keys and values round a ring (``--cp-attention ring``: never whole on one device) unless
    ``--cp-attention`` says otherwise or the attention is naive (the ring needs the fused
    kernel)."""
    from jaxmem.config import STREAM_OPTIMIZERS, AccumConfig
    from jaxmem.step.spec import StepSpec

    par = job.parallel
    if par.sharded and (par.data > 1 or par.tp > 1):
        raise UsageError(
            f"--longest plans batch 1 on one device or one context axis: --mesh "
            f"{par.mesh_text()} has other axes; use --mesh cp=N (or fsdp=1,cp=N)"
        )
    if args.seq_step % (2 * par.cp):
        raise UsageError(
            f"--seq-step {args.seq_step}: the context axis cp={par.cp} cuts the sequence into "
            f"{2 * par.cp} equal chunks; use a step that is a multiple of {2 * par.cp}"
        )
    if par.context_parallel:
        par = dataclasses.replace(par, cp_attention=planned_cp_attention(args, job))
        job = dataclasses.replace(job, parallel=par)
    hosted = args.state_offload and problem.target.is_gpu and not job.adapters.enabled
    hosted = hosted and not par.sharded
    opt = job.optimizer
    streams = hosted and opt.name in STREAM_OPTIMIZERS and not opt.clips
    place = "pinned_host" if hosted and not streams else "device"
    optimizer = dataclasses.replace(opt, state_memory=place, stream=streams, stream_update=None)
    spec = StepSpec.of_job(job, problem.target)
    return spec.replace(optimizer=optimizer, accum=AccumConfig(steps=1), batch=1)


def planned_cp_attention(args, job) -> str:
    """How a planned context axis runs attention (``jaxmem plan``, ``--longest`` too): as the
    command names it (``--cp-attention``, ``--set``, ``--config``), else round a ring where the
    attention is fused (its keys and values never whole on one device, half the gathered
    form's score blocks), else gathered."""
    if asked_cp_attention(args) or job.model.attention != "fused":
        return job.parallel.cp_attention
    return "ring"


def asked_cp_attention(args) -> bool:
    """Whether the command names how context-parallel attention runs: ``--cp-attention``, a
    ``--set parallel.cp_attention=...`` or a ``--config`` file's ``parallel.cp_attention``."""
    from jaxmem.job import read_config_file

    if getattr(args, "cp_attention", None) is not None:
        return True
    sets = [s.partition("=")[0].strip() for s in getattr(args, "set", None) or []]
    if "parallel.cp_attention" in sets:
        return True
    config = getattr(args, "config", None)
    return bool(config) and "cp_attention" in (read_config_file(config).get("parallel") or {})


def longest(args, job, problem, sources: tuple[str, str], start_backend, shell_lines) -> int:
    """Search, then print (``shell_lines``: a command as shell lines) and (``--json``) write the
    answer; exit 2 when not even one step fits. ``sources``: where the budget and the host
    limit came from; ``start_backend``: ``jaxmem plan``'s, before the first compile."""
    budget_source, host_source = sources
    from jaxmem.planner import host
    from jaxmem.planner.longest import lean_spec, plan_longest

    check_writable(args.json)
    base = _base(args, job, problem)
    step, limit = args.seq_step, problem.host_memory_bytes
    cap = args.seq_cap
    if job.model.learned_positions:  # a learned position table bounds the model's sequence
        cap = min(cap, job.model.max_seq_len)
    if cap < step:
        raise UsageError(
            f"--seq-step {step} is over the longest sequence searched ({cap}: --seq-cap, or a "
            "learned position table's max_seq_len): give a smaller step"
        )
    with usage_errors():  # the state alone over the host limit: refused before any compile
        host.check_spec(lean_spec(base, step, problem.budget_bytes, False), limit)
    start_backend(job, problem.target)
    out = render.console()
    out.print(
        f"longest sequence of {job.preset} at batch 1 on {problem.target.name}: budget "
        f"{mib(problem.budget_bytes)} MiB per device ({budget_source}), host memory "
        f"{mib(limit)} MiB ({host_source}); steps of {step} tokens up to {cap:,}",
        style="dim",
    )
    found = plan_longest(
        base, problem.budget_bytes, limit, step=step, cap=cap,
        start=min(cap, START_STEPS * step), offload=problem.target.is_gpu,
        progress=search_progress(out),
    )  # fmt: skip
    found.devices = base.parallel.cp
    if found.fits is None:
        raise UsageError(
            f"not even {step} tokens fit {mib(problem.budget_bytes)} MiB per device on "
            f"{problem.target.name} (compiled plan: {mib(found.probes[0].device_bytes)} MiB at "
            f"{found.probes[0].seq_len} tokens); raise --budget or lower --seq-step"
        )
    peak = _peak(found.fits.spec)
    command = _command(job, found.fits.spec)
    _print(out, found, shell_lines(command), peak, host_source)
    if args.json:
        write_json_atomic(args.json, _json(job, problem, found, command, peak, host_source))
        out.print(f"wrote the answer to {args.json}")
    return 0


def _command(job, spec) -> str:
    """``jaxmem train`` running the answer's step."""
    model = job.model.replace(max_seq_len=max(job.model.max_seq_len, spec.seq_len))
    run = dataclasses.replace(job.run, batch_size=1, seq_len=spec.seq_len)
    chosen = dataclasses.replace(
        job, model=model, memory=spec.policy, optimizer=spec.optimizer, accum=spec.accum, run=run,
        parallel=spec.parallel,
    )  # fmt: skip
    return shlex.join(["jaxmem", "train", *job_argv(chosen)])


def _peak(spec):
    """What is live at the peak of the answer's plan (``jaxmem peak``: XLA's buffer
    assignment), compiled as the search compiled it (host-resident state on the device)."""
    from jaxmem.planner.longest import compiled_as
    from jaxmem.planner.peak import explain_peak

    return explain_peak(compiled_as(spec))


def _largest(peak, n: int = 5) -> list:
    return sorted(peak.values, key=lambda v: -v.bytes)[:n]


def _print(out, found, command: str, peak, host_source: str) -> None:
    fits, over = found.fits, found.over
    whose = fits.compiler
    beyond = (
        f"over at {over.seq_len:,} ({mib(over.device_bytes)} MiB device, "
        f"{mib(sum(over.host_bytes.values()))} MiB host)"
        if over is not None
        else "the cap reached (--seq-cap, or a learned position table's max_seq_len)"
    )
    out.print(
        f"longest: [bold]{fits.seq_len:,} tokens[/] at batch 1 (fits at {fits.seq_len:,}; "
        f"{beyond}; {len(found.probes)} compiled plans: {whose})"
    )
    state_note = (
        ", optimizer state in host memory taken off from shapes"
        if fits.spec.optimizer.state_memory == "pinned_host"
        else ""
    )
    out.print(f"  device: {mib(fits.device_bytes)} MiB per device (compiled plan{state_note})")
    parts = ", ".join(f"{k} {mib(v)} MiB" for k, v in fits.host_bytes.items()) or "none"
    from jaxmem.planner.host import spec_host_share

    share, each = spec_host_share(fits.spec), sum(fits.host_bytes.values())
    shared = f", x {share} devices on a host = {mib(share * each)} MiB" if share > 1 else ""
    out.print(
        f"  host: {mib(each)} MiB per device ({parts}; {fits.host_source}){shared}, "
        f"within {host_source}"
    )
    if fits.step_time:
        out.print(f"  step time: {fits.step_time['line']} (an estimate, not a measurement)")
        out.print(f"    assumptions: {fits.step_time['assumptions']}", style="dim")
    holds = "; ".join(f"{v.shape} {mib(v.bytes)} MiB ({v.kind})" for v in _largest(peak))
    out.print(
        f"  what limits it (jaxmem peak of that plan, {mib(peak.live_bytes)} MiB live at "
        f"{peak.at_peak}): {holds}"
    )
    out.print("run it:", style="bold")
    out.print(command, soft_wrap=True, highlight=False, markup=False)


def _json(job, problem, found, command: str, peak, host_source: str) -> dict:
    return {
        "preset": job.preset,
        "target": problem.target.name,
        "budget_bytes": problem.budget_bytes,
        "host_memory_bytes": problem.host_memory_bytes,
        "host_memory_source": host_source,
        "step": found.step,
        "longest": found.fits.seq_len,
        "capped": found.capped,
        "fits": found.fits.as_dict(),
        "over": found.over.as_dict() if found.over else None,
        "probes": [p.as_dict() for p in found.probes],
        "command": command,
        "peak": {
            "live_bytes": peak.live_bytes,
            "at_peak": peak.at_peak,
            "by_kind_bytes": peak.by_kind(),
            "largest": [
                {"shape": v.shape, "bytes": v.bytes, "kind": v.kind} for v in _largest(peak)
            ],
            "source": "compiled plan: XLA's buffer assignment (jaxmem.planner.peak)",
        },
        "memory_source": "compiled plan per device; host: the plan's host bytes for offloaded "
        "activations, optimizer state from shapes",
    }

"""``jaxmem peak``: what is live at the peak of a train step's compiled memory plan, and which
JAX operation made it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import jaxmem.cli.own_step as own_step
import jaxmem.cli.render as render
from jaxmem.cli.common import (
    EXIT_RUN_FAILED,
    check_writable,
    mib,
    need_gpu_plan,
    need_jax_backend,
    positive_int,
    usage_errors,
)
from jaxmem.cli.flags import STEP_FLAGS, add_flags, job_from_args, max_seq_len
from jaxmem.files import write_json_atomic

NAMES = (
    *STEP_FLAGS,
    "policy",
    "unroll",
    "loss_chunks",
    "loss_tile_tokens",
    "mlp_tile_tokens",
    "replay_embedding",
    "accum",
    "mesh",
    "cp_attention",
)
DEFAULTS = {"preset": "small", "run": {"batch_size": 8}, "memory": {"policy": "none"}}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "peak",
        help="what is live at the peak of a train step's compiled memory plan, and what made it",
        description="Compiles one train step for --target (the local backend, or a GPU without "
        "one) with XLA's buffer-assignment dump on, finds the position in the scheduled program "
        "where the device memory its live buffers cover is largest, and lists those buffers "
        "with the JAX operation that made each (forward activation kept for the backward, "
        "recomputation, backward buffer, argument). A compiled plan's own figures, labelled so.",
    )
    shown = {"seq_len": "the model's max_seq_len", "target": "cpu"}
    add_flags(p, NAMES, DEFAULTS, shown=shown)
    add_flags(p, ("target", "json"), shown=shown, title="the report")
    p.add_argument("--top", type=positive_int, default=25, help="groups listed (default 25)")
    own_step.add_fn_flag(p, "--policy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxmem.memory.targets import get_target
    from jaxmem.planner.peak import explain_peak
    from jaxmem.step.frozen import check_composes
    from jaxmem.step.spec import StepSpec

    if args.fn is not None:
        return own_step.peak(args, NAMES)
    job = job_from_args(args, NAMES, DEFAULTS, seq_len_default=max_seq_len)
    with usage_errors():
        target = get_target(args.target or "cpu")
        if target.is_gpu:
            job.check_gpu_plan()
    if job.parallel.sharded and not target.is_gpu:
        from jaxmem.parallel import check_cpu_mesh

        with usage_errors():
            check_cpu_mesh(job.parallel.devices)
    if job.optimizer.stream:
        from jaxmem.planner.plans import require_one_device

        with usage_errors():
            require_one_device(job.parallel)
    with usage_errors():  # what an adapter step refuses, before the child compiles anything
        check_composes(StepSpec.of_job(job, target))
    check_writable(args.json)
    if target.is_gpu:
        need_gpu_plan(target)
    else:
        need_jax_backend()
    from jaxmem.planner.records import record_spec

    try:  # a GPU target's host-resident state is planned on the device (argument kinds drop)
        with usage_errors():
            spec = record_spec(StepSpec.of_job(job, target))
        report = explain_peak(spec)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # the compile failed, or XLA's dump
        print(f"jaxmem peak: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    out = render.console()
    out.print(f"jaxmem peak: {job.step_text}; compiled plan for {report.compiler}")
    out.print(
        f"planned peak {mib(report.planned_peak_bytes)} MiB (memory_analysis: arguments + "
        f"outputs - donated + temporaries); device arena {mib(report.allocated_bytes)} MiB; "
        f"live at the peak {mib(report.live_bytes)} MiB (position {report.position} of "
        f"{report.length} in the scheduled program, at {report.at_peak or '?'}); the rest, "
        f"{mib(report.allocated_bytes - report.live_bytes)} MiB, is what packing the buffers "
        "into one arena costs"
    )
    if job.optimizer.stream:
        out.print(
            "streamed (--stream): the planned peak is corrected from shapes (the stack's "
            "parameters and state live in host memory; donation); a deviceless compile sees them "
            "arrive in device memory, so the arena and the arguments below include them",
            style="yellow",
        )
    if target.is_gpu and job.optimizer.state_memory == "pinned_host":
        out.print(
            "optimizer state in pinned_host: a deviceless compile drops argument memory kinds, "
            "so this plan holds the state on the device (the whole state brought in for the "
            "update: an upper bound; `jaxmem memory` gives the lower bound too)",
            style="yellow",
        )
    if report.step_time is not None:
        out.print(f"{target.name} plan: {report.step_time['line']}")
        render.estimate_note(out, report.step_time, "est.")
    render.peak_tables(out, report, args.top)
    if args.json:
        write_json_atomic(args.json, _json(job, target, report))
        out.print(f"wrote {args.json}", style="dim")
    return 0


def _json(job, target, report) -> dict:
    return {
        "preset": job.preset,
        "policy": job.memory.name,
        "unroll": job.memory.unroll,
        "precision": job.precision.name,
        "optimizer": job.optimizer.name,
        "adapters": job.to_dict()["adapters"] if job.adapters.enabled else None,
        "batch": job.run.batch_size,
        "seq_len": job.run.seq_len,
        "accum": job.accum.steps,
        "target": target.name,
        "mesh": job.parallel.mesh_text() if job.parallel.sharded else None,
        **report.to_dict(),
    }

"""``jaxmem bench``: the cross-framework sweep (policy x precision, depth, sequence length,
accumulation, step time), jaxmem against torch_ref; JSON, Markdown and PNG plots."""

from __future__ import annotations

import argparse
import dataclasses
import os

import jaxmem.cli.presets as presets
import jaxmem.cli.render as render
from jaxmem.cli.common import (
    UsageError,
    int_list,
    need_gpu_plan,
    need_jax_backend,
    need_torch,
    positive_int,
    usage_errors,
)
from jaxmem.cli.common import names as parse_names
from jaxmem.cli.flags import (
    MODEL_FLAGS,
    TARGETS_HELP,
    add_flags,
    job_from_args,
    not_streamed,
    not_tensor_parallel,
)
from jaxmem.policy import POLICIES

NAMES = (*MODEL_FLAGS, "batch_size", "seq_len")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="sweep policies x precision, depth, sequence length, accumulation and step time "
        "in both frameworks; JSON, Markdown and PNG plots",
        description="The cross-framework benchmark: saved activation bytes (device + host), "
        "matmul FLOPs executed and JAX's compiled plan per policy x precision, depth, sequence "
        "length and accumulation, and median step time per policy (interleaved runs, compile "
        "and warm-up excluded), jaxmem vs torch_ref on the same weights and batches. Default: "
        "around `small`; --quick: `tiny`, fewer points and repeats.",
    )
    p.add_argument("--quick", action="store_true", help="the tiny plan (fewer points, 3 repeats)")
    shown = {"preset": "small (quick: tiny)", "batch_size": "8 (quick 4)"}
    add_flags(p, NAMES, shown=shown | {"seq_len": "128 (quick 32)"})
    g = p.add_argument_group("the sweep")
    g.add_argument("--depths", default=None, help="layer counts, e.g. 2,4,8,12")
    g.add_argument("--seq-lens", default=None, help="sequence lengths, e.g. 64,128,256")
    g.add_argument("--accum", default=None, help="microbatch counts, e.g. 1,2,4")
    g.add_argument(
        "--time-policies",
        default=None,
        help="policies to time (default none,selective,full,offload,nested)",
    )
    g.add_argument("--repeats", type=positive_int, default=None, help="timed runs (default 10)")
    g.add_argument("--target", default=None, help=f"the depth axis's JAX plans for: {TARGETS_HELP}")
    g.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="threads for both frameworks: PyTorch's pool and the CPU affinity XLA sizes its "
        "pool by (default: every usable core)",
    )
    g.add_argument(
        "--out", default="bench-results", help="output directory (default bench-results)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    need_torch("jaxmem bench")
    from jaxmem.compare.bench import DEFAULT, QUICK, run_sweep, set_threads, usable_cores

    base = QUICK if args.quick else DEFAULT
    job = job_from_args(
        args,
        NAMES,
        {"preset": base.preset, "run": {"batch_size": base.batch}},
        seq_len_default=lambda preset, model: base.seq_len,
    )
    presets.check("bench", job.preset, job.model)
    not_streamed(job, "bench")
    not_tensor_parallel(job, "bench")
    plan = _sweep_plan(args, base, job)
    _check_out(args.out)
    if args.threads is not None and args.threads > usable_cores():
        raise UsageError(
            f"--threads {args.threads}: this process may use {usable_cores()} cores; use at "
            "most that"
        )
    set_threads(args.threads)  # before JAX starts its CPU backend, which sizes its pool then
    need_jax_backend()
    from jaxmem.memory.targets import get_target

    with usage_errors():
        need_gpu_plan(get_target(plan.target))
    out = render.console()
    result = run_sweep(plan, args.out, progress=lambda m: out.log(m))
    if result["meta"]["busy_warning"]:
        out.print(f"[yellow]warning: {result['meta']['busy_warning']}[/]")
    with open(os.path.join(args.out, "sweep.md")) as f:
        out.print(f.read())
    out.print(
        f"wrote {args.out}/sweep.json, sweep.md, bytes_per_policy.png, memory_vs_layers.png, "
        f"pareto.png, step_time.png ({result['meta']['device']})"
    )
    return 0


def _sweep_plan(args: argparse.Namespace, base, job):
    """The sweep around ``job``'s model, batch and sequence, with the axes the flags give."""
    overrides = {
        "repeats": args.repeats,
        "depths": args.depths and int_list(args.depths, "--depths"),
        "seq_lens": args.seq_lens and int_list(args.seq_lens, "--seq-lens"),
        "accum_steps": args.accum and int_list(args.accum, "--accum"),
        "timed_policies": args.time_policies
        and tuple(parse_names(args.time_policies, list(POLICIES), "policies")),
        "target": args.target,
    }
    plan = dataclasses.replace(
        base,
        preset=job.preset,
        model=job.model,
        batch=job.run.batch_size,
        seq_len=job.run.seq_len,
        **{k: v for k, v in overrides.items() if v},
    )
    for seq in plan.seq_lens:
        if seq > job.model.max_seq_len:
            raise UsageError(
                f"sequence length {seq} exceeds {plan.preset}'s max_seq_len={job.model.max_seq_len}"
            )
    for k in plan.accum_steps:
        if plan.batch % k:
            raise UsageError(
                f"--accum {k} does not divide --batch-size {plan.batch}; use divisors of the "
                "batch size"
            )
    return plan


def _check_out(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file; give a directory")
    parent = out if os.path.isdir(out) else os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UsageError(f"--out {out}: {parent} is not a writable directory")

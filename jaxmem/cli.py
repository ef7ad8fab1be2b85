"""The ``jaxmem`` command line. The only module that parses flags.

Bad input gets one line on stderr naming the value and the fix, and exit code 2; nothing is
written before the input has been validated. This module imports only jaxmem's pure modules at
start; each command imports what it runs. Commands that compare with PyTorch (``parity``,
``bench``, ``memory --frameworks torch``, ``train --framework torch``, ``seed-example
--framework torch``) need the ``torch`` extra and say so, in one line, when it is missing.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import subprocess
import sys
from collections.abc import Sequence

from jaxmem import __version__
from jaxmem.config import (
    ATTENTIONS,
    PLANNING_ONLY,
    PRESETS,
    ConfigError,
    ModelConfig,
    OptimizerConfig,
    get_preset,
)
from jaxmem.files import write_json_atomic
from jaxmem.parallel import parse_mesh
from jaxmem.policy import CHECKPOINT_NAMES, POLICIES, MemoryPolicy, get_policy
from jaxmem.precision import PRECISIONS, get_precision
from jaxmem.train.job import FRAMEWORKS

EXIT_USAGE = 2
EXIT_PARITY_FAILED = 1
EXIT_RUN_FAILED = 1  # a training run stopped at run time (non-finite loss, out of memory, disk)
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM (128 + SIGINT), after saving the step
TORCH_EXTRA = "pip install 'jaxmem[torch]'"


class UsageError(Exception):
    """Bad user input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (not the usage block) and exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{value} is not a seed: use 0 .. {2**32 - 1}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{value} must be positive and finite")
    return value


def torch_available() -> bool:
    """Whether PyTorch imports (only asked by the commands that compare with it)."""
    try:
        importlib.import_module("torch")
    except ImportError:
        return False
    return True


def need_torch(what: str) -> None:
    """One line and exit 2 when a command that compares with PyTorch runs without it."""
    if not torch_available():
        raise UsageError(f"{what} needs PyTorch, which is not installed: {TORCH_EXTRA}")


def need_jax_backend() -> None:
    """One line and exit 2 when JAX cannot start the backend ``JAX_PLATFORMS`` asks for (it
    raises a bare AssertionError or RuntimeError on first use)."""
    import jax

    from jaxmem.backend import quiet_native_stderr

    try:
        with quiet_native_stderr(drop_on_error=True):  # the plugin's traceback: said below
            jax.devices()
    except Exception as e:  # jax raises AssertionError / RuntimeError, varying by version
        wanted = os.environ.get("JAX_PLATFORMS", "")
        if any(p in wanted.lower() for p in ("cuda", "gpu")):
            raise UsageError(
                f"JAX has no CUDA backend here (JAX_PLATFORMS={wanted!r}): install "
                "'jaxmem[cuda]' on a machine with an NVIDIA driver, or unset JAX_PLATFORMS"
            ) from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UsageError(
            f"JAX cannot start a backend for JAX_PLATFORMS={wanted!r} ({first}); unset it or "
            "set it to cpu"
        ) from None


def _check_writable_json(path: str | None, flag: str = "--json") -> None:
    """The directory an output file goes to exists and is writable."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path}: directory {parent} is not writable")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a directory; give a file name")


# ------------------------------------------------------------------------------------------- plan
def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag} {text!r} must be comma-separated positive integers") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"{flag} {text!r} must be comma-separated positive integers, e.g. 1,2,4")
    return values


TARGET_HELP = (
    "cpu (the local backend, default), h100, a100-40gb, a100-80gb (deviceless; needs "
    "jaxmem[gpu-plan]) or a .txtpb target file"
)


def _need_lm(args: argparse.Namespace) -> None:
    if args.preset_name == "seed":
        raise UsageError("--preset seed is a single block, not an LM; use tiny, small or gpt2-*")


def _seq_len(cfg: ModelConfig, requested: int | None, default: int) -> int:
    """``--seq-len`` (or ``default``), refused in one line past the preset's position table."""
    seq_len = requested or default
    if seq_len > cfg.max_seq_len:
        raise UsageError(
            f"--seq-len {seq_len} exceeds the preset's max_seq_len={cfg.max_seq_len}; "
            f"use at most {cfg.max_seq_len}"
        )
    return seq_len


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def cmd_plan(args: argparse.Namespace) -> int:
    cfg: ModelConfig = args.preset
    _need_lm(args)
    from jaxmem.memory.targets import get_target

    try:
        target = get_target(args.target)
        parallel = parse_mesh(args.mesh) if args.mesh is not None else None
        opt_cfg = OptimizerConfig(name=args.optimizer)
        from jaxmem.memory.plan import PlanSpace, default_budget, parse_bytes

        if args.budget is not None:
            budget, budget_source = parse_bytes(args.budget), "--budget"
        else:
            budget, budget_source = default_budget(target)
        space = PlanSpace(
            policies=tuple(_names(args.policies, list(POLICIES), "policies")),
            mix=tuple(p for p in ("none", "selective", "offload", "full") if p in args.policies)
            if args.mix
            else (),
            accum=_int_list(args.accum, "--accum"),
            state_memory=("device", "pinned_host") if args.state_offload else ("device",),
            strategies=tuple(_names(args.strategies, ["dp", "zero1", "fsdp"], "strategies")),
            precisions=tuple(_names(args.precisions, list(PRECISIONS), "precisions")),
        )
    except ConfigError as e:
        raise UsageError(str(e)) from None
    devices = parallel.devices if parallel is not None else 1
    seq_len = _seq_len(cfg, args.seq_len, cfg.max_seq_len)
    if args.batch_size % devices:
        raise UsageError(
            f"--batch-size {args.batch_size} does not split over {devices} devices: give a "
            f"multiple of {devices}"
        )
    if cfg.n_layers < 4:
        raise UsageError(
            f"--preset {args.preset_name} has {cfg.n_layers} layers: the memory model is fitted "
            "at two depths of at least 2 blocks, so plan a model of at least 4"
        )
    _check_writable_json(args.json)
    need_jax_backend()
    if target.is_gpu:
        from jaxmem.memory.gpu_plan import require_gpu_plan

        try:
            require_gpu_plan(target)
        except ConfigError as e:
            raise UsageError(str(e)) from None
    elif devices > 1:
        from jaxmem.sharding import ensure_cpu_devices

        ensure_cpu_devices(devices)
    from rich.console import Console
    from rich.table import Table

    from jaxmem.memory.plan import Problem, rates_for, search, smallest_plan

    console = Console(width=max(Console().width, 150))  # the table's 8 columns, even in a pipe
    problem = Problem(
        cfg, args.batch_size, seq_len, target, budget, opt_cfg, devices, slack=args.slack
    )
    where = f"{devices} x {target.name}" if devices > 1 else target.name
    console.print(
        f"planning {args.preset_name}, batch {args.batch_size} x seq {seq_len}, {opt_cfg.name}, "
        f"on {where}: budget {_mib(budget)} MiB per device ({budget_source})",
        style="dim",
    )
    result = search(
        problem,
        space,
        max_compiles=args.max_compiles,
        progress=lambda text: console.print(text, style="dim"),
    )
    error = result.max_fit_error()
    rates = rates_for(target)
    if result.chosen is None and result.stopped:
        raise UsageError(
            f"the search stopped after --max-compiles {args.max_compiles} compiles with no "
            f"candidate under {_mib(budget)} MiB per device; raise --max-compiles"
        )
    if result.chosen is None:
        smallest = smallest_plan(result)
        found = (
            f"the smallest plan found is {smallest.candidate.describe()} at "
            f"{_mib(smallest.compiled)} MiB ({result.compiler})"
            if smallest is not None
            else "no candidate was compiled"
        )
        reached = sum(o.status != "not reached" for o in result.outcomes)
        raise UsageError(
            f"no configuration of the {reached} tried fits {_mib(budget)} MiB per device on "
            f"{where}: {found}; raise --budget, add devices (--mesh fsdp=N) or allow more "
            "(--accum, --precisions, --state-offload)"
        )
    shown = [o for o in result.outcomes if o.status != "not reached"][-args.top :]
    table = Table(
        title=f"jaxmem plan: {args.preset_name}, batch {args.batch_size} x {seq_len} on {where}, "
        f"budget {_mib(budget)} MiB per device"
    )
    for col in (
        "configuration",
        "matmul TFLOP (jaxpr)",
        "host GB (est.)",
        "collective GB (est.)",
        "est. step s",
        "predicted MiB (fit)",
        "compiled MiB (plan)",
        "",
    ):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for o in shown:
        c = o.candidate
        style = "bold green" if o is result.chosen else None
        table.add_row(
            c.describe(),
            f"{c.flops / 1e12:,.3f}",
            f"{c.host_bytes / 1e9:,.2f}",
            f"{c.collective_bytes / 1e9:,.2f}",
            f"{c.seconds:.4f}",
            _mib(o.predicted),
            _mib(o.compiled),
            o.status,
            style=style,
        )
    console.print(table)
    chosen = result.chosen.candidate
    skipped = sum(o.status == "over (predicted)" for o in result.outcomes)
    floored = sum(o.status.startswith("over (family floor") for o in result.outcomes)
    console.print(
        f"chosen: [bold]{chosen.describe()}[/]: {_mib(result.chosen.compiled)} MiB per device "
        f"(compiled plan: {result.compiler}), {chosen.flops / 1e12:,.3f} TFLOP per device and "
        f"step, est. {chosen.seconds:.4f} s"
    )
    console.print(
        f"{len(result.outcomes)} candidates on the lattice; {result.candidate_compiles} compiled "
        f"at depth {cfg.n_layers}, {skipped} skipped as predicted over the budget (by more than "
        f"{args.slack:.0%}, or than a calibrated pair's error), {floored} because their "
        "family's leanest stack (full/offload) compiled over it; the memory model "
        f"({result.fit_compiles} compiles at depths {problem.fit_depths[0]} and "
        f"{problem.fit_depths[1]}) "
        + (
            f"erred by at most {error:.1%} on the compiled candidates"
            if error is not None
            else "was not checked (nothing predicted was compiled)"
        )
        + (
            f" [yellow](more than --slack {args.slack:.0%}: a skipped candidate may fit)[/]"
            if error is not None and error > args.slack
            else ""
        ),
        style="dim",
    )
    from jaxmem.memory.plan import torch_translation, train_flags

    flags = " ".join(train_flags(chosen, devices))
    console.print(f"run it: jaxmem train --preset {args.preset_name} {flags} ...")
    console.print(f"PyTorch: {torch_translation(chosen, devices)}")
    console.print(
        "cost: an estimate (matmul FLOPs from the gradient's jaxpr over the peak rate, bytes "
        f"over the links): {rates.source}",
        style="dim",
    )
    if args.json:
        write_json_atomic(
            args.json,
            {
                "preset": args.preset_name,
                "batch": args.batch_size,
                "seq_len": seq_len,
                "target": target.name,
                "devices": devices,
                "budget_bytes": budget,
                "budget_source": budget_source,
                "compiler": result.compiler,
                "chosen": result.chosen.as_dict(),
                "jax_train_flags": train_flags(chosen, devices),
                "torch": torch_translation(chosen, devices),
                "candidates": [o.as_dict() for o in result.outcomes if o.status != "not reached"],
                "lattice_size": len(result.outcomes),
                "fit_compiles": result.fit_compiles,
                "candidate_compiles": result.candidate_compiles,
                "max_fit_error": error,
                "cost_source": "estimate: " + rates.source,
                "memory_source": "compiled plan (arguments + outputs - aliased + temporaries), "
                "per device; predicted: affine fit in depth from compiles at depths "
                f"{problem.fit_depths}",
            },
        )
        console.print(f"wrote the plan to {args.json}")
    return 0


# ---------------------------------------------------------------------------------------- presets
def preset_use(name: str) -> str:
    """What a preset is for, in the words of the rules the commands apply."""
    cfg = PRESETS[name]
    if not cfg.causal:
        return "seed-example, memory (no causal mask: not a language model to train)"
    if name in PLANNING_ONLY:
        return "memory plans it from shapes (torch_ref on fake tensors); train (a GPU's work)"
    return "train, memory, parity, bench"


# ------------------------------------------------------------------------------------------- peak
def _peak_policy(text: str, unroll: bool) -> MemoryPolicy:
    """A preset name, or ``HEAD:K+REST`` (the first K blocks under HEAD, the rest under REST:
    the names ``jaxmem plan`` prints)."""
    import re

    from jaxmem.policy import mixed_policy

    try:
        mixed = re.fullmatch(r"([a-z_]+):(\d+)\+([a-z_]+)", text)
        if mixed:
            return mixed_policy(mixed.group(1), int(mixed.group(2)), mixed.group(3), unroll=unroll)
        return get_policy(text).replace(unroll=unroll) if unroll else get_policy(text)
    except ConfigError as e:
        raise UsageError(f"--policy {text!r}: {e}") from None


def cmd_peak(args: argparse.Namespace) -> int:
    cfg: ModelConfig = args.preset
    _need_lm(args)
    from jaxmem.memory.targets import get_target

    policy = _peak_policy(args.policy, args.unroll)
    if args.unroll and policy.nested:
        raise UsageError(
            "--unroll cannot apply to nested (it runs its segments under scan); drop --unroll"
        )
    if args.attention is not None:
        if args.attention not in ATTENTIONS:
            raise UsageError(
                f"--attention {args.attention!r} is not one of {', '.join(ATTENTIONS)}"
            )
        cfg = cfg.replace(attention=args.attention)
    try:
        target = get_target(args.target)
        get_precision(args.precision)
        opt_cfg = OptimizerConfig(name=args.optimizer)
        from jaxmem.policy import check_policy

        check_policy(cfg, policy)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    seq_len = _seq_len(cfg, args.seq_len, cfg.max_seq_len)
    if args.batch_size % args.accum:
        raise UsageError(
            f"--batch-size {args.batch_size} does not split into --accum {args.accum} "
            f"microbatches: give a multiple of {args.accum}"
        )
    parallel = None
    if args.mesh is not None:
        try:
            parallel = parse_mesh(args.mesh)
            parallel.check_batch(args.batch_size, args.accum)
        except ConfigError as e:
            raise UsageError(str(e)) from None
    _check_writable_json(args.json)
    if target.is_gpu:
        from jaxmem.memory.gpu_plan import require_gpu_plan

        try:
            require_gpu_plan(target)
        except ConfigError as e:
            raise UsageError(str(e)) from None
    else:
        need_jax_backend()
    from rich.console import Console
    from rich.table import Table

    from jaxmem.memory.peak import KIND_HELP, KINDS, explain_peak

    console = Console(width=max(Console().width, 140))
    try:
        report = explain_peak(
            cfg,
            policy,
            args.precision,
            opt_cfg,
            args.batch_size,
            seq_len,
            args.target,
            args.accum,
            mesh=args.mesh,
        )
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # the compile failed, or XLA's dump
        print(f"jaxmem peak: {e}", file=sys.stderr)
        return 1
    stack = f"{policy.name}{' (unrolled)' if policy.unroll else ''}"
    what = (
        f"{args.preset_name}, batch {args.batch_size} x {seq_len}"
        f"{f' in {args.accum} microbatches' if args.accum > 1 else ''}, {args.precision}, "
        f"{stack}, {opt_cfg.name}"
    )
    console.print(f"jaxmem peak: {what}; compiled plan for {report.compiler}")
    console.print(
        f"planned peak {_mib(report.planned_peak_bytes)} MiB (memory_analysis: arguments + "
        f"outputs - donated + temporaries); device arena {_mib(report.allocated_bytes)} MiB; "
        f"live at the peak {_mib(report.live_bytes)} MiB (position {report.position} of "
        f"{report.length} in the scheduled program, at {report.at_peak or '?'}); the rest, "
        f"{_mib(report.allocated_bytes - report.live_bytes)} MiB, is what packing the buffers "
        "into one arena costs"
    )
    kinds = Table(title="live at the peak, by kind (MiB)")
    for col in ("kind", "MiB", "what"):
        kinds.add_column(col, justify="right" if col == "MiB" else "left")
    totals = report.by_kind()
    for kind in KINDS:
        kinds.add_row(kind, _mib(totals[kind]), KIND_HELP[kind])
    console.print(kinds)
    groups: dict[tuple[str, str, str], list] = {}
    for v in report.values:
        if v.kind != "argument":  # the table above has them, by kind
            groups.setdefault((v.kind, v.op_name, v.shape), []).append(v)
    ranked = sorted(groups.items(), key=lambda kv: -sum(v.bytes for v in kv[1]))
    values = Table(
        title=f"the {min(args.top, len(ranked))} largest groups of buffers live at the peak, "
        "arguments aside (same JAX operation and shape; live: the positions the first is made "
        "and the last is read)"
    )
    for col in ("MiB", "buffers", "kind", "shape", "live", "made by (JAX operation)"):
        values.add_column(col, justify="right" if col in ("MiB", "buffers") else "left")
    for (kind, op_name, shape), vs in ranked[: args.top]:
        values.add_row(
            _mib(sum(v.bytes for v in vs)),
            str(len(vs)),
            kind,
            shape,
            f"{min(v.start for v in vs)}-{max(v.end for v in vs)}",
            op_name,
        )
    console.print(values)
    if args.json:
        write_json_atomic(
            args.json,
            {
                "preset": args.preset_name,
                "policy": policy.name,
                "unroll": policy.unroll,
                "precision": args.precision,
                "optimizer": opt_cfg.name,
                "batch": args.batch_size,
                "seq_len": seq_len,
                "accum": args.accum,
                "target": target.name,
                "mesh": parallel.mesh_text() if parallel is not None else None,
                **report.to_dict(),
            },
        )
        console.print(f"wrote {args.json}", style="dim")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="jaxmem model presets (parameter counts are analytic)")
    table.add_column("preset", no_wrap=True)
    table.add_column("params", justify="right", no_wrap=True)
    for col in ("L", "d", "H", "d_ff", "seq"):
        table.add_column(col, justify="right")
    for col in ("norm", "act", "use"):
        table.add_column(col)
    for name, cfg in PRESETS.items():
        table.add_row(
            name,
            f"{cfg.n_params / 1e6:,.1f} M",
            str(cfg.n_layers),
            str(cfg.d_model),
            str(cfg.n_heads),
            str(cfg.d_ff),
            str(cfg.max_seq_len),
            cfg.norm,
            cfg.activation,
            preset_use(name),
        )
    console = Console()
    Console(width=max(console.width, 100)).print(table)  # never wrap the columns
    return 0


# ----------------------------------------------------------------------------------------- parity
def cmd_parity(args: argparse.Namespace) -> int:
    cfg: ModelConfig = args.preset
    seq_len = _seq_len(cfg, args.seq_len, min(cfg.max_seq_len, 32))
    if cfg.n_params > 50_000_000:
        raise UsageError(
            f"--preset {args.preset_name} has {cfg.n_params / 1e6:.0f} M parameters; parity "
            "runs both frameworks in float64 and fp32 on this machine: use tiny, small or seed"
        )
    need_torch("jaxmem parity")
    need_jax_backend()
    _check_writable_json(args.json)
    from jaxmem.compare.parity import run_parity

    dtypes = [args.dtype] if args.dtype else ["float64", "float32"]
    reports = [
        run_parity(cfg, batch=args.batch_size, seq_len=seq_len, seed=args.seed, dtype=dtype)
        for dtype in dtypes
    ]
    passed = all(r["passed"] for r in reports)
    if args.json:
        write_json_atomic(
            args.json, {"preset": args.preset_name, "passed": passed, "results": reports}
        )
    for report in reports:
        verdict = "PASSED" if report["passed"] else "FAILED"
        tol = report["tolerances"]["grads"]
        print(
            f"parity {verdict} ({args.preset_name}, {report['dtype']}, batch {args.batch_size}, "
            f"seq {seq_len}): loss jax {report['loss_jax']:.9f} torch "
            f"{report['loss_torch']:.9f}; max |grad diff| {report['max_abs_grad_diff']:.3e}, "
            f"max normwise rel {report['max_rel_grad_diff']:.3e} over {report['n_grad_leaves']} "
            f"gradient leaves (tolerance rtol={tol['rtol']}, atol={tol['atol']})"
        )
        if not report["passed"]:
            print(
                f"failing gradient leaves ({report['dtype']}): {report['failed_grad_leaves']}",
                file=sys.stderr,
            )
    return 0 if passed else EXIT_PARITY_FAILED


# ------------------------------------------------------------------------------------------ train
# flag -> (section, key) of jaxmem.train.job.JobConfig.to_dict(); None values (flag not given) are
# skipped, so a flag overrides the config file only when given.
TRAIN_FLAGS: dict[str, tuple[str, str]] = {
    "preset": ("", "preset"),
    "precision": ("", "precision"),
    "policy": ("memory", "policy"),
    "save": ("memory", "save"),
    "offload": ("memory", "offload"),
    "unroll": ("memory", "unroll"),
    "n_layers": ("model", "n_layers"),
    "d_model": ("model", "d_model"),
    "n_heads": ("model", "n_heads"),
    "d_ff": ("model", "d_ff"),
    "optimizer": ("optimizer", "name"),
    "lr": ("optimizer", "lr"),
    "weight_decay": ("optimizer", "weight_decay"),
    "accum": ("accum", "steps"),
    "accum_mode": ("accum", "mode"),
    "data": ("data", "path"),
    "framework": ("run", "framework"),
    "steps": ("run", "steps"),
    "batch_size": ("run", "batch_size"),
    "seq_len": ("run", "seq_len"),
    "seed": ("run", "seed"),
    "eval_every": ("run", "eval_every"),
    "checkpoint_every": ("run", "checkpoint_every"),
    "keep": ("run", "keep_checkpoints"),
    "sample_tokens": ("run", "sample_tokens"),
    "prompt": ("run", "prompt"),
}


def resolve_job(args: argparse.Namespace):
    """Defaults < the checkpoint's saved config (with --resume) < --config file < flags and
    --set. Raises ConfigError with the bad value."""
    from jaxmem.train.job import JobConfig, merge, parse_assignment, read_config_file

    layered: dict = {}
    if args.resume and args.out:
        from jaxmem.train.checkpoint import latest_checkpoint

        # either framework's checkpoint layout is read; its config says which one it was
        _, saved, _ = latest_checkpoint(args.out)
        layered = saved or {}
    if args.config:
        layered = merge(layered, read_config_file(args.config))
    flags: dict = {}
    for flag, (section, key) in TRAIN_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if flag in ("save", "offload"):
            value = [n.strip() for n in value.split(",") if n.strip()]
        if section:
            flags.setdefault(section, {})[key] = value
        else:
            flags[key] = value
    if (args.save or args.offload) and args.policy is None:
        flags.setdefault("memory", {})["policy"] = "custom"
    if args.mesh is not None:
        parallel = parse_mesh(args.mesh)
        flags["parallel"] = {"strategy": parallel.strategy, "devices": parallel.devices}
    layered = merge(layered, flags)
    for assignment in args.set or ():
        layered = merge(layered, parse_assignment(assignment))
    return JobConfig.from_dict(layered)


def _ask_for_cpu_devices(args: argparse.Namespace, processes: int = 1) -> int | None:
    """JAX fixes its CPU device count when its backends start, and reading a checkpoint starts
    them: ask for a mesh's devices first, from --mesh or the run's config.yaml (resuming).
    Returns the mesh's device count, or None when a config file may still set it."""
    import yaml

    from jaxmem.sharding import ensure_cpu_devices

    devices = None if args.config else 1
    if args.mesh is not None:
        try:
            devices = parse_mesh(args.mesh).devices
        except ConfigError:
            return None  # resolve_job reports it
    elif args.resume and args.out:
        try:
            with open(os.path.join(args.out, "config.yaml")) as f:
                devices = int(((yaml.safe_load(f) or {}).get("parallel") or {}).get("devices", 1))
        except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
            return None  # no readable config: resolve_job reads the checkpoint's and says
    if devices is not None and devices > 1:
        ensure_cpu_devices(max(1, devices // processes))  # this process's share of the mesh
    return devices


def _check_processes(devices: int, processes: int, mesh_text: str) -> None:
    if processes > 1 and devices % processes:
        raise UsageError(
            f"--num-processes {processes} needs a --mesh spanning every process's devices (got "
            f"{mesh_text}): e.g. --mesh fsdp={2 * processes}"
        )


def _auto_policy(job, budget_text: str):
    """``jaxmem plan`` on this machine's backend at ``budget_text``: the job with the chosen
    policy and microbatch count (the run's config.yaml then records them)."""
    import dataclasses

    if job.run.framework != "jax":
        raise UsageError("--policy auto plans jaxmem's step: use --framework jax")
    if job.accum.mode != "scan":
        raise UsageError("--policy auto plans the scanned accumulation: drop --accum-mode")
    need_jax_backend()
    from rich.console import Console

    from jaxmem.memory.plan import PlanSpace, Problem, parse_bytes, search, smallest_plan
    from jaxmem.memory.targets import LOCAL

    try:
        budget = parse_bytes(budget_text)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if job.model.n_layers < 4:
        raise UsageError(
            f"--policy auto fits its memory model at two depths of at least 2: the model has "
            f"{job.model.n_layers} layers; choose a policy yourself"
        )
    n = job.parallel.devices
    space = PlanSpace(
        policies=("none", "selective", "mlp", "full", "nested"),
        mix=("none", "selective", "full"),
        accum=tuple(m for m in (1, 2, 4, 8) if job.run.batch_size % (m * n) == 0),
        state_memory=("device",),
        strategies=(job.parallel.strategy,),
        precisions=(job.precision.name,),
    )
    problem = Problem(
        job.model, job.run.batch_size, job.run.seq_len, LOCAL, budget, job.optimizer, n
    )
    console = Console()
    console.print(f"--policy auto: planning on this backend under {budget_text} ...", style="dim")
    result = search(problem, space)
    if result.chosen is None:
        smallest = smallest_plan(result)
        found = (
            f"{smallest.candidate.describe()} at {smallest.compiled / 2**20:,.1f} MiB"
            if smallest is not None
            else "nothing compiled"
        )
        raise UsageError(
            f"--policy auto: no configuration fits --memory-budget {budget_text} on this "
            f"backend; the smallest plan found is {found} ({result.compiler})"
        )
    chosen = result.chosen.candidate
    console.print(
        f"--policy auto chose {chosen.policy.name} with {chosen.accum} microbatch(es): "
        f"{result.chosen.compiled / 2**20:,.1f} MiB planned ({result.compiler}), cheapest of "
        f"{len(result.outcomes)} on the lattice by estimated cost; written to config.yaml",
    )
    return dataclasses.replace(
        job,
        memory=chosen.policy,
        accum=dataclasses.replace(job.accum, steps=chosen.accum),
    )


def cmd_train(args: argparse.Namespace) -> int:
    from jaxmem.data import DataError
    from jaxmem.distributed import initialize, process_group
    from jaxmem.train.layout import CheckpointError

    try:
        group = process_group(args.coordinator, args.num_processes, args.process_id)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    devices = _ask_for_cpu_devices(args, group.num_processes)
    if devices is not None:  # before joining the other processes: a bad layout fails fast
        _check_processes(devices, group.num_processes, args.mesh or f"{devices} device(s)")
    if group.multi:
        initialize(group)  # before anything starts JAX's backends (reading a checkpoint does)
    auto = args.policy == "auto"
    if auto:
        if args.memory_budget is None:
            raise UsageError("--policy auto needs --memory-budget (e.g. 2GiB): the bytes to fit")
        if args.resume:
            raise UsageError(
                "--policy auto chooses a policy when a run starts; --resume continues with the "
                "one in the run's config.yaml: drop --policy auto"
            )
        if args.save or args.offload or args.accum is not None:
            raise UsageError(
                "--policy auto chooses the policy and the microbatch count itself: drop "
                "--save/--offload/--accum (or choose them yourself without auto)"
            )
        args.policy = None
    elif args.memory_budget is not None:
        raise UsageError("--memory-budget goes with --policy auto")
    try:
        job = resolve_job(args)
    except (ConfigError, DataError, CheckpointError) as e:
        raise UsageError(str(e)) from None
    if auto:
        job = _auto_policy(job, args.memory_budget)
    target = None
    if args.target not in (None, "cpu"):
        from jaxmem.memory.targets import get_target

        if job.run.framework == "torch":
            raise UsageError(
                f"--target {args.target} plans jaxmem's step for a GPU; torch_ref has no "
                "compiled plan (see its accounting with jaxmem memory --target)"
            )
        if job.accum.mode == "multisteps":
            raise UsageError(
                f"--target {args.target} plans the scanned train step; with --accum-mode "
                "multisteps use --accum-mode scan (or plan with jaxmem memory --target)"
            )
        if "pinned_host" in (job.optimizer.state_memory, job.optimizer.params_memory):
            raise UsageError(
                f"--target {args.target}: a deviceless compile drops host memory kinds on the "
                "step's arguments; see host-resident optimizer state with jaxmem memory "
                "--target ... --state-memory pinned_host (counted analytically there)"
            )
        try:
            target = get_target(args.target)
            from jaxmem.memory.gpu_plan import require_gpu_plan

            require_gpu_plan(target)
        except ConfigError as e:
            raise UsageError(str(e)) from None
    primary = group.primary
    if job.run.framework == "torch":
        need_torch("jaxmem train --framework torch")
        from jaxmem.compare import torch_run as framework

        try:  # one torchrun process per device of the mesh
            primary = framework.launch_for(job).primary
        except ConfigError as e:
            raise UsageError(str(e)) from None
    else:
        if job.parallel.sharded:  # a mesh given in a --config file: ask before JAX starts
            from jaxmem.sharding import ensure_cpu_devices

            ensure_cpu_devices(max(1, job.parallel.devices // group.num_processes))
        need_jax_backend()
        from jaxmem.train import run as framework
    from jaxmem.train.loop import RunFailed, RunInterrupted

    if group.multi and job.run.framework != "jax":
        raise UsageError(
            "--num-processes > 1 runs JAX's multi-process runtime: use --framework jax"
        )
    _check_processes(job.parallel.devices, group.num_processes, job.parallel.mesh_text())
    try:
        if group.multi or job.parallel.sharded and job.run.framework == "torch":
            from rich.console import Console

            # process 0 owns the run directory and the console; the others train beside it
            prepared = framework.prepare(job, args.out, resume=args.resume, primary=primary)
            framework.run_training(prepared, console=Console(quiet=not primary))
        else:
            prepared = framework.prepare(job, args.out, resume=args.resume)
            if target is not None:
                framework.run_training(prepared, target=target)
            else:
                framework.run_training(prepared)
    except (ConfigError, DataError, CheckpointError) as e:
        raise UsageError(str(e)) from None
    except RunFailed as e:
        if job.run.framework == "jax":
            from jaxmem.train.checkpoint import silence_background_errors

            silence_background_errors()  # orbax's threads would repeat a failed save at exit
        print(f"jaxmem train: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except RunInterrupted as e:
        print(f"jaxmem train: {e}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print(
            "jaxmem train: interrupted; nothing saved since the last checkpoint",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from jaxmem.data import DataError, prepare_bin

    try:
        meta = prepare_bin(args.source, args.out, val_fraction=args.val_fraction)
    except DataError as e:
        raise UsageError(str(e)) from None
    print(
        f"wrote {args.out}/train.bin ({meta['train_tokens']:,} tokens), val.bin "
        f"({meta['val_tokens']:,} tokens), meta.json: uint16 byte tokens from {meta['source']}; "
        f"train with: jaxmem train --data {args.out}"
    )
    return 0


PLOT_FORMATS = (".png", ".pdf", ".svg")


def cmd_capture_target(args: argparse.Namespace) -> int:
    """Write this machine's GPU target config, for ``--target FILE`` on a machine without it."""
    from jaxmem.files import write_atomic

    if not args.out.endswith((".txtpb", ".pbtxt", ".textproto")):
        raise UsageError(f"--out {args.out}: give a .txtpb file name")
    _check_writable_json(args.out, "--out")
    need_jax_backend()
    from jaxmem.memory.gpu_plan import capture_target_config
    from jaxmem.memory.targets import parse_target

    try:
        text = capture_target_config()
        target = parse_target(os.path.splitext(os.path.basename(args.out))[0], text, args.out)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    write_atomic(args.out, text)
    print(
        f"wrote {args.out}: {target.description}, {target.device_memory_bytes:,} bytes of device "
        f"memory; plan for it anywhere with --target {args.out}"
    )
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from jaxmem.train.job import read_config_file
    from jaxmem.train.loop import plot_losses, read_metrics

    out = args.out
    if os.path.isdir(out):
        raise UsageError(f"--out {out} is a directory; give a file name")
    ext = os.path.splitext(out)[1].lower()
    if not ext:
        out += ".png"
    elif ext not in PLOT_FORMATS:
        raise UsageError(f"--out {out}: give a {', '.join(PLOT_FORMATS)} file")
    _check_writable_json(out, "--out")
    runs, notes = [], []
    for run_dir in args.runs:
        path = os.path.join(run_dir, "metrics.jsonl")
        if not os.path.isfile(path):
            raise UsageError(
                f"{run_dir} has no metrics.jsonl; give run directories of jaxmem train"
            )
        records, partial = read_metrics(path)
        if partial:
            notes.append(f"{path}: skipped {partial} unreadable line(s) (a run killed mid-write)")
        if not records:
            raise UsageError(f"{path} holds no step yet; the run logged nothing")
        label = os.path.basename(os.path.normpath(run_dir))
        config = os.path.join(run_dir, "config.yaml")
        if os.path.isfile(config):
            try:
                run = read_config_file(config).get("run", {})
            except ConfigError as e:
                raise UsageError(str(e)) from None
            label = f"{label} ({run.get('framework', 'jax')})"
        runs.append((label, records))
    plot_losses(runs, out)
    for note in notes:
        print(note, file=sys.stderr)
    print(f"wrote {out}: loss curves of {len(runs)} run(s)")
    return 0


# ----------------------------------------------------------------------------------------- memory
MEMORY_FRAMEWORKS = ("jax", "torch", "torch-lean")


def _names(text: str, valid: Sequence[str], what: str) -> list[str]:
    """Comma-separated names, each once, in the order given."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise UsageError(f"unknown {what} {bad or [text]}; choose from: {', '.join(valid)}")
    return names


def cmd_memory(args: argparse.Namespace) -> int:
    cfg: ModelConfig = args.preset
    notes = []
    if args.attention is not None:
        if args.attention not in ATTENTIONS:
            raise UsageError(
                f"--attention {args.attention!r} is not one of {', '.join(ATTENTIONS)}"
            )
        cfg = cfg.replace(attention=args.attention)
    if cfg.attention == "fused":
        notes.append(
            "attention: fused (JAX: jaxmem's blockwise kernel; PyTorch: "
            "F.scaled_dot_product_attention): no [B, H, S, S] tensor is kept or materialised"
        )
    policies = _names(args.policies, list(POLICIES), "policies")
    parallel = None
    if args.mesh is not None:
        try:
            parallel = parse_mesh(args.mesh)
        except ConfigError as e:
            raise UsageError(str(e)) from None
        if args.frameworks is None:
            args.frameworks = "jax"
            notes.append(
                f"--mesh {parallel.mesh_text()}: JAX plans, every figure per device; add "
                f"--frameworks jax,torch for torch_ref's per-rank figures (its step run on "
                f"{parallel.devices} torchrun CPU processes)"
            )
        elif "torch-lean" in args.frameworks.split(","):
            raise UsageError(
                f"--mesh {parallel.mesh_text()}: torch_ref's per-rank runs are stock PyTorch "
                "(DDP, FSDP2): use --frameworks jax,torch"
            )
        elif "torch" in args.frameworks.split(",") and parallel.sharded:
            if args.preset_name in PLANNING_ONLY or args.target not in (None, "cpu"):
                raise UsageError(
                    f"--mesh {parallel.mesh_text()} --frameworks torch runs torch_ref's step on "
                    f"{parallel.devices} CPU processes of this machine: use a preset it holds "
                    "(tiny, small) without --target, or --frameworks jax to plan"
                )
        if args.target in (None, "cpu") and parallel.sharded:
            from jaxmem.sharding import ensure_cpu_devices

            ensure_cpu_devices(parallel.devices)  # before JAX starts its backends
    if args.unroll:
        if "nested" in policies:
            raise UsageError(
                "--unroll cannot apply to nested (it runs its segments under scan: that is how "
                "it keeps about √L block inputs); drop nested from --policies or drop --unroll"
            )
        if args.target in (None, "cpu"):
            notes.append(
                "--unroll on XLA:CPU: its compiler drops remat in an unrolled stack, so the "
                "plan shows no policy's savings (only none's); plan for a GPU --target"
            )
    if args.frameworks is None and not torch_available():
        frameworks = ["jax"]
        notes.append(f"PyTorch is not installed: JAX only ({TORCH_EXTRA} adds the torch rows)")
    else:
        frameworks = _names(
            args.frameworks or ",".join(MEMORY_FRAMEWORKS), MEMORY_FRAMEWORKS, "frameworks"
        )
    if any(f.startswith("torch") for f in frameworks):
        need_torch("jaxmem memory --frameworks torch")
    try:
        precision = get_precision(args.precision)
        opt_cfg = OptimizerConfig(name=args.optimizer, state_memory=args.state_memory)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if opt_cfg.state_memory != "device" and args.frameworks is None:
        frameworks = ["jax"]
        notes.append(
            "--state-memory pinned_host is jaxmem's (torch_ref has no such offload): JAX only"
        )
    elif opt_cfg.state_memory != "device" and frameworks != ["jax"]:
        raise UsageError(
            f"--state-memory {opt_cfg.state_memory} is jaxmem's optimizer-state offload, which "
            "torch_ref does not implement: add --frameworks jax"
        )
    _need_lm(args)
    from jaxmem.memory.targets import get_target

    try:
        target = get_target(args.target)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    # planning: JAX compiles the step from shapes (for this backend or the GPU target) and
    # torch_ref runs it on fake tensors (shapes only; see jaxmem.compare.records.torch_record)
    planning = args.preset_name in PLANNING_ONLY or target.is_gpu
    seq_len = _seq_len(
        cfg, args.seq_len, (cfg.max_seq_len if planning else min(64, cfg.max_seq_len))
    )
    planning = planning or (parallel is not None and parallel.sharded)  # always from shapes
    _check_writable_json(args.json)
    if "jax" in frameworks:
        need_jax_backend()
        from jaxmem.memory.remat import check_backend

        try:
            if target.is_gpu:
                from jaxmem.memory.gpu_plan import require_gpu_plan

                require_gpu_plan(target)  # a GPU target has host memory: offload plans there
            else:
                for name in policies:
                    check_backend(get_policy(name))
        except ConfigError as e:
            raise UsageError(str(e)) from None
    from rich.console import Console

    console = Console()
    for note in notes:
        console.print(f"[yellow]{note}[/]")
    records, rank_records = [], []
    for name in policies:
        policy = get_policy(name)
        if args.unroll:  # torch_ref ignores it: its blocks always run one by one
            policy = policy.replace(unroll=True)
        for fw in frameworks:
            if fw == "torch" and parallel is not None and parallel.sharded:
                from jaxmem.compare.records import torch_rank_records

                console.print(
                    f"measuring torch {name} (running the step on {parallel.devices} torchrun "
                    "CPU processes)...",
                    style="dim",
                )
                try:
                    rank_records += torch_rank_records(
                        args.preset_name,
                        name,
                        parallel,
                        precision=precision.name,
                        optimizer=opt_cfg.name,
                        attention=cfg.attention,
                        batch=args.batch_size,
                        seq_len=seq_len,
                    )
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"jaxmem memory: torch_ref's per-rank run failed: {e}", file=sys.stderr)
                    return EXIT_RUN_FAILED
                continue
            how = ""
            if planning and fw != "jax":
                how = " (running the step on fake tensors: shapes only)"
            elif target.is_gpu:
                how = f" (compiling the train step from shapes for {target.description})"
            elif planning:
                how = " (compiling the train step from shapes)"
            console.print(f"measuring {fw} {name}{how}...", style="dim")
            if fw == "jax":
                from jaxmem.memory.records import jax_record

                rec = jax_record(
                    cfg,
                    policy,
                    precision,
                    opt_cfg,
                    args.batch_size,
                    seq_len,
                    abstract=planning,
                    target=target,
                    parallel=parallel,
                )
            else:
                from jaxmem.compare.bench import has_lean
                from jaxmem.compare.records import torch_record

                if fw == "torch-lean" and not has_lean(policy):
                    continue  # the extension runs what stock runs (or stock has no API)
                translation = "lean" if fw == "torch-lean" else "stock"
                rec = torch_record(
                    cfg,
                    policy,
                    precision,
                    opt_cfg,
                    args.batch_size,
                    seq_len,
                    translation=translation,
                    fake=planning,
                )
            rec["preset"] = args.preset_name
            rec["attention"] = cfg.attention
            records.append(rec)
    if records:
        _print_memory_table(
            console, records, args.preset_name, args.batch_size, seq_len, planning, target
        )
    if rank_records:
        _print_rank_table(console, rank_records, args.preset_name, args.batch_size, seq_len)
    if args.json:
        write_json_atomic(args.json, records + rank_records)
        console.print(f"wrote {len(records) + len(rank_records)} records to {args.json}")
    return 0


def _print_rank_table(console, records, preset, batch, seq_len) -> None:
    """torch_ref's per-rank records of a run over a mesh (``torch_ref.mesh_memory``): another
    kind of figure than the JAX plans above, so another table."""
    from rich.table import Table

    from jaxmem.figures import format_bytes

    first = records[0]
    table = Table(
        title=f"torch_ref per rank: {preset}, batch {batch} x seq {seq_len} ({first['mesh']}, "
        f"run on CPU processes, {first['precision']})"
    )
    columns = ("framework", "policy", "rank", "params", "grads", "opt state", "runtime peak")
    for col in columns:
        table.add_column(col, justify="left" if col in ("framework", "policy") else "right")
    for r in records:
        table.add_row(
            r["framework"],
            r["policy"],
            str(r["rank"]),
            *(
                format_bytes(r[k])
                for k in ("params_bytes", "grads_bytes", "opt_state_bytes", "peak_bytes")
            ),
        )
    console.print(table)
    console.print(f"  what ran: {first['strategy']}")
    for source in sorted({(r["state_source"], r["peak_source"]) for r in records}):
        console.print(f"  params, grads, opt state = {source[0]}; runtime peak = {source[1]}")
    console.print(
        "  a runtime peak of torch_ref's step, not a compiled plan: compare each framework "
        "against its own one-device figure"
    )


def _print_memory_table(console, records, preset, batch, seq_len, planning, target) -> None:
    from rich.console import Console
    from rich.table import Table

    from jaxmem.figures import format_bytes

    kind = "planned from shapes" if planning else "measured"
    if target.is_gpu:
        kind += f", plans compiled for {target.description}"
    if records[0].get("mesh"):
        kind += f", per device of {records[0]['mesh']}"
    table = Table(
        title=f"memory of one training step: {preset}, batch {batch} x seq {seq_len} "
        f"({kind}, {records[0]['precision']})"
    )
    columns = [
        "framework",
        "policy",
        "saved device",
        "saved host",
        "weight copies",
        "analytic (stack only)",
        "compiled temp",
        "opt state",
        "GFLOP (hw / model)",
        "planned peak",
        "runtime peak",
    ]
    if target.is_gpu:
        columns += ["plan host", f"fits {format_bytes(target.device_memory_bytes)}"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("framework", "policy") else "right")
    for r in records:
        temp = r["compiled_temp_bytes"]
        gpu = ()
        if target.is_gpu:  # torch rows have no plan: nothing to fit
            planned = r.get("fits") is not None
            offload = r.get("state_offload")
            fits = "yes" if r.get("fits") else "no"
            if offload and not r["fits"] and offload["fits_lower"]:
                fits = "if streamed"
            gpu = (
                format_bytes(r["plan_host_bytes"]) if planned else "-",
                fits if planned else "-",
            )
        table.add_row(
            r["framework"],
            r["policy"],
            format_bytes(r["saved_activation_bytes_device"]),
            format_bytes(r["saved_activation_bytes_host"]),
            format_bytes(r["saved_parameter_copy_bytes"]),
            format_bytes(r["analytic_activation_bytes"]),
            "-" if temp is None else format_bytes(temp),
            format_bytes(r["opt_state_bytes"]),
            f"{r['flops'] / 1e9:,.1f} / {r['model_flops'] / 1e9:,.1f}",
            *(
                ("-", "-")
                if r["peak_bytes"] is None
                else (format_bytes(r["peak_bytes"]), "-")
                if r["peak_source"].startswith("compiled plan")
                else ("-", format_bytes(r["peak_bytes"]))
            ),
            *gpu,
        )
    wide = Console(file=console.file, width=max(console.width, 150))
    wide.print(table)
    sources = sorted(
        {(r["framework"], r["saved_source"], r["flops_source"], r["peak_source"]) for r in records}
    )
    wide.print("How each figure was obtained:")
    for fw, saved, flops, peak in sources:
        wide.print(f"  {fw}: saved = {saved}; GFLOP = {flops}; peak = {peak}")
    wide.print(
        "  analytic = jaxmem.memory.analytic (what the block's backward reads, by policy, as JAX "
        "keeps it; stack only); model FLOPs = analytic, no recompute"
    )
    wide.print(
        "  weight copies = slices and compute-dtype casts of parameters the backward keeps (new "
        "memory, not activations: bf16 weight copies, the slices of unequal nested segments); "
        "not included in saved device / host"
    )
    translations = sorted({(r["framework"], r["policy"], r["translation"]) for r in records})
    wide.print(
        "What ran (torch = stock PyTorch; torch-lean = torch_ref's extension, shown where "
        "it differs from stock):"
    )
    for fw, policy, how in translations:
        wide.print(f"  {fw} {policy}: {how}")
    wide.print(
        "  planned peak = a compiled plan (arguments + outputs - aliased + temporaries), runtime "
        "peak = measured while the step ran: different kinds of figure, kept in two columns"
    )
    for r in records:
        if not r["framework"].startswith("torch"):
            continue
        hooks = r["hook_saved_bytes_device"] + r["hook_saved_bytes_host"]
        if hooks != r["saved_activation_bytes_device"] + r["saved_activation_bytes_host"]:
            wide.print(
                f"  {r['framework']} {r['policy']}: saved-tensor hooks see {format_bytes(hooks)} "
                "(blind to what selective checkpointing or the extension keeps itself)"
            )
    wide.print(
        "  process max RSS: "
        f"{format_bytes(max(r['process_max_rss_bytes'] for r in records))} (OS getrusage: the "
        "whole process, host memory, both frameworks and everything before them)"
    )
    for r in records:
        offload = r.get("state_offload")
        if offload:
            wide.print(
                f"  {r['framework']} {r['policy']}: optimizer state in pinned_host, counted "
                f"analytically: {format_bytes(offload['host_bytes'])} in host memory between "
                f"steps; device peak between {format_bytes(offload['device_peak_lower_bytes'])} "
                "(state streamed leaf by leaf) and "
                f"{format_bytes(offload['device_peak_upper_bytes'])} (the planned peak: whole "
                "state brought in for the update); a deviceless compile drops argument memory "
                "kinds, so no plan shows it"
            )
    if planning and any(r["framework"].startswith("torch") for r in records):
        wide.print(
            "  torch rows: torch_ref's step run under FakeTensorMode (no memory, no arithmetic): "
            "what it keeps and its FLOPs are those of any device; it has no compiled plan and no "
            "runtime peak"
            + (f", so the {target.name} plan columns are JAX's only" if target.is_gpu else "")
        )
    if target.is_gpu:
        wide.print(
            f"  plan host = host memory in the {target.name} plan (offloaded residuals); fits = "
            f"planned peak <= the target's {format_bytes(target.device_memory_bytes)} "
            "(jaxmem's check: a deviceless compile never fails for lack of memory; it runs no "
            "autotuning, so GEMM workspaces may differ slightly from a compile on the GPU)"
        )
    _print_differences(wide, records)


def _print_differences(console, records) -> None:
    """Per-tensor differences between JAX and each PyTorch translation, per policy (never
    hidden)."""
    from rich.table import Table

    from jaxmem.figures import format_bytes

    by_policy: dict[str, dict[str, dict]] = {}
    for r in records:
        by_policy.setdefault(r["policy"], {})[r["framework"]] = r
    compared = False
    for policy, group in by_policy.items():
        if "jax" not in group:
            continue
        for fw in sorted(f for f in group if f != "jax"):
            from jaxmem.compare.records import name_differences

            compared = True
            rows = name_differences(group["jax"]["saved_by_name"], group[fw]["saved_by_name"])
            if not rows:
                console.print(f"{policy}: jaxmem and {fw} save the same bytes for every tensor")
                continue
            table = Table(title=f"{policy}: saved tensors that differ (jaxmem vs {fw})")
            for col in ("tensor", "jaxmem", fw, f"{fw} - jax"):
                table.add_column(col, justify="left" if col == "tensor" else "right")
            for row in rows:
                diff = row["torch_bytes"] - row["jax_bytes"]
                table.add_row(
                    row["name"],
                    format_bytes(row["jax_bytes"]),
                    format_bytes(row["torch_bytes"]),
                    ("+" if diff > 0 else "-") + format_bytes(abs(diff)),
                )
            console.print(table)
    if compared:
        console.print(
            "  <untagged>: what jaxmem keeps outside tagged tensors (embedding, final norm, loss); "
            "<op in block / outside the stack>: torch_ref's untagged saved outputs, by op"
        )


# ------------------------------------------------------------------------------------------ bench
def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag} {text!r}: give comma-separated positive integers") from None
    if not values or min(values) <= 0:
        raise UsageError(f"{flag} {text!r}: give comma-separated positive integers")
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    import dataclasses

    need_torch("jaxmem bench")
    from jaxmem.compare.bench import DEFAULT, QUICK, run_sweep, set_threads, usable_cores

    if args.threads is not None and args.threads > usable_cores():
        raise UsageError(
            f"--threads {args.threads}: this process may use {usable_cores()} cores; use at "
            "most that"
        )
    set_threads(args.threads)  # before JAX starts its CPU backend, which sizes its pool then
    need_jax_backend()

    plan = QUICK if args.quick else DEFAULT
    overrides = {
        "preset": args.bench_preset,
        "batch": args.batch_size,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "depths": args.depths and _int_list(args.depths, "--depths"),
        "seq_lens": args.seq_lens and _int_list(args.seq_lens, "--seq-lens"),
        "accum_steps": args.accum and _int_list(args.accum, "--accum"),
        "timed_policies": args.time_policies
        and tuple(_names(args.time_policies, list(POLICIES), "policies")),
        "target": args.target,
    }
    plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v})
    from jaxmem.memory.targets import get_target

    try:
        target = get_target(plan.target)
        if target.is_gpu:
            from jaxmem.memory.gpu_plan import require_gpu_plan

            require_gpu_plan(target)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    try:
        cfg = get_preset(plan.preset)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if plan.preset in PLANNING_ONLY or plan.preset == "seed":
        raise UsageError(
            f"--preset {plan.preset} cannot run both frameworks on this machine; "
            "bench tiny or small (plan large presets with `jaxmem memory`)"
        )
    for seq in (plan.seq_len, *plan.seq_lens):
        if seq > cfg.max_seq_len:
            raise UsageError(
                f"sequence length {seq} exceeds {plan.preset}'s max_seq_len={cfg.max_seq_len}"
            )
    for k in plan.accum_steps:
        if plan.batch % k:
            raise UsageError(
                f"--accum {k} does not divide --batch-size {plan.batch}; "
                "use divisors of the batch size"
            )
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file; give a directory")
    parent = out if os.path.isdir(out) else os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UsageError(f"--out {out}: {parent} is not a writable directory")
    from rich.console import Console

    console = Console()
    result = run_sweep(plan, out, progress=lambda m: console.log(m))
    if result["meta"]["busy_warning"]:
        console.print(f"[yellow]warning: {result['meta']['busy_warning']}[/]")
    console.print(open(os.path.join(out, "sweep.md")).read())
    console.print(
        f"wrote {out}/sweep.json, sweep.md, bytes_per_policy.png, memory_vs_layers.png, "
        f"pareto.png, step_time.png ({result['meta']['device']})"
    )
    return 0


def cmd_seed_example(args: argparse.Namespace) -> int:
    try:
        policy = get_policy(args.policy)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if args.framework == "torch":
        need_torch("jaxmem seed-example --framework torch")
        from jaxmem.compare.seed_example import train

        losses = train("torch", args.steps, policy)
    else:
        need_jax_backend()
        from jaxmem.train.seed_example import train

        losses = train(args.steps, policy=policy)
    for i, loss in enumerate(losses):
        print(f"step {i}: mse {loss:.6f} ({args.framework}, policy {policy.name})")
    return 0


# ----------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jaxmem",
        description="Decide, prove and run the cheapest memory strategy for training a "
        "transformer, in JAX (Flax NNX) and PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"jaxmem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("presets", help="list the model presets")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser(
        "parity",
        help="check that jaxmem and torch_ref give the same loss and gradients (float64 and fp32)",
        description="Build a model from --seed, copy its weights to torch_ref through the "
        "key-and-shape map, and compare logits, loss and every gradient leaf against the "
        "tolerance table (jaxmem.compare.tolerances.TOLERANCES): in float64 (exactness: "
        "rounding cannot hide a bug or flip a ReLU) and in fp32 (the dtype people train in). "
        "Exit 0 when all agree, 1 when not. Needs PyTorch.",
    )
    p.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--batch-size", type=_positive_int, default=4, help="default 4")
    p.add_argument(
        "--seq-len", type=_positive_int, default=None, help="default min(max_seq_len, 32)"
    )
    p.add_argument("--seed", type=_seed, default=0, help="weights and data seed (default 0)")
    p.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default=None,
        help="compare in this dtype only (default: float64, then float32)",
    )
    p.add_argument("--json", metavar="OUT.json", help="write the full report as JSON")
    p.set_defaults(func=cmd_parity)

    p = sub.add_parser(
        "memory",
        help="measure (or plan) the memory of one training step per policy, JAX and PyTorch",
        description="For each policy and framework: parameter, gradient and optimizer-state "
        "bytes, saved activations (device / host), the analytic model, the compiled plan (JAX), "
        "FLOPs and a peak, each labelled with how it was obtained. Planning-only presets are "
        "compiled from shapes (no weights allocated) and torch_ref's step runs on fake tensors "
        "(shapes only); --target compiles the plan for a GPU without one (XLA:CPU's plan is far "
        "from a GPU's).",
    )
    p.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--policies", default="none,full,selective,offload", help="comma-separated")
    p.add_argument(
        "--frameworks",
        default=None,
        help="jax, torch (stock PyTorch) and torch-lean (torch_ref's extension, where it differs "
        "from stock), comma-separated (default all three; jax alone without PyTorch)",
    )
    p.add_argument("--precision", default="fp32", help=f"one of {', '.join(PRECISIONS)}")
    p.add_argument("--optimizer", default="adamw", help="adamw, sgd or adafactor")
    p.add_argument(
        "--attention",
        default=None,
        help="the attention core: naive (materialises [B, H, S, S]; the presets' default) or "
        "fused (FlashAttention's algorithm in both frameworks)",
    )
    p.add_argument(
        "--state-memory",
        default="device",
        help="where the optimizer state lives between steps: device (default) or pinned_host "
        "(JAX; under a GPU --target counted analytically, see the notes)",
    )
    p.add_argument("--batch-size", type=_positive_int, default=8, help="default 8")
    p.add_argument(
        "--seq-len",
        type=_positive_int,
        default=None,
        help="default 64 (max_seq_len for planning presets)",
    )
    p.add_argument(
        "--target",
        default="cpu",
        help="compile the JAX plan for: cpu (the local backend, default), h100, a100-40gb, "
        "a100-80gb (XLA:CUDA without a GPU; needs jaxmem[gpu-plan]) or a .txtpb target file",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="plan the step sharded over devices, STRATEGY=N (dp, zero1, fsdp; e.g. fsdp=8): "
        "per-device records, on N CPU devices or one host of N GPUs of --target",
    )
    p.add_argument(
        "--unroll",
        action="store_true",
        help="JAX: plan the blocks unrolled instead of under one scan (torch_ref runs its blocks "
        "one by one anyway); XLA:CPU drops remat when unrolled, a GPU --target keeps it",
    )
    p.add_argument("--json", metavar="OUT.json", help="write the records as a JSON list")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser(
        "capture-target",
        help="on a GPU machine: write its XLA target config, for --target FILE elsewhere",
        description="Writes the GpuTargetConfig of this machine's first GPU (what XLA compiles "
        "for) as a text file; `jaxmem memory --target FILE` then plans for that GPU on any "
        "machine with jaxmem[gpu-plan]. Needs a CUDA GPU visible to JAX.",
    )
    p.add_argument("--out", required=True, metavar="FILE.txtpb", help="where to write it")
    p.set_defaults(func=cmd_capture_target)

    p = sub.add_parser(
        "bench",
        help="sweep policies x precision, depth, sequence length, accumulation and step time "
        "in both frameworks; JSON, Markdown and PNG plots",
        description="The cross-framework benchmark: saved activation bytes (device + host), "
        "matmul FLOPs executed and JAX's compiled plan per policy x precision, depth, sequence "
        "length and accumulation, and median step time per policy (interleaved runs, compile "
        "and warm-up excluded), jaxmem vs torch_ref on the same weights and batches. Default: "
        "around `small` (4 min 18-40 s on 2 busy CPU cores); --quick: `tiny` (73 s).",
    )
    p.add_argument(
        "--preset",
        dest="bench_preset",
        default=None,
        help="tiny or small (default small; quick: tiny)",
    )
    p.add_argument("--quick", action="store_true", help="the tiny plan (fewer points, 3 repeats)")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="default 8 (quick 4)")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="default 128 (quick 32)")
    p.add_argument("--depths", default=None, help="layer counts, e.g. 2,4,8,12")
    p.add_argument("--seq-lens", default=None, help="sequence lengths, e.g. 64,128,256")
    p.add_argument("--accum", default=None, help="microbatch counts, e.g. 1,2,4")
    p.add_argument(
        "--time-policies",
        default=None,
        help="policies to time (default none,selective,full,offload,nested)",
    )
    p.add_argument("--repeats", type=_positive_int, default=None, help="timed runs (default 10)")
    p.add_argument(
        "--target",
        default=None,
        help="compile the depth axis's JAX plans for: cpu (the local backend, default), h100, "
        "a100-40gb, a100-80gb (without a GPU; needs jaxmem[gpu-plan]) or a .txtpb target file",
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="threads for both frameworks: PyTorch's pool and the CPU affinity XLA sizes its "
        "pool by (default: every usable core)",
    )
    p.add_argument(
        "--out", default="bench-results", help="output directory (default bench-results)"
    )
    p.set_defaults(func=cmd_bench)

    _train_parser(sub)

    p = sub.add_parser(
        "prepare",
        help="tokenize text into nanoGPT-style uint16 train.bin / val.bin for --data",
        description="Byte-tokenize a text file or a directory of text files (or, with no "
        "source, the embedded Python-stdlib corpus) into train.bin and val.bin (raw little-endian "
        "uint16, nanoGPT's format) plus meta.json; the last --val-fraction is validation data. "
        "Existing files are never overwritten.",
    )
    p.add_argument(
        "source",
        nargs="?",
        default=None,
        help="text file or directory (default: the embedded corpus)",
    )
    p.add_argument("--out", required=True, help="directory for train.bin, val.bin, meta.json")
    p.add_argument("--val-fraction", type=_positive_float, default=0.05, help="default 0.05")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "seed-example",
        help="the seeds' training example (one post-norm ReLU layer, MSE, Adam) in JAX or torch",
        description="The write-ups' example (shared/seeds/003): one post-norm ReLU decoder layer "
        "(d_model 512, 8 heads, d_ff 2048, no causal mask) on a fixed random [32, 64, 512] "
        "input, MSE against a fixed random target, Adam at lr 1e-4, under a memory policy.",
    )
    p.add_argument("--framework", choices=FRAMEWORKS, default="jax", help="default jax")
    p.add_argument("--steps", type=_positive_int, default=5, help="Adam steps (default 5)")
    p.add_argument("--policy", default="none", help=f"one of {', '.join(POLICIES)}")
    p.set_defaults(func=cmd_seed_example)

    p = sub.add_parser(
        "plan",
        help="the cheapest training configuration that fits a memory budget, proved by "
        "compiling it for the target",
        description="Searches the stack's memory policy (presets, and the first k blocks under "
        "one preset with the rest under another), the microbatch count, optimizer-state offload "
        "(GPU targets), the data-parallel strategy (with --mesh) and, when allowed, the "
        "precision; predicts each candidate's bytes from a few compiles, then compiles "
        "candidates for --target in order of estimated cost until one fits --budget. Exit 2 "
        "when nothing fits, naming the smallest plan found.",
    )
    p.add_argument("--preset", default="small", help=f"one of {', '.join(PRESETS)} (default small)")
    p.add_argument("--target", default="cpu", help=TARGET_HELP)
    p.add_argument(
        "--budget",
        default=None,
        help="bytes per device, e.g. 70GiB or 200MiB (default for a GPU target: 90%% of its "
        "memory; required for cpu)",
    )
    p.add_argument("--batch-size", type=_positive_int, default=8, help="global batch (default 8)")
    p.add_argument(
        "--seq-len", type=_positive_int, default=None, help="default the preset's max_seq_len"
    )
    p.add_argument("--optimizer", default="adamw", help="adamw, sgd or adafactor")
    p.add_argument(
        "--mesh",
        default=None,
        help="N devices as STRATEGY=N (e.g. fsdp=8): every strategy of --strategies is "
        "searched over them (N CPU devices, or one host of N GPUs of --target)",
    )
    p.add_argument("--strategies", default="dp,zero1,fsdp", help="with --mesh (default all)")
    p.add_argument(
        "--policies",
        default="none,selective,mlp,offload,full,nested",
        help="presets searched (default all; offload only on GPU targets: XLA:CPU erases it)",
    )
    p.add_argument(
        "--no-mix",
        dest="mix",
        action="store_false",
        help="only whole-stack presets (default: also k blocks under one preset, the rest "
        "under another)",
    )
    p.add_argument("--accum", default="1,2,4,8", help="microbatch counts (default 1,2,4,8)")
    p.add_argument(
        "--state-offload",
        action="store_true",
        help="also search optimizer state in pinned_host (GPU targets; counted as the plan "
        "minus the state: a deviceless compile drops argument memory kinds)",
    )
    p.add_argument(
        "--precisions",
        default="fp32",
        help=f"precisions the search may choose ({', '.join(PRECISIONS)}; default fp32 only: "
        "precision changes the numbers, so only when you allow it)",
    )
    p.add_argument(
        "--slack",
        type=_positive_float,
        default=0.20,
        help="compile a candidate predicted over the budget by at most this fraction (default "
        "0.20: the memory model's measured error on mixed stacks)",
    )
    p.add_argument(
        "--max-compiles", type=_positive_int, default=40, help="candidates compiled at most"
    )
    p.add_argument("--top", type=_positive_int, default=15, help="rows shown (default 15)")
    p.add_argument("--json", metavar="OUT.json", help="write the plan and its candidates")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "peak",
        help="what is live at the peak of a train step's compiled memory plan, and what made it",
        description="Compiles one train step for --target (the local backend, or a GPU without "
        "one) with XLA's buffer-assignment dump on, finds the position in the scheduled program "
        "where the device memory its live buffers cover is largest, and lists those buffers "
        "with the JAX operation that made each (forward activation kept for the backward, "
        "recomputation, backward buffer, argument). A compiled plan's own figures, labelled so.",
    )
    p.add_argument("--preset", default="small", help=f"one of {', '.join(PRESETS)} (default small)")
    p.add_argument(
        "--policy",
        default="none",
        help=f"a preset ({', '.join(POLICIES)}) or HEAD:K+REST as `jaxmem plan` prints it",
    )
    p.add_argument("--unroll", action="store_true", help="the blocks unrolled, not scanned")
    p.add_argument("--precision", default="fp32", help=f"one of {', '.join(PRECISIONS)}")
    p.add_argument("--optimizer", default="adamw", help="adamw, sgd or adafactor")
    p.add_argument("--attention", default=None, help="naive (default) or fused")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="default 8")
    p.add_argument(
        "--seq-len", type=_positive_int, default=None, help="default the preset's max_seq_len"
    )
    p.add_argument("--accum", type=_positive_int, default=1, help="microbatches (default 1)")
    p.add_argument("--target", default="cpu", help=TARGET_HELP)
    p.add_argument(
        "--mesh",
        default=None,
        help="the step sharded over devices, STRATEGY=N (dp, zero1, fsdp; e.g. fsdp=8): what "
        "one device holds at its peak (N CPU devices, or one host of N GPUs of --target)",
    )
    p.add_argument("--top", type=_positive_int, default=25, help="groups listed (default 25)")
    p.add_argument("--json", metavar="OUT.json", help="write the report")
    p.set_defaults(func=cmd_peak)

    p = sub.add_parser(
        "plot",
        help="loss curves of several runs (e.g. --framework jax and torch) on one plot",
    )
    p.add_argument("runs", nargs="+", help="run directories written by jaxmem train --out")
    p.add_argument("--out", default="loss_curves.png", help="PNG path (default loss_curves.png)")
    p.set_defaults(func=cmd_plot)
    return parser


def _train_parser(sub) -> None:
    from jaxmem.train.job import RunConfig

    run = RunConfig()
    opt = OptimizerConfig()
    p = sub.add_parser(
        "train",
        help="train a preset (JAX or torch_ref) with checkpoints, metrics, plots and a sample",
        description="Train a decoder preset on the embedded corpus (the Python standard "
        "library's sources, byte tokens) or your --data, under a memory policy, precision and "
        "accumulation; checkpoints every --checkpoint-every steps (orbax for JAX) and --resume "
        "continues a run exactly. Settings come from the defaults, the preset, --config "
        "(TOML/YAML, sections as in the run's config.yaml) and these flags, in that order; "
        "--set section.key=value reaches every other setting. Bad input exits with code 2 "
        "before anything is written; a run stopped by a non-finite loss or out of memory exits "
        "with code 1.",
        epilog="presets: "
        + ", ".join(n for n in PRESETS if PRESETS[n].causal)
        + f"; policies: {', '.join(POLICIES)}; precisions: {', '.join(PRECISIONS)}; "
        "tags for --save/--offload: " + ", ".join(CHECKPOINT_NAMES),
    )
    a = p.add_argument
    a("--config", help="TOML or YAML file of settings (a run's config.yaml repeats it)")
    a(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="any setting, e.g. --set model.norm=post --set optimizer.b2=0.95 (repeatable)",
    )
    a(
        "--out",
        default=None,
        help="run directory: config.yaml, metrics.jsonl, loss.png, "
        "summary.json, sample.txt, checkpoints/ (default: nothing written)",
    )
    a("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    a(
        "--target",
        default=None,
        help="also plan this very train step for a GPU (h100, a100-40gb, a100-80gb or a .txtpb "
        "file; needs jaxmem[gpu-plan]) and print that plan beside this machine's (JAX)",
    )
    a(
        "--framework",
        choices=FRAMEWORKS,
        default=None,
        help="jax (jaxmem) or torch (torch_ref, same weights and data; needs PyTorch) "
        "(default jax)",
    )
    a("--preset", default=None, help="model preset (default small)")
    a("--n-layers", type=_positive_int, default=None, help="override the preset's layer count")
    a("--d-model", type=_positive_int, default=None, help="override the preset's width")
    a("--n-heads", type=_positive_int, default=None, help="override the preset's heads")
    a("--d-ff", type=_positive_int, default=None, help="override the preset's MLP width")
    a(
        "--policy",
        default=None,
        help=f"memory policy: {', '.join(POLICIES)}, custom, or auto (jaxmem plan on this "
        "device under --memory-budget chooses the policy and --accum) (default none)",
    )
    a(
        "--memory-budget",
        default=None,
        help="with --policy auto: bytes the step may plan per device, e.g. 2GiB",
    )
    a("--save", default=None, help="custom policy: tags kept in device memory, comma-separated")
    a("--offload", default=None, help="custom policy: tags sent to host memory, comma-separated")
    a(
        "--mesh",
        default=None,
        help="data-parallel strategy over devices, STRATEGY=N: dp=4 (replicated), zero1=4 "
        "(optimizer state sharded), fsdp=4 (parameters, gradients and state sharded); on a CPU "
        "JAX is given N CPU devices",
    )
    a(
        "--coordinator",
        default=None,
        help="multi-process (JAX): HOST:PORT of process 0 (default $JAX_COORDINATOR_ADDRESS)",
    )
    a(
        "--num-processes",
        type=_positive_int,
        default=None,
        help="multi-process (JAX): how many processes run this job (default $JAX_NUM_PROCESSES "
        "or 1); --mesh spans all their devices",
    )
    a(
        "--process-id",
        type=int,
        default=None,
        help="multi-process (JAX): this process's index, 0 owns the run directory (default "
        "$JAX_PROCESS_ID or 0)",
    )
    a(
        "--unroll",
        action="store_const",
        const=True,
        default=None,
        help="JAX: run the blocks unrolled instead of under one scan (frees each block's "
        "residuals after its backward; slower to compile; XLA:CPU drops remat when unrolled)",
    )
    a("--precision", default=None, help=f"one of {', '.join(PRECISIONS)} (default fp32)")
    a("--accum", type=_positive_int, default=None, help="microbatches per step (default 1)")
    a("--accum-mode", default=None, help="scan or multisteps (default scan)")
    a("--optimizer", default=None, help=f"adamw, sgd or adafactor (default {opt.name})")
    a("--lr", type=_positive_float, default=None, help=f"learning rate (default {opt.lr})")
    a("--weight-decay", type=float, default=None, help=f"default {opt.weight_decay}")
    a(
        "--data",
        default=None,
        help="text file, directory of text, or nanoGPT .bin / directory "
        "with train.bin (default: the embedded stdlib corpus)",
    )
    a("--steps", type=_positive_int, default=None, help=f"default {run.steps}")
    a("--batch-size", type=_positive_int, default=None, help=f"default {run.batch_size}")
    a("--seq-len", type=_positive_int, default=None, help=f"default {run.seq_len}")
    a("--seed", type=_seed, default=None, help=f"weights and data order (default {run.seed})")
    a("--eval-every", type=_positive_int, default=None, help=f"default {run.eval_every}")
    a(
        "--checkpoint-every",
        type=_positive_int,
        default=None,
        help=f"default {run.checkpoint_every}",
    )
    a(
        "--keep",
        type=_positive_int,
        default=None,
        help=f"checkpoints kept (default {run.keep_checkpoints})",
    )
    a(
        "--sample-tokens",
        type=int,
        default=None,
        help=f"text sample length at the end (default {run.sample_tokens}; 0: none)",
    )
    a("--prompt", default=None, help=f"sample prompt (default {run.prompt!r})")
    p.set_defaults(func=cmd_train)


def main(argv: Sequence[str] | None = None) -> int:
    from jaxmem.backend import contain_cuda_plugin

    contain_cuda_plugin()  # before JAX starts (it starts lazily, in the commands)
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "preset") and args.command != "train":  # train resolves its own config
        args.preset_name = args.preset
        try:
            args.preset = get_preset(args.preset)
        except ConfigError as e:
            parser.exit(EXIT_USAGE, f"jaxmem {args.command}: error: {e}\n")
    try:
        code = args.func(args) or 0
    except UsageError as e:
        message = f"jaxmem {args.command}: error: {e}\n"
        _end_torch_worker(EXIT_USAGE, message)
        parser.exit(EXIT_USAGE, message)
    _end_torch_worker(code)
    return code


def _end_torch_worker(code: int, message: str = "") -> None:
    """A torch run that joined torchrun's process group ends here (``end_worker``: the
    interpreter's teardown would free gloo's groups under its threads); others return."""
    distributed = sys.modules.get("torch_ref.distributed")  # imported only by torch runs
    if distributed is None or not distributed.joined():
        return
    sys.stderr.write(message)
    distributed.end_worker(code)


if __name__ == "__main__":
    sys.exit(main())

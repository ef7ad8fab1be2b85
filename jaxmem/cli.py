"""The ``jaxmem`` command line. The only module that parses flags.

Bad input gets one line on stderr naming the value and the fix, and exit code 2; nothing is
written before the input has been validated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from jaxmem.config import (
    PLANNING_ONLY,
    PRESETS,
    AccumConfig,
    ConfigError,
    ModelConfig,
    OptimizerConfig,
    get_preset,
)
from jaxmem.precision import PRECISIONS, get_precision
from jaxmem.remat import POLICIES, check_backend, get_policy

EXIT_USAGE = 2
EXIT_PARITY_FAILED = 1


class UsageError(Exception):
    """Bad user input: reported as one line, exit code 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _check_writable_json(path: str | None) -> None:
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"--json {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--json {path}: directory {parent} is not writable")


def _write_json_atomic(path: str, payload: object) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------- presets
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
            "planning" if name in PLANNING_ONLY else "train",
        )
    console = Console()
    Console(width=max(console.width, 100)).print(table)  # never wrap the columns
    return 0


# ----------------------------------------------------------------------------------------- parity
def cmd_parity(args: argparse.Namespace) -> int:
    cfg: ModelConfig = args.preset
    seq_len = args.seq_len or min(cfg.max_seq_len, 32)
    if seq_len > cfg.max_seq_len:
        raise UsageError(
            f"--seq-len {seq_len} exceeds the preset's max_seq_len={cfg.max_seq_len}; "
            f"use at most {cfg.max_seq_len}"
        )
    if cfg.n_params > 50_000_000:
        raise UsageError(
            f"--preset {args.preset_name} has {cfg.n_params / 1e6:.0f} M parameters; parity "
            "runs both frameworks in fp32 on this machine: use tiny, small or seed"
        )
    _check_writable_json(args.json)
    from jaxmem.parity import run_parity

    report = run_parity(cfg, batch=args.batch_size, seq_len=seq_len, seed=args.seed)
    report["preset"] = args.preset_name
    if args.json:
        _write_json_atomic(args.json, report)
    verdict = "PASSED" if report["passed"] else "FAILED"
    print(
        f"parity {verdict} ({args.preset_name}, fp32, batch {args.batch_size}, seq {seq_len}): "
        f"loss jax {report['loss_jax']:.7f} torch {report['loss_torch']:.7f}; "
        f"max |grad diff| {report['max_abs_grad_diff']:.3e}, "
        f"max normwise rel {report['max_rel_grad_diff']:.3e} over {report['n_grad_leaves']} "
        f"gradient leaves (tolerance rtol={report['tolerances']['grads']['rtol']}, "
        f"atol={report['tolerances']['grads']['atol']})"
    )
    if not report["passed"]:
        print(f"failing gradient leaves: {report['failed_grad_leaves']}", file=sys.stderr)
    return 0 if report["passed"] else EXIT_PARITY_FAILED


# ------------------------------------------------------------------------------------------ train
def cmd_train(args: argparse.Namespace) -> int:
    cfg: ModelConfig = args.preset
    if args.preset_name == "seed":
        raise UsageError(
            "--preset seed is the seeds' single layer (run `python -m jaxmem.seed_example`); "
            "train an LM preset such as tiny or small"
        )
    if args.preset_name in PLANNING_ONLY:
        raise UsageError(
            f"--preset {args.preset_name} is a planning-only shape "
            f"({cfg.n_params / 1e6:,.0f} M parameters); train tiny or small on this machine"
        )
    args.seq_len = args.seq_len or min(128, cfg.max_seq_len)
    if args.seq_len > cfg.max_seq_len:
        raise UsageError(
            f"--seq-len {args.seq_len} exceeds the preset's max_seq_len={cfg.max_seq_len}; "
            f"use at most {cfg.max_seq_len}"
        )
    try:
        opt_cfg = OptimizerConfig(name=args.optimizer, lr=args.lr, weight_decay=args.weight_decay)
        policy = get_policy(args.policy)
        check_backend(policy)
        precision = get_precision(args.precision)
        accum = AccumConfig(steps=args.accum)
        accum.check_batch(args.batch_size)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if args.out is not None:
        if os.path.exists(args.out) and os.listdir(args.out):
            raise UsageError(f"--out {args.out} exists and is not empty; choose a new directory")
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.access(parent, os.W_OK):
            raise UsageError(f"--out {args.out}: {parent} is not writable")
    from jaxmem.run import run_training

    run_training(
        cfg,
        opt_cfg,
        policy=policy,
        precision=precision,
        accum=accum,
        preset_name=args.preset_name,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        eval_every=args.eval_every,
        out_dir=args.out,
    )
    return 0


# ----------------------------------------------------------------------------------------- memory
FRAMEWORKS = ("jax", "torch")


def _names(text: str, valid: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise UsageError(f"unknown {what} {bad or [text]}; choose from: {', '.join(valid)}")
    return names


def cmd_memory(args: argparse.Namespace) -> int:
    cfg: ModelConfig = args.preset
    policies = _names(args.policies, list(POLICIES), "policies")
    frameworks = _names(args.frameworks, FRAMEWORKS, "frameworks")
    try:
        precision = get_precision(args.precision)
        opt_cfg = OptimizerConfig(name=args.optimizer)
        for name in policies:
            check_backend(get_policy(name))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if args.preset_name == "seed":
        raise UsageError("--preset seed is a single block, not an LM; use tiny, small or gpt2-*")
    planning = args.preset_name in PLANNING_ONLY
    seq_len = args.seq_len or (cfg.max_seq_len if planning else min(64, cfg.max_seq_len))
    if seq_len > cfg.max_seq_len:
        raise UsageError(
            f"--seq-len {seq_len} exceeds the preset's max_seq_len={cfg.max_seq_len}; "
            f"use at most {cfg.max_seq_len}"
        )
    _check_writable_json(args.json)
    from rich.console import Console

    from jaxmem.report import jax_record, torch_record

    console = Console()
    if planning and "torch" in frameworks:
        console.print(
            f"[yellow]{args.preset_name} is planning-only: torch_ref needs real weights, so only "
            "the JAX plan (compiled from shapes, no weights allocated) is reported.[/]"
        )
        frameworks = [f for f in frameworks if f != "torch"]
    records = []
    for name in policies:
        policy = get_policy(name)
        for fw in frameworks:
            if fw == "jax":
                rec = jax_record(
                    cfg, policy, precision, opt_cfg, args.batch_size, seq_len, abstract=planning
                )
            else:
                rec = torch_record(cfg, policy, precision, opt_cfg, args.batch_size, seq_len)
            rec["preset"] = args.preset_name
            records.append(rec)
    _print_memory_table(console, records, args.preset_name, args.batch_size, seq_len, planning)
    if args.json:
        _write_json_atomic(args.json, records)
        console.print(f"wrote {len(records)} records to {args.json}")
    return 0


def _print_memory_table(console, records, preset, batch, seq_len, planning) -> None:
    from rich.console import Console
    from rich.table import Table

    from jaxmem.memory import format_bytes

    kind = "planned from shapes" if planning else "measured"
    table = Table(
        title=f"memory of one training step: {preset}, batch {batch} x seq {seq_len} "
        f"({kind}, {records[0]['precision']})"
    )
    for col in (
        "framework",
        "policy",
        "saved device",
        "saved host",
        "analytic",
        "compiled temp",
        "opt state",
        "GFLOP (hw / model)",
        "peak",
    ):
        table.add_column(col, justify="left" if col in ("framework", "policy") else "right")
    for r in records:
        temp = r["compiled_temp_bytes"]
        table.add_row(
            r["framework"],
            r["policy"],
            format_bytes(r["saved_activation_bytes_device"]),
            format_bytes(r["saved_activation_bytes_host"]),
            format_bytes(r["analytic_activation_bytes"]),
            "-" if temp is None else format_bytes(temp),
            format_bytes(r["opt_state_bytes"]),
            f"{r['flops'] / 1e9:,.1f} / {r['model_flops'] / 1e9:,.1f}",
            format_bytes(r["peak_bytes"]),
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
        "  analytic = jaxmem.analytic (the block's backward reads, by policy; stack only); "
        "model FLOPs = analytic, no recompute"
    )


# ----------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxmem",
        description="Decide, prove and run the cheapest memory strategy for training a "
        "transformer, in JAX (Flax NNX) and PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("presets", help="list the model presets")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser(
        "parity",
        help="check that jaxmem and torch_ref give the same loss and gradients (fp32)",
        description="Build a model from --seed, copy its weights to torch_ref through the "
        "key-and-shape map, and compare logits, loss and every gradient leaf in fp32 against "
        "the tolerance table (jaxmem.parity.TOLERANCES). Exit 0 when all agree, 1 when not.",
    )
    p.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--batch-size", type=_positive_int, default=4, help="default 4")
    p.add_argument(
        "--seq-len", type=_positive_int, default=None, help="default min(max_seq_len, 32)"
    )
    p.add_argument("--seed", type=int, default=0, help="weights and data seed (default 0)")
    p.add_argument("--json", metavar="OUT.json", help="write the full report as JSON")
    p.set_defaults(func=cmd_parity)

    p = sub.add_parser(
        "memory",
        help="measure (or plan) the memory of one training step per policy, JAX and PyTorch",
        description="For each policy and framework: parameter, gradient and optimizer-state "
        "bytes, saved activations (device / host), the analytic model, the compiled plan (JAX), "
        "FLOPs and a peak, each labelled with how it was obtained. Planning-only presets are "
        "compiled from shapes (no weights allocated); a CPU plan is a proxy for a GPU's.",
    )
    p.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--policies", default="none,full,selective,offload", help="comma-separated")
    p.add_argument("--frameworks", default="jax,torch", help="jax,torch (default both)")
    p.add_argument("--precision", default="fp32", help=f"one of {', '.join(PRECISIONS)}")
    p.add_argument("--optimizer", default="adamw", help="adamw, sgd or adafactor")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="default 8")
    p.add_argument(
        "--seq-len",
        type=_positive_int,
        default=None,
        help="default 64 (max_seq_len for planning presets)",
    )
    p.add_argument("--json", metavar="OUT.json", help="write the records as a JSON list")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser(
        "train",
        help="train a preset on the embedded corpus and print its memory table",
        description="Train a decoder preset with AdamW on the embedded corpus (the Python "
        "standard library's sources, byte-level tokens) and print a memory table whose every "
        "figure says how it was obtained.",
    )
    p.add_argument("--preset", default="small", help="tiny or small (default small)")
    p.add_argument("--steps", type=_positive_int, default=200, help="default 200")
    p.add_argument("--batch-size", type=_positive_int, default=16, help="default 16")
    p.add_argument(
        "--seq-len", type=_positive_int, default=None, help="default min(128, max_seq_len)"
    )
    p.add_argument(
        "--policy",
        default="none",
        help=f"memory policy: {', '.join(POLICIES)} (default none)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        help=f"one of {', '.join(PRECISIONS)} (default fp32)",
    )
    p.add_argument(
        "--accum", type=_positive_int, default=1, help="microbatches per step (default 1)"
    )
    p.add_argument("--optimizer", default="adamw", help="adamw, sgd or adafactor (default adamw)")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="default 0.1")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    p.add_argument(
        "--eval-every", type=_positive_int, default=100, help="validation interval (default 100)"
    )
    p.add_argument(
        "--out", default=None, help="new directory for metrics.jsonl, memory.json, weights"
    )
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "preset"):
        args.preset_name = args.preset
        try:
            args.preset = get_preset(args.preset)
        except ConfigError as e:
            parser.exit(EXIT_USAGE, f"jaxmem {args.command}: error: {e}\n")
    try:
        return args.func(args)
    except UsageError as e:
        parser.exit(EXIT_USAGE, f"jaxmem {args.command}: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

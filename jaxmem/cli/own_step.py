"""``--fn MODULE:FUNCTION`` for ``jaxmem memory`` and ``jaxmem peak``: jaxmem's memory tools
(``jaxmem.memory.tools``) on a user's own JAX step, without writing a script.

The entry point is a function returning a ``jaxmem.memory.tools.Step`` (or a ``(fn, args)``
pair). Given ``--policies`` (memory) or ``--policy`` (peak), it is called as
``FUNCTION(policy=NAME)`` for each name, and applies that policy to its own model however it
likes (``TagPolicy.preset(NAME, its_tag_map)`` is the short way)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jaxmem.cli.render as render
from jaxmem.cli.common import (
    UsageError,
    check_writable,
    need_gpu_plan,
    need_jax_backend,
    usage_errors,
)
from jaxmem.config import ConfigError
from jaxmem.figures import format_bytes
from jaxmem.files import write_json_atomic

FN_HELP = (
    "measure your own JAX step instead of jaxmem's decoder: MODULE:FUNCTION (importable from "
    "here) or FILE.py:FUNCTION, a function returning a jaxmem.memory.tools.Step (or (fn, args))"
)


def add_fn_flag(parser: argparse.ArgumentParser, policy_flag: str) -> None:
    parser.add_argument(
        "--fn",
        metavar="MODULE:FUNCTION",
        default=None,
        help=f"{FN_HELP}; with {policy_flag} it is called with policy=NAME (each name is yours "
        "to interpret); the step flags do not apply",
    )


def refuse_step_flags(
    args: argparse.Namespace, names: Sequence[str], allowed: Sequence[str]
) -> None:
    given = [
        "--" + n.replace("_", "-")
        for n in names
        if n not in allowed and getattr(args, n, None) not in (None, [], ())
    ]
    if given:
        raise UsageError(
            f"--fn measures your own function: {', '.join(given)} describe jaxmem's decoder and do "
            "not apply (set sizes in your entry point)"
        )


def load_entry(text: str) -> Callable[..., Any]:
    """The function ``MODULE:FUNCTION`` or ``FILE.py:FUNCTION`` names; a usage error otherwise.
    JAX's backend is started first, quietly, as for jaxmem's own runs: a module that uses JAX
    on import then prints none of the CUDA plugin's start-up lines."""
    where, sep, attr = text.rpartition(":")
    if not sep or not where or not attr:
        raise UsageError(f"--fn {text!r} must be MODULE:FUNCTION or FILE.py:FUNCTION")
    is_file = where.endswith(".py") or os.sep in where
    if is_file and not os.path.isfile(where):
        raise UsageError(f"--fn {text}: no such file {where}")
    need_jax_backend()
    with user_code(text, f"importing {where}", raised="failed:"):
        if is_file:
            name = os.path.splitext(os.path.basename(where))[0]
            spec = importlib.util.spec_from_file_location(name, where)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # as an import would (dataclasses look it up)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # as `python -m` would: the current directory first
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    entry = getattr(module, attr, None)
    if entry is None or not callable(entry):
        found = "has no" if entry is None else "has a non-callable"
        raise UsageError(f"--fn {text}: {where} {found} {attr!r}")
    return entry


@contextlib.contextmanager
def user_code(text: str, doing: str, raised: str = "raised") -> Iterator[None]:
    """Run a piece of the user's code (importing the module, calling the entry point, tracing
    the step): an exception it raises, or ``sys.exit``, is one usage error naming the user's
    file and line. Ctrl-C still interrupts."""
    try:
        yield
    except UsageError:
        raise
    except SystemExit as e:
        code = e.code if e.code is not None else 0
        hint = (
            "a module --fn imports must not exit: keep a script's own run under "
            "if __name__ == '__main__'"
            if doing.startswith("importing")
            else "an entry point returns a step and must not exit"
        )
        raise UsageError(
            f"--fn {text}: {doing} exited (sys.exit({code!r}){_where(e)}); {hint}"
        ) from None
    except ConfigError as e:  # jaxmem's own check (tools.StepError among them), with its cause
        at = _where(e.__cause__) if e.__cause__ is not None else ""
        raise UsageError(f"--fn {text}: {e}{at}") from None
    except Exception as e:  # the user's code failed: one line, its own error and where
        raise UsageError(f"--fn {text}: {doing} {raised} {_line(e)}{_where(e)}") from None


def _where(e: BaseException) -> str:
    """`` at FILE:LINE``: the innermost place in the user's own code (not the standard library,
    installed packages or jaxmem) that raised ``e``; empty when there is none."""
    if isinstance(e, SyntaxError):  # its message names the file and line already
        return ""
    skip = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    skip.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # jaxmem itself
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if not f.filename.startswith("<")
        and not any(os.path.abspath(f.filename).startswith(d + os.sep) for d in skip)
    ]
    return f" at {_short(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def _short(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def call_entry(entry: Callable[..., Any], text: str, policy: str | None):
    """The ``Step`` ``entry`` returns (called with ``policy=`` when one is named)."""
    from jaxmem.memory.tools import Step

    if policy is not None:
        try:
            takes = "policy" in inspect.signature(entry).parameters
        except (TypeError, ValueError):
            takes = True
        if not takes:
            raise UsageError(
                f"--fn {text}: {entry.__name__}() takes no policy argument; give it a policy "
                "parameter or leave out --policies/--policy"
            )
    with user_code(text, f"{entry.__name__}()"):
        result = entry(policy=policy) if policy is not None else entry()
    if isinstance(result, Step):
        return result
    if isinstance(result, tuple) and len(result) == 2 and callable(result[0]):
        with usage_errors():
            return Step(fn=result[0], args=tuple(result[1]))
    raise UsageError(
        f"--fn {text}: {entry.__name__}() returned {type(result).__name__}; return a "
        "jaxmem.memory.tools.Step or (fn, args)"
    )


def _target(args: argparse.Namespace):
    from jaxmem.memory.tools import _get_target

    with usage_errors():
        target = _get_target(args.target or "cpu")
    if target.is_gpu:
        need_gpu_plan(target)
    return target


# ---------------------------------------------------------------------------------- memory
def memory(args: argparse.Namespace, names: Sequence[str]) -> int:
    from jaxmem.memory import tools

    refuse_step_flags(args, names, allowed=())
    if args.frameworks not in (None, "jax"):
        raise UsageError("--fn measures a JAX function: --frameworks takes jax only")
    entry = load_entry(args.fn)
    target = _target(args)
    check_writable(args.json)
    policies: list[str | None] = [None]
    if args.policies is not None:
        policies = list(dict.fromkeys(n.strip() for n in args.policies.split(",") if n.strip()))
        if not policies:
            raise UsageError(f"--policies {args.policies!r}: give at least one name")
    rows = []
    for name in policies:
        step = call_entry(entry, args.fn, name)
        with user_code(args.fn, "measuring the step"):
            plan = tools.plan(step.fn, *step.args, target=target, **step.compile_kwargs())
            flops = tools.matmul_flops(step.fn, *step.args, static_argnums=step.static_argnums)
            kept = tools.residuals(step.loss, *step.loss_args) if step.loss else None
        rows.append(_row(name, plan, flops, kept))
    out = render.console()
    out.print(
        f"jaxmem memory --fn {args.fn}: compiled plans for {target.compiler()}"
        + (", per device" if rows[0]["plan"]["devices"] > 1 else "")
    )
    _memory_tables(out, rows, target)
    if args.json:
        write_json_atomic(args.json, rows)
        out.print(f"wrote {len(rows)} records to {args.json}", style="dim")
    return 0


def _row(name: str | None, plan, flops: int, kept) -> dict[str, Any]:
    return {
        "policy": name,
        "plan": plan.to_dict(),
        "matmul_flops": flops,
        "flops_source": "jaxpr count of the function (matmuls, recomputation included)",
        "residuals": None
        if kept is None
        else {
            "device_bytes": kept.device_bytes,
            "host_bytes": kept.host_bytes,
            "by_tag": kept.by_tag,
            "figure": kept.figure,
        },
    }


def _memory_tables(out, rows: list[dict], target) -> None:
    t = render.table(
        "saved: residual accounting; GFLOP: jaxpr count; temp, peak: compiled plan",
        ("policy", "saved device", "saved host", "GFLOP", "temp", "planned peak", "fits"),
        left=("policy",),
    )
    for r in rows:
        p, kept = r["plan"], r["residuals"]
        t.add_row(
            r["policy"] or "as written",
            format_bytes(kept["device_bytes"]) if kept else "-",
            format_bytes(kept["host_bytes"]) if kept else "-",
            f"{r['matmul_flops'] / 1e9:,.1f}",
            format_bytes(p["temp_bytes"]),
            format_bytes(p["planned_peak_bytes"]),
            "-" if p["fits"] is None else ("yes" if p["fits"] else "no"),
        )
    out.print(t)
    tags = list(dict.fromkeys(k for r in rows if r["residuals"] for k in r["residuals"]["by_tag"]))
    if tags:
        by = render.table(
            "saved by tag (residual accounting)",
            ("tag", *[r["policy"] or "as written" for r in rows]),
            left=("tag",),
        )
        for tag in tags:
            by.add_row(
                tag,
                *[
                    format_bytes(r["residuals"]["by_tag"].get(tag, 0))
                    for r in rows
                    if r["residuals"]
                ],
            )
        out.print(by)
    if target.is_gpu:
        out.print(
            f"  fits = planned peak <= {target.name}'s {format_bytes(target.device_memory_bytes)} "
            "(jaxmem's check: a deviceless compile never fails for lack of memory)",
            style="dim",
        )


# ------------------------------------------------------------------------------------ peak
def peak(args: argparse.Namespace, names: Sequence[str]) -> int:
    from jaxmem.memory import tools

    refuse_step_flags(args, names, allowed=("policy",))
    entry = load_entry(args.fn)
    target = _target(args)
    check_writable(args.json)
    step = call_entry(entry, args.fn, args.policy)
    with user_code(args.fn, "measuring the step"):
        sp = tools.peak(
            step.fn,
            *step.args,
            target=target,
            loss=step.loss,
            loss_args=step.loss_args,
            **step.compile_kwargs(),
        )
    report = sp.report
    out = render.console()
    label = f" under {args.policy}" if args.policy else ""
    out.print(f"jaxmem peak --fn {args.fn}{label}: compiled plan for {report.compiler}")
    out.print(
        f"planned peak {format_bytes(report.planned_peak_bytes)} (memory_analysis); device "
        f"arena {format_bytes(report.allocated_bytes)}; live at the peak "
        f"{format_bytes(report.live_bytes)} (position {report.position} of {report.length}, at "
        f"{report.at_peak or '?'})"
    )
    render.peak_tables(out, report, args.top)
    by = render.table(
        f"forward and recomputed values live at the peak, by tag (matched by {sp.by_tag_method})",
        ("tag", "bytes"),
        left=("tag",),
    )
    for tag, n in sp.by_tag.items():
        by.add_row(tag, format_bytes(n))
    out.print(by)
    if args.json:
        write_json_atomic(
            args.json,
            {
                "fn": args.fn,
                "policy": args.policy,
                "plan": sp.plan.to_dict(),
                **report.to_dict(),
                "by_tag_bytes": sp.by_tag,
                "by_tag_method": sp.by_tag_method,
                "by_operation_bytes": sp.by_operation(),
            },
        )
        out.print(f"wrote {args.json}", style="dim")
    return 0

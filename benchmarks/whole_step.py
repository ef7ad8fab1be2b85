# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""Whole-step memory, both frameworks side by side: everything one training step holds
(parameters, optimizer state, gradients, saved activations, working buffers), not the saved
activations alone.

- ``sweep``: the sweep shape (``small``, batch 8 × 128), every preset × fp32 / bf16 / pure-bf16,
  AdamW: JAX's planned peak from the step's compiled plan (XLA:CPU, and the same step compiled
  for an H100 without one), PyTorch's runtime peak (torch MemTracker on CPU, a steady second
  step: AdamW's state exists).
- ``unrolled``: the sweep's H100 plans again with the blocks unrolled (``MemoryPolicy.unroll``;
  ``nested`` always scans), added to the sweep's rows.
- ``gpt2_unrolled``: gpt2-124m (bf16, 8 × 1024) planned for an H100, scanned and unrolled.
- ``exceptions``: for each sweep row whose better H100 plan is above torch_ref's peak, what is
  live at that plan's peak (``jaxmem peak``: XLA's buffer assignment, by kind and by the JAX
  operation that made each buffer), beside torch_ref's figures for the same row.
- ``combined``: the seeds' "combine everything" claim: the baseline (fp32, no remat, AdamW, one
  microbatch) against every combination of policy × precision × optimizer × accumulation at
  batch 16 × 256, per framework; the leanest, its reduction and what it still holds.
- ``combined_new``: ``combined`` for candidates the last run has no row for (the others kept).
- ``combined_h100``: the same candidates' H100 plans (added to their rows).
- ``combined_peaks``: what the leanest JAX combination holds at its plan's peak, on XLA:CPU and
  on the H100 plan (``jaxmem peak``).

Each figure says what it is; the two frameworks' peaks are different kinds of figure (a compiled
plan vs a runtime high-water mark) and are labelled so, never mixed in one column.

    python benchmarks/whole_step.py [--parts sweep,unrolled,gpt2_unrolled,exceptions,combined,
                                     combined_h100,combined_peaks]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import time

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()  # before JAX starts: CPU backend, no plugin start-up noise
import jax
import torch

from jaxmem.compare.bench import set_threads
from jaxmem.compare.records import torch_record
from jaxmem.config import AccumConfig, OptimizerConfig, get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.targets import get_target
from jaxmem.planner.plans import plan_step
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

MIB = 1 << 20
PRESET = "small"
SWEEP_SHAPE = (8, 128)
SWEEP_PRECISIONS = ("fp32", "bf16", "pure-bf16")
COMBINED_SHAPE = (16, 256)
BASELINE = ("none", "fp32", "adamw", 1)
COMBINED_AXES = {
    "policy": ("full", "nested"),
    "precision": ("fp32", "bf16", "pure-bf16"),
    "optimizer": ("adamw", "adafactor"),
    "accum": (1, 8, 16),
}


def _parts(rec: dict) -> dict:
    return {
        "params_bytes": rec["params_bytes"],
        "opt_state_bytes": rec["opt_state_bytes"],
        "grads_bytes": rec["grads_bytes"],
        "saved_activation_bytes": rec["saved_activation_bytes_device"]
        + rec["saved_activation_bytes_host"],
        "parameter_copy_bytes": rec["saved_parameter_copy_bytes"],
    }


def _row_spec(row: dict, **changes) -> StepSpec:
    """The step ``row`` measures (``PRESET`` at the row's policy, precision, optimizer, shape and
    accumulation, on this backend), with ``changes`` (an H100 target, the policy unrolled)."""
    return StepSpec(
        model=get_preset(PRESET),
        policy=POLICIES[row["policy"]],
        precision=PRECISIONS[row["precision"]],
        optimizer=OptimizerConfig(name=row["optimizer"]),
        batch=row["batch"],
        seq_len=row["seq_len"],
        accum=AccumConfig(steps=row["accum"]),
    ).replace(**changes)


def point(policy: str, precision: str, optimizer: str, accum: int, shape, h100: bool) -> dict:
    batch, seq = shape
    row = {
        "policy": policy,
        "precision": precision,
        "optimizer": optimizer,
        "accum": accum,
        "batch": batch,
        "seq_len": seq,
    }
    spec = _row_spec(row)
    j = jax_record(spec)
    t = torch_record(
        spec.model, spec.policy, spec.precision, spec.optimizer, batch, seq, accum=accum
    )
    row |= {
        "jax_plan_peak_bytes": j["planned_peak_bytes"],
        "jax_plan_temp_bytes": j["compiled_temp_bytes"],
        "jax_plan_source": j["peak_source"],
        "jax": _parts(j),
        "jax_flops": j["flops"],
        "torch_peak_bytes": t["peak_bytes"],
        "torch_peak_source": t["peak_source"],
        "torch_translation": t["translation"],
        "torch": _parts(t),
        "torch_flops": t["flops"],
    }
    if h100:
        plan = plan_step(spec.replace(target=get_target("h100")))
        row["jax_h100_plan_peak_bytes"] = plan["planned_peak_bytes"]
        row["jax_h100_compiler"] = plan["compiler"]
    return row


def sweep() -> list[dict]:
    rows = []
    for precision in SWEEP_PRECISIONS:
        for policy in POLICIES:
            start = time.perf_counter()
            rows.append(point(policy, precision, "adamw", 1, SWEEP_SHAPE, h100=True))
            print(f"sweep {precision} {policy}: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def _h100_peak(row: dict, policy) -> int:
    """The planned peak of ``row``'s step (its precision, optimizer, shape, accumulation) under
    ``policy``, compiled for an H100 without one."""
    plan = plan_step(_row_spec(row, policy=policy, target=get_target("h100")))
    return plan["planned_peak_bytes"]


def unrolled(rows: list[dict]) -> None:
    """Add the H100 plan of the same step with the blocks unrolled to each sweep row."""
    for r in rows:
        policy = POLICIES[r["policy"]]
        if policy.nested:
            r["jax_h100_unrolled_plan_peak_bytes"] = None  # nested scans its segments
            continue
        start = time.perf_counter()
        r["jax_h100_unrolled_plan_peak_bytes"] = _h100_peak(r, policy.replace(unroll=True))
        print(
            f"unrolled {r['precision']} {r['policy']}: {time.perf_counter() - start:.0f} s",
            flush=True,
        )


GPT2_SHAPE = ("gpt2-124m", "bf16", 8, 1024)
GPT2_POLICIES = ("none", "full", "selective", "mlp", "offload")


def gpt2_unrolled() -> list[dict]:
    """gpt2-124m (bf16, 8 × 1024, AdamW) compiled for an H100, scanned and unrolled: does
    unrolling pay at a GPU size? Compile seconds are wall time on this machine (noisy)."""
    preset, precision, batch, seq = GPT2_SHAPE
    spec = StepSpec(
        model=get_preset(preset),
        policy=POLICIES["none"],
        precision=PRECISIONS[precision],
        batch=batch,
        seq_len=seq,
        target=get_target("h100"),
    )
    rows = []
    for name in GPT2_POLICIES:
        row = {"preset": preset, "precision": precision, "batch": batch, "seq_len": seq}
        row["policy"] = name
        for stack, unroll in (("scanned", False), ("unrolled", True)):
            start = time.perf_counter()
            plan = plan_step(spec.replace(policy=POLICIES[name].replace(unroll=unroll)))
            row[f"{stack}_plan_peak_bytes"] = plan["planned_peak_bytes"]
            row[f"{stack}_compile_seconds"] = round(time.perf_counter() - start, 1)
            row["compiler"] = plan["compiler"]
        print(f"gpt2 {name}: {row}", flush=True)
        rows.append(row)
    return rows


def gpt2_markdown(rows: list[dict]) -> list[str]:
    preset, precision, batch, seq = GPT2_SHAPE
    lines = [
        "",
        f"### Scanned vs unrolled at a GPU size ({preset}, {precision}, {batch} × {seq}, AdamW)",
        "",
        f"The train step's compiled plan for an H100 without one ({rows[0]['compiler']}), "
        "scanned and with the blocks unrolled; compile seconds: wall time on this machine "
        "(2 busy cores), for the ratio only.",
        "",
        "| policy | scanned GB | unrolled GB | unrolled / scanned | compile s scanned "
        "| compile s unrolled |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["scanned_plan_peak_bytes"], r["unrolled_plan_peak_bytes"]
        lines.append(
            f"| {r['policy']} | {a / 1e9:.2f} | {b / 1e9:.2f} | {b / a:.3f} "
            f"| {r['scanned_compile_seconds']} | {r['unrolled_compile_seconds']} |"
        )
    return lines


def _peak_fields(report) -> dict:
    """A ``jaxmem.planner.peak.PeakReport``'s figures, for the JSON."""
    return {
        "compiler": report.compiler,
        "planned_peak_bytes": report.planned_peak_bytes,
        "allocated_bytes": report.allocated_bytes,
        "live_bytes": report.live_bytes,
        "position": report.position,
        "length": report.length,
        "at_peak": report.at_peak,
        "by_kind_bytes": report.by_kind(),
    }


def _kind_cells(e: dict) -> str:
    """Live MiB by kind, then packing (arena - live), as Markdown cells."""
    k = e["by_kind_bytes"]
    cells = [k["argument"], k["forward"], k["recomputed"], k["backward"], k["other"]]
    cells.append(e["allocated_bytes"] - e["live_bytes"])
    return " | ".join(_m(c) for c in cells)


def _best_h100(row: dict) -> tuple[int, bool]:
    """The smaller of the row's H100 plans, and whether it is the unrolled one."""
    scanned, unrolled_ = (
        row.get("jax_h100_plan_peak_bytes"),
        row.get("jax_h100_unrolled_plan_peak_bytes"),
    )
    if unrolled_ is not None and unrolled_ < scanned:
        return unrolled_, True
    return scanned, False


def exceptions(rows: list[dict]) -> list[dict]:
    """What is live at the peak of each sweep row's better H100 plan where it is above
    torch_ref's runtime peak (``jaxmem.planner.peak``)."""
    from jaxmem.planner.peak import explain_peak

    out = []
    for r in rows:
        best, unroll = _best_h100(r)
        if best is None or best <= r["torch_peak_bytes"]:
            continue
        policy = POLICIES[r["policy"]].replace(unroll=unroll) if unroll else POLICIES[r["policy"]]
        start = time.perf_counter()
        report = explain_peak(_row_spec(r, policy=policy, target=get_target("h100")))
        groups: dict[tuple[str, str, str], int] = {}
        for v in report.values:
            if v.kind != "argument":
                key = (v.kind, v.op_name, v.shape)
                groups[key] = groups.get(key, 0) + v.bytes
        top = sorted(groups.items(), key=lambda kv: -kv[1])[:12]
        out.append(
            {
                "precision": r["precision"],
                "policy": r["policy"],
                "unrolled": unroll,
                **_peak_fields(report),
                "top_groups": [
                    {"kind": k, "op_name": op, "shape": shape, "bytes": b}
                    for (k, op, shape), b in top
                ],
                "torch_peak_bytes": r["torch_peak_bytes"],
                "torch_saved_activation_bytes": r["torch"]["saved_activation_bytes"],
                "jax_saved_activation_bytes": r["jax"]["saved_activation_bytes"],
            }
        )
        print(f"exception {r['precision']} {r['policy']}: {time.perf_counter() - start:.0f} s")
    return out


def exceptions_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "### Where JAX's better H100 plan is above torch_ref's peak: what its peak holds",
        "",
        "`jaxmem peak` on the row's better H100 plan (XLA's buffer assignment of the step "
        "compiled for an H100 without one: the position in the scheduled program where the "
        "live buffers cover the most device memory, each buffer attributed to the JAX operation "
        "that made it). Live MiB by kind; packing = the arena minus what is live at its peak. "
        "torch: runtime peak and saved activations (residual accounting) of the same row.",
        "",
        "| precision | policy | stack | JAX plan MiB | live at peak | arguments | forward (kept) "
        "| recomputed | backward | other | packing | torch peak MiB | saved JAX / torch MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in rows:
        lines.append(
            f"| {e['precision']} | {e['policy']} | {'unrolled' if e['unrolled'] else 'scanned'} "
            f"| {_m(e['planned_peak_bytes'])} | {_m(e['live_bytes'])} | {_kind_cells(e)} "
            f"| {_m(e['torch_peak_bytes'])} | {_m(e['jax_saved_activation_bytes'])} / "
            f"{_m(e['torch_saved_activation_bytes'])} |"
        )
    for e in rows:
        stack = "unrolled" if e["unrolled"] else "scanned"
        lines += [
            "",
            f"{e['precision']} `{e['policy']}` ({stack}): peak at position {e['position']} of "
            f"{e['length']} (`{e['at_peak']}`); largest groups of buffers live there, arguments "
            "aside:",
            "",
            "| MiB | kind | shape | made by (JAX operation) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {_m(g['bytes'])} | {g['kind']} | {g['shape']} | `{g['op_name']}` |"
            for g in e["top_groups"]
        ]
    return lines + [""]


def combined(previous: list[dict], remeasure: bool) -> list[dict]:
    """The baseline and every candidate; with ``remeasure`` off, rows of ``previous`` (the last
    run's) for the same combination at the same shape are kept and only new ones measured."""
    key = lambda r: (r["policy"], r["precision"], r["optimizer"], r["accum"])  # noqa: E731
    kept = {
        key(r): r
        for r in previous
        if not remeasure and (r["batch"], r["seq_len"]) == COMBINED_SHAPE
    }
    rows = []
    for combo in [BASELINE, *itertools.product(*COMBINED_AXES.values())]:
        if combo in kept:
            rows.append(kept[combo])
            continue
        start = time.perf_counter()
        row = point(*combo, COMBINED_SHAPE, h100=False)
        rows.append(row | {"baseline": True} if combo == BASELINE else row)
        print(f"combined {combo}: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def combined_h100(rows: list[dict], remeasure: bool) -> None:
    """Add each combined candidate's H100 plan (the same step compiled for an H100 without
    one) to its row (with ``remeasure`` off, only to rows without one)."""
    for r in rows:
        if not remeasure and r.get("jax_h100_plan_peak_bytes") is not None:
            continue
        start = time.perf_counter()
        r["jax_h100_plan_peak_bytes"] = _h100_peak(r, POLICIES[r["policy"]])
        print(
            f"combined h100 {r['policy']} {r['precision']} {r['optimizer']} {r['accum']}: "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )


def combined_peaks(rows: list[dict]) -> list[dict]:
    """What the leanest JAX combination holds at its plan's peak, on XLA:CPU and on the H100
    plan (``jaxmem.planner.peak``): the remainder broken down by the compiler's own account."""
    from jaxmem.planner.peak import explain_peak

    out = []
    for target, key in (("cpu", "jax_plan_peak_bytes"), ("h100", "jax_h100_plan_peak_bytes")):
        if any(r.get(key) is None for r in rows):
            continue
        lean = min(rows, key=lambda r, k=key: r[k])
        report = explain_peak(_row_spec(lean, target=get_target(target)))
        out.append(
            {
                "target": target,
                "combination": {k: lean[k] for k in ("policy", "precision", "optimizer", "accum")},
                **_peak_fields(report),
            }
        )
    return out


def _m(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def sweep_markdown(rows: list[dict]) -> list[str]:
    lines = [
        f"### Whole step at the sweep shape ({PRESET}, batch {SWEEP_SHAPE[0]} × "
        f"{SWEEP_SHAPE[1]}, AdamW)",
        "",
        "JAX plan = the train step's compiled plan (arguments + outputs − donated + "
        "temporaries), XLA:CPU and compiled for an H100 without one; torch peak = runtime peak "
        "(torch MemTracker, CPU, a steady second step). Different kinds of figure: compare them "
        "as what each framework's user would be told. XLA:CPU erases host offload and MemTracker "
        "counts host memory too (a CPU-only run), so `offload` saves nothing in either column. "
        "H100 unrolled: the same step with the blocks unrolled (`--unroll`: XLA frees each "
        "block's residuals after its backward instead of holding the scan's stacked buffers; "
        "`nested` always scans; XLA:CPU drops remat when unrolled, so no XLA:CPU column). "
        "Best H100 / torch: the smaller H100 plan over the torch peak.",
        "",
        "| precision | policy | JAX plan MiB (XLA:CPU) | JAX plan MiB (H100) | JAX plan MiB "
        "(H100, unrolled) | torch peak MiB (runtime, CPU) | JAX XLA:CPU / torch | best H100 / "
        "torch | grads JAX / torch MiB | saved JAX / torch MiB | weight copies JAX / torch MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        j, t = r["jax"], r["torch"]
        h100 = [
            b
            for b in (r.get("jax_h100_plan_peak_bytes"), r.get("jax_h100_unrolled_plan_peak_bytes"))
            if b is not None
        ]
        best = f"{min(h100) / r['torch_peak_bytes']:.3f}" if h100 else "-"
        lines.append(
            f"| {r['precision']} | {r['policy']} | {_m(r['jax_plan_peak_bytes'])} "
            f"| {_m(r.get('jax_h100_plan_peak_bytes'))} "
            f"| {_m(r.get('jax_h100_unrolled_plan_peak_bytes'))} | {_m(r['torch_peak_bytes'])} "
            f"| {r['jax_plan_peak_bytes'] / r['torch_peak_bytes']:.3f} | {best} "
            f"| {_m(j['grads_bytes'])} / {_m(t['grads_bytes'])} "
            f"| {_m(j['saved_activation_bytes'])} / {_m(t['saved_activation_bytes'])} "
            f"| {_m(j['parameter_copy_bytes'])} / {_m(t['parameter_copy_bytes'])} |"
        )
    return lines


def combined_markdown(rows: list[dict]) -> list[str]:
    base = next(r for r in rows if r.get("baseline"))
    lines = [
        "",
        f"### Combined: baseline vs the leanest combination ({PRESET}, batch "
        f"{COMBINED_SHAPE[0]} × {COMBINED_SHAPE[1]})",
        "",
        f"Baseline: {base['precision']}, `{base['policy']}`, {base['optimizer']}, one "
        "microbatch. Candidates: every policy × precision × optimizer × accumulation of "
        f"{COMBINED_AXES}. JAX: the step's compiled plan (XLA:CPU, and compiled for an H100 "
        "without one: a separate row, never mixed with the CPU plan); torch: runtime peak "
        "(torch MemTracker, CPU, steady step).",
        "",
        "| framework | baseline MiB | leanest MiB | reduction | leanest combination | params "
        "| optimizer state | gradients | saved activations (one microbatch) | rest (working "
        "buffers, copies) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    figures = [("jax", "jax_plan_peak_bytes", "jax (XLA:CPU plan)")]
    if all(r.get("jax_h100_plan_peak_bytes") is not None for r in rows):
        figures.append(("jax", "jax_h100_plan_peak_bytes", "jax (H100 plan)"))
    figures.append(("torch", "torch_peak_bytes", "torch (runtime peak)"))
    for fw, key, label in figures:
        lean = min(rows, key=lambda r, k=key: r[k])
        parts = lean[fw]
        held = parts["params_bytes"] + parts["opt_state_bytes"] + parts["grads_bytes"]
        rest = lean[key] - held - parts["saved_activation_bytes"]
        lines.append(
            f"| {label} | {_m(base[key])} | {_m(lean[key])} | {base[key] / lean[key]:.1f}× "
            f"| {lean['precision']}, `{lean['policy']}`, {lean['optimizer']}, accum "
            f"{lean['accum']} | {_m(parts['params_bytes'])} | {_m(parts['opt_state_bytes'])} "
            f"| {_m(parts['grads_bytes'])} | {_m(parts['saved_activation_bytes'])} "
            f"| {_m(rest)} |"
        )
    lines += [
        "",
        "The components are residual accounting and shapes (saved activations of one "
        "microbatch; JAX's gradients with accumulation are its one accumulation buffer); rest = "
        "the peak minus them.",
        "",
        "| policy | precision | optimizer | accum | JAX plan MiB (XLA:CPU) | JAX plan MiB (H100) "
        "| torch peak MiB (runtime, CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["jax_plan_peak_bytes"]):
        lines.append(
            f"| {r['policy']} | {r['precision']} | {r['optimizer']} | {r['accum']} "
            f"| {_m(r['jax_plan_peak_bytes'])} | {_m(r.get('jax_h100_plan_peak_bytes'))} "
            f"| {_m(r['torch_peak_bytes'])} |"
        )
    return lines


def combined_peaks_markdown(peaks: list[dict]) -> list[str]:
    lines = [
        "",
        "What the leanest JAX combination holds at its plan's peak (`jaxmem peak`: XLA's buffer "
        "assignment; MiB live at the peak by kind; packing = arena − live):",
        "",
        "| plan | combination | planned MiB | arguments | forward (kept) | recomputed | backward "
        "| other (accumulator, update, loss) | packing | peak at |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in peaks:
        c = p["combination"]
        lines.append(
            f"| {p['compiler']} | {c['precision']}, `{c['policy']}`, {c['optimizer']}, accum "
            f"{c['accum']} | {_m(p['planned_peak_bytes'])} | {_kind_cells(p)} "
            f"| {p['position']} of {p['length']}: `{p['at_peak'] or '?'}` |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        default="sweep,unrolled,gpt2_unrolled,exceptions,combined,combined_h100,combined_peaks",
    )
    parser.add_argument("--out", default="benchmarks/results/whole_step")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]  # "": rewrite the Markdown only
    threads = set_threads()
    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "whole_step.json")
    result = {
        "sweep": [],
        "combined": [],
        "gpt2_unrolled": [],
        "exceptions": [],
        "combined_peaks": [],
    }
    measured: dict[str, str] = {}  # part -> when it was last measured
    if os.path.exists(path):  # a part not measured in this run keeps its last measurement
        with open(path) as f:
            last = json.load(f)
        result |= {k: v for k, v in last.items() if k != "meta"}
        old = last["meta"]
        measured = old.get("measured") or dict.fromkeys(old["parts_measured"], old["date"])
    if "sweep" in parts:
        result["sweep"] = sweep()
    if "unrolled" in parts:
        unrolled(result["sweep"])
    if "gpt2_unrolled" in parts:
        result["gpt2_unrolled"] = gpt2_unrolled()
    if "exceptions" in parts:
        result["exceptions"] = exceptions(result["sweep"])
    if "combined" in parts or "combined_new" in parts:
        result["combined"] = combined(result["combined"], remeasure="combined" in parts)
    if "combined_h100" in parts:
        combined_h100(result["combined"], remeasure="combined" in parts)
    if "combined_peaks" in parts:
        result["combined_peaks"] = combined_peaks(result["combined"])
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    meta = {
        "date": now,
        "measured": measured | dict.fromkeys(parts, now),
        "host": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
        "threads": threads,
        "parts_measured": parts,
        "seconds": round(time.perf_counter() - started),
    }
    write_json_atomic(path, {"meta": meta, **result})
    lines = [
        f"Whole-step memory, jaxmem vs torch_ref; {meta['host']}, {meta['date']} (jax "
        f"{meta['versions']['jax']}, torch {meta['versions']['torch']}). "
        "`python benchmarks/whole_step.py`; parts measured: "
        + ", ".join(f"{part} {when}" for part, when in sorted(meta["measured"].items()))
        + ".",
        "",
    ]
    if result["sweep"]:
        lines += sweep_markdown(result["sweep"])
    if result["exceptions"]:
        lines += exceptions_markdown(result["exceptions"])
    if result["gpt2_unrolled"]:
        lines += gpt2_markdown(result["gpt2_unrolled"])
    if result["combined"]:
        lines += combined_markdown(result["combined"])
    if result["combined_peaks"]:
        lines += combined_peaks_markdown(result["combined_peaks"])
    write_atomic(os.path.join(args.out, "whole_step.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

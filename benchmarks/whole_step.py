# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""Whole-step memory, both frameworks side by side (issue 13): everything one training step holds
(parameters, optimizer state, gradients, saved activations, working buffers), not the saved
activations alone.

- ``sweep``: the sweep shape (``small``, batch 8 × 128), every preset × fp32 / bf16 / pure-bf16,
  AdamW: JAX's planned peak from the step's compiled plan (XLA:CPU, and the same step compiled
  for an H100 without one), PyTorch's runtime peak (torch MemTracker on CPU, a steady second
  step: AdamW's state exists).
- ``combined``: the seeds' "combine everything" claim: the baseline (fp32, no remat, AdamW, one
  microbatch) against every combination of policy × precision × optimizer × accumulation at
  batch 16 × 256, per framework; the leanest, its reduction and what it still holds.

Each figure says what it is; the two frameworks' peaks are different kinds of figure (a compiled
plan vs a runtime high-water mark) and are labelled so, never mixed in one column.

    python benchmarks/whole_step.py [--parts sweep,combined]
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
from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.records import jax_record, plan_step
from jaxmem.memory.targets import get_target
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS

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
    "accum": (1, 8),
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


def point(policy: str, precision: str, optimizer: str, accum: int, shape, h100: bool) -> dict:
    cfg = get_preset(PRESET)
    batch, seq = shape
    opt = OptimizerConfig(name=optimizer)
    prec, pol = PRECISIONS[precision], POLICIES[policy]
    j = jax_record(cfg, pol, prec, opt, batch, seq, accum=accum)
    t = torch_record(cfg, pol, prec, opt, batch, seq, accum=accum)
    row = {
        "policy": policy,
        "precision": precision,
        "optimizer": optimizer,
        "accum": accum,
        "batch": batch,
        "seq_len": seq,
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
        plan = plan_step(cfg, pol, prec, opt, batch, seq, get_target("h100"), accum=accum)
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


def combined() -> list[dict]:
    rows = [point(*BASELINE, COMBINED_SHAPE, h100=False) | {"baseline": True}]
    for combo in itertools.product(*COMBINED_AXES.values()):
        start = time.perf_counter()
        rows.append(point(*combo, COMBINED_SHAPE, h100=False))
        print(f"combined {combo}: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


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
        "counts host memory too (a CPU-only run), so `offload` saves nothing in either column.",
        "",
        "| precision | policy | JAX plan MiB (XLA:CPU) | JAX plan MiB (H100) | torch peak MiB "
        "(runtime, CPU) | JAX XLA:CPU / torch | grads JAX / torch MiB | saved JAX / torch MiB "
        "| weight copies JAX / torch MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        j, t = r["jax"], r["torch"]
        lines.append(
            f"| {r['precision']} | {r['policy']} | {_m(r['jax_plan_peak_bytes'])} "
            f"| {_m(r.get('jax_h100_plan_peak_bytes'))} | {_m(r['torch_peak_bytes'])} "
            f"| {r['jax_plan_peak_bytes'] / r['torch_peak_bytes']:.3f} "
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
        f"{COMBINED_AXES}. JAX: the step's compiled plan (XLA:CPU); torch: runtime peak (torch "
        "MemTracker, CPU, steady step).",
        "",
        "| framework | baseline MiB | leanest MiB | reduction | leanest combination | params "
        "| optimizer state | gradients | saved activations (one microbatch) | rest (working "
        "buffers, copies) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fw, key in (("jax", "jax_plan_peak_bytes"), ("torch", "torch_peak_bytes")):
        lean = min(rows, key=lambda r, k=key: r[k])
        parts = lean[fw]
        held = parts["params_bytes"] + parts["opt_state_bytes"] + parts["grads_bytes"]
        rest = lean[key] - held - parts["saved_activation_bytes"]
        lines.append(
            f"| {fw} | {_m(base[key])} | {_m(lean[key])} | {base[key] / lean[key]:.1f}× "
            f"| {lean['precision']}, `{lean['policy']}`, {lean['optimizer']}, accum "
            f"{lean['accum']} | {_m(parts['params_bytes'])} | {_m(parts['opt_state_bytes'])} "
            f"| {_m(parts['grads_bytes'])} | {_m(parts['saved_activation_bytes'])} "
            f"| {_m(rest)} |"
        )
    lines += [
        "",
        "| policy | precision | optimizer | accum | JAX plan MiB (XLA:CPU) | torch peak MiB "
        "(runtime, CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["jax_plan_peak_bytes"]):
        lines.append(
            f"| {r['policy']} | {r['precision']} | {r['optimizer']} | {r['accum']} "
            f"| {_m(r['jax_plan_peak_bytes'])} | {_m(r['torch_peak_bytes'])} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="sweep,combined")
    parser.add_argument("--out", default="benchmarks/results/whole_step")
    args = parser.parse_args()
    parts = args.parts.split(",")
    threads = set_threads()
    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "whole_step.json")
    result = {"sweep": [], "combined": []}
    if os.path.exists(path):  # a part not measured in this run keeps its last measurement
        with open(path) as f:
            result |= {k: v for k, v in json.load(f).items() if k != "meta"}
    if "sweep" in parts:
        result["sweep"] = sweep()
    if "combined" in parts:
        result["combined"] = combined()
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
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
        "`python benchmarks/whole_step.py`.",
        "",
    ]
    if result["sweep"]:
        lines += sweep_markdown(result["sweep"])
    if result["combined"]:
        lines += combined_markdown(result["combined"])
    write_atomic(os.path.join(args.out, "whole_step.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

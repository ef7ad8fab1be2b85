# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""Llama 3 at the sizes people train it, planned for H100s without a GPU (needs
``jaxmem[gpu-plan]``; the torch column needs ``jaxmem[torch]``).

    python benchmarks/llama.py --out benchmarks/results/llama

Attention is fused (``attention="fused"``: FlashAttention's algorithm, as every Llama trainer
runs it): naive attention's fp32 ``[B, H, S, S]`` probabilities alone are 2 GiB per layer and
sequence at 4096 tokens, so under ``none`` not one sequence of ``llama-3.2-1b`` fits an H100.

1. **Plans per policy** of ``llama-3.2-1b`` and ``llama-3-8b``, bf16 (fp32 master weights,
   AdamW), one sequence of 4096 and of 8192 tokens on one H100: device temporaries, arguments,
   host bytes, planned peak, whether it fits (``memory_analysis()`` of the plan XLA:CUDA
   compiles for the target); saved activations by residual accounting (JAX), by torch_ref's
   step under ``FakeTensorMode`` (PyTorch, shapes only) and by the analytic model; matmul FLOPs.
2. **Largest batch** (sequences of that length) per policy: on one 80 GB H100, and per device on
   8 H100s under ``fsdp`` (one host's topology), each shown by two compiled plans (b fits,
   b + 1 does not).
3. **The planner's answer** for ``llama-3-8b`` on 8 H100s: ``jaxmem plan --preset llama-3-8b
   --target h100 --mesh fsdp=8 ...``, run as a user runs it, its JSON kept.
4. **cuDNN's fused kernel against the blockwise one** (only where cuDNN's library is installed:
   ``pip install -e '.[cudnn-plan]'``): the same steps' H100 plans with
   ``jax.nn.dot_product_attention(implementation="cudnn")``, which is what fused attention runs
   on an NVIDIA GPU.

Rows are kept in ``<out>/llama.partial.json`` as they are measured, so a stopped run resumes;
a later run keeps the rows of ``<out>/llama.json`` and measures only what is missing (``--skip``
leaves parts out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()  # before JAX starts: CPU backend, no plugin start-up noise
import jax
from gpu_plans import search_largest

from jaxmem.config import get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.targets import get_target
from jaxmem.parallel import ParallelConfig
from jaxmem.planner.plans import plan_step
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES
from jaxmem.precision import get_precision
from jaxmem.step.spec import StepSpec

MODELS = ("llama-3.2-1b", "llama-3-8b")
SEQS = (4096, 8192)
POLICY_NAMES = ("none", "selective", "full", "offload", "nested")
ONE_DEVICE = ParallelConfig()
FSDP = ParallelConfig(strategy="fsdp", devices=8)
GIB = 2**30
PLAN_COMMAND = (
    "plan --preset llama-3-8b --attention fused --target h100 --mesh fsdp=8 --precision bf16 "
    "--batch-size 32 --seq-len 8192"
)


def model(preset: str):
    return get_preset(preset).replace(attention="fused")


def plans(base: StepSpec, rows: dict, save) -> None:
    """Part 1: one sequence per model x sequence length x policy (``base``: the step of one
    sequence, its precision and target)."""
    for preset in MODELS:
        cfg = model(preset)
        for seq in SEQS:
            for name in POLICY_NAMES:
                key = f"{preset} {seq} {name}"
                if key in rows:
                    continue
                start = time.perf_counter()
                spec = base.replace(model=cfg, policy=POLICIES[name], seq_len=seq)
                rec = jax_record(spec)
                row = {
                    "preset": preset,
                    "seq_len": seq,
                    "policy": name,
                    "compiler": rec["compiler"],
                    "temp_bytes": rec["compiled_temp_bytes"],
                    "argument_bytes": rec["compiled_plan"]["argument_bytes"],
                    "host_bytes": rec["plan_host_bytes"],
                    "planned_peak_bytes": rec["planned_peak_bytes"],
                    "fits": rec["fits"],
                    "jax_saved_bytes": rec["saved_activation_bytes_device"]
                    + rec["saved_activation_bytes_host"],
                    "analytic_bytes": rec["analytic_activation_bytes"],
                    "jax_flops": rec["flops"],
                    "model_flops": rec["model_flops"],
                }
                row |= torch_columns(spec)
                row["seconds"] = round(time.perf_counter() - start, 1)
                rows[key] = row
                save()
                print(
                    f"{key}: planned peak {row['planned_peak_bytes'] / GIB:.2f} GiB "
                    f"({row['seconds']} s)",
                    flush=True,
                )


def torch_columns(spec: StepSpec) -> dict:
    from jaxmem.compare.records import torch_record

    t = torch_record(
        spec.model, spec.policy, spec.precision, spec.optimizer, spec.batch, spec.seq_len, fake=True
    )
    return {
        "torch_translation": t["translation"],
        "torch_saved_bytes": t["saved_activation_bytes_device"] + t["saved_activation_bytes_host"],
        "torch_flops": t["flops"],
    }


def largest(base: StepSpec, rows: dict, save) -> None:
    """Part 2: the largest batch per policy, one H100 and per device of 8 under fsdp."""
    for preset in MODELS:
        cfg = model(preset)
        for seq in SEQS:
            for name in POLICY_NAMES:
                for where, parallel in (("1 x h100", ONE_DEVICE), ("fsdp=8 per device", FSDP)):
                    key = f"{preset} {seq} {name} {where}"
                    if key in rows:
                        continue
                    start = time.perf_counter()
                    spec = base.replace(model=cfg, policy=POLICIES[name], seq_len=seq)
                    peak = peak_of(spec, parallel)
                    found = search_largest(peak, base.target.device_memory_bytes, {})
                    rows[key] = {
                        "preset": preset,
                        "seq_len": seq,
                        "policy": name,
                        "where": where,
                        "largest_rows_per_device": found["batch"],
                        "plans": {str(b): p for b, p in found["plans"].items()},
                        "compiled": found["compiled"],
                        "seconds": round(time.perf_counter() - start, 1),
                    }
                    save()
                    print(f"{key}: {found['batch']} ({rows[key]['seconds']} s)", flush=True)


def peak_of(spec: StepSpec, parallel: ParallelConfig):
    """``rows per device -> planned peak`` of ``spec``'s step (per device over ``parallel``)."""

    def peak(rows_per_device: int) -> int:
        batch = rows_per_device * parallel.devices
        plan = plan_step(spec.replace(batch=batch, parallel=parallel))
        return plan["planned_peak_bytes"]

    return peak


def cudnn_installed() -> bool:
    from jaxmem.model.flash import cudnn_installed as installed

    return installed()


def cudnn_plans(base: StepSpec, rows: dict, save) -> None:
    """Part 4: the plans of part 1 (none, selective, full) with cuDNN's kernel."""
    if not cudnn_installed():
        print("cuDNN's library is not installed: part 4 left out", flush=True)
        return
    for preset in MODELS:
        cfg = model(preset)
        for seq in SEQS:
            for name in ("none", "selective", "full"):
                key = f"{preset} {seq} {name}"
                if key in rows:
                    continue
                start = time.perf_counter()
                plan = plan_step(base.replace(model=cfg, policy=POLICIES[name], seq_len=seq))
                rows[key] = {
                    "temp_bytes": plan["compiled_plan"]["temp_bytes"],
                    "planned_peak_bytes": plan["planned_peak_bytes"],
                    "compiler": plan["compiler"],
                    "seconds": round(time.perf_counter() - start, 1),
                }
                save()
                print(f"cuDNN {key}: {plan['planned_peak_bytes'] / GIB:.2f} GiB", flush=True)


def planner(out_dir: str) -> dict:
    """Part 3: `jaxmem plan` for llama-3-8b on 8 H100s, as a user runs it."""
    path = os.path.join(out_dir, "plan_llama-3-8b_8xh100.json")
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "jaxmem.cli", *PLAN_COMMAND.split(), "--json", path]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"jaxmem plan failed: {done.stderr.strip()[-2000:]}")
    with open(path) as f:
        result = json.load(f)
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["command"] = "jaxmem " + PLAN_COMMAND
    result["stdout"] = done.stdout
    return result


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def to_markdown(result: dict) -> str:
    meta, rows = result["meta"], result["plans"]
    lines = [
        f"Llama 3 planned for {meta['target']['description']} without a GPU (XLA:CUDA "
        f"deviceless compile), fused attention, bf16 (fp32 master weights), AdamW; "
        f"{meta['date']}, jax {meta['jax']}, torch {meta['torch']}, on {meta['host']}. "
        "Bytes in GiB (2^30). Every figure is a compiled "
        "plan's (`memory_analysis()`: planned peak = arguments + outputs - aliased + "
        "temporaries; fits = planned peak <= the target's "
        f"{meta['target']['device_memory_bytes'] / GIB:.2f} GiB, jaxmem's check), residual "
        "accounting (JAX saved), torch_ref's step under FakeTensorMode (torch saved, shapes "
        "only) or the analytic model, as its column says.",
        "",
        "## One sequence per step, one H100",
        "",
        "| model | seq | policy | temp | arguments | host | planned peak | fits | JAX saved | "
        "torch saved | analytic | TFLOP (JAX / torch) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        lines.append(
            f"| {r['preset']} | {r['seq_len']} | {r['policy']} | {_gib(r['temp_bytes'])} | "
            f"{_gib(r['argument_bytes'])} | {_gib(r['host_bytes'])} | "
            f"{_gib(r['planned_peak_bytes'])} | {'yes' if r['fits'] else 'no'} | "
            f"{_gib(r['jax_saved_bytes'])} | {_gib(r['torch_saved_bytes'])} | "
            f"{_gib(r['analytic_bytes'])} | {r['jax_flops'] / 1e12:,.1f} / "
            f"{r['torch_flops'] / 1e12:,.1f} |"
        )
    lines += [
        "",
        "## Largest batch (sequences per device) whose plan fits",
        "",
        "Each shown by two compiled plans: b fits, b + 1 does not (planned peak GiB at b / b+1); "
        "0: not even one sequence. fsdp=8: one host of 8 H100s, per device.",
        "",
        "| model | seq | policy | 1 x H100 | fsdp=8, per device |",
        "|---|---|---|---|---|",
    ]
    batches = result["largest"]
    for preset in MODELS:
        for seq in SEQS:
            for name in POLICY_NAMES:
                cells = []
                for where in ("1 x h100", "fsdp=8 per device"):
                    r = batches.get(f"{preset} {seq} {name} {where}")
                    if r is None:
                        cells.append("-")
                        continue
                    shown = " / ".join(
                        f"{p / GIB:.1f}"
                        for _, p in sorted(r["plans"].items(), key=lambda kv: int(kv[0]))
                    )
                    cells.append(f"{r['largest_rows_per_device']} ({shown})")
                lines.append(f"| {preset} | {seq} | {name} | {cells[0]} | {cells[1]} |")
    cudnn = result.get("cudnn", {})
    if cudnn:
        lines += [
            "",
            "## cuDNN's fused attention against the blockwise kernel",
            "",
            "The same steps (one sequence, one H100): fused attention as cuDNN's kernel "
            "(`jax.nn.dot_product_attention(implementation='cudnn')`, what an NVIDIA GPU runs) "
            "and as jaxmem's blockwise kernel (every backend).",
            "",
            "| model | seq | policy | blockwise temp | cuDNN temp | blockwise peak | cuDNN peak |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, c in cudnn.items():
            b = rows.get(key, {})
            preset, seq, name = key.split()
            lines.append(
                f"| {preset} | {seq} | {name} | {_gib(b.get('temp_bytes'))} | "
                f"{_gib(c['temp_bytes'])} | {_gib(b.get('planned_peak_bytes'))} | "
                f"{_gib(c['planned_peak_bytes'])} |"
            )
    plan = result.get("planner")
    if plan:
        chosen = plan["chosen"]
        lines += [
            "",
            "## The planner on 8 H100s",
            "",
            f"`{plan['command']}` ({plan['seconds']} s on this machine): chose "
            f"**{chosen['configuration']}**, {chosen['compiled_bytes'] / GIB:.2f} GiB per "
            f"device (compiled plan, {plan['compiler']}), budget "
            f"{plan['budget_bytes'] / GIB:.2f} GiB ({plan['budget_source']}); "
            f"{plan['candidate_compiles']} candidates compiled, {plan['fit_compiles']} for the "
            "memory model. It prints these commands:",
            "",
            "```bash",
            plan["commands"]["jax"],
            plan["commands"]["torch"] or f"# PyTorch: {plan['commands']['torch_note']}",
            "```",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/llama")
    parser.add_argument(
        "--skip", default="", help="parts to leave out: plans,largest,planner,cudnn"
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    skip = {p for p in args.skip.split(",") if p}
    stem = os.path.join(args.out, "llama")
    partial = stem + ".partial.json"
    state = {"plans": {}, "largest": {}, "cudnn": {}}
    earlier_meta: dict = {}
    for earlier in (stem + ".json", partial):  # a finished run's rows, then a stopped one's
        if os.path.exists(earlier):
            with open(earlier) as f:
                loaded = json.load(f)
            earlier_meta = loaded.get("meta", earlier_meta)
            state |= {k: v for k, v in loaded.items() if k != "meta"}
    started = time.perf_counter()
    # one sequence of the first model in bf16 on an H100: each part replaces what it varies
    base = StepSpec(
        model=model(MODELS[0]),
        policy=POLICIES["none"],
        precision=get_precision("bf16"),
        batch=1,
        seq_len=SEQS[0],
        target=get_target("h100"),
    )
    target = base.target

    def save() -> None:
        write_json_atomic(partial, state)

    if "plans" not in skip:
        plans(base, state["plans"], save)
    if "largest" not in skip:
        largest(base, state["largest"], save)
    if "planner" not in skip and "planner" not in state:
        state["planner"] = planner(args.out)
        save()
    if "cudnn" not in skip:
        cudnn_plans(base, state["cudnn"], save)
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # the cuDNN pass runs in an environment with JAX's CUDA libraries only
        torch_version = earlier_meta.get("torch", "-")
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    state["meta"] = {
        "date": now,
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU needed)",
        "jax": jax.__version__,
        "torch": torch_version,
        # what each run measured and how long it took (a stopped or partial run resumes)
        "passes": [
            *earlier_meta.get("passes", []),
            {
                "date": now,
                "parts": sorted({"plans", "largest", "planner", "cudnn"} - skip),
                "seconds": round(time.perf_counter() - started),
                "cudnn_installed": cudnn_installed(),
            },
        ],
        "target": {
            "name": target.name,
            "description": target.description,
            "device_memory_bytes": target.device_memory_bytes,
            "config": target.source,
        },
    }
    write_json_atomic(stem + ".json", state)
    write_atomic(stem + ".md", to_markdown(state))
    os.remove(partial)
    print(f"wrote {stem}.json and .md in {state['meta']['passes'][-1]['seconds']} s")


if __name__ == "__main__":
    main()

# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""Estimated step time and MFU per policy, on H100s (and an A100 row for torchtitan's), beside
the published MFU of the nearest configuration. Planned without a GPU; every figure an
estimate.

    python benchmarks/mfu.py --out benchmarks/results/mfu

Per row (a model, its batch, a policy, one device or fsdp=8 on one host): the estimate
``jaxmem plan`` orders by (``jaxmem.planner.cost``: the gradient's jaxpr before compiling) and
the estimate of the compiled plan (``jaxmem.memory.step_time.of_plan``: the XLA:CUDA deviceless
plan's kernels), each with its MFU (model FLOPs, no recompute, over the step and the bf16 dense
peak), its parts and its assumptions; and the planned peak. bf16 compute, fp32 master weights,
AdamW. ``--render`` rewrites the Markdown from the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()
import jax

from jaxmem.config import PRESETS, OptimizerConfig
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.targets import get_target
from jaxmem.parallel import ParallelConfig
from jaxmem.planner.plans import plan_step
from jaxmem.planner.predict import FlopModel
from jaxmem.planner.space import PlanSpace, Problem, enumerate_candidates
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

GIB = 2**30
# published figures, as their sources give them (configuration, MFU, source)
TORCHTITAN_A100 = (
    "torchtitan, Llama 3 8B, FSDP2 on 64 A100 80GB, local batch 1 x 8192, selective op AC",
    "58.2 %",
    "pytorch/torchtitan docs/performance.md",
)
TORCHTITAN_H100 = (
    "torchtitan, Llama 3.1 8B, FSDP on 8 H100 (96 GB HBM2e, 500 W), local batch 2, selective AC",
    "33-39 %",
    "pytorch/torchtitan docs/performance.md (with or without torch.compile)",
)
MEGATRON_H100 = (
    "Megatron-Core, GPT-3 175B, TP 4 x PP 8 on 128-512 H100",
    "47 % (up to)",
    "NVIDIA Megatron-LM performance notes: MFU grows with model size",
)
# (model, batch per step, seq, policies, target, fsdp devices or 1, references)
ROWS = (
    ("gpt2-124m", 8, 1024, ("none", "selective", "full", "offload"), "h100", 1, ()),
    ("gpt2-124m/fused", 8, 1024, ("none", "selective", "full"), "h100", 1, ()),
    ("llama-3.2-1b", 4, 2048, ("none", "selective", "full"), "h100", 1, ()),
    (
        "llama-3-8b",
        8,
        8192,
        ("selective", "full"),
        "h100",
        8,
        (TORCHTITAN_H100, MEGATRON_H100),
    ),
    ("llama-3-8b", 8, 8192, ("selective", "full"), "a100-80gb", 8, (TORCHTITAN_A100,)),
)


def model(name: str):
    preset = name.split("/")[0]
    cfg = PRESETS[preset]
    return cfg.replace(attention="fused") if name.endswith("/fused") or "llama" in name else cfg


def measure(row: tuple) -> list[dict]:
    name, batch, seq, policies, target_name, devices, refs = row
    cfg, prec, opt = model(name), PRECISIONS["bf16"], OptimizerConfig()
    target = get_target(target_name)
    parallel = ParallelConfig(strategy="fsdp", devices=devices) if devices > 1 else ParallelConfig()
    problem = Problem(cfg, batch, seq, target, target.device_memory_bytes, opt, devices=devices)
    space = PlanSpace(
        policies=policies, mix=(), accum=(1,), state_memory=("device",),
        strategies=("fsdp",), precisions=("bf16",), tags=False, unroll=False,
    )  # fmt: skip
    started = time.perf_counter()
    planned = {c.policy.name: c for c in enumerate_candidates(problem, space, FlopModel(cfg, seq))}
    out = []
    for policy in policies:
        cand = planned[policy]
        t = time.perf_counter()
        plan = plan_step(
            StepSpec(
                model=cfg,
                policy=POLICIES[policy],
                precision=prec,
                batch=batch,
                seq_len=seq,
                target=target,
                parallel=parallel,
            )
        )
        est = plan["step_time"]
        row = {
            "model": name,
            "attention": cfg.attention,
            "batch": batch,
            "seq_len": seq,
            "policy": policy,
            "target": target_name,
            "mesh": parallel.mesh_text() if parallel.sharded else None,
            "tokens_per_device": batch * seq // devices,
            "planned_peak_bytes": plan["planned_peak_bytes"],
            "fits": plan["planned_peak_bytes"] <= target.device_memory_bytes,
            "compiler": plan["compiler"],
            "before_compile": cand.estimate.as_dict(),
            "compiled": est,
            "references": [
                dict(zip(("configuration", "mfu", "source"), r, strict=True)) for r in refs
            ],  # fmt: skip
            "compile_s": time.perf_counter() - t,
        }
        out.append(row)
        print(
            f"{name} {policy} {target_name} x{devices}: before compile "
            f"{cand.seconds * 1e3:,.1f} ms (MFU {cand.estimate.mfu:.1%}), compiled plan "
            f"{est['seconds'] * 1e3:,.1f} ms (MFU {est['mfu']:.1%}), peak "
            f"{plan['planned_peak_bytes'] / GIB:,.2f} GiB",
            flush=True,
        )
    print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    return out


def render(report: dict, path: str) -> None:
    meta = report["meta"]
    lines = [
        "# Estimated step time and MFU",
        "",
        f"{meta['date']}, jax {meta['jax']}, on {meta['host']} ({meta['cpus']} CPUs, no GPU "
        "needed). Every time here is an **estimate** (`jaxmem.memory.step_time`), never a "
        "measurement; `benchmarks/gpu_check.py` measures steps on a GPU to calibrate it. bf16 "
        "compute, fp32 master weights, AdamW, one step. *Before compile*: what `jaxmem plan` "
        "orders by (the gradient's jaxpr, elementwise chains assumed fused); *compiled plan*: "
        "the same model priced from the XLA:CUDA deviceless plan's kernels. MFU: model FLOPs "
        "(the step's matmuls without recompute, 3 x the forward: PaLM's definition, as "
        "torchtitan and Megatron count) over the step time and the bf16 dense peak (H100 989, "
        "A100 312 TFLOP/s). Per device; fsdp=8: one host of 8 GPUs.",
        "",
        "| model | tokens/device | policy | target | est. ms (before compile) | MFU | est. ms "
        "(compiled plan) | MFU | matmuls / memory-bound / exposed transfers ms | matmul "
        "efficiency | planned peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        b, c = r["before_compile"], r["compiled"]
        exposed = c["seconds"] - c["compute"]
        target = r["target"] + (f" ({r['mesh']})" if r["mesh"] else "")
        fits = "" if r["fits"] else " (over)"
        lines.append(
            f"| {r['model']} | {r['tokens_per_device']:,} | {r['policy']} | {target} | "
            f"{b['seconds'] * 1e3:,.1f} | {b['mfu']:.1%} | {c['seconds'] * 1e3:,.1f} | "
            f"{c['mfu']:.1%} | {(c['matmul'] + c['attention']) * 1e3:,.1f} / "
            f"{(c['memory_bound'] + c['launches']) * 1e3:,.1f} / {exposed * 1e3:,.1f} | "
            f"{c['matmul_efficiency']:.0%} | {r['planned_peak_bytes'] / GIB:,.2f}{fits} |"
        )
    lines += ["", "## Published MFU of the nearest configurations", ""]
    seen = set()
    for r in report["rows"]:
        for ref in r["references"]:
            key = ref["configuration"]
            if key in seen:
                continue
            seen.add(key)
            mine = [x for x in report["rows"] if ref in x["references"]]
            ours = ", ".join(
                f"{x['policy']} on {x['target']}: {x['compiled']['mfu']:.1%}" for x in mine
            )
            lines.append(
                f"- {ref['configuration']}: **{ref['mfu']}** ({ref['source']}); jaxmem's "
                f"estimate for llama-3-8b fsdp=8, 1 x 8192 per device: {ours}."
            )
    first = report["rows"][0]["compiled"]
    lines += [
        "",
        "Rows without a peer: no published MFU for a model this small on one GPU.",
        "",
        f"Assumptions (each row's own in the JSON): {first['assumptions']}.",
        "",
        "What the estimate leaves out, so that a measured step is expected slower: kernel "
        "autotuning (a deviceless compile runs none), the data pipeline and the host's Python, "
        "stragglers and network contention across hosts, and any overlap beyond the stated "
        "fractions.",
    ]
    write_atomic(path, "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/mfu")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    parser.add_argument("--rows", default="", help="row indices to run (default: all)")
    args = parser.parse_args()
    json_path = os.path.join(args.out, "mfu.json")
    if args.render:
        with open(json_path) as f:
            render(json.load(f), os.path.join(args.out, "mfu.md"))
        return
    chosen = [int(i) for i in args.rows.split(",") if i] or range(len(ROWS))
    started = time.perf_counter()
    rows = [r for i in chosen for r in measure(ROWS[i])]
    report = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "jax": jax.__version__,
            "seconds": time.perf_counter() - started,
        },
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    write_json_atomic(json_path, report)
    render(report, os.path.join(args.out, "mfu.md"))
    print(f"wrote {json_path} and mfu.md")


if __name__ == "__main__":
    main()

# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""The largest model one GPU trains, with its state on the device, with the optimizer state in
host memory, and streamed through host memory (``--stream``), planned without a GPU (needs
``jaxmem[gpu-plan]``).

    python benchmarks/streaming.py --out benchmarks/results/streaming

One sequence of 2048 tokens, bf16 compute with fp32 master weights (fp16 with dynamic loss
scaling on the V100, which has no bf16 tensor cores), AdamW, the ``full`` policy (the fewest
activations), for each target and GPT/Llama preset:

- **on the device**: the compiled plan's planned peak (``memory_analysis()``);
- **state on host**: that plan without the optimizer state (``--state-memory pinned_host``'s
  lower bound, counted from shapes: a deviceless compile drops argument memory kinds);
- **streamed**: the streamed step's plan (``jaxmem.planner.plans.stream_plan``: XLA's device
  temporaries and host bytes, corrected from shapes for the host-resident stack and donation),
  its host memory, and the step's host-link transfers over the target's datasheet bandwidth
  beside the matmul time at its datasheet rate (estimates, labelled);
- **at speed**: the streamed step with its update in host memory (ZeRO-Offload's design), at
  batches 1, 2, 4, ... until its plan no longer fits: the batch whose estimated step time
  (``jaxmem.memory.step_time``, the compiled plan's kernels and the transfers from shapes)
  gives the most TFLOP/s, beside ZeRO-Offload's figure.

Fits: planned peak <= the target's memory (jaxmem's check). Rows are kept in
``<out>/streaming.partial.json`` as they are measured, so a stopped run resumes.
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
from jaxmem.memory.targets import get_target, rates_for
from jaxmem.planner.plans import plan_step
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

TARGETS = ("h100", "v100-32gb", "a10-24gb")
MODELS = ("llama-3.2-3b", "gpt3-6.7b", "gpt3-13b", "llama-3-8b", "llama-3-70b")
SEQ, BATCH, POLICY = 2048, 1, "full"
GIB = 2**30
# the V100 has fp16 tensor cores only (125 TFLOP/s; bf16 runs at its fp32 rate)
PRECISION = {"v100-32gb": "fp16"}
MAX_BATCH = 64
ZERO_OFFLOAD = (
    "ZeRO-Offload (Ren et al., 2021): 13 B parameters on one 32 GB V100 at about 40 TFLOPS, fp16 "
    "parameters and gradients over PCIe, the update on the CPU"
)


def precision_of(target_name: str):
    return PRECISIONS[PRECISION.get(target_name, "bf16")]


def one_sequence(target_name: str, preset: str) -> StepSpec:
    """``preset``'s step of ``BATCH`` x ``SEQ`` tokens under ``POLICY`` at the target's precision,
    compiled for ``target_name``, its AdamW state on the device (each part replaces what it
    varies: the optimizer's streaming, the batch)."""
    return StepSpec(
        model=PRESETS[preset],
        policy=POLICIES[POLICY],
        precision=precision_of(target_name),
        batch=BATCH,
        seq_len=SEQ,
        target=get_target(target_name),
    )


def at_speed(target_name: str, preset: str) -> dict:
    """The streamed step (update in host memory) at batches 1, 2, 4, ... while its plan fits:
    each batch's planned peak and estimated step time, and the batch with the most estimated
    model TFLOP/s."""
    from jaxmem.memory import analytic

    spec = one_sequence(target_name, preset)
    spec = spec.replace(optimizer=OptimizerConfig(stream=True, stream_update="host"))
    target, cfg, prec = spec.target, spec.model, spec.precision
    tried = []
    batch = 1
    while batch <= MAX_BATCH:
        r = plan_step(spec.replace(batch=batch))
        est = r["step_time"]
        model = analytic.mfu_flops(cfg, batch, SEQ)
        row = {
            "batch": batch,
            "planned_peak_bytes": r["planned_peak_bytes"],
            "fits": r["planned_peak_bytes"] <= target.device_memory_bytes,
            "seconds": est["seconds"],
            "compute_seconds": est["compute"],
            "link_seconds": est["state"],
            "host_update_seconds": est["host_update"],
            "model_tflops": model / est["seconds"] / 1e12,
            "executed_tflops": est["executed_flops"] / est["seconds"] / 1e12,
            "mfu": est["mfu"],
        }
        tried.append(row)
        print(f"  {target_name} {preset} batch {batch}: {row}", flush=True)
        if not row["fits"]:
            break
        batch *= 2
    fitting = [t for t in tried if t["fits"]]
    best = max(fitting, key=lambda t: t["model_tflops"]) if fitting else None
    return {
        "precision": prec.name,
        "update": "host",
        "tried": tried,
        "best": best,
        "assumptions": r["step_time"]["assumptions"],
        "source": r["step_time"]["source"],
    }


def measure(target_name: str, preset: str) -> dict:
    spec = one_sequence(target_name, preset)
    target, cfg, prec = spec.target, spec.model, spec.precision
    start = time.perf_counter()
    plain = plan_step(spec)
    state = 8 * cfg.n_params  # AdamW's two fp32 moments (analytic, from the shapes)
    streamed = plan_step(spec.replace(optimizer=OptimizerConfig(stream=True)))
    info = streamed["stream"]
    rates = rates_for(target)
    # forward, backward (2x) and full's replay of the forward: 8 N tokens (analytic estimate)
    flops = 8 * cfg.n_params * BATCH * SEQ
    limit = target.device_memory_bytes
    speed = at_speed(target_name, preset) if streamed["planned_peak_bytes"] <= limit else None
    return {
        "target": target_name,
        "preset": preset,
        "precision": prec.name,
        "n_params": cfg.n_params,
        "at_speed": speed,
        "device_peak_bytes": plain["planned_peak_bytes"],
        "state_on_host_peak_bytes": plain["planned_peak_bytes"] - state,
        "streamed_peak_bytes": streamed["planned_peak_bytes"],
        "streamed_host_bytes": info["host_peak_bytes"],
        "fits": {
            "device": plain["planned_peak_bytes"] <= limit,
            "state_on_host": plain["planned_peak_bytes"] - state <= limit,
            "streamed": streamed["planned_peak_bytes"] <= limit,
        },
        "transfer_bytes": info["transfers"]["total_bytes"],
        "transfer_seconds": info["transfers"]["seconds"],
        "matmul_seconds": flops / rates.matmul_flops[prec.compute_dtype],
        "stream_source": info["source"],
        "transfer_source": info["transfers"]["source"],
        "compiler": streamed["compiler"],
        "seconds": round(time.perf_counter() - start, 1),
    }


def _cell(r: dict, key: str, fit: str) -> str:
    return f"{r[key] / GIB:,.2f}" + ("" if r["fits"][fit] else " (no)")


def _largest(rows: list[dict], fit: str) -> str:
    ok = [r for r in rows if r["fits"][fit]]
    return max(ok, key=lambda r: r["n_params"])["preset"] if ok else "none"


def to_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# The largest model one GPU trains",
        "",
        f"{meta['date']}, jax {meta['jax']}, on {meta['host']}. One sequence of {SEQ} tokens, "
        "bf16 compute with fp32 master weights (fp16 with dynamic loss scaling on the V100, "
        f"which has no bf16 tensor cores), AdamW, policy `{POLICY}`. Planned peak GiB per "
        "device: *on the device* is the compiled plan (`memory_analysis()` of the XLA:CUDA "
        "deviceless compile); *state on host* is that plan less the AdamW moments (from "
        "shapes: `--state-memory pinned_host`'s lower bound); *streamed* is the streamed step's "
        "plan (`--stream`), corrected from shapes for the host-resident stack and donation, "
        "with the host memory it needs. *Transfers* and *matmuls* are estimates: the streamed "
        "step's host-link bytes (from shapes) over the target's datasheet bandwidth, and "
        f"8 N x {SEQ} matmul FLOPs (forward, backward, full's replay) at its datasheet rate "
        "for the compute type; a step takes at least the larger of the two.",
        "",
        "| target | model | params | on the device | state on host | streamed | host (streamed) "
        "| transfers s | matmuls s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"].values():
        lines.append(
            f"| {r['target']} | {r['preset']} | {r['n_params'] / 1e9:.1f} B | "
            f"{_cell(r, 'device_peak_bytes', 'device')} | "
            f"{_cell(r, 'state_on_host_peak_bytes', 'state_on_host')} | "
            f"{_cell(r, 'streamed_peak_bytes', 'streamed')} | "
            f"{r['streamed_host_bytes'] / GIB:,.0f} | "
            f"{r['transfer_seconds']:.1f} | {r['matmul_seconds']:.2f} |"
        )
    lines += ["", "## The largest preset that fits, per target", ""]
    lines += ["| target | on the device | state on host | streamed |", "|---|---|---|---|"]
    for t in TARGETS:
        rows = [r for r in result["rows"].values() if r["target"] == t]
        cells = [_largest(rows, fit) for fit in ("device", "state_on_host", "streamed")]
        lines.append(f"| {t} | {' | '.join(cells)} |")
    lines += [
        "",
        "## At speed: the batch with the most TFLOP/s",
        "",
        "The streamed step with its update in host memory (`--stream --stream-update host`, "
        "ZeRO-Offload's design), planned at batches 1, 2, 4, ... of 2048-token sequences while "
        "its plan fits; per row the batch whose **estimated** step time gives the most model "
        "TFLOP/s (the step's matmuls without recompute) and that time's parts: compute (the "
        "compiled plan's kernels), the host link (the stack's parameters in, twice under "
        "`full`, and gradients out, from shapes) and the update in host memory (assumed rate), "
        "both assumed exposed. Executed TFLOP/s counts `full`'s replay too.",
        "",
        "| target | model | compute | best batch | est. step s | compute / link / host update s "
        "| model TFLOP/s | executed TFLOP/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    assumptions = None
    for r in result["rows"].values():
        speed = r.get("at_speed")
        if not speed or not speed["best"]:
            continue
        b = speed["best"]
        assumptions = speed["assumptions"]
        lines.append(
            f"| {r['target']} | {r['preset']} | {speed['precision']} | {b['batch']} | "
            f"{b['seconds']:.1f} | {b['compute_seconds']:.1f} / {b['link_seconds']:.1f} / "
            f"{b['host_update_seconds']:.1f} | {b['model_tflops']:.1f} | "
            f"{b['executed_tflops']:.1f} | {b['mfu']:.1%} |"
        )
    lines += [
        "",
        f"{ZERO_OFFLOAD}: the V100 gpt3-13b row is its setting.",
    ]
    if assumptions:
        lines += ["", f"Estimate's assumptions: {assumptions}."]
    return "\n".join(lines) + "\n"


# where the streamed stack's update runs (--stream-update): device block by block vs host memory
UPDATE_ROWS = (("v100-32gb", "gpt3-13b"), ("a10-24gb", "gpt3-13b"))


def update_rows() -> dict:
    """The streamed step of ``UPDATE_ROWS`` with its update on the device and in host memory:
    planned device peak, host memory, host-link bytes and their estimated seconds."""
    out = {}
    for target_name, preset in UPDATE_ROWS:
        spec = one_sequence(target_name, preset).replace(precision=PRECISIONS["bf16"])
        for update in ("device", "host"):
            start = time.perf_counter()
            opt = OptimizerConfig(stream=True, stream_update=update)
            r = plan_step(spec.replace(optimizer=opt))
            info = r["stream"]
            out[f"{target_name} {preset} {update}"] = {
                "target": target_name,
                "preset": preset,
                "update": update,
                "planned_peak_bytes": r["planned_peak_bytes"],
                "host_bytes": info["host_peak_bytes"],
                "transfer_bytes": info["transfers"]["total_bytes"],
                "transfer_seconds": info["transfers"]["seconds"],
                "transfer_source": info["transfers"]["source"],
                "host_update": info["transfers"].get("host_update"),
                "compiler": r["compiler"],
                "seconds": round(time.perf_counter() - start, 1),
            }
            print(
                f"{target_name} {preset} update {update}: {out[f'{target_name} {preset} {update}']}"
            )
    return out


def update_markdown(rows: dict, meta: dict) -> str:
    lines = [
        "# Where a streamed step updates: device or host memory",
        "",
        f"{meta['date']}, jax {meta['jax']}, on {meta['host']}. `--stream` with `--stream-update "
        f"device` (the stack's AdamW update block by block on the device: parameters, gradient "
        f"and both moments brought over and sent back) and `host` (in host memory, "
        f'`compute_on("device_host")`: only parameters and gradients cross the link). One '
        f"sequence of {SEQ} tokens, bf16 compute with fp32 master weights, policy `{POLICY}`. "
        "Planned peak: the XLA:CUDA deviceless compile, corrected from shapes as in "
        "`streaming.md`; transfers: host-link bytes from shapes over the datasheet bandwidth "
        "(estimate); host update: the bytes of host memory the update reads and writes, from "
        "shapes, over an assumed rate (estimate; rates below). Neither assumes any overlap with "
        "the device's compute; `jaxmem plan --state-offload` weighs the two the same way.",
        "",
        "| target | model | update | planned peak GiB | host GiB | transfers GiB | transfers s "
        "| host update GiB | host update s | sum s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    sources = {}
    for r in rows.values():
        host = r.get("host_update") or {"bytes": 0, "seconds": 0.0}
        if r.get("host_update"):
            sources[r["target"]] = host["source"]
        lines.append(
            f"| {r['target']} | {r['preset']} | {r['update']} | "
            f"{r['planned_peak_bytes'] / GIB:,.2f} | {r['host_bytes'] / GIB:,.0f} | "
            f"{r['transfer_bytes'] / GIB:,.1f} | {r['transfer_seconds']:.1f} | "
            f"{host['bytes'] / GIB:,.1f} | {host['seconds']:.1f} | "
            f"{r['transfer_seconds'] + host['seconds']:.1f} |"
        )
    lines.append("")
    lines += [f"- {target}: {source}" for target, source in sources.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/streaming")
    parser.add_argument(
        "--updates",
        action="store_true",
        help="only the device vs host update rows (host_update.json/.md)",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.updates:
        meta = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU needed)",
            "jax": jax.__version__,
        }
        rows = update_rows()
        stem = os.path.join(args.out, "host_update")
        write_json_atomic(stem + ".json", {"rows": rows, "meta": meta})
        write_atomic(stem + ".md", update_markdown(rows, meta))
        print(f"wrote {stem}.json and .md")
        return
    stem = os.path.join(args.out, "streaming")
    partial = stem + ".partial.json"
    rows: dict = {}
    if os.path.exists(partial):
        with open(partial) as f:
            rows = json.load(f)
    started = time.perf_counter()
    for target in TARGETS:
        for preset in MODELS:
            key = f"{target} {preset}"
            if key in rows:
                continue
            rows[key] = measure(target, preset)
            r = rows[key]
            print(
                f"{key}: device {r['device_peak_bytes'] / GIB:.2f}, streamed "
                f"{r['streamed_peak_bytes'] / GIB:.2f} GiB, host "
                f"{r['streamed_host_bytes'] / GIB:.0f} GiB ({r['seconds']} s)",
                flush=True,
            )
            write_json_atomic(partial, rows)
    result = {
        "rows": rows,
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU needed)",
            "jax": jax.__version__,
            "seconds_this_run": round(time.perf_counter() - started),
            "targets": {t: get_target(t).description for t in TARGETS},
        },
    }
    write_json_atomic(stem + ".json", result)
    write_atomic(stem + ".md", to_markdown(result))
    os.remove(partial)
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()

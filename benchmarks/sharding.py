# ruff: noqa: E402  (JAX is configured before it starts, on purpose)
"""Per-device memory of the sharded train step (issue 14): data-parallel strategies × device
count, from compiled plans, and which strategy × policy lets a model fit 8 × 80 GB H100s.

- ``cpu``: ``small`` (fp32, AdamW), 8 rows of 128 tokens per device, N = 1, 2, 4, 8 CPU
  devices in this process, every strategy × {full, selective}: the per-device record
  (parameters, gradients and optimizer state from shard shapes; saved activations of one
  device's rows, residual accounting; the XLA:CPU plan of one device).
- ``h100``: the same for gpt2-1.5b (bf16, 8 rows of 1024 tokens per device) compiled for one
  host of N H100s without any GPU.
- ``fit``: gpt2-1.5b and gpt3-6.7b on 8 H100s (bf16, AdamW, 1 row of 1024 tokens per device),
  every strategy × {none, full, selective}: the planned peak per device against 80 GB.

Writes ``benchmarks/results/sharding/{sharding.json,sharding.md,per_device_vs_n.png}``.

    python benchmarks/sharding.py [--parts cpu,h100,fit]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()
import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.records import jax_record
from jaxmem.memory.targets import LOCAL, get_target
from jaxmem.parallel import STRATEGIES, ParallelConfig
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS

NS = (1, 2, 4, 8)
MIB, GB = 1 << 20, 1e9
PARTS = {
    "cpu": {"preset": "small", "precision": "fp32", "rows": 8, "seq": 128, "target": "cpu"},
    "h100": {"preset": "gpt2-1.5b", "precision": "bf16", "rows": 8, "seq": 1024, "target": "h100"},
}
FIT_PRESETS = ("gpt2-1.5b", "gpt3-6.7b")
FIT_POLICIES = ("none", "full", "selective")


def _row(rec: dict, **keys) -> dict:
    return keys | {
        "params_bytes": rec["params_bytes"],
        "grads_bytes": rec["grads_bytes"],
        "opt_state_bytes": rec["opt_state_bytes"],
        "saved_bytes": rec["saved_activation_bytes_device"] + rec["saved_activation_bytes_host"],
        "temp_bytes": rec["compiled_temp_bytes"],
        "planned_peak_bytes": rec["planned_peak_bytes"],
        "flops": rec["flops"],
        "compiler": rec["compiler"],
        "fits": rec["fits"],
    }


def scaling(part: str) -> list[dict]:
    spec = PARTS[part]
    cfg = get_preset(spec["preset"])
    target = LOCAL if spec["target"] == "cpu" else get_target(spec["target"])
    rows = []
    for policy in ("full", "selective"):
        for strategy in STRATEGIES:
            for n in NS:
                start = time.perf_counter()
                rec = jax_record(
                    cfg,
                    POLICIES[policy],
                    PRECISIONS[spec["precision"]],
                    OptimizerConfig(),
                    spec["rows"] * n,
                    spec["seq"],
                    abstract=True,
                    target=target,
                    parallel=ParallelConfig(strategy=strategy, devices=n),
                )
                rows.append(_row(rec, part=part, policy=policy, strategy=strategy, devices=n))
                print(
                    f"{part} {policy} {strategy}={n}: peak "
                    f"{rec['planned_peak_bytes'] / MIB:,.1f} MiB per device "
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    return rows


def fit() -> list[dict]:
    target = get_target("h100")
    rows = []
    for preset in FIT_PRESETS:
        cfg = get_preset(preset)
        for policy in FIT_POLICIES:
            for strategy in STRATEGIES:
                start = time.perf_counter()
                rec = jax_record(
                    cfg,
                    POLICIES[policy],
                    PRECISIONS["bf16"],
                    OptimizerConfig(),
                    8,
                    1024,
                    target=target,
                    parallel=ParallelConfig(strategy=strategy, devices=8),
                )
                rows.append(_row(rec, part="fit", preset=preset, policy=policy, strategy=strategy))
                print(
                    f"fit {preset} {policy} {strategy}=8: {rec['planned_peak_bytes'] / GB:.2f} GB "
                    f"per device, fits {rec['fits']} ({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    return rows


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# Sharded train step, per device ({meta['date']}, {meta['host']}, jax {meta['jax']})",
        "",
        "Every figure is one device's, planned from shapes (nothing runs): parameters, gradients "
        "and optimizer state from each leaf's shard shape; saved activations by residual "
        "accounting of one device's rows of the batch; temporaries and planned peak (arguments + "
        "outputs − donated + temporaries) from the compiled plan of the sharded step. The batch "
        "grows with N (a fixed number of rows per device). `python benchmarks/sharding.py`.",
    ]
    for part in ("cpu", "h100"):
        rows = [r for r in result["rows"] if r["part"] == part]
        if not rows:
            continue
        spec = PARTS[part]
        unit, scale = ("MiB", MIB) if part == "cpu" else ("GB", GB)
        lines += [
            "",
            f"## {spec['preset']}, {spec['precision']}, AdamW, {spec['rows']} × {spec['seq']} "
            f"tokens per device; plan: {rows[0]['compiler'].split(', per device')[0]}",
            "",
            f"| policy | strategy | N | params {unit} | grads {unit} | optimizer {unit} "
            f"| saved {unit} | temp {unit} | planned peak {unit} | peak / N=1 |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            base = next(
                b
                for b in rows
                if b["policy"] == r["policy"]
                and b["strategy"] == r["strategy"]
                and b["devices"] == 1
            )
            lines.append(
                f"| {r['policy']} | {r['strategy']} | {r['devices']} "
                f"| {r['params_bytes'] / scale:,.2f} | {r['grads_bytes'] / scale:,.2f} "
                f"| {r['opt_state_bytes'] / scale:,.2f} | {r['saved_bytes'] / scale:,.2f} "
                f"| {r['temp_bytes'] / scale:,.2f} | {r['planned_peak_bytes'] / scale:,.2f} "
                f"| {r['planned_peak_bytes'] / base['planned_peak_bytes']:.3f} |"
            )
    rows = [r for r in result["rows"] if r["part"] == "fit"]
    if rows:
        lines += [
            "",
            "## What fits 8 × 80 GB H100 (bf16, AdamW, 1 × 1024 tokens per device; plans for "
            "one host of 8 H100s, no GPU)",
            "",
            "| model | policy | strategy | params GB | optimizer GB | temp GB | planned peak GB "
            "| fits 80 GB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['preset']} | {r['policy']} | {r['strategy']} "
                f"| {r['params_bytes'] / GB:.2f} | {r['opt_state_bytes'] / GB:.2f} "
                f"| {r['temp_bytes'] / GB:.2f} | {r['planned_peak_bytes'] / GB:.2f} "
                f"| {'yes' if r['fits'] else 'no'} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("cpu", "h100") if any(r["part"] == p for r in result["rows"])]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        unit, scale = ("MiB", MIB) if part == "cpu" else ("GB", GB)
        for strategy, color in zip(STRATEGIES, ("C0", "C1", "C2"), strict=True):
            for policy, style in (("full", "-"), ("selective", "--")):
                pts = sorted(
                    (r["devices"], r["planned_peak_bytes"] / scale)
                    for r in result["rows"]
                    if r["part"] == part and r["strategy"] == strategy and r["policy"] == policy
                )
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, color=color, marker="o", label=f"{strategy}, {policy}")
        spec = PARTS[part]
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices N")
        ax.set_ylabel(f"planned peak per device, {unit}")
        ax.set_title(f"{spec['preset']} {spec['precision']} ({spec['target']} plan)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Per-device memory of the sharded train step vs N (fixed rows per device)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="cpu,h100,fit")
    parser.add_argument("--out", default="benchmarks/results/sharding")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sharding.json")
    old = []
    if os.path.exists(path):  # parts not measured now keep their last rows
        with open(path) as f:
            old = [r for r in json.load(f)["rows"] if r["part"] not in parts]
    started = time.perf_counter()
    rows = list(old)
    for part in parts:
        rows += fit() if part == "fit" else scaling(part)
    result = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU)",
            "jax": jax.__version__,
            "parts_measured": parts,
            "seconds": round(time.perf_counter() - started),
        },
        "rows": rows,
    }
    write_json_atomic(path, result)
    write_atomic(os.path.join(args.out, "sharding.md"), markdown(result))
    plot(result, os.path.join(args.out, "per_device_vs_n.png"))
    print(markdown(result))


if __name__ == "__main__":
    main()

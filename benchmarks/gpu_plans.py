# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""The train step's memory plan compiled for a GPU target without a GPU, per model and policy
(``jaxmem.memory.records.jax_record`` with ``target=``; needs ``jaxmem[gpu-plan]``). JAX only:
no PyTorch needed.

    python benchmarks/gpu_plans.py --target h100 --out benchmarks/results/gpu_plans

Every figure is labelled in the output: device temporaries, arguments and host bytes come from
``memory_analysis()`` of the plan XLA:CUDA compiled for the target; saved activations from
residual accounting (the jaxpr of ``jax.vjp``); the analytic column from
``jaxmem.memory.analytic`` (the block stack only); FLOPs from the gradient's jaxpr.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()  # before JAX starts: CPU backend, no plugin start-up noise
import jax

from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.records import jax_record
from jaxmem.memory.targets import get_target
from jaxmem.policy import POLICIES
from jaxmem.precision import get_precision

# batch x sequence as these models are trained (GPT-2: 1024 tokens; GPT-3: 2048)
SHAPES = {
    "gpt2-124m": (8, 1024),
    "gpt2-355m": (8, 1024),
    "gpt2-774m": (8, 1024),
    "gpt2-1.5b": (8, 1024),
    "gpt3-6.7b": (1, 2048),
}
GB = 1e9


def measure(target_name: str, presets: list[str], policies: list[str], precision: str) -> list:
    target = get_target(target_name)
    rows = []
    for preset in presets:
        cfg = get_preset(preset)
        batch, seq_len = SHAPES[preset]
        for name in policies:
            start = time.perf_counter()
            rec = jax_record(
                cfg,
                POLICIES[name],
                get_precision(precision),
                OptimizerConfig(),
                batch,
                seq_len,
                target=target,
            )
            rec["preset"] = preset
            rec["seconds_to_plan"] = round(time.perf_counter() - start, 1)
            print(
                f"{preset} {name}: planned peak {rec['planned_peak_bytes'] / GB:.2f} GB", flush=True
            )
            rows.append(rec)
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Train-step plans compiled for {meta['target']['description']} without a GPU "
        f"({rows[0]['compiler']}), {meta['precision']}, AdamW; {meta['date']}, jax "
        f"{meta['jax']}, on {meta['host']}. Device temp, arguments and host: the plan's "
        "`memory_analysis()`; planned peak = arguments + outputs - aliased + temporaries; fits = "
        f"planned peak <= {meta['target']['device_memory_bytes'] / GB:.1f} GB (jaxmem's check: a "
        "deviceless compile never fails for lack of memory). Saved: residual accounting (jaxpr "
        "of `jax.vjp`); analytic: `jaxmem.memory.analytic` (the block stack only); GFLOP: matmul "
        "FLOPs of the gradient's jaxpr, recompute included.",
        "",
        "| model | batch × seq | policy | device temp GB | arguments GB | host GB | planned peak "
        "GB | fits | saved device GB | saved host GB | analytic GB | GFLOP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["compiled_plan"]
        lines.append(
            f"| {r['preset']} | {r['batch']} × {r['seq_len']} | {r['policy']} | "
            f"{p['temp_bytes'] / GB:.2f} | {p['argument_bytes'] / GB:.2f} | "
            f"{r['plan_host_bytes'] / GB:.2f} | {r['planned_peak_bytes'] / GB:.2f} | "
            f"{'yes' if r['fits'] else 'no'} | {r['saved_activation_bytes_device'] / GB:.2f} | "
            f"{r['saved_activation_bytes_host'] / GB:.2f} | "
            f"{r['analytic_activation_bytes'] / GB:.2f} | {r['flops'] / 1e9:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, policy in enumerate(policies):
        peaks = [
            next(
                r["planned_peak_bytes"] for r in rows if r["preset"] == p and r["policy"] == policy
            )
            / GB
            for p in presets
        ]
        ax.bar([i + j * width for i in range(len(presets))], peaks, width, label=policy)
    ax.axhline(meta["target"]["device_memory_bytes"] / GB, color="k", ls="--", lw=1)
    ax.text(0, meta["target"]["device_memory_bytes"] / GB, " device memory", va="bottom")
    ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(presets))])
    ax.set_xticklabels([f"{p}\n{SHAPES[p][0]}×{SHAPES[p][1]}" for p in presets])
    ax.set_yscale("log")
    ax.set_ylabel("planned peak, GB (compiled plan, log scale)")
    ax.set_title(f"train step planned for {meta['target']['description']} ({meta['precision']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--presets", default=",".join(SHAPES))
    parser.add_argument("--policies", default="none,full,selective,offload,nested")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--out", default="benchmarks/results/gpu_plans")
    args = parser.parse_args()
    presets, policies = args.presets.split(","), args.policies.split(",")
    target = get_target(args.target)
    rows = measure(args.target, presets, policies, args.precision)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU needed)",
        "jax": jax.__version__,
        "precision": args.precision,
        "target": {
            "name": target.name,
            "description": target.description,
            "device_memory_bytes": target.device_memory_bytes,
            "config": target.source,
        },
    }
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{target.name}_{args.precision}")
    write_json_atomic(stem + ".json", {"meta": meta, "rows": rows})
    write_atomic(stem + ".md", to_markdown(rows, meta))
    plot(rows, meta, stem + ".png")
    print(f"wrote {stem}.json, .md, .png")


if __name__ == "__main__":
    main()

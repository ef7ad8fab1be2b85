"""Headline figures: a GPT-3-shaped layer scaled to CPU (h 512, 32 heads, seq 256: a·s/h = 16 as
in GPT-3 175B), 4 layers, batch 2. For none / selective / full / offload in both frameworks:
saved activation bytes (device, host) and matmul FLOPs, as ratios against ``none``, checked
against the targets:

- selective: <= 0.5x none's bytes at <= 3 % extra FLOPs;
- full: <= 23 % extra FLOPs;
- offload (selective's FLOPs): device bytes within 1.1x of full's.

Saved bytes: JAX residual accounting, torch live-tensor accounting (both include the embedding,
LM-head and loss tensors outside the blocks). FLOPs: JAX from the gradient's jaxpr, torch from
FlopCounterMode. Writes benchmarks/results/headline.{json,md}.

    python benchmarks/headline.py
"""

from __future__ import annotations

import datetime
import json
import os
import platform

import jax
import torch
from jaxmem.remat import POLICIES
from jaxmem.report import jax_record, torch_record

from jaxmem.config import ModelConfig, OptimizerConfig
from jaxmem.precision import PRECISIONS

CFG = ModelConfig(vocab_size=259, d_model=512, n_heads=32, n_layers=4, d_ff=2048, max_seq_len=256)
BATCH, SEQ = 2, 256
POLICY_NAMES = ("none", "selective", "full", "offload")


def main() -> None:
    out_dir = "benchmarks/results"
    rows = []
    for precision in ("fp32", "bf16"):
        for fw, record in (("jax", jax_record), ("torch", torch_record)):
            recs = {
                n: record(CFG, POLICIES[n], PRECISIONS[precision], OptimizerConfig(), BATCH, SEQ)
                for n in POLICY_NAMES
            }
            base = recs["none"]
            for n, r in recs.items():
                rows.append(
                    {
                        "framework": fw,
                        "precision": precision,
                        "policy": n,
                        "saved_device_bytes": r["saved_activation_bytes_device"],
                        "saved_host_bytes": r["saved_activation_bytes_host"],
                        "analytic_bytes": r["analytic_activation_bytes"],
                        "flops": r["flops"],
                        "bytes_vs_none": r["saved_activation_bytes_device"]
                        / base["saved_activation_bytes_device"],
                        "flops_vs_none": r["flops"] / base["flops"],
                        "device_bytes_vs_full": r["saved_activation_bytes_device"]
                        / recs["full"]["saved_activation_bytes_device"],
                        "saved_source": r["saved_source"],
                        "flops_source": r["flops_source"],
                    }
                )
    checks = []
    for r in rows:
        if r["policy"] == "selective":
            ok = r["bytes_vs_none"] <= 0.5 and r["flops_vs_none"] <= 1.03
            checks.append((r, "selective <= 0.5x bytes at <= 3 % FLOPs", ok))
        if r["policy"] == "full":
            checks.append((r, "full <= 23 % extra FLOPs", r["flops_vs_none"] <= 1.23))
        if r["policy"] == "offload":
            checks.append(
                (r, "offload device bytes <= 1.1x full's", r["device_bytes_vs_full"] <= 1.1)
            )
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": f"{jax.devices()[0].platform.upper()} ({os.cpu_count()} cores)",
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
        "config": CFG.__dict__,
        "batch": BATCH,
        "seq_len": SEQ,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "headline.json"), "w") as f:
        json.dump(
            {
                "meta": meta,
                "results": rows,
                "checks": [
                    {
                        "framework": r["framework"],
                        "precision": r["precision"],
                        "target": t,
                        "met": ok,
                    }
                    for r, t, ok in checks
                ],
            },
            f,
            indent=2,
        )
    mib = 1 << 20
    lines = [
        f"GPT-3-shaped layer scaled to CPU (d 512, 32 heads, seq 256, d_ff 2048, 4 layers, batch "
        f"2); {meta['device']}, {meta['date']}. Saved bytes: JAX residual accounting / torch "
        "live-tensor accounting, embeddings and loss included; FLOPs: matmul FLOPs executed.",
        "",
        "| framework | precision | policy | saved MiB device + host | bytes / none | FLOPs / none "
        "| device bytes / full |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['framework']} | {r['precision']} | {r['policy']} "
            f"| {r['saved_device_bytes'] / mib:.1f} + {r['saved_host_bytes'] / mib:.1f} "
            f"| {r['bytes_vs_none']:.3f} | {r['flops_vs_none']:.4f} "
            f"| {r['device_bytes_vs_full']:.2f} |"
        )
    lines += ["", "| framework | precision | target | met |", "|---|---|---|---|"]
    lines += [
        f"| {r['framework']} | {r['precision']} | {t} | {'yes' if ok else 'NO'} |"
        for r, t, ok in checks
    ]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "headline.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()

"""Headline figures: a GPT-3-shaped layer scaled to CPU (h 512, 32 heads, seq 256: a·s/h = 16 as
in GPT-3 175B), 4 layers, batch 2. For none / selective / full / offload in JAX, stock PyTorch
(``torch``: ``checkpoint`` and selective checkpointing; offload has no stock API in eager
PyTorch, so its row is torch_ref's extension, marked †) and torch_ref's lean extension
(``torch-lean``, where it differs from stock): saved activation bytes (device, host) and matmul
FLOPs, as ratios against the same framework's ``none``, checked against the targets:

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
import os
import platform

import jax
import torch

from jaxmem.compare.bench import has_lean
from jaxmem.compare.records import torch_record
from jaxmem.config import ModelConfig, OptimizerConfig
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

CFG = ModelConfig(vocab_size=259, d_model=512, n_heads=32, n_layers=4, d_ff=2048, max_seq_len=256)
BATCH, SEQ = 2, 256
POLICY_NAMES = ("none", "selective", "full", "offload")
TARGETS = {
    "selective": (
        "selective <= 0.5x bytes at <= 3 % FLOPs",
        lambda r: r["bytes_vs_none"] <= 0.5 and r["flops_vs_none"] <= 1.03,
    ),
    "full": ("full <= 23 % extra FLOPs", lambda r: r["flops_vs_none"] <= 1.23),
    "offload": ("offload device bytes <= 1.1x full's", lambda r: r["device_bytes_vs_full"] <= 1.1),
}


def records(precision: str) -> dict[str, dict[str, dict]]:
    """framework -> policy -> record. torch-lean only where the extension differs from stock;
    its ratios use stock's none and full (the extension runs those exactly as stock does)."""
    args = (PRECISIONS[precision], OptimizerConfig(), BATCH, SEQ)
    out = {
        "jax": {
            n: jax_record(
                StepSpec(
                    model=CFG,
                    policy=POLICIES[n],
                    precision=PRECISIONS[precision],
                    batch=BATCH,
                    seq_len=SEQ,
                )
            )
            for n in POLICY_NAMES
        },
        "torch": {n: torch_record(CFG, POLICIES[n], *args) for n in POLICY_NAMES},
    }
    out["torch-lean"] = {
        n: torch_record(CFG, POLICIES[n], *args, translation="lean")
        for n in POLICY_NAMES
        if has_lean(POLICIES[n])
    }
    return out


def main() -> None:
    out_dir = "benchmarks/results"
    rows = []
    for precision in ("fp32", "bf16"):
        recs = records(precision)
        for fw, by_policy in recs.items():
            reference = recs["torch"] if fw == "torch-lean" else by_policy
            none, full = reference["none"], reference["full"]
            for n, r in by_policy.items():
                device = r["saved_activation_bytes_device"]
                rows.append(
                    {
                        "framework": fw,
                        "translation": r["translation"],
                        "stock": fw != "torch" or r["translation"].startswith("stock"),
                        "precision": precision,
                        "policy": n,
                        "saved_device_bytes": device,
                        "saved_host_bytes": r["saved_activation_bytes_host"],
                        # compute-dtype copies of the weights the backward keeps: apart
                        "parameter_copy_bytes": r["saved_parameter_copy_bytes"],
                        "analytic_bytes": r["analytic_activation_bytes"],
                        "flops": r["flops"],
                        "bytes_vs_none": device / none["saved_activation_bytes_device"],
                        "flops_vs_none": r["flops"] / none["flops"],
                        "device_bytes_vs_full": device / full["saved_activation_bytes_device"],
                        "saved_source": r["saved_source"],
                        "flops_source": r["flops_source"],
                    }
                )
    # bf16 against fp32's none too (against its own none a bf16 ratio hides that bf16 halves
    # the baseline)
    fp32_none = {
        r["framework"]: r["saved_device_bytes"]
        for r in rows
        if r["precision"] == "fp32" and r["policy"] == "none"
    }
    for r in rows:  # the extension runs none as stock does: its rows use stock's
        base = fp32_none["torch" if r["framework"] == "torch-lean" else r["framework"]]
        r["bytes_vs_fp32_none"] = r["saved_device_bytes"] / base
    checks = [
        (r, TARGETS[r["policy"]][0], TARGETS[r["policy"]][1](r))
        for r in rows
        if r["policy"] in TARGETS
    ]
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
    write_json_atomic(
        os.path.join(out_dir, "headline.json"),
        {
            "meta": meta,
            "results": rows,
            "checks": [
                {"framework": r["framework"], "precision": r["precision"], "target": t, "met": ok}
                for r, t, ok in checks
            ],
        },
    )
    mib = 1 << 20
    lines = [
        f"GPT-3-shaped layer scaled to CPU (d 512, 32 heads, seq 256, d_ff 2048, 4 layers, batch "
        f"2); {meta['device']}, {meta['date']}. Saved bytes: JAX residual accounting / torch "
        "live-tensor accounting, embeddings and loss included, parameter copies (bf16 weight "
        "casts the backward keeps) apart; FLOPs: matmul FLOPs executed. "
        "torch = stock PyTorch († = no stock API in eager PyTorch: torch_ref's extension); "
        "torch-lean = torch_ref's extension (keeps what the backward reads, skips matmuls "
        "nothing reads), where it differs from stock.",
        "",
        "| framework | precision | policy | saved MiB device + host | weight copies MiB "
        "| bytes / none | bytes / fp32 none | FLOPs / none | device bytes / full |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = "" if r["stock"] else " †"
        lines.append(
            f"| {r['framework']}{mark} | {r['precision']} | {r['policy']} "
            f"| {r['saved_device_bytes'] / mib:.1f} + {r['saved_host_bytes'] / mib:.1f} "
            f"| {r['parameter_copy_bytes'] / mib:.1f} "
            f"| {r['bytes_vs_none']:.3f} | {r['bytes_vs_fp32_none']:.3f} "
            f"| {r['flops_vs_none']:.4f} "
            f"| {r['device_bytes_vs_full']:.2f} |"
        )
    lines += ["", "| framework | precision | target | met |", "|---|---|---|---|"]
    lines += [
        f"| {r['framework']} | {r['precision']} | {t} | {'yes' if ok else 'NO'} |"
        for r, t, ok in checks
    ]
    text = "\n".join(lines) + "\n"
    write_atomic(os.path.join(out_dir, "headline.md"), text)
    print(text)


if __name__ == "__main__":
    main()

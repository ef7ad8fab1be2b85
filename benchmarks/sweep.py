"""Memory and FLOPs across strategies, JAX vs PyTorch, with plots.

Axes (each swept on its own around the `small` preset, batch 8):
- policy (all presets) × precision (fp32, bf16), sequence 128;
- depth (2, 4, 8, 12 layers) for none / selective / full / nested, fp32;
- sequence length (64, 128, 256) for none / selective / full, fp32;
- gradient accumulation (1, 2, 4 microbatches of the batch) for none / full: what one microbatch
  keeps for its backward.

Per point: saved activation bytes (JAX residual accounting / torch live-tensor accounting,
device + host), matmul FLOPs executed (JAX jaxpr / torch FlopCounterMode) and JAX's compiled
plan temporaries for jit(grad) (XLA:CPU here: a proxy for a GPU, blind to host offload). Writes
benchmarks/results/sweep.json, sweep.md and three PNGs: bytes per policy (JAX vs torch bars),
memory vs layers, and FLOP overhead vs memory (the Pareto view).

    python benchmarks/sweep.py        # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import datetime
import json
import os
import platform

import jax
import jax.numpy as jnp
import matplotlib
import torch
from flax import nnx

from jaxmem.config import get_preset
from jaxmem.flops import grad_matmul_flops
from jaxmem.memory import compiled_plan, saved_residuals, summarize_residuals
from jaxmem.parity import lm_batch, torch_model_from
from jaxmem.precision import PRECISIONS
from jaxmem.remat import POLICIES, layers_fn
from jaxmem.train import lm_loss_fn, make_model
from torch_ref.memory import measure_lm_step
from torch_ref.remat import apply_memory_policy
from torch_ref.train import TORCH_DTYPES

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = "benchmarks/results"
BATCH = 8


def point(cfg, policy_name, precision_name, batch, seq_len, *, torch_too=True, compile_plan=True):
    policy, prec = POLICIES[policy_name], PRECISIONS[precision_name]
    reference = make_model(cfg)  # fp32 weights shared by both frameworks
    model = make_model(cfg, prec)
    nnx.update(model, nnx.state(reference, nnx.Param))
    graphdef, params = nnx.split(model, nnx.Param)
    inputs, targets = lm_batch(cfg, batch, seq_len)
    data = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
    f = lambda p, b: loss(p, b)[0]  # noqa: E731
    res = summarize_residuals(saved_residuals(f, params, data))
    row = {
        "policy": policy_name,
        "precision": precision_name,
        "n_layers": cfg.n_layers,
        "batch": batch,
        "seq_len": seq_len,
        "jax_device_bytes": res.activation_bytes_device,
        "jax_host_bytes": res.activation_bytes_host,
        "jax_flops": grad_matmul_flops(f, params, data),
        "jax_compiled_temp_bytes": (
            compiled_plan(jax.jit(jax.grad(f)).lower(params, data).compile())["temp_bytes"]
            if compile_plan
            else None
        ),
    }
    if torch_too:
        tm = torch_model_from(reference).to(TORCH_DTYPES[prec.param_dtype])
        runner = apply_memory_policy(tm.blocks, policy)
        x, y = torch.from_numpy(inputs).long(), torch.from_numpy(targets).long()
        live, torch_flops = measure_lm_step(tm, runner, x, y, prec)
        row.update(
            torch_device_bytes=live.device_bytes,
            torch_host_bytes=live.host_bytes,
            torch_flops=torch_flops,
        )
    return row


def main() -> None:
    base = get_preset("small")
    rows = {"policy_precision": [], "depth": [], "seq_len": [], "accum": []}
    for prec in ("fp32", "bf16"):
        for name in POLICIES:
            rows["policy_precision"].append(point(base, name, prec, BATCH, 128, compile_plan=False))
    for depth in (2, 4, 8, 12):
        for name in ("none", "selective", "full", "nested"):
            rows["depth"].append(
                point(
                    base.replace(n_layers=depth),
                    name,
                    "fp32",
                    BATCH,
                    128,
                    torch_too=name != "nested" or depth <= 8,
                )
            )
    for seq in (64, 128, 256):
        for name in ("none", "selective", "full"):
            rows["seq_len"].append(point(base, name, "fp32", BATCH, seq, compile_plan=False))
    for k in (1, 2, 4):
        for name in ("none", "full"):
            r = point(base, name, "fp32", BATCH // k, 128, torch_too=False, compile_plan=False)
            r["accum_steps"] = k
            rows["accum"].append(r)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": f"{jax.devices()[0].platform.upper()} ({os.cpu_count()} cores)",
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
        "base_config": base.__dict__,
        "note": "CPU results: bytes and FLOPs are exact accounting; compiled temps are XLA:CPU's "
        "plan, a proxy for a GPU's",
    }
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "sweep.json"), "w") as f:
        json.dump({"meta": meta, **rows}, f, indent=2)
    write_markdown(rows, meta)
    plot(rows)


def write_markdown(rows, meta) -> None:
    mib = 1 << 20
    lines = [
        f"Sweep around `small`, {meta['device']}, {meta['date']}. Saved bytes: JAX residual "
        "accounting / torch live-tensor accounting (device + host, MiB). FLOPs: matmul GFLOP "
        "executed.",
        "",
        "### policy × precision (seq 128)",
        "",
        "| precision | policy | JAX MiB | torch MiB | JAX GFLOP | torch GFLOP |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows["policy_precision"]:
        lines.append(
            f"| {r['precision']} | {r['policy']} | {r['jax_device_bytes'] / mib:.1f} + "
            f"{r['jax_host_bytes'] / mib:.1f} | {r['torch_device_bytes'] / mib:.1f} + "
            f"{r['torch_host_bytes'] / mib:.1f} | {r['jax_flops'] / 1e9:.2f} | "
            f"{r['torch_flops'] / 1e9:.2f} |"
        )
    lines += [
        "",
        "### depth (fp32, seq 128)",
        "",
        "| layers | policy | JAX MiB | torch MiB | JAX compiled temp MiB (XLA:CPU) |",
        "|---|---|---|---|---|",
    ]
    for r in rows["depth"]:
        t = r.get("torch_device_bytes")
        lines.append(
            f"| {r['n_layers']} | {r['policy']} | {r['jax_device_bytes'] / mib:.1f} | "
            f"{'-' if t is None else f'{t / mib:.1f}'} | {r['jax_compiled_temp_bytes'] / mib:.1f} |"
        )
    lines += [
        "",
        "### sequence length (fp32)",
        "",
        "| seq | policy | JAX MiB | torch MiB |",
        "|---|---|---|---|",
    ]
    for r in rows["seq_len"]:
        lines.append(
            f"| {r['seq_len']} | {r['policy']} | {r['jax_device_bytes'] / mib:.1f} | "
            f"{r['torch_device_bytes'] / mib:.1f} |"
        )
    lines += [
        "",
        "### accumulation (what one microbatch keeps; batch 8 split k ways)",
        "",
        "| k | policy | JAX MiB |",
        "|---|---|---|",
    ]
    for r in rows["accum"]:
        lines.append(f"| {r['accum_steps']} | {r['policy']} | {r['jax_device_bytes'] / mib:.1f} |")
    with open(os.path.join(OUT, "sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(rows) -> None:
    mib = 1 << 20
    fp32 = [r for r in rows["policy_precision"] if r["precision"] == "fp32"]
    names = [r["policy"] for r in fp32]
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(
        [x - 0.2 for x in xs],
        [r["jax_device_bytes"] / mib for r in fp32],
        0.4,
        label="jaxmem (device)",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r["torch_device_bytes"] / mib for r in fp32],
        0.4,
        label="torch_ref (device)",
    )
    ax.bar(
        [x - 0.2 for x in xs],
        [r["jax_host_bytes"] / mib for r in fp32],
        0.4,
        bottom=[r["jax_device_bytes"] / mib for r in fp32],
        alpha=0.4,
        label="jaxmem (host)",
    )
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("saved activations (MiB)")
    ax.set_title("small, batch 8 x seq 128, fp32: bytes kept for the backward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "bytes_per_policy.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("none", "selective", "full", "nested"):
        pts = [r for r in rows["depth"] if r["policy"] == name]
        ax.plot(
            [r["n_layers"] for r in pts],
            [r["jax_device_bytes"] / mib for r in pts],
            "o-",
            label=f"{name} (jaxmem)",
        )
        tp = [r for r in pts if r.get("torch_device_bytes") is not None]
        ax.plot(
            [r["n_layers"] for r in tp],
            [r["torch_device_bytes"] / mib for r in tp],
            "x--",
            label=f"{name} (torch_ref)",
        )
    ax.set_xlabel("layers")
    ax.set_ylabel("saved activations (MiB)")
    ax.set_title("memory vs depth (small, fp32, batch 8 x seq 128)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "memory_vs_layers.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    base = {
        fw: next(r for r in fp32 if r["policy"] == "none")[f"{fw}_flops"] for fw in ("jax", "torch")
    }
    for fw, marker, color in (("jax", "o", "C0"), ("torch", "x", "C3")):
        for r in fp32:
            over = 100 * (r[f"{fw}_flops"] / base[fw] - 1)
            ax.scatter(
                r[f"{fw}_device_bytes"] / mib,
                over,
                marker=marker,
                color=color,
                label=("jaxmem" if fw == "jax" else "torch_ref") if r is fp32[0] else None,
            )
            ax.annotate(r["policy"], (r[f"{fw}_device_bytes"] / mib, over), fontsize=7)
    ax.set_xlabel("device bytes kept (MiB)")
    ax.set_ylabel("extra matmul FLOPs vs none (%)")
    ax.set_title("FLOP overhead vs memory (small, fp32)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "pareto.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

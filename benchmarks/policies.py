"""Saved-activation bytes and matmul FLOPs of every memory policy, jaxmem vs torch_ref.

Per preset × policy × framework, one fp32 training step (forward + backward) on the same weights
and batch:
- saved bytes, JAX: residual accounting (arrays ``jax.vjp`` keeps, from its jaxpr; parameters
  excluded), split device / host memory kind;
- saved bytes, torch: live-tensor accounting (storages the forward allocated and left alive for
  the backward), split device / host;
- FLOPs: matmul FLOPs actually executed — JAX counted from the gradient's jaxpr (scan bodies ×
  length, recompute included), torch from ``torch.utils.flop_counter.FlopCounterMode``;
- JAX compiled temp bytes: ``memory_analysis().temp_size_in_bytes`` of the jitted gradient on
  this backend (XLA:CPU here: a proxy for a GPU's plan, and blind to host offload).

    python benchmarks/policies.py --presets tiny,small --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform

import jax
import jax.numpy as jnp
import torch
from flax import nnx
from jaxmem.flops import grad_matmul_flops
from jaxmem.parity import lm_batch, torch_model_from
from jaxmem.remat import POLICIES, layers_fn

from jaxmem.config import get_preset
from jaxmem.memory import compiled_plan, saved_residuals, summarize_residuals
from jaxmem.model import Decoder
from jaxmem.precision import PRECISIONS
from jaxmem.train import lm_loss_fn
from torch_ref.memory import measure_lm_step
from torch_ref.remat import apply_memory_policy

SHAPES = {"tiny": (8, 64), "small": (8, 128)}


def measure(preset: str, policies: list[str]) -> list[dict]:
    cfg = get_preset(preset)
    batch_size, seq_len = SHAPES.get(preset, (8, min(128, cfg.max_seq_len)))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    torch_model = torch_model_from(model)
    inputs, targets = lm_batch(cfg, batch_size, seq_len)
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    x, y = torch.from_numpy(inputs).long(), torch.from_numpy(targets).long()
    rows = []
    for name in policies:
        policy = POLICIES[name]
        loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
        f = lambda p, b, loss=loss: loss(p, b)[0]  # noqa: E731
        res = summarize_residuals(saved_residuals(f, params, batch))
        plan = compiled_plan(jax.jit(jax.grad(f)).lower(params, batch).compile())
        rows.append(
            {
                "preset": preset,
                "framework": "jax",
                "policy": name,
                "batch": batch_size,
                "seq_len": seq_len,
                "saved_bytes_device": res.activation_bytes_device,
                "saved_bytes_host": res.activation_bytes_host,
                "saved_source": "residual accounting (jaxpr of jax.vjp), parameters excluded",
                "flops": grad_matmul_flops(f, params, batch),
                "flops_source": "matmul FLOPs of the gradient's jaxpr",
                "compiled_temp_bytes": plan["temp_bytes"],
            }
        )
        runner = apply_memory_policy(torch_model.blocks, policy)
        torch_model.zero_grad(set_to_none=True)
        live, _, torch_flops = measure_lm_step(torch_model, runner, x, y, PRECISIONS["fp32"])
        rows.append(
            {
                "preset": preset,
                "framework": "torch",
                "policy": name,
                "batch": batch_size,
                "seq_len": seq_len,
                "saved_bytes_device": live.device_bytes,
                "saved_bytes_host": live.host_bytes,
                "saved_source": "live-tensor accounting (forward allocations alive at its end)",
                "flops": torch_flops,
                "flops_source": "torch.utils.flop_counter.FlopCounterMode",
                "compiled_temp_bytes": None,
            }
        )
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Memory policies, fp32, one training step; {meta['device']}, {meta['date']} "
        f"(jax {meta['versions']['jax']}, torch {meta['versions']['torch']}). Saved bytes: JAX "
        "residual accounting / torch live-tensor accounting; FLOPs: matmul FLOPs executed "
        "(JAX jaxpr, torch FlopCounterMode); ratios against the same framework's `none`.",
        "",
        "| preset | policy | JAX saved MiB (device + host) | torch saved MiB (device + host) "
        "| JAX / torch bytes | JAX GFLOP | torch GFLOP | JAX FLOPs / none | torch FLOPs / none "
        "| JAX compiled temp MiB (XLA:CPU) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 1 << 20
    by = {(r["preset"], r["framework"], r["policy"]): r for r in rows}
    for r in rows:
        if r["framework"] != "jax":
            continue
        t = by[(r["preset"], "torch", r["policy"])]
        base_j = by[(r["preset"], "jax", "none")]["flops"]
        base_t = by[(r["preset"], "torch", "none")]["flops"]
        jax_bytes = r["saved_bytes_device"] + r["saved_bytes_host"]
        torch_bytes = t["saved_bytes_device"] + t["saved_bytes_host"]
        lines.append(
            f"| {r['preset']} | {r['policy']} "
            f"| {r['saved_bytes_device'] / mib:.2f} + {r['saved_bytes_host'] / mib:.2f} "
            f"| {t['saved_bytes_device'] / mib:.2f} + {t['saved_bytes_host'] / mib:.2f} "
            f"| {jax_bytes / torch_bytes:.3f} "
            f"| {r['flops'] / 1e9:.3f} | {t['flops'] / 1e9:.3f} "
            f"| {r['flops'] / base_j:.3f} | {t['flops'] / base_t:.3f} "
            f"| {r['compiled_temp_bytes'] / mib:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rows = [r for p in args.presets.split(",") for r in measure(p, args.policies.split(","))]
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": f"{jax.devices()[0].platform.upper()} ({os.cpu_count()} cores)",
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
        "configs": {p: dataclasses.asdict(get_preset(p)) for p in args.presets.split(",")},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "policies.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    table = to_markdown(rows, meta)
    with open(os.path.join(args.out, "policies.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()

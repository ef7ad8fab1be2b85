"""Training-step time, jaxmem vs torch_ref, on the same weights and batches.

Measures one full step (forward, backward, AdamW update) per framework. Compilation and warm-up
run outside the timer; JAX steps end with ``block_until_ready``. Runs are interleaved
(jax, torch, jax, torch, ...) so machine noise hits both alike; the medians and their ratio are
reported. Writes JSON (with hardware, versions, date and the full config) and a Markdown table.

    python benchmarks/step_time.py --presets tiny,small --repeats 20 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import torch
from flax import nnx

from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.model import Decoder
from jaxmem.parity import lm_batch, torch_model_from
from jaxmem.train import lm_loss_fn, make_optimizer, make_train_step
from torch_ref.loss import cross_entropy_sum
from torch_ref.train import make_optimizer as make_torch_optimizer


def bench_preset(name: str, batch: int, seq_len: int, repeats: int) -> dict:
    cfg = get_preset(name)
    opt_cfg = OptimizerConfig()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    torch_model = torch_model_from(model)
    inputs, targets = lm_batch(cfg, batch, seq_len)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(opt_cfg)
    opt_state = tx.init(params)
    jax_batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    step_fn = make_train_step(lm_loss_fn(graphdef), tx)
    step = step_fn.lower(params, opt_state, None, jax_batch).compile()
    torch_opt = make_torch_optimizer(torch_model, opt_cfg)
    x_t, y_t = torch.from_numpy(inputs).long(), torch.from_numpy(targets).long()

    def torch_step():
        torch_opt.zero_grad(set_to_none=True)
        loss_sum, n = cross_entropy_sum(torch_model(x_t), y_t)
        (loss_sum / n).backward()
        torch_opt.step()

    state = [params, opt_state]

    def jax_step():
        state[0], state[1], _, metrics = step(state[0], state[1], None, jax_batch)
        jax.block_until_ready(metrics["loss"])

    for _ in range(3):  # warm-up outside the timer
        jax_step()
        torch_step()
    times: dict[str, list[float]] = {"jax": [], "torch": []}
    for _ in range(repeats):
        for label, fn in (("jax", jax_step), ("torch", torch_step)):
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "preset": name,
        "config": dataclasses.asdict(cfg),
        "batch": batch,
        "seq_len": seq_len,
        "repeats": repeats,
        "median_s": med,
        "all_s": times,
        "tokens_per_s": {k: batch * seq_len / v for k, v in med.items()},
        "jax_over_torch_time": med["jax"] / med["torch"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    results = [
        bench_preset(p, args.batch_size, args.seq_len, args.repeats)
        for p in args.presets.split(",")
    ]
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax_device": str(jax.devices()[0]),
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "what": "median wall time of one fwd+bwd+AdamW step, fp32, compile/warm-up excluded, "
        "interleaved runs",
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_time.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    lines = [
        f"Step time, fp32, {meta['jax_device']}, {meta['cpu_count']} cores, {meta['date']} "
        f"(jax {jax.__version__}, torch {torch.__version__})",
        "",
        "| preset | batch x seq | jaxmem median ms | torch_ref median ms | jax / torch |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['preset']} | {r['batch']} x {r['seq_len']} | {1e3 * r['median_s']['jax']:.2f} "
            f"| {1e3 * r['median_s']['torch']:.2f} | {r['jax_over_torch_time']:.2f} |"
        )
    with open(os.path.join(args.out, "step_time.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

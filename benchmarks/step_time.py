"""Training-step time, jaxmem vs torch_ref, on the same weights and batches.

Measures one full step (forward, backward, AdamW update) per framework with no memory policy
(``jaxmem bench`` times each policy). Compilation and warm-up run outside the timer; JAX steps
end with ``block_until_ready``. Runs are interleaved (jax, torch, jax, torch, ...) so machine
noise hits both alike; the medians and their ratio are reported. Writes JSON (with hardware,
versions, date and the full config) and a Markdown table.

    python benchmarks/step_time.py --presets tiny,small --repeats 20 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from jaxmem.compare.bench import machine_meta, step_times
from jaxmem.config import get_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    results = []
    for name in args.presets.split(","):
        cfg = get_preset(name)
        r = step_times(cfg, "none", args.batch_size, args.seq_len, args.repeats)
        results.append({"preset": name, "config": dataclasses.asdict(cfg), **r})
    meta = machine_meta() | {
        "what": "median wall time of one fwd+bwd+AdamW step, fp32, compile/warm-up excluded, "
        "interleaved runs",
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_time.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    lines = [
        f"Step time, fp32, {meta['device']}, {meta['cpu_count']} cores, {meta['date']} "
        f"(jax {meta['versions']['jax']}, torch {meta['versions']['torch']})",
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

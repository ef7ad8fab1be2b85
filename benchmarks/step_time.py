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
import os

from jaxmem.compare.bench import (
    busy_warning,
    load_average,
    machine_meta,
    set_threads,
    step_times,
)
from jaxmem.config import get_preset
from jaxmem.files import write_atomic, write_json_atomic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--threads", type=int, default=None, help="default: every usable core")
    args = parser.parse_args()
    threads = set_threads(args.threads)  # before JAX's CPU backend starts (it sizes its pool)
    load_before = load_average()
    results = []
    for name in args.presets.split(","):
        cfg = get_preset(name)
        r = step_times(cfg, "none", args.batch_size, args.seq_len, args.repeats)
        results.append({"preset": name, "config": dataclasses.asdict(cfg), **r})
    load_after = load_average()
    meta = machine_meta() | {
        "what": "median wall time of one fwd+bwd+AdamW step, fp32, compile/warm-up excluded, "
        "interleaved runs",
        "threads": threads,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "busy_warning": busy_warning(load_before, load_after, threads["threads"]),
    }
    os.makedirs(args.out, exist_ok=True)
    write_json_atomic(os.path.join(args.out, "step_time.json"), {"meta": meta, "results": results})
    lines = [
        f"Step time, fp32, {meta['device']}, {meta['cpu_count']} cores, {meta['date']} "
        f"(jax {meta['versions']['jax']}, torch {meta['versions']['torch']}); "
        f"{threads['threads']} threads each; load average {load_before} before, {load_after} "
        "after",
        *(["", f"**Warning: {meta['busy_warning']}.**"] if meta["busy_warning"] else []),
        "",
        "| preset | batch x seq | jaxmem median ms | torch_ref median ms | jax / torch |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['preset']} | {r['batch']} x {r['seq_len']} | {1e3 * r['median_s']['jax']:.2f} "
            f"| {1e3 * r['median_s']['torch']:.2f} | {r['jax_over_torch_time']:.2f} |"
        )
    write_atomic(os.path.join(args.out, "step_time.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Training-step time, jaxmem vs torch_ref, on the same weights and batches, fp32 and bf16.

Measures one full step (forward, backward, AdamW update) per framework and precision with no
memory policy (``jaxmem bench`` times each policy), and one matmul of the model's MLP shape in
fp32 and bf16 in each framework (what the backend does with bf16 dots, apart from the model).
Compilation and warm-up run outside the timer; JAX steps
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
    dot_times,
    load_average,
    machine_meta,
    set_threads,
    step_times,
)
from jaxmem.config import get_preset
from jaxmem.files import write_atomic, write_json_atomic


def cpu_bf16_flags() -> list[str]:
    """The CPU's bf16-capable instruction sets (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith("flags")]
        flags = lines[0].split(":", 1)[1].split() if lines else []
    except OSError:
        return []
    wanted = ("avx512_bf16", "amx_bf16", "avx512f", "avx2")  # the bf16 paths depend on these
    return [w for w in wanted if w in flags]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--threads", type=int, default=None, help="default: every usable core")
    parser.add_argument("--precisions", default="fp32,bf16")
    args = parser.parse_args()
    threads = set_threads(args.threads)  # before JAX's CPU backend starts (it sizes its pool)
    load_before = load_average()
    results, dots = [], []
    for name in args.presets.split(","):
        cfg = get_preset(name)
        for precision in args.precisions.split(","):
            r = step_times(cfg, "none", args.batch_size, args.seq_len, args.repeats, precision)
            results.append({"preset": name, "config": dataclasses.asdict(cfg), **r})
        shape = (args.batch_size * args.seq_len, cfg.d_model, cfg.d_ff)
        dots.append({"preset": name, **dot_times(*shape, args.repeats)})
    load_after = load_average()
    meta = machine_meta() | {
        "what": "median wall time of one fwd+bwd+AdamW step per precision, compile/warm-up "
        "excluded, interleaved runs; and of one matmul of the MLP's shape (fp32 result) with fp32 "
        "and bf16 inputs",
        "threads": threads,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "busy_warning": busy_warning(load_before, load_after, threads["threads"]),
        "cpu_bf16": cpu_bf16_flags(),
    }
    os.makedirs(args.out, exist_ok=True)
    write_json_atomic(
        os.path.join(args.out, "step_time.json"), {"meta": meta, "results": results, "dots": dots}
    )
    lines = [
        f"Step time, {meta['device']}, {meta['cpu_count']} cores, {meta['date']} "
        f"(jax {meta['versions']['jax']}, torch {meta['versions']['torch']}); "
        f"{threads['threads']} threads each; load average {load_before} before, {load_after} "
        "after",
        *(["", f"**Warning: {meta['busy_warning']}.**"] if meta["busy_warning"] else []),
        "",
        "| preset | precision | batch x seq | jaxmem median ms | torch_ref median ms "
        "| jax / torch | jaxmem / its fp32 | torch_ref / its fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fp32 = {r["preset"]: r["median_s"] for r in results if r["precision"] == "fp32"}
    for r in results:
        med, base = r["median_s"], fp32.get(r["preset"])
        rel = (
            f"{med['jax'] / base['jax']:.2f} | {med['torch'] / base['torch']:.2f}"
            if base
            else "- | -"
        )
        lines.append(
            f"| {r['preset']} | {r['precision']} | {r['batch']} x {r['seq_len']} "
            f"| {1e3 * med['jax']:.2f} | {1e3 * med['torch']:.2f} "
            f"| {r['jax_over_torch_time']:.2f} | {rel} |"
        )
    jax_r = [d["median_s"]["jax bf16"] / d["median_s"]["jax fp32"] for d in dots]
    torch_r = [d["median_s"]["torch bf16"] / d["median_s"]["torch fp32"] for d in dots]
    lines += [
        "",
        "One matmul of the MLP's shape, fp32 result (median ms; bf16 / fp32 in brackets). "
        f"This CPU's bf16-related instruction sets: {meta['cpu_bf16'] or 'none'}. Measured "
        f"here: XLA:CPU runs a bf16 dot at {min(jax_r):.2f}–{max(jax_r):.2f}× its fp32 time, "
        f"PyTorch at {min(torch_r):.2f}–{max(torch_r):.2f}×; each framework's bf16 step "
        "inherits its dots' cost.",
        "",
        "| preset | m × k × n | jax fp32 | jax bf16 | torch fp32 | torch bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for d in dots:
        med = d["median_s"]
        m, k, n = d["shape"]
        lines.append(
            f"| {d['preset']} | {m} × {k} × {n} | {1e3 * med['jax fp32']:.2f} "
            f"| {1e3 * med['jax bf16']:.2f} ({med['jax bf16'] / med['jax fp32']:.2f}) "
            f"| {1e3 * med['torch fp32']:.2f} "
            f"| {1e3 * med['torch bf16']:.2f} ({med['torch bf16'] / med['torch fp32']:.2f}) |"
        )
    write_atomic(os.path.join(args.out, "step_time.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Why ``selective`` does not keep Megatron's elementwise outputs: Megatron's set (projections +
norms, activation and residual additions, the attention core recomputed) against ``selective``
(the projections only), on ``small`` (batch 8 × 128, fp32 and bf16): saved bytes and FLOPs
(both frameworks) and step time (interleaved medians, both frameworks).
Writes ``benchmarks/results/megatron_set.{json,md}``.

    python benchmarks/megatron_set.py
"""

from __future__ import annotations

import os

from jaxmem.compare.bench import (
    interleaved_medians,
    load_average,
    machine_meta,
    memory_point,
    set_threads,
    step_fns,
)
from jaxmem.config import get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.policy import CHECKPOINT_NAMES, POLICIES, BlockPolicy, MemoryPolicy

MEGATRON = MemoryPolicy.of(
    BlockPolicy(
        save=tuple(
            n
            for n in CHECKPOINT_NAMES
            if n not in ("attn_scores", "attn_probs", "attn_lse", "attn_context")
        )
    ),
    name="megatron",
)
MIB = 1 << 20


def main() -> None:
    threads = set_threads()
    before = load_average()
    cfg = get_preset("small")
    rows = []
    policies = (("selective", POLICIES["selective"]), (MEGATRON.name, MEGATRON))
    for precision in ("fp32", "bf16"):
        fns = {}
        for name, policy in policies:
            mem = memory_point(cfg, name, precision, 8, 128, compile_plan=False, policy=policy)
            rows.append({"precision": precision, **mem, "step_median_s": None})
            if precision == "fp32":  # bf16 steps are timed by step_time.py (slow on AVX2)
                steps, _ = step_fns(cfg, name, 8, 128, precision, policy)
                fns |= {f"{name} {fw}": f for fw, f in steps.items()}
        if fns:
            times = interleaved_medians(fns, 15)
            for r in rows[-2:]:
                r["step_median_s"] = {
                    fw: times["median_s"][f"{r['policy']} {fw}"] for fw in ("jax", "torch")
                }
    meta = machine_meta() | {
        "threads": threads,
        "load_average_before": before,
        "load_average_after": load_average(),
    }
    os.makedirs("benchmarks/results", exist_ok=True)
    write_json_atomic("benchmarks/results/megatron_set.json", {"meta": meta, "rows": rows})
    lines = [
        f"Megatron's set vs `selective`, `small` 8 × 128; {meta['device']}, "
        f"{meta['date']}. Saved MiB: JAX residual accounting / torch live-tensor accounting "
        "(stock); GFLOP: matmul FLOPs executed; step: median ms of 15 fwd + bwd + AdamW steps, "
        "fp32, compile and warm-up excluded, the four steps (two policies × two frameworks) "
        "interleaved; load average before/after in the JSON.",
        "",
        "| precision | policy | JAX MiB | torch MiB | JAX GFLOP | torch GFLOP | JAX step ms "
        "| torch step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        med = r["step_median_s"]
        step = "- | -" if med is None else f"{1e3 * med['jax']:.1f} | {1e3 * med['torch']:.1f}"
        lines.append(
            f"| {r['precision']} | {r['policy']} | {r['jax_device_bytes'] / MIB:.1f} "
            f"| {r['torch_device_bytes'] / MIB:.1f} | {r['jax_flops'] / 1e9:.2f} "
            f"| {r['torch_flops'] / 1e9:.2f} | {step} |"
        )
    write_atomic("benchmarks/results/megatron_set.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

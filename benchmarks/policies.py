"""Saved-activation bytes and matmul FLOPs of every memory policy, jaxmem vs stock PyTorch (and
torch_ref's lean extension where it differs from stock), per preset: one fp32 training step
(forward + backward) on the same weights and batch, measured by
``jaxmem.compare.bench.memory_point`` (what each column is: see ``benchmarks/README.md``).

    python benchmarks/policies.py --presets tiny,small --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from jaxmem.compare.bench import (
    PEER_NOTE,
    PEERS,
    dominated_by,
    gflop_cell,
    machine_meta,
    memory_point,
    mib_cell,
)
from jaxmem.config import get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.policy import POLICIES

SHAPES = {"tiny": (8, 64), "small": (8, 128)}


def measure(preset: str, policies: list[str]) -> list[dict]:
    cfg = get_preset(preset)
    batch, seq_len = SHAPES.get(preset, (8, min(128, cfg.max_seq_len)))
    rows = [
        {"preset": preset, **memory_point(cfg, name, "fp32", batch, seq_len)} for name in policies
    ]
    return rows + [
        {"preset": preset, "peer": True, **memory_point(cfg, n, "fp32", batch, seq_len, policy=p)}
        for n, p in PEERS.items()
    ]


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Memory policies, fp32, one training step; {meta['device']}, {meta['date']} "
        f"(jax {meta['versions']['jax']}, torch {meta['versions']['torch']}). Saved MiB "
        "(device + host): JAX residual accounting / torch live-tensor accounting; GFLOP: matmul "
        "FLOPs executed (JAX jaxpr, torch FlopCounterMode); FLOP ratios against the same "
        "framework's `none`. torch = stock PyTorch († = no stock API in eager PyTorch: "
        "torch_ref's extension); torch lean = torch_ref's extension where it differs from stock. "
        f"{PEER_NOTE}. Dominated by: the rows of the same preset keeping no more bytes at no "
        "more FLOPs, one strictly less (JAX / torch stock; † rows compared as they ran).",
        "",
        "| preset | policy | JAX MiB | torch MiB | torch lean MiB | JAX / torch bytes "
        "| JAX GFLOP | torch GFLOP | torch lean GFLOP | JAX FLOPs / none | torch FLOPs / none "
        "| JAX compiled temp MiB (XLA:CPU) | dominated by (JAX / torch) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    none = {r["preset"]: r for r in rows if r["policy"] == "none"}
    for r in rows:
        base = none[r["preset"]]
        same = [x for x in rows if x["preset"] == r["preset"]]
        beaten = " / ".join(", ".join(dominated_by(r, same, fw)) or "-" for fw in ("jax", "torch"))
        jb = r["jax_device_bytes"] + r["jax_host_bytes"]
        tb = r["torch_device_bytes"] + r["torch_host_bytes"]
        mark = "" if r["torch_is_stock"] else " †"
        lines.append(
            f"| {r['preset']} | {r['policy']} | {mib_cell(r, 'jax')} "
            f"| {mib_cell(r, 'torch')}{mark} "
            f"| {mib_cell(r, 'torch_lean')} | {jb / tb:.3f} | {gflop_cell(r, 'jax')} "
            f"| {gflop_cell(r, 'torch')}{mark} | {gflop_cell(r, 'torch_lean')} "
            f"| {r['jax_flops'] / base['jax_flops']:.3f} "
            f"| {r['torch_flops'] / base['torch_flops']:.3f} "
            f"| {r['jax_compiled_temp_bytes'] / (1 << 20):.2f} | {beaten} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    presets = args.presets.split(",")
    rows = [r for p in presets for r in measure(p, args.policies.split(","))]
    meta = machine_meta() | {
        "configs": {p: dataclasses.asdict(get_preset(p)) for p in presets},
        "shapes": {p: SHAPES.get(p) for p in presets},
    }
    os.makedirs(args.out, exist_ok=True)
    write_json_atomic(os.path.join(args.out, "policies.json"), {"meta": meta, "results": rows})
    table = to_markdown(rows, meta)
    write_atomic(os.path.join(args.out, "policies.md"), table)
    print(table)


if __name__ == "__main__":
    main()

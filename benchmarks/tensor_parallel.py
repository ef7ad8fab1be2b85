# ruff: noqa: E402  (JAX is configured before it starts, on purpose)
"""Per-device activation memory under Megatron's tensor parallelism, with and without sequence
parallelism, beside the analytic model and Korthikanti et al. (2022)'s formulas.

- ``h100``: gpt3-6.7b (bf16, AdamW), one row of 2048 tokens, tensor parallelism over t = 1, 2,
  4, 8 H100s (no data axis), compiled for one host of H100s without any GPU.
- ``cpu``: small (fp32), 8 rows of 128 tokens, t = 1, 2, 4 CPU devices in this process (XLA:CPU
  plans of the same step).
- ``torch``: the same small step in torch_ref over t = 1, 2, 4 torchrun processes (gloo, DTensor
  tensor parallelism: ``torch_ref.distributed``), measured on rank 0: what the forward leaves
  alive for the backward, by tag (``torch_ref.mesh_memory``; a DTensor counted at its local
  shard), and the runtime peak of a step (PyTorch's MemTracker).

Per row, per device: the saved activations of the blocks by residual accounting (each tensor
device's share of each tag: ``jaxmem.parallel.tensor_share``), the analytic model's, the
paper's formula with its dropout terms removed (bf16 only: the paper counts 2-byte activations),
the compiled plan's peak and the matmul FLOPs.

The paper's per-layer bytes (s sequence, b batch, h hidden, a heads), with dropout: sbh(34 +
5as/h) without parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, sbh(34/t +
5as/(ht)) with sequence parallelism added. jaxmem has no dropout: its two sbh masks and the
attention's as²b mask go, and the attention's dropout output (2as²b) is the softmax output
already counted: sbh(32 + 2as/h), sbh(8 + 24/t + 2as/(ht)), sbh(32/t + 2as/(ht)); the paper's
selective recomputation drops the as² term; full recomputation keeps the block input, 2sbh
(2sbh/t with sequence parallelism).

- ``plan``: what ``jaxmem plan``'s search chooses for llama-3-70b on 8 H100s (``PLAN``).

Writes ``benchmarks/results/tensor_parallel/{tensor_parallel,plan_llama-3-70b_8xh100}.{json,md}``.

    python benchmarks/tensor_parallel.py [--parts h100,cpu,torch,plan]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()
import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.targets import LOCAL, get_target
from jaxmem.parallel import ParallelConfig
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

PARTS = {
    "h100": {
        "preset": "gpt3-6.7b",
        "precision": "bf16",
        "batch": 1,
        "seq": 2048,
        "tps": (1, 2, 4, 8),
    },
    "cpu": {"preset": "small", "precision": "fp32", "batch": 8, "seq": 128, "tps": (1, 2, 4)},
}
POLICY_NAMES = ("none", "selective", "full")
MIB = 1 << 20


def paper_bytes(policy: str, s: int, b: int, h: int, a: int, t: int, sp: bool) -> int:
    """Korthikanti et al.'s activation bytes per layer without dropout (2-byte activations)."""
    attention = 2 * a * s * s * b // t  # softmax output (the dropout output is the same tensor)
    if policy == "full":
        return 2 * s * b * h // (t if sp else 1)
    stream = 32 * s * b * h // t if sp or t == 1 else 8 * s * b * h + 24 * s * b * h // t
    return stream + (attention if policy == "none" else 0)


def _row(part: str, spec: dict, t: int, sp: bool, policy: str, blocks: int, layers: int) -> dict:
    """What identifies a row, and its blocks' saved bytes (all layers and per layer)."""
    return {
        "part": part,
        "preset": spec["preset"],
        "precision": spec["precision"],
        "tp": t,
        "sequence_parallel": sp,
        "policy": policy,
        "blocks_saved_bytes": blocks,
        "per_layer_saved_bytes": blocks // layers,
    }


def measure(part: str) -> list[dict]:
    spec = PARTS[part]
    cfg = get_preset(spec["preset"])
    precision = PRECISIONS[spec["precision"]]
    target = get_target("h100") if part == "h100" else LOCAL
    rows = []
    for t in spec["tps"]:
        for sp in (True, False) if t > 1 else (True,):
            parallel = (
                ParallelConfig(devices=t, tp=t, sequence_parallel=sp) if t > 1 else ParallelConfig()
            )
            for name in POLICY_NAMES:
                start = time.perf_counter()
                rec = jax_record(
                    StepSpec(
                        model=cfg,
                        policy=POLICIES[name],
                        precision=precision,
                        batch=spec["batch"],
                        seq_len=spec["seq"],
                        target=target,
                        parallel=parallel,
                    ),
                    abstract=True,
                )
                by_name = rec["saved_by_name"]
                blocks = sum(
                    v for k, v in by_name.items() if k not in ("<untagged>", "<stack output>")
                )
                row = {
                    **_row(part, spec, t, sp, name, blocks, cfg.n_layers),
                    "saved_bytes": rec["saved_activation_bytes_device"]
                    + rec["saved_activation_bytes_host"],
                    "saved_by_name": by_name,
                    "analytic_bytes": rec["analytic_activation_bytes"],
                    "paper_per_layer_bytes": paper_bytes(
                        name,
                        spec["seq"],
                        spec["batch"],
                        cfg.d_model,
                        cfg.n_heads,
                        t,
                        sp,
                    )
                    if spec["precision"] == "bf16"
                    else None,
                    "planned_peak_bytes": rec["planned_peak_bytes"],
                    "flops": rec["flops"],
                    "compiler": rec["compiler"],
                    "seconds": round(time.perf_counter() - start, 1),
                }
                rows.append(row)
                print(
                    f"{part} tp={t} sp={sp} {name}: per layer "
                    f"{row['per_layer_saved_bytes'] / MIB:.1f} MiB, paper "
                    f"{(row['paper_per_layer_bytes'] or 0) / MIB:.1f}, peak "
                    f"{row['planned_peak_bytes'] / MIB:,.0f} MiB ({row['seconds']} s)",
                    flush=True,
                )
    return rows


def measure_torch() -> list[dict]:
    """The ``cpu`` part's step in torch_ref, per rank (rank 0's record)."""
    from jaxmem.compare.records import torch_rank_records

    spec = PARTS["cpu"]
    cfg = get_preset(spec["preset"])
    rows = []
    for t in spec["tps"]:
        for sp in (True, False) if t > 1 else (True,):
            parallel = ParallelConfig(devices=t, tp=t, sequence_parallel=sp)
            for name in POLICY_NAMES:
                start = time.perf_counter()
                (rec, *_) = torch_rank_records(
                    spec["preset"],
                    name,
                    parallel,
                    precision=spec["precision"],
                    batch=spec["batch"],
                    seq_len=spec["seq"],
                )
                blocks = sum(
                    v for k, v in rec["saved_by_name"].items() if "outside the stack" not in k
                )
                row = {
                    **_row("torch", spec, t, sp, name, blocks, cfg.n_layers),
                    "saved_bytes": rec["saved_activation_bytes_device"]
                    + rec["saved_activation_bytes_host"],
                    "saved_by_name": rec["saved_by_name"],
                    "runtime_peak_bytes": rec["peak_bytes"],
                    "translation": rec["translation"],
                    "strategy": rec["strategy"],
                    "peak_source": rec["peak_source"],
                    "saved_source": rec["saved_source"],
                    "seconds": round(time.perf_counter() - start, 1),
                }
                rows.append(row)
                print(
                    f"torch tp={t} sp={sp} {name}: per layer "
                    f"{row['per_layer_saved_bytes'] / MIB:.2f} MiB, runtime peak "
                    f"{row['runtime_peak_bytes'] / MIB:,.1f} MiB ({row['seconds']} s)",
                    flush=True,
                )
    return rows


# ``plan``: what jaxmem plan chooses for a 70B-class model on one host of 8 H100s when the batch
# (4 rows) is smaller than the devices, so every layout has a tensor axis: fsdp x tp, state on
# the device or in host memory, bf16 with fp32 master weights or pure bf16
PLAN = {
    "preset": "llama-3-70b",
    "batch": 4,
    "seq": 4096,
    "devices": 8,
    "precisions": ("bf16", "pure-bf16"),
    "policies": ("full", "selective"),
}


def plan_part() -> dict:
    from jaxmem.memory.targets import get_target
    from jaxmem.planner.search import default_budget, search
    from jaxmem.planner.space import PlanSpace, Problem

    target = get_target("h100")
    budget, budget_source = default_budget(target)
    cfg = get_preset(PLAN["preset"])
    problem = Problem(
        cfg, PLAN["batch"], PLAN["seq"], target, budget, OptimizerConfig(), PLAN["devices"]
    )
    space = PlanSpace(
        policies=PLAN["policies"],
        mix=(),
        accum=(1,),
        state_memory=("device", "pinned_host"),
        strategies=("fsdp",),
        tensor=(1, 2, 4, 8),
        precisions=PLAN["precisions"],
        tags=False,
        unroll=False,
    )
    start = time.perf_counter()
    result = search(problem, space, progress=lambda t: print(t, flush=True))
    chosen = result.chosen
    return {
        **PLAN,
        "budget_bytes": budget,
        "budget_source": budget_source,
        "compiler": result.compiler,
        "chosen": None if chosen is None else chosen.as_dict(),
        "candidates": [o.as_dict() for o in result.outcomes if o.status != "not reached"],
        "fit_compiles": result.fit_compiles,
        "candidate_compiles": result.candidate_compiles,
        "seconds": round(time.perf_counter() - start, 1),
    }


def plan_markdown(plan: dict, meta: dict) -> str:
    lines = [
        f"# jaxmem plan: {plan['preset']} on {plan['devices']} H100s, {plan['batch']} x "
        f"{plan['seq']} tokens",
        "",
        f"{meta['date']}, jax {meta['jax']}, on {meta['host']}; {plan['seconds']} s. "
        f"{' or '.join(plan['precisions'])}, AdamW, budget "
        f"{plan['budget_bytes'] / 2**30:.1f} GiB per device "
        f"({plan['budget_source']}). The batch (4 rows) is smaller than the devices, so every "
        "layout has a tensor axis (fsdp over the rest). Searched: policies "
        f"{', '.join(plan['policies'])}, tp 2, 4, 8 (1 cannot split the batch), AdamW state on "
        "the device or in host memory. Planned peaks: XLA:CUDA deviceless compiles "
        f"({plan['compiler']}); est. s: matmul FLOPs and bytes over datasheet rates (an "
        f"estimate). {plan['fit_compiles']} fit compiles, {plan['candidate_compiles']} "
        "candidate compiles.",
        "",
        "| configuration | TFLOP per device | est. s | predicted GiB | compiled GiB | status |",
        "|---|---|---|---|---|---|",
    ]
    for c in plan["candidates"]:
        pred = "-" if c["predicted_bytes"] is None else f"{c['predicted_bytes'] / 2**30:,.2f}"
        comp = "-" if c["compiled_bytes"] is None else f"{c['compiled_bytes'] / 2**30:,.2f}"
        lines.append(
            f"| {c['configuration']} | {c['flops'] / 1e12:,.1f} | "
            f"{c['estimated_seconds']:.3g} | {pred} | {comp} | {c['status']} |"
        )
    chosen = plan["chosen"]
    lines += [
        "",
        f"Chosen: {chosen['configuration']}, {chosen['compiled_bytes'] / 2**30:,.2f} GiB per "
        "device (compiled plan)"
        if chosen
        else "Nothing fits the budget.",
    ]
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Tensor and sequence parallelism: activation memory per device",
        "",
        f"{meta['date']}, jax {meta['jax']}, on {meta['host']}. Per device: the blocks' saved "
        "activations per layer by residual accounting (each tensor device's share of each "
        "tag, Megatron's layout; the embeddings' and head's residuals excluded), the analytic "
        "model's (all layers), the paper's per-layer formula without dropout (bf16 rows), the "
        "compiled plan's peak (arguments + outputs - aliased + temporaries: parameters, "
        "gradients, AdamW state and temporaries included), and matmul FLOPs. `h100`: XLA:CUDA "
        "deviceless compiles for one host of H100s; `cpu`: XLA:CPU plans on this machine's CPU "
        "devices. Tensor parallelism alone (no data axis).",
        "",
        "| part | model | t | SP | policy | saved per layer MiB | paper per layer MiB | "
        "analytic (all layers) MiB | planned peak MiB | TFLOP |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["part"] == "torch":
            continue
        paper = r["paper_per_layer_bytes"]
        lines.append(
            f"| {r['part']} | {r['preset']} {r['precision']} | {r['tp']} | "
            f"{'yes' if r['sequence_parallel'] and r['tp'] > 1 else '-' if r['tp'] == 1 else 'no'} "
            f"| {r['policy']} | {r['per_layer_saved_bytes'] / MIB:,.1f} | "
            f"{'-' if paper is None else f'{paper / MIB:,.1f}'} | "
            f"{r['analytic_bytes'] / MIB:,.1f} | {r['planned_peak_bytes'] / MIB:,.0f} | "
            f"{r['flops'] / 1e12:,.2f} |"
        )
    torch_rows = [r for r in rows if r["part"] == "torch"]
    if torch_rows:
        lines += torch_markdown(torch_rows, [r for r in rows if r["part"] == "cpu"])
    return "\n".join(lines) + "\n"


def _sp(r: dict) -> str:
    return "-" if r["tp"] == 1 else "yes" if r["sequence_parallel"] else "no"


def _largest_tags(by_name: dict[str, int], outside: tuple[str, ...]) -> str:
    """The six largest tags of a stack (what is named ``outside`` left out), MiB, all layers."""
    tags = sorted(
        ((v, k) for k, v in by_name.items() if not any(o in k for o in outside) and v >= MIB // 4),
        reverse=True,
    )
    return ", ".join(f"{k} {v / MIB:.1f}" for v, k in tags[:6]) or "-"


def torch_markdown(rows: list[dict], jax_rows: list[dict]) -> list[str]:
    """torch_ref's ranks beside the ``cpu`` part's JAX devices (same step)."""
    jax_of = {(r["tp"], r["sequence_parallel"], r["policy"]): r for r in jax_rows}
    first = rows[-1]  # a rank of the largest mesh: its sources say "per rank of ..."
    lines = [
        "",
        "## torch_ref per rank (the `cpu` part's step)",
        "",
        f"small fp32, 8 x 128, AdamW, torchrun ranks on this machine (gloo), rank 0. Saved: "
        "the whole step's activations kept for the backward, per device or rank (JAX: "
        "residual accounting of the `cpu` rows above, each device's share; torch: "
        f"{first['saved_source']}); by tag: the largest, all layers (torch's tag is the op "
        "jaxmem's table names at that place of a block: DTensor's collectives add ops, so a "
        "block's first input can be named outside the stack). Runtime peak: "
        f"{first['peak_source']}; JAX: the compiled plan's peak. Policies in stock PyTorch "
        "(torch_ref.remat: `checkpoint` for full, `create_selective_checkpoint_contexts` for "
        "selective, which keeps every output it is told to save, read by the backward or not).",
        "",
        "| t | SP | policy | JAX saved MiB | torch saved MiB | JAX by tag (MiB, all layers) "
        "| torch by tag | JAX planned peak MiB | torch runtime peak MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        j = jax_of.get((r["tp"], r["sequence_parallel"] or r["tp"] == 1, r["policy"]))
        by_tag = _largest_tags(r["saved_by_name"], ("outside the stack",))
        jax_tags = "-" if j is None else _largest_tags(j["saved_by_name"], ("<untagged>",))
        jax_saved = "-" if j is None else f"{j['saved_bytes'] / MIB:,.1f}"
        jax_peak = "-" if j is None else f"{j['planned_peak_bytes'] / MIB:,.1f}"
        lines.append(
            f"| {r['tp']} | {_sp(r)} | {r['policy']} | {jax_saved} | "
            f"{r['saved_bytes'] / MIB:,.1f} | {jax_tags} | {by_tag} | {jax_peak} | "
            f"{r['runtime_peak_bytes'] / MIB:,.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="h100,cpu")
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU needed)",
        "jax": jax.__version__,
    }
    parts = [p.strip() for p in args.parts.split(",")]
    if "plan" in parts:
        plan = plan_part()
        stem = os.path.join(args.out, "plan_llama-3-70b_8xh100")
        write_json_atomic(stem + ".json", {"plan": plan, "meta": meta})
        write_atomic(stem + ".md", plan_markdown(plan, meta))
        print(f"wrote {stem}.json and .md")
    rows = [r for part in parts if part in PARTS for r in measure(part)]
    if "torch" in parts:
        rows += measure_torch()
    if rows:
        stem = os.path.join(args.out, "tensor_parallel")
        write_json_atomic(stem + ".json", {"rows": rows, "meta": meta})
        write_atomic(stem + ".md", markdown(rows, meta))
        print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()

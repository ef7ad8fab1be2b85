# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""Fused vs naive attention as a memory strategy, in both frameworks: saved activation bytes,
matmul FLOPs and the compiled plan of one training step, by sequence length and policy.

    python benchmarks/attention.py --out benchmarks/results/attention

The model is the GPT-3-shaped layer scaled to CPU (d 512, 32 heads of 16, d_ff 2048, 4 layers,
batch 2; a·s/h = 16 at seq 256, 64 at seq 1024), at sequence 256–2048, for naive and fused
attention × none / full / selective / offload, in fp32 and bf16. Every step is planned from
shapes, nothing runs: JAX's saved bytes from residual accounting (the jaxpr of ``jax.vjp``),
its FLOPs from the gradient's jaxpr, its plan compiled for this machine's CPU (XLA:CPU: remat
is honoured under scan, host offload is not); PyTorch's saved bytes (live-tensor accounting)
and FLOPs (``FlopCounterMode`` with ``torch_ref.flops``' formulas for the CPU SDPA kernel) from
torch_ref's step under ``FakeTensorMode``. The GPU rows compile gpt2-124m (bf16, 8 × 1024) for
an H100 without one (needs ``jaxmem[gpu-plan]``); the naive GPU rows are read from
``benchmarks/results/gpu_plans/h100_bf16.json`` (the same step, measured by gpu_plans.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()
import jax

from jaxmem.config import ModelConfig, get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES, BlockPolicy, MemoryPolicy, model_tags
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

CFG = ModelConfig(vocab_size=259, d_model=512, n_heads=32, n_layers=4, d_ff=2048, max_seq_len=2048)
BATCH = 2
SEQS = (256, 512, 1024, 2048)
NAMES = ("none", "full", "selective", "offload", "megatron")
# Megatron-LM's selective recompute (Korthikanti et al. 2022, the 34·s·b·h of their Table 2):
# the attention core's s² tensors recomputed, everything else kept, the core's output included
# (the output projection saves its input). jaxmem's `selective` keeps the projections only, not
# Megatron's elementwise outputs (benchmarks/megatron_set.py compares the two sets). Fused `none`
# also keeps everything but the s² tensors, so Megatron's set is what it is measured against.
# Under fused attention, recomputing the core means re-running the fused op, whose output and
# log-sum-exp come from one op (PyTorch's selective checkpointing saves or recomputes both).
MEGATRON_RECOMPUTES = {
    "naive": ("attn_scores", "attn_probs"),
    "fused": ("attn_lse", "attn_context"),
}


def policy(name: str, attention: str) -> MemoryPolicy:
    if name != "megatron":
        return POLICIES[name]
    drop = MEGATRON_RECOMPUTES[attention]
    tags = model_tags(CFG.replace(attention=attention))
    return MemoryPolicy.of(
        BlockPolicy(save=tuple(n for n in tags if n not in drop)), name="megatron"
    )


GPU_NAMES = NAMES[:4]  # the naive H100 rows come from gpu_plans.py, which plans the presets
ATTENTIONS = ("naive", "fused")
MIB = 1 << 20


def cpu_rows(precisions: list[str], seqs: list[int], names=NAMES) -> list[dict]:
    from jaxmem.compare.records import torch_record

    rows = []
    for precision in precisions:
        prec = PRECISIONS[precision]
        for seq in seqs:
            for attention in ATTENTIONS:
                cfg = CFG.replace(attention=attention)
                for name in names:
                    start = time.perf_counter()
                    pol = policy(name, attention)
                    spec = StepSpec(model=cfg, policy=pol, precision=prec, batch=BATCH, seq_len=seq)
                    j = jax_record(spec, abstract=True)
                    t = torch_record(cfg, pol, prec, spec.optimizer, BATCH, seq, fake=True)
                    rows.append(
                        {
                            "precision": precision,
                            "seq_len": seq,
                            "attention": attention,
                            "policy": name,
                            "jax_saved_device": j["saved_activation_bytes_device"],
                            "jax_saved_host": j["saved_activation_bytes_host"],
                            "jax_flops": j["flops"],
                            "jax_cpu_temp": j["compiled_temp_bytes"],
                            "jax_cpu_planned_peak": j["planned_peak_bytes"],
                            "analytic": j["analytic_activation_bytes"],
                            "torch_saved_device": t["saved_activation_bytes_device"],
                            "torch_saved_host": t["saved_activation_bytes_host"],
                            "torch_flops": t["flops"],
                            "torch_translation": t["translation"],
                            "seconds": round(time.perf_counter() - start, 1),
                        }
                    )
                    jax_mib = (
                        j["saved_activation_bytes_device"] + j["saved_activation_bytes_host"]
                    ) / MIB
                    torch_mib = (
                        t["saved_activation_bytes_device"] + t["saved_activation_bytes_host"]
                    ) / MIB
                    print(
                        f"{precision} seq {seq} {attention} {name}: saved JAX {jax_mib:.1f} MiB, "
                        f"torch {torch_mib:.1f} MiB",
                        flush=True,
                    )
    return rows


def gpu_rows(gpu_plans_json: str) -> list[dict]:
    """gpt2-124m, bf16, 8 × 1024, H100: fused compiled here; naive read from gpu_plans."""
    from jaxmem.memory.targets import get_target

    target = get_target("h100")
    cfg = get_preset("gpt2-124m")
    with open(gpu_plans_json) as f:
        measured = json.load(f)
    naive = {r["policy"]: r for r in measured["rows"] if r["preset"] == "gpt2-124m"}
    rows = []
    for attention in ATTENTIONS:
        for name in GPU_NAMES:
            if attention == "naive":
                r = naive[name]
                source = f"{gpu_plans_json} (measured {measured['meta']['date']})"
            else:
                r = jax_record(
                    StepSpec(
                        model=cfg.replace(attention="fused"),
                        policy=POLICIES[name],
                        precision=PRECISIONS["bf16"],
                        batch=8,
                        seq_len=1024,
                        target=target,
                    )
                )
                source = "compiled by this run"
            rows.append(
                {
                    "attention": attention,
                    "policy": name,
                    "saved_device": r["saved_activation_bytes_device"],
                    "saved_host": r["saved_activation_bytes_host"],
                    "temp": r["compiled_temp_bytes"],
                    "plan_host": r["plan_host_bytes"],
                    "planned_peak": r["planned_peak_bytes"],
                    "flops": r["flops"],
                    "source": source,
                }
            )
            peak = r["planned_peak_bytes"] / 1e9
            print(f"h100 gpt2-124m {attention} {name}: planned peak {peak:.2f} GB", flush=True)
    return rows


def check_at_1024(rows: list[dict]) -> list[dict]:
    """The comparison at seq 1024: fused + none vs naive selective (saved bytes, both
    frameworks) and vs naive full (FLOPs), and vs Megatron's selective recompute (both) where
    it was measured; the compiled plan's peak beside it."""
    out = []
    for precision in sorted({r["precision"] for r in rows}):
        at = {
            (r["attention"], r["policy"]): r
            for r in rows
            if r["precision"] == precision and r["seq_len"] == 1024
        }
        if not at:
            continue
        fused, sel, full = at[("fused", "none")], at[("naive", "selective")], at[("naive", "full")]
        check = {"precision": precision}
        for fw in ("jax", "torch"):
            saved_f = fused[f"{fw}_saved_device"] + fused[f"{fw}_saved_host"]
            saved_s = sel[f"{fw}_saved_device"] + sel[f"{fw}_saved_host"]
            check[f"{fw}_fused_none_saved"] = saved_f
            check[f"{fw}_naive_selective_saved"] = saved_s
            check[f"{fw}_fused_none_fewer_bytes_than_naive_selective"] = saved_f < saved_s
            check[f"{fw}_fused_none_flops"] = fused[f"{fw}_flops"]
            check[f"{fw}_naive_full_flops"] = full[f"{fw}_flops"]
            check[f"{fw}_naive_selective_flops"] = sel[f"{fw}_flops"]
            check[f"{fw}_fused_none_fewer_flops_than_naive_full"] = (
                fused[f"{fw}_flops"] < full[f"{fw}_flops"]
            )
        megatron = at.get(("naive", "megatron"))
        for fw in ("jax", "torch") if megatron else ():
            # the same comparison against Megatron's selective recompute (MEGATRON_RECOMPUTES)
            saved_m = megatron[f"{fw}_saved_device"] + megatron[f"{fw}_saved_host"]
            saved_f = check[f"{fw}_fused_none_saved"]
            check[f"{fw}_naive_megatron_saved"] = saved_m
            check[f"{fw}_naive_megatron_flops"] = megatron[f"{fw}_flops"]
            check[f"{fw}_fused_none_minus_naive_megatron_saved"] = saved_f - saved_m
        check["jax_cpu_planned_peak_fused_none"] = fused["jax_cpu_planned_peak"]
        check["jax_cpu_planned_peak_naive_selective"] = sel["jax_cpu_planned_peak"]
        out.append(check)
    return out


def to_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# Fused vs naive attention ({meta['date']}, {meta['host']}, jax {meta['jax']}, "
        f"torch {meta['torch']})",
        "",
        "GPT-3-shaped layer scaled to CPU: d 512, 32 heads of 16, d_ff 2048, 4 layers, batch 2. "
        "Planned from shapes (nothing runs). Saved MiB = activations kept for the backward "
        "(device + host): JAX residual accounting (jaxpr of `jax.vjp`), torch live-tensor "
        "accounting under FakeTensorMode. GFLOP = matmul FLOPs executed (JAX gradient jaxpr; "
        "torch FlopCounterMode + torch_ref.flops for the CPU SDPA kernel). Plan peak = XLA:CPU "
        "compiled plan of the whole train step (AdamW): arguments + outputs - aliased + "
        "temporaries (XLA:CPU keeps offloaded tensors on the host = same memory: offload rows "
        "equal selective there).",
        "",
        "| precision | seq | attention | policy | JAX saved MiB | torch saved MiB "
        "| analytic MiB (stack only) | JAX GFLOP | torch GFLOP | JAX plan peak MiB (XLA:CPU) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cpu"]:
        js = (r["jax_saved_device"] + r["jax_saved_host"]) / MIB
        ts = (r["torch_saved_device"] + r["torch_saved_host"]) / MIB
        lines.append(
            f"| {r['precision']} | {r['seq_len']} | {r['attention']} | {r['policy']} | {js:.1f} "
            f"| {ts:.1f} | {r['analytic'] / MIB:.1f} | {r['jax_flops'] / 1e9:.1f} "
            f"| {r['torch_flops'] / 1e9:.1f} | {r['jax_cpu_planned_peak'] / MIB:.1f} |"
        )
    lines += [
        "",
        "## Fused `none` against naive `selective`, `full` and Megatron's selective recompute "
        "at seq 1024",
        "",
    ]
    for c in result["check_at_1024"]:
        for fw in ("jax", "torch"):
            lines.append(
                f"- {c['precision']}, {fw}: fused + none keeps "
                f"{c[f'{fw}_fused_none_saved'] / MIB:.1f} MiB vs naive selective "
                f"{c[f'{fw}_naive_selective_saved'] / MIB:.1f} MiB "
                f"({'fewer' if c[f'{fw}_fused_none_fewer_bytes_than_naive_selective'] else 'MORE'}"
                f"); FLOPs {c[f'{fw}_fused_none_flops'] / 1e9:.1f} G vs naive full "
                f"{c[f'{fw}_naive_full_flops'] / 1e9:.1f} G "
                f"({'fewer' if c[f'{fw}_fused_none_fewer_flops_than_naive_full'] else 'MORE'}) "
                f"and naive selective {c[f'{fw}_naive_selective_flops'] / 1e9:.1f} G"
            )
        for fw in ("jax", "torch") if "jax_naive_megatron_saved" in c else ():
            diff = c[f"{fw}_fused_none_minus_naive_megatron_saved"]
            megatron = c[f"{fw}_naive_megatron_saved"]
            lines.append(
                f"- {c['precision']}, {fw}, against Megatron's selective recompute: naive "
                f"megatron keeps {megatron / MIB:.1f} MiB at "
                f"{c[f'{fw}_naive_megatron_flops'] / 1e9:.1f} GFLOP; fused + none keeps "
                f"{diff / MIB:+.2f} MiB ({diff / megatron:+.2%}; the fused op's fp32 "
                f"log-sum-exp is {BATCH * CFG.n_heads * 1024 * 4 * CFG.n_layers / MIB:.2f} MiB) at "
                f"{c[f'{fw}_fused_none_flops'] / c[f'{fw}_naive_megatron_flops'] - 1:+.1%} FLOPs"
            )
        lines.append(
            f"- {c['precision']}, JAX XLA:CPU plan peak of the whole step: fused + none "
            f"{c['jax_cpu_planned_peak_fused_none'] / MIB:.1f} MiB vs naive selective "
            f"{c['jax_cpu_planned_peak_naive_selective'] / MIB:.1f} MiB"
        )
    if result.get("gpu"):
        lines += [
            "",
            "## gpt2-124m, bf16, 8 × 1024, AdamW, compiled for an H100 without one",
            "",
            "| attention | policy | saved GB (device + host) | device temp GB | plan host GB "
            "| planned peak GB | TFLOP | source |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in result["gpu"]:
            lines.append(
                f"| {r['attention']} | {r['policy']} "
                f"| {(r['saved_device'] + r['saved_host']) / 1e9:.2f} | {r['temp'] / 1e9:.2f} "
                f"| {r['plan_host'] / 1e9:.2f} | {r['planned_peak'] / 1e9:.2f} "
                f"| {r['flops'] / 1e12:.2f} | {r['source']} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precisions = sorted({r["precision"] for r in result["cpu"]})
    fig, axes = plt.subplots(1, len(precisions), figsize=(6 * len(precisions), 4.5), squeeze=False)
    for ax, precision in zip(axes[0], precisions, strict=True):
        for attention, style in (("naive", "-"), ("fused", "--")):
            for name, color in zip(NAMES, ("C0", "C1", "C2", "C3", "C4"), strict=True):
                pts = sorted(
                    (r["seq_len"], (r["jax_saved_device"] + r["jax_saved_host"]) / MIB)
                    for r in result["cpu"]
                    if r["precision"] == precision
                    and r["attention"] == attention
                    and r["policy"] == name
                )
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, style, color=color, marker="o", label=f"{attention} {name}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("saved activations, MiB (JAX residual accounting)")
        ax.set_title(f"{precision}: naive none grows as s², fused as s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("GPT-3-shaped layer (d 512, 32 heads, 4 layers, batch 2), planned from shapes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def refresh_naive(out: str, gpu_plans_json: str) -> None:
    stem = os.path.join(out, "attention")
    with open(stem + ".json") as f:
        result = json.load(f)
    with open(gpu_plans_json) as f:
        measured = json.load(f)
    naive = {r["policy"]: r for r in measured["rows"] if r["preset"] == "gpt2-124m"}
    for row in result["gpu"]:
        if row["attention"] == "naive":
            r = naive[row["policy"]]
            row |= {
                "saved_device": r["saved_activation_bytes_device"],
                "saved_host": r["saved_activation_bytes_host"],
                "temp": r["compiled_temp_bytes"],
                "plan_host": r["plan_host_bytes"],
                "planned_peak": r["planned_peak_bytes"],
                "flops": r["flops"],
                "source": f"{gpu_plans_json} (measured {measured['meta']['date']})",
            }
    write_json_atomic(stem + ".json", result)
    write_atomic(stem + ".md", to_markdown(result))
    print(f"rewrote {stem}.json and .md with the naive rows of {gpu_plans_json}")


def add_policies(out: str, names: list[str], precisions: list[str], seqs: str) -> None:
    import torch

    torch.set_num_threads(1)
    stem = os.path.join(out, "attention")
    with open(stem + ".json") as f:
        result = json.load(f)
    new = cpu_rows(precisions, [int(s) for s in seqs.split(",")], names)
    keys = {(r["precision"], r["seq_len"], r["attention"], r["policy"]) for r in new}
    kept = [
        r
        for r in result["cpu"]
        if (r["precision"], r["seq_len"], r["attention"], r["policy"]) not in keys
    ]
    order = {n: i for i, n in enumerate(NAMES)}
    result["cpu"] = sorted(
        kept + new,
        key=lambda r: (
            -len(r["precision"]),  # fp32 before bf16, as measured
            r["precision"],
            r["seq_len"],
            ATTENTIONS.index(r["attention"]),
            order[r["policy"]],
        ),
    )
    result["check_at_1024"] = check_at_1024(result["cpu"])
    result["meta"]["added"] = result["meta"].get("added", []) + [
        {
            "policies": names,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
    ]
    write_json_atomic(stem + ".json", result)
    write_atomic(stem + ".md", to_markdown(result))
    plot(result, stem + "_vs_seq.png")
    print(f"added {len(new)} rows to {stem}.json, .md, _vs_seq.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/attention")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)))
    parser.add_argument("--skip-gpu", action="store_true", help="no H100 rows")
    parser.add_argument("--gpu-plans", default="benchmarks/results/gpu_plans/h100_bf16.json")
    parser.add_argument(
        "--refresh-naive",
        action="store_true",
        help="measure nothing: re-read the naive H100 rows from --gpu-plans (a newer run of "
        "gpu_plans.py) into the last results, keeping every row this script measured",
    )
    parser.add_argument(
        "--add",
        default=None,
        help=f"measure only these policies (of {', '.join(NAMES)}; CPU rows) and merge them "
        "into the last results, replacing their old rows",
    )
    args = parser.parse_args()
    if args.refresh_naive:
        refresh_naive(args.out, args.gpu_plans)
        return
    if args.add:
        add_policies(args.out, args.add.split(","), args.precisions.split(","), args.seqs)
        return
    import torch

    torch.set_num_threads(1)  # shapes only: nothing to parallelise
    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    cpu = cpu_rows(args.precisions.split(","), [int(s) for s in args.seqs.split(",")])
    gpu = [] if args.skip_gpu else gpu_rows(args.gpu_plans)
    result = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU)",
            "jax": jax.__version__,
            "torch": torch.__version__,
            "model": {
                "d_model": CFG.d_model,
                "n_heads": CFG.n_heads,
                "d_ff": CFG.d_ff,
                "n_layers": CFG.n_layers,
                "batch": BATCH,
                "attention_block": CFG.attention_block,
            },
            "seconds": None,
        },
        "cpu": cpu,
        "check_at_1024": check_at_1024(cpu),
        "gpu": gpu,
    }
    result["meta"]["seconds"] = round(time.perf_counter() - started)
    stem = os.path.join(args.out, "attention")
    write_json_atomic(stem + ".json", result)
    write_atomic(stem + ".md", to_markdown(result))
    plot(result, stem + "_vs_seq.png")
    print(f"wrote {stem}.json, .md, _vs_seq.png in {result['meta']['seconds']} s")


if __name__ == "__main__":
    main()

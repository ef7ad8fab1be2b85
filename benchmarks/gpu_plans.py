# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""The train step's memory plan compiled for a GPU target without a GPU, per model and policy,
with the PyTorch column, XLA:CPU's plan for contrast and the largest batch that fits (needs
``jaxmem[gpu-plan]``; the torch column needs ``jaxmem[torch]``).

    python benchmarks/gpu_plans.py --target h100 --out benchmarks/results/gpu_plans

Every figure is labelled in the output: device temporaries, arguments and host bytes come from
``memory_analysis()`` of the plan XLA:CUDA compiled for the target; saved activations from
residual accounting (the jaxpr of ``jax.vjp``) for JAX and from torch_ref's step run under
``FakeTensorMode`` (shapes only) for PyTorch; the analytic column from ``jaxmem.memory.analytic``
(the block stack only); FLOPs from the gradient's jaxpr / ``FlopCounterMode``; the XLA:CPU column
from the same step compiled for this machine's CPU backend (from shapes); the largest batch from
plans compiled at the batch sizes it names (``b`` fits and ``b + 1`` does not, both compiled).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections.abc import Callable

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()  # before JAX starts: CPU backend, no plugin start-up noise
import jax

from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.remat import REMAT_REVISION
from jaxmem.memory.targets import LOCAL, Target, get_target
from jaxmem.planner.plans import plan_step
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES, MemoryPolicy, nested_segment_size
from jaxmem.precision import Precision, get_precision
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import STEP_REVISION

# what the saved-activation columns count (rows of another accounting are measured again)
ACCOUNTING = "parameter copies apart from activations"

# batch x sequence as these models are trained (GPT-2: 1024 tokens; GPT-3: 2048)
SHAPES = {
    "gpt2-124m": (8, 1024),
    "gpt2-355m": (8, 1024),
    "gpt2-774m": (8, 1024),
    "gpt2-1.5b": (8, 1024),
    "gpt3-6.7b": (1, 2048),
}
GB = 1e9


def trained_step(preset: str, precision: Precision, target: Target) -> StepSpec:
    """``preset``'s step (AdamW, no remat: callers replace the policy) at the batch and sequence
    it is trained at (``SHAPES``), compiled for ``target``."""
    batch, seq_len = SHAPES[preset]
    return StepSpec(
        model=get_preset(preset),
        policy=POLICIES["none"],
        precision=precision,
        batch=batch,
        seq_len=seq_len,
        target=target,
    )


def largest_batch(spec: StepSpec, known: dict[int, int]) -> dict:
    """The largest batch of ``spec``'s step whose planned peak fits its target, with the two
    plans that show it (``b`` fits, ``b + 1`` does not; ``search_largest``). ``known``: batch ->
    planned peak already planned."""

    def plan(b: int) -> int:
        return plan_step(spec.replace(batch=b))["planned_peak_bytes"]

    return search_largest(plan, spec.target.device_memory_bytes, known)


def search_largest(plan: Callable[[int], int], budget: int, known: dict[int, int]) -> dict:
    """The largest ``b`` with ``plan(b) <= budget`` (``plan``: the planned peak of ``b``, e.g.
    rows per device), shown by two compiled plans (``b`` fits and ``b + 1`` does not). Plans are
    compiled where the search needs them; the next ``b`` to try is predicted from the two
    nearest plans (the peak is close to affine in the batch), so a search takes a few compiles.
    ``known``: ``b`` -> planned peak already planned."""
    peaks = dict(known)

    def peak(b: int) -> int:
        if b not in peaks:
            peaks[b] = plan(b)
        return peaks[b]

    if peak(1) > budget:
        return {"batch": 0, "plans": {1: peaks[1]}, "compiled": sorted(peaks)}
    bisect_next = False
    while True:
        lo = max(b for b in peaks if peaks[b] <= budget)  # fits
        above = [b for b in peaks if peaks[b] > budget and b > lo]
        hi = min(above) if above else None  # does not fit
        if hi == lo + 1:
            return {"batch": lo, "plans": {lo: peaks[lo], hi: peaks[hi]}, "compiled": sorted(peaks)}
        if hi is not None:
            # bracketed: interpolate between the two plans (the peak is close to affine in the
            # batch), every other step bisecting so that a bent curve still closes the bracket
            # in a few compiles (stepping down from hi one batch at a time did not: gpt2-774m
            # `full` compiled 60+ plans of ~180 GiB, 8 s each)
            if bisect_next:
                guess = (lo + hi) // 2
            else:
                guess = lo + int((budget - peaks[lo]) * (hi - lo) / (peaks[hi] - peaks[lo]))
            guess = min(max(guess, lo + 1), hi - 1)
            bisect_next = not bisect_next
        else:
            others = [b for b in peaks if b != lo]
            if others:  # the slope from lo and its nearest planned neighbour
                near = min(others, key=lambda b: abs(b - lo))
                slope = max((peaks[near] - peaks[lo]) / (near - lo), 1.0)
                # at most doubling: a far overshoot compiles a huge program, on which XLA's
                # rematerialization pass (trying to fit the device) spends minutes per compile
                guess = lo + max(1, min(int((budget - peaks[lo]) // slope), lo))
            else:
                guess = lo + 1
        peak(guess)


def _measured_repr(policy: MemoryPolicy) -> str:
    """A preset as the measured rows name it: the repr of the flat policy they were measured
    under (its fields before a policy was made of parts, without those added since at their
    defaults), rebuilt from the preset's parts, so the rows whose definition did not change
    still match."""
    block = policy.head
    return (
        f"MemoryPolicy(name={policy.name!r}, remat={block.remat}, save={block.save!r}, "
        f"offload={block.offload!r}, save_dots={block.save_dots}, nested={policy.nested}, "
        "layers=LayerSelection(every=None, first=None, layers=None), "
        f"use_reentrant={policy.use_reentrant})"
    )


def measure(
    target_name: str,
    presets: list[str],
    policies: list[str],
    precision: str,
    skip: set[str],
    partial: str,
    batch_presets: set[str],
    earlier: list[dict],
) -> list:
    """One row per (model, policy). Rows are kept in ``partial`` (JSON) as they are measured, so
    a run that stops resumes where it stopped; a row measured before (``partial``, or
    ``earlier``: the last finished run's) gains the parts it lacks (e.g. the largest batch,
    searched in a later run) and is otherwise reused as measured."""
    target = get_target(target_name)
    prec = get_precision(precision)
    kept = {(r["preset"], r["policy"]): r for r in earlier}
    if os.path.exists(partial):
        with open(partial) as f:
            kept |= {(r["preset"], r["policy"]): r for r in json.load(f)}
    done: dict[str, list[str]] = {"plans": [], "cpu": [], "torch": [], "batch": []}
    for preset in presets:
        cfg = get_preset(preset)
        batch, seq_len = SHAPES[preset]
        for name in policies:
            start = time.perf_counter()
            rec = kept.get((preset, name))
            # A row measured under another definition of the policy or another translation of
            # it is measured again; one measured under another accounting (``ACCOUNTING``) is
            # measured again but keeps its largest batch, which the accounting does not touch.
            policy_repr = _measured_repr(POLICIES[name])
            definition = (
                f"{policy_repr} remat revision {REMAT_REVISION} step revision {STEP_REVISION}"
            )
            same = (
                rec is not None
                and rec["target"] == target.name
                and rec["precision"] == precision
                and rec.get("policy_definition") == definition
            )
            spec = trained_step(preset, prec, target).replace(policy=POLICIES[name])
            if not same or rec.get("accounting") != ACCOUNTING:
                found = rec.get("largest_batch") if same else None
                rec = jax_record(spec)
                rec |= {"preset": preset, "policy_definition": definition, "accounting": ACCOUNTING}
                if found:
                    rec["largest_batch"] = found
                done["plans"].append(f"{preset} {name}")
            if "cpu" not in skip and "cpu_plan" not in rec:
                rec["cpu_plan"] = plan_step(spec.replace(target=LOCAL))
                done["cpu"].append(f"{preset} {name}")
            if "torch" not in skip and "torch" not in rec:
                from jaxmem.compare.records import torch_record

                t = torch_record(
                    cfg, POLICIES[name], prec, OptimizerConfig(), batch, seq_len, fake=True
                )
                keys = ("translation", "saved_activation_bytes_device")
                keys += ("saved_activation_bytes_host", "saved_source", "flops", "flops_source")
                rec["torch"] = {k: t[k] for k in keys}
                done["torch"].append(f"{preset} {name}")
            if "batch" not in skip and preset in batch_presets and "largest_batch" not in rec:
                rec["largest_batch"] = largest_batch(spec, {batch: rec["planned_peak_bytes"]})
                done["batch"].append(f"{preset} {name}")
            rec["seconds"] = round(rec.get("seconds", 0) + time.perf_counter() - start, 1)
            kept[(preset, name)] = rec
            write_json_atomic(partial, list(kept.values()))
            found = rec.get("largest_batch")
            print(
                f"{preset} {name}: planned peak {rec['planned_peak_bytes'] / GB:.2f} GB"
                + (f", largest batch {found['batch']}" if found else "")
                + f" ({rec['seconds']} s in all)",
                flush=True,
            )
    # every row: those this run measured and those it kept from earlier runs (a run over some
    # models or policies must not drop the others from the results)
    order = {p: i for i, p in enumerate(SHAPES)}
    names = list(POLICIES)
    everything = sorted(
        kept.values(), key=lambda r: (order.get(r["preset"], 99), names.index(r["policy"]))
    )
    return everything, done


def nested_vs_full(target_name: str, precision: str, base: str, depths: list[int]) -> list:
    """Device temporaries of full and nested by depth at one width (the H100 plan): where √L
    segments start to pay off."""
    target, prec = get_target(target_name), get_precision(precision)
    batch, seq_len = SHAPES[base]
    out = []
    for depth in depths:
        cfg = get_preset(base).replace(n_layers=depth)
        row = {"base": base, "n_layers": depth, "batch": batch, "seq_len": seq_len}
        spec = trained_step(base, prec, target).replace(model=cfg)
        for name in ("full", "nested"):
            plan = plan_step(spec.replace(policy=POLICIES[name]))
            row[f"{name}_temp_bytes"] = plan["compiled_plan"]["temp_bytes"]
        row["segment_size"] = nested_segment_size(depth)
        print(
            f"depth {depth}: full {row['full_temp_bytes'] / GB:.2f} GB, nested "
            f"{row['nested_temp_bytes'] / GB:.2f} GB",
            flush=True,
        )
        out.append(row)
    return out


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / GB:.2f}"


def to_markdown(rows: list[dict], meta: dict, depth_rows: list[dict]) -> str:
    budget = meta["target"]["device_memory_bytes"] / GB
    lines = [
        f"Train-step plans compiled for {meta['target']['description']} without a GPU "
        f"({rows[0]['compiler']}), {meta['precision']}, AdamW; {meta['date']}, jax "
        f"{meta['jax']}, on {meta['host']}.",
        "",
        "### The plan, whether it fits, and the largest batch that does",
        "",
        "Device temp, arguments and host: the plan's `memory_analysis()`; planned peak = "
        f"arguments + outputs - aliased + temporaries; fits = planned peak <= {budget:.1f} GB "
        "(jaxmem's check: a deviceless compile never fails for lack of memory). Largest batch: "
        "the largest batch (at this sequence length) whose plan fits, shown by two compiled "
        "plans (b fits, b + 1 does not; 0 = not even batch 1). XLA:CPU temp: the same step "
        "compiled for this machine's CPU backend, for contrast (it erases host offload). "
        "Largest batch '-': not searched (the JSON's `meta.passes` says what each run measured).",
        "",
        "| model | batch × seq | policy | device temp GB | arguments GB | host GB | planned peak "
        "GB | fits | largest batch (peak GB at b / b+1) | XLA:CPU temp GB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["compiled_plan"]
        lb = r.get("largest_batch")
        if lb is None:
            batch_cell = "-"
        else:
            plans = {int(k): v for k, v in lb["plans"].items()}
            b = lb["batch"]
            shown = " / ".join(f"{plans[k] / GB:.1f}" for k in sorted(plans))
            batch_cell = f"{b} ({shown})"
        cpu = r.get("cpu_plan")
        lines.append(
            f"| {r['preset']} | {r['batch']} × {r['seq_len']} | {r['policy']} | "
            f"{p['temp_bytes'] / GB:.2f} | {p['argument_bytes'] / GB:.2f} | "
            f"{r['plan_host_bytes'] / GB:.2f} | {r['planned_peak_bytes'] / GB:.2f} | "
            f"{'yes' if r['fits'] else 'no'} | {batch_cell} | "
            f"{_gb(cpu and cpu['compiled_plan']['temp_bytes'])} |"
        )
    lines += [
        "",
        "### What each framework keeps for the backward, and its FLOPs",
        "",
        "Saved (device + host GB): JAX residual accounting (jaxpr of `jax.vjp`); torch: "
        "torch_ref's stock-PyTorch step run under `FakeTensorMode` (shapes only, live-tensor "
        "accounting; its translation in the JSON); analytic: `jaxmem.memory.analytic` (the "
        "block stack only). GFLOP: matmul FLOPs executed, recompute included (JAX: the "
        "gradient's jaxpr; torch: `FlopCounterMode`).",
        "",
        "| model | policy | JAX saved GB | torch saved GB | analytic GB (stack only) | JAX GFLOP "
        "| torch GFLOP |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r.get("torch")
        torch_saved = (
            "-"
            if t is None
            else f"{t['saved_activation_bytes_device'] / GB:.2f} + "
            f"{t['saved_activation_bytes_host'] / GB:.2f}"
        )
        torch_flops = "-" if t is None else f"{t['flops'] / 1e9:,.0f}"
        lines.append(
            f"| {r['preset']} | {r['policy']} | {r['saved_activation_bytes_device'] / GB:.2f} + "
            f"{r['saved_activation_bytes_host'] / GB:.2f} | {torch_saved} | "
            f"{r['analytic_activation_bytes'] / GB:.2f} | {r['flops'] / 1e9:,.0f} | "
            f"{torch_flops} |"
        )
    if depth_rows:
        d0 = depth_rows[0]
        lines += [
            "",
            f"### full vs nested by depth ({d0['base']} width, {d0['batch']} × {d0['seq_len']})",
            "",
            "Device temporaries of the plan; nested's segment size is "
            "`jaxmem.policy.nested_segment_size` (a divisor of L near √L where one exists).",
            "",
            "| layers | segment size | full temp GB | nested temp GB | nested / full |",
            "|---|---|---|---|---|",
        ]
        for d in depth_rows:
            lines.append(
                f"| {d['n_layers']} | {d['segment_size']} | {d['full_temp_bytes'] / GB:.2f} | "
                f"{d['nested_temp_bytes'] / GB:.2f} | "
                f"{d['nested_temp_bytes'] / d['full_temp_bytes']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, policy in enumerate(policies):
        peaks = [
            next(
                r["planned_peak_bytes"] for r in rows if r["preset"] == p and r["policy"] == policy
            )
            / GB
            for p in presets
        ]
        ax.bar([i + j * width for i in range(len(presets))], peaks, width, label=policy)
    ax.axhline(meta["target"]["device_memory_bytes"] / GB, color="k", ls="--", lw=1)
    ax.text(0, meta["target"]["device_memory_bytes"] / GB, " device memory", va="bottom")
    ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(presets))])
    ax.set_xticklabels([f"{p}\n{SHAPES[p][0]}×{SHAPES[p][1]}" for p in presets])
    ax.set_yscale("log")
    ax.set_ylabel("planned peak, GB (compiled plan, log scale)")
    ax.set_title(f"train step planned for {meta['target']['description']} ({meta['precision']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--presets", default=",".join(SHAPES))
    parser.add_argument("--policies", default="none,full,selective,offload,nested")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated parts not to measure in this run (what an earlier run of the same "
        "--out measured is kept): cpu (XLA:CPU contrast), torch (the FakeTensorMode column), "
        "batch (largest-batch search), depth (full vs nested by depth)",
    )
    parser.add_argument(
        "--batch-presets", default=None, help="models to search the largest batch for (default all)"
    )
    parser.add_argument("--depth-base", default="gpt2-1.5b")
    parser.add_argument("--depths", default="12,24,36,48,72")
    parser.add_argument("--out", default="benchmarks/results/gpu_plans")
    parser.add_argument("--note", default=None, help="a line recorded with this run's pass")
    args = parser.parse_args()
    presets, policies = args.presets.split(","), args.policies.split(",")
    skip = {x for x in args.skip.split(",") if x}
    target = get_target(args.target)
    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{target.name}_{args.precision}")
    batch_presets = set(args.batch_presets.split(",")) if args.batch_presets else set(presets)
    earlier = {"rows": [], "nested_vs_full": []}
    if os.path.exists(stem + ".json"):  # what the last finished run measured is reused
        with open(stem + ".json") as f:
            earlier = json.load(f)
    rows, done = measure(
        args.target,
        presets,
        policies,
        args.precision,
        skip,
        stem + ".partial.json",
        batch_presets,
        earlier.get("rows", []),
    )
    depth_rows = earlier.get("nested_vs_full", [])
    if "depth" not in skip:
        depths = [int(d) for d in args.depths.split(",")]
        depth_rows = nested_vs_full(args.target, args.precision, args.depth_base, depths)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU needed)",
        "jax": jax.__version__,
        "precision": args.precision,
        "seconds": round(time.perf_counter() - started),
        # one entry per run that wrote this file; rows measured in earlier runs are reused
        "passes": earlier.get("meta", {}).get("passes", [])
        + [
            {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "seconds": round(time.perf_counter() - started),
                # what this run measured (rows it did not list were reused as measured before)
                "measured": {k: v for k, v in done.items() if v}
                | ({"depth": args.depths} if "depth" not in skip else {}),
            }
            | ({"note": args.note} if args.note else {})
        ],
        "target": {
            "name": target.name,
            "description": target.description,
            "device_memory_bytes": target.device_memory_bytes,
            "config": target.source,
        },
    }
    write_json_atomic(stem + ".json", {"meta": meta, "rows": rows, "nested_vs_full": depth_rows})
    write_atomic(stem + ".md", to_markdown(rows, meta, depth_rows))
    plot(rows, meta, stem + ".png")
    if os.path.exists(stem + ".partial.json"):
        os.remove(stem + ".partial.json")
    print(f"wrote {stem}.json, .md, .png in {meta['seconds']} s")


if __name__ == "__main__":
    main()

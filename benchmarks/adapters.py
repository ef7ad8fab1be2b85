# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""Fine-tuning with adapters on one GPU, planned without it: full fine-tuning vs LoRA (bf16 base)
vs QLoRA (nf4 base) for Llama 3 shapes on a 24 GB, a 48 GB and an 80 GB target (needs
``jaxmem[gpu-plan]``; cuDNN's library for the fused attention kernel).

    python benchmarks/adapters.py --out benchmarks/results/adapters

Per row (model x method x target): bytes by kind, each labelled how it was obtained (frozen and
trainable parameters, gradients and optimizer state: analytic, from shapes,
``jaxmem.memory.analytic.model_state_bytes``; saved activations: analytic,
``analytic.saved_activation_bytes``, the block stack; compiled temporaries, arguments and the
planned peak: the plan XLA:CUDA compiles for the target without a GPU, ``planner.plans.plan_step``,
the function ``jaxmem memory --target`` plans with); the largest batch at 2,048 and at 8,192
tokens and the longest sequence at batch 1, each shown by two compiled plans (fits at N, over at
the next step), with the plan's estimated step time. A row whose arguments alone (parameters,
gradients, optimizer state, analytic) exceed the target is resolved without compiling.

Compiles are few and ordered: the goal rows first, then one plan per row at 1 x 2,048, then the
searches, cheapest model first. Every plan is written to the JSON as it is compiled, so a run
that stops (``--budget-s``) keeps what it measured and a later run resumes from it; ``--render``
rewrites the Markdown from the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import time
from typing import Any

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()  # before JAX starts: CPU backend, no plugin start-up noise
import jax
import jaxlib

from jaxmem.adapters import AdapterConfig
from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory import analytic
from jaxmem.memory.targets import get_target
from jaxmem.model.flash import KERNEL_NAMES, cudnn_installed, fused_kernel
from jaxmem.parallel import ParallelConfig
from jaxmem.planner.plans import plan_step
from jaxmem.policy import POLICIES, LossPolicy
from jaxmem.precision import get_precision
from jaxmem.step.spec import StepSpec

PRESETS = ("llama-3.2-1b", "llama-3-8b", "llama-3.1-8b", "llama-3-70b")
TARGETS = ("rtx4090-24gb", "l40s-48gb", "h100")
# PEFT's LoraConfig with the attention projections targeted (q_proj, k_proj, v_proj, o_proj)
LORA = AdapterConfig(rank=16, alpha=16.0, targets=("q", "k", "v", "o"))
METHODS = {
    "full": AdapterConfig(),
    "lora": LORA,
    "qlora": dataclasses.replace(LORA, base="nf4"),
}
# bf16 parameters, activations and AdamW state (torchtune's single-device recipes): LoRA's
# frozen base is then stored in bf16 (jaxmem's ``bf16`` keeps fp32 master weights)
PRECISION = "pure-bf16"
CHUNK = 1024  # tokens per loss chunk, and the unit of the sequence search
BATCH_SEQS = (2048, 8192)
# the goal rows: Unsloth's published Llama-3.1-8B QLoRA maxima (tokens at batch 1), and QLoRA's
# 65B on one 48 GB GPU (here Llama-3-70B)
GOALS = {
    ("llama-3.1-8b", "qlora", "rtx4090-24gb"): 78475,
    ("llama-3.1-8b", "qlora", "h100"): 342733,
}
GOAL_70B = ("llama-3-70b", "qlora", "l40s-48gb")
# the goal rows search past the preset's max_seq_len (131,072 for Llama 3.1), as Unsloth's
# 342,733 does; the others stop at it
GOAL_SEQ_CAP = 1 << 20
GIB = 2**30


def policy(seq_len: int):
    """``full`` remat (each block keeps its input, recomputes the rest) and the loss in chunks of
    ``CHUNK`` tokens per row (no [B, S, V] logits kept)."""
    return dataclasses.replace(
        POLICIES["full"], name="full+chunks", loss=LossPolicy(chunks=max(1, seq_len // CHUNK))
    )


def seq_cap(key: tuple) -> int:
    return GOAL_SEQ_CAP if key in GOALS else get_preset(key[0]).max_seq_len


def spec_of(key: tuple, batch: int, seq_len: int) -> StepSpec:
    preset, method, target = key
    model = get_preset(preset).replace(attention="fused")
    if seq_len > model.max_seq_len:
        model = model.replace(max_seq_len=seq_len)
    return StepSpec(
        model=model,
        policy=policy(seq_len),
        precision=get_precision(PRECISION),
        batch=batch,
        seq_len=seq_len,
        target=get_target(target),
        adapters=METHODS[method],
    )


def analytic_row(key: tuple) -> dict[str, Any]:
    """Bytes by kind that need no compile (analytic, from shapes), and whether the arguments
    alone (parameters, gradients, optimizer state) exceed the target."""
    preset, method, target = key
    cfg, adapters = get_preset(preset), METHODS[method]
    prec, opt = get_precision(PRECISION), OptimizerConfig()
    state = analytic.model_state_bytes(cfg, opt, prec, ParallelConfig(), adapters)
    if adapters.enabled:
        a = analytic.adapter_state(cfg, adapters, opt, prec)
        frozen, trainable = a.quantized_bytes + a.other_frozen_bytes, a.trainable_bytes
        trainable_params = a.trainable_params
    else:
        frozen, trainable, trainable_params = 0, state["params"], cfg.n_params
    saved = analytic.saved_activation_bytes(cfg, policy(2048), 1, 2048, prec)
    arguments = state["params"] + state["grads"] + state["opt_state"]
    budget = get_target(target).device_memory_bytes
    return {
        "preset": preset,
        "method": method,
        "target": target,
        "adapters": adapters.label(),
        "trainable_params": trainable_params,
        "frozen_params_bytes": frozen,
        "trainable_params_bytes": trainable,
        "grads_bytes": state["grads"],
        "opt_state_bytes": state["opt_state"],
        "state_source": "analytic: jaxmem.memory.analytic.model_state_bytes (from shapes)",
        "arguments_analytic_bytes": arguments,
        "saved_activation_bytes_1x2048": saved.device_bytes + saved.host_bytes,
        "saved_source": "analytic: jaxmem.memory.analytic.saved_activation_bytes (the block "
        "stack, batch 1 x 2,048)",
        "device_memory_bytes": budget,
        "arguments_fit": arguments <= budget,
    }


class Bench:
    """The rows and every plan compiled, kept in ``path`` (JSON) after each compile."""

    def __init__(self, path: str, budget_s: float):
        self.path, self.deadline = path, time.monotonic() + budget_s
        self.data: dict[str, Any] = {"rows": {}, "plans": {}}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)
        self.meta = self.data.setdefault("meta", {})

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def save(self) -> None:
        self.meta["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        write_json_atomic(self.path, self.data)

    def row(self, key: tuple) -> dict[str, Any]:
        name = "|".join(key)
        if name not in self.data["rows"]:
            self.data["rows"][name] = analytic_row(key)
        return self.data["rows"][name]

    def peak(self, key: tuple, batch: int, seq_len: int) -> int | None:
        """The planned peak of ``key`` at ``batch`` x ``seq_len`` (compiled once, kept); None
        when the time budget is spent."""
        name = f"{'|'.join(key)}|{batch}x{seq_len}"
        plans = self.data["plans"]
        if name not in plans:
            if self.out_of_time():
                return None
            start = time.perf_counter()
            p = plan_step(spec_of(key, batch, seq_len))
            cp = p["compiled_plan"]
            st = p["step_time"] or {}
            plans[name] = {
                "batch": batch,
                "seq_len": seq_len,
                "planned_peak_bytes": p["planned_peak_bytes"],
                "temp_bytes": cp["temp_bytes"],
                "argument_bytes": cp["argument_bytes"],
                "host_bytes": cp["host_temp_bytes"] + cp["host_argument_bytes"],
                "step_time_s": st.get("seconds"),
                "mfu": st.get("mfu"),
                "compiler": p["compiler"],
                "compile_s": round(time.perf_counter() - start, 1),
            }
            self.save()
            print(
                f"{name}: {p['planned_peak_bytes'] / GIB:.2f} GiB, est. "
                f"{plans[name]['step_time_s']} s/step ({plans[name]['compile_s']} s)",
                flush=True,
            )
        return plans[name]["planned_peak_bytes"]

    def search(self, key: tuple, what: str, unit: int, cap: int, known: dict, first: int) -> None:
        """The largest ``x`` (batch at a sequence, or sequence at batch 1, in steps of ``unit``)
        whose plan fits, shown by two compiled plans: ``x`` fits, ``x + unit`` does not (or
        ``x`` is ``cap``). ``known``: x -> planned peak already compiled; ``first``: the first
        guess (a tokens-affine prediction, or 0: extrapolate from ``known``'s two largest);
        a guess that fits is followed at once by the next step; then the bracket closes by
        interpolation and bisection."""
        row = self.row(key)
        if what in row:
            return
        budget = row["device_memory_bytes"]
        if what == "longest_seq_b1":
            at = lambda x: self.peak(key, 1, x)  # noqa: E731
        else:
            seq = int(what.rsplit("_", 1)[1])
            at = lambda x: self.peak(key, x, seq)  # noqa: E731
        peaks = dict(known)
        bisect = False
        while True:
            fits = [x for x in peaks if peaks[x] <= budget]
            lo = max(fits) if fits else 0
            over = [x for x in peaks if peaks[x] > budget and x > lo]
            hi = min(over) if over else None
            if lo == cap or (hi is not None and hi - lo == unit) or (hi == unit and not fits):
                break
            if hi is None and first > lo:
                guess = first
            elif hi is None:  # extrapolate from the two largest plans (close to affine)
                a, b = sorted(peaks)[-2:]
                slope = max((peaks[b] - peaks[a]) / (b - a), 1.0)
                guess = b + int((budget - peaks[b]) // slope) // unit * unit
            elif bisect or not fits:
                guess = (lo + hi) // 2 // unit * unit
            else:
                guess = lo + int((budget - peaks[lo]) * (hi - lo) / (peaks[hi] - peaks[lo]))
                guess = guess // unit * unit
            if hi is not None:
                bisect = not bisect
            guess = min(max(guess, lo + unit), cap, (hi or cap + unit) - unit)
            for x in (guess, guess + unit):
                if x in peaks or x > cap:
                    continue
                p = at(x)
                if p is None:
                    return  # out of time: the row says what is missing
                peaks[x] = p
                if p > budget:
                    break
        shown = {str(x): peaks[x] for x in (lo, hi) if x}
        row[what] = {"value": lo, "capped": lo == cap, "plans": shown, "compiled": len(peaks)}
        self.save()


def search_row(bench: Bench, key: tuple, what: str) -> bool:
    """One search of ``key``'s row, from plans at 2,048 and 8,192 (compiled if missing): the
    sequence search extrapolates from them; a batch search at S starts at batch 1 and guesses
    the batch the tokens-affine fit of the two predicts. False when out of time."""
    p2, p8 = bench.peak(key, 1, 2048), bench.peak(key, 1, 8192)
    if p2 is None or p8 is None:
        return False
    budget = bench.row(key)["device_memory_bytes"]
    if what == "longest_seq_b1":
        bench.search(key, what, CHUNK, seq_cap(key), {2048: p2, 8192: p8}, 0)
    else:
        seq = int(what.rsplit("_", 1)[1])
        per_token = max((p8 - p2) / (8192 - 2048), 1.0)
        base = p2 if seq == 2048 else p8
        first = 1 + int((budget - base) // (per_token * seq)) if base <= budget else 1
        bench.search(key, what, 1, 1 << 16, {1: base}, max(first, 1))
    return what in bench.row(key)


def explain(bench: Bench, key: tuple) -> None:
    """What holds the peak of ``key``'s plan at its longest sequence (``jaxmem peak``: XLA's
    buffer assignment, compiled again in a child process)."""
    row = bench.row(key)
    found = row.get("longest_seq_b1")
    if found is None or "peak_at_longest" in row or bench.out_of_time() or not found["value"]:
        return
    from jaxmem.planner.peak import explain_peak

    start = time.perf_counter()
    report = explain_peak(spec_of(key, 1, found["value"]))
    top = sorted(report.values, key=lambda v: -v.bytes)[:8]
    row["peak_at_longest"] = {
        "seq_len": found["value"],
        "planned_peak_bytes": report.planned_peak_bytes,
        "live_bytes": report.live_bytes,
        "at_peak": report.at_peak,
        "by_kind_bytes": report.by_kind(),
        "largest": [
            {"shape": v.shape, "bytes": v.bytes, "kind": v.kind, "op": v.op_name} for v in top
        ],
        "source": "compiled plan: XLA's buffer assignment (jaxmem.planner.peak.explain_peak)",
        "compile_s": round(time.perf_counter() - start, 1),
    }
    bench.save()


def run_row(bench: Bench, key: tuple, parts: tuple[str, ...]) -> None:
    """``parts`` of ``key``'s row (``1x2048``: one plan; the rest: searches), in order; a row
    whose arguments alone exceed the target compiles nothing."""
    row = bench.row(key)
    if not row["arguments_fit"]:
        return
    for what in parts:
        if what == "1x2048":
            if bench.peak(key, 1, 2048) is None:
                return
        elif what not in row and not search_row(bench, key, what):
            return


# the searches' order: the goals' model first, then the 70B, Llama-3-8B's longest sequence
# (capped at its max_seq_len 8,192: one plan), the 1B, and Llama-3-8B's batches (Llama-3.1-8B's
# shapes without its RoPE scaling)
SEARCH_PHASES = (
    ("llama-3.1-8b", ("longest_seq_b1", "largest_batch_2048", "largest_batch_8192")),
    ("llama-3-70b", ("longest_seq_b1", "largest_batch_2048", "largest_batch_8192")),
    ("llama-3-8b", ("longest_seq_b1",)),
    ("llama-3.2-1b", ("longest_seq_b1", "largest_batch_2048", "largest_batch_8192")),
    ("llama-3-8b", ("largest_batch_2048", "largest_batch_8192")),
)


def search_order(key: tuple) -> tuple[int, int]:
    """Within a model: QLoRA, LoRA, then full; targets from the smallest."""
    return ("qlora", "lora", "full").index(key[1]), TARGETS.index(key[2])


def all_keys() -> list[tuple]:
    return [(p, m, t) for p in PRESETS for m in METHODS for t in TARGETS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/adapters")
    parser.add_argument("--budget-s", type=float, default=3600.0, help="stop compiling after")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "adapters.json")
    bench = Bench(path, 0 if args.render else args.budget_s)
    kernel = fused_kernel(128, "bfloat16", "gpu", cudnn_installed())
    bench.meta |= {
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU: deviceless plans)",
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "precision": PRECISION,
        "policy": "full remat (each block keeps its input) + loss in chunks of "
        f"{CHUNK} tokens per row",
        "attention": f"fused: {KERNEL_NAMES.get(kernel, kernel)}",
        "optimizer": "AdamW (jaxmem's default OptimizerConfig)",
        "granularity": f"batch in steps of 1, sequence in multiples of {CHUNK}",
    }
    for key in all_keys():
        bench.row(key)
    bench.save()
    if not args.render:
        started = time.perf_counter()
        for key in GOALS:  # the goals first, and what holds the peak where one is not met
            run_row(bench, key, ("1x2048", "longest_seq_b1"))
        run_row(bench, GOAL_70B, ("1x2048",))
        for key, tokens in GOALS.items():
            if bench.row(key).get("longest_seq_b1", {}).get("value", tokens) < tokens:
                explain(bench, key)
        by_size = sorted(all_keys(), key=lambda k: get_preset(k[0]).n_params)
        for key in by_size:  # one plan per row: bytes by kind
            run_row(bench, key, ("1x2048",))
        for model, parts in SEARCH_PHASES:
            for key in sorted(all_keys(), key=search_order):
                if key[0] == model:
                    run_row(bench, key, parts)
        bench.meta["seconds_last_run"] = round(time.perf_counter() - started)
        bench.save()
    write_atomic(os.path.join(args.out, "adapters.md"), to_markdown(bench.data))
    print(f"wrote {path} and adapters.md")


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _plan(data: dict, key: tuple, batch: int, seq_len: int) -> dict | None:
    return data["plans"].get(f"{'|'.join(key)}|{batch}x{seq_len}")


def _found(data: dict, key: tuple, what: str) -> str:
    """A search's result: ``N (peak at N / at the next step, GiB; est. step time at N)``."""
    r = data["rows"]["|".join(key)]
    f = r.get(what)
    if f is None:
        return "not measured (time)"
    if not f["value"]:
        first = min(int(x) for x in f["plans"])
        return f"0 (over at {first:,}: {f['plans'][str(first)] / GIB:.1f})"
    peaks = " / ".join(f"{f['plans'][x] / GIB:.1f}" for x in sorted(f["plans"], key=int))
    if what == "longest_seq_b1":
        plan = _plan(data, key, 1, f["value"])
    else:
        plan = _plan(data, key, f["value"], int(what.rsplit("_", 1)[1]))
    cap = ", cap" if f["capped"] else ""
    return f"{f['value']:,}{cap} ({peaks}; {plan['step_time_s']:.2f} s)"


def _state_table(data: dict) -> list[str]:
    lines = [
        "### Parameters, gradients, optimizer state and saved activations (analytic)",
        "",
        "GiB, from shapes (`jaxmem.memory.analytic`): the same on every target. Saved "
        "activations: the block stack at batch 1 x 2,048 under the policy above.",
        "",
        "| model | method | trainable params | frozen | trainable | grads | AdamW state | "
        "arguments | saved act. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for preset in PRESETS:
        for method in METHODS:
            r = data["rows"][f"{preset}|{method}|{TARGETS[0]}"]
            lines.append(
                f"| {preset} | {method} | {r['trainable_params']:,} | "
                f"{_gib(r['frozen_params_bytes'])} | {_gib(r['trainable_params_bytes'])} | "
                f"{_gib(r['grads_bytes'])} | {_gib(r['opt_state_bytes'])} | "
                f"{_gib(r['arguments_analytic_bytes'])} | "
                f"{_gib(r['saved_activation_bytes_1x2048'])} |"
            )
    return lines


def _plan_table(data: dict) -> list[str]:
    lines = [
        "### Compiled plans: 1 x 2,048, the largest batches and the longest sequence",
        "",
        "XLA:CUDA deviceless compiles for each target (`jaxmem.planner.plans.plan_step`, what "
        "`jaxmem memory --target` plans). Temp, peak: GiB of the plan at batch 1 x 2,048 "
        "(planned peak = arguments + outputs - aliased + temporaries). Est. s: the plan's "
        "estimated step time (`jaxmem.memory.step_time`). Searches: N (planned peak GiB at N / "
        "at the next step; est. step time at N): N fits and the next step (batch + 1, sequence "
        "+ 1,024) does not, both compiled; 'cap': the preset's max_seq_len, not searched "
        "beyond; 0: not even the smallest step. 'not measured (time)': the run's compile "
        "budget (`--budget-s`, one shared 2-core machine) ended before that search; a rerun "
        "resumes from the JSON's plans.",
        "",
        "| model | method | target | temp | peak | est. s | batch @ 2,048 | batch @ 8,192 | "
        "longest seq, batch 1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for preset in PRESETS:
        for method in METHODS:
            for target in TARGETS:
                key = (preset, method, target)
                r = data["rows"]["|".join(key)]
                head = f"| {preset} | {method} | {target} |"
                if not r["arguments_fit"]:
                    lines.append(
                        f"{head} does not fit: arguments alone "
                        f"{_gib(r['arguments_analytic_bytes'])} GiB (analytic) | | | | | |"
                    )
                    continue
                p = _plan(data, key, 1, 2048)
                first = (
                    "not measured (time) | | |"
                    if p is None
                    else f"{_gib(p['temp_bytes'])} | {_gib(p['planned_peak_bytes'])} | "
                    f"{p['step_time_s']:.2f} |"
                )
                lines.append(
                    f"{head} {first} {_found(data, key, 'largest_batch_2048')} | "
                    f"{_found(data, key, 'largest_batch_8192')} | "
                    f"{_found(data, key, 'longest_seq_b1')} |"
                )
    return lines


def _holds(r: dict) -> str:
    """What the plan at the longest sequence holds at its peak (``jaxmem peak``), in words."""
    e = r.get("peak_at_longest")
    if e is None:
        return "what holds the peak: not measured (time)"
    kinds = ", ".join(
        f"{k} {v / GIB:.2f}" for k, v in sorted(e["by_kind_bytes"].items(), key=lambda x: -x[1])
    )
    cfg, seq = get_preset(r["preset"]), e["seq_len"]

    def what(v: dict) -> str:  # the buffer in words, where its shape says what it is
        if v["shape"].startswith(f"bf16[{cfg.n_layers},1,{seq},{cfg.d_model}]"):
            return "the block inputs `full` checkpoints, every layer's, "
        if f"{seq},{cfg.d_ff}]" in v["shape"]:
            return "an MLP intermediate of one block's recompute / backward, "
        return ""

    big = "; ".join(
        f"{v['shape']} {v['bytes'] / GIB:.2f} GiB ({what(v)}{v['kind']}, {v['op'][:60]})"
        for v in e["largest"][:4]
    )
    return (
        f"at {e['seq_len']:,} tokens the plan's peak ({e['planned_peak_bytes'] / GIB:.2f} GiB "
        f"planned, {e['live_bytes'] / GIB:.2f} GiB live at `{e['at_peak'][:60]}`) holds, by "
        f"kind (GiB, {e['source']}): {kinds}; its largest buffers: {big}"
    )


def _goals(data: dict) -> list[str]:
    rows = data["rows"]
    lines = ["### Goals", ""]
    key = "|".join(GOAL_70B)
    p = _plan(data, GOAL_70B, 1, 2048)
    budget = rows[key]["device_memory_bytes"]
    if p is None:
        state = "not measured (time)"
    else:
        fits = p["planned_peak_bytes"] <= budget
        state = (
            f"{'met' if fits else 'gap'}: planned peak {_gib(p['planned_peak_bytes'])} GiB at "
            f"1 x 2,048 against {_gib(budget)} GiB (compiled plan), est. "
            f"{p['step_time_s']:.2f} s per step"
        )
    lines.append(
        f"- Llama-3-70B QLoRA on one 48 GB target (l40s-48gb; QLoRA paper: 65B on 48 GB): {state}"
        f"; largest batch at 2,048: {_found(data, GOAL_70B, 'largest_batch_2048')}; longest "
        f"sequence at batch 1: {_found(data, GOAL_70B, 'longest_seq_b1')}."
    )
    for key, tokens in GOALS.items():
        r = rows["|".join(key)]
        f = r.get("longest_seq_b1")
        head = f"- Llama-3.1-8B QLoRA on {key[2]}, at or beyond Unsloth's {tokens:,} tokens"
        if f is None:
            lines.append(f"{head}: not measured (time).")
            continue
        met = f["value"] >= tokens
        line = f"{head}: {'met' if met else 'gap'}: {f['value']:,} tokens at batch 1 fit"
        line += f" (compiled plans: {_found(data, key, 'longest_seq_b1')})"
        if key[2] == "h100":
            line += "; Hugging Face + FlashAttention-2: 28,454 (Unsloth's figure)"
        if not met:
            line += f"; {_holds(r)}"
        lines.append(line + ".")
    lines += [
        "",
        "Options every row uses: the policy above (full remat, loss chunks, fused attention, "
        "cuDNN's kernel). The two Llama-3.1-8B goal rows search past the preset's max_seq_len "
        "(131,072; the model's max_seq_len raised for the plan, RoPE scaling unchanged), as "
        "Unsloth's 342,733 does; every other row stops at its preset's. Not in jaxmem yet, "
        "and what the long-sequence goals need: "
        "checkpointed block inputs offloaded to host memory (Unsloth's offloaded gradient "
        "checkpointing) and sequence tiling of the MLP's recompute.",
    ]
    return lines


def to_markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [
        f"Adapter fine-tuning planned for three GPUs without one ({meta.get('date')}, jax "
        f"{meta.get('jax')}, jaxlib {meta.get('jaxlib')}, on {meta.get('host')}). Precision "
        f"`{meta.get('precision')}` (bf16 parameters, activations and AdamW state); memory "
        f"policy for every row: {meta.get('policy')}; attention {meta.get('attention')}; "
        f"{meta.get('optimizer')}. full: every parameter trains; lora: PEFT-style LoRA rank "
        "16, alpha 16, targets q,k,v,o on a bf16 base; qlora: the same on an nf4 base (blocks "
        f"of 64, double-quantized absmax). Search granularity: {meta.get('granularity')}.",
        "",
        *_state_table(data),
        "",
        *_plan_table(data),
        "",
        *_goals(data),
        "",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""The LM head and loss whole and in chunks (``--loss-chunks``), in both frameworks.

    python benchmarks/loss_chunks.py --out benchmarks/results/loss_chunks

For each row (a preset at a GPU size, bf16 compute with fp32 master weights, AdamW, fused
attention, one microbatch): the whole-step plan compiled without a GPU for an H100 (planned
peak: arguments + outputs - aliased + temporaries), with the loss whole and in 8 chunks; the
activations the step keeps for its backward (JAX: residual accounting; torch_ref: live-tensor
accounting of its step on fake tensors, so GPU sizes exist on this machine) and the matmul
FLOPs executed (JAX: the gradient's jaxpr; torch_ref: FlopCounterMode). Last, one step small
enough to run here: XLA:CPU's plan and torch_ref's runtime peak (MemTracker, CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()
import jax
import torch

from jaxmem.compare.records import torch_record
from jaxmem.config import PRESETS, OptimizerConfig
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.targets import LOCAL, get_target
from jaxmem.planner.plans import plan_step
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES, LossPolicy
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

CHUNKS = 8
MIB = 2**20
# (preset, batch, seq, policy, precision, target, torch step: fake (GPU sizes) or run here)
ROWS = (
    ("gpt2-124m", 8, 1024, "selective", "bf16", "h100", "fake"),
    ("llama-3.2-1b", 8, 2048, "full", "bf16", "h100", "fake"),
    ("llama-3.2-1b", 8, 2048, "selective", "bf16", "h100", "fake"),
    ("llama-3-8b", 4, 2048, "full", "bf16", "h100", None),
    ("tiny-llama/32k", 4, 512, "full", "fp32", "cpu", "run"),
)


def model(name: str):
    if name == "tiny-llama/32k":  # Llama's block at tiny width with a 32,768-token vocabulary
        return PRESETS["tiny-llama"].replace(vocab_size=32768, max_seq_len=512)
    return PRESETS[name].replace(attention="fused")


def measure(row: tuple) -> dict:
    name, batch, seq, policy_name, precision_name, target_name, torch_step = row
    cfg, prec, opt = model(name), PRECISIONS[precision_name], OptimizerConfig()
    target = LOCAL if target_name == "cpu" else get_target(target_name)
    out = {
        "preset": name,
        "batch": batch,
        "seq_len": seq,
        "policy": policy_name,
        "precision": precision_name,
        "target": target_name,
        "vocab_size": cfg.vocab_size,
        "logits_bytes": batch * seq * cfg.vocab_size * 4,
    }
    start = time.perf_counter()
    for chunks in (0, CHUNKS):
        policy = POLICIES[policy_name].replace(loss=LossPolicy(chunks))
        key = "whole" if chunks == 0 else "chunked"
        spec = StepSpec(
            model=cfg, policy=policy, precision=prec, batch=batch, seq_len=seq, target=target
        )
        plan = plan_step(spec)
        rec = jax_record(spec, abstract=True)
        out[key] = {
            "planned_peak_bytes": plan["planned_peak_bytes"],
            "compiler": plan["compiler"],
            "jax_saved_bytes": rec["saved_activation_bytes_device"],
            "jax_flops": rec["flops"],
        }
        if torch_step is not None:
            t = torch_record(cfg, policy, prec, opt, batch, seq, fake=torch_step == "fake")
            out[key]["torch_saved_bytes"] = t["saved_activation_bytes_device"]
            out[key]["torch_flops"] = t["flops"]
            out[key]["torch_runtime_peak_bytes"] = t.get("peak_bytes")
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MIB:,.1f}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# The LM head and loss whole and in {CHUNKS} chunks",
        "",
        f"Measured {meta['date']} on {meta['host']}; jax {meta['jax']}, torch {meta['torch']}. "
        "`python benchmarks/loss_chunks.py`. bf16 rows: fp32 master weights; fused attention; "
        "AdamW; one microbatch.",
        "",
        "Planned peak: the whole step's compiled plan (arguments + outputs - aliased + "
        "temporaries) for the target, compiled on this machine (h100: deviceless XLA:CUDA; cpu: "
        "XLA:CPU). Saved: what the forward keeps for the backward (JAX: residual accounting; "
        "torch_ref: live-tensor accounting, its step on fake tensors for GPU sizes). GFLOP: "
        "matmul FLOPs executed (JAX: the gradient's jaxpr; torch: FlopCounterMode). Runtime "
        "peak: torch_ref's step run here (MemTracker, CPU).",
        "",
        "| preset | batch x seq | policy | target | logits MiB | planned peak MiB whole | "
        f"in {CHUNKS} chunks | change | saved MiB JAX whole / chunked | saved MiB torch whole / "
        "chunked | GFLOP JAX whole / chunked | GFLOP torch whole / chunked | torch runtime peak "
        "MiB whole / chunked |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w, c = r["whole"], r["chunked"]
        torch_saved = (
            f"{_mib(w['torch_saved_bytes'])} / {_mib(c['torch_saved_bytes'])}"
            if "torch_saved_bytes" in w
            else "-"
        )
        torch_flops = (
            f"{w['torch_flops'] / 1e9:,.1f} / {c['torch_flops'] / 1e9:,.1f}"
            if "torch_flops" in w
            else "-"
        )
        runtime = (
            f"{_mib(w['torch_runtime_peak_bytes'])} / {_mib(c['torch_runtime_peak_bytes'])}"
            if w.get("torch_runtime_peak_bytes")
            else "-"
        )
        lines.append(
            f"| {r['preset']} | {r['batch']} x {r['seq_len']} | {r['policy']}, "
            f"{r['precision']} | {r['target']} | {_mib(r['logits_bytes'])} | "
            f"{_mib(w['planned_peak_bytes'])} | {_mib(c['planned_peak_bytes'])} | "
            f"{c['planned_peak_bytes'] / w['planned_peak_bytes'] - 1:+.1%} | "
            f"{_mib(w['jax_saved_bytes'])} / {_mib(c['jax_saved_bytes'])} | {torch_saved} | "
            f"{w['jax_flops'] / 1e9:,.1f} / {c['jax_flops'] / 1e9:,.1f} | {torch_flops} | "
            f"{runtime} |"
        )
    lines += [
        "",
        "The chunks lower a plan where the loss holds its peak (the logits and their gradient at "
        "the start of the backward); where the peak is elsewhere (a block's backward, or the "
        "optimizer state: llama-3-8b with its AdamW state on the device does not fit one H100 "
        "either way) they change it by the logits' share only. The FLOPs are the whole loss's "
        "in both frameworks (nothing is recomputed).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/loss_chunks")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "loss_chunks")
    if args.render:
        with open(stem + ".json") as f:
            data = json.load(f)
        write_atomic(stem + ".md", markdown(data["rows"], data["meta"]))
        return
    torch.set_num_threads(2)
    rows = []
    for row in ROWS:
        rows.append(measure(row))
        r = rows[-1]
        print(
            f"{r['preset']} {r['policy']}: planned peak {_mib(r['whole']['planned_peak_bytes'])}"
            f" -> {_mib(r['chunked']['planned_peak_bytes'])} MiB ({r['seconds']} s)",
            flush=True,
        )
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU)",
        "jax": jax.__version__,
        "torch": torch.__version__,
    }
    write_json_atomic(stem + ".json", {"rows": rows, "meta": meta})
    write_atomic(stem + ".md", markdown(rows, meta))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()

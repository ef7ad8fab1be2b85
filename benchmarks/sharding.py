# ruff: noqa: E402  (JAX is configured before it starts, on purpose)
"""Per-device memory of the sharded train step: data-parallel strategies × device
count, from compiled plans, and which strategy × policy lets a model fit 8 × 80 GB H100s.

- ``cpu``: ``small`` (fp32, AdamW), 8 rows of 128 tokens per device, N = 1, 2, 4, 8 CPU
  devices in this process, every strategy × {full, selective}: the per-device record
  (parameters, gradients and optimizer state from shard shapes; saved activations of one
  device's rows, residual accounting; the XLA:CPU plan of one device).
- ``h100``: the same for gpt2-1.5b (bf16, 8 rows of 1024 tokens per device) compiled for one
  host of N H100s without any GPU.
- ``fit``: gpt2-1.5b and gpt3-6.7b on 8 H100s (bf16, AdamW, 1 row of 1024 tokens per device),
  every strategy × {none, full, selective}: the planned peak per device against 80 GB.
- ``torch``: the ``cpu`` part's shapes in torch_ref, run (not planned): N torchrun processes
  (gloo) of ``python -m torch_ref.mesh_memory``, DDP for ``dp`` and FSDP2 for ``zero1`` (its
  ZeRO-2-like mode) and ``fsdp``; each rank's shards counted and its runtime peak from
  PyTorch's trackers (FSDPMemTracker, MemTracker for DDP) on a steady second step.

Writes ``benchmarks/results/sharding/{sharding.json,sharding.md,per_device_vs_n.png}``.

    python benchmarks/sharding.py [--parts cpu,h100,fit,torch]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()
import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxmem.config import get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.targets import LOCAL, get_target
from jaxmem.parallel import STRATEGIES, ParallelConfig
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

NS = (1, 2, 4, 8)
MIB, GB = 1 << 20, 1e9
PARTS = {
    "cpu": {"preset": "small", "precision": "fp32", "rows": 8, "seq": 128, "target": "cpu"},
    "h100": {"preset": "gpt2-1.5b", "precision": "bf16", "rows": 8, "seq": 1024, "target": "h100"},
}
FIT_PRESETS = ("gpt2-1.5b", "gpt3-6.7b")
FIT_POLICIES = ("none", "full", "selective")


def _row(rec: dict, **keys) -> dict:
    return keys | {
        "params_bytes": rec["params_bytes"],
        "grads_bytes": rec["grads_bytes"],
        "opt_state_bytes": rec["opt_state_bytes"],
        "saved_bytes": rec["saved_activation_bytes_device"] + rec["saved_activation_bytes_host"],
        "temp_bytes": rec["compiled_temp_bytes"],
        "planned_peak_bytes": rec["planned_peak_bytes"],
        "flops": rec["flops"],
        "compiler": rec["compiler"],
        "fits": rec["fits"],
    }


def scaling(part: str) -> list[dict]:
    spec = PARTS[part]
    cfg = get_preset(spec["preset"])
    target = LOCAL if spec["target"] == "cpu" else get_target(spec["target"])
    rows = []
    for policy in ("full", "selective"):
        for strategy in STRATEGIES:
            for n in NS:
                start = time.perf_counter()
                rec = jax_record(
                    StepSpec(
                        model=cfg,
                        policy=POLICIES[policy],
                        precision=PRECISIONS[spec["precision"]],
                        batch=spec["rows"] * n,
                        seq_len=spec["seq"],
                        target=target,
                        parallel=ParallelConfig(strategy=strategy, devices=n),
                    ),
                    abstract=True,
                )
                rows.append(_row(rec, part=part, policy=policy, strategy=strategy, devices=n))
                print(
                    f"{part} {policy} {strategy}={n}: peak "
                    f"{rec['planned_peak_bytes'] / MIB:,.1f} MiB per device "
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    return rows


def torch_scaling() -> list[dict]:
    """The ``cpu`` part's shapes, run by torch_ref over N torchrun processes (one per device)."""
    spec = PARTS["cpu"]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    rows = []
    for policy in ("full", "selective"):
        for strategy in STRATEGIES:
            for n in NS:
                start = time.perf_counter()
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "ranks.json")
                    args = ["--preset", spec["preset"], "--policy", policy, "--precision"]
                    args += [spec["precision"], "--batch-size", str(spec["rows"] * n)]
                    args += ["--seq-len", str(spec["seq"]), "--json", out]
                    if n == 1:
                        cmd = [sys.executable, "-m", "torch_ref.mesh_memory", *args]
                    else:
                        cmd = [torchrun, "--standalone", f"--nproc_per_node={n}"]
                        cmd += ["-m", "torch_ref.mesh_memory", *args, "--mesh", f"{strategy}={n}"]
                    env = {**os.environ, "OMP_NUM_THREADS": "1"}
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    # Rank 0 writes the records after gathering every rank's, so a run that
                    # wrote them measured everything. The interpreter's teardown can abort a
                    # rank after that (gloo, SIGABRT: 3 of 8 runs here ended so), so the workers
                    # end without it (torch_ref.distributed.end_worker). A run that exits
                    # non-zero after its records all the same is kept and marked; one that wrote
                    # nothing fails the benchmark.
                    if proc.returncode and not os.path.exists(out):
                        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
                    if proc.returncode:
                        print(f"  (exit {proc.returncode} after the records were written)")
                    with open(out) as f:
                        ranks = json.load(f)
                rank0 = ranks[0]
                rows.append(
                    {
                        "part": "torch",
                        "policy": policy,
                        "strategy": strategy,
                        "devices": n,
                        "what_ran": rank0["strategy"],
                        "params_bytes": rank0["params_bytes"],
                        "grads_bytes": rank0["grads_bytes"],
                        "opt_state_bytes": rank0["opt_state_bytes"],
                        "peak_bytes": max(r["peak_bytes"] for r in ranks),
                        "state_source": rank0["state_source"],
                        "peak_source": rank0["peak_source"] + "; the largest rank's",
                        "exit_after_records": proc.returncode,
                    }
                )
                print(
                    f"torch {policy} {strategy}={n}: runtime peak "
                    f"{rows[-1]['peak_bytes'] / MIB:,.1f} MiB per rank "
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    return rows


def fit() -> list[dict]:
    target = get_target("h100")
    rows = []
    for preset in FIT_PRESETS:
        cfg = get_preset(preset)
        for policy in FIT_POLICIES:
            for strategy in STRATEGIES:
                start = time.perf_counter()
                rec = jax_record(
                    StepSpec(
                        model=cfg,
                        policy=POLICIES[policy],
                        precision=PRECISIONS["bf16"],
                        batch=8,
                        seq_len=1024,
                        target=target,
                        parallel=ParallelConfig(strategy=strategy, devices=8),
                    )
                )
                rows.append(_row(rec, part="fit", preset=preset, policy=policy, strategy=strategy))
                print(
                    f"fit {preset} {policy} {strategy}=8: {rec['planned_peak_bytes'] / GB:.2f} GB "
                    f"per device, fits {rec['fits']} ({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    return rows


def _one_device(rows: list[dict], row: dict) -> dict:
    """The N = 1 row of ``row``'s policy and strategy."""
    return next(
        b
        for b in rows
        if (b["policy"], b["strategy"], b["devices"]) == (row["policy"], row["strategy"], 1)
    )


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# Sharded train step, per device ({meta['date']}, {meta['host']}, jax {meta['jax']})",
        "",
        "Every figure is one device's, planned from shapes (nothing runs): parameters, gradients "
        "and optimizer state from each leaf's shard shape; saved activations by residual "
        "accounting of one device's rows of the batch; temporaries and planned peak (arguments + "
        "outputs − donated + temporaries) from the compiled plan of the sharded step. The batch "
        "grows with N (a fixed number of rows per device). `python benchmarks/sharding.py`.",
    ]
    for part in ("cpu", "h100"):
        rows = [r for r in result["rows"] if r["part"] == part]
        if not rows:
            continue
        spec = PARTS[part]
        unit, scale = ("MiB", MIB) if part == "cpu" else ("GB", GB)
        lines += [
            "",
            f"## {spec['preset']}, {spec['precision']}, AdamW, {spec['rows']} × {spec['seq']} "
            f"tokens per device; plan: {rows[0]['compiler'].split(', per device')[0]}",
            "",
            f"| policy | strategy | N | params {unit} | grads {unit} | optimizer {unit} "
            f"| saved {unit} | temp {unit} | planned peak {unit} | peak / N=1 |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            base = _one_device(rows, r)
            lines.append(
                f"| {r['policy']} | {r['strategy']} | {r['devices']} "
                f"| {r['params_bytes'] / scale:,.2f} | {r['grads_bytes'] / scale:,.2f} "
                f"| {r['opt_state_bytes'] / scale:,.2f} | {r['saved_bytes'] / scale:,.2f} "
                f"| {r['temp_bytes'] / scale:,.2f} | {r['planned_peak_bytes'] / scale:,.2f} "
                f"| {r['planned_peak_bytes'] / base['planned_peak_bytes']:.3f} |"
            )
    rows = [r for r in result["rows"] if r["part"] == "torch"]
    if rows:
        spec = PARTS["cpu"]
        jax_rows = {
            (r["policy"], r["strategy"], r["devices"]): r
            for r in result["rows"]
            if r["part"] == "cpu"
        }
        lines += [
            "",
            f"## torch_ref beside jaxmem: {spec['preset']}, {spec['precision']}, AdamW, "
            f"{spec['rows']} × {spec['seq']} tokens per device, N CPU processes (torchrun, gloo)",
            "",
            "torch_ref's figures are *run*: each rank's shards counted after a steady second step, "
            "its peak from PyTorch's trackers (FSDPMemTracker for FSDP2, MemTracker for DDP; the "
            "largest rank's). jaxmem's peak is the XLA:CPU plan of the table above. Two kinds of "
            "figure, two columns. torch `dp` = DDP; torch `zero1` = FSDP2 "
            "`reshard_after_forward=False` (ZeRO-2-like: its gradients and, between steps, its "
            "parameters are sharded too); torch `fsdp` = FSDP2 `fully_shard`.",
            "",
            "| policy | strategy | N | torch params MiB | torch grads MiB | torch optimizer MiB "
            "| torch runtime peak MiB | torch peak / N=1 | jaxmem planned peak MiB |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            base = _one_device(rows, r)
            j = jax_rows.get((r["policy"], r["strategy"], r["devices"]))
            lines.append(
                f"| {r['policy']} | {r['strategy']} | {r['devices']} "
                f"| {r['params_bytes'] / MIB:,.2f} | {r['grads_bytes'] / MIB:,.2f} "
                f"| {r['opt_state_bytes'] / MIB:,.2f} | {r['peak_bytes'] / MIB:,.2f} "
                f"| {r['peak_bytes'] / base['peak_bytes']:.3f} "
                f"| {'-' if j is None else format(j['planned_peak_bytes'] / MIB, ',.2f')} |"
            )
    rows = [r for r in result["rows"] if r["part"] == "fit"]
    if rows:
        lines += [
            "",
            "## What fits 8 × 80 GB H100 (bf16, AdamW, 1 × 1024 tokens per device; plans for "
            "one host of 8 H100s, no GPU)",
            "",
            "| model | policy | strategy | params GB | optimizer GB | temp GB | planned peak GB "
            "| fits 80 GB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['preset']} | {r['policy']} | {r['strategy']} "
                f"| {r['params_bytes'] / GB:.2f} | {r['opt_state_bytes'] / GB:.2f} "
                f"| {r['temp_bytes'] / GB:.2f} | {r['planned_peak_bytes'] / GB:.2f} "
                f"| {'yes' if r['fits'] else 'no'} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("cpu", "torch", "h100") if any(r["part"] == p for r in result["rows"])]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        unit, scale = ("GB", GB) if part == "h100" else ("MiB", MIB)
        for strategy, color in zip(STRATEGIES, ("C0", "C1", "C2"), strict=True):
            for policy, style in (("full", "-"), ("selective", "--")):
                pts = sorted(
                    (r["devices"], r.get("planned_peak_bytes", r.get("peak_bytes")) / scale)
                    for r in result["rows"]
                    if r["part"] == part and r["strategy"] == strategy and r["policy"] == policy
                )
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, color=color, marker="o", label=f"{strategy}, {policy}")
        spec = PARTS["cpu" if part == "torch" else part]
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices N")
        if part == "torch":  # another kind of figure: its own panel
            ax.set_ylabel(f"torch_ref runtime peak per rank, {unit}")
            ax.set_title(f"{spec['preset']} {spec['precision']} (torch_ref run, CPU trackers)")
        else:
            ax.set_ylabel(f"jaxmem planned peak per device, {unit}")
            ax.set_title(f"{spec['preset']} {spec['precision']} ({spec['target']} plan)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Per-device memory of the sharded train step vs N (fixed rows per device)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="cpu,h100,fit,torch")
    parser.add_argument("--out", default="benchmarks/results/sharding")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sharding.json")
    old = []
    if os.path.exists(path):  # parts not measured now keep their last rows
        with open(path) as f:
            old = [r for r in json.load(f)["rows"] if r["part"] not in parts]
    started = time.perf_counter()
    rows = list(old)
    for part in parts:
        rows += fit() if part == "fit" else torch_scaling() if part == "torch" else scaling(part)
    result = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU)",
            "jax": jax.__version__,
            "parts_measured": parts,
            "seconds": round(time.perf_counter() - started),
        },
        "rows": rows,
    }
    write_json_atomic(path, result)
    write_atomic(os.path.join(args.out, "sharding.md"), markdown(result))
    plot(result, os.path.join(args.out, "per_device_vs_n.png"))
    print(markdown(result))


if __name__ == "__main__":
    main()

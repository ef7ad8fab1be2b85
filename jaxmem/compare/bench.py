"""The cross-framework benchmark behind ``jaxmem bench`` (and ``benchmarks/sweep.py``).

Axes, each swept on its own around one preset (``SweepPlan``):
- policy (all presets) × precision (fp32, bf16);
- depth for none / selective / full / nested, fp32;
- sequence length for none / selective / full, fp32;
- gradient accumulation: what one microbatch of the batch keeps for its backward;
- step time per policy, jaxmem vs torch_ref: one fwd + bwd + AdamW step on the same weights and
  batch, compile and warm-up outside the timer, JAX ended with ``block_until_ready``, runs
  interleaved (jax, torch, jax, ...) so machine noise hits both alike; medians and their ratio.

Per point: saved activation bytes (JAX residual accounting / torch live-tensor accounting, device
+ host), matmul FLOPs executed (JAX from the gradient's jaxpr / torch ``FlopCounterMode``) and
JAX's compiled plan temporaries for jit(grad) (on CPU: XLA:CPU's plan, a proxy for a GPU's and
blind to host offload). Writes ``sweep.json`` (hardware, versions, date, full config with every
result), ``sweep.md`` and four PNGs: bytes per policy (JAX vs torch bars), memory vs layers,
FLOP overhead vs memory (the Pareto view) and step time per policy.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from jaxmem.compare.parity import torch_model_from
from jaxmem.config import ModelConfig, OptimizerConfig, get_preset
from jaxmem.data import lm_batch
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.memory.residuals import compiled_plan, saved_residuals, summarize_residuals
from jaxmem.memory.targets import LOCAL, Target, get_target
from jaxmem.model import make_model
from jaxmem.policy import POLICIES, BlockPolicy, MemoryPolicy
from jaxmem.precision import PRECISIONS
from jaxmem.step.build import build_step
from jaxmem.step.spec import StepSpec
from torch_ref.forward_memory import measure_lm_step
from torch_ref.remat import apply_loss_policy, apply_memory_policy, resolve_translation
from torch_ref.train import TORCH_DTYPES, lm_loss_sum
from torch_ref.train import make_optimizer as make_torch_optimizer

MIB = 1 << 20
# (column prefix, bar offset, legend) of the byte plots
SERIES = (
    ("jax", -0.27, "jaxmem"),
    ("torch", 0.0, "torch_ref stock"),
    ("torch_lean", 0.27, "torch_ref lean (ext.)"),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepPlan:
    """What ``run_sweep`` measures. ``DEFAULT`` runs in a few minutes on 2 CPU cores;
    ``QUICK`` (tiny preset) in well under a minute, for tests and a first look."""

    preset: str = "small"
    model: ModelConfig | None = None  # the preset's model with overrides (None: the preset's)
    batch: int = 8
    seq_len: int = 128
    depths: tuple[int, ...] = (2, 4, 8, 12)
    seq_lens: tuple[int, ...] = (64, 128, 256)
    accum_steps: tuple[int, ...] = (1, 2, 4)
    timed_policies: tuple[str, ...] = ("none", "selective", "full", "offload", "nested")
    repeats: int = 10
    torch_nested_max_depth: int = 8  # torch's nested checkpoint is slow to trace beyond this
    # the compiled-plan column (depth axis): "cpu" = the local backend, or a GPU target
    # (jaxmem.memory.targets) compiled without a GPU
    target: str = "cpu"


DEFAULT = SweepPlan()
QUICK = SweepPlan(
    preset="tiny",
    batch=4,
    seq_len=32,
    depths=(1, 2, 4),
    seq_lens=(16, 32),
    accum_steps=(1, 2),
    timed_policies=("none", "full"),
    repeats=3,
)


# The frameworks' own policies, measured beside the presets as peers (a preset that a built-in
# beats on both bytes and FLOPs should not exist). One MemoryPolicy, translated by each
# framework to its built-in: JAX's ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``,
# PyTorch's stock selective checkpointing with ``MUST_SAVE`` for every ``mm``/``addmm``. (JAX's
# ``everything_saveable`` / ``nothing_saveable`` are ``none`` / ``full``.)
PEERS: dict[str, MemoryPolicy] = {
    "built-in dots": MemoryPolicy.of(BlockPolicy(save_dots=True), name="built-in dots"),
}
PEER_NOTE = (
    "built-in dots = JAX `dots_with_no_batch_dims_saveable` / PyTorch selective checkpointing "
    "saving every `mm`/`addmm` (the frameworks' own policies, peers of the presets)"
)


def dominated_by(row: dict[str, Any], rows: list[dict[str, Any]], prefix: str) -> list[str]:
    """The policies of ``rows`` (same precision) that keep no more bytes (device + host) and
    execute no more FLOPs than ``row`` in framework ``prefix``, one of them strictly less: the
    ones that make ``row`` a worse choice on both axes."""

    def cost(r: dict[str, Any]) -> tuple[int, int] | None:
        device = r.get(f"{prefix}_device_bytes")
        if device is None:
            return None
        return device + r[f"{prefix}_host_bytes"], r[f"{prefix}_flops"]

    mine = cost(row)
    out = []
    for other in rows:
        theirs = cost(other)
        if other is row or theirs is None or mine is None:
            continue
        if other["precision"] != row["precision"]:
            continue
        if theirs[0] <= mine[0] and theirs[1] <= mine[1] and theirs != mine:
            out.append(other["policy"])
    return out


def has_lean(policy: MemoryPolicy) -> bool:
    """Whether torch_ref's lean extension runs something other than the stock translation (and
    stock exists): named policies without offload, and nested."""
    return lean_left_out(policy) is None


def lean_left_out(policy: MemoryPolicy) -> str | None:
    """Why ``policy`` has no row of its own for torch_ref's lean extension (``None`` when it
    has one), in a few words for a report."""
    if resolve_translation(policy, "stock") == "lean":
        return "stock PyTorch has no offload by name, so the torch row runs the extension"
    if resolve_translation(policy, "lean") == "stock":
        return "no remat or whole-block remat, which the extension runs as stock PyTorch does"
    return None


def torch_point(
    reference: Any,
    policy: MemoryPolicy,
    precision_name: str,
    inputs: np.ndarray,
    targets: np.ndarray,
    translation: str,
) -> dict[str, Any]:
    """Saved bytes (live-tensor accounting, device + host) and FLOPs executed of one torch_ref
    step of ``reference``'s weights under ``policy`` in ``translation``."""
    prec = PRECISIONS[precision_name]
    tm = torch_model_from(reference).to(TORCH_DTYPES[prec.param_dtype])
    runner = apply_memory_policy(tm.blocks, policy, translation)
    apply_loss_policy(tm, policy)
    x, y = torch.from_numpy(inputs).long(), torch.from_numpy(targets).long()
    live, _, flops = measure_lm_step(tm, runner, x, y, prec)
    return {
        "device_bytes": live.device_bytes,
        "host_bytes": live.host_bytes,
        "parameter_copy_bytes": live.parameter_copy_bytes,
        "flops": flops,
        "translation": runner.description,
        "by_name": live.by_name,
    }


def memory_point(
    cfg: ModelConfig,
    policy_name: str,
    precision_name: str,
    batch: int,
    seq_len: int,
    *,
    torch_too: bool = True,
    compile_plan: bool = True,
    policy: MemoryPolicy | None = None,
    target: Target = LOCAL,
    lean: bool = True,
) -> dict[str, Any]:
    """Saved bytes and FLOPs of one training step in both frameworks (same weights and batch):
    JAX, stock PyTorch (``torch_*``; torch_ref's extension where stock has no API, as
    ``torch_translation`` says) and, where it differs from stock, torch_ref's lean extension
    (``torch_lean_*``, else None)."""
    policy = policy or POLICIES[policy_name]
    prec = PRECISIONS[precision_name]
    reference = make_model(cfg)  # fp32 weights shared by both frameworks
    model = make_model(cfg, prec)
    nnx.update(model, nnx.state(reference, nnx.Param))
    spec = StepSpec(model=cfg, policy=policy, precision=prec, batch=batch, seq_len=seq_len)
    built, params = build_step(spec, model)
    inputs, targets = lm_batch(cfg, batch, seq_len)
    data = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    f = lambda p, b: built.plain_loss(p, b)[0]  # noqa: E731
    res = summarize_residuals(saved_residuals(f, params, data))
    row: dict[str, Any] = {
        "policy": policy_name,
        "precision": precision_name,
        "n_layers": cfg.n_layers,
        "batch": batch,
        "seq_len": seq_len,
        "jax_device_bytes": res.activation_bytes_device,
        "jax_host_bytes": res.activation_bytes_host,
        # slices and compute-dtype casts of parameters: new memory, not activations
        "jax_parameter_copy_bytes": res.parameter_copy_bytes,
        "jax_flops": grad_matmul_flops(f, params, data),
        "jax_compiled_temp_bytes": None,
        "jax_compiled_host_temp_bytes": None,
    }
    if compile_plan:
        grad = jax.jit(jax.grad(f))
        if target.is_gpu:
            from jaxmem.memory.gpu_plan import compile_for

            plan = compiled_plan(compile_for(grad, (params, data), target))
        else:
            plan = compiled_plan(grad.lower(params, data).compile())
        row["jax_compiled_temp_bytes"] = plan["temp_bytes"]
        row["jax_compiled_host_temp_bytes"] = plan["host_temp_bytes"]
    if torch_too:
        stock = torch_point(reference, policy, precision_name, inputs, targets, "stock")
        row.update(
            torch_device_bytes=stock["device_bytes"],
            torch_host_bytes=stock["host_bytes"],
            torch_parameter_copy_bytes=stock["parameter_copy_bytes"],
            torch_flops=stock["flops"],
            torch_translation=stock["translation"],
            torch_is_stock=resolve_translation(policy, "stock") == "stock",
            torch_lean_device_bytes=None,
            torch_lean_host_bytes=None,
            torch_lean_flops=None,
        )
        if lean and has_lean(policy):
            extension = torch_point(reference, policy, precision_name, inputs, targets, "lean")
            row.update(
                torch_lean_device_bytes=extension["device_bytes"],
                torch_lean_host_bytes=extension["host_bytes"],
                torch_lean_flops=extension["flops"],
            )
    return row


def step_fns(
    cfg: ModelConfig,
    policy_name: str,
    batch: int,
    seq_len: int,
    precision_name: str = "fp32",
    policy: MemoryPolicy | None = None,
) -> tuple[dict[str, Callable[[], None]], dict[str, Any]]:
    """One fwd + bwd + AdamW step per framework under ``policy`` and ``precision`` (fp32, bf16
    or pure-bf16; PyTorch: the stock translation, or torch_ref's extension where stock has none;
    mixed precision under ``torch.autocast``), compiled and ready: ``({"jax": f, "torch": g},
    what ran)``. ``policy``: a policy that is not a preset, reported as ``policy_name``."""
    policy, opt_cfg = policy or POLICIES[policy_name], OptimizerConfig()
    prec = PRECISIONS[precision_name]
    if prec.loss_scale != "none":
        raise ValueError(f"step_fns does not time {precision_name} (loss scaling)")
    reference = make_model(cfg)
    model = make_model(cfg, prec)
    nnx.update(model, nnx.state(reference, nnx.Param))
    torch_model = torch_model_from(reference).to(TORCH_DTYPES[prec.param_dtype])
    runner = apply_memory_policy(torch_model.blocks, policy)
    apply_loss_policy(torch_model, policy)
    inputs, targets = lm_batch(cfg, batch, seq_len)
    spec = StepSpec(
        model=cfg, policy=policy, precision=prec, optimizer=opt_cfg, batch=batch, seq_len=seq_len
    )
    built, params = build_step(spec, model)
    params, opt_state = built.state(params)
    jax_batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    step = built.step.lower(params, opt_state, None, jax_batch).compile()
    torch_opt = make_torch_optimizer(torch_model, opt_cfg)
    x_t, y_t = torch.from_numpy(inputs).long(), torch.from_numpy(targets).long()

    def torch_step() -> None:
        torch_opt.zero_grad(set_to_none=True)
        loss_sum, n = lm_loss_sum(torch_model, {"inputs": x_t, "targets": y_t}, prec)
        (loss_sum / n).backward()
        torch_opt.step()

    state = [params, opt_state]

    def jax_step() -> None:
        state[0], state[1], _, metrics = step(state[0], state[1], None, jax_batch)
        jax.block_until_ready(metrics["loss"])

    return {"jax": jax_step, "torch": torch_step}, {
        "policy": policy_name,
        "precision": precision_name,
        "torch_translation": runner.description,
        "torch_is_stock": runner.translation == "stock",
        "batch": batch,
        "seq_len": seq_len,
    }


def step_times(
    cfg: ModelConfig,
    policy_name: str,
    batch: int,
    seq_len: int,
    repeats: int,
    precision_name: str = "fp32",
    policy: MemoryPolicy | None = None,
) -> dict[str, Any]:
    """Median wall time of one step per framework (``step_fns``), the two interleaved."""
    fns, what = step_fns(cfg, policy_name, batch, seq_len, precision_name, policy)
    return interleaved_medians(fns, repeats) | what


def dot_times(m: int, k: int, n: int, repeats: int) -> dict[str, Any]:
    """Median wall time of one ``[m, k] × [k, n]`` matmul with fp32 results, fp32 and bf16
    inputs, in each framework (interleaved): what a backend does with bf16 dots, apart from the
    model (XLA:CPU has no bf16 GEMM on a CPU without bf16 instructions)."""
    steps: dict[str, Callable[[], None]] = {}
    dtypes = (("fp32", jnp.float32, torch.float32), ("bf16", jnp.bfloat16, torch.bfloat16))
    for name, jdt, tdt in dtypes:
        a, b = jnp.ones((m, k), jdt), jnp.ones((k, n), jdt)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        f(a, b).block_until_ready()
        ta, tb = torch.ones(m, k, dtype=tdt), torch.ones(k, n, dtype=tdt)
        steps[f"jax {name}"] = lambda f=f, a=a, b=b: f(a, b).block_until_ready()
        steps[f"torch {name}"] = lambda ta=ta, tb=tb: torch.mm(ta, tb)
    out = interleaved_medians(steps, repeats)
    return out | {"shape": (m, k, n), "flops": 2 * m * k * n}


def interleaved_medians(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, Any]:
    """Three warm-up calls each, then ``repeats`` interleaved timed calls; medians and ratio."""
    for _ in range(3):
        for fn in steps.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for label, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"repeats": repeats, "median_s": med, "all_s": times}
    if "jax" in med and "torch" in med:
        out["jax_over_torch_time"] = med["jax"] / med["torch"]
    return out


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def set_threads(n: int | None = None) -> dict[str, Any]:
    """Give both frameworks ``n`` threads (default: every core this process may use), set
    explicitly: PyTorch's intra-op pool (``torch.set_num_threads``) and JAX's, which XLA:CPU
    sizes from the process's CPU affinity when its backend starts (so this must run first).
    Returns what was set, for the results' metadata."""
    cores = sorted(os.sched_getaffinity(0))
    n = len(cores) if n is None else n
    if not 1 <= n <= len(cores):
        raise ValueError(f"threads={n} must be between 1 and the {len(cores)} usable cores")
    if n < len(cores):
        os.sched_setaffinity(0, cores[:n])
    torch.set_num_threads(n)
    return {"threads": n, "cpu_affinity": cores[:n], "torch_threads": torch.get_num_threads()}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def busy_warning(before: list[float], after: list[float], threads: int) -> str | None:
    """A warning when other processes kept the machine busy around a timed run: the 1-minute
    load average beyond what the benchmark's own threads explain (timings are then noise; the
    ratios measured interleaved suffer least)."""
    cores = usable_cores()
    if before[0] > 0.5 or after[0] > threads + 0.5 or max(before[0], after[0]) > cores:
        return (
            f"the machine was busy (1-min load average {before[0]} before, {after[0]} after, "
            f"{cores} cores, {threads} benchmark threads): timings are unreliable"
        )
    return None


def machine_meta() -> dict[str, Any]:
    """Hardware, versions and date, recorded with every benchmark result."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": f"{jax.devices()[0].platform.upper()} ({jax.devices()[0].device_kind})",
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
    }


def run_sweep(
    plan: SweepPlan, out_dir: str, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Measure every axis of ``plan`` and write sweep.json, sweep.md and the PNGs (thread counts
    as ``set_threads`` left them; the load average is recorded before and after)."""
    load_before = load_average()
    target = get_target(plan.target)
    base = plan.model or get_preset(plan.preset)
    b, s = plan.batch, plan.seq_len
    rows: dict[str, list[dict[str, Any]]] = {
        "policy_precision": [],
        "depth": [],
        "seq_len": [],
        "accum": [],
        "step_time": [],
    }
    for prec in ("fp32", "bf16"):
        for name in POLICIES:
            progress(f"policy x precision: {name} {prec}")
            rows["policy_precision"].append(
                memory_point(base, name, prec, b, s, compile_plan=False)
            )
        for name, peer in PEERS.items():
            progress(f"policy x precision: {name} {prec}")
            row = memory_point(base, name, prec, b, s, compile_plan=False, policy=peer)
            rows["policy_precision"].append(row | {"peer": True})
    for depth in plan.depths:
        for name in ("none", "selective", "full", "nested"):
            progress(f"depth: {name} {depth} layers")
            torch_too = name != "nested" or depth <= plan.torch_nested_max_depth
            cfg = base.replace(n_layers=depth)
            rows["depth"].append(
                memory_point(cfg, name, "fp32", b, s, torch_too=torch_too, target=target)
            )
    for seq in plan.seq_lens:
        for name in ("none", "selective", "full"):
            progress(f"sequence length: {name} {seq}")
            rows["seq_len"].append(memory_point(base, name, "fp32", b, seq, compile_plan=False))
    for k in plan.accum_steps:
        for name in ("none", "full"):
            progress(f"accumulation: {name} {k} microbatches")
            r = memory_point(base, name, "fp32", b // k, s, torch_too=False, compile_plan=False)
            r["accum_steps"] = k
            rows["accum"].append(r)
    for name in plan.timed_policies:
        progress(f"step time: {name}")
        rows["step_time"].append(step_times(base, name, b, s, plan.repeats))
    load_after = load_average()
    threads = torch.get_num_threads()
    meta = machine_meta() | {
        "plan": dataclasses.asdict(plan),
        "base_config": dataclasses.asdict(base),
        "threads": {
            "torch": threads,
            "jax": f"XLA:CPU pool sized by the CPU affinity: {usable_cores()} cores",
        },
        "load_average_before": load_before,
        "load_average_after": load_after,
        "busy_warning": busy_warning(load_before, load_after, threads),
        "compiler": target.compiler(),
        "note": f"{jax.devices()[0].platform.upper()} results: bytes and FLOPs are exact "
        f"accounting; compiled temps are the plan of {target.compiler()}"
        + ("" if target.is_gpu else " (XLA:CPU's is far from a GPU's and erases host offload)")
        + "; step times are wall-clock medians on this machine",
    }
    os.makedirs(out_dir, exist_ok=True)
    result = {"meta": meta, **rows}
    write_json_atomic(os.path.join(out_dir, "sweep.json"), result)
    write_atomic(os.path.join(out_dir, "sweep.md"), markdown(rows, meta))
    plot(rows, meta, out_dir)
    return result


def mib_cell(row: dict[str, Any], prefix: str, host: bool = True) -> str:
    """``device + host`` MiB of one framework's columns, or ``-`` where not measured."""
    device = row.get(f"{prefix}_device_bytes")
    if device is None:
        return "-"
    if not host:
        return f"{device / MIB:.2f}"
    return f"{device / MIB:.2f} + {row[f'{prefix}_host_bytes'] / MIB:.2f}"


def gflop_cell(row: dict[str, Any], prefix: str) -> str:
    flops = row.get(f"{prefix}_flops")
    return "-" if flops is None else f"{flops / 1e9:.3f}"


def markdown(rows: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    plan = meta["plan"]
    lines = [
        f"Sweep around `{plan['preset']}`, batch {plan['batch']} × seq {plan['seq_len']}, "
        f"{meta['device']}, {meta['cpu_count']} cores, {meta['date']} "
        f"(jax {meta['versions']['jax']}, torch {meta['versions']['torch']}). Saved bytes: JAX "
        "residual accounting / torch live-tensor accounting (device + host, MiB). FLOPs: matmul "
        "GFLOP executed. Threads: PyTorch "
        f"{meta['threads']['torch']}, JAX {meta['threads']['jax']}; load average "
        f"{meta['load_average_before']} before, {meta['load_average_after']} after.",
        *(["", f"**Warning: {meta['busy_warning']}.**"] if meta["busy_warning"] else []),
        "",
        "### policy × precision",
        "",
        "torch = stock PyTorch (`checkpoint`, selective checkpointing, `checkpoint_sequential`); "
        "† = no stock API (name-based offload in eager PyTorch): torch_ref's extension. torch "
        "lean = torch_ref's extension (keeps what the backward reads, skips matmuls nothing "
        "reads, two-level nested), shown where it differs from stock. "
        f"{PEER_NOTE}. Dominated by = the rows that keep no more bytes at no more FLOPs "
        "(one strictly less) in that framework (JAX / torch stock).",
        "",
        "| precision | policy | JAX MiB | torch MiB | torch lean MiB | JAX / torch bytes "
        "| JAX GFLOP | torch GFLOP | torch lean GFLOP | dominated by (JAX / torch) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    table = rows["policy_precision"]
    for r in table:
        jb = r["jax_device_bytes"] + r["jax_host_bytes"]
        tb = r["torch_device_bytes"] + r["torch_host_bytes"]
        mark = "" if r["torch_is_stock"] else " †"
        beaten = " / ".join(", ".join(dominated_by(r, table, fw)) or "-" for fw in ("jax", "torch"))
        lines.append(
            f"| {r['precision']} | {r['policy']} | {mib_cell(r, 'jax')} "
            f"| {mib_cell(r, 'torch')}{mark} "
            f"| {mib_cell(r, 'torch_lean')} | {jb / tb:.3f} | {r['jax_flops'] / 1e9:.3f} | "
            f"{r['torch_flops'] / 1e9:.3f}{mark} | {gflop_cell(r, 'torch_lean')} | {beaten} |"
        )
    lines += [
        "",
        "### depth (fp32)",
        "",
        f"JAX compiled temp: jit(grad)'s plan, {meta['compiler']}.",
        "",
        "| layers | policy | JAX MiB | torch MiB | torch lean MiB | JAX compiled temp MiB "
        "(device + host) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows["depth"]:
        lines.append(
            f"| {r['n_layers']} | {r['policy']} | {mib_cell(r, 'jax', host=False)} | "
            f"{mib_cell(r, 'torch', host=False)} | {mib_cell(r, 'torch_lean', host=False)} | "
            f"{r['jax_compiled_temp_bytes'] / MIB:.2f} + "
            f"{r['jax_compiled_host_temp_bytes'] / MIB:.2f} |"
        )
    lines += [
        "",
        "### sequence length (fp32)",
        "",
        "| seq | policy | JAX MiB | torch MiB | torch lean MiB |",
        "|---|---|---|---|---|",
    ]
    for r in rows["seq_len"]:
        lines.append(
            f"| {r['seq_len']} | {r['policy']} | {mib_cell(r, 'jax', host=False)} | "
            f"{mib_cell(r, 'torch', host=False)} | {mib_cell(r, 'torch_lean', host=False)} |"
        )
    lines += [
        "",
        "### accumulation (what one microbatch keeps; the batch split k ways)",
        "",
        "| k | policy | JAX MiB |",
        "|---|---|---|",
    ]
    for r in rows["accum"]:
        lines.append(f"| {r['accum_steps']} | {r['policy']} | {r['jax_device_bytes'] / MIB:.2f} |")
    lines += [
        "",
        f"### step time (fp32 fwd + bwd + AdamW; median of {plan['repeats']} interleaved runs, "
        "compile and warm-up excluded)",
        "",
        "| policy | jaxmem ms | torch_ref ms (stock; † extension) | jax / torch |",
        "|---|---|---|---|",
    ]
    for r in rows["step_time"]:
        lines.append(
            f"| {r['policy']} | {1e3 * r['median_s']['jax']:.2f} | "
            f"{1e3 * r['median_s']['torch']:.2f}{'' if r['torch_is_stock'] else ' †'} | "
            f"{r['jax_over_torch_time']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, list[dict[str, Any]]], meta: dict[str, Any], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = meta["plan"]
    where = f"{plan['preset']}, batch {plan['batch']} x seq {plan['seq_len']}"
    fp32 = [r for r in rows["policy_precision"] if r["precision"] == "fp32"]
    names = [r["policy"] for r in fp32]  # the presets, then the built-in peers
    xs = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(9, 4))
    for fw, shift, label in SERIES:
        # where the extension runs what stock runs, it has no bar of its own
        dev = [(r[f"{fw}_device_bytes"] or 0) / MIB for r in fp32]
        ax.bar(xs + shift, dev, 0.27, label=f"{label} (device)")
        ax.bar(
            xs + shift,
            [(r[f"{fw}_host_bytes"] or 0) / MIB for r in fp32],
            0.27,
            bottom=dev,
            alpha=0.4,
            label=f"{label} (host)",
        )
    ax.set_xticks(xs, names)
    ax.set_ylabel("saved activations (MiB)")
    ax.set_title(f"{where}, fp32: bytes kept for the backward")
    ax.legend(fontsize=7)
    _save(fig, out_dir, "bytes_per_policy.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("none", "selective", "full", "nested"):
        pts = [r for r in rows["depth"] if r["policy"] == name]
        ax.plot(
            [r["n_layers"] for r in pts],
            [r["jax_device_bytes"] / MIB for r in pts],
            "o-",
            label=f"{name} (jaxmem)",
        )
        for fw, style, label in (("torch", "x--", "stock"), ("torch_lean", "+:", "lean")):
            tp = [r for r in pts if r.get(f"{fw}_device_bytes") is not None]
            if tp:
                ax.plot(
                    [r["n_layers"] for r in tp],
                    [r[f"{fw}_device_bytes"] / MIB for r in tp],
                    style,
                    label=f"{name} (torch_ref {label})",
                )
    ax.set_xlabel("layers")
    ax.set_ylabel("saved activations (MiB)")
    ax.set_title(f"memory vs depth ({where}, fp32)")
    ax.legend(fontsize=7)
    _save(fig, out_dir, "memory_vs_layers.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    none = next(r for r in fp32 if r["policy"] == "none")
    for fw, marker, color, label in (
        ("jax", "o", "C0", "jaxmem"),
        ("torch", "x", "C3", "torch_ref stock (offload: extension)"),
        ("torch_lean", "+", "C2", "torch_ref lean (extension)"),
    ):
        pts = [r for r in fp32 if r.get(f"{fw}_flops") is not None]
        base = none["torch_flops"] if fw == "torch_lean" else none[f"{fw}_flops"]
        for i, r in enumerate(pts):
            over = 100 * (r[f"{fw}_flops"] / base - 1)
            x = r[f"{fw}_device_bytes"] / MIB
            peer = r.get("peer", False)  # a built-in: hollow square, name in brackets
            style = (
                {"marker": "s", "facecolors": "none", "edgecolors": color}
                if peer
                else {"marker": marker, "color": color}  # x and + have no face to colour
            )
            ax.scatter(x, over, label=label if i == 0 else None, **style)
            ax.annotate(f"[{r['policy']}]" if peer else r["policy"], (x, over), fontsize=7)
    ax.set_xlabel("device bytes kept (MiB)")
    ax.set_ylabel("extra matmul FLOPs vs none (%)")
    ax.set_title(f"FLOP overhead vs memory ({where}, fp32; [built-in] = peer)", fontsize=9)
    ax.legend()
    _save(fig, out_dir, "pareto.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    timed = rows["step_time"]
    xs = np.arange(len(timed))
    for fw, shift, label in (("jax", -0.2, "jaxmem"), ("torch", 0.2, "torch_ref (stock)")):
        ax.bar(xs + shift, [1e3 * r["median_s"][fw] for r in timed], 0.4, label=label)
    ax.set_xticks(xs, [r["policy"] for r in timed])
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"fwd + bwd + AdamW step ({where}, fp32, {meta['device']})")
    ax.legend()
    _save(fig, out_dir, "step_time.png")


def _save(fig: Any, out_dir: str, name: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=120)
    plt.close(fig)

"""The training loop behind ``jaxmem train``: data, compiled step, progress, memory table."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from jaxmem import data as data_lib
from jaxmem import memory
from jaxmem.config import AccumConfig, ModelConfig, OptimizerConfig
from jaxmem.precision import PRECISIONS, Precision
from jaxmem.remat import POLICIES, MemoryPolicy, layers_fn
from jaxmem.train import (
    NO_ACCUM,
    init_loss_scale,
    lm_loss_fn,
    make_model,
    make_optimizer,
    make_train_step,
    tree_bytes,
)
from jaxmem.weights import save_safetensors


def _to_device(inputs: np.ndarray, targets: np.ndarray) -> dict[str, jax.Array]:
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}


def memory_figures(
    loss_fn: Any,
    params: Any,
    opt_state: Any,
    batch: dict[str, jax.Array],
    plan: dict[str, int],
    accum_steps: int = 1,
) -> list[memory.Figure]:
    """The memory table of one training step. Every figure is measured, with its method.
    Residuals are those of one microbatch (what the backward keeps at a time)."""
    if accum_steps > 1:
        batch = jax.tree_util.tree_map(lambda a: a[: a.shape[0] // accum_steps], batch)
    grads_shape = jax.eval_shape(jax.grad(lambda p: loss_fn(p, batch)[0]), params)
    residuals = memory.summarize_residuals(
        memory.saved_residuals(lambda p: loss_fn(p, batch)[0], params)
    )
    platform_name = jax.devices()[0].platform.upper()
    figures = [
        memory.Figure("parameters", tree_bytes(params), "counted (arrays)"),
        memory.Figure("gradients", tree_bytes(grads_shape), "counted (jax.eval_shape of grad)"),
        memory.Figure("optimizer state", tree_bytes(opt_state), "counted (arrays)"),
        memory.Figure(
            "saved activations, device memory",
            residuals.activation_bytes_device,
            "residual accounting (jaxpr of jax.vjp)",
        ),
        memory.Figure(
            "saved activations, host memory (offloaded)",
            residuals.activation_bytes_host,
            "residual accounting (jaxpr of jax.vjp)",
        ),
        memory.Figure(
            "parameters the backward keeps (not extra)",
            residuals.argument_bytes,
            "residual accounting (jaxpr of jax.vjp)",
        ),
    ]
    plan_source = f"compiled plan (XLA:{platform_name} memory_analysis)"
    figures += [
        memory.Figure("train step: arguments", plan["argument_bytes"], plan_source),
        memory.Figure("train step: outputs", plan["output_bytes"], plan_source),
        memory.Figure("train step: donated (aliased)", plan["alias_bytes"], plan_source),
        memory.Figure("train step: temporaries", plan["temp_bytes"], plan_source),
    ]
    peak = memory.device_peak_bytes()
    if peak is not None:
        figures.append(memory.Figure("device peak", peak, "runtime peak (device.memory_stats)"))
    figures.append(
        memory.Figure(
            "process max RSS (whole process, host)",
            memory.process_max_rss_bytes(),
            "OS (getrusage ru_maxrss)",
        )
    )
    return figures


def run_training(
    cfg: ModelConfig,
    opt_cfg: OptimizerConfig,
    *,
    policy: MemoryPolicy = POLICIES["none"],
    precision: Precision = PRECISIONS["fp32"],
    accum: AccumConfig = NO_ACCUM,
    preset_name: str,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    eval_every: int,
    out_dir: str | None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Train, print progress and the memory table; returns a summary dict."""
    console = console or Console()
    tokens = data_lib.stdlib_corpus()
    train_tokens, val_tokens = data_lib.train_val_split(tokens)
    train_iter = data_lib.random_windows(train_tokens, batch_size, seq_len, seed)

    model = make_model(cfg, precision, seed=seed)
    graphdef, params = nnx.split(model, nnx.Param)
    del model  # params are donated to the step; keep no second reference
    tx = make_optimizer(opt_cfg)
    opt_state = tx.init(params)
    loss_fn = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
    step_fn = make_train_step(loss_fn, tx, precision=precision, accum=accum, opt_cfg=opt_cfg)
    eval_fn = jax.jit(lambda p, b: loss_fn(p, b)[0])
    loss_scale = init_loss_scale(precision)

    first = _to_device(*next(train_iter))
    t0 = time.perf_counter()
    compiled = step_fn.lower(params, opt_state, loss_scale, first).compile()
    compile_s = time.perf_counter() - t0
    plan = memory.compiled_plan(compiled)
    figures = memory_figures(loss_fn, params, opt_state, first, plan, accum.steps)
    console.print(
        f"[bold]jaxmem train[/] preset={preset_name} ({cfg.n_params / 1e6:.2f} M params), "
        f"policy {policy.name}, precision {precision.name}, accum {accum.steps} ({accum.mode}), "
        f"batch {batch_size} x seq {seq_len}, {opt_cfg.name} lr {opt_cfg.lr}, {steps} steps on "
        f"{jax.devices()[0].platform}; corpus: {train_tokens.size:,} train / "
        f"{val_tokens.size:,} val byte tokens (Python stdlib sources); "
        f"compiled in {compile_s:.1f} s"
    )

    def val_loss(params: Any, n_batches: int = 8) -> float:
        it = data_lib.random_windows(val_tokens, batch_size, seq_len, seed=12345)
        losses = [eval_fn(params, _to_device(*next(it))) for _ in range(n_batches)]
        return float(jnp.mean(jnp.stack(losses)))

    records: list[dict[str, Any]] = []
    log_every = max(1, min(10, steps // 20))
    pending: list[tuple[int, jax.Array]] = []
    batch = first
    tokens_per_step = batch_size * seq_len
    t_start = time.perf_counter()
    last_loss = float("nan")
    with Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("train", total=steps, loss=float("nan"), tps=0.0)
        for step in range(1, steps + 1):
            params, opt_state, loss_scale, metrics = compiled(params, opt_state, loss_scale, batch)
            pending.append((step, metrics["loss"]))
            batch = _to_device(*next(train_iter))  # host work overlaps the async step
            if step % log_every == 0 or step == steps:
                # The only host sync: once per refresh, for the losses since the last one.
                for s, loss in pending:
                    records.append({"step": s, "loss": float(loss)})
                pending.clear()
                last_loss = records[-1]["loss"]
                elapsed = time.perf_counter() - t_start
                progress.update(
                    task, completed=step, loss=last_loss, tps=step * tokens_per_step / elapsed
                )
            if step % eval_every == 0 or step == steps:
                v = val_loss(params)
                records[-1]["val_loss"] = v
                progress.console.print(f"step {step}: train loss {last_loss:.4f}, val loss {v:.4f}")
    jax.block_until_ready(params)
    wall = time.perf_counter() - t_start
    tokens_per_s = steps * tokens_per_step / wall

    # A console of its own so the table keeps its columns on narrow or non-tty outputs.
    Console(file=console.file, width=max(console.width, 110)).print(
        memory.render_table(figures, f"memory of one training step ({preset_name})")
    )
    summary = {
        "preset": preset_name,
        "config": dataclasses.asdict(cfg),
        "optimizer": dataclasses.asdict(opt_cfg),
        "policy": policy.name,
        "precision": dataclasses.asdict(precision),
        "accum": dataclasses.asdict(accum),
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "seed": seed,
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "final_val_loss": records[-1].get("val_loss"),
        "tokens_per_s": tokens_per_s,
        "wall_s": wall,
        "compile_s": compile_s,
        "platform": jax.devices()[0].platform,
        "host": platform.node(),
        "memory": [dataclasses.asdict(f) for f in figures],
    }
    console.print(
        f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} "
        f"(val {summary['final_val_loss']:.4f}) in {wall:.1f} s, {tokens_per_s:,.0f} tokens/s "
        "(wall clock over the loop, compile excluded)"
    )
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        save_safetensors(nnx.merge(graphdef, params), os.path.join(out_dir, "model.safetensors"))
        console.print(f"wrote {out_dir}/metrics.jsonl, summary.json, model.safetensors")
    return summary

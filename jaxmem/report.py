"""Memory records, one per framework × policy, with the same categories on both sides. Every
figure is measured or derived as its ``*_source`` field says; nothing is filled in unmeasured
(a figure a framework cannot give is ``None``).

JAX records can be built from shapes alone (``abstract=True``: ``jax.ShapeDtypeStruct``
parameters, no weights allocated) so large presets are planned ahead of time from a laptop. A
plan compiled for XLA:CPU is a proxy for the GPU's: the same program, another compiler backend.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmem import analytic
from jaxmem.config import ModelConfig, OptimizerConfig
from jaxmem.flops import grad_matmul_flops
from jaxmem.memory import (
    bytes_by_name,
    compiled_plan,
    device_peak_bytes,
    process_max_rss_bytes,
    saved_residuals,
    summarize_residuals,
)
from jaxmem.parity import lm_batch
from jaxmem.precision import Precision
from jaxmem.remat import MemoryPolicy, layers_fn
from jaxmem.train import (
    init_loss_scale,
    lm_loss_fn,
    make_model,
    make_optimizer,
    make_train_step,
    tree_bytes,
)

RECORD_FIELDS = (
    "framework",
    "policy",
    "precision",
    "params_bytes",
    "grads_bytes",
    "opt_state_bytes",
    "saved_activation_bytes_device",
    "saved_activation_bytes_host",
    "analytic_activation_bytes",
    "compiled_temp_bytes",
    "flops",
    "model_flops",
    "peak_bytes",
    "peak_source",
    "saved_by_name",
    "saved_argument_bytes",
)


def _batch(cfg: ModelConfig, batch: int, seq_len: int, abstract: bool) -> dict[str, Any]:
    if abstract:
        spec = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
        return {"inputs": spec, "targets": spec}
    inputs, targets = lm_batch(cfg, batch, seq_len, seed=0)
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}


def jax_record(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    batch: int,
    seq_len: int,
    *,
    abstract: bool = False,
) -> dict[str, Any]:
    """Measure one jaxmem training step (or plan it from shapes when ``abstract``)."""
    if abstract:
        model = nnx.eval_shape(lambda: make_model(cfg, precision))
    else:
        model = make_model(cfg, precision)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(opt_cfg)
    opt_state = jax.eval_shape(tx.init, params) if abstract else tx.init(params)
    data = _batch(cfg, batch, seq_len, abstract)
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))

    def f(p, b):
        return loss(p, b)[0]

    saved = saved_residuals(f, params, data)
    residuals = summarize_residuals(saved)
    grads = jax.eval_shape(jax.grad(f), params, data)
    step = make_train_step(loss, tx, precision=precision, opt_cfg=opt_cfg)
    scale = init_loss_scale(precision)
    plan = compiled_plan(step.lower(params, opt_state, scale, data).compile())
    platform = jax.devices()[0].platform
    peak, peak_source = None, None
    if not abstract and platform != "cpu":
        step(params, opt_state, scale, data)
        peak, peak_source = device_peak_bytes(), "runtime peak (device.memory_stats)"
    if peak is None:
        peak = (
            plan["argument_bytes"] + plan["output_bytes"] - plan["alias_bytes"] + plan["temp_bytes"]
        )
        peak_source = (
            f"compiled plan (XLA:{platform.upper()}): arguments + outputs - aliased + temporaries"
        )
    estimate = analytic.saved_activation_bytes(cfg, policy, batch, seq_len, precision)
    return {
        "framework": "jax",
        "policy": policy.name,
        "precision": precision.name,
        "batch": batch,
        "seq_len": seq_len,
        "planned_from_shapes": abstract,
        "params_bytes": tree_bytes(params),
        "grads_bytes": tree_bytes(grads),
        "opt_state_bytes": tree_bytes(opt_state),
        "saved_activation_bytes_device": residuals.activation_bytes_device,
        "saved_activation_bytes_host": residuals.activation_bytes_host,
        "saved_source": "residual accounting (jaxpr of jax.vjp; parameters excluded)",
        "saved_by_name": bytes_by_name(saved),
        "saved_argument_bytes": residuals.argument_bytes,
        "analytic_activation_bytes": estimate.device_bytes + estimate.host_bytes,
        "compiled_temp_bytes": plan["temp_bytes"],
        "compiled_plan": plan,
        "flops": grad_matmul_flops(f, params, data),
        "flops_source": "matmul FLOPs of the gradient's jaxpr (recompute included: hardware FLOPs)",
        "model_flops": analytic.model_flops(cfg, batch, seq_len),
        "peak_bytes": peak,
        "peak_source": peak_source,
        # the OS's high-water mark of this whole process (both frameworks, everything so far)
        "process_max_rss_bytes": process_max_rss_bytes(),
        "process_max_rss_source": "OS (getrusage ru_maxrss), whole process so far, host",
    }


def torch_record(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    batch: int,
    seq_len: int,
) -> dict[str, Any]:
    """Run one torch_ref training step and measure it."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    import torch_ref
    from torch_ref.memory import measure_lm_step
    from torch_ref.remat import apply_memory_policy
    from torch_ref.train import TORCH_DTYPES
    from torch_ref.train import make_optimizer as make_torch_optimizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch_ref.Decoder(cfg).to(device, TORCH_DTYPES[precision.param_dtype])
    runner = apply_memory_policy(model.blocks, policy)
    opt = make_torch_optimizer(model, opt_cfg)
    data = _batch(cfg, batch, seq_len, abstract=False)
    x = torch.from_numpy(np.array(data["inputs"])).long().to(device)
    y = torch.from_numpy(np.array(data["targets"])).long().to(device)

    tracker = MemTracker()
    tracker.track_external(model, opt)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tracker:
        live, hooks, flops = measure_lm_step(model, runner, x, y, precision)
        grads_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
        opt.step()
    if device == "cuda":
        peak, source = torch.cuda.max_memory_allocated(), "runtime peak (max_memory_allocated)"
    else:
        peak = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
        source = "runtime peak (torch MemTracker, CPU)"
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    estimate = analytic.saved_activation_bytes(cfg, policy, batch, seq_len, precision)
    return {
        "framework": "torch",
        "policy": policy.name,
        "precision": precision.name,
        "batch": batch,
        "seq_len": seq_len,
        "planned_from_shapes": False,
        "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "grads_bytes": grads_bytes,
        "opt_state_bytes": sum(t.numel() * t.element_size() for t in state),
        "saved_activation_bytes_device": live.device_bytes,
        "saved_activation_bytes_host": live.host_bytes,
        "saved_source": "live-tensor accounting (forward allocations alive at its end)",
        "saved_by_name": live.by_name,
        "saved_argument_bytes": hooks.argument_bytes,
        "hook_saved_bytes_device": hooks.activation_bytes_device,
        "hook_saved_bytes_host": hooks.activation_bytes_host,
        "hook_source": "saved-tensor hooks (storages de-duplicated; blind to what a selective "
        "policy keeps itself)",
        "analytic_activation_bytes": estimate.device_bytes + estimate.host_bytes,
        "compiled_temp_bytes": None,
        "compiled_plan": None,
        "flops": flops,
        "flops_source": "torch.utils.flop_counter.FlopCounterMode (hardware FLOPs)",
        "model_flops": analytic.model_flops(cfg, batch, seq_len),
        "peak_bytes": int(peak),
        "peak_source": source,
        # the OS's high-water mark of this whole process (both frameworks, everything so far)
        "process_max_rss_bytes": process_max_rss_bytes(),
        "process_max_rss_source": "OS (getrusage ru_maxrss), whole process so far, host",
    }


# The q, k and v projections are one fused matmul in torch_ref: compared as one group.
_GROUPS = {
    "query_proj": "query_proj/key_proj/value_proj",
    "key_proj": "query_proj/key_proj/value_proj",
    "value_proj": "query_proj/key_proj/value_proj",
}
# jaxmem tags the block input inside the block; torch_ref's listing names it by position.
_SAME = {"block_input": "<layer input>"}


def name_differences(
    jax_names: dict[str, int], torch_names: dict[str, int]
) -> list[dict[str, Any]]:
    """Saved bytes by tensor name where the two frameworks differ, largest difference first.

    Both sides name saved tensors by jaxmem's tags; q/k/v are compared as one group (torch_ref
    fuses their matmul), and names in ``<...>`` are what each framework keeps besides tagged
    tensors (jaxmem: ``<untagged>``; torch_ref: ``<op kind in block / outside the stack>``).
    """
    joined = any("/" in n for n in torch_names)

    def canonical(names: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, nbytes in names.items():
            name = _SAME.get(name, name)
            if joined:
                name = _GROUPS.get(name, name)
            out[name] = out.get(name, 0) + nbytes
        return out

    jax_c, torch_c = canonical(jax_names), canonical(torch_names)
    rows = [
        {"name": n, "jax_bytes": jax_c.get(n, 0), "torch_bytes": torch_c.get(n, 0)}
        for n in sorted(set(jax_c) | set(torch_c))
        if jax_c.get(n, 0) != torch_c.get(n, 0)
    ]
    return sorted(rows, key=lambda r: -abs(r["jax_bytes"] - r["torch_bytes"]))

"""torch_ref's memory record of one training step, beside jaxmem's
(``jaxmem.planner.records.jax_record``: the same categories), and where the two differ tensor by
tensor. Every figure is measured as its ``*_source`` field says; a record names the PyTorch
translation of the policy it ran (``translation``: stock PyTorch, or torch_ref's extension).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import torch_ref
from jaxmem.adapters import AdapterConfig
from jaxmem.config import AccumConfig, ModelConfig, OptimizerConfig
from jaxmem.figures import process_max_rss_bytes
from jaxmem.memory import analytic
from jaxmem.parallel import ParallelConfig
from jaxmem.planner.records import lm_step_batch
from jaxmem.policy import MemoryPolicy
from jaxmem.precision import Precision
from torch_ref.forward_memory import measure_lm_step
from torch_ref.remat import apply_loss_policy, apply_memory_policy, describe_loss
from torch_ref.train import TORCH_DTYPES, accumulate_grads, clip_grads
from torch_ref.train import make_optimizer as make_torch_optimizer


def torch_record(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    batch: int,
    seq_len: int,
    *,
    translation: str = "stock",
    fake: bool = False,
    accum: int = 1,
    adapters: AdapterConfig | None = None,
) -> dict[str, Any]:
    """Run one torch_ref training step under ``policy`` (``translation``: ``stock`` PyTorch or
    torch_ref's ``lean`` extension, see ``torch_ref.remat``) and measure it.

    ``adapters`` (enabled): LoRA on a frozen base (``torch_ref.lora``, PEFT): gradients and
    optimizer state exist for the trainable parameters only, and ``trainable_params_bytes``
    says how many of ``params_bytes`` those are.

    ``fake``: run the same step under ``FakeTensorMode`` (every tensor is meta storage with a
    shape: no memory, no arithmetic), so the accounting exists at sizes this machine cannot hold
    (GPT-2 1.5B, GPT-3 6.7B). Shapes, dtypes, what autograd and the policy keep and the FLOPs are
    the real step's; a runtime peak cannot exist and is None. The fake step runs as a CPU step
    (this PyTorch has no CUDA), so mixed precision follows CPU autocast's rules; torch_ref
    upcasts norms, softmax and the loss itself, so the saved dtypes are those of a CUDA run.

    ``accum``: the step runs that many microbatches of the batch, each backward accumulating
    into ``.grad`` (as a PyTorch user accumulates), then the optimizer; saved activations are one
    microbatch's, FLOPs and the peak the whole step's."""
    AccumConfig(steps=accum).check_batch(batch)  # the same check and message as jax_record
    step = _measure_step(
        cfg, policy, precision, opt_cfg, batch, seq_len, translation, fake, accum, adapters
    )
    live, hooks = step.live, step.hooks
    estimate = analytic.saved_activation_bytes(cfg, policy, batch // accum, seq_len, precision)
    how = " under FakeTensorMode (shapes only: no memory, no arithmetic)" if fake else ""
    return {
        "framework": framework_label(translation),
        "translation": step.translation + describe_loss(policy),
        "policy": policy.name,
        "precision": precision.name,
        "batch": batch,
        "seq_len": seq_len,
        "accum": accum,
        "planned_from_shapes": fake,
        "params_bytes": step.params_bytes,
        "trainable_params_bytes": step.trainable_bytes,
        "adapters": (adapters or AdapterConfig()).label(),
        "grads_bytes": step.grads_bytes,
        "opt_state_bytes": step.opt_state_bytes,
        "saved_activation_bytes_device": live.device_bytes,
        "saved_activation_bytes_host": live.host_bytes,
        "saved_source": "live-tensor accounting (forward allocations alive at its end)" + how,
        "saved_by_name": live.by_name,
        "saved_argument_bytes": hooks.argument_bytes,
        "saved_parameter_copy_bytes": live.parameter_copy_bytes,
        "hook_saved_bytes_device": hooks.activation_bytes_device,
        "hook_saved_bytes_host": hooks.activation_bytes_host,
        "hook_source": "saved-tensor hooks (storages de-duplicated; blind to what a selective "
        "policy keeps itself)" + how,
        "analytic_activation_bytes": estimate.device_bytes + estimate.host_bytes,
        "analytic_source": analytic.ANALYTIC_SOURCE,
        "compiled_temp_bytes": None,
        "compiled_plan": None,
        "flops": step.flops,
        "flops_source": "torch.utils.flop_counter.FlopCounterMode (hardware FLOPs)" + how,
        "model_flops": analytic.model_flops(cfg, batch, seq_len),
        "peak_bytes": step.peak_bytes,
        "peak_source": step.peak_source,
        # the OS's high-water mark of this whole process (both frameworks, everything so far)
        "process_max_rss_bytes": process_max_rss_bytes(),
        "process_max_rss_source": "OS (getrusage ru_maxrss), whole process so far, host",
    }


@dataclasses.dataclass(frozen=True)
class _Step:
    """What one torch_ref step measured (``_measure_step``) gives its record."""

    live: Any  # the live-tensor accounting of the first microbatch's forward
    hooks: Any  # and its saved-tensor hooks' accounting
    flops: int  # of every microbatch's forward and backward
    translation: str  # how the policy was applied (the runner's description)
    params_bytes: int
    trainable_bytes: int  # of params_bytes, those with requires_grad (all but a frozen base)
    grads_bytes: int
    opt_state_bytes: int
    peak_bytes: int | None  # the runtime peak (None under fake tensors)
    peak_source: str


def _measure_step(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    batch: int,
    seq_len: int,
    translation: str,
    fake: bool,
    accum: int,
    adapters: AdapterConfig | None = None,
) -> _Step:
    """Build the model and run ``torch_record``'s step: the accounted step first, untracked;
    then (real tensors) a steady step, holding the optimizer state a first step has not created
    yet, measured for the runtime peak."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = "cpu" if fake or not torch.cuda.is_available() else "cuda"
    dtype = TORCH_DTYPES[precision.param_dtype]
    tracker = None
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model, runner, opt = _model_and_optimizer(
            cfg, policy, opt_cfg, translation, device, dtype, fake, adapters
        )
        xs, ys = _token_microbatches(cfg, batch, seq_len, accum, device, fake)
        live, hooks, flops = _accounted_microbatches(model, runner, xs, ys, precision)
        grads = [p.grad for p in model.parameters() if p.grad is not None]  # frozen: none
        grads_bytes = sum(g.numel() * g.element_size() for g in grads)
        opt.step()
        if not fake:
            tracker = _tracked_step(model, opt, xs, ys, precision, device, opt_cfg)
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        params_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        trainable = [p for p in model.parameters() if p.requires_grad]
        trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
        opt_state_bytes = sum(t.numel() * t.element_size() for t in state)
    if fake:
        peak, source = None, "none (fake tensors allocate nothing)"
    elif device == "cuda":
        peak = torch.cuda.max_memory_allocated()
        source = "runtime peak (max_memory_allocated; a second step: optimizer state included)"
    elif tracker is None:
        peak, source = None, "none (torch's MemTracker cannot hook a frozen parameter)"
    else:
        peak = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
        source = "runtime peak (torch MemTracker, CPU; a second step: optimizer state included)"
    return _Step(
        live=live,
        hooks=hooks,
        flops=flops,
        translation=runner.description,
        params_bytes=params_bytes,
        trainable_bytes=trainable_bytes,
        grads_bytes=grads_bytes,
        opt_state_bytes=opt_state_bytes,
        peak_bytes=None if peak is None else int(peak),
        peak_source=source,
    )


def _model_and_optimizer(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    opt_cfg: OptimizerConfig,
    translation: str,
    device: str,
    dtype: torch.dtype,
    fake: bool,
    adapters: AdapterConfig | None = None,
) -> tuple[Any, Any, Any]:
    """torch_ref's decoder in ``dtype`` on ``device`` (with ``adapters``: PEFT's LoRA on its
    frozen base), ``policy`` applied to its blocks (``translation``) and its loss, the
    policy's runner, and the optimizer (over the trainable parameters)."""
    lora = adapters is not None and adapters.enabled
    if fake and lora:
        model = _fake_model_with_adapters(cfg, adapters, dtype)
    elif fake:  # Module.to cannot swap fake parameters: build them in their dtype instead
        with _default_dtype(dtype):
            model = torch_ref.Decoder(cfg)
    else:
        model = torch_ref.Decoder(cfg).to(device, dtype)
    if lora and not fake:
        from torch_ref.lora import add_adapters

        add_adapters(model, adapters)
    runner = apply_memory_policy(model.blocks, policy, translation)
    apply_loss_policy(model, policy)
    return model, runner, make_torch_optimizer(model, opt_cfg)


def _token_microbatches(
    cfg: ModelConfig, batch: int, seq_len: int, accum: int, device: str, fake: bool
) -> tuple[Any, Any]:
    """The step's inputs and targets, split into ``accum`` microbatches: ``lm_step_batch``'s
    tokens (zeros under fake tensors: token ids do not change the bytes or the FLOPs)."""
    if fake:
        x = torch.zeros(batch, seq_len, dtype=torch.long)
        y = torch.zeros(batch, seq_len, dtype=torch.long)
    else:
        data = lm_step_batch(cfg, batch, seq_len, abstract=False)
        x = torch.from_numpy(np.array(data["inputs"])).long().to(device)
        y = torch.from_numpy(np.array(data["targets"])).long().to(device)
    micro = batch // accum
    return x.split(micro), y.split(micro)


def _accounted_microbatches(
    model: Any, runner: Any, xs: Any, ys: Any, precision: Precision
) -> tuple[Any, Any, int]:
    """Forward + backward of every microbatch under the accounting (gradients accumulate in
    ``.grad``): what the first left for its backward, and the FLOPs of all."""
    flops, first = 0, None
    for xi, yi in zip(xs, ys, strict=True):
        live, hooks, f = measure_lm_step(model, runner, xi, yi, precision)
        first = first or (live, hooks)
        flops += f
    return *first, flops


def _tracked_step(
    model: Any,
    opt: Any,
    xs: Any,
    ys: Any,
    precision: Precision,
    device: str,
    opt_cfg: OptimizerConfig,
) -> MemTracker | None:
    """A steady step under MemTracker (and CUDA's peak statistics, reset): the microbatches
    through torch_ref's own training step (``accumulate_grads``: each summed loss over the
    batch's token count) with no accounting attached, then the optimizer. The accounting's
    hooks keep tensors in reference cycles until Python's collector runs, which moved
    MemTracker's peak with the collector's timing (`small` fp32 `full`: 109.1-115.4 MiB over
    runs; 123.4 with the collector off). A clipping ``opt_cfg`` clips as the trainer does
    (``clip_grads``: per-tensor norms, scalars)."""
    opt.zero_grad(set_to_none=True)
    # MemTracker hooks every parameter's gradient, and a frozen one (adapters' base) refuses a
    # hook: no tracker then (the CUDA statistics still give a peak)
    frozen = any(not p.requires_grad for p in model.parameters())
    tracker = None if frozen else MemTracker()
    if tracker is not None:
        tracker.track_external(model, opt)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tracker or contextlib.nullcontext():
        n_total = torch.tensor(float(sum(yi.numel() for yi in ys)), device=ys[0].device)
        for i, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
            if i and tracker is not None:
                # MemTracker refuses a module run twice in one context (NotImplementedError,
                # "multiple iterative calls"); its per-module stats are cleared, the peak
                # over the whole step is kept
                tracker.reset_mod_stats()
            accumulate_grads(
                model,
                {"inputs": xi, "targets": yi},
                precision=precision,
                divisor=lambda _: n_total,
            )
        clip_grads(model.parameters(), opt_cfg)
        opt.step()
    return tracker


def _fake_model_with_adapters(cfg: ModelConfig, adapters: AdapterConfig, dtype: torch.dtype):
    """torch_ref's decoder with adapters under the active ``FakeTensorMode``, on the CPU: built
    on the meta device (PEFT moves each new adapter to its base layer's device with
    ``Module.to``, which cannot swap fake parameters, and leaves meta ones where they are), then
    every tensor put on the CPU by assignment."""
    from torch_ref.lora import add_adapters

    with torch.device("meta"), _default_dtype(dtype):
        model = add_adapters(torch_ref.Decoder(cfg), adapters)
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[key] = torch.nn.Parameter(p.to("cpu"), p.requires_grad)
        for key, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[key] = b.to("cpu")
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Any:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def framework_label(translation: str) -> str:
    """The ``framework`` column of a torch record: the translation asked for (``torch``: stock
    PyTorch, or torch_ref's extension where stock has no API, as ``translation`` in the record
    says; ``torch-lean``: the extension)."""
    return "torch" if translation == "stock" else "torch-lean"


# jaxmem tags the block input inside the block; torch_ref's listing names it by position.
_SAME = {"block_input": "<layer input>"}


def name_differences(
    jax_names: dict[str, int], torch_names: dict[str, int]
) -> list[dict[str, Any]]:
    """Saved bytes by tensor name where the two frameworks differ, largest difference first.

    Both sides name saved tensors by jaxmem's tags. Where torch_ref's one op carries several
    tags (q/k/v: one fused matmul; fused attention's output and log-sum-exp: one SDPA call), its
    listing joins them with ``/``, and jaxmem's tensors of those tags are compared as that one
    group. Names in ``<...>`` are what each framework keeps besides tagged tensors (jaxmem:
    ``<untagged>``; torch_ref: ``<op kind in block / outside the stack>``).
    """
    groups = {n: label for label in torch_names if "/" in label for n in label.split("/")}

    def canonical(names: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, nbytes in names.items():
            name = _SAME.get(name, name)
            name = groups.get(name, name)
            out[name] = out.get(name, 0) + nbytes
        return out

    jax_c, torch_c = canonical(jax_names), canonical(torch_names)
    rows = [
        {"name": n, "jax_bytes": jax_c.get(n, 0), "torch_bytes": torch_c.get(n, 0)}
        for n in sorted(set(jax_c) | set(torch_c))
        if jax_c.get(n, 0) != torch_c.get(n, 0)
    ]
    return sorted(rows, key=lambda r: -abs(r["jax_bytes"] - r["torch_bytes"]))


def torch_rank_records(
    preset: str,
    policy: str,
    parallel: ParallelConfig,
    *,
    precision: str = "fp32",
    optimizer: str = "adamw",
    attention: str = "naive",
    batch: int = 8,
    seq_len: int = 32,
    timeout: float = 600,
) -> list[dict[str, Any]]:
    """Launch ``parallel.devices`` torchrun processes of ``torch_ref.mesh_memory`` (gloo on
    CPU: one thread each) and return their records, rank by rank. Raises ``RuntimeError`` with
    torchrun's last words if a rank fails."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        cmd = [torchrun, "--standalone", f"--nproc_per_node={parallel.devices}"]
        cmd += ["-m", "torch_ref.mesh_memory", "--preset", preset, "--policy", policy]
        cmd += ["--precision", precision, "--optimizer", optimizer, "--attention", attention]
        cmd += ["--batch-size", str(batch), "--seq-len", str(seq_len), "--json", out]
        if parallel.sharded:  # else one process, no mesh
            cmd += ["--mesh", parallel.mesh_text()]
        if parallel.tensor_parallel:
            cmd += ["--sequence-parallel", "true" if parallel.sequence_parallel else "false"]
        if parallel.context_parallel:
            cmd += ["--cp-attention", parallel.cp_attention]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)

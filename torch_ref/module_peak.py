"""The peak bytes of real training steps of any ``nn.Module`` (forward, backward, optimizer
step; ``step_peak``): the CUDA caching allocator's peak on a GPU, live-tensor accounting on CPU.

Part of the memory tools for any ``nn.Module`` (``torch_ref.module_memory``, the public API).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torch_ref.checkpoint_plan import CheckpointPlan, ModelError, _applied
from torch_ref.module_activations import (
    Inputs,
    LossFn,
    _call_arguments,
    _check_real,
    _loss_of,
    _tensors,
    _unique_bytes,
    new_storages,
)

CUDA_PEAK = "runtime peak, CUDA caching allocator (torch.cuda.max_memory_allocated)"
CPU_PEAK = (
    "live-tensor accounting on CPU (parameters, buffers, gradients, inputs and optimizer state, "
    "plus every storage an op allocates, minus frees: TorchDispatchMode and weakref finalizers; "
    "scratch memory a kernel frees before it returns is not seen)"
)


# ------------------------------------------------------------------------------ the step peak
@dataclasses.dataclass(frozen=True)
class StepPeak:
    """The peak memory of real training steps.

    Attributes:
      peak_bytes: the larger of the two step peaks below.
      first_step_peak_bytes: peak of the first step, which creates the optimizer state.
      steady_step_peak_bytes: peak of the second step, the optimizer state resident throughout
        (every later step looks like it).
      parameter_bytes, gradient_bytes, optimizer_state_bytes: counted from the tensors after
        the second step (storages counted once).
      trainable_parameter_bytes: of ``parameter_bytes``, those with ``requires_grad`` (what
        the gradients and optimizer state are for; less than all with a frozen base, e.g.
        PEFT's LoRA).
      device: where the step ran.
      policy: the checkpoint plan, in words.
      source: how the peaks were obtained (``CUDA_PEAK`` or ``CPU_PEAK``).
    """

    peak_bytes: int
    first_step_peak_bytes: int
    steady_step_peak_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    trainable_parameter_bytes: int
    device: str
    policy: str
    source: str


class _LiveStorages(TorchDispatchMode):
    """Bytes of the storages alive now and their peak: the ones registered with ``add`` and
    every storage an op allocates while the mode is active, each dropped when it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self.live or nbytes == 0:
            return
        self.live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def add_all(self, tensors: Iterable[torch.Tensor]) -> None:
        """Register tensors alive now, keeping no reference to them (a gradient freed by
        ``zero_grad`` must leave the count)."""
        for t in tensors:
            self.add(t)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in new_storages(func, args, kwargs, out):
            self.add(t)
        return out


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def _train_step(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer,
) -> None:
    optimizer.zero_grad(set_to_none=True)
    _loss_of(model, args, kwargs, loss_fn).backward()
    optimizer.step()


def _cuda_peaks(step: Callable[[], None], device: torch.device) -> list[int]:
    peaks = []
    for _ in range(2):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device))
    return peaks


def _cpu_peaks(step: Callable[[], None], resident: Callable[[], list[torch.Tensor]]) -> list[int]:
    tracker = _LiveStorages()
    tracker.add_all(resident())
    peaks = []
    with tracker:
        for _ in range(2):
            tracker.peak = tracker.current
            step()
            peaks.append(tracker.peak)
    return peaks


def step_peak(
    model: nn.Module,
    inputs: Inputs,
    *,
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = torch.optim.AdamW,
    loss_fn: LossFn | None = None,
    policy: CheckpointPlan | None = None,
) -> StepPeak:
    """Run two real training steps of ``model`` on ``inputs`` (each: ``zero_grad(set_to_none=
    True)``, forward, loss, backward, ``optimizer.step()``) under ``policy`` and report the peak
    bytes of each. The optimizer is ``optimizer_factory(trainable parameters)``; its state is
    created by the first step.

    The model must hold real tensors on one device with its inputs. On CUDA the peak is the
    caching allocator's (``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``: every tensor of the process on that device); on CPU it is
    counted from the tensors (``CPU_PEAK``). The steps train the model: its parameters and
    ``.grad`` change (pass a copy if they matter)."""
    plan = policy or CheckpointPlan()
    args, kwargs = _call_arguments(inputs)
    _check_real(model, args, kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ModelError(f"no parameter of {type(model).__name__} requires grad: nothing to train")
    device = params[0].device
    optimizer = optimizer_factory(params)
    with _applied(model, plan):
        step = functools.partial(_train_step, model, args, kwargs, loss_fn, optimizer)
        if device.type == "cuda":
            peaks, source = _cuda_peaks(step, device), CUDA_PEAK
        else:

            def resident() -> list[torch.Tensor]:
                grads = [p.grad for p in params if p.grad is not None]
                return _tensors(model, args, kwargs) + grads

            peaks, source = _cpu_peaks(step, resident), CPU_PEAK
    return StepPeak(
        peak_bytes=max(peaks),
        first_step_peak_bytes=peaks[0],
        steady_step_peak_bytes=peaks[1],
        parameter_bytes=_unique_bytes(model.parameters()),
        gradient_bytes=_unique_bytes(p.grad for p in params if p.grad is not None),
        optimizer_state_bytes=_unique_bytes(_optimizer_tensors(optimizer)),
        device=str(device),
        policy=plan.describe(),
        source=source,
        trainable_parameter_bytes=_unique_bytes(params),
    )

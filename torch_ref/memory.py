"""Memory measurement for torch_ref, mirroring ``jaxmem.memory``.

``forward_live_bytes`` counts what a forward pass leaves alive for the backward pass: every tensor
storage created during the forward and still referenced when it ends (activations autograd
saved, checkpoint inputs, tensors a selective policy kept, host copies of offloaded ones),
de-duplicated by storage and split by device. Saved-tensor hooks alone cannot do this: inside a
non-reentrant checkpoint, the checkpoint's own hooks replace any outer ones.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclasses.dataclass(frozen=True)
class LiveBytes:
    device_bytes: int  # on the compute device (on a CPU-only run: not offloaded)
    host_bytes: int  # offloaded to host memory (cpu tensors while computing on an accelerator,
    # or tensors a policy explicitly moved to host on a CPU-only run)
    n_storages: int


class _TrackAllocations(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.live:
            return
        self.live[key] = (storage.nbytes(), t.device.type)
        weakref.finalize(storage, self.live.pop, key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Views (e.g. a parameter's transpose) share their input's storage: not an allocation.
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._track(t)
        return out


def forward_live_bytes(
    forward: Callable[[], Any], *, host_storages: Callable[[], set[int]] | None = None
) -> tuple[Any, LiveBytes]:
    """Run ``forward()`` and count the storages it allocated that are alive at its end, minus
    the returned tensors' own. ``host_storages()`` names storages to count as host memory (the
    copies an offloading policy made; on a CPU-only machine they are not told apart by device).
    """
    mode = _TrackAllocations()
    with mode:
        out = forward()
    returned = {
        t.untyped_storage().data_ptr() for t in tree_leaves(out) if isinstance(t, torch.Tensor)
    }
    host = host_storages() if host_storages else set()
    device_bytes = host_bytes = n = 0
    compute = next((t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)), "cpu")
    for key, (nbytes, device) in list(mode.live.items()):
        if key in returned:
            continue
        n += 1
        if key in host or (device == "cpu" and compute != "cpu"):
            host_bytes += nbytes
        else:
            device_bytes += nbytes
    return out, LiveBytes(device_bytes=device_bytes, host_bytes=host_bytes, n_storages=n)


def measure_lm_step(
    model: torch.nn.Module,
    runner: Any,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    precision: Any,
) -> tuple[LiveBytes, int]:
    """One forward + backward of the mean LM loss (autocast for mixed precision).

    Returns the bytes the forward leaves for the backward (live-tensor accounting; the host
    copies of ``runner``, a ``torch_ref.remat.PolicyLayers``, counted as host) and the matmul
    FLOPs executed (``FlopCounterMode``, recompute included). Gradients stay in ``.grad``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from torch_ref.loss import cross_entropy_sum
    from torch_ref.train import TORCH_DTYPES

    device = inputs.device.type

    def forward():
        with torch.autocast(
            device, dtype=TORCH_DTYPES[precision.compute_dtype], enabled=precision.is_mixed
        ):
            logits = model(inputs)
        loss_sum, n = cross_entropy_sum(logits, targets)
        return loss_sum / n

    with FlopCounterMode(display=False) as counter:
        loss, live = forward_live_bytes(forward, host_storages=runner.host_storages)
        loss.backward()
    return live, counter.get_total_flops()

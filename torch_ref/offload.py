"""Offload helpers for PyTorch users' own blocks, beside the policies ``torch_ref.remat``
applies: ``save_on_cpu_layers_fn`` (PyTorch's built-in saved-tensor-hook offload of every tensor
a selected block saves, ``torch.autograd.graph.save_on_cpu``) and ``OffloadCheckpoint``, the
seeds' ``OffloadFunction`` made correct: the input kept in host memory, the real block
recomputed in backward, gradients for the parameters whatever the input requires (as
FairScale's ``checkpoint_wrapper(offload_to_cpu=True)``). Written by hand because FairScale is
unmaintained and stock PyTorch has no checkpoint that keeps its input in host memory by itself
(``save_on_cpu`` around a checkpoint does it: the ``full-host`` policy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from jaxmem.policy import LayerSelection
from torch_ref.model import RopeTables


def save_on_cpu_layers_fn(selection: LayerSelection, n_layers: int) -> Callable[..., Any]:
    """Every tensor the selected blocks save for backward goes to host memory
    (``torch.autograd.graph.save_on_cpu``; pinned when CUDA is present). No recompute."""
    selected = set(selection.indices(n_layers))
    pin = torch.cuda.is_available()

    def layers_fn(
        layers: nn.ModuleList, x: torch.Tensor, mask: Any, rope: RopeTables | None
    ) -> torch.Tensor:
        for i, layer in enumerate(layers):
            if i in selected:
                with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                    x = layer(x, mask, rope)
            else:
                x = layer(x, mask, rope)
        return x

    return layers_fn


class _OffloadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, anchor, *args):
        ctx.fn = fn
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.non_tensors = [None if t else a for t, a in zip(ctx.is_tensor, args, strict=True)]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.devices = [t.device for t in tensors]
        ctx.requires = [t.requires_grad for t in tensors]
        pin = torch.cuda.is_available()
        host = []
        for t in tensors:
            copy = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            host.append(copy.copy_(t.detach(), non_blocking=pin))
        ctx.save_for_backward(*host)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, grad_out):
        tensors = [
            t.to(d, non_blocking=True).requires_grad_(r)
            for t, d, r in zip(ctx.saved_tensors, ctx.devices, ctx.requires, strict=True)
        ]
        it = iter(tensors)
        args = [
            next(it) if is_t else a for is_t, a in zip(ctx.is_tensor, ctx.non_tensors, strict=True)
        ]
        with torch.enable_grad():
            out = ctx.fn(*args)
        # Accumulates into the parameters inside fn, and into the inputs that require grad.
        torch.autograd.backward(out, grad_out)
        grads = iter(t.grad if t.requires_grad else None for t in tensors)
        return (None, None, *[next(grads) if is_t else None for is_t in ctx.is_tensor])


class OffloadCheckpoint:
    """The seeds' ``OffloadFunction``, made correct and general.

    ``OffloadCheckpoint.apply(fn, *args)`` runs ``fn(*args)`` without building a graph and keeps
    only the tensor arguments, in host memory. Backward brings them back, re-runs the real ``fn``
    with grad enabled and back-propagates through it, so parameters inside ``fn`` receive their
    gradients and every tensor argument that requires grad gets its own. (The seed's version
    recomputed a placeholder ``input * 2`` and dropped parameter gradients.) ``fn`` must be
    deterministic: no RNG state is replayed.

    An ``autograd.Function`` runs its backward only if one of its inputs requires grad, and a
    block's parameters are not inputs: with an input that does not require grad (a frozen first
    layer, a block stack fed raw features) the parameters would silently get no gradient. An
    empty anchor tensor that requires grad is passed along, as FairScale's ``checkpoint_wrapper``
    does with its dummy tensor.
    """

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())
        return _OffloadFunction.apply(fn, anchor, *args)


def offload_checkpoint_layers_fn(selection: LayerSelection, n_layers: int) -> Callable[..., Any]:
    """Selected blocks run through ``OffloadCheckpoint``: only their input is kept, on host."""
    selected = set(selection.indices(n_layers))

    def layers_fn(
        layers: nn.ModuleList, x: torch.Tensor, mask: Any, rope: RopeTables | None
    ) -> torch.Tensor:
        for i, layer in enumerate(layers):
            if i in selected:
                x = OffloadCheckpoint.apply(layer, x, mask, rope)
            else:
                x = layer(x, mask, rope)
        return x

    return layers_fn

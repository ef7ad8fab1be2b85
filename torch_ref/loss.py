"""Losses mirroring ``jaxmem.model.loss``: each returns a sum and a count, divided once by the
caller."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from torch_ref.dtypes import wide


def cross_entropy_sum(
    logits_bsv: torch.Tensor, targets_bs: torch.Tensor, mask_bs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy in fp32 (float64 for float64 logits) and the number of
    tokens it covers."""
    acc = wide(logits_bsv.dtype)
    nll_bs = F.cross_entropy(
        logits_bsv.to(acc).flatten(0, 1), targets_bs.flatten(), reduction="none"
    ).view_as(targets_bs)
    if mask_bs is None:
        return nll_bs.sum(), torch.tensor(float(nll_bs.numel()), dtype=acc)
    mask = mask_bs.to(acc)
    return (nll_bs * mask).sum(), mask.sum()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


# how many ChunkedLMLoss forwards are running: torch_ref.forward_memory's accounting names what
# they allocate "<loss gradients>" (jaxmem's residual accounting does the same)
_forming = [0]


def forming_loss_gradients() -> bool:
    """Inside ``ChunkedLMLoss``'s forward, where the loss's gradients are formed."""
    return _forming[0] > 0


class ChunkedLMLoss(torch.autograd.Function):
    """The head and loss over sequence chunks, each chunk's gradients formed in the forward
    (``chunked_lm_loss``). Inputs: ``(head, chunks, x, targets, weights, *params)``."""

    @staticmethod
    def forward(ctx, head, chunks, x, targets, weights, *params):  # noqa: D102
        _forming[0] += 1
        try:
            return ChunkedLMLoss._forward(ctx, head, chunks, x, targets, weights, *params)
        finally:
            _forming[0] -= 1

    @staticmethod
    def _forward(ctx, head, chunks, x, targets, weights, *params):
        acc = wide(x.dtype)
        dx = torch.empty_like(x)
        dparams = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, acc)) for p in params]
        total = torch.zeros((), dtype=acc, device=x.device)
        step = x.shape[1] // chunks
        for start in range(0, x.shape[1], step):
            part = slice(start, start + step)
            # inner saved-tensor hooks that keep what they are given: what this chunk saves is
            # freed here, so hooks outside (accounting, offload) must not see it as kept
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                x_c = x[:, part].detach().requires_grad_(True)
                # the head reads a view of the leaf: module trackers (ModTracker, MemTracker)
                # hook a module's inputs, and autograd.grad refuses such hooks on a leaf
                logits = head(x_c.view_as(x_c))
                nll = F.cross_entropy(
                    logits.to(acc).flatten(0, 1), targets[:, part].flatten(), reduction="none"
                )
                loss = (nll.view_as(targets[:, part]) * weights[:, part].to(acc)).sum()
                grads = torch.autograd.grad(loss, [x_c, *params], allow_unused=True)
            dx[:, part] = grads[0]
            for d, g in zip(dparams, grads[1:], strict=True):
                if g is not None:
                    d += g.to(d.dtype)
            total += loss.detach()
        ctx.save_for_backward(dx, *dparams)
        ctx.param_dtypes = [p.dtype for p in params]
        return total

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        dx, *dparams = ctx.saved_tensors

        def scale(d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return (d.to(torch.promote_types(d.dtype, g.dtype)) * g).to(dtype)

        grads = [scale(d, t) for d, t in zip(dparams, ctx.param_dtypes, strict=True)]
        return None, None, scale(dx, dx.dtype), None, None, *grads


def chunked_lm_loss(
    head: Callable[[torch.Tensor], torch.Tensor],
    params: list[torch.Tensor],
    x_bsd: torch.Tensor,
    targets_bs: torch.Tensor,
    mask_bs: torch.Tensor | None = None,
    *,
    chunks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy_sum(head(x_bsd), targets_bs, mask_bs)`` over ``chunks`` sequence chunks,
    each chunk's gradients (with respect to ``x_bsd`` and the head's ``params``) formed in the
    forward where its logits exist: no ``[B, S, V]`` logits are kept for the backward and one
    chunk's exist at a time, at no recomputed FLOP. An extension (PyTorch has no stock fused
    loss; Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` is the same idea in Triton), the
    peer of ``jaxmem.model.loss.chunked_lm_loss``: the backward scales the stored gradients by
    the loss's cotangent, so it does not compose with GradScaler (jaxmem.job refuses fp16)."""
    seq = x_bsd.shape[1]
    if not (isinstance(chunks, int) and chunks >= 1 and seq % chunks == 0):
        raise ValueError(f"loss chunks={chunks!r} must be a positive divisor of seq_len={seq}")
    acc = wide(x_bsd.dtype)
    weights = (
        torch.ones(targets_bs.shape, dtype=acc, device=x_bsd.device)
        if mask_bs is None
        else mask_bs.to(acc)
    )
    loss_sum = ChunkedLMLoss.apply(head, chunks, x_bsd, targets_bs, weights, *params)
    n = torch.tensor(float(targets_bs.numel()), dtype=acc) if mask_bs is None else weights.sum()
    return loss_sum, n


def mse_sum(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed squared error and element count (``nn.MSELoss()`` is their ratio)."""
    acc = wide(pred.dtype)
    err = pred.to(acc) - target.to(acc)
    return (err * err).sum(), torch.tensor(float(err.numel()), dtype=acc)

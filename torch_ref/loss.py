"""Losses mirroring ``jaxmem.model.loss``: each returns a sum and a count, divided once by the
caller."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_ref.model import wide


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


def mse_sum(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed squared error and element count (``nn.MSELoss()`` is their ratio)."""
    acc = wide(pred.dtype)
    err = pred.to(acc) - target.to(acc)
    return (err * err).sum(), torch.tensor(float(err.numel()), dtype=acc)

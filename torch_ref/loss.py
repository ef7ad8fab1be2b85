"""Losses mirroring ``jaxmem.loss``: each returns a sum and a count, divided once by the caller."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_sum(
    logits_bsv: torch.Tensor, targets_bs: torch.Tensor, mask_bs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy in fp32 and the number of tokens it covers."""
    nll_bs = F.cross_entropy(
        logits_bsv.float().flatten(0, 1), targets_bs.flatten(), reduction="none"
    ).view_as(targets_bs)
    if mask_bs is None:
        return nll_bs.sum(), torch.tensor(float(nll_bs.numel()))
    mask = mask_bs.float()
    return (nll_bs * mask).sum(), mask.sum()


def mse_sum(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed squared error and element count (``nn.MSELoss()`` is their ratio)."""
    err = pred.float() - target.float()
    return (err * err).sum(), torch.tensor(float(err.numel()))

"""Optimizer construction mirroring ``jaxmem.train``."""

from __future__ import annotations

import torch
from torch import nn

from jaxmem.config import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embedding tables (ndim >= 2); not biases or LayerNorm weights —
    the same split as ``jaxmem.train.decay_mask``."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    if cfg.name == "adamw":
        # foreach=False: the plain per-parameter loop, the reference arithmetic order.
        return torch.optim.AdamW(
            param_groups(model, cfg.weight_decay),
            lr=cfg.lr,
            betas=(cfg.b1, cfg.b2),
            eps=cfg.eps,
            foreach=False,
        )
    raise ValueError(f"optimizer={cfg.name!r} is not supported")

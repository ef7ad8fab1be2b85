"""The seeds' training example (shared/seeds/003) on torch_ref: mirrors
``jaxmem.train.seed_example``. Run: ``jaxmem seed-example --framework torch --steps 5``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from jaxmem.config import PRESETS, ModelConfig
from jaxmem.data import seed_example_data
from jaxmem.policy import MemoryPolicy
from torch_ref.loss import mse_sum
from torch_ref.model import BlockStack
from torch_ref.remat import apply_memory_policy

SEED_CONFIG: ModelConfig = PRESETS["seed"]


def train(
    steps: int,
    *,
    cfg: ModelConfig = SEED_CONFIG,
    lr: float = 1e-4,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    module: torch.nn.Module | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    policy: MemoryPolicy | None = None,
) -> list[float]:
    """Adam on MSE, as in the seed; returns the loss before each update. ``module`` replaces the
    block stack (e.g. the seeds' own ``DecoderLayer``)."""
    model = module if module is not None else BlockStack(cfg)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    if policy is not None:
        apply_memory_policy(model, policy)
    x, target = data if data is not None else seed_example_data(d_model=cfg.d_model)
    x, target = torch.from_numpy(x), torch.from_numpy(target)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        err_sum, n = mse_sum(model(x), target)
        loss = err_sum / n
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return [v.item() for v in losses]

"""The seeds' training example (shared/seeds/003), in both frameworks: one post-norm ReLU decoder
layer (the ``seed`` preset: d_model 512, 8 heads, d_ff 2048, no causal mask) applied to a fixed
random input ``[32, 64, 512]``, MSE against a fixed random target, Adam at lr 1e-4, under a
memory policy.

``train_jax`` runs it on ``jaxmem.model.BlockStack``, ``train_torch`` on ``torch_ref.BlockStack``
(or on the seeds' own ``DecoderLayer``), from the same fixed data (``seed_example_data``);
``parity_tests/test_seed_example.py`` runs both from one set of weights. Run:
``jaxmem seed-example --framework jax --steps 5`` (or ``--framework torch``).

It is one module of the comparison wing because it runs both frameworks; PyTorch is imported
inside ``train_torch`` only, so ``--framework jax`` runs where PyTorch is not installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxmem.config import PRESETS, ModelConfig
from jaxmem.memory.remat import layers_fn
from jaxmem.model import BlockStack
from jaxmem.model.loss import mse_sum
from jaxmem.policy import MemoryPolicy

SEED_CONFIG: ModelConfig = PRESETS["seed"]


def seed_example_data(
    batch: int = 32, seq_len: int = 64, d_model: int = 512, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The example's fixed input and target (``torch.randn`` in the seed; numpy here so both
    frameworks see the same numbers)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq_len, d_model), dtype=np.float32)
    target = rng.standard_normal((batch, seq_len, d_model), dtype=np.float32)
    return x, target


def train(framework: str, steps: int, policy: MemoryPolicy) -> list[float]:
    """The loss before each of ``steps`` Adam steps, in ``framework`` (``jax`` or ``torch``)."""
    run = train_torch if framework == "torch" else train_jax
    return run(steps, policy=policy)


def train_jax(
    steps: int,
    *,
    cfg: ModelConfig = SEED_CONFIG,
    lr: float = 1e-4,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    stack: BlockStack | None = None,
    seed: int = 0,
    policy: MemoryPolicy | None = None,
) -> list[float]:
    """Run the example in JAX for ``steps`` Adam steps; returns the loss before each update.

    ``stack`` gives the initial weights (e.g. a PyTorch run's, loaded with
    ``jaxmem.compare.weights.load_torch_state_dict``); by default a new one from ``seed``.
    ``policy`` applies a memory policy.
    """
    stack = stack if stack is not None else BlockStack(cfg, rngs=nnx.Rngs(seed))
    x, target = data if data is not None else seed_example_data(d_model=cfg.d_model)
    graphdef, params = nnx.split(stack, nnx.Param)
    run_layers = None if policy is None else layers_fn(policy, cfg.n_layers)
    tx = optax.adam(lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, target):
        def loss_fn(p):
            err_sum, n = mse_sum(nnx.merge(graphdef, p)(x, layers_fn=run_layers), target)
            return err_sum / n  # nn.MSELoss(): mean over every element

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x, target = jnp.asarray(x), jnp.asarray(target)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, target)
        losses.append(loss)
    return [float(v) for v in losses]  # one host sync, after the loop


def train_torch(
    steps: int,
    *,
    cfg: ModelConfig = SEED_CONFIG,
    lr: float = 1e-4,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    module: Any = None,
    state_dict: Mapping[str, Any] | None = None,
    policy: MemoryPolicy | None = None,
) -> list[float]:
    """The same loop on torch_ref: Adam on MSE, as in the seed; returns the loss before each
    update. ``module`` (a ``torch.nn.Module``) replaces the block stack (e.g. the seeds' own
    ``DecoderLayer``); ``state_dict`` gives the initial weights."""
    import torch

    from torch_ref.loss import mse_sum as torch_mse_sum
    from torch_ref.model import BlockStack as TorchBlockStack
    from torch_ref.remat import apply_memory_policy

    model = module if module is not None else TorchBlockStack(cfg)
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
        err_sum, n = torch_mse_sum(model(x), target)
        loss = err_sum / n
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return [v.item() for v in losses]

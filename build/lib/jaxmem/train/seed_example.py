"""The seeds' training example (shared/seeds/003) in jaxmem.

One post-norm ReLU decoder layer (d_model 512, 8 heads, d_ff 2048, no causal mask) applied to a
fixed random input ``[32, 64, 512]``, MSE loss against a fixed random target, Adam at lr 1e-4.
``torch_ref.seed_example`` is the same loop in PyTorch; parity tests run both from one set of
weights. Run: ``jaxmem seed-example --framework jax --steps 5``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxmem.config import PRESETS, ModelConfig
from jaxmem.data import seed_example_data
from jaxmem.memory.remat import layers_fn
from jaxmem.model import BlockStack
from jaxmem.model.loss import mse_sum
from jaxmem.policy import MemoryPolicy

SEED_CONFIG: ModelConfig = PRESETS["seed"]


def train(
    steps: int,
    *,
    cfg: ModelConfig = SEED_CONFIG,
    lr: float = 1e-4,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    stack: BlockStack | None = None,
    seed: int = 0,
    policy: MemoryPolicy | None = None,
) -> list[float]:
    """Run the example for ``steps`` Adam steps; returns the loss before each update.

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

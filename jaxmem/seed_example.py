"""The seeds' training example (shared/seeds/003) in jaxmem.

One post-norm ReLU decoder layer (d_model 512, 8 heads, d_ff 2048, no causal mask) applied to a
fixed random input ``[32, 64, 512]``, MSE loss against a fixed random target, Adam at lr 1e-4.
``torch_ref.seed_example`` is the same loop in PyTorch; parity tests run both from one set of
weights. Run: ``python -m jaxmem.seed_example --steps 5``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxmem.config import PRESETS, ModelConfig
from jaxmem.loss import mse_sum
from jaxmem.model import BlockStack
from jaxmem.remat import MemoryPolicy, get_policy, layers_fn
from jaxmem.weights import load_torch_state_dict

SEED_CONFIG: ModelConfig = PRESETS["seed"]


def seed_data(
    batch: int = 32, seq_len: int = 64, d_model: int = 512, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The example's fixed input and target (``torch.randn`` in the seed; numpy here so both
    frameworks see the same numbers)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq_len, d_model), dtype=np.float32)
    target = rng.standard_normal((batch, seq_len, d_model), dtype=np.float32)
    return x, target


def train(
    steps: int,
    *,
    cfg: ModelConfig = SEED_CONFIG,
    lr: float = 1e-4,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    torch_state_dict: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    policy: MemoryPolicy | None = None,
) -> list[float]:
    """Run the example for ``steps`` Adam steps; returns the loss before each update.

    ``torch_state_dict`` (keys ``layers.{i}.…`` of ``torch_ref.BlockStack``) sets the initial
    weights, so a PyTorch run can be reproduced exactly. ``policy`` applies a memory policy.
    """
    stack = BlockStack(cfg, rngs=nnx.Rngs(seed))
    if torch_state_dict is not None:
        load_torch_state_dict(stack, torch_state_dict)
    x, target = data if data is not None else seed_data(d_model=cfg.d_model)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="Adam steps (default 5)")
    parser.add_argument("--policy", default="none", help="memory policy (default none)")
    args = parser.parse_args(argv)
    for i, loss in enumerate(train(args.steps, policy=get_policy(args.policy))):
        print(f"step {i}: mse {loss:.6f}")


if __name__ == "__main__":
    main()

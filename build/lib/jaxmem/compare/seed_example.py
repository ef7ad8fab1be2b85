"""The seeds' training example in either framework, for ``jaxmem seed-example``: the JAX loop
(``jaxmem.train.seed_example``) and the PyTorch one (``torch_ref.seed_example``) from the same
fixed data (``jaxmem.data.seed_example_data``). ``parity_tests`` run both from one set of
weights."""

from __future__ import annotations

from jaxmem.policy import MemoryPolicy
from jaxmem.train import seed_example as jax_seed
from torch_ref import seed_example as torch_seed


def train(framework: str, steps: int, policy: MemoryPolicy) -> list[float]:
    """The loss before each of ``steps`` Adam steps, in ``framework`` (``jax`` or ``torch``)."""
    module = torch_seed if framework == "torch" else jax_seed
    return module.train(steps, policy=policy)

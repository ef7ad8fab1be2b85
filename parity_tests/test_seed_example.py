"""The seeds' own PyTorch DecoderLayer is the outside reference: its checkpoint loads into
torch_ref and jaxmem, all three agree, and the seeds' training example runs in both frameworks
with the same loss curve."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import torch_ref
from jaxmem.compare.tolerances import tolerance
from jaxmem.compare.weights import load_torch_state_dict
from jaxmem.data import seed_example_data
from jaxmem.model import Block, BlockStack
from jaxmem.train import seed_example as jax_seed
from parity_tests.seed_reference import DecoderLayer
from torch_ref import seed_example as torch_seed

SEED_KEYS = {
    "self_attn.in_proj_weight",
    "self_attn.in_proj_bias",
    "self_attn.out_proj.weight",
    "self_attn.out_proj.bias",
    "ffn.0.weight",
    "ffn.0.bias",
    "ffn.2.weight",
    "ffn.2.bias",
    "norm1.weight",
    "norm1.bias",
    "norm2.weight",
    "norm2.bias",
}


def _close(actual, expected, quantity):
    tol = tolerance("float32", quantity)
    np.testing.assert_allclose(actual, expected, rtol=tol.rtol, atol=tol.atol)


def _perturbed_seed_layer() -> DecoderLayer:
    """The seed layer with non-trivial biases and norm affines (its defaults are 0 and 1, which
    would hide a bias or scale mapped to the wrong place)."""
    layer = DecoderLayer()
    with torch.no_grad():
        for p in layer.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return layer


def test_torch_ref_block_has_the_seed_state_dict_keys():
    block = torch_ref.Block(jax_seed.SEED_CONFIG)
    assert set(block.state_dict()) == SEED_KEYS == set(DecoderLayer().state_dict())


def test_seed_checkpoint_loads_into_torch_ref_and_jaxmem_with_same_outputs():
    seed_layer = _perturbed_seed_layer()
    state = seed_layer.state_dict()
    ref_block = torch_ref.Block(jax_seed.SEED_CONFIG)
    ref_block.load_state_dict(state, strict=True)
    jax_block = Block(jax_seed.SEED_CONFIG, rngs=nnx.Rngs(0))
    load_torch_state_dict(jax_block, state, cfg=jax_seed.SEED_CONFIG)

    x = torch.randn(4, 64, 512, requires_grad=True)
    expected = seed_layer(x)
    expected.pow(2).mean().backward()
    x_grad_seed = x.grad.clone()
    x.grad = None
    actual = ref_block(x)
    actual.pow(2).mean().backward()

    _close(actual.detach().numpy(), expected.detach().numpy(), "block_output")
    _close(x.grad.numpy(), x_grad_seed.numpy(), "grads")
    for (name, p_seed), (name_ref, p_ref) in zip(
        seed_layer.named_parameters(), ref_block.named_parameters(), strict=True
    ):
        assert name == name_ref
        _close(p_ref.grad.numpy(), p_seed.grad.numpy(), "grads")

    out_jax = jax_block(jnp.asarray(x.detach().numpy()), None)
    _close(np.asarray(out_jax), expected.detach().numpy(), "block_output")


def jax_stack(state: dict[str, torch.Tensor]) -> BlockStack:
    """A jaxmem BlockStack of the seed config holding a torch_ref BlockStack's weights."""
    stack = BlockStack(jax_seed.SEED_CONFIG, rngs=nnx.Rngs(0))
    load_torch_state_dict(stack, {k: v.numpy() for k, v in state.items()})
    return stack


@pytest.mark.slow
def test_seed_training_example_runs_the_same_in_both_frameworks():
    steps = 3
    data = seed_example_data(batch=8)  # the seed's shape with batch 8 (32 in the write-up)
    seed_layer = _perturbed_seed_layer()
    state = {f"layers.0.{k}": v.clone() for k, v in seed_layer.state_dict().items()}

    losses_seed = torch_seed.train(steps, data=data, module=seed_layer)
    losses_torch = torch_seed.train(steps, data=data, state_dict=state)
    losses_jax = jax_seed.train(steps, data=data, stack=jax_stack(state))
    tol = tolerance("float32", "adamw_loss")
    np.testing.assert_allclose(losses_torch, losses_seed, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(losses_jax, losses_torch, rtol=tol.rtol, atol=tol.atol)
    assert losses_jax[-1] < losses_jax[0]

"""The seeds' own PyTorch DecoderLayer is the outside reference: its checkpoint loads into
torch_ref and jaxmem, all three agree, and the seeds' training example
(``jaxmem.compare.seed_example``) runs in both frameworks with the same loss curve."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

import torch_ref
from jaxmem.compare import seed_example
from jaxmem.compare.seed_example import SEED_CONFIG, seed_example_data
from jaxmem.compare.tolerances import tolerance
from jaxmem.compare.weights import load_torch_state_dict
from jaxmem.model import Block, BlockStack


# The seeds' PyTorch ``DecoderLayer``, verbatim but for formatting (shared/seeds/000 and 003: one
# post-norm ReLU layer over ``nn.MultiheadAttention``): the outside reference torch_ref must
# match; its state dict must load into ``torch_ref.Block`` and ``jaxmem.model.Block`` and give the
# same outputs.
class DecoderLayer(nn.Module):
    def __init__(self, d_model=512, nhead=8):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead)
        self.ffn = nn.Sequential(
            nn.Linear(d_model, d_model * 4), nn.ReLU(), nn.Linear(d_model * 4, d_model)
        )
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x):
        x_attn = x.transpose(0, 1)
        attn_output, _ = self.self_attn(x_attn, x_attn, x_attn)
        attn_output = attn_output.transpose(0, 1)
        x = self.norm1(x + attn_output)
        ffn_output = self.ffn(x)
        x = self.norm2(x + ffn_output)
        return x


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
    block = torch_ref.Block(SEED_CONFIG)
    assert set(block.state_dict()) == SEED_KEYS == set(DecoderLayer().state_dict())


def test_seed_checkpoint_loads_into_torch_ref_and_jaxmem_with_same_outputs():
    seed_layer = _perturbed_seed_layer()
    state = seed_layer.state_dict()
    ref_block = torch_ref.Block(SEED_CONFIG)
    ref_block.load_state_dict(state, strict=True)
    jax_block = Block(SEED_CONFIG, rngs=nnx.Rngs(0))
    load_torch_state_dict(jax_block, state, cfg=SEED_CONFIG)

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
    stack = BlockStack(SEED_CONFIG, rngs=nnx.Rngs(0))
    load_torch_state_dict(stack, {k: v.numpy() for k, v in state.items()})
    return stack


@pytest.mark.slow
def test_seed_training_example_runs_the_same_in_both_frameworks():
    steps = 3
    data = seed_example_data(batch=8)  # the seed's shape with batch 8 (32 in the write-up)
    seed_layer = _perturbed_seed_layer()
    state = {f"layers.0.{k}": v.clone() for k, v in seed_layer.state_dict().items()}

    losses_seed = seed_example.train_torch(steps, data=data, module=seed_layer)
    losses_torch = seed_example.train_torch(steps, data=data, state_dict=state)
    losses_jax = seed_example.train_jax(steps, data=data, stack=jax_stack(state))
    tol = tolerance("float32", "adamw_loss")
    np.testing.assert_allclose(losses_torch, losses_seed, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(losses_jax, losses_torch, rtol=tol.rtol, atol=tol.atol)
    assert losses_jax[-1] < losses_jax[0]

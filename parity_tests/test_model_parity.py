"""Same weights → same logits, loss and every gradient leaf in fp32, for three configurations.
Module by module first (block, stack), then the whole model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import torch_ref
from jaxmem.model import Block, BlockStack, Decoder, causal_mask
from jaxmem.compare.parity import (
    compare_state_dicts,
    jax_loss_and_grads,
    lm_batch,
    tolerance,
    torch_loss_and_grads,
    torch_model_from,
)
from jaxmem.compare.weights import to_torch_state_dict

F32 = "float32"


def _assert_close(actual, expected, quantity):
    tol = tolerance(F32, quantity)
    np.testing.assert_allclose(actual, expected, rtol=tol.rtol, atol=tol.atol)


def _torch_sd(module, cfg=None) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in to_torch_state_dict(module, cfg=cfg).items()}


def test_single_block_output_and_grads(parity_case):
    _, cfg, batch, seq_len = parity_case
    block = Block(cfg, rngs=nnx.Rngs(1))
    torch_block = torch_ref.Block(cfg)
    torch_block.load_state_dict(_torch_sd(block, cfg), strict=True)
    x = np.random.default_rng(2).standard_normal((batch, seq_len, cfg.d_model)).astype(np.float32)
    mask = causal_mask(cfg, seq_len)

    graphdef, params = nnx.split(block, nnx.Param)

    def f(p, x):
        return jnp.mean(jnp.sin(nnx.merge(graphdef, p)(x, mask)))  # non-trivial cotangent

    out_jax = block(jnp.asarray(x), mask)
    grads_p, grads_x = jax.grad(f, argnums=(0, 1))(params, jnp.asarray(x))

    x_t = torch.from_numpy(x).requires_grad_(True)
    mask_t = None if mask is None else torch.from_numpy(np.array(mask))
    out_t = torch_block(x_t, mask_t)
    torch.sin(out_t).mean().backward()

    _assert_close(np.asarray(out_jax), out_t.detach().numpy(), "block_output")
    _assert_close(np.asarray(grads_x), x_t.grad.numpy(), "grads")
    jax_grads = to_torch_state_dict(nnx.merge(graphdef, grads_p), cfg=cfg)
    torch_grads = {k: p.grad.numpy() for k, p in torch_block.named_parameters()}
    diff = compare_state_dicts(jax_grads, torch_grads, tolerance(F32, "grads"))
    assert diff.passed, (
        f"gradient leaves out of tolerance: {diff.failures} (max abs {diff.max_abs})"
    )


def test_block_stack_output(parity_case):
    _, cfg, batch, seq_len = parity_case
    stack = BlockStack(cfg, rngs=nnx.Rngs(3))
    torch_stack = torch_ref.BlockStack(cfg)
    torch_stack.load_state_dict(_torch_sd(stack), strict=True)
    x = np.random.default_rng(4).standard_normal((batch, seq_len, cfg.d_model)).astype(np.float32)
    with torch.no_grad():
        expected = torch_stack(torch.from_numpy(x)).numpy()
    _assert_close(np.asarray(stack(jnp.asarray(x))), expected, "block_output")


def test_decoder_logits_loss_and_every_gradient(parity_case):
    name, cfg, batch, seq_len = parity_case
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    torch_model = torch_model_from(model)
    inputs, targets = lm_batch(cfg, batch, seq_len, seed=5)

    loss_j, logits_j, grads_j = jax_loss_and_grads(model, inputs, targets)
    loss_t, logits_t, grads_t = torch_loss_and_grads(torch_model, inputs, targets)

    assert logits_j.shape == (batch, seq_len, cfg.vocab_size)
    _assert_close(logits_j, logits_t, "logits")
    _assert_close(loss_j, loss_t, "loss")
    assert set(grads_j) == set(grads_t) == set(torch_model.state_dict())
    diff = compare_state_dicts(grads_j, grads_t, tolerance(F32, "grads"))
    print(f"[{name}] max |dgrad| = {diff.max_abs:.3e}, max normwise rel = {diff.max_rel:.3e}")
    assert diff.passed, (
        f"gradient leaves out of tolerance: {diff.failures} (max abs {diff.max_abs})"
    )
    # The comparison is not vacuous: every gradient leaf carries signal.
    assert all(np.abs(g).max() > 1e-6 for g in grads_t.values())


def test_parity_check_detects_a_wrong_weight(parity_case):
    """The comparison fails when one weight differs by 1e-3: the tolerances are not vacuous."""
    _, cfg, batch, seq_len = parity_case
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    torch_model = torch_model_from(model)
    with torch.no_grad():
        torch_model.blocks.layers[-1].ffn[0].weight[0, 0] += 1e-3
    inputs, targets = lm_batch(cfg, batch, seq_len, seed=5)
    _, _, grads_j = jax_loss_and_grads(model, inputs, targets)
    _, _, grads_t = torch_loss_and_grads(torch_model, inputs, targets)
    assert not compare_state_dicts(grads_j, grads_t, tolerance(F32, "grads")).passed

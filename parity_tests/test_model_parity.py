"""Same weights → same logits, loss and every gradient leaf, for every parity configuration
(GPT-2 and the seeds' blocks, odd shapes, Llama and Qwen2 blocks): in float64 (exactness) for all
of them and in fp32 for those without a ReLU (conftest.PARITY_RUNS). Module by module first
(block, stack), then the whole model; the checks tell a wrong weight and a wrong RoPE layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import torch_ref
from jaxmem.compare.parity import (
    dtype_context,
    jax_loss_and_grads,
    model_in,
    torch_loss_and_grads,
    torch_model_from,
)
from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from jaxmem.compare.weights import to_torch_state_dict
from jaxmem.data import lm_batch
from jaxmem.model import Block, BlockStack, Decoder, causal_mask
from jaxmem.model.sequence import rope_tables
from parity_tests.conftest import PARITY_CONFIGS


def _assert_close(actual, expected, dtype, quantity):
    tol = tolerance(dtype, quantity)
    np.testing.assert_allclose(actual, expected, rtol=tol.rtol, atol=tol.atol)


def _torch_sd(module, cfg=None) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in to_torch_state_dict(module, cfg=cfg).items()}


def _in(module_type, cfg, dtype, seed):
    """A jaxmem module stored and computed in ``dtype`` (call inside ``dtype_context``)."""
    dt = jnp.dtype(dtype)
    return module_type(cfg, rngs=nnx.Rngs(seed), dtype=dt, param_dtype=dt)


def _torch_in(module_type, cfg, dtype):
    return module_type(cfg).to(getattr(torch, dtype))


@pytest.mark.slow
def test_single_block_output_and_grads(parity_case):
    _, cfg, batch, seq_len, dtype = parity_case
    x = np.random.default_rng(2).standard_normal((batch, seq_len, cfg.d_model)).astype(dtype)
    with dtype_context(dtype):
        block = _in(Block, cfg, dtype, 1)
        mask = causal_mask(cfg, seq_len)
        rope = rope_tables(cfg, seq_len, jnp.dtype(dtype))  # None without RoPE
        graphdef, params = nnx.split(block, nnx.Param)

        def f(p, x):
            # a non-trivial cotangent
            return jnp.mean(jnp.sin(nnx.merge(graphdef, p)(x, mask, rope)))

        # jitted: one compile each instead of one per eager op (the block's numerics are its
        # program's either way; the tolerance table compares them with torch_ref's)
        out_jax = np.asarray(
            jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, mask, rope))(params, jnp.asarray(x))
        )
        grads_p, grads_x = jax.jit(jax.grad(f, argnums=(0, 1)))(params, jnp.asarray(x))
        jax_grads = to_torch_state_dict(nnx.merge(graphdef, grads_p), cfg=cfg)
        torch_block = _torch_in(torch_ref.Block, cfg, dtype)
        torch_block.load_state_dict(_torch_sd(block, cfg), strict=True)

    x_t = torch.from_numpy(x).requires_grad_(True)
    mask_t = None if mask is None else torch.from_numpy(np.array(mask))
    rope_t = torch_ref.model.rope_tables(cfg, seq_len, x_t.device, x_t.dtype)
    out_t = torch_block(x_t, mask_t, rope_t)
    torch.sin(out_t).mean().backward()

    _assert_close(out_jax, out_t.detach().numpy(), dtype, "block_output")
    _assert_close(np.asarray(grads_x), x_t.grad.numpy(), dtype, "grads")
    torch_grads = {k: p.grad.numpy() for k, p in torch_block.named_parameters()}
    diff = compare_state_dicts(jax_grads, torch_grads, tolerance(dtype, "grads"))
    assert diff.passed, (
        f"gradient leaves out of tolerance: {diff.failures} (max abs {diff.max_abs})"
    )


def test_block_stack_output(parity_case):
    _, cfg, batch, seq_len, dtype = parity_case
    x = np.random.default_rng(4).standard_normal((batch, seq_len, cfg.d_model)).astype(dtype)
    with dtype_context(dtype):
        stack = _in(BlockStack, cfg, dtype, 3)
        actual = np.asarray(stack(jnp.asarray(x)))
        torch_stack = _torch_in(torch_ref.BlockStack, cfg, dtype)
        torch_stack.load_state_dict(_torch_sd(stack), strict=True)
    with torch.no_grad():
        expected = torch_stack(torch.from_numpy(x)).numpy()
    _assert_close(actual, expected, dtype, "block_output")


def _decoder_pair(cfg, dtype):
    with dtype_context(dtype):
        model = model_in(Decoder(cfg, rngs=nnx.Rngs(0)), dtype)
        return model, torch_model_from(model)


@pytest.mark.slow
def test_decoder_logits_loss_and_every_gradient(parity_case):
    name, cfg, batch, seq_len, dtype = parity_case
    model, torch_model = _decoder_pair(cfg, dtype)
    inputs, targets = lm_batch(cfg, batch, seq_len, seed=5)
    with dtype_context(dtype):
        loss_j, logits_j, grads_j = jax_loss_and_grads(model, inputs, targets)
    loss_t, logits_t, grads_t = torch_loss_and_grads(torch_model, inputs, targets)

    assert logits_j.shape == (batch, seq_len, cfg.vocab_size) and logits_j.dtype == dtype
    _assert_close(logits_j, logits_t, dtype, "logits")
    _assert_close(loss_j, loss_t, dtype, "loss")
    assert set(grads_j) == set(grads_t) == set(torch_model.state_dict())
    diff = compare_state_dicts(grads_j, grads_t, tolerance(dtype, "grads"))
    print(f"[{name} {dtype}] max |dgrad| = {diff.max_abs:.3e}, normwise rel {diff.max_rel:.3e}")
    assert diff.passed, (
        f"gradient leaves out of tolerance: {diff.failures} (max abs {diff.max_abs})"
    )
    # The comparison is not vacuous: every gradient leaf carries signal.
    assert all(np.abs(g).max() > 1e-6 for g in grads_t.values())


@pytest.mark.slow
def test_parity_check_detects_a_wrong_weight(parity_case):
    """The comparison fails when one weight differs by 1e-3: the tolerances are not vacuous."""
    _, cfg, batch, seq_len, dtype = parity_case
    model, torch_model = _decoder_pair(cfg, dtype)
    ffn = torch_model.blocks.layers[-1].ffn
    with torch.no_grad():
        (ffn.up if cfg.mlp == "gated" else ffn[0]).weight[0, 0] += 1e-3
    inputs, targets = lm_batch(cfg, batch, seq_len, seed=5)
    with dtype_context(dtype):
        _, _, grads_j = jax_loss_and_grads(model, inputs, targets)
    _, _, grads_t = torch_loss_and_grads(torch_model, inputs, targets)
    assert not compare_state_dicts(grads_j, grads_t, tolerance(dtype, "grads")).passed


def _interleaved_rope(x_bshk, cos_sk, sin_sk):
    """RoPE in Meta's original layout (pairs of adjacent dimensions, gpt-fast's), where jaxmem
    and torch_ref pair dimension i with i + K/2: the layout bug of a checkpoint converted
    without permuting q and k."""
    x = x_bshk.to(cos_sk.dtype)
    half = x.shape[-1] // 2
    cos, sin = cos_sk[:, None, :half], sin_sk[:, None, :half]  # [S, 1, K/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x_bshk.dtype)


@pytest.mark.slow
def test_parity_check_detects_rope_in_the_other_layout(monkeypatch):
    """RoPE in the interleaved layout rotates by the same angles and fails the float64 check."""
    cfg, batch, seq_len = PARITY_CONFIGS["llama_gqa"]
    model, torch_model = _decoder_pair(cfg, "float64")
    inputs, targets = lm_batch(cfg, batch, seq_len, seed=5)
    with dtype_context("float64"):
        _, _, grads_j = jax_loss_and_grads(model, inputs, targets)
    monkeypatch.setattr(torch_ref.model, "apply_rope", _interleaved_rope)
    _, _, grads_t = torch_loss_and_grads(torch_model, inputs, targets)
    diff = compare_state_dicts(grads_j, grads_t, tolerance("float64", "grads"))
    assert not diff.passed and diff.max_rel > 1e3 * tolerance("float64", "grads").rtol

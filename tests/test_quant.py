"""The quantized frozen base: int8 and nf4 packing (``jaxmem.quant``), its dequantization in JAX
(``jaxmem.model.quant``) and PyTorch (``torch_ref.quant``) bit for bit, both against
bitsandbytes, and a backward that keeps no dequantized weight in either framework."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxmem.memory.residuals import saved_residuals
from jaxmem.model.quant import as_jax, dequantize, quantized_matmul
from jaxmem.policy import BASE_WEIGHT
from jaxmem.quant import OFFSET_ULPS, dynamic_code, packed_bytes, quantize, quantize_absmax
from torch_ref import quant as tq

# [out, in]: whole blocks; a last partial block of 64 (126 values); three blocks of 256 absmax
# values, the last one partial (520 blocks of 64). An odd count (a padded last nibble) is
# compared between the frameworks only: bitsandbytes dequantizes it through torch.compile.
SHAPES = [(16, 128), (3, 42), (520, 64)]
KINDS = ("int8", "nf4")


def weight(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 0.05).astype(np.float32)


@pytest.fixture(scope="module")
def packed():
    return {(k, s): quantize(weight(s), k) for k in KINDS for s in [*SHAPES, (3, 7)]}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [*SHAPES, (3, 7)])
def test_jax_and_torch_dequantize_the_same_packed_bytes_bit_for_bit(packed, kind, shape):
    qw = packed[kind, shape]
    torch_fp32 = tq.dequantize(qw, torch.float32).numpy()
    assert torch_fp32.shape == shape
    jitted = jax.jit(dequantize, static_argnums=1)
    np.testing.assert_array_equal(np.asarray(jitted(as_jax(qw), jnp.float32)), torch_fp32)
    # wider outputs are the same fp32 values, cast once
    with jax.enable_x64(True):
        np.testing.assert_array_equal(
            np.asarray(jitted(as_jax(qw), jnp.float64)), tq.dequantize(qw, torch.float64)
        )


def test_bad_weights_and_kinds_are_refused():
    for bad, kind in ((np.zeros(8, np.float32), "nf4"), (np.zeros((2, 2), np.int32), "int8")):
        with pytest.raises(ValueError, match=r"float \[out, in\] weight"):
            quantize(bad, kind)
    with pytest.raises(ValueError, match="'int4' is not one of"):
        quantize(np.zeros((2, 2), np.float32), "int4")


# ------------------------------------------------------------------------------ bitsandbytes
@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_packs_and_dequantizes_as_bitsandbytes(shape):
    """bitsandbytes' own nf4 arrays dequantize to its values exactly; our packing equals its
    bytes and 8-bit statistics exactly, the mean offset within ``OFFSET_ULPS`` (torch's fp32
    ``mean()`` sums in its own order; ours is the float64 mean rounded once)."""
    bnb = pytest.importorskip(
        "bitsandbytes.functional",
        reason="bitsandbytes: the adapters and dev extras (make test installs it)",
    )
    w = torch.from_numpy(weight(shape))
    bnb_packed, state = bnb.quantize_4bit(
        w, blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    theirs = tq.from_bitsandbytes_nf4(bnb_packed, state)
    expected = bnb.dequantize_4bit(bnb_packed, state).numpy()
    np.testing.assert_array_equal(tq.dequantize(theirs).numpy(), expected)
    np.testing.assert_array_equal(np.asarray(dequantize(as_jax(theirs))), expected)

    ours = quantize(w.numpy(), "nf4")
    np.testing.assert_array_equal(ours.packed, theirs.packed)
    offset_ulps = ours.absmax_offset.view(np.int32) - theirs.absmax_offset.view(np.int32)
    assert abs(int(offset_ulps)) <= OFFSET_ULPS
    _, raw = bnb.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
    codes, scales = quantize_absmax(raw.absmax.numpy(), theirs.absmax_offset)
    np.testing.assert_array_equal(codes, theirs.absmax)
    np.testing.assert_array_equal(scales, theirs.absmax_scale)
    # the bytes: ours, the arrays', and bitsandbytes' data (not its per-layer code tables)
    bnb_bytes = sum(
        t.numel() * t.element_size()
        for t in (bnb_packed, state.absmax, state.state2.absmax, state.offset)
    )
    assert ours.nbytes == packed_bytes("nf4", *shape) == bnb_bytes


def test_the_8_bit_statistics_code_is_bitsandbytes_own():
    """The dynamic code, and values coded by bitsandbytes' CPU blockwise kernel, densely over
    [-1, 1] and near zero (where its steps are finest), in blocks of 256 with a partial one."""
    bnb = pytest.importorskip(
        "bitsandbytes.functional",
        reason="bitsandbytes: the adapters and dev extras (make test installs it)",
    )
    np.testing.assert_array_equal(dynamic_code(), bnb.create_dynamic_map().numpy())
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-1, 1, 20_000), rng.uniform(-0.01, 0.01, 10_000)])
    x = x[:-17].astype(np.float32)
    codes, state = bnb.quantize_blockwise(torch.from_numpy(x.copy()), blocksize=256)
    ours, scales = quantize_absmax(x, np.float32(0.0))
    np.testing.assert_array_equal(ours, codes.numpy())
    np.testing.assert_array_equal(scales, state.absmax.numpy())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_int8_packs_and_dequantizes_as_bitsandbytes(shape, dtype):
    bnb = pytest.importorskip(
        "bitsandbytes.functional",
        reason="bitsandbytes: the adapters and dev extras (make test installs it)",
    )
    w = torch.from_numpy(weight(shape)).to(dtype)
    cb, scb, _ = bnb.int8_vectorwise_quant(w.clone())
    ours = quantize(w.numpy(), "int8")
    np.testing.assert_array_equal(ours.packed, cb.numpy())
    np.testing.assert_array_equal(ours.absmax, scb.numpy())
    expected = bnb.int8_vectorwise_dequant(cb, scb).numpy()
    np.testing.assert_array_equal(tq.dequantize(tq.from_bitsandbytes_int8(cb, scb)), expected)
    np.testing.assert_array_equal(np.asarray(dequantize(as_jax(ours))), expected)
    assert ours.nbytes == packed_bytes("int8", *shape) == cb.numel() + 4 * scb.numel()


def test_a_zero_row_packs_to_zeros():
    w = weight((4, 64))
    w[1] = 0.0
    for kind in KINDS:
        assert not tq.dequantize(quantize(w, kind))[1].any()


# --------------------------------------------------------------------- the backward, in JAX
OUTER = {
    "no outer checkpoint": None,
    "everything saveable": jax.checkpoint_policies.everything_saveable,
    "dots saveable": jax.checkpoint_policies.dots_saveable,
}


def _loss(policy, policy_decides=False):
    def f(x, qw):
        y = quantized_matmul(x, qw, jnp.float32, policy_decides=policy_decides)
        return jnp.sum(jnp.sin(y))

    return f if policy is None else jax.checkpoint(f, policy=policy)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("outer", list(OUTER))
def test_the_vjp_keeps_no_dequantized_weight_and_its_gradient_is_the_plain_one(packed, kind, outer):
    qw = as_jax(packed[kind, (16, 128)])
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 128)), jnp.float32)
    loss = _loss(OUTER[outer])
    residuals = saved_residuals(loss, x, qw)
    weight_bytes = 16 * 128 * 4
    assert not [r for r in residuals if r.nbytes >= weight_bytes and r.dtype == "float32"]
    assert not [r for r in residuals if r.name == BASE_WEIGHT]

    def plain(x):
        w = dequantize(qw)
        return jnp.sum(jnp.sin(jnp.einsum("...i,oi->...o", x, w)))

    np.testing.assert_array_equal(jax.grad(loss)(x, qw), jax.grad(plain)(x))


def test_when_the_policy_decides_it_keeps_or_recomputes_the_tagged_weight(packed):
    qw = as_jax(packed["nf4", (16, 128)])
    x = jnp.ones((2, 128), jnp.float32)
    keep = jax.checkpoint_policies.save_only_these_names(BASE_WEIGHT)
    for policy, kept in ((None, [(16, 128)]), (keep, [(16, 128)]), (OUTER["dots saveable"], [])):
        residuals = saved_residuals(_loss(policy, policy_decides=True), x, qw)
        assert [r.shape for r in residuals if r.name == BASE_WEIGHT] == kept


# ------------------------------------------------------------------ the backward, in PyTorch
@pytest.mark.parametrize("kind", KINDS)
def test_torch_saves_only_the_packed_buffers_and_its_gradient_is_the_plain_one(packed, kind):
    qw = packed[kind, (16, 128)]
    layer = tq.QuantizedLinear(qw)
    assert not list(layer.parameters())
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((2, 5, 128))).float()
    x.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    buffers = {b.data_ptr() for b in layer.buffers()}
    assert saved and all(t.data_ptr() in buffers for t in saved)
    assert not [t for t in saved if t.is_floating_point() and t.numel() >= 16 * 128]
    g = torch.sin(y.detach())
    y.backward(g)
    plain_x = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(plain_x, tq.dequantize(qw)).backward(g)
    np.testing.assert_array_equal(x.grad.numpy(), plain_x.grad.numpy())


def test_bitsandbytes_matmul_4bit_agrees_on_the_same_packed_bytes(packed):
    """bitsandbytes' own 4-bit linear (``matmul_4bit``, forward and backward on CPU) over the
    arrays jaxmem packed gives torch_ref's output and input gradient exactly."""
    bnb = pytest.importorskip(
        "bitsandbytes",
        reason="bitsandbytes: the adapters and dev extras (make test installs it)",
    )
    qw = packed["nf4", (16, 128)]
    _, state = bnb.functional.quantize_4bit(
        torch.zeros(16, 128), blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    arrays = tq.tensors(qw)
    state.absmax, state.state2.absmax, state.offset = (
        arrays["absmax"],
        arrays["absmax_scale"],
        arrays["absmax_offset"],
    )
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((4, 128))).float()
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    theirs = bnb.matmul_4bit(xs[0], arrays["packed"].reshape(-1, 1), state)
    ours = tq.QuantizedLinear(qw)(xs[1])
    np.testing.assert_array_equal(theirs.detach().numpy(), ours.detach().numpy())
    theirs.backward(torch.ones_like(theirs))
    ours.backward(torch.ones_like(ours))
    np.testing.assert_array_equal(xs[0].grad.numpy(), xs[1].grad.numpy())

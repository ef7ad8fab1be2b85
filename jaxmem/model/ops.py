"""Elementwise ops with memory-lean gradients.

Plain JAX autodiff of LayerNorm, softmax and GELU keeps several intermediates per call for the
backward pass (centred input, normalised input, products with the scale; softmax's exponentials
next to its output; GELU's erfc/exp factors): about twice what PyTorch's fused kernels keep.
These ``custom_vjp`` versions keep what the PyTorch kernels keep — LayerNorm its input and the
per-row mean and 1/std, softmax its output, GELU its input, ReLU its output (``jax.nn.relu``
keeps its input, which nothing else reads after the MLP's first matmul) — and recompute the rest
in the backward pass (elementwise work only; matmul FLOPs are unchanged). Written by hand because no
library provides them for arbitrary JAX programs.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array


def wide(dtype: Any) -> Any:
    """The dtype norms, softmax, logits and the loss run in: float32, or wider when the compute
    dtype is (float64 in the parity suite's exactness mode)."""
    return jnp.promote_types(dtype, jnp.float32)


# ------------------------------------------------------------------------------------- LayerNorm
@partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x: Array, scale: Array, bias: Array | None, eps: float) -> Array:
    """LayerNorm over the last axis, computed in ``wide(x.dtype)`` (fp32 for 16-bit inputs), and
    returned in that dtype."""
    y, _ = _layer_norm_fwd(x, scale, bias, eps)
    return y


def _stats(x32: Array, eps: float) -> tuple[Array, Array]:
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return mean, jax.lax.rsqrt(var + eps)


def _layer_norm_fwd(x, scale, bias, eps):
    x32 = x.astype(wide(x.dtype))
    mean, rstd = _stats(x32, eps)
    y = (x32 - mean) * rstd * scale.astype(x32.dtype)
    if bias is not None:
        y = y + bias.astype(x32.dtype)
    # Keep the input in its own dtype (it is usually a tensor kept anyway) and two [..., 1] stats.
    return y, (x, mean, rstd, scale, bias)


def _layer_norm_bwd(eps, residuals, g):
    x, mean, rstd, scale, bias = residuals
    acc = wide(x.dtype)
    xhat = (x.astype(acc) - mean) * rstd
    g = g.astype(acc)
    dxhat = g * scale.astype(acc)
    dx = rstd * (
        dxhat
        - jnp.mean(dxhat, axis=-1, keepdims=True)
        - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True)
    )
    reduce_axes = tuple(range(g.ndim - 1))
    dscale = jnp.sum(g * xhat, axis=reduce_axes).astype(scale.dtype)
    dbias = None if bias is None else jnp.sum(g, axis=reduce_axes).astype(bias.dtype)
    return dx.astype(x.dtype), dscale, dbias


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


# --------------------------------------------------------------------------------------- softmax
@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def softmax(x: Array, out_dtype: Any, tag: str | None = None) -> Array:
    """Softmax over the last axis in ``x``'s dtype, tagged ``tag``, then cast to ``out_dtype``.

    The backward keeps only the (tagged) output. Tagging inside lets the kept output and the
    tagged probabilities be one tensor (tagging outside would make them two tensors, and a scan
    would keep both)."""
    return _softmax_fwd(x, out_dtype, tag)[0]


def _softmax_fwd(x, out_dtype, tag):
    y = jax.nn.softmax(x, axis=-1)
    if tag is not None:
        y = checkpoint_name(y, tag)  # the softmax output itself, as PyTorch's _softmax op
    out = y.astype(out_dtype)  # no-op when the dtypes agree: then out and y are one tensor
    return out, y


def _softmax_bwd(out_dtype, tag, y, g):
    g = g.astype(y.dtype)
    return ((y * (g - jnp.sum(g * y, axis=-1, keepdims=True))),)


softmax.defvjp(_softmax_fwd, _softmax_bwd)


# ------------------------------------------------------------------------------------------ GELU
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gelu(x: Array, approximate: bool) -> Array:
    """GELU (exact erf form, or tanh approximation), computed in ``wide(x.dtype)`` and cast back
    to ``x``'s dtype; the backward keeps only the input."""
    return _gelu_wide(x.astype(wide(x.dtype)), approximate).astype(x.dtype)


def _gelu_wide(x, approximate):
    if approximate:
        return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + jax.lax.erf(x * _INV_SQRT_2))


def _gelu_fwd(x, approximate):
    return gelu(x, approximate), x


def _gelu_bwd(approximate, x, g):
    x32 = x.astype(wide(x.dtype))
    if approximate:
        inner = _SQRT_2_OVER_PI * (x32 + 0.044715 * x32**3)
        t = jnp.tanh(inner)
        d = 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3 * 0.044715 * x32 * x32
        )
    else:
        cdf = 0.5 * (1.0 + jax.lax.erf(x32 * _INV_SQRT_2))
        pdf = jnp.exp(-0.5 * x32 * x32) * _INV_SQRT_2PI
        d = cdf + x32 * pdf
    return ((g.astype(x32.dtype) * d).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


# ------------------------------------------------------------------------------------------ ReLU
@partial(jax.custom_vjp, nondiff_argnums=(1,))
def relu(x: Array, tag: str | None = None) -> Array:
    """ReLU, tagged ``tag``; the backward keeps only the (tagged) output, as PyTorch's
    ``threshold_backward`` does: ``y > 0`` exactly where ``x > 0``. Tagged inside for the reason
    ``softmax`` is: the kept output and the tagged activation must be one tensor."""
    return _relu_fwd(x, tag)[0]


def _relu_fwd(x, tag):
    y = jnp.maximum(x, jnp.zeros((), x.dtype))
    if tag is not None:
        y = checkpoint_name(y, tag)
    return y, y


def _relu_bwd(tag, y, g):
    return (jnp.where(y > 0, g, jnp.zeros((), g.dtype)),)


relu.defvjp(_relu_fwd, _relu_bwd)


# --------------------------------------------------------------------------------------- RMSNorm
@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """RMSNorm over the last axis (Zhang & Sennrich 2019; Llama's): ``x / rms(x) * scale``,
    computed in ``wide(x.dtype)`` and returned in that dtype. The backward keeps the input and
    the per-row 1/rms, as ``layer_norm`` keeps its statistics."""
    return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
    x32 = x.astype(wide(x.dtype))
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return x32 * rstd * scale.astype(x32.dtype), (x, rstd, scale)


def _rms_norm_bwd(eps, residuals, g):
    x, rstd, scale = residuals
    acc = wide(x.dtype)
    xhat = x.astype(acc) * rstd
    g = g.astype(acc)
    dxhat = g * scale.astype(acc)
    dx = rstd * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
    dscale = jnp.sum(g * xhat, axis=tuple(range(g.ndim - 1))).astype(scale.dtype)
    return dx.astype(x.dtype), dscale


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


# ------------------------------------------------------------------------------------ gated MLP
_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: _gelu_wide(x, False),
    "gelu_tanh": lambda x: _gelu_wide(x, True),
    "relu": jax.nn.relu,
}


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def gated(gate: Array, up: Array, activation: str) -> Array:
    """A gated MLP's product ``act(gate) * up`` (SwiGLU with ``silu``, Shazeer 2020), computed in
    ``wide`` and cast to ``gate``'s dtype. The backward keeps gate and up only and recomputes
    ``act(gate)``: plain autodiff (and PyTorch's ``F.silu(g) * u``) also keeps ``act(gate)``, a
    third ``[B, S, F]`` tensor, for the product's backward."""
    return _gated_fwd(gate, up, activation)[0]


def _gated_fwd(gate, up, activation):
    acc = wide(gate.dtype)
    out = _ACTIVATIONS[activation](gate.astype(acc)) * up.astype(acc)
    return out.astype(gate.dtype), (gate, up)


def _gated_bwd(activation, residuals, g):
    gate, up = residuals
    acc = wide(gate.dtype)
    act, act_vjp = jax.vjp(_ACTIVATIONS[activation], gate.astype(acc))
    g = g.astype(acc)
    (dgate,) = act_vjp(g * up.astype(acc))
    return dgate.astype(gate.dtype), (g * act).astype(up.dtype)


gated.defvjp(_gated_fwd, _gated_bwd)


# ------------------------------------------------------------------------------------------ RoPE
def rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotary position embedding of ``x`` (``[B, S, heads..., K]``: ``[B, S, H, K]``, or
    grouped ``[B, S, Hkv, G, K]``) in the rotate-half layout (Hugging Face Llama's: the pairs
    are dimensions i and i + K/2), ``cos``/``sin`` ``[S, K]``, computed in their (wide) dtype
    and cast back to ``x``'s. Its backward keeps nothing of ``x``: a rotation by constant
    angles."""
    acc = cos.dtype
    x32 = x.astype(acc)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    shape = (1, cos.shape[0]) + (1,) * (x.ndim - 3) + (cos.shape[1],)
    return (x32 * cos.reshape(shape) + rotated * sin.reshape(shape)).astype(x.dtype)

"""A quantized frozen base in JAX: dequantization in jnp ops, and a linear that re-dequantizes.

``jaxmem.quant`` packs a weight (``int8``, ``nf4``; numpy, shared with ``torch_ref.quant``);
here ``dequantize`` unpacks it with a table lookup and multiplies in fp32, cast once at the end,
bit for bit what ``torch_ref.quant`` and bitsandbytes compute from the same arrays, and
``quantized_matmul`` applies it as a linear layer, ``x @ W^T``.

The backward never keeps the dequantized weight: ``quantized_matmul`` is a ``jax.custom_vjp``
whose residuals are the packed arrays; its backward dequantizes again for the input's gradient,
whatever policy an outer ``jax.checkpoint`` applies. The dequantized weight is tagged
``base_weight`` (``jaxmem.policy.BASE_WEIGHT``); with ``policy_decides=True`` it is an ordinary
intermediate the surrounding policy keeps or recomputes by that name (one full-size weight per
layer, traded for one dequantization in the backward). The base is frozen: the packed arrays
get no gradient.

Importing this module registers ``jaxmem.quant.QuantizedWeight`` as a pytree (``kind`` and
``shape`` static, the arrays its leaves).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxmem.adapters import NF4_BLOCK, NF4_STATS_BLOCK
from jaxmem.model.ops import wide
from jaxmem.policy import BASE_WEIGHT
from jaxmem.quant import INT8_RECIPROCAL, NF4_CODE, QuantizedWeight, dynamic_code

Array = jax.Array

jax.tree_util.register_dataclass(
    QuantizedWeight,
    data_fields=["packed", "absmax", "absmax_scale", "absmax_offset"],
    meta_fields=["kind", "shape"],
)


def as_jax(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` with its numpy arrays as JAX arrays (same dtypes, same bits)."""
    return jax.tree.map(jnp.asarray, qw)


def _blockwise(values: Array, scales: Array, block: int) -> Array:
    """``values[i] * scales[i // block]`` in fp32 (a shorter last block allowed)."""
    n = values.shape[0]
    padded = jnp.pad(values, (0, scales.shape[0] * block - n))
    return (padded.reshape(-1, block) * scales[:, None]).reshape(-1)[:n]


def dequantize(qw: QuantizedWeight, dtype: Any = jnp.float32) -> Array:
    """The ``[out, in]`` weight ``qw`` packs, computed in fp32 and cast once to ``dtype``."""
    if qw.kind == "int8":
        rows = qw.packed.astype(jnp.float32) * qw.absmax[:, None]
        return (rows * jnp.float32(INT8_RECIPROCAL)).astype(dtype)
    if qw.kind != "nf4":
        raise ValueError(f"QuantizedWeight.kind={qw.kind!r} is not int8 or nf4")
    out, in_ = qw.shape
    # the block absmax values: 8-bit dynamic code times its block's scale, plus the mean
    stats = jnp.asarray(dynamic_code())[qw.absmax.astype(jnp.int32)]
    absmax = _blockwise(stats, qw.absmax_scale, NF4_STATS_BLOCK) + qw.absmax_offset
    # two 4-bit indices a byte, the first in the high nibble
    idx = jnp.stack([qw.packed >> 4, qw.packed & 0x0F], axis=-1).reshape(-1)[: out * in_]
    values = jnp.asarray(NF4_CODE)[idx.astype(jnp.int32)]
    return _blockwise(values, absmax, NF4_BLOCK).reshape(out, in_).astype(dtype)


def quantized_matmul(
    x: Array, qw: QuantizedWeight, dtype: Any, *, policy_decides: bool = False
) -> Array:
    """``x @ W^T`` for the ``[out, in]`` weight ``qw`` packs: ``x`` ``[..., in]`` →
    ``[..., out]``, multiplied in ``dtype`` and accumulated in fp32 (or wider), as jaxmem's
    linear layers do (callers cast the result).

    Default: a ``jax.custom_vjp`` whose residuals are the packed arrays; the backward
    dequantizes again for ``x``'s gradient, under any outer ``jax.checkpoint`` policy (a nested
    checkpoint would not do: an outer ``everything_saveable`` keeps what an inner policy drops).
    ``policy_decides=True``: plain autodiff, the weight an ordinary intermediate tagged
    ``base_weight`` that the surrounding policy keeps (no policy: kept) or recomputes."""
    if policy_decides:
        return _matmul(x.astype(dtype), _tagged_weight(qw, dtype), dtype)
    return _redequantized(x.astype(dtype), qw, dtype)


def _tagged_weight(qw: QuantizedWeight, dtype: Any) -> Array:
    return checkpoint_name(dequantize(qw, dtype), BASE_WEIGHT)  # [out, in]


def _matmul(x: Array, w: Array, dtype: Any) -> Array:
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=wide(dtype))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _redequantized(x: Array, qw: QuantizedWeight, dtype: Any) -> Array:
    return _matmul(x, _tagged_weight(qw, dtype), dtype)


def _redequantized_fwd(x: Array, qw: QuantizedWeight, dtype: Any) -> tuple[Array, Any]:
    return _matmul(x, _tagged_weight(qw, dtype), dtype), qw


def _redequantized_bwd(dtype: Any, qw: QuantizedWeight, g: Array) -> tuple[Array, Any]:
    w = dequantize(qw, dtype)  # again, from the packed arrays
    x_like = jax.ShapeDtypeStruct((*g.shape[:-1], qw.shape[1]), w.dtype)
    # the matmul's own transpose: the x-gradient plain autodiff computes, op for op
    (grad_x,) = jax.linear_transpose(lambda x: _matmul(x, w, dtype), x_like)(g)
    # the frozen base gets none (float0 for the integer arrays, zeros for int8's fp32 absmax)
    frozen = jax.tree.map(
        lambda a: (
            np.zeros(a.shape, jax.dtypes.float0)
            if jnp.issubdtype(a.dtype, jnp.integer)
            else jnp.zeros_like(a)
        ),
        qw,
    )
    return grad_x, frozen


_redequantized.defvjp(_redequantized_fwd, _redequantized_bwd)

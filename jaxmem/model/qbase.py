"""The decoder's frozen block projections stored packed (``--quantize-base int8|nf4``).

``quantize_base`` replaces, in a built ``Decoder``, every block projection's ``nnx.Linear``
(``in_proj``, ``out_proj``, the MLP's ``up``, ``down``, ``gate``) by a ``QuantizedLinear``
holding the same weights packed (``jaxmem.quant``), one ``QuantizedPart`` per projection of a
Hugging Face Llama (``in_proj`` as three: q, k and v, each packed separately, as bitsandbytes
packs ``q_proj``, ``k_proj``, ``v_proj``). Biases, embeddings, the head and the norms stay in
the parameter dtype. The packed arrays are ``PackedBase`` variables, stacked over the layers as
every block parameter is (a leading L axis), so the scan slices them like the rest.

``PackedBase`` is an ``nnx.Param`` (the step's one parameter tree holds it, so checkpoints save
and restore it) that no adapter filter selects: it never trains. A projection computes
``x @ dequantize(W)`` with ``jaxmem.model.quant.quantized_matmul``, whose backward keeps only the
packed arrays whatever the memory policy.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmem.adapters import NF4_BLOCK
from jaxmem.model.quant import dequantize, quantized_matmul
from jaxmem.quant import NF4_CODE, QuantizedWeight, packed_shapes, quantize, quantize_absmax

Array = jax.Array
FIELDS = ("packed", "absmax", "absmax_scale", "absmax_offset")
# the midpoints between the NF4 code values a scaled weight is sorted by (jaxmem.quant's rule)
NF4_BOUNDS = (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2.0)


class PackedBase(nnx.Param):
    """A packed array of a quantized frozen weight (integer or fp32 statistics): frozen."""


class QuantizedPart(nnx.Module):
    """One projection's ``[out, in]`` weight, packed as ``kind`` (arrays per ``FIELDS``)."""

    def __init__(self, kind: str, shape: tuple[int, int], arrays: dict[str, Any]):
        self.kind, self.shape = kind, shape
        for name in FIELDS:
            value = arrays.get(name)
            setattr(self, name, None if value is None else PackedBase(value))

    def weight(self) -> QuantizedWeight:
        arrays = {n: None if getattr(self, n) is None else getattr(self, n)[...] for n in FIELDS}
        return QuantizedWeight(kind=self.kind, shape=self.shape, **arrays)

    def __call__(self, x: Array, dtype: Any) -> Array:
        return quantized_matmul(x, self.weight(), dtype)


class QuantizedLinear(nnx.Module):
    """A linear layer over packed parts (their outputs side by side), the bias in the
    parameter dtype: ``nnx.Linear``'s output (wide, the bias cast to the compute dtype)."""

    def __init__(self, parts: dict[str, QuantizedPart], bias: Any, dtype: Any):
        self.names = tuple(parts)
        for name, part in parts.items():
            setattr(self, name, part)
        self.bias = bias
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        ys = [getattr(self, n)(x, self.dtype) for n in self.names]
        y = ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=-1)
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


def _packed_stack(kernel: Any, kind: str, abstract: bool) -> tuple[tuple[int, int], dict]:
    """The ``[L, in, out]`` kernel packed layer by layer as ``kind`` (each layer's weight
    ``[out, in]``, as PyTorch stores it), the arrays stacked on a leading L axis; shapes only
    (``jaxmem.quant.packed_shapes``, nothing packed) for an ``abstract`` kernel."""
    n_layers, d_in, d_out = kernel.shape
    shape = (int(d_out), int(d_in))
    if abstract:
        return shape, {
            n: jax.ShapeDtypeStruct((n_layers, *s), jnp.dtype(d))
            for n, (s, d) in packed_shapes(kind, *shape).items()
        }
    if kind == "int8" and all(d.platform == "cpu" for d in kernel.devices()):
        # the CPU backend's int8 packs faster with numpy (2 Llama-3.2-1B layers: 1.4 s, 5.3 s
        # under jit, which compiles each shape; nf4 is faster under jit: 7.1 s against 10.7 s)
        host = np.asarray(jax.device_get(kernel), dtype=np.float32)
        packed = [quantize(host[i].T, kind) for i in range(n_layers)]
        return shape, {
            n: jnp.asarray(np.stack([getattr(q, n) for q in packed])) for n in FIELDS[:2]
        }
    layers = [pack_layer(kernel[i].T, kind) for i in range(n_layers)]
    return shape, {n: jnp.stack([q[n] for q in layers]) for n in layers[0]}


def pack_layer(weight: Array, kind: str) -> dict[str, Array]:
    """One ``[out, in]`` weight packed as ``kind`` where it lies (on the device), with the bytes
    ``jaxmem.quant.quantize`` gives (bitsandbytes'): the scaling and the 4-bit indices, or the
    int8 rows, in the same fp32 operations under ``jit`` (XLA flushes subnormal fp32 values to
    zero where numpy keeps them: a weight under 1.2e-38 in magnitude may pack apart); nf4's
    block absmax values then come to the host for the double quantization
    (``jaxmem.quant.quantize_absmax``, one value per 64 weights). A weight whose size the nf4
    block does not divide is packed on the host."""
    n = weight.shape[0] * weight.shape[1]
    if kind == "nf4" and n % NF4_BLOCK:
        host = quantize(np.asarray(jax.device_get(weight), np.float32), kind)
        return {f: jnp.asarray(getattr(host, f)) for f in FIELDS if getattr(host, f) is not None}
    arrays = _pack_on_device(weight, kind)
    if kind == "int8":
        return arrays
    absmax = np.asarray(jax.device_get(arrays.pop("absmax")))
    offset = np.float32(absmax.astype(np.float64).mean())  # as jaxmem.quant.quantize
    codes, scales = quantize_absmax(absmax, offset)
    return arrays | {
        "absmax": jnp.asarray(codes),
        "absmax_scale": jnp.asarray(scales),
        "absmax_offset": jnp.asarray(offset, jnp.float32),
    }


@partial(jax.jit, static_argnames="kind")
def _pack_on_device(weight: Array, kind: str) -> dict[str, Array]:
    """``jaxmem.quant``'s ``_int8_rows`` and ``_nf4_blocks`` (whole blocks) in jnp ops."""
    w = weight.astype(jnp.float32)
    if kind == "int8":
        absmax = jnp.abs(w).max(axis=1)  # [out]
        recip = jnp.where(absmax > 0, jnp.float32(1.0) / absmax, jnp.float32(0.0))
        q = jnp.round(w * (recip * jnp.float32(127.0))[:, None]).astype(jnp.int8)
        return {"packed": q, "absmax": absmax}
    blocks = w.reshape(-1, NF4_BLOCK)
    absmax = jnp.abs(blocks).max(axis=1)  # [blocks]
    # a block of zeros scales by 0, not numpy's 1 / 1e-38 (XLA flushes that subnormal to 0;
    # both give the index of 0)
    inv = jnp.where(absmax > 0, jnp.float32(1.0) / absmax, jnp.float32(0.0))
    scaled = jnp.clip(blocks * inv[:, None], -1.0, 1.0).reshape(-1)
    # numpy's searchsorted(side="left"): how many midpoints lie below (one fused compare-and-sum,
    # ~15x faster on XLA:CPU than jnp.searchsorted's loop)
    idx = (scaled[:, None] > jnp.asarray(NF4_BOUNDS)).sum(axis=-1).astype(jnp.uint8)
    return {"packed": (idx[0::2] << 4) | idx[1::2], "absmax": absmax}


def _quantized(linear: nnx.Linear, kind: str, splits: dict[str, tuple[int, int]], dtype: Any):
    kernel = linear.kernel.get_value()  # [L, in, out]
    abstract = isinstance(kernel, jax.ShapeDtypeStruct)
    parts = {}
    for name, (lo, hi) in splits.items():
        cols = (
            jax.ShapeDtypeStruct((*kernel.shape[:2], hi - lo), kernel.dtype)
            if abstract
            else kernel[..., lo:hi]
        )
        shape, arrays = _packed_stack(cols, kind, abstract)
        parts[name] = QuantizedPart(kind, shape, arrays)
    return QuantizedLinear(parts, linear.bias, dtype)


def quantize_base(model: Any, kind: str) -> Any:
    """``model`` (a ``Decoder``, arrays or shapes) with its block projections packed as
    ``kind`` (``int8``, ``nf4``), in place; returned for convenience."""
    layers = model.blocks.layers
    if isinstance(layers.self_attn.in_proj, QuantizedLinear):
        return model  # already packed
    cfg, dtype = model.cfg, model.dtype
    d, kv = cfg.d_model, cfg.kv_dim
    attn, ffn = layers.self_attn, layers.ffn
    qkv = {"q": (0, d), "k": (d, d + kv), "v": (d + kv, d + 2 * kv)}
    attn.in_proj = _quantized(attn.in_proj, kind, qkv, dtype)
    attn.out_proj = _quantized(attn.out_proj, kind, {"w": (0, d)}, dtype)
    for name in ("gate", "up", "down") if ffn.gated else ("up", "down"):
        width = getattr(ffn, name).kernel.shape[-1]
        setattr(ffn, name, _quantized(getattr(ffn, name), kind, {"w": (0, width)}, dtype))
    return model


def packed_param_bytes(params: Any) -> int:
    """The bytes the ``PackedBase`` arrays of ``params`` (an ``nnx.State``) hold."""
    leaves = jax.tree_util.tree_leaves(params.filter(PackedBase))
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)


def dense_arrays(model: Any) -> dict[tuple[str, ...], np.ndarray]:
    """Every parameter of ``model`` (a ``Decoder`` whose base ``quantize_base`` packed) as
    ``path -> numpy array``, each packed projection replaced by its dequantized kernel under
    ``nnx.Linear``'s path (``blocks.layers.self_attn.in_proj.kernel`` ``[L, in, out]``, the
    parts side by side) in float32: the weights the packed base computes with (what ``jaxmem
    export --merge`` adds the adapters to). Adapters and every other parameter as they are."""
    state = nnx.state(model, nnx.Param)
    flat = {tuple(str(k) for k in p): v for p, v in nnx.to_flat_state(state)}
    out = {p: np.asarray(v[...]) for p, v in flat.items() if not isinstance(v, PackedBase)}
    layers = model.blocks.layers
    linears = {("self_attn", n): getattr(layers.self_attn, n) for n in ("in_proj", "out_proj")}
    linears |= {("ffn", n): getattr(layers.ffn, n, None) for n in ("gate", "up", "down")}
    for where, linear in linears.items():
        if not isinstance(linear, QuantizedLinear):
            continue
        columns = []
        for name in linear.names:
            qw = getattr(linear, name).weight()  # arrays stacked on a leading L axis
            n_layers = qw.packed.shape[0]
            one = [dequantize(jax.tree.map(lambda a, i=i: a[i], qw)).T for i in range(n_layers)]
            columns.append(jnp.stack(one))  # [L, in, part]
        out[("blocks", "layers", *where, "kernel")] = np.asarray(jnp.concatenate(columns, -1))
    return out

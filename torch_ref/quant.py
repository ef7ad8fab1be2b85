"""A quantized frozen base in PyTorch: the same dequantization as ``jaxmem.model.quant`` in
torch ops, and a frozen linear layer whose backward re-dequantizes.

The packed arrays are ``jaxmem.quant``'s (``int8``, ``nf4``: bitsandbytes' formats), so both
frameworks dequantize the same bytes to the same fp32 values (``dequantize``: a table lookup and
multiplies in fp32, cast once at the end).

``QuantizedLinear`` holds them as buffers; its autograd function (``QuantizedMatmul``) saves
only those buffers and dequantizes again for the input's gradient, never keeping the full-size
weight, as bitsandbytes' ``MatMul4Bit`` does. Written by hand rather than wrapping
bitsandbytes' ``Linear4bit``/``matmul_4bit`` (which runs forward and backward on CPU from the
same packed nf4 arrays: ``tests/test_quant.py`` checks it gives the same output and gradient):
bitsandbytes is not a dependency of torch_ref, has no int8 layer that re-dequantizes in the
backward, and keeps its code tables in every layer's state. torchao's ``NF4Tensor``
(``torchao.quantization.NF4Tensor`` in torchao 0.18) stores a different format: the same 16
NF4 values and nibble order, but its second level is a linear int8 code of the absmax values,
not bitsandbytes' dynamic 8-bit code, so it cannot read these arrays.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from jaxmem.adapters import NF4_BLOCK, NF4_STATS_BLOCK
from jaxmem.quant import INT8_RECIPROCAL, NF4_CODE, QuantizedWeight, dynamic_code

_ARRAYS = ("packed", "absmax", "absmax_scale", "absmax_offset")


def _blockwise(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``values[i] * scales[i // block]`` in fp32 (a shorter last block allowed)."""
    n = values.shape[0]
    padded = torch.nn.functional.pad(values, (0, scales.shape[0] * block - n))
    return (padded.reshape(-1, block) * scales[:, None]).reshape(-1)[:n]


def dequantize_arrays(
    kind: str, shape: tuple[int, int], arrays: dict[str, torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """The ``[out, in]`` weight the packed ``arrays`` (``QuantizedWeight``'s fields) hold,
    computed in fp32 and cast once to ``dtype``."""
    if kind == "int8":
        rows = arrays["packed"].to(torch.float32) * arrays["absmax"][:, None]
        return (rows * torch.tensor(INT8_RECIPROCAL)).to(dtype)
    if kind != "nf4":
        raise ValueError(f"QuantizedWeight.kind={kind!r} is not int8 or nf4")
    out, in_ = shape
    device = arrays["packed"].device
    # the block absmax values: 8-bit dynamic code times its block's scale, plus the mean
    stats = torch.tensor(dynamic_code(), device=device)[arrays["absmax"].long()]
    absmax = _blockwise(stats, arrays["absmax_scale"], NF4_STATS_BLOCK) + arrays["absmax_offset"]
    # two 4-bit indices a byte, the first in the high nibble
    packed = arrays["packed"]
    idx = torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(-1)[: out * in_]
    values = torch.tensor(NF4_CODE, device=device)[idx.long()]
    return _blockwise(values, absmax, NF4_BLOCK).reshape(out, in_).to(dtype)


def tensors(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """``qw``'s packed arrays as tensors (same dtypes, same bits), by field name."""
    arrays = {name: getattr(qw, name) for name in _ARRAYS}
    return {k: torch.from_numpy(np.array(v)) for k, v in arrays.items() if v is not None}


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[out, in]`` weight ``qw`` packs (``jaxmem.model.quant.dequantize`` in torch ops)."""
    return dequantize_arrays(qw.kind, qw.shape, tensors(qw), dtype)


def from_bitsandbytes_nf4(packed: torch.Tensor, state) -> QuantizedWeight:
    """The ``QuantizedWeight`` of a weight bitsandbytes packed with ``quantize_4bit(W,
    blocksize=64, compress_statistics=True, quant_type="nf4")`` (``packed`` and its
    ``QuantState``): the same arrays, refused (``ValueError``) where its format is not ours."""
    nested = getattr(state, "state2", None)
    fits = (
        state.quant_type == "nf4"
        and state.blocksize == NF4_BLOCK
        and nested is not None
        and nested.blocksize == NF4_STATS_BLOCK
        and len(state.shape) == 2
        and np.array_equal(state.code.cpu().numpy(), NF4_CODE)
        and np.array_equal(nested.code.cpu().numpy(), dynamic_code())
    )
    if not fits:
        raise ValueError(
            "this QuantState is not nf4 in blocks of 64 with double-quantized absmax in blocks "
            "of 256 and bitsandbytes' own code tables: quantize with quantize_4bit(W, "
            "blocksize=64, compress_statistics=True, quant_type='nf4')"
        )
    return QuantizedWeight(
        kind="nf4",
        shape=(int(state.shape[0]), int(state.shape[1])),
        packed=packed.detach().cpu().numpy().reshape(-1).copy(),
        absmax=state.absmax.cpu().numpy().copy(),
        absmax_scale=nested.absmax.cpu().numpy().copy(),
        absmax_offset=np.asarray(state.offset.cpu().numpy(), dtype=np.float32),
    )


def from_bitsandbytes_int8(cb: torch.Tensor, scb: torch.Tensor) -> QuantizedWeight:
    """The ``QuantizedWeight`` of bitsandbytes' row-wise int8 weight (``CB``, ``SCB`` from
    ``int8_vectorwise_quant``, ``Int8Params``)."""
    return QuantizedWeight(
        kind="int8",
        shape=(int(cb.shape[0]), int(cb.shape[1])),
        packed=cb.detach().cpu().numpy().copy(),
        absmax=scb.detach().cpu().numpy().astype(np.float32),
    )


class QuantizedMatmul(torch.autograd.Function):
    """``x @ W^T`` with ``W`` dequantized from packed arrays; saves only the packed arrays and
    dequantizes again in the backward. Gradient for ``x`` only (the packed base is frozen)."""

    @staticmethod
    def forward(ctx, x, kind, shape, dtype, names, *arrays):  # noqa: D102
        packed = dict(zip(names, arrays, strict=True))
        w = dequantize_arrays(kind, shape, packed, dtype)  # [out, in]
        ctx.save_for_backward(*arrays)
        ctx.meta = (kind, shape, dtype, names)
        return torch.nn.functional.linear(x.to(dtype), w)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        kind, shape, dtype, names = ctx.meta
        w = dequantize_arrays(kind, shape, dict(zip(names, ctx.saved_tensors, strict=True)), dtype)
        grad_x = grad_out.to(dtype) @ w  # [..., out] @ [out, in]
        return (grad_x, None, None, None, None, *([None] * len(names)))


class QuantizedLinear(nn.Module):
    """A frozen linear layer over a packed weight (``jaxmem.quant.QuantizedWeight``): buffers,
    no parameters; ``forward(x) = x @ W^T`` in ``dtype`` through ``QuantizedMatmul``."""

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.kind, self.shape, self.dtype = qw.kind, qw.shape, dtype
        self.names = tuple(tensors(qw))
        for name, t in tensors(qw).items():
            self.register_buffer(name, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        arrays = [getattr(self, n) for n in self.names]
        return QuantizedMatmul.apply(x, self.kind, self.shape, self.dtype, self.names, *arrays)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, out={self.shape[0]}, in={self.shape[1]}, dtype={self.dtype}"

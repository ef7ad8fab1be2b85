"""A quantized frozen base in PyTorch: the same dequantization as ``jaxmem.model.quant`` in
torch ops, and a frozen linear layer whose backward re-dequantizes.

The packed arrays are ``jaxmem.quant``'s (``int8``, ``nf4``: bitsandbytes' formats), so both
frameworks dequantize the same bytes to the same fp32 values (``dequantize``: a table lookup and
multiplies in fp32, cast once at the end).

``QuantizedLinear`` holds them as buffers; its autograd function (``QuantizedMatmul``) saves
only those buffers and dequantizes again for the input's gradient, never keeping the full-size
weight, as bitsandbytes' ``MatMul4Bit`` does. ``quantize_base`` packs a ``Decoder``'s block
projections into them (the fused q/k/v as ``PackedProjection``, three parts), from the same
float32 values ``jaxmem.model.qbase`` packs, so both frameworks train on the same bytes;
PEFT's stock ``lora.Linear`` wraps each ``QuantizedLinear`` (``torch_ref.lora``).

An extension, labelled as such. Stock tried first (bitsandbytes 0.50.2, PEFT 0.21.2, CPU):
``bnb.nn.Linear4bit`` (nf4, packed to uint8) and ``bnb.nn.Linear8bitLt`` (int8) both run
forward and backward with PEFT's LoRA on top (``inject_adapter_in_model`` wraps them in PEFT's
plain ``lora.Linear``; its ``lora.bnb`` layers are dispatched only for a model transformers
loaded in 4 or 8 bits), and ``matmul_4bit`` gives this module's output and gradient from the
same packed nf4 arrays (``tests/test_quant.py``). Not used because torch_ref's q/k/v is one
fused projection (``FusedProjection``, one PEFT adapter per part) that no bitsandbytes layer
holds, so its parts need this module's layer anyway, and one layer for every projection keeps
one dequantization; loading jaxmem's arrays into ``Params4bit`` means rebuilding its
``QuantState``; bitsandbytes is not a dependency of torch_ref, has no int8 layer that
re-dequantizes in the backward, and keeps its code tables in every layer's state. torchao's
``NF4Tensor``
(``torchao.quantization.NF4Tensor`` in torchao 0.18) stores a different format: the same 16
NF4 values and nibble order, but its second level is a linear int8 code of the absmax values,
not bitsandbytes' dynamic 8-bit code, so it cannot read these arrays.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from jaxmem.adapters import NF4_BLOCK, NF4_STATS_BLOCK
from jaxmem.quant import INT8_RECIPROCAL, NF4_CODE, QuantizedWeight, dynamic_code, quantize
from torch_ref.model import Decoder, FusedProjection

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
    and an optional ``bias`` parameter; ``forward(x) = x @ W^T (+ bias)`` in ``dtype`` through
    ``QuantizedMatmul``. ``in_features``/``out_features`` and ``weight`` (an empty tensor in
    ``dtype``, not the weight) are what PEFT's ``lora.Linear`` reads of a base layer to size and
    place its adapters (``torch_ref.lora`` registers this class with it)."""

    def __init__(
        self,
        qw: QuantizedWeight,
        dtype: torch.dtype = torch.float32,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.kind, self.shape, self.dtype = qw.kind, qw.shape, dtype
        self.out_features, self.in_features = qw.shape
        self.names = tuple(tensors(qw))
        for name, t in tensors(qw).items():
            self.register_buffer(name, t)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.register_buffer("placement", torch.empty(0, dtype=dtype), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """Not the weight (it is packed): an empty tensor on the layer's device in ``dtype``."""
        return self.placement

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        arrays = [getattr(self, n) for n in self.names]
        y = QuantizedMatmul.apply(x, self.kind, self.shape, self.dtype, self.names, *arrays)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self) -> torch.Tensor:
        """The ``[out, in]`` weight in ``dtype`` (for merging and export, never the step)."""
        return dequantize_arrays(
            self.kind, self.shape, {n: getattr(self, n) for n in self.names}, self.dtype
        )

    def extra_repr(self) -> str:
        return f"kind={self.kind}, out={self.shape[0]}, in={self.shape[1]}, dtype={self.dtype}"


class PackedProjection(FusedProjection):
    """torch_ref's fused q/k/v projection over a packed base: q, k and v each a
    ``QuantizedLinear`` (packed separately, as bitsandbytes packs a Llama's ``q_proj``,
    ``k_proj``, ``v_proj`` and ``jaxmem.model.qbase`` packs the fused kernel's parts), their
    outputs side by side, plus the parent's ``in_proj_bias``. A ``FusedProjection``, so
    ``torch_ref.lora.FusedQKVLora`` puts its per-part adapters on it unchanged."""

    def __init__(self, parts: dict[str, QuantizedLinear], dtype: torch.dtype):
        first = next(iter(parts.values()))
        super().__init__(first.in_features, {n: p.out_features for n, p in parts.items()})
        for name, part in parts.items():
            self.add_module(name, part)
        self.placement = torch.empty(0, dtype=dtype, device=first.packed.device)

    def forward(self, x: torch.Tensor, attention: nn.Module) -> torch.Tensor:
        y = torch.cat([getattr(self, n)(x) for n in self.parts], dim=-1)  # [B, S, D + 2 Hkv K]
        bias = attention.in_proj_bias
        return y if bias is None else y + bias.to(y.dtype)

    def dequantized(self) -> torch.Tensor:
        """The fused ``[D + 2 Hkv K, D]`` weight (``in_proj_weight``) in the base's dtype."""
        return torch.cat([getattr(self, n).dequantized() for n in self.parts])


def _packed(weight: torch.Tensor, kind: str, bias: torch.Tensor | None = None) -> QuantizedLinear:
    """``weight`` ``[out, in]`` packed as ``kind`` from its float32 values (what
    ``jaxmem.model.qbase`` packs of the same weights), on its device, computing in its dtype."""
    qw = quantize(weight.detach().float().cpu().numpy(), kind)
    return QuantizedLinear(qw, weight.dtype, bias).to(weight.device)


def quantize_base(model: Decoder, kind: str) -> Decoder:
    """``model``'s block projections packed as ``kind`` (``int8``, ``nf4``), in place, as
    ``jaxmem.model.qbase.quantize_base`` packs jaxmem's: the fused q/k/v weight as three
    ``QuantizedLinear`` (``PackedProjection``; ``in_proj_weight`` removed), ``out_proj`` and
    the MLP's matrices one each; biases, embeddings, head and norms as they were. Call it
    before ``torch_ref.lora.add_adapters``. Returned for convenience."""
    for block in model.blocks.layers:
        attn, ffn = block.self_attn, block.ffn
        if isinstance(attn.in_proj, PackedProjection):
            continue  # already packed
        w = attn.in_proj_weight
        rows = w.split(list(attn.in_proj.parts.values()))
        parts = {n: _packed(r, kind) for n, r in zip(attn.in_proj.parts, rows, strict=True)}
        attn.in_proj = PackedProjection(parts, w.dtype)
        del attn.in_proj_weight
        attn.register_parameter("in_proj_weight", None)
        attn.out_proj = _packed(attn.out_proj.weight, kind, attn.out_proj.bias)
        names = ("gate", "up", "down") if hasattr(ffn, "gate") else ("0", "2")
        for name in names:
            linear = getattr(ffn, name)
            setattr(ffn, name, _packed(linear.weight, kind, linear.bias))
    return model


def dense_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a base state dict of ``model`` under torch_ref's own names, PEFT's
    ``base_layer`` dropped) with every packed projection's buffers replaced by its dequantized
    weight under the unpacked model's key (``in_proj_weight``, ``out_proj.weight``, ...): the
    state dict of ``torch_ref.Decoder`` whose weights are the packed base's values."""
    out = dict(state)
    fused: set[str] = set()
    for name, module in model.named_modules():
        name = name.replace(".base_layer", "")
        if isinstance(module, PackedProjection):
            fused.add(name)
            out[f"{name.rsplit('.', 1)[0]}.in_proj_weight"] = module.dequantized()
        elif isinstance(module, QuantizedLinear):
            for buffer in module.names:
                del out[f"{name}.{buffer}"]
            if name.rsplit(".", 1)[0] not in fused:  # q, k, v: their projection's rows
                out[f"{name}.weight"] = module.dequantized()
    return out

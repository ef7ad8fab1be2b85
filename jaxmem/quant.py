"""A frozen base's weights packed as bitsandbytes packs them: ``int8`` and ``nf4``, in numpy.

Both frameworks dequantize the same packed arrays (``jaxmem.model.quant`` in jnp ops,
``torch_ref.quant`` in torch ops), so the packing lives here, pure: it imports neither JAX nor
PyTorch. A weight is given as PyTorch and Hugging Face store a linear layer's, ``[out, in]``,
the layout bitsandbytes and PEFT quantize, and is flattened row-major.

- ``nf4``: QLoRA's 4-bit NormalFloat (Dettmers et al. 2023) exactly as bitsandbytes 0.50's
  ``quantize_4bit(W, blocksize=64, compress_statistics=True, quant_type="nf4")`` packs it:
  blocks of ``NF4_BLOCK`` values scaled by their absmax (times the reciprocal, clamped to
  [-1, 1]; a last, shorter block is divided by its absmax), each value's index in ``NF4_CODE``
  chosen by the midpoints between the sorted code values (a value on a midpoint takes the lower
  index: ``torch.bucketize``'s rule), two indices a byte, the first in the high nibble (an odd
  count pads a zero, index 7). Double quantization: the block absmax values minus their mean
  (the ``absmax_offset``) are coded in 8 bits with bitsandbytes' dynamic code
  (``dynamic_code()``, ``create_dynamic_map``) in blocks of ``NF4_STATS_BLOCK`` with an fp32
  absmax each (``absmax_scale``), coded as bitsandbytes' CPU kernel codes them (through a
  table of 65,536 even steps: ``quantize_absmax``, not always the nearest code value). Dequantized:
  ``NF4_CODE[i] * (dynamic_code()[a] * absmax_scale + absmax_offset)``, all in fp32.
- ``int8``: LLM.int8's row-wise weight quantization (bitsandbytes' ``int8_vectorwise_quant``):
  per output row, ``round(W * (127 / absmax))`` (round half to even; ``127 / absmax`` as torch
  computes it, ``reciprocal(absmax) * 127``) with the row's fp32 absmax kept (``absmax``);
  dequantized ``(q * absmax) * INT8_RECIPROCAL`` in fp32, as ``int8_vectorwise_dequant`` does.
  A row of zeros packs to zeros (bitsandbytes divides by 0).

The one known difference from bitsandbytes: ``absmax_offset`` is the float64 mean of the fp32
absmax values rounded once to fp32; bitsandbytes takes torch's fp32 ``mean()``, whose summation
order can put it a few units in the last place away (``OFFSET_ULPS``); the 4-bit indices and
the block absmax values do not depend on it, and with bitsandbytes' offset the 8-bit
statistics are bitsandbytes' exactly (``tests/test_quant.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jaxmem.adapters import NF4_BLOCK, NF4_STATS_BLOCK

KINDS: tuple[str, ...] = ("int8", "nf4")

# QLoRA's 16 NormalFloat values (bitsandbytes ``get_4bit_type("nf4")``, fp32)
NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)
# 1/127 as bitsandbytes' int8_vectorwise_dequant multiplies by it (the literal, rounded to fp32)
INT8_RECIPROCAL = np.float32(7.874015718698502e-3)
# how far (units in the last place of fp32) absmax_offset may sit from bitsandbytes' fp32 mean
OFFSET_ULPS = 8


@functools.cache
def dynamic_code() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic code (``create_dynamic_map()``: 7 exponent bits), the
    256 sorted fp32 values the nf4 absmax statistics are coded with (read-only)."""
    values: list[float] = [0.0, 1.0]
    for i in range(7):
        boundaries = _torch_linspace(0.1, 1.0, 2**i + 1)
        means = (boundaries[:-1] + boundaries[1:]) / np.float32(2.0)
        scale = np.float32(10.0 ** (i - 6))
        values += (scale * means).tolist() + (-scale * means).tolist()
    code = np.array(sorted(values), dtype=np.float32)
    code.flags.writeable = False
    return code


def _torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace(start, end, steps, dtype=float32)`` as ATen's CPU kernel computes it:
    the first half ``start + step * i``, the second ``end - step * (steps - 1 - i)``, each a
    fused multiply-add (one rounding to fp32; float64 holds the exact product and sum here)."""
    lo, hi = np.float32(start), np.float32(end)
    step = np.float64((hi - lo) / np.float32(steps - 1))
    idx = np.arange(steps, dtype=np.float64)
    up = step * idx + np.float64(lo)
    down = np.float64(hi) - step * (steps - 1 - idx)
    return np.where(idx < steps // 2, up, down).astype(np.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A frozen ``[out, in]`` weight, packed (see the module docstring for each ``kind``).

    ``packed``: nf4 uint8 ``[ceil(out*in / 2)]``, two 4-bit indices a byte; int8 int8
    ``[out, in]``. ``absmax``: nf4 uint8 ``[blocks]`` (each block's absmax, 8-bit coded);
    int8 fp32 ``[out]``. nf4 only: ``absmax_scale`` fp32 ``[ceil(blocks / 256)]`` and
    ``absmax_offset`` fp32 ``[]``. ``kind`` and ``shape`` are static (a JAX pytree's aux data);
    the arrays are its leaves (``jaxmem.model.quant`` registers it).
    """

    kind: str
    shape: tuple[int, int]
    packed: np.ndarray
    absmax: np.ndarray
    absmax_scale: np.ndarray | None = None
    absmax_offset: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """The bytes the packed arrays hold (``packed_bytes`` of the shape, by construction)."""
        arrays = (self.packed, self.absmax, self.absmax_scale, self.absmax_offset)
        return sum(int(a.nbytes) for a in arrays if a is not None)


def packed_shapes(kind: str, out: int, in_: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The arrays of ``QuantizedWeight`` a ``[out, in_]`` weight packs to as ``kind``, from its
    shape alone: ``{field: (shape, dtype name)}`` (``absmax_scale`` and ``absmax_offset``:
    nf4 only)."""
    if kind == "int8":
        return {"packed": ((out, in_), "int8"), "absmax": ((out,), "float32")}
    if kind != "nf4":
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    n = out * in_
    blocks = math.ceil(n / NF4_BLOCK)
    return {
        "packed": ((math.ceil(n / 2),), "uint8"),
        "absmax": ((blocks,), "uint8"),
        "absmax_scale": ((math.ceil(blocks / NF4_STATS_BLOCK),), "float32"),
        "absmax_offset": ((), "float32"),
    }


def packed_bytes(kind: str, out: int, in_: int) -> int:
    """The bytes a ``[out, in_]`` weight takes packed as ``kind``, from its shape alone: the
    arrays of ``QuantizedWeight`` (the code tables are constants, shared by every weight)."""
    return sum(
        math.prod(shape) * np.dtype(dtype).itemsize
        for shape, dtype in packed_shapes(kind, out, in_).values()
    )


def quantize(weight: np.ndarray, kind: str) -> QuantizedWeight:
    """Pack a float ``[out, in]`` weight (any float dtype; read as fp32) as ``kind``."""
    w = np.asarray(weight)
    if w.ndim != 2 or not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"quantize takes a float [out, in] weight, got {w.dtype} {w.shape}")
    w = w.astype(np.float32)
    shape = (int(w.shape[0]), int(w.shape[1]))
    if kind == "int8":
        q, absmax = _int8_rows(w)
        return QuantizedWeight(kind="int8", shape=shape, packed=q, absmax=absmax)
    if kind != "nf4":
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    packed, absmax = _nf4_blocks(w.reshape(-1))
    offset = np.float32(absmax.astype(np.float64).mean())
    codes, scales = quantize_absmax(absmax, offset)
    return QuantizedWeight(
        kind="nf4",
        shape=shape,
        packed=packed,
        absmax=codes,
        absmax_scale=scales,
        absmax_offset=np.asarray(offset, dtype=np.float32),
    )


def _int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    absmax = np.abs(w).max(axis=1)
    # torch computes ``127.0 / absmax`` as ``reciprocal(absmax) * 127``: two roundings
    with np.errstate(divide="ignore"):
        recip = np.where(absmax > 0, np.float32(1.0) / absmax, np.float32(0.0))
    scale = recip * np.float32(127.0)
    return np.rint(w * scale[:, None]).astype(np.int8), absmax.astype(np.float32)


def _scaled_blocks(flat: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Each block's absmax and the values scaled into [-1, 1] as bitsandbytes' reference
    kernel scales them (full blocks times the reciprocal, a last shorter block divided)."""
    n = flat.size
    full = n - n % block
    tiny = np.float32(1e-38)
    body = flat[:full].reshape(-1, block)
    absmax = np.abs(body).max(axis=1) if full else np.zeros(0, np.float32)
    scaled = np.clip(body * (np.float32(1.0) / np.maximum(absmax, tiny))[:, None], -1, 1)
    scaled = scaled.reshape(-1)
    if full < n:
        last = np.maximum(np.abs(flat[full:]).max(), tiny)
        absmax = np.append(absmax, np.abs(flat[full:]).max())
        scaled = np.concatenate([scaled, np.clip(flat[full:] / last, -1, 1)])
    return absmax.astype(np.float32), scaled.astype(np.float32)


def _nf4_blocks(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    absmax, scaled = _scaled_blocks(flat, NF4_BLOCK)
    if scaled.size % 2:
        scaled = np.append(scaled, np.float32(0.0))
    bounds = (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2.0)
    idx = np.searchsorted(bounds, scaled, side="left").astype(np.uint8)
    return (idx[0::2] << 4) | idx[1::2], absmax


def quantize_absmax(absmax: np.ndarray, offset: np.floating) -> tuple[np.ndarray, np.ndarray]:
    """nf4's double quantization of fp32 block ``absmax`` values around ``offset``: the 8-bit
    dynamic-code indices and each block of ``NF4_STATS_BLOCK``'s fp32 absmax, as bitsandbytes'
    CPU ``quantize_blockwise`` computes them (public so a test can code bitsandbytes' own
    offset). That kernel does not search the code: it scales each value by the reciprocal of its
    block's absmax, maps it to one of 65,536 even steps over [-1, 1] (``((v + 1) * 0.5) * 65535
    + 0.5``, truncated, each operation rounded to fp32) and reads the code index of that step
    from a table (``_dynamic_steps``); a block of zeros codes as index 0."""
    x = (absmax.astype(np.float32) - np.float32(offset)).astype(np.float32)
    blocks = math.ceil(x.size / NF4_STATS_BLOCK)
    padded = np.zeros(blocks * NF4_STATS_BLOCK, np.float32)
    padded[: x.size] = x
    padded = padded.reshape(blocks, NF4_STATS_BLOCK)
    scales = np.abs(padded).max(axis=1).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(scales > 0, np.float32(1.0) / scales, np.float32(0.0))
    v = np.clip(padded * inv[:, None], np.float32(-1.0), np.float32(1.0))
    one, half = np.float32(1.0), np.float32(0.5)
    steps = ((v + one) * half) * np.float32(_STEPS - 1) + half
    codes = _dynamic_steps()[steps.astype(np.int64)]
    codes[scales == 0] = 0
    return codes.reshape(-1)[: x.size].astype(np.uint8), scales


_STEPS = 65536  # the even steps over [-1, 1] bitsandbytes' CPU 8-bit quantizer maps values to


@functools.cache
def _dynamic_steps() -> np.ndarray:
    """For each of the ``_STEPS`` values ``-1 + 2 i / 65535`` (fp32), the index of the nearest
    dynamic-code value (below a midpoint of two code values, or on it: the lower)."""
    code = dynamic_code()
    mid = np.float32(0.5) * (code[:-1] + code[1:])
    i = np.arange(_STEPS, dtype=np.float32)
    val = np.float32(-1.0) + (np.float32(2.0) * i) / np.float32(_STEPS - 1)
    steps = np.searchsorted(mid, val, side="left").astype(np.uint8)
    steps.flags.writeable = False
    return steps

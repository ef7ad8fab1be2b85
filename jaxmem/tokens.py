"""Token ids, the bottom of jaxmem's data modules (pure: numpy, no JAX, no PyTorch): the
byte-level tokenizer (``encode`` / ``decode`` and its special ids ``BOS``, ``EOS``, ``PAD``), the
dtypes token files hold (``bin_dtype``), documents as a Hugging Face tokenizer's ids
(``tokenize_documents``), and ``DataError``, which every data module raises.

It sits below ``jaxmem.text_sources`` and ``jaxmem.data`` so both can import it without importing
each other; ``jaxmem.data`` re-exports its names, where callers import them from.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259  # 256 byte values + BOS, EOS, PAD

BIN_DTYPE = np.dtype("<u2")  # nanoGPT's .bin layout: raw little-endian uint16, no header
BIN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}  # meta.json's "dtype"


class DataError(ValueError):
    """Training data is missing, empty or malformed (the CLI maps this to exit code 2)."""


def bin_dtype(vocab_size: int) -> np.dtype:
    """The ``.bin`` dtype for ids below ``vocab_size``: nanoGPT's uint16 while every id fits
    (up to 65,536 ids: 0..65,535), else uint32."""
    return BIN_DTYPES["uint16"] if vocab_size <= 1 << 16 else BIN_DTYPES["uint32"]


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids (``uint16``)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode(tokens: np.ndarray) -> str:
    """Token ids back to text; special tokens are dropped, invalid UTF-8 is replaced."""
    data = bytes(int(t) for t in np.asarray(tokens).ravel() if t < 256)
    return data.decode("utf-8", errors="replace")


def tokenize_documents(files: list[bytes], tokenizer: Any, cut: int | None = None) -> np.ndarray:
    """Documents (raw bytes: decoded as UTF-8, invalid bytes replaced) as ``tokenizer``'s ids,
    separated by its separator; ``cut``: only the first ``cut`` bytes of text."""
    if cut is not None:
        kept, total = [], 0
        for data in files:
            kept.append(data[: cut - total])
            total += len(kept[-1])
            if total >= cut:
                break
        files = kept
    texts = [data.decode("utf-8", errors="replace") for data in files]
    many = getattr(tokenizer, "encode_many", None)
    encoded = many(texts) if many is not None else [tokenizer.encode(t) for t in texts]
    dtype = bin_dtype(tokenizer.vocab_size)
    sep = [] if tokenizer.separator is None else [np.array([tokenizer.separator], dtype)]
    out: list[np.ndarray] = []
    for ids in encoded:
        out += [*(sep if out else []), np.asarray(ids).astype(dtype)]
    return np.concatenate(out) if out else np.zeros(0, dtype)

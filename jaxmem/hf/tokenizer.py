"""Tokenizers: the byte tokenizer (the default everywhere) and a Hugging Face model directory's
``tokenizer.json`` through the ``tokenizers`` package (``pip install 'jaxmem[hf]'``; pure: no
JAX, no PyTorch, no ``transformers``).

A tokenizer turns text into token ids (``encode``) and back (``decode``), names itself for a
prepared dataset's ``meta.json`` (``name``: ``bytes``, or ``tokenizer.json`` and its SHA-256, so
a dataset is matched to a tokenizer by content, not by where it lies) and says which id starts
an empty prompt and which separates documents.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Protocol

import numpy as np

from jaxmem.config import ConfigError, require
from jaxmem.data import BOS, EOS, VOCAB_SIZE, decode, encode

TOKENIZER_JSON = "tokenizer.json"
HF_EXTRA = "pip install 'jaxmem[hf]'"


class Tokenizer(Protocol):
    name: str  # what meta.json records: "bytes" or "tokenizer.json sha256:..."
    description: str  # for messages: "the byte tokenizer", "tokenizer.json of DIR"
    vocab_size: int
    start_id: int  # the prompt of an empty --prompt
    separator: int | None  # between documents (files) of a corpus; None: nothing

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus BOS, EOS and PAD."""

    name = "bytes"
    description = "the byte tokenizer"
    vocab_size = VOCAB_SIZE
    start_id = BOS
    separator = EOS

    def encode(self, text: str) -> np.ndarray:
        return encode(text)

    def decode(self, ids: np.ndarray) -> str:
        return decode(ids)


class HFTokenizer:
    """A ``tokenizer.json`` (Hugging Face ``tokenizers``). Its start and separator ids are the
    model's ``bos_token_id`` / ``eos_token_id`` from ``config.json`` when they are in its
    vocabulary (else the start is 0 and documents are not separated)."""

    def __init__(self, directory: str):
        path = os.path.join(directory, TOKENIZER_JSON)
        require(os.path.isfile(path), f"{directory} has no {TOKENIZER_JSON}")
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise ConfigError(
                f"{path} needs the tokenizers package, which is not installed: {HF_EXTRA}"
            ) from None
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises its own Exception for a bad file
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise ConfigError(f"{path} cannot be read by tokenizers ({first})") from None
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        self.directory = directory
        self.name = f"{TOKENIZER_JSON} sha256:{digest[:16]}"
        self.description = f"{TOKENIZER_JSON} of {directory}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = _special_ids(directory)
        in_vocab = {k: v for k, v in ids.items() if v is not None and 0 <= v < self.vocab_size}
        self.start_id = in_vocab.get("bos", in_vocab.get("eos", 0))
        self.separator = in_vocab.get("eos")

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text, in parallel (the tokenizers package's own threads)."""
        out = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in out]

    def decode(self, ids: np.ndarray) -> str:
        return self._tok.decode([int(t) for t in np.asarray(ids).ravel()])

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """``encode(text)`` and each id's ``[start, end)`` character span in ``text``."""
        out = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(out.ids, dtype=np.uint32), list(out.offsets)

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` (a special token's text), None when it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    def added_around(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's post-processor puts before and after a text (a Llama
        tokenizer's BOS before; none for GPT-2's)."""
        bare = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        for at in range(len(full) - len(bare) + 1):
            if full[at : at + len(bare)] == bare:
                return full[:at], full[at + len(bare) :]
        return [], []


def _special_ids(directory: str) -> dict[str, int | None]:
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    out: dict[str, int | None] = {}
    for name in ("bos", "eos"):
        value = raw.get(f"{name}_token_id") if isinstance(raw, dict) else None
        value = value[0] if isinstance(value, list) and value else value
        out[name] = value if isinstance(value, int) and not isinstance(value, bool) else None
    return out


def has_tokenizer(directory: str | None) -> bool:
    return directory is not None and os.path.isfile(os.path.join(directory, TOKENIZER_JSON))


def tokenizer_for(directory: str | None) -> Tokenizer:
    """``directory``'s ``tokenizer.json`` when it has one, else the byte tokenizer."""
    return HFTokenizer(directory) if has_tokenizer(directory) else ByteTokenizer()

"""Byte-level tokenizer and the embedded default corpus.

The default corpus is the Python standard library's own source files, found via ``sysconfig`` and
read in sorted path order, so every machine has training text without a download. Different
Python versions ship different sources, so loss values are comparable only on one interpreter.
"""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259  # 256 byte values + BOS, EOS, PAD


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids (``uint16``)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode(tokens: np.ndarray) -> str:
    """Token ids back to text; special tokens are dropped, invalid UTF-8 is replaced."""
    data = bytes(int(t) for t in np.asarray(tokens).ravel() if t < 256)
    return data.decode("utf-8", errors="replace")


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's ``.py`` files in sorted order (site-packages excluded)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )


def stdlib_corpus(max_bytes: int = 8 << 20) -> np.ndarray:
    """Up to ``max_bytes`` tokens of standard-library source, files separated by ``EOS``."""
    chunks: list[np.ndarray] = []
    total = 0
    for path in stdlib_files():
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16)
        chunks += [data, np.array([EOS], dtype=np.uint16)]
        total += data.size + 1
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(
            f"no Python sources under {sysconfig.get_paths()['stdlib']}; pass a data path"
        )
    return np.concatenate(chunks)[:max_bytes]


def train_val_split(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, ...]:
    """The last ``val_fraction`` of the tokens is validation data (deterministic)."""
    n_val = max(1, int(tokens.size * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def random_windows(
    tokens: np.ndarray, batch: int, seq_len: int, seed: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless ``(inputs [B, S], targets [B, S])`` int32 windows at seeded random offsets."""
    if tokens.size < seq_len + 2:
        raise ValueError(
            f"seq_len={seq_len} needs at least {seq_len + 2} tokens, the data has {tokens.size}"
        )
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, tokens.size - seq_len - 1, batch)
        windows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)
        yield windows[:, :-1], windows[:, 1:]

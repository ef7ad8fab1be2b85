"""Training data sources and the host-to-device batch pipeline (pure: numpy, no JAX, no
PyTorch; each framework passes its own host-to-device transfer to ``Prefetcher``). The byte
tokenizer and ``DataError`` live in ``jaxmem.tokens``, text files in ``jaxmem.text_sources``;
this module re-exports the former, so callers import them from here.

The default corpus is the Python standard library's own source files, found via ``sysconfig`` and
read in sorted path order, so every machine has training text without a download. Different
Python versions ship different sources, so loss values are comparable only on one interpreter.

Other sources: a text file or a directory of text files (``jaxmem.text_sources``, tokenized on
load), or nanoGPT-style pre-tokenized ``train.bin`` / ``val.bin`` files (raw little-endian
``uint16``, no header, as written by karpathy/nanoGPT's ``data/*/prepare.py``; ``uint32`` for
vocabularies above 65,536 ids, as ``meta.json`` says) with our ``meta.json`` beside them;
``prepare_bin`` writes those. Text is byte-tokenized unless a ``tokenizer`` is given
(``jaxmem.hf.tokenizer``: a Hugging Face model directory's ``tokenizer.json``); ``meta.json``
names the tokenizer a ``.bin`` was made with. JSON Lines is refused where a text file is named
(``jaxmem.text_sources.refuse_json_lines``; skipped, and said, in a directory of text), and data
whose splits cannot hold one sequence (``check_split_sizes``), before anything is written or
compiled.
Batches are a pure function of ``(seed, step)`` (``batch_at``) so a resumed run sees exactly the
data it would have seen, and ``Prefetcher`` overlaps building and transferring the next batches
with the current step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import queue
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from jaxmem.files import check_can_create, made_dirs
from jaxmem.text_sources import text_source, text_tokens
from jaxmem.tokens import (  # noqa: F401  (re-exported: callers import these from here)
    BIN_DTYPE,
    BIN_DTYPES,
    BOS,
    EOS,
    PAD,
    VOCAB_SIZE,
    DataError,
    bin_dtype,
    decode,
    encode,
    tokenize_documents,
)

META_FORMAT = "jaxmem-bytes-v1"
STDLIB_SOURCE = "Python stdlib sources (embedded default)"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's ``.py`` files in sorted order (site-packages excluded)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )


def stdlib_corpus(max_bytes: int = 8 << 20, tokenizer: Any = None) -> np.ndarray:
    """Up to ``max_bytes`` tokens of standard-library source, files separated by ``EOS``. With
    a ``tokenizer`` (``jaxmem.hf.tokenizer``): the same ``max_bytes`` of source, tokenized by it."""
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
    if tokenizer is not None and tokenizer.name != "bytes":
        files = [c.astype(np.uint8).tobytes() for c in chunks[::2]]
        return tokenize_documents(files, tokenizer, cut=max_bytes)
    return np.concatenate(chunks)[:max_bytes]


def _n_val(n_tokens: int, val_fraction: float) -> int:
    return max(1, int(n_tokens * val_fraction))


def train_val_split(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, ...]:
    """The last ``val_fraction`` of the tokens is validation data (deterministic)."""
    n_val = _n_val(tokens.size, val_fraction)
    return tokens[:-n_val], tokens[-n_val:]


def split_tokens_needed(seq_len: int) -> int:
    """The fewest tokens a split can hold for ``seq_len``: one window of ``seq_len`` inputs and
    their targets (``seq_len + 1`` tokens), and a second start for the random offsets."""
    return seq_len + 2


def check_split_sizes(
    n_train: int, n_val: int, seq_len: int, source: str, val_fraction: float | None = None
) -> None:
    """Refuse data whose train or validation split is shorter than ``split_tokens_needed``: one
    line naming the tokens found, the tokens each split needs and the seq-len. With the
    ``val_fraction`` that split it, the line also says how many tokens in all would do.

    Raises:
        DataError: a split is too short.
    """
    need = split_tokens_needed(seq_len)
    if n_train >= need and n_val >= need:
        return
    least = ""
    if val_fraction is not None:
        total = max(2 * need, math.ceil(need / val_fraction), math.ceil(need / (1 - val_fraction)))
        while min(_n_val(total, val_fraction), total - _n_val(total, val_fraction)) < need:
            total += 1
        least = f" (at least {total:,} tokens in all at --val-fraction {val_fraction:g})"
    raise DataError(
        f"{source} has {n_train + n_val:,} tokens ({n_train:,} train, {n_val:,} validation); "
        f"each split needs at least {need:,} tokens for --seq-len {seq_len} (seq-len + 2): "
        f"give more text{least} or a shorter --seq-len"
    )


def lm_batch(cfg: Any, batch: int, seq_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic random token ids for measurements and parity: ``(inputs [B, S], targets
    [B, S])`` int32, targets shifted by one; ``cfg`` is a ``ModelConfig`` (its vocabulary)."""
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq_len + 1))
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


def random_windows(
    tokens: np.ndarray, batch: int, seq_len: int, seed: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless ``(inputs [B, S], targets [B, S])`` int32 windows at seeded random offsets."""
    if tokens.size < split_tokens_needed(seq_len):
        raise ValueError(
            f"seq_len={seq_len} needs at least {split_tokens_needed(seq_len)} tokens, the data "
            f"has {tokens.size}"
        )
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, tokens.size - seq_len - 1, batch)
        windows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)
        yield windows[:, :-1], windows[:, 1:]


# --------------------------------------------------------------------------------------------
# nanoGPT-style pre-tokenized .bin files


def read_meta(directory: pathlib.Path) -> dict[str, Any] | None:
    """``directory``'s ``meta.json`` (None: it has none).

    Raises:
        DataError: it is not a readable JSON object.
    """
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path} is not readable JSON ({e}); fix or delete it") from e
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path} must hold a JSON object; fix or delete it")
    return meta


def _max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    # Chunked so a multi-GB memmap is streamed through the page cache, never copied whole.
    return max(int(tokens[i : i + chunk].max()) for i in range(0, tokens.size, chunk))


def _check_vocab(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    if tokens.size == 0:
        return
    top = _max_token(tokens)
    if top >= vocab_size:
        raise DataError(
            f"{what} has token id {top} but the model's vocab_size is {vocab_size}; "
            "was it prepared with another tokenizer?"
        )


def load_bin(path: str | os.PathLike[str], vocab_size: int = VOCAB_SIZE) -> np.memmap:
    """Open a nanoGPT-style ``.bin`` token file read-only as a memmap: ``uint16``, or the dtype
    a ``meta.json`` beside it names (``uint16`` or ``uint32``).

    Validates that the file is non-empty and a whole number of tokens, that the ``meta.json``
    (if any) agrees on this split's token count (``train_tokens`` for ``train.bin``,
    ``val_tokens`` for ``val.bin``), and that every token id is below ``vocab_size``.

    Raises:
        DataError: on any of the mismatches above, or a missing file.
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise DataError(f"token file {p} does not exist; pass an existing .bin file")
    size = p.stat().st_size
    if size == 0:
        raise DataError(f"token file {p} is empty; re-run prepare to regenerate it")
    meta = read_meta(p.parent)
    dtype_name = "uint16" if meta is None else meta.get("dtype", "uint16")
    if dtype_name not in BIN_DTYPES:
        raise DataError(
            f"{p.parent / 'meta.json'} says dtype {dtype_name!r}; .bin files hold uint16 or "
            "uint32 tokens: re-run prepare"
        )
    dtype = BIN_DTYPES[dtype_name]
    if size % dtype.itemsize:
        raise DataError(
            f"token file {p} is {size} bytes, not a multiple of {dtype.itemsize}, so it is not "
            f"raw {dtype_name} tokens; re-run prepare or check how it was written"
        )
    n_tokens = size // dtype.itemsize
    if meta is not None:
        meta_path = p.parent / "meta.json"
        key = {"train.bin": "train_tokens", "val.bin": "val_tokens"}.get(p.name)
        if key is not None and key in meta and meta[key] != n_tokens:
            raise DataError(
                f"{meta_path} says {key}={meta[key]} but {p} holds {n_tokens} tokens "
                f"({size} bytes); the files are out of sync, re-run prepare"
            )
    tokens = np.memmap(p, dtype=dtype, mode="r", shape=(n_tokens,))
    _check_vocab(tokens, vocab_size, f"token file {p}")
    return tokens


def prepare_bin(
    src: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    val_fraction: float = 0.05,
    tokenizer: Any = None,
    seq_len: int | None = None,
) -> dict[str, Any]:
    """Tokenize ``src`` into ``out_dir/{train.bin, val.bin, meta.json}``; returns the meta dict.
    Byte tokens in ``uint16``, or ``tokenizer``'s ids (``jaxmem.hf.tokenizer``) in the dtype its
    vocabulary needs (``bin_dtype``), recorded in ``meta.json`` with the tokenizer's name.

    ``src`` is a text file or directory (see ``jaxmem.text_sources.text_tokens``), or ``None``
    for the embedded standard-library corpus. The split is ``train_val_split``'s: the last
    ``val_fraction`` of the tokens is validation; with ``seq_len``, each split must hold a batch
    of that length (``check_split_sizes``), else one token each. ``out_dir`` and the directories
    missing above it are made; files are written under temporary names and renamed into place,
    so an error never leaves a half-written ``.bin`` (or a directory made for it) behind.

    Raises:
        ConfigError: ``out_dir`` cannot be made or written (``jaxmem.files.check_can_create``).
        DataError: ``src`` is bad, the data is too small to split, ``out_dir`` already holds
            ``train.bin`` / ``val.bin`` (existing data is never overwritten), or writing fails.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
    out = pathlib.Path(out_dir)
    check_can_create(out, "--out")
    existing = [n for n in ("train.bin", "val.bin") if (out / n).exists()]
    if existing:
        raise DataError(
            f"{out} already contains {' and '.join(existing)}; choose another --out or delete them"
        )
    if src is None:
        tokens, source = stdlib_corpus(tokenizer=tokenizer), STDLIB_SOURCE
    else:
        s = pathlib.Path(src)
        tokens, skipped = text_tokens(s, tokenizer)
        source = text_source(s.resolve(), skipped)
    vocab = VOCAB_SIZE if tokenizer is None else tokenizer.vocab_size
    dtype = bin_dtype(vocab)
    if tokens.size < 2:
        raise DataError(
            f"{source} has {tokens.size} token(s); at least 2 are needed for a train/val split"
        )
    train, val = train_val_split(tokens, val_fraction)
    if seq_len is not None:
        check_split_sizes(train.size, val.size, seq_len, source, val_fraction)
    meta: dict[str, Any] = {
        "format": META_FORMAT,
        "dtype": dtype.name,
        "vocab_size": vocab,
        "tokenizer": "bytes" if tokenizer is None else tokenizer.name,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "source": source,
    }
    try:
        with made_dirs(out):
            write_dataset(
                out, {"train.bin": train.astype(dtype), "val.bin": val.astype(dtype)}, meta
            )
    except OSError as e:
        raise DataError(
            f"cannot write {out}: {e.strerror or e}; check its space and permissions"
        ) from e
    return meta


def write_dataset(out: pathlib.Path, splits: dict[str, np.ndarray], meta: dict) -> None:
    """``splits`` (file name: array, written raw) and ``meta.json`` into ``out`` (which exists),
    each under a temporary name first, ``train.bin`` renamed into place last; on failure every
    file written here is removed."""
    temps: dict[str, str] = {}
    placed: list[pathlib.Path] = []
    try:
        for name, arr in splits.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out)
            temps[name] = tmp
            with os.fdopen(fd, "wb") as f:
                arr.tofile(f)
        fd, tmp = tempfile.mkstemp(prefix=".meta.json.", suffix=".tmp", dir=out)
        temps["meta.json"] = tmp
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        # meta.json first and train.bin last: train.bin is what marks a directory as a prepared
        # dataset, so it appears only once its companions are in place.
        order = ["meta.json", *sorted(set(splits) - {"train.bin"}), "train.bin"]
        for name in order:
            # mkstemp makes 0600 files; a dataset is shared like any other file (umask applies)
            os.chmod(temps[name], 0o666 & ~_umask())
            # Forget the temp name only after the rename succeeded, so cleanup still sees it.
            os.replace(temps[name], out / name)
            del temps[name]
            placed.append(out / name)
    except BaseException:
        for leftover in [*map(pathlib.Path, temps.values()), *placed]:
            with contextlib.suppress(OSError):
                leftover.unlink()
        raise


# --------------------------------------------------------------------------------------------
# Dataset selection


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Train and validation token streams plus a human-readable description of their source.
    Instruction data (``jaxmem.instruct``) also has a loss mask per token and is rows of
    ``seq_len + 1`` tokens."""

    train: np.ndarray
    val: np.ndarray
    source: str
    train_mask: np.ndarray | None = None
    val_mask: np.ndarray | None = None
    seq_len: int | None = None  # instruction data: the rows' sequence length

    @property
    def masked(self) -> bool:
        """Instruction data: the loss counts only the tokens its mask marks."""
        return self.train_mask is not None


def load_dataset(
    path: str | os.PathLike[str] | None,
    *,
    val_fraction: float = 0.05,
    vocab_size: int = VOCAB_SIZE,
    tokenizer: Any = None,
) -> Dataset:
    """Load training data from ``path``, picking the format from what the path is.

    * ``None``: the embedded standard-library corpus, split by ``train_val_split``.
    * a directory containing ``train.bin``: that file and ``val.bin`` beside it as memmaps
      (without ``val.bin`` the train tokens are split instead).
    * a file ending ``.bin``: that file as train data; ``val.bin`` beside it if present,
      otherwise split.
    * any other file or directory: text, tokenized by ``jaxmem.text_sources.text_tokens`` and split.

    Text is tokenized by ``tokenizer`` (default: bytes); a ``.bin`` whose ``meta.json`` names
    another tokenizer is refused. Every token id is checked against ``vocab_size``.

    Raises:
        DataError: the path is missing, malformed or holds too little data.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
    if path is None:
        tokens = stdlib_corpus(tokenizer=tokenizer)
        _check_vocab(tokens, vocab_size, STDLIB_SOURCE)
        return Dataset(*train_val_split(tokens, val_fraction), STDLIB_SOURCE)
    p = pathlib.Path(path)
    if not p.exists():
        raise DataError(f"data path {p} does not exist; pass an existing file or directory")
    if p.is_dir() and (p / "val.bin").exists() and not (p / "train.bin").exists():
        raise DataError(
            f"{p} has val.bin but no train.bin; re-run prepare or pass the text source instead"
        )
    train_bin = _train_bin(p)
    if train_bin is not None:
        source = f"nanoGPT .bin in {p}" if p.is_dir() else f"nanoGPT .bin {p}"
        check_tokenizer(train_bin.parent, tokenizer)
        train = load_bin(train_bin, vocab_size)
        val_bin = train_bin.parent / "val.bin"
        if val_bin.exists() and val_bin.resolve() != train_bin.resolve():
            return Dataset(train, load_bin(val_bin, vocab_size), source)
        if train.size < 2:
            raise DataError(f"{train_bin} has 1 token; at least 2 are needed for a train/val split")
        train, val = train_val_split(train, val_fraction)
        return Dataset(train, val, f"{source} (no val.bin: last {val_fraction:g} split off)")
    tokens, skipped = text_tokens(p, tokenizer)
    if tokens.size < 2:
        raise DataError(f"data file {p} has 1 token; at least 2 are needed for a train/val split")
    _check_vocab(tokens, vocab_size, f"data {p}")
    train, val = train_val_split(tokens, val_fraction)
    return Dataset(train, val, text_source(p, skipped))


def _train_bin(p: pathlib.Path) -> pathlib.Path | None:
    """The ``.bin`` train split ``p`` names (itself, or its ``train.bin``); None for text."""
    if p.is_dir() and (p / "train.bin").exists():
        return p / "train.bin"
    return p if p.is_file() and p.suffix == ".bin" else None


def data_tokenizer(path: str | os.PathLike[str] | None) -> str | None:
    """The tokenizer a run's data (``DataConfig.path``) was read with when the run had no
    tokenizer of its own: ``"bytes"`` for text and the embedded corpus, the name a ``.bin``'s
    ``meta.json`` records, None when that is unknown (a ``.bin`` made elsewhere, data gone)."""
    if path is None:
        return "bytes"
    p = pathlib.Path(path)
    if not p.exists():
        return None
    train_bin = _train_bin(p)
    if train_bin is None:
        return "bytes"
    with contextlib.suppress(DataError):
        name = (read_meta(train_bin.parent) or {}).get("tokenizer")
        return name if isinstance(name, str) else None
    return None


def check_tokenizer(directory: pathlib.Path, tokenizer: Any) -> None:
    """A prepared dataset whose ``meta.json`` names a tokenizer matches the run's."""
    meta = read_meta(directory)
    made_with = None if meta is None else meta.get("tokenizer")
    ours = "bytes" if tokenizer is None else tokenizer.name
    if made_with is not None and made_with != ours:
        what = "the byte tokenizer" if tokenizer is None else tokenizer.description
        raise DataError(
            f"{directory / 'meta.json'} says its tokens come from {made_with}, but this run "
            f"tokenizes with {what} ({ours}); prepare the data with the run's tokenizer"
        )


# --------------------------------------------------------------------------------------------
# Deterministic batches and prefetching


def batch_at(
    tokens: np.ndarray,
    step: int,
    batch: int,
    seq_len: int,
    seed: int,
    what: str = "train",
    rows: slice | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs [B, S], targets [B, S])`` int32 windows for one step; targets are inputs + 1.

    Offsets come from ``np.random.default_rng([seed, step])``, so the batch is a pure function of
    ``(tokens, seed, step, batch, seq_len)``: a run resumed at step ``k`` sees exactly the batches
    an uninterrupted run would, without replaying steps ``0..k-1`` of an iterator. ``what`` names
    the split in the error message. ``rows``: only those rows of the batch (a process of a
    multi-host run reads only its own; the offsets of every row are drawn, so its rows are the
    ones the whole batch would have).

    Raises:
        DataError: ``tokens`` has fewer than ``seq_len + 2`` tokens.
        ValueError: a negative ``step`` or ``seed``, or a non-positive ``batch`` or ``seq_len``.
    """
    if step < 0 or seed < 0:
        raise ValueError(f"step={step} and seed={seed} must be >= 0 (they seed numpy's RNG)")
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch={batch} and seq_len={seq_len} must be >= 1")
    if tokens.size < split_tokens_needed(seq_len):
        raise DataError(
            f"seq_len={seq_len} needs at least {split_tokens_needed(seq_len)} tokens; "
            f"the {what} split has {tokens.size}"
        )
    rng = np.random.default_rng([seed, step])
    # Same offset range as random_windows: every window [s, s + seq_len] lies inside the data.
    starts = rng.integers(0, tokens.size - seq_len - 1, batch)
    if rows is not None:
        starts = starts[rows]
    # One fancy-index gather: on a memmap it reads only the pages the windows touch.
    windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int32)
    return windows[:, :-1], windows[:, 1:]


class Prefetcher:
    """Build and device-transfer batches for steps ``start..stop-1`` on a background thread.

    ``make(step)`` returns a dict of numpy arrays; the worker puts it where the step reads it with
    ``transfer(batch)`` (``jax.device_put``, or a copy to torch tensors on the device) and keeps
    at most ``depth`` batches ready. Iterating yields ``(step, transferred batch)`` in step
    order. An exception raised by ``make`` or the transfer is re-raised, unchanged, by the
    consumer's next ``next()``. ``close()`` (or leaving a ``with`` block) stops the worker
    promptly even when the consumer stops early.

    This is the JAX analogue of a PyTorch DataLoader with ``pin_memory`` and ``prefetch_factor``.
    It is written by hand because JAX has no built-in background host-to-device prefetcher for a
    single-process numpy pipeline: ``flax.jax_utils.prefetch_to_device`` only enqueues ahead on
    the consumer's own thread (host batch building still stalls the step) and stacks a leading
    per-device axis for ``pmap``; grain, Google's JAX data loader, is a heavy extra dependency
    and is not installed in this environment.
    """

    _POLL_S = 0.05  # how often a blocked put/get rechecks the stop flag / worker liveness

    def __init__(
        self,
        make: Callable[[int], Mapping[str, np.ndarray]],
        start: int,
        stop: int,
        *,
        transfer: Callable[[dict[str, np.ndarray]], Any],
        depth: int = 2,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1")
        if stop < start:
            raise ValueError(f"stop={stop} must be >= start={start}")
        self._make = make
        self._range = range(start, stop)
        self._transfer = transfer
        self._queue: queue.Queue[tuple[str, Any, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        # Daemon: a consumer that forgets close() must not keep the interpreter alive at exit.
        self._thread = threading.Thread(target=self._work, name="jaxmem-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[str, Any, Any]) -> bool:
        # A bounded put with a timeout, not a blocking one: if the consumer has stopped reading,
        # close() sets the flag and the worker notices within _POLL_S instead of blocking forever.
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            for step in self._range:
                if self._stop.is_set():
                    return
                host = dict(self._make(step))
                if not self._put(("batch", step, self._transfer(host))):
                    return
            self._put(("done", None, None))
        # BaseException too: whatever stops the worker must reach the consumer, or it would
        # wait for a batch that never comes.
        except BaseException as e:
            self._put(("error", None, e))

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self

    def __next__(self) -> tuple[int, Any]:
        while not self._finished:
            try:
                kind, step, payload = self._queue.get(timeout=self._POLL_S)
            except queue.Empty:
                # A worker that died without a final message (cannot happen short of interpreter
                # shutdown) must not leave the consumer polling forever.
                if self._stop.is_set() or (not self._thread.is_alive() and self._queue.empty()):
                    self._finished = True
                continue
            if kind == "batch":
                return step, payload
            self._finished = True
            if kind == "error":
                raise payload
        raise StopIteration

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the worker and join it (waiting at most ``timeout`` s for a running ``make``)."""
        self._stop.set()
        self._finished = True
        self._thread.join(timeout)
        # Drop queued device batches now rather than whenever this object is collected.
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

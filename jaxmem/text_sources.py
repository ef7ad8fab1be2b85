"""Text read as training tokens (pure: numpy, no JAX, no PyTorch): a text file, or every text
file under a directory, byte-tokenized or tokenized by a Hugging Face tokenizer
(``jaxmem.hf.tokenizer``); JSON Lines is recognized by its name or its first lines, refused
where a text file is named (``refuse_json_lines``) and skipped, and said, in a directory.

Split from ``jaxmem.data``, which reads these sources beside the embedded corpus and prepared
``.bin`` files (``load_dataset``, ``prepare_bin``); it imports only ``jaxmem.tokens``, so the
two never import each other.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from jaxmem.tokens import EOS, DataError, tokenize_documents


def _read_text_file(path: pathlib.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}; check its permissions") from e


JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")
_JSON_LINES_SNIFFED = 5  # the first non-empty lines that, all JSON objects, make a file JSON Lines


def _looks_like_json_lines(data: bytes) -> bool:
    """The first ``_JSON_LINES_SNIFFED`` non-empty lines (fewer in a shorter file, but at least
    two) are each a JSON object. Reads only those lines: plain text fails at its first
    character; one JSON object alone is not yet a format of records."""
    seen, start = 0, 0
    while seen < _JSON_LINES_SNIFFED and start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        line, start = data[start:end].strip(), end + 1
        if not line:
            continue
        if not line.startswith(b"{"):
            return False
        try:
            if not isinstance(json.loads(line), dict):
                return False
        except ValueError:  # not JSON (UnicodeDecodeError is a ValueError too)
            return False
        seen += 1
    return seen >= 2


def _is_json_records(data: bytes) -> bool:
    """JSON Lines, or one JSON object (a stray ``metadata.json``, a one-line ``{"a": 1}``):
    data, not text, where a directory of text is read."""
    if not data.lstrip().startswith(b"{"):
        return False
    if _looks_like_json_lines(data):
        return True
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


def refuse_json_lines(path: pathlib.Path, data: bytes | None = None) -> None:
    """Refuse JSON Lines where plain text is read: a file named ``*.jsonl`` / ``*.ndjson``, or
    (given its ``data``) one whose first non-empty lines are all JSON objects. Training on it as
    text would learn its braces and keys; instruction records are read by ``jaxmem prepare``
    (``jaxmem.instruct``), which writes them as token rows with a loss mask.

    Raises:
        DataError: ``path`` is JSON Lines.
    """
    by_name = data is None and path.suffix.lower() in JSON_LINES_SUFFIXES
    if by_name or (data is not None and _looks_like_json_lines(data)):
        how = f"named {path.suffix}" if by_name else "its first lines are JSON objects"
        raise DataError(
            f"{path} is JSON Lines ({how}): --data and a text directory read plain text; "
            f"prepare instruction records first: jaxmem prepare {path} --tokenizer DIR --out "
            "DATA, then train --data DATA"
        )


def is_json_lines(path: pathlib.Path) -> bool:
    """A file named ``*.jsonl`` / ``*.ndjson``, or whose first non-empty lines are JSON objects
    (read from its first 64 KiB)."""
    if path.suffix.lower() in JSON_LINES_SUFFIXES:
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return _looks_like_json_lines(head)


def _text_files(root: pathlib.Path) -> list[pathlib.Path]:
    """Non-hidden regular files under ``root``, in sorted path order."""
    found: list[pathlib.Path] = []
    # os.walk rather than rglob: it lets us prune hidden directories (.git, .venv, ...) instead
    # of walking them, and does not follow directory symlinks, so a link loop cannot hang us.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [
            pathlib.Path(dirpath, f)
            for f in filenames
            if not f.startswith(".") and os.path.isfile(os.path.join(dirpath, f))
        ]
    # Sort whole paths (not per-directory walk order) so the token stream is the same on every
    # filesystem, the same rule stdlib_files uses.
    return sorted(found)


def load_text_tokens(path: str | os.PathLike[str], tokenizer: Any = None) -> np.ndarray:
    """``text_tokens`` without what it skipped."""
    return text_tokens(path, tokenizer)[0]


def text_source(path: pathlib.Path, skipped: str) -> str:
    """How a text source is named in a run's and a prepared dataset's ``source``."""
    what = "directory" if path.is_dir() else "file"
    return f"text {what} {path}" + (f" ({skipped})" if skipped else "")


def text_tokens(path: str | os.PathLike[str], tokenizer: Any = None) -> tuple[np.ndarray, str]:
    """Byte tokens (``uint16``) of a text file, or of every text file under a directory; with a
    ``tokenizer`` (``jaxmem.hf.tokenizer``), its ids instead (files separated by its separator).

    Bytes are used as-is: the byte tokenizer needs no decoding, so text in any encoding (or
    invalid UTF-8) loads fine. A directory is walked recursively in sorted path order; files
    are separated by ``EOS`` (none after the last). Hidden files and directories (name starting
    with ``.``), empty files and files containing NUL bytes (almost surely binary: images,
    ``.pyc``, ``.bin`` token files) are skipped. A single named file that contains NUL bytes is
    rejected rather than skipped, because the caller asked for it explicitly. JSON Lines
    (``refuse_json_lines``) is refused where a file is named; in a directory, JSON Lines and
    JSON files are skipped (``directory_tokens``), said in the second value ("" for a file).

    Raises:
        DataError: the path does not exist, cannot be read, is binary, holds JSON Lines, or holds
            no text.
    """
    p = pathlib.Path(path)
    if not p.exists():
        raise DataError(f"data path {p} does not exist; pass an existing text file or directory")
    if p.is_file():
        refuse_json_lines(p)
        data = _read_text_file(p)
        refuse_json_lines(p, data)
        if not data:
            raise DataError(f"data file {p} contains no text; it is empty")
        if b"\0" in data:
            raise DataError(
                f"data file {p} contains NUL bytes, so it looks binary, not text; "
                "pass a text file (a pre-tokenized file must be named *.bin)"
            )
        if tokenizer is not None and tokenizer.name != "bytes":
            return tokenize_documents([data], tokenizer), ""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16), ""
    if not p.is_dir():
        raise DataError(f"data path {p} is neither a file nor a directory; pass a text file")
    return directory_tokens(p, tokenizer)


def directory_tokens(root: pathlib.Path, tokenizer: Any = None) -> tuple[np.ndarray, str]:
    """``load_text_tokens`` of a directory, and what it skipped: empty, binary (NUL bytes) and
    JSON files (named ``*.jsonl``/``*.ndjson``, or holding JSON records: ``_is_json_records``),
    said as ``"1 binary file(s) skipped; ..."`` ("" when none was)."""
    chunks: list[np.ndarray] = []
    texts: list[bytes] = []
    n_binary, json_files = 0, []
    for f in _text_files(root):
        if f.suffix.lower() in JSON_LINES_SUFFIXES:  # by name, before a byte is read
            json_files.append(f)
            continue
        data = _read_text_file(f)
        if not data:
            continue
        if b"\0" in data:
            n_binary += 1
            continue
        if _is_json_records(data):
            json_files.append(f)
            continue
        texts.append(data)
        if chunks:
            chunks.append(np.array([EOS], dtype=np.uint16))
        chunks.append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16))
    skipped = [f"{n_binary} binary file(s) skipped"] if n_binary else []
    if json_files:
        named = ", ".join(str(f.relative_to(root)) for f in json_files[:3])
        named += ", ..." if len(json_files) > 3 else ""
        skipped.append(f"{len(json_files)} JSON file(s) skipped ({named})")
    said = "; ".join(skipped)
    if not chunks:
        raise DataError(
            f"data directory {root} contains no text{f' ({said})' if said else ''}; "
            "it needs non-empty, non-hidden text files"
        )
    if tokenizer is not None and tokenizer.name != "bytes":
        return tokenize_documents(texts, tokenizer), said
    return np.concatenate(chunks), said

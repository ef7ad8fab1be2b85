"""Instruction data: JSON Lines records turned into token rows with a loss mask, written and read
as a prepared dataset (pure: numpy, no JAX, no PyTorch).

A record is ``{"prompt": str, "completion": str}`` or ``{"messages": [{"role", "content"}, ...]}``
(rendered with the tokenizer directory's chat template, ``jaxmem.hf.chat``). The loss counts only
the completion's tokens (a messages record: the assistant turns'). Every example is one row of
``seq_len + 1`` tokens, padded after its end: jaxmem's attention is plain causal, so rows packed
with several examples would let one attend to another; a padded row sees only itself, and its
pad tokens are out of the loss. An example longer than a row is cut at its end (counted); one
with no completion token left in its row is dropped (counted).

On disk, beside ``meta.json`` (``format: jaxmem-instruct-v1``, its tokenizer, seq_len and
counts): ``train.bin`` / ``val.bin`` hold the rows' token ids as ``jaxmem prepare`` writes text
(uint16, uint32 above 65,536 ids), ``train.mask.bin`` / ``val.mask.bin`` one uint8 per token:
1 where that token is a target the loss counts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import numpy as np

from jaxmem.config import ConfigError
from jaxmem.data import (
    BOS,
    EOS,
    PAD,
    VOCAB_SIZE,
    DataError,
    Dataset,
    bin_dtype,
    check_tokenizer,
    load_bin,
    read_meta,
    write_dataset,
)
from jaxmem.files import check_can_create, made_dirs

INSTRUCT_FORMAT = "jaxmem-instruct-v1"
MASK_DTYPE = np.dtype("u1")
SPLIT_FILES = ("train.bin", "val.bin", "train.mask.bin", "val.mask.bin")
RECORD_SHAPES = (
    'each line is {"prompt": "...", "completion": "..."} or '
    '{"messages": [{"role": "...", "content": "..."}, ...]}'
)


@dataclasses.dataclass(frozen=True)
class Example:
    """One record's token ids and, per token, whether the loss counts it as a target."""

    ids: np.ndarray
    counts: np.ndarray  # bool, like ids


# ------------------------------------------------------------------------------------ records
def _record_error(record: Any) -> str | None:
    """What is wrong with one parsed record (None: nothing)."""
    if not isinstance(record, dict):
        return f"a record is a JSON object, not {type(record).__name__}"
    if "messages" in record and ("prompt" in record or "completion" in record):
        return 'a record has "messages" or "prompt" and "completion", not both'
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return '"messages" must be a non-empty list of {"role", "content"} objects'
        for i, m in enumerate(messages):
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                return f'message {i} must be an object with "role" and "content" strings'
        if not any(m["role"] == "assistant" and m["content"] for m in messages):
            return 'no message has role "assistant" and some content: nothing to learn'
        return None
    missing = [k for k in ("prompt", "completion") if k not in record]
    if missing:
        return f"missing {' and '.join(repr(k) for k in missing)}"
    for key in ("prompt", "completion"):
        if not isinstance(record[key], str):
            return f"{key!r} must be a string, not {type(record[key]).__name__}"
    if not record["completion"]:
        return '"completion" is empty: nothing to learn'
    return None


def read_records(path: str | os.PathLike[str]) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of every non-empty line of the JSON Lines file ``path``.

    Raises:
        DataError: the file cannot be read, holds no record, or a line is not JSON or not a
            record of either shape (the file and the line number named).
    """
    p = pathlib.Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise DataError(f"cannot read data file {p}: {e.strerror}; check its permissions") from e
    except UnicodeDecodeError as e:
        raise DataError(f"{p} is not UTF-8 (byte {e.start}); JSON Lines files are UTF-8") from e
    records = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(
                f"{p} line {n}: invalid JSON ({e.msg} at column {e.colno}); {RECORD_SHAPES}"
            ) from None
        error = _record_error(record)
        if error is not None:
            raise DataError(f"{p} line {n}: {error}; {RECORD_SHAPES}")
        records.append((n, record))
    if not records:
        raise DataError(f"{p} holds no records; {RECORD_SHAPES}")
    return records


# ------------------------------------------------------------------------------- tokenizing
class Renderer:
    """Records into ``Example``s with ``tokenizer`` (``jaxmem.hf.tokenizer``) and, for messages
    records, the chat template of its directory."""

    def __init__(self, tokenizer: Any, source: pathlib.Path):
        self.tokenizer = tokenizer
        self.source = source
        self.directory = getattr(tokenizer, "directory", None)
        self.template = None  # compiled by check_template, for messages records only
        self.template_text: str | None = None
        self.specials: dict[str, str] = {}
        if self.directory is not None:
            from jaxmem.hf import chat

            self.specials = chat.special_tokens(self.directory)
            self.template_text = chat.chat_template(self.directory)
        self.head, self.tail = self._around()
        self.pad_id = self._special_id("pad_token", PAD if self.directory is None else None)

    def _special_id(self, name: str, default: int | None) -> int:
        tok = self.tokenizer
        found = self.specials.get(name)
        found_id = tok.token_id(found) if found is not None else None
        if found_id is not None:
            return found_id
        if default is not None:
            return default
        return tok.separator if tok.separator is not None else 0

    def _around(self) -> tuple[list[int], list[int]]:
        """The ids before and after a prompt/completion record: the post-processor's (a BOS
        before), and after the completion its EOS (the post-processor's, else the tokenizer's
        eos_token, else the model's eos_token_id; none when it has none)."""
        if self.directory is None:
            return [BOS], [EOS]
        head, tail = self.tokenizer.added_around()
        if not tail:
            eos = self.specials.get("eos_token")
            eos_id = self.tokenizer.token_id(eos) if eos is not None else None
            eos_id = eos_id if eos_id is not None else self.tokenizer.separator
            tail = [] if eos_id is None else [eos_id]
        return list(head), list(tail)

    def check_template(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        """A messages record needs a chat template that compiles (checked before anything is
        tokenized)."""
        first = next((n for n, r in records if "messages" in r), None)
        if first is None:
            return
        if self.template_text is not None:
            from jaxmem.hf.chat import ChatTemplate

            where = f"the chat template of {self.directory}"
            try:
                self.template = ChatTemplate(self.template_text, self.specials, where)
            except ConfigError as e:  # a messages record is where it is needed
                raise DataError(f"{self.source} line {first}: {e}") from None
            return
        where = (
            f'{self.directory} has no chat template: add "chat_template" to its '
            "tokenizer_config.json or a chat_template.jinja file"
            if self.directory is not None
            else "the byte tokenizer has none: give --tokenizer DIR, a directory with one"
        )
        raise DataError(
            f"{self.source} line {first}: a messages record is rendered with a chat template; "
            f"{where} (or write the records as prompt/completion)"
        )

    def example(self, line: int, record: dict[str, Any]) -> Example:
        if "messages" in record:
            return self._messages(line, record["messages"])
        tok = self.tokenizer
        prompt = np.asarray(tok.encode(record["prompt"]), np.int64)
        completion = np.asarray(tok.encode(record["completion"]), np.int64)
        head, tail = np.asarray(self.head, np.int64), np.asarray(self.tail, np.int64)
        ids = np.concatenate([head, prompt, completion, tail])
        counts = np.zeros(ids.size, bool)
        counts[head.size + prompt.size :] = True
        return Example(ids, counts)

    def _messages(self, line: int, messages: list[dict[str, Any]]) -> Example:
        assert self.template is not None
        try:
            text, spans = self.template.render(messages)
            if not self.template.generation_tags:
                spans = self._prefix_spans(line, messages, text)
        except self.template.errors as e:
            raise DataError(
                f"{self.source} line {line}: the chat template of {self.directory} refused the "
                f"conversation ({str(e).strip()[:160]}); fix the record"
            ) from None
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        return Example(np.asarray(ids, np.int64), _span_mask(offsets, spans))

    def _prefix_spans(self, line: int, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """The assistant turns' character spans found by rendering the conversation up to each
        one: from the end of the text before it (with the generation prompt) to the end of the
        text with it, which takes in what the template writes after the turn (its end-of-turn)."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.template.render(messages[:i], add_generation_prompt=True)[0]
            through = self.template.render(messages[: i + 1])[0]
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(
                    f"{self.source} line {line}: the chat template of {self.directory} does not "
                    f"render this conversation prefix by prefix (turn {i} changes the text before "
                    "it), so its assistant tokens cannot be found; mark them with {% generation "
                    "%}...{% endgeneration %} in the template"
                )
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return spans


def _span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """Tokens overlapping a character span (transformers' ``assistant_masks`` rule)."""
    counts = np.zeros(len(offsets), bool)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        counts[i] = end > spans[k][0]
    return counts


# ------------------------------------------------------------------------------------ rows
@dataclasses.dataclass(frozen=True)
class Rows:
    """Examples as ``[n, seq_len + 1]`` token rows and their masks (1: a target the loss
    counts), with what fitting them into rows did."""

    ids: np.ndarray
    mask: np.ndarray
    examples: int
    truncated: int  # longer than a row: cut at the row's end
    dropped: int  # no completion token left in the row


def to_rows(examples: list[Example], seq_len: int, pad_id: int) -> Rows:
    width = seq_len + 1
    ids, mask, truncated, dropped = [], [], 0, 0
    for ex in examples:
        if ex.ids.size > width:
            truncated += 1
        row_ids, row_counts = ex.ids[:width], ex.counts[:width].copy()
        row_counts[0] = False  # the first token is never a target
        if not row_counts.any():
            dropped += 1
            continue
        pad = width - row_ids.size
        ids.append(np.concatenate([row_ids, np.full(pad, pad_id, np.int64)]))
        mask.append(np.concatenate([row_counts, np.zeros(pad, bool)]))
    shape = (len(ids), width)
    return Rows(
        np.array(ids, np.int64).reshape(shape),
        np.array(mask, MASK_DTYPE).reshape(shape),
        len(examples),
        truncated,
        dropped,
    )


def rows_batch(
    dataset: Dataset,
    split: str,
    step: int,
    batch: int,
    seed: int,
    rows: slice | None = None,
) -> dict[str, np.ndarray]:
    """Batch ``step`` of instruction data: ``batch`` rows of ``split`` (``train`` or ``val``)
    drawn by ``np.random.default_rng([seed, step])`` (a pure function of them, as text batches
    are), as int32 ``inputs``, ``targets`` and ``mask`` ``[B, seq_len]``; ``rows``: only those
    rows of the batch."""
    tokens, mask = (
        (dataset.train, dataset.train_mask) if split == "train" else (dataset.val, dataset.val_mask)
    )
    width = dataset.seq_len + 1
    n_rows = tokens.size // width
    picks = np.random.default_rng([seed, step]).integers(0, n_rows, batch)
    if rows is not None:
        picks = picks[rows]
    index = picks[:, None] * width + np.arange(width)
    window = np.asarray(tokens[index], dtype=np.int32)
    counts = np.asarray(mask[index[:, 1:]], dtype=np.int32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:], "mask": counts}


# ---------------------------------------------------------------------------- prepare, load
def prepare_instruct(
    src: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Any,
    seq_len: int,
    val_fraction: float = 0.05,
) -> dict[str, Any]:
    """``src`` (JSON Lines) into ``out_dir`` as instruction data (see the module docstring);
    returns ``meta.json``'s contents. Every record is checked before any is tokenized, and
    nothing is written unless all of them are good.

    Raises:
        ConfigError: ``out_dir`` cannot be made or written.
        DataError: a bad record (its line named), too few examples, existing files in
            ``out_dir``, or a failed write.
    """
    from jaxmem.hf.tokenizer import ByteTokenizer

    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
    source, out = pathlib.Path(src), pathlib.Path(out_dir)
    check_can_create(out, "--out")
    existing = [n for n in SPLIT_FILES if (out / n).exists()]
    if existing:
        raise DataError(
            f"{out} already contains {' and '.join(existing)}; choose another --out or delete them"
        )
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    records = read_records(source)
    renderer = Renderer(tokenizer, source)
    renderer.check_template(records)
    rows = to_rows([renderer.example(n, r) for n, r in records], seq_len, renderer.pad_id)
    n_rows = rows.ids.shape[0]
    if n_rows < 2:
        raise DataError(
            f"{source} gives {n_rows} example(s) with a completion token within --seq-len "
            f"{seq_len} ({rows.dropped} dropped); at least 2 are needed (train and validation): "
            "give more records or a longer --seq-len"
        )
    n_val = max(1, int(n_rows * val_fraction))
    vocab = tokenizer.vocab_size
    dtype = bin_dtype(vocab)
    split = {"train": slice(0, n_rows - n_val), "val": slice(n_rows - n_val, n_rows)}
    meta = {
        "format": INSTRUCT_FORMAT,
        "kind": "instruction",
        "dtype": dtype.name,
        "vocab_size": vocab,
        "tokenizer": tokenizer.name,
        "seq_len": seq_len,
        "pad_id": int(renderer.pad_id),
        "train_rows": n_rows - n_val,
        "val_rows": n_val,
        "train_tokens": (n_rows - n_val) * (seq_len + 1),
        "val_tokens": n_val * (seq_len + 1),
        "train_loss_tokens": int(rows.mask[split["train"]].sum()),
        "val_loss_tokens": int(rows.mask[split["val"]].sum()),
        "examples": rows.examples,
        "truncated": rows.truncated,
        "dropped": rows.dropped,
        "assistant_tokens": _how_assistant(renderer, records),
        "source": f"instruction file {source.resolve()}",
    }
    arrays = {}
    for name, part in split.items():
        arrays[f"{name}.bin"] = rows.ids[part].ravel().astype(dtype)
        arrays[f"{name}.mask.bin"] = rows.mask[part].ravel()
    try:
        with made_dirs(out):
            write_dataset(out, arrays, meta)
    except OSError as e:
        raise DataError(
            f"cannot write {out}: {e.strerror or e}; check its space and permissions"
        ) from e
    return meta


def _how_assistant(renderer: Renderer, records: list[tuple[int, dict]]) -> str | None:
    if not any("messages" in r for _, r in records):
        return None
    assert renderer.template is not None
    if renderer.template.generation_tags:
        return "{% generation %} blocks of the chat template"
    return "the chat template rendered prefix by prefix"


def instruction_dir(path: str | os.PathLike[str] | None) -> pathlib.Path | None:
    """The prepared instruction data ``path`` names (the directory, or its ``train.bin``), None
    when it names something else."""
    if path is None:
        return None
    p = pathlib.Path(path)
    directory = p if p.is_dir() else p.parent if p.is_file() and p.suffix == ".bin" else None
    if directory is None or not (directory / "train.bin").is_file():
        return None
    meta = read_meta(directory)
    return directory if meta is not None and meta.get("kind") == "instruction" else None


def load_instruction(
    directory: pathlib.Path, vocab_size: int = VOCAB_SIZE, tokenizer: Any = None
) -> Dataset:
    """The instruction data ``prepare_instruct`` wrote in ``directory``, made with
    ``tokenizer`` (None: bytes).

    Raises:
        DataError: another tokenizer made it, a file is missing, or the files disagree with
            each other or ``meta.json``.
    """
    check_tokenizer(directory, tokenizer)
    meta = read_meta(directory) or {}
    seq_len = meta.get("seq_len")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"{directory / 'meta.json'} names no seq_len; re-run prepare")
    splits = {}
    for name in ("train", "val"):
        tokens = load_bin(directory / f"{name}.bin", vocab_size)
        mask_path = directory / f"{name}.mask.bin"
        if not mask_path.is_file():
            raise DataError(f"{mask_path} is missing; re-run prepare")
        mask = np.memmap(mask_path, dtype=MASK_DTYPE, mode="r")
        if mask.size != tokens.size or tokens.size % (seq_len + 1):
            raise DataError(
                f"{mask_path} holds {mask.size} mask bytes for {tokens.size} tokens in rows of "
                f"{seq_len + 1}; the files are out of sync, re-run prepare"
            )
        splits[name] = (tokens, mask)
    return Dataset(
        splits["train"][0],
        splits["val"][0],
        f"instruction data in {directory} (rows of {seq_len} + 1 tokens, loss on completions)",
        train_mask=splits["train"][1],
        val_mask=splits["val"][1],
        seq_len=seq_len,
    )

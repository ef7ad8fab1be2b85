"""``jaxmem prepare``: text into nanoGPT-style ``train.bin`` / ``val.bin`` for --data (byte
tokens, or a Hugging Face model directory's ``tokenizer.json`` with ``--tokenizer DIR``), and
JSON Lines instruction records into token rows with a loss mask (``jaxmem.instruct``)."""

from __future__ import annotations

import argparse

from jaxmem.cli.common import UsageError, positive_float, positive_int, usage_errors
from jaxmem.job import RunConfig


def add_parser(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize text into nanoGPT-style train.bin / val.bin for --data",
        description="Tokenize a text file or a directory of text files (or, with no source, "
        "the embedded Python-stdlib corpus) into train.bin and val.bin (raw little-endian "
        "uint16, nanoGPT's format; uint32 for a vocabulary above 65,536 ids) plus meta.json, "
        "which names the tokenizer; the last --val-fraction is validation data, and each split "
        "must hold a --seq-len sequence. A JSON Lines file (.jsonl, .ndjson) is instruction data: "
        'records {"prompt", "completion"} or {"messages"} (rendered with DIR\'s chat template) '
        "become one row of --seq-len + 1 tokens each, with a loss mask on the completion "
        "(train.mask.bin, val.mask.bin). In a directory of text, JSON Lines, JSON and binary files "
        "are skipped (and said). Bytes by "
        "default; --tokenizer DIR uses DIR's tokenizer.json (needs jaxmem[hf]). Existing files "
        "are never overwritten.",
    )
    p.add_argument(
        "source",
        nargs="?",
        default=None,
        help="text file or directory, or a JSON Lines file of instruction records (default: "
        "the corpus)",
    )
    p.add_argument("--out", required=True, help="directory for train.bin, val.bin, meta.json")
    p.add_argument("--val-fraction", type=positive_float, default=0.05, help="default 0.05")
    p.add_argument(
        "--seq-len",
        type=positive_int,
        default=RunConfig.seq_len,
        help="the sequence length the data is for: each split must hold one sequence of it "
        f"plus 2 tokens, or nothing is written (default {RunConfig.seq_len}, train's)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a Hugging Face model directory whose tokenizer.json tokenizes the text "
        "(default: bytes)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxmem.data import DataError, prepare_bin

    tokenizer = None
    if args.tokenizer is not None:
        from jaxmem.hf.tokenizer import HFTokenizer, has_tokenizer

        if not has_tokenizer(args.tokenizer):
            raise UsageError(
                f"--tokenizer {args.tokenizer}: no tokenizer.json there; give a Hugging Face "
                "model directory that has one (or leave --tokenizer out for bytes)"
            )
        with usage_errors():
            tokenizer = HFTokenizer(args.tokenizer)
    if args.source is not None and _is_instruction_file(args.source):
        return _prepare_instruct(args, tokenizer)
    with usage_errors(DataError):
        meta = prepare_bin(
            args.source,
            args.out,
            val_fraction=args.val_fraction,
            tokenizer=tokenizer,
            seq_len=args.seq_len,
        )
    what = "byte tokens" if tokenizer is None else f"tokens of {tokenizer.description}"
    hint = f" --init-from {args.tokenizer}" if tokenizer is not None else ""
    hint += f" --seq-len {args.seq_len}" if args.seq_len != RunConfig.seq_len else ""
    print(
        f"wrote {args.out}/train.bin ({meta['train_tokens']:,} tokens), val.bin "
        f"({meta['val_tokens']:,} tokens), meta.json: {meta['dtype']} {what} from "
        f"{meta['source']}; train with: jaxmem train --data {args.out}{hint}"
    )
    return 0


def _is_instruction_file(source: str) -> bool:
    import pathlib

    from jaxmem.text_sources import is_json_lines

    path = pathlib.Path(source)
    return path.is_file() and is_json_lines(path)


def _prepare_instruct(args: argparse.Namespace, tokenizer) -> int:
    from jaxmem.data import DataError
    from jaxmem.instruct import prepare_instruct

    with usage_errors(DataError):
        meta = prepare_instruct(
            args.source,
            args.out,
            tokenizer=tokenizer,
            seq_len=args.seq_len,
            val_fraction=args.val_fraction,
        )
    what = "byte tokens" if tokenizer is None else f"tokens of {tokenizer.description}"
    hint = f" --init-from {args.tokenizer}" if tokenizer is not None else ""
    how = meta["assistant_tokens"]
    rows = {
        s: f"{meta[f'{s}_rows']:,} row{'s' * (meta[f'{s}_rows'] != 1)}" for s in ("train", "val")
    }
    print(
        f"wrote {args.out}/train.bin + train.mask.bin ({rows['train']}, "
        f"{meta['train_loss_tokens']:,} loss tokens), val.bin + val.mask.bin "
        f"({rows['val']}, {meta['val_loss_tokens']:,} loss tokens), meta.json: "
        f"{meta['examples']:,} examples as rows of {meta['seq_len']} + 1 {what}, "
        f"{meta['truncated']:,} cut to fit, {meta['dropped']:,} dropped (no completion token "
        f"within the row)" + (f"; assistant tokens from {how}" if how else "") + "; train with: "
        f"jaxmem train --data {args.out}{hint} --seq-len {meta['seq_len']}"
    )
    return 0

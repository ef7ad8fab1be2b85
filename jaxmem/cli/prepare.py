"""``jaxmem prepare``: text into nanoGPT-style ``train.bin`` / ``val.bin`` for --data (byte
tokens, or a Hugging Face model directory's ``tokenizer.json`` with ``--tokenizer DIR``)."""

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
        "must hold a --seq-len sequence. Text only: JSON Lines is refused (skipped, and said, "
        "in a directory, as JSON and binary files are). Bytes by "
        "default; --tokenizer DIR uses DIR's tokenizer.json (needs jaxmem[hf]). Existing files "
        "are never overwritten.",
    )
    p.add_argument(
        "source", nargs="?", default=None, help="text file or directory (default: the corpus)"
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

"""``jaxmem prepare``: text into nanoGPT-style uint16 ``train.bin`` / ``val.bin`` for --data."""

from __future__ import annotations

import argparse

from jaxmem.cli.common import positive_float, usage_errors


def add_parser(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize text into nanoGPT-style uint16 train.bin / val.bin for --data",
        description="Byte-tokenize a text file or a directory of text files (or, with no "
        "source, the embedded Python-stdlib corpus) into train.bin and val.bin (raw little-endian "
        "uint16, nanoGPT's format) plus meta.json; the last --val-fraction is validation data. "
        "Existing files are never overwritten.",
    )
    p.add_argument(
        "source", nargs="?", default=None, help="text file or directory (default: the corpus)"
    )
    p.add_argument("--out", required=True, help="directory for train.bin, val.bin, meta.json")
    p.add_argument("--val-fraction", type=positive_float, default=0.05, help="default 0.05")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxmem.data import DataError, prepare_bin

    with usage_errors(DataError):
        meta = prepare_bin(args.source, args.out, val_fraction=args.val_fraction)
    print(
        f"wrote {args.out}/train.bin ({meta['train_tokens']:,} tokens), val.bin "
        f"({meta['val_tokens']:,} tokens), meta.json: uint16 byte tokens from {meta['source']}; "
        f"train with: jaxmem train --data {args.out}"
    )
    return 0

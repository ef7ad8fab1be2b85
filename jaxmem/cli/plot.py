"""``jaxmem plot``: the loss curves of several runs (e.g. ``--framework jax`` and ``torch``) on
one plot."""

from __future__ import annotations

import argparse
import os
import sys

from jaxmem.cli.common import UsageError, check_writable, usage_errors

FORMATS = (".png", ".pdf", ".svg")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plot", help="loss curves of several runs (e.g. --framework jax and torch) on one plot"
    )
    p.add_argument("runs", nargs="+", help="run directories written by jaxmem train --out")
    p.add_argument(
        "--out", default="loss_curves.png", help="a .png, .pdf or .svg (default loss_curves.png)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxmem.train.run_dir import finite_losses, plot_losses

    out = _out_path(args.out)
    runs, notes = [], []
    for run_dir in args.runs:
        label, records, note = _read_run(run_dir)
        if note:
            notes.append(note)
        finite = finite_losses(records)
        if not finite:
            raise UsageError(
                f"{run_dir}: none of its {len(records)} logged losses is finite (the run "
                "diverged from its first step): nothing to plot"
            )
        if finite < len(records):
            notes.append(f"{run_dir}: {len(records) - finite} non-finite loss(es) left out")
        runs.append((label, records))
    plot_losses(runs, out)
    for note in notes:
        print(note, file=sys.stderr)
    print(f"wrote {out}: loss curves of {len(runs)} run(s)")
    return 0


def _out_path(out: str) -> str:
    if os.path.isdir(out):
        raise UsageError(f"--out {out} is a directory; give a file name")
    ext = os.path.splitext(out)[1].lower()
    if not ext:
        out += ".png"
    elif ext not in FORMATS:
        raise UsageError(f"--out {out}: give a {', '.join(FORMATS)} file")
    check_writable(out, "--out")
    return out


def _read_run(run_dir: str) -> tuple[str, list, str | None]:
    """A run's label, its step records, and a note when lines could not be read."""
    from jaxmem.job import read_config_file
    from jaxmem.train.run_dir import read_metrics

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UsageError(f"{run_dir} has no metrics.jsonl; give run directories of jaxmem train")
    records, partial = read_metrics(path)
    note = (
        f"{path}: skipped {partial} unreadable line(s) (a run killed mid-write)"
        if partial
        else None
    )
    if not records:
        raise UsageError(f"{path} holds no step yet; the run logged nothing")
    label = os.path.basename(os.path.normpath(run_dir))
    config = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(config):
        with usage_errors():
            framework = read_config_file(config).get("run", {}).get("framework", "jax")
        label = f"{label} ({framework})"
    return label, records, note

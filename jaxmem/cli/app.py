"""``jaxmem``'s parser (one sub-command per module) and ``main``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import jaxmem.cli.bench as bench
import jaxmem.cli.capture_target as capture_target
import jaxmem.cli.export as export
import jaxmem.cli.memory as memory
import jaxmem.cli.parity as parity
import jaxmem.cli.peak as peak
import jaxmem.cli.plan as plan
import jaxmem.cli.plot as plot
import jaxmem.cli.prepare as prepare
import jaxmem.cli.presets as presets
import jaxmem.cli.seed_example as seed_example
import jaxmem.cli.train as train
from jaxmem import __version__
from jaxmem.cli.common import EXIT_USAGE, Parser, UsageError

# in the order `jaxmem --help` lists them
COMMANDS = (
    train,
    memory,
    plan,
    peak,
    parity,
    bench,
    presets,
    prepare,
    export,
    plot,
    capture_target,
    seed_example,
)


# the README's first two jaxmem commands: train a tiny model, then measure a step's memory
START_HERE = (
    "start here: train a tiny model on the CPU, then see what its step keeps under each policy\n"
    "  jaxmem train --preset tiny --policy selective --steps 50 --batch-size 8 --seq-len 64 \\\n"
    "      --out runs/quickstart\n"
    "  jaxmem memory --preset tiny --policies none,selective,full"
)


def build_parser() -> Parser:
    parser = Parser(
        prog="jaxmem",
        description="Decide, prove and run the cheapest memory strategy for training a "
        "transformer,\nin JAX (Flax NNX) and PyTorch.",
        epilog=START_HERE,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the commands as typed
    )
    parser.add_argument("--version", action="version", version=f"jaxmem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from jaxmem.backend import contain_cuda_plugin, quiet_xla_warnings

    quiet_xla_warnings()  # before JAX loads (it loads lazily, in the commands)
    contain_cuda_plugin()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args) or 0
    except UsageError as e:
        message = f"jaxmem {args.command}: error: {e}\n"
        _end_torch_worker(EXIT_USAGE, message)
        parser.exit(EXIT_USAGE, message)
    _end_torch_worker(code)
    return code


def _end_torch_worker(code: int, message: str = "") -> None:
    """A torch run that joined torchrun's process group ends here (``end_worker``: the
    interpreter's teardown would free gloo's groups under its threads); others return."""
    distributed = sys.modules.get("torch_ref.distributed")  # imported only by torch runs
    if distributed is None or not distributed.joined():
        return
    sys.stderr.write(message)
    distributed.end_worker(code)

"""The ``jaxmem`` command line: one module per command (``train``, ``memory``, ``plan``,
``peak``, ``parity``, ``bench``, ...), the step flags declared once and resolved into a
``jaxmem.job.JobConfig`` the same way by every command (``flags``), the checks and errors they
share (``common``) and the tables they print (``render``). The only package that parses flags.

Bad input gets one line on stderr naming the value and the fix, and exit code 2; nothing is
written before the input has been validated. The package imports only jaxmem's pure modules at
start; each command imports what it runs. Commands that compare with PyTorch say, in one line,
that they need the ``torch`` extra when it is missing.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxmem.cli.common import EXIT_INTERRUPTED, EXIT_PARITY_FAILED, EXIT_RUN_FAILED, EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``jaxmem`` with ``argv`` (default: the process's arguments); returns the exit code
    (bad input exits with 2 through ``SystemExit``)."""
    from jaxmem.cli.app import main as run

    return run(argv)


def build_parser():
    """The ``jaxmem`` argument parser, every command on it."""
    from jaxmem.cli.app import build_parser as build

    return build()


__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_PARITY_FAILED",
    "EXIT_RUN_FAILED",
    "EXIT_USAGE",
    "build_parser",
    "main",
]

"""Figures as printed: a number, what it is, and how it was obtained (pure: no JAX, no PyTorch).

Nothing is reported that was not measured or counted, and every figure carries its method
(``source``), e.g. ``counted (arrays)``, ``residual accounting (jaxpr of jax.vjp)``,
``compiled plan (XLA:CPU memory_analysis)``, ``runtime peak (device.memory_stats)``,
``OS (getrusage ru_maxrss)``.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Figure:
    """One line of a memory table."""

    quantity: str
    nbytes: int
    source: str


def format_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render_table(figures: Sequence[Figure], title: str) -> Any:
    """A rich table of figures, each with how it was obtained."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("quantity")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right")
    table.add_column("how obtained")
    for f in figures:
        table.add_row(f.quantity, f"{f.nbytes:,}", format_bytes(f.nbytes), f.source)
    return table


def process_max_rss_bytes() -> int:
    """The process's peak resident set size (``getrusage``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


RSS_FIGURE_SOURCE = "OS (getrusage ru_maxrss)"


def rss_figure() -> Figure:
    return Figure(
        "process max RSS (whole process, host)", process_max_rss_bytes(), RSS_FIGURE_SOURCE
    )

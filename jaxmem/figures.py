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


TABLE_WIDTH = 100  # columns a table printed for people fits in


def render_table(figures: Sequence[Figure], title: str) -> Any:
    """A rich table of figures, each with how it was obtained: the methods are numbered in
    the table and written out once below it (several figures share one), so a table fits
    ``TABLE_WIDTH`` columns with every digit of its byte counts (which never wrap)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    methods = list(dict.fromkeys(f.source for f in figures))
    table = Table(title=title)
    table.add_column("quantity")
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("how", justify="right", no_wrap=True)
    for f in figures:
        number = methods.index(f.source) + 1
        table.add_row(f.quantity, f"{f.nbytes:,}", format_bytes(f.nbytes), f"[{number}]")
    legend = Table.grid(padding=(0, 1))  # a long method wraps under itself
    legend.add_column(no_wrap=True)
    legend.add_column()
    for number, method in enumerate(methods, 1):
        legend.add_row(f" [{number}]", Text(method))
    return Group(table, Text("how obtained:"), legend)


def process_max_rss_bytes() -> int:
    """The process's peak resident set size (``getrusage``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


RSS_FIGURE_SOURCE = "OS (getrusage ru_maxrss)"


def rss_figure() -> Figure:
    return Figure(
        "process max RSS (whole process, host)", process_max_rss_bytes(), RSS_FIGURE_SOURCE
    )

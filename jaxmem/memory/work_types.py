"""What the two readers of a step's work count into (``jaxmem.memory.work``): a matmul's shape
(``Matmul``), a program's or a part's work (``Work``), a weighted sum of parts (``combine``),
and what both readers share: the tally of their counters into a ``Work`` and a dot's
(batch, m, n, k) from its operands' shapes and dimension numbers.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True, order=True)
class Matmul:
    """One matmul's shape: ``batch`` products of [m, k] x [k, n]."""

    batch: int
    m: int
    n: int
    k: int
    dtype: str  # the operands' element type (the rate it runs at)
    bytes: int  # operands read and result written

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


@dataclasses.dataclass(frozen=True)
class Work:
    """What one step (or a part of it) does, counted from a program."""

    matmuls: tuple[tuple[Matmul, int], ...] = ()  # (shape, how many times it runs)
    memory_bytes: int = 0  # read + written by memory-bound kernels (device memory)
    memory_kernels: int = 0  # how many memory-bound kernels run (launches)
    attention_flops: int = 0  # fused attention kernels (cuDNN): FLOPs
    attention_bytes: int = 0  # and bytes
    attention_dtype: str = "bfloat16"
    to_host_bytes: int = 0  # device -> host memory copies
    from_host_bytes: int = 0  # host -> device memory copies
    host_compute_bytes: int = 0  # read + written by work XLA runs on the host
    # (kind, bytes each device sends); a kind ends in " (neighbours)" where each group is
    # consecutive devices (jaxmem's tensor axis; the data axis when there is no other)
    collective_bytes: tuple[tuple[str, int], ...] = ()
    unknown_loops: int = 0  # loops without a known trip count (counted once)
    source: str = ""

    @property
    def matmul_flops(self) -> int:
        return sum(m.flops * n for m, n in self.matmuls)

    @property
    def flops(self) -> int:
        return self.matmul_flops + self.attention_flops

    @property
    def collective_total(self) -> int:
        return sum(b for _, b in self.collective_bytes)


def combine(parts: Iterable[tuple[Work, int]], source: str = "") -> Work:
    """Σ count · work over ``parts`` (counts may be negative for an affine fit's difference;
    the result's counts must not be)."""
    matmuls: collections.Counter = collections.Counter()
    coll: collections.Counter = collections.Counter()
    totals: collections.Counter = collections.Counter()
    dtype = "bfloat16"
    for work, count in parts:
        for m, n in work.matmuls:
            matmuls[m] += n * count
        for kind, b in work.collective_bytes:
            coll[kind] += b * count
        for f in _TOTALS:
            totals[f] += getattr(work, f) * count
        if work.attention_flops:
            dtype = work.attention_dtype
    return tallied(matmuls, totals, coll, source, dtype)


_TOTALS = (
    "memory_bytes", "memory_kernels", "attention_flops", "attention_bytes", "to_host_bytes",
    "from_host_bytes", "host_compute_bytes", "unknown_loops",
)  # fmt: skip


def tallied(
    matmuls: collections.Counter,
    totals: collections.Counter,
    collectives: collections.Counter,
    source: str,
    attention_dtype: str = "bfloat16",
) -> Work:
    """The ``Work`` of a reader's counters: matmul counts by shape, the totals by field name
    (``Work``'s integer fields), collective bytes by kind; zero counts left out."""
    return Work(
        matmuls=tuple(sorted((m, n) for m, n in matmuls.items() if n)),
        collective_bytes=tuple(sorted((k, b) for k, b in collectives.items() if b)),
        attention_dtype=attention_dtype,
        source=source,
        **{f: int(totals[f]) for f in _TOTALS},
    )


def dot_shape(
    lhs: tuple[int, ...], rhs: tuple[int, ...], lb, lc, rb, rc
) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a dot of operands shaped ``lhs`` and ``rhs`` with batch dimensions
    ``lb``/``rb`` and contracting dimensions ``lc``/``rc``."""
    batch = math.prod(lhs[d] for d in lb)
    k = math.prod(lhs[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs) if d not in lb and d not in lc)
    n = math.prod(s for d, s in enumerate(rhs) if d not in rb and d not in rc)
    return batch, m, n, k

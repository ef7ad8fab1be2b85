"""What a step's kernels do: matmul shapes, bytes of memory-bound work, host and collective
traffic. The input of every step-time estimate (``jaxmem.memory.step_time``).

Two readers, one result (``Work``):

- ``work_of_hlo(text)``: the optimized HLO of a compiled program (``compiled.as_text()``), the
  program the target runs after fusion, rematerialisation and scheduling: per kernel it
  launches, a matmul (a dot fusion, a cuBLAS custom call or an unfused dot) is a shape (batch,
  m, n, k) and the bytes of its operands and result; a fused attention kernel (cuDNN) its FLOPs
  and bytes; every other fusion or op that touches memory the bytes it reads and writes
  (an operand only sliced inside a fusion counts its slices, an in-place update its update);
  copies to and from host memory (memory space 5) the bytes each way; collectives their bytes
  by kind; work XLA runs on the host (``compute_on("device_host")``) its bytes apart. A loop
  with a known trip count (a scan) counts its body that many times; a conditional its
  costliest branch.
- ``work_of_jaxpr(jaxpr)``: the same from a jaxpr, before any compile (``jaxmem plan`` orders
  candidates by it). Matmuls are read exactly; memory-bound bytes assume XLA fuses every
  elementwise chain: a value is read from or written to memory only where it crosses between
  fusible work (elementwise ops, broadcasts, reshapes, reductions, jitted calls made of them)
  and anything else (a matmul, a loop, a gather or scatter, an argument or result); a cast of
  a value already in memory read only by matmuls runs inside them; a scan adds what XLA's loop
  adds (each stacked output zero-initialised and written into its slot, each stacked input a
  matmul reads copied out). Its matmul and attention FLOPs equal the compiled plan's; its
  memory-bound bytes are a model of XLA's fusion (within 10 % of the compiled plan's step time
  on gpt2-124m and Llama: ``benchmarks/results/mfu``).

Written by hand: XLA's own ``cost_analysis()`` is absent from a deviceless compile (None) and
on XLA:CPU counts a loop body once whatever its trip count; the jaxpr has no fusion at all.

This module is the readers' one front: the result types live in ``work_types``, the HLO text's
reader in ``work_hlo``, the jaxpr's in ``work_jaxpr``.
"""

from jaxmem.memory.work_hlo import HOST_SPACE, work_of_hlo
from jaxmem.memory.work_jaxpr import Traced, at_rows, trace_jaxpr, work_of_jaxpr
from jaxmem.memory.work_types import Matmul, Work, combine

__all__ = [
    "HOST_SPACE",
    "Matmul",
    "Traced",
    "Work",
    "at_rows",
    "combine",
    "trace_jaxpr",
    "work_of_hlo",
    "work_of_jaxpr",
]

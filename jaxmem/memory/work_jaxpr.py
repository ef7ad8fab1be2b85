"""A jaxpr's work, before XLA compiles it (``work_of_jaxpr``; ``jaxmem plan`` orders candidates
by it): matmuls read exactly, memory-bound bytes from a model of XLA's fusion (what it assumes:
``jaxmem.memory.work``). ``trace_jaxpr`` keeps the matmuls in program order, so that
``at_rows`` can extrapolate a trace at one and two rows to any number of rows.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from jaxmem.memory.work_types import Matmul, Work, dot_shape, tallied

# Work XLA fuses: elementwise ops, broadcasts, reshapes, reductions, casts, slices. A value
# crosses memory only between these and anything else (a matmul, a loop, a call, a gather or
# scatter, an argument or result).
_FUSIBLE = {
    "abs", "acos", "add", "and", "argmax", "argmin", "asin", "atan", "atan2", "broadcast_in_dim",
    "cbrt", "ceil", "clamp", "concatenate", "convert_element_type", "copy", "copy_p", "cos",
    "cosh", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expand_dims", "expm1",
    "floor", "ge", "gt", "imag", "integer_pow", "iota", "is_finite", "le", "lgamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or",
    "pad", "population_count", "pow", "real", "reduce_and", "reduce_max", "reduce_min",
    "reduce_or", "reduce_precision", "reduce_prod", "reduce_sum", "rem", "reshape", "rev",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sinh", "slice", "sqrt", "square", "squeeze",
    "stop_gradient", "sub", "tan", "tanh", "transpose", "xor", "dynamic_slice",
    "dynamic_update_slice", "split", "name", "optimization_barrier", "add_any",
}  # fmt: skip
# casts and layout changes XLA fuses into a matmul's operand
_PROLOGUE = {
    "convert_element_type", "transpose", "reshape", "broadcast_in_dim", "squeeze",
    "expand_dims", "copy", "copy_p",
}  # fmt: skip


def _aval_nbytes(v: Any) -> int:
    aval = getattr(v, "aval", None)
    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0
    import numpy as np

    return int(math.prod(shape) * np.dtype(aval.dtype).itemsize)


def _jaxpr_dot(eqn: Any) -> Matmul:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    shape = dot_shape(tuple(lhs.shape), tuple(rhs.shape), lb, lc, rb, rc)
    io = sum(_aval_nbytes(v) for v in (*eqn.invars[:2], *eqn.outvars))
    return Matmul(*shape, dtype=str(lhs.dtype), bytes=io)


def _sub_jaxprs(eqn: Any) -> list[Any]:
    out = []
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            out.append(getattr(sub, "jaxpr", sub))
            break
    return out


@dataclasses.dataclass(frozen=True)
class _Flow:
    """Where one jaxpr's values come from and go, as the fusion model needs it: the values
    fusible work makes (``fused``: they stay inside a fusion), each value's consumers, the
    jaxpr's results, and the casts and layout changes that run inside the matmuls reading them
    (``absorbed``: their equations' ids)."""

    fused: set[Any]
    consumers: dict[Any, list[Any]]
    outvars: set[Any]
    absorbed: set[int]

    @classmethod
    def of(cls, jaxpr: Any) -> _Flow:
        fused: set[Any] = set()
        consumers: dict[Any, list[Any]] = collections.defaultdict(list)
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if not _is_literal(v):
                    consumers[v].append(eqn)
            if _fusible(eqn):
                fused.update(eqn.outvars)
        outvars = {v for v in jaxpr.outvars if not _is_literal(v)}
        # a cast or layout change of a value that is already in memory, read only by matmuls,
        # runs inside them (XLA fuses it into the GEMM's operand): neither written nor read on
        # its own
        absorbed = {
            id(eqn)
            for eqn in jaxpr.eqns
            if eqn.primitive.name in _PROLOGUE
            and not any(v in fused for v in eqn.invars if not _is_literal(v))
            and all(v not in outvars for v in eqn.outvars)
            and all(c.primitive.name == "dot_general" for v in eqn.outvars for c in consumers[v])
            and any(consumers[v] for v in eqn.outvars)
        }
        return cls(fused, consumers, outvars, absorbed)


class _JaxprReader:
    """Counts a jaxpr's work into its counters: matmuls by shape (and in program order, with
    how many times each runs), totals by ``Work`` field."""

    def __init__(self) -> None:
        self.matmuls: collections.Counter = collections.Counter()
        self.totals: collections.Counter = collections.Counter()
        self.ordered: list[tuple[Matmul, int]] = []  # every dot in program order, with times

    def walk(self, jaxpr: Any, times: int, depth: int = 0) -> None:
        """Count ``jaxpr`` ``times`` over (``depth``: how many calls and loops it is inside)."""
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        flow = _Flow.of(jaxpr)
        read: set[Any] = set()  # values fused work has already read from memory
        for eqn in jaxpr.eqns:
            if id(eqn) in flow.absorbed:
                continue
            if _fusible(eqn):
                self._fused(eqn, flow, read, times)
            else:
                self._kernel(eqn, times, depth)

    def _fused(self, eqn: Any, flow: _Flow, read: set[Any], times: int) -> None:
        """A fusible op's memory traffic: what it reads from memory (a value once per jaxpr; a
        slice only its slice, an in-place update not the buffer it updates) and what it writes
        there (a value that leaves the fusion, for a result or for work that is not fused; an
        in-place update its update)."""
        prim = eqn.primitive.name
        for i, v in enumerate(eqn.invars):
            if _is_literal(v) or v in flow.fused or v in read:
                continue
            if prim in ("dynamic_slice", "slice") and i == 0:
                self.totals["memory_bytes"] += times * _aval_nbytes(eqn.outvars[0])
                continue
            if prim == "dynamic_update_slice" and i == 0:
                continue  # updated in place
            read.add(v)
            self.totals["memory_bytes"] += times * _aval_nbytes(v)
        for v in eqn.outvars:
            escapes = v in flow.outvars or any(not _fusible(c) for c in flow.consumers.get(v, []))
            if escapes:
                size = _aval_nbytes(v)
                if prim == "dynamic_update_slice":
                    size = _aval_nbytes(eqn.invars[1])
                self.totals["memory_bytes"] += times * size
                self.totals["memory_kernels"] += times

    def _kernel(self, eqn: Any, times: int, depth: int) -> None:
        """Work XLA does not fuse: a matmul, a loop, a conditional, a transfer between device
        and host memory, a fused attention call, a call (its jaxpr), or any other op by the
        bytes it reads and writes."""
        prim = eqn.primitive.name
        if prim == "dot_general":
            mm = _jaxpr_dot(eqn)
            self.matmuls[mm] += times
            self.ordered.append((mm, times))
        elif prim == "scan":
            length = int(eqn.params["length"])
            self.walk(eqn.params["jaxpr"], times * length, depth + 1)
            self._scan_stacking(eqn, times, length)
        elif prim == "cond":
            self._costliest_branch(eqn, times, depth)
        elif prim == "device_put":
            self._device_put(eqn, times)
        elif "dot_product_attention" in prim:  # cuDNN's fused attention, forward or backward
            self._attention(eqn, times)
        elif (subs := _sub_jaxprs(eqn)) and depth < 64:
            for sub in subs:
                self.walk(sub, times, depth + 1)
        else:
            self._unfused(eqn, times)

    def _costliest_branch(self, eqn: Any, times: int, depth: int) -> None:
        """A conditional: the branch with the most matmul FLOPs plus memory-bound bytes."""
        best = None
        for b in eqn.params["branches"]:
            sub = _JaxprReader()
            sub.walk(b, 1, depth + 1)
            cost = sum(m.flops * n for m, n in sub.matmuls.items()) + sub.totals["memory_bytes"]
            if best is None or cost > best[0]:
                best = (cost, sub)
        if best is not None:
            for m, n in best[1].matmuls.items():
                self.matmuls[m] += n * times
            for k, v in best[1].totals.items():
                self.totals[k] += v * times
            self.ordered += [(m, n * times) for m, n in best[1].ordered]

    def _device_put(self, eqn: Any, times: int) -> None:
        """A transfer: the bytes it moves between device and host memory (none within one)."""
        for v, out in zip(eqn.invars, eqn.outvars, strict=False):
            src = _memory_kind(v)
            dst = _memory_kind(out)
            if src != dst and "host" in (src, dst):
                key = "to_host_bytes" if dst == "host" else "from_host_bytes"
                self.totals[key] += times * _aval_nbytes(v)

    def _attention(self, eqn: Any, times: int) -> None:
        """cuDNN's fused attention, forward or backward: its FLOPs from q's and k's shapes
        ([batch, seq, heads, head dim]: q·kᵀ and p·v; the backward 2.5 times that, halved under
        a causal mask) and the bytes of its operands and results."""
        q, k = (v.aval.shape for v in eqn.invars[:2])
        flops = 4 * math.prod(q) * k[1]  # [batch, seq, heads, head dim]: q·kᵀ and p·v
        if "bwd" in eqn.primitive.name:
            flops = flops * 5 // 2
        if "CAUSAL" in str(eqn.params.get("mask_type", "")).upper():
            flops //= 2
        io = sum(_aval_nbytes(v) for v in (*eqn.invars, *eqn.outvars))
        self.totals["attention_flops"] += times * flops
        self.totals["attention_bytes"] += times * io

    def _unfused(self, eqn: Any, times: int) -> None:
        """Any other op: one kernel, by the bytes it reads and writes (a gather the rows it
        gathers and their indices, a scatter its zeroed result and the updates it adds in)."""
        prim = eqn.primitive.name
        if prim == "gather":  # reads the rows it gathers (and their indices), writes them
            io = 2 * _aval_nbytes(eqn.outvars[0]) + _aval_nbytes(eqn.invars[1])
        elif prim.startswith("scatter"):  # the result zeroed, then the updates added in
            io = _aval_nbytes(eqn.outvars[0]) + 2 * _aval_nbytes(eqn.invars[2])
        else:  # anything else (a sort, a custom call): reads and writes its arrays
            io = sum(_aval_nbytes(v) for v in (*eqn.invars, *eqn.outvars) if not _is_literal(v))
        self.totals["memory_bytes"] += times * io
        self.totals["memory_kernels"] += times

    def _scan_stacking(self, eqn: Any, times: int, length: int) -> None:
        """What XLA's loop adds around a scan's body (seen in its GPU plans): each stacked
        output is zero-initialised once and written into its slot by an update that reads the
        body's value again; each stacked input a matmul reads is first copied out of its
        stack (a fusion reading it elementwise slices it in place)."""
        from jaxmem.compat import scan_operand_counts

        body = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"])
        n_consts, n_carry = scan_operand_counts(eqn)
        for v in body.outvars[n_carry:]:
            if not _is_literal(v):
                self.totals["memory_bytes"] += times * 3 * length * _aval_nbytes(v)
                self.totals["memory_kernels"] += times * (length + 1)
        users: dict[Any, list[str]] = collections.defaultdict(list)
        for e in body.eqns:
            for v in e.invars:
                if not _is_literal(v):
                    users[v].append(e.primitive.name)
        for v in body.invars[n_consts + n_carry :]:
            if "dot_general" in users.get(v, ()):
                self.totals["memory_bytes"] += times * 2 * length * _aval_nbytes(v)
                self.totals["memory_kernels"] += times * length


_CALLS = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call")


def _fusible(eqn: Any, depth: int = 0) -> bool:
    """XLA fuses it with its neighbours: an elementwise, shape or reduction op, or a call (a
    jitted ``silu``, ``gelu``, ``softmax``) made of nothing else."""
    prim = eqn.primitive.name
    if prim in _FUSIBLE:
        return True
    if prim not in _CALLS or depth > 8:
        return False
    subs = _sub_jaxprs(eqn)
    return bool(subs) and all(_fusible(e, depth + 1) for sub in subs for e in sub.eqns)


def _is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _memory_kind(v: Any) -> str:
    space = getattr(getattr(v, "aval", None), "memory_space", None)
    name = "" if space is None else str(space).split(".")[-1].lower()
    return "host" if "host" in name else "device"


@dataclasses.dataclass(frozen=True)
class Traced:
    """A jaxpr's work with its matmuls in program order (``at_rows`` extrapolates it)."""

    matmuls: tuple[tuple[Matmul, int], ...]  # in program order, with how many times each runs
    totals: tuple[tuple[str, int], ...]  # memory_bytes, memory_kernels, host bytes

    def work(self, source: str = "") -> Work:
        counts: collections.Counter = collections.Counter()
        for m, n in self.matmuls:
            counts[m] += n
        return tallied(counts, collections.Counter(dict(self.totals)), collections.Counter(),
                        source)  # fmt: skip


def trace_jaxpr(jaxpr: Any) -> Traced:
    """``jaxpr``'s work, its matmuls in program order."""
    reader = _JaxprReader()
    reader.walk(jaxpr, 1)
    return Traced(tuple(reader.ordered), tuple(sorted(reader.totals.items())))


def at_rows(one: Traced, two: Traced, rows: int) -> Traced:
    """The work of ``rows`` rows from traces of the same program at one and at two rows:
    every matmul dimension, byte count and total is affine in the rows (each row adds the same
    tokens); the programs must match dot for dot."""
    if len(one.matmuls) != len(two.matmuls):
        raise ValueError("traces at one and two rows differ in their matmuls")

    def line(a: int, b: int) -> int:
        return a + (b - a) * (rows - 1)

    matmuls = tuple(
        (
            Matmul(
                line(a.batch, b.batch), line(a.m, b.m), line(a.n, b.n), line(a.k, b.k), a.dtype,
                line(a.bytes, b.bytes),
            ),
            n,
        )
        for (a, n), (b, _) in zip(one.matmuls, two.matmuls, strict=True)
    )  # fmt: skip
    t1, t2 = dict(one.totals), dict(two.totals)
    totals = tuple((k, line(t1.get(k, 0), t2.get(k, 0))) for k in sorted(set(t1) | set(t2)))
    return Traced(matmuls, totals)


def work_of_jaxpr(jaxpr: Any, source: str = "") -> Work:
    """The work of a (closed) jaxpr, before XLA compiles it (see the module docstring)."""
    reader = _JaxprReader()
    reader.walk(jaxpr, 1)
    return tallied(
        reader.matmuls,
        reader.totals,
        collections.Counter(),
        source or "per-operation count of the jaxpr (elementwise chains assumed fused)",
    )

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
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from collections.abc import Iterable
from typing import Any

# bytes per element of an HLO element type (s4/u4 packed two to a byte)
_HLO_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
    "s2": 0.25, "u2": 0.25, "s1": 0.125, "u1": 0.125, "f8e4m3fn": 1, "f8e5m2": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e4m3": 1, "f8e3m4": 1,
    "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
HOST_SPACE = "S(5)"  # XLA's memory space of host memory in a layout: {1,0:S(5)}


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
    return _tallied(matmuls, totals, coll, source, dtype)


_TOTALS = (
    "memory_bytes", "memory_kernels", "attention_flops", "attention_bytes", "to_host_bytes",
    "from_host_bytes", "host_compute_bytes", "unknown_loops",
)  # fmt: skip


def _tallied(
    matmuls: collections.Counter,
    totals: collections.Counter,
    collectives: collections.Counter,
    source: str,
    attention_dtype: str = "bfloat16",
) -> Work:
    return Work(
        matmuls=tuple(sorted((m, n) for m, n in matmuls.items() if n)),
        collective_bytes=tuple(sorted((k, b) for k, b in collectives.items() if b)),
        attention_dtype=attention_dtype,
        source=source,
        **{f: int(totals[f]) for f in _TOTALS},
    )


# ------------------------------------------------------------------------------ HLO text
def _shapes(type_text: str) -> list[tuple[str, tuple[int, ...], str]]:
    return [
        (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d), m.group(3) or "")
        for m in _SHAPE.finditer(type_text)
        if m.group(1) in _HLO_BYTES
    ]


def _nbytes(type_text: str) -> int:
    return int(sum(math.prod(dims) * _HLO_BYTES[t] for t, dims, _ in _shapes(type_text)))


def _on_host(type_text: str) -> bool:
    return any(HOST_SPACE in layout for _, _, layout in _shapes(type_text))


def _matching(text: str, start: int) -> int:
    """Index just past the bracket closing the one at ``start``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    quoted = False
    for i in range(start, len(text)):
        c = text[i]
        if c == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        if quoted:
            continue
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


@dataclasses.dataclass
class _Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool


_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMMENT = re.compile(r"/\*.*?\*/")


def _parse_instr(line: str) -> _Instr | None:
    line = _COMMENT.sub("", line)
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _matching(rest, 0)
        type_text, rest = rest[:end], rest[end:].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    op = re.match(r"([a-z][a-z0-9\-]*)\(", rest)
    if not op:
        return None
    end = _matching(rest, op.end() - 1)
    operand_text = rest[op.end() : end - 1]
    operands = re.findall(r"%([\w.\-]+)", operand_text)
    return _Instr(m.group(2), type_text, op.group(1), operands, rest[end:], bool(m.group(1)))


def _computations(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    comps: dict[str, list[_Instr]] = {}
    entry = None
    current: list[_Instr] | None = None
    for line in text.splitlines():
        if current is None:
            head = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$", line)
            if head:
                current = comps.setdefault(head.group(2), [])
                if head.group(1):
                    entry = head.group(2)
            continue
        if line.startswith("}"):
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            current.append(instr)
    return comps, entry


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return m.group(1) if m else None


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


_DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}


def _dot_shape(
    lhs: tuple[int, ...], rhs: tuple[int, ...], lb, lc, rb, rc
) -> tuple[int, int, int, int]:
    batch = math.prod(lhs[d] for d in lb)
    k = math.prod(lhs[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs) if d not in lb and d not in lc)
    n = math.prod(s for d, s in enumerate(rhs) if d not in rb and d not in rc)
    return batch, m, n, k


class _HloReader:
    def __init__(self, text: str):
        self.comps, self.entry = _computations(text)
        self.types = {c: {i.name: i.type for i in body} for c, body in self.comps.items()}
        self.matmuls: collections.Counter = collections.Counter()
        self.totals: collections.Counter = collections.Counter()
        self.coll: collections.Counter = collections.Counter()
        self.attention_dtype = "bfloat16"

    # -- what a fused computation does
    def _find_dot(self, comp: str, depth: int = 0) -> tuple[_Instr, str] | None:
        for instr in self.comps.get(comp, ()):
            if instr.opcode == "dot":
                return instr, comp
            called = _attr(instr.attrs, "calls")
            if called and depth < 4:
                found = self._find_dot(called, depth + 1)
                if found:
                    return found
        return None

    def _matmul(self, dot: _Instr, comp: str, io_bytes: int) -> Matmul:
        types = self.types[comp]
        lhs, rhs = (_shapes(types.get(o, ""))[0] for o in dot.operands[:2])
        shape = _dot_shape(
            lhs[1],
            rhs[1],
            _dims(dot.attrs, "lhs_batch_dims"),
            _dims(dot.attrs, "lhs_contracting_dims"),
            _dims(dot.attrs, "rhs_batch_dims"),
            _dims(dot.attrs, "rhs_contracting_dims"),
        )
        return Matmul(*shape, dtype=_DTYPE_NAMES.get(lhs[0], lhs[0]), bytes=io_bytes)

    def _fusion_io(self, instr: _Instr, comp: str, called: str) -> int:
        """Bytes a fusion reads and writes: a parameter only sliced inside counts its slices;
        the buffer an in-place update writes into counts nothing but the update."""
        body = self.comps.get(called, [])
        users: dict[str, list[_Instr]] = collections.defaultdict(list)
        for i in body:
            for o in i.operands:
                users[o].append(i)

        def read(name: str, depth: int = 0) -> int | None:
            """Bytes of ``name`` read through slices only (None: read whole)."""
            total = 0
            for u in users.get(name, []):
                if u.opcode == "bitcast" and depth < 8:
                    sub = read(u.name, depth + 1)
                    if sub is None:
                        return None
                    total += sub
                elif u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == name:
                    total += _nbytes(u.type)
                elif u.opcode in ("dynamic-update-slice", "scatter") and u.operands[0] == name:
                    continue  # written in place: the update is counted as the output
                else:
                    return None
            return total

        params = {i.name: i for i in body if i.opcode == "parameter"}
        total = 0
        for p in params.values():
            sliced = read(p.name)
            total += _nbytes(p.type) if sliced is None else sliced
        roots = [i for i in body if i.root]
        by_name = {i.name: i for i in body}

        def written(i: _Instr) -> int:
            if i.opcode == "tuple":
                return sum(written(by_name[o]) for o in i.operands if o in by_name)
            if i.opcode == "bitcast" and i.operands and i.operands[0] in by_name:
                return written(by_name[i.operands[0]])
            if i.opcode == "dynamic-update-slice":
                return _nbytes(self.types[called].get(i.operands[1], ""))
            if i.opcode == "scatter" and len(i.operands) > 2:  # the rows its updates touch
                return _nbytes(self.types[called].get(i.operands[2], ""))
            return _nbytes(i.type)

        total += written(roots[0]) if roots else _nbytes(instr.type)
        return total

    def _host_transfer(self, called: str) -> tuple[bool, int] | None:
        """(to host, bytes) when a fusion writes into or reads from host memory (XLA's host
        offload: a slot of a buffer in memory space 5 updated from, or sliced into, device
        memory); None otherwise."""
        body = self.comps.get(called, [])
        hosted = {i.name for i in body if i.opcode == "parameter" and _on_host(i.type)}
        if not hosted:
            return None
        roots = [i for i in body if i.root]
        root = roots[0] if roots else None
        types = self.types.get(called, {})
        if root is not None and root.opcode == "dynamic-update-slice":
            if root.operands and root.operands[0] in hosted:
                return True, _nbytes(types.get(root.operands[1], ""))
        return False, _nbytes(root.type) if root is not None else 0

    # -- one computation, ``times`` over
    def walk(self, comp: str, times: int, depth: int = 0, on_host: bool = False) -> None:
        """Count ``comp`` ``times`` over; ``on_host``: it runs on the host (the body of a host
        computation, ``compute_on("device_host")``)."""
        if depth > 64:
            return
        types = self.types[comp]
        for instr in self.comps.get(comp, ()):
            op = instr.opcode
            host = on_host or '_xla_compute_type="host"' in instr.attrs
            if op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
                if trip is None:
                    self.totals["unknown_loops"] += 1
                body = _attr(instr.attrs, "body")
                if body:
                    trips = int(trip.group(1)) if trip else 1
                    self.walk(body, times * trips, depth + 1, host)
                continue
            if op in ("call", "async-start", "custom-call-start") and (
                op != "custom-call-start" or 'async_execution_thread="host"' in instr.attrs
            ):
                # a host computation (compute_on("device_host")): XLA's HostExecute call of
                # computations on the host thread
                host = host or 'async_execution_thread="host"' in instr.attrs
                called = (
                    _attr(instr.attrs, "to_apply")
                    or _attr(instr.attrs, "calls")
                    or _first_called(instr.attrs)
                )
                if called:
                    self.walk(called, times, depth + 1, host)
                continue
            if op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", _branch_text(instr.attrs))
                best, best_cost = None, -1.0
                for b in branches:
                    sub = _HloReader.__new__(_HloReader)
                    sub.comps, sub.types, sub.entry = self.comps, self.types, None
                    sub.matmuls, sub.totals, sub.coll = (
                        collections.Counter(),
                        collections.Counter(),
                        collections.Counter(),
                    )
                    sub.attention_dtype = self.attention_dtype
                    sub.walk(b, 1, depth + 1, host)
                    cost = (
                        sum(m.flops * n for m, n in sub.matmuls.items())
                        + sub.totals["memory_bytes"]
                    )
                    if cost > best_cost:
                        best, best_cost = sub, cost
                if best is not None:
                    for m, n in best.matmuls.items():
                        self.matmuls[m] += n * times
                    for k, v in best.totals.items():
                        self.totals[k] += v * times
                    for k, v in best.coll.items():
                        self.coll[k] += v * times
                continue
            if op in _FREE or op.endswith("-done"):
                continue
            if op.removesuffix("-start") in _COLLECTIVES:
                kind = op.removesuffix("-start")
                label = kind + (" (neighbours)" if _neighbours(instr.attrs) else "")
                self.coll[label] += times * _collective_bytes(kind, instr, types)
                continue
            operand_bytes = sum(_nbytes(types.get(o, "")) for o in instr.operands)
            if op in ("copy-start", "copy") and not host:
                src = types.get(instr.operands[0], "") if instr.operands else ""
                # an async copy's result is (destination, source, context): its first array
                dest = _shapes(instr.type)[:1] if op == "copy-start" else _shapes(instr.type)
                to_host = any(HOST_SPACE in layout for _, _, layout in dest)
                if to_host != _on_host(src):
                    key = "to_host_bytes" if to_host else "from_host_bytes"
                    self.totals[key] += times * _nbytes(src)
                else:  # a copy within device memory: read and written
                    self.totals["memory_bytes"] += times * 2 * _nbytes(src)
                    self.totals["memory_kernels"] += times
                continue
            if op in ("fusion", "fusion-start"):
                called = _attr(instr.attrs, "calls") or ""
                moved = None if host else self._host_transfer(called)
                if moved is not None:  # an update of, or a slice from, host memory
                    key = "to_host_bytes" if moved[0] else "from_host_bytes"
                    self.totals[key] += times * moved[1]
                    continue
                io = self._fusion_io(instr, comp, called)
                found = self._find_dot(called)
                if found is not None and not host:
                    self.matmuls[self._matmul(found[0], found[1], io)] += times
                    continue
                key = "host_compute_bytes" if host else "memory_bytes"
                self.totals[key] += times * io
                self.totals["memory_kernels"] += 0 if host else times
                continue
            if op == "dot" and not host:
                io = operand_bytes + _nbytes(instr.type)
                self.matmuls[self._matmul(instr, comp, io)] += times
                continue
            if op == "custom-call":
                target = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
                name = target.group(1) if target else ""
                if name in _FREE_CALLS:
                    continue
                # a library call's result tuple ends in its scratch workspace (u8/s8): not data
                out = sum(
                    math.prod(d) * _HLO_BYTES[t]
                    for t, d, _ in _shapes(instr.type)
                    if not (t in ("u8", "s8") and len(d) == 1)
                )
                if "cublas" in name and "gemm" in name or "matmul" in name:
                    mm = self._gemm_call(instr, types, operand_bytes + out)
                    if mm is not None:
                        self.matmuls[mm] += times
                        continue
                if "fmha" in name or "cudnn$fmha" in name:
                    flops, dtype = _attention_flops(instr, types, name)
                    self.totals["attention_flops"] += times * flops
                    self.totals["attention_bytes"] += times * (operand_bytes + out)
                    self.attention_dtype = dtype
                    continue
                self.totals["memory_bytes"] += times * (operand_bytes + out)
                self.totals["memory_kernels"] += times
                continue
            # an unfused op that touches memory
            if op in ("dynamic-slice", "slice", "gather"):
                io = 2 * _nbytes(instr.type)
            elif op == "dynamic-update-slice":
                io = 2 * _nbytes(types.get(instr.operands[1], "")) if len(instr.operands) > 1 else 0
            elif op in ("broadcast", "iota"):
                io = _nbytes(instr.type)
            elif op == "scatter" and len(instr.operands) > 2:  # in place: the updates added in
                io = 2 * _nbytes(types.get(instr.operands[2], "")) + _nbytes(
                    types.get(instr.operands[1], "")
                )
            else:
                io = operand_bytes + _nbytes(instr.type)
            key = "host_compute_bytes" if host else "memory_bytes"
            self.totals[key] += times * io
            self.totals["memory_kernels"] += 0 if host else times

    def _gemm_call(self, instr: _Instr, types: dict[str, str], io: int) -> Matmul | None:
        m = re.search(r"backend_config=(\{.*\})", instr.attrs)
        if not m or len(instr.operands) < 2:
            return None
        try:
            config = json.loads(m.group(1)[: _matching(m.group(1), 0)])
        except ValueError:
            return None
        dims = (config.get("gemm_backend_config") or {}).get("dot_dimension_numbers") or {}

        def ints(key: str) -> tuple[int, ...]:
            return tuple(int(x) for x in dims.get(key, []))

        lhs, rhs = (_shapes(types.get(o, ""))[0] for o in instr.operands[:2])
        shape = _dot_shape(
            lhs[1],
            rhs[1],
            ints("lhs_batch_dimensions"),
            ints("lhs_contracting_dimensions"),
            ints("rhs_batch_dimensions"),
            ints("rhs_contracting_dimensions"),
        )
        return Matmul(*shape, dtype=_DTYPE_NAMES.get(lhs[0], lhs[0]), bytes=io)

    def result(self, source: str) -> Work:
        return _tallied(self.matmuls, self.totals, self.coll, source, self.attention_dtype)


def _first_called(attrs: str) -> str | None:
    m = re.search(r"called_computations=\{%([\w.\-]+)", attrs)
    return m.group(1) if m else None


def _branch_text(attrs: str) -> str:
    m = re.search(r"branch_computations=\{([^}]*)\}", attrs)
    if m:
        return m.group(1)
    found = [_attr(attrs, k) for k in ("true_computation", "false_computation")]
    return " ".join(f"%{f}" for f in found if f)


# ops that move no bytes of their own (views, tuples, control)
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
    "after-all", "partition-id", "replica-id", "add-dependency", "domain", "send", "recv",
    "infeed", "outfeed", "rng-get-and-update-state", "get-dimension-size",
}  # fmt: skip
# custom calls that move no bytes: a buffer allocation (host offload's destination)
_FREE_CALLS = {"AllocateBuffer"}
_COLLECTIVES = {
    "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-broadcast", "ragged-all-to-all",
}  # fmt: skip


def _group_size(attrs: str) -> int:
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
    if iota:
        return int(iota.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    if m:
        return max(1, len([x for x in m.group(1).split(",") if x]))
    return 1


def _neighbours(attrs: str) -> bool:
    """Each replica group is consecutive devices ({0,1},{2,3} or an untransposed iota list)."""
    if re.search(r"replica_groups=\[[0-9,]+\]<=\[[0-9,]+\]T\(", attrs):
        return False
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    if m:
        ids = [int(x) for x in m.group(1).split(",") if x]
        return all(b - a == 1 for a, b in zip(ids, ids[1:], strict=False))
    return True


def _collective_bytes(kind: str, instr: _Instr, types: dict[str, str]) -> int:
    """Bytes each device sends for one collective, ring algorithms: an all-gather sends
    (n-1)/n of its result, a reduce-scatter (n-1)/n of its operand, an all-reduce twice that,
    an all-to-all (n-1)/n of its operand, a permute its operand."""
    n = _group_size(instr.attrs)
    operand = sum(_nbytes(types.get(o, "")) for o in instr.operands)
    result = _nbytes(instr.type)
    if kind == "all-gather":
        # an async start's result is (operand, result): the gathered array is the larger
        result = max((math.prod(d) * _HLO_BYTES[t] for t, d, _ in _shapes(instr.type)), default=0)
        return result * (n - 1) // max(n, 1)
    if kind == "all-reduce":
        return 2 * operand * (n - 1) // max(n, 1)
    if kind in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return operand * (n - 1) // max(n, 1)
    return operand


def _attention_flops(instr: _Instr, types: dict[str, str], target: str) -> tuple[int, str]:
    """FLOPs of a cuDNN fused attention call from its Q and K shapes ([batch, seq, heads,
    head dim] or any layout whose last dimension is the head dimension): forward 4·B·H·Sq·Sk·D
    (QKᵀ and PV), backward 2.5 times that (five products), halved under a causal mask (the
    kernel skips the masked tiles)."""
    q, k = (_shapes(types.get(o, ""))[0] for o in instr.operands[:2])
    qd, kd = q[1], k[1]
    # B·H·Sq·D = q's elements; with grouped key/value heads B·H·Sq·Sk·D is q's elements x Sk
    seq_k = kd[1] if len(kd) == 4 else kd[-2]
    flops = 4 * math.prod(qd) * seq_k
    if "backward" in target.lower():
        flops = flops * 5 // 2
    if "CAUSAL" in instr.attrs.upper():
        flops //= 2
    return flops, _DTYPE_NAMES.get(q[0], q[0])


def work_of_hlo(text: str, source: str = "") -> Work:
    """The work of the compiled program whose optimized HLO is ``text``."""
    reader = _HloReader(text)
    if reader.entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    reader.walk(reader.entry, 1)
    return reader.result(source or "per-kernel count of the compiled program's HLO")


# ------------------------------------------------------------------------------ jaxpr
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
    shape = _dot_shape(tuple(lhs.shape), tuple(rhs.shape), lb, lc, rb, rc)
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


class _JaxprReader:
    def __init__(self) -> None:
        self.matmuls: collections.Counter = collections.Counter()
        self.totals: collections.Counter = collections.Counter()
        self.ordered: list[tuple[Matmul, int]] = []  # every dot in program order, with times

    def walk(self, jaxpr: Any, times: int, depth: int = 0) -> None:
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        produced_by_fusible: set[Any] = set()
        consumers: dict[Any, list[Any]] = collections.defaultdict(list)
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if not _is_literal(v):
                    consumers[v].append(eqn)
            if _fusible(eqn):
                produced_by_fusible.update(eqn.outvars)
        outvars = {v for v in jaxpr.outvars if not _is_literal(v)}
        # a cast or layout change of a value that is already in memory, read only by matmuls,
        # runs inside them (XLA fuses it into the GEMM's operand): neither written nor read on
        # its own
        absorbed = {
            id(eqn)
            for eqn in jaxpr.eqns
            if eqn.primitive.name in _PROLOGUE
            and not any(v in produced_by_fusible for v in eqn.invars if not _is_literal(v))
            and all(v not in outvars for v in eqn.outvars)
            and all(c.primitive.name == "dot_general" for v in eqn.outvars for c in consumers[v])
            and any(consumers[v] for v in eqn.outvars)
        }
        read: set[Any] = set()
        for eqn in jaxpr.eqns:
            prim = eqn.primitive.name
            if id(eqn) in absorbed:
                continue
            if _fusible(eqn):
                for i, v in enumerate(eqn.invars):
                    if _is_literal(v) or v in produced_by_fusible or v in read:
                        continue
                    if prim in ("dynamic_slice", "slice") and i == 0:
                        self.totals["memory_bytes"] += times * _aval_nbytes(eqn.outvars[0])
                        continue
                    if prim == "dynamic_update_slice" and i == 0:
                        continue  # updated in place
                    read.add(v)
                    self.totals["memory_bytes"] += times * _aval_nbytes(v)
                for v in eqn.outvars:
                    escapes = v in outvars or any(not _fusible(c) for c in consumers.get(v, []))
                    if escapes:
                        size = _aval_nbytes(v)
                        if prim == "dynamic_update_slice":
                            size = _aval_nbytes(eqn.invars[1])
                        self.totals["memory_bytes"] += times * size
                        self.totals["memory_kernels"] += times
                continue
            if prim == "dot_general":
                mm = _jaxpr_dot(eqn)
                self.matmuls[mm] += times
                self.ordered.append((mm, times))
                continue
            if prim == "scan":
                length = int(eqn.params["length"])
                self.walk(eqn.params["jaxpr"], times * length, depth + 1)
                self._scan_stacking(eqn, times, length)
                continue
            if prim == "cond":
                branches = eqn.params["branches"]
                best = None
                for b in branches:
                    sub = _JaxprReader()
                    sub.walk(b, 1, depth + 1)
                    cost = (
                        sum(m.flops * n for m, n in sub.matmuls.items())
                        + sub.totals["memory_bytes"]
                    )
                    if best is None or cost > best[0]:
                        best = (cost, sub)
                if best is not None:
                    for m, n in best[1].matmuls.items():
                        self.matmuls[m] += n * times
                    for k, v in best[1].totals.items():
                        self.totals[k] += v * times
                    self.ordered += [(m, n * times) for m, n in best[1].ordered]
                continue
            if prim == "device_put":
                for v, out in zip(eqn.invars, eqn.outvars, strict=False):
                    src = _memory_kind(v)
                    dst = _memory_kind(out)
                    if src != dst and "host" in (src, dst):
                        key = "to_host_bytes" if dst == "host" else "from_host_bytes"
                        self.totals[key] += times * _aval_nbytes(v)
                continue
            if "dot_product_attention" in prim:  # cuDNN's fused attention, forward or backward
                q, k = (v.aval.shape for v in eqn.invars[:2])
                flops = 4 * math.prod(q) * k[1]  # [batch, seq, heads, head dim]: q·kᵀ and p·v
                if "bwd" in prim:
                    flops = flops * 5 // 2
                if "CAUSAL" in str(eqn.params.get("mask_type", "")).upper():
                    flops //= 2
                io = sum(_aval_nbytes(v) for v in (*eqn.invars, *eqn.outvars))
                self.totals["attention_flops"] += times * flops
                self.totals["attention_bytes"] += times * io
                continue
            subs = _sub_jaxprs(eqn)
            if subs and depth < 64:
                for sub in subs:
                    self.walk(sub, times, depth + 1)
                continue
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
        return _tallied(counts, collections.Counter(dict(self.totals)), collections.Counter(),
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
    return _tallied(
        reader.matmuls,
        reader.totals,
        collections.Counter(),
        source or "per-operation count of the jaxpr (elementwise chains assumed fused)",
    )

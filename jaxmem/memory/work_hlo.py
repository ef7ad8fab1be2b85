"""A compiled program's work, read from its optimized HLO text (``compiled.as_text()``): the
kernels the target runs after fusion, rematerialisation and scheduling, counted one by one
(``work_of_hlo``; what each kind of kernel counts: ``jaxmem.memory.work``). The text is parsed
here (computations, instructions, their types and attributes) because no JAX or XLA Python API
returns the compiled module's instructions.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re

from jaxmem.memory.work_types import Matmul, Work, dot_shape, tallied

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


def _operand_bytes(instr: _Instr, types: dict[str, str]) -> int:
    """Bytes of ``instr``'s operands (``types``: its computation's types by name)."""
    return sum(_nbytes(types.get(o, "")) for o in instr.operands)


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


class _HloReader:
    """Counts an optimized HLO module's work into its counters: matmuls by shape, totals by
    ``Work`` field, collective bytes by kind, and the element type of its fused attention."""

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
        shape = dot_shape(
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
            host = on_host or '_xla_compute_type="host"' in instr.attrs
            self._count(instr, comp, types, times, depth, host)

    def _count(
        self, instr: _Instr, comp: str, types: dict[str, str], times: int, depth: int, host: bool
    ) -> None:
        """Count one instruction of ``comp`` (``types``: its values' types), ``times`` over: a
        loop, call or conditional by what it runs, a collective by the bytes it sends, a copy by
        the memory it crosses, a fusion, dot or library call by the matmul or bytes it is, any
        other op by its bytes."""
        op = instr.opcode
        if op == "while":
            self._loop(instr, times, depth, host)
        elif op in ("call", "async-start", "custom-call-start") and (
            op != "custom-call-start" or 'async_execution_thread="host"' in instr.attrs
        ):
            self._call(instr, times, depth, host)
        elif op == "conditional":
            self._costliest_branch(instr, times, depth, host)
        elif op in _FREE or op.endswith("-done"):
            pass
        elif op.removesuffix("-start") in _COLLECTIVES:
            kind = op.removesuffix("-start")
            label = kind + (" (neighbours)" if _neighbours(instr.attrs) else "")
            self.coll[label] += times * _collective_bytes(kind, instr, types)
        elif op in ("copy-start", "copy") and not host:
            self._copy(instr, types, times)
        elif op in ("fusion", "fusion-start"):
            self._fusion(instr, comp, times, host)
        elif op == "dot" and not host:
            io = _operand_bytes(instr, types) + _nbytes(instr.type)
            self.matmuls[self._matmul(instr, comp, io)] += times
        elif op == "custom-call":
            self._custom_call(instr, types, times)
        else:
            self._unfused(instr, types, times, host)

    def _loop(self, instr: _Instr, times: int, depth: int, host: bool) -> None:
        """A while loop: its body as many times as its known trip count (once, and counted
        among the unknown loops, without one)."""
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
        if trip is None:
            self.totals["unknown_loops"] += 1
        body = _attr(instr.attrs, "body")
        if body:
            trips = int(trip.group(1)) if trip else 1
            self.walk(body, times * trips, depth + 1, host)

    def _call(self, instr: _Instr, times: int, depth: int, host: bool) -> None:
        """A call, or an async start, of another computation: that computation, on the host
        where it is a host computation (``compute_on("device_host")``: XLA's HostExecute call
        of computations on the host thread)."""
        host = host or 'async_execution_thread="host"' in instr.attrs
        called = (
            _attr(instr.attrs, "to_apply")
            or _attr(instr.attrs, "calls")
            or _first_called(instr.attrs)
        )
        if called:
            self.walk(called, times, depth + 1, host)

    def _costliest_branch(self, instr: _Instr, times: int, depth: int, host: bool) -> None:
        """A conditional: the branch with the most matmul FLOPs plus memory-bound bytes."""
        branches = re.findall(r"%([\w.\-]+)", _branch_text(instr.attrs))
        best, best_cost = None, -1.0
        for b in branches:
            sub = self._branch_reader()
            sub.walk(b, 1, depth + 1, host)
            cost = sum(m.flops * n for m, n in sub.matmuls.items()) + sub.totals["memory_bytes"]
            if cost > best_cost:
                best, best_cost = sub, cost
        if best is not None:
            for m, n in best.matmuls.items():
                self.matmuls[m] += n * times
            for k, v in best.totals.items():
                self.totals[k] += v * times
            for k, v in best.coll.items():
                self.coll[k] += v * times

    def _branch_reader(self) -> _HloReader:
        """A reader of the same program with counts of its own (one branch's)."""
        sub = _HloReader.__new__(_HloReader)
        sub.comps, sub.types, sub.entry = self.comps, self.types, None
        sub.matmuls, sub.totals, sub.coll = (
            collections.Counter(),
            collections.Counter(),
            collections.Counter(),
        )
        sub.attention_dtype = self.attention_dtype
        return sub

    def _copy(self, instr: _Instr, types: dict[str, str], times: int) -> None:
        """A copy on the device: the bytes it moves to or from host memory, or reads and
        writes within device memory."""
        src = types.get(instr.operands[0], "") if instr.operands else ""
        # an async copy's result is (destination, source, context): its first array
        dest = _shapes(instr.type)[:1] if instr.opcode == "copy-start" else _shapes(instr.type)
        to_host = any(HOST_SPACE in layout for _, _, layout in dest)
        if to_host != _on_host(src):
            key = "to_host_bytes" if to_host else "from_host_bytes"
            self.totals[key] += times * _nbytes(src)
        else:  # a copy within device memory: read and written
            self.totals["memory_bytes"] += times * 2 * _nbytes(src)
            self.totals["memory_kernels"] += times

    def _fusion(self, instr: _Instr, comp: str, times: int, host: bool) -> None:
        """A fusion: an update of, or a slice from, host memory; a matmul where it holds a dot
        (on the device); else the bytes it reads and writes."""
        called = _attr(instr.attrs, "calls") or ""
        moved = None if host else self._host_transfer(called)
        if moved is not None:  # an update of, or a slice from, host memory
            key = "to_host_bytes" if moved[0] else "from_host_bytes"
            self.totals[key] += times * moved[1]
            return
        io = self._fusion_io(instr, comp, called)
        found = self._find_dot(called)
        if found is not None and not host:
            self.matmuls[self._matmul(found[0], found[1], io)] += times
            return
        key = "host_compute_bytes" if host else "memory_bytes"
        self.totals[key] += times * io
        self.totals["memory_kernels"] += 0 if host else times

    def _custom_call(self, instr: _Instr, types: dict[str, str], times: int) -> None:
        """A library call: a cuBLAS GEMM as a matmul, cuDNN's fused attention by its FLOPs and
        bytes, any other call by the bytes it reads and writes (a buffer allocation none)."""
        target = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
        name = target.group(1) if target else ""
        if name in _FREE_CALLS:
            return
        operand_bytes = _operand_bytes(instr, types)
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
                return
        if "fmha" in name or "cudnn$fmha" in name:
            flops, dtype = _attention_flops(instr, types, name)
            self.totals["attention_flops"] += times * flops
            self.totals["attention_bytes"] += times * (operand_bytes + out)
            self.attention_dtype = dtype
            return
        self.totals["memory_bytes"] += times * (operand_bytes + out)
        self.totals["memory_kernels"] += times

    def _unfused(self, instr: _Instr, types: dict[str, str], times: int, host: bool) -> None:
        """An unfused op that touches memory: the bytes it reads and writes (a slice or gather
        its result twice, an in-place update its update, a broadcast or iota its result)."""
        op = instr.opcode
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
            io = _operand_bytes(instr, types) + _nbytes(instr.type)
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
        shape = dot_shape(
            lhs[1],
            rhs[1],
            ints("lhs_batch_dimensions"),
            ints("lhs_contracting_dimensions"),
            ints("rhs_batch_dimensions"),
            ints("rhs_contracting_dimensions"),
        )
        return Matmul(*shape, dtype=_DTYPE_NAMES.get(lhs[0], lhs[0]), bytes=io)

    def result(self, source: str) -> Work:
        return tallied(self.matmuls, self.totals, self.coll, source, self.attention_dtype)


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
    operand = _operand_bytes(instr, types)
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

"""What is live at the peak of a compiled program's memory plan, and what made it, from XLA's
dump of the compiled module.

``memory_analysis()`` (``residuals.compiled_plan``) gives a plan's totals; it cannot say which
buffers are alive together at the peak. XLA knows: its buffer assignment computes every value's
live range over the scheduled program and the peak they reach, and writes it out when asked to
dump the compiled module (``xla_dump_to``, an XLA flag, or a compile option of one compile:
``jit(f).lower(...).compile({"xla_dump_to": DIR})``). No JAX or XLA Python API returns it, so
``parse_dump`` reads the dump's files and maps every live value back to the JAX operation that
produced it (HLO ``op_name`` metadata: ``jvp(...)`` is the forward, ``transpose(...)`` the
backward, ``rematted_computation`` a recomputation, the program's parameters by their argument
path).

The figure is the compiler's own (a compiled plan, for the target the program was compiled for):
``live_bytes`` is what the buffers live at the peak hold; ``allocated_bytes`` the plan's size,
larger by what packing the buffers into one arena costs (fragmentation).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Any

KINDS = ("argument", "forward", "recomputed", "backward", "other")
KIND_HELP = {
    "argument": "the step's inputs: parameters, optimizer state, batch",
    "forward": "made by the forward and kept for the backward (activations)",
    "recomputed": "remade in the backward by remat",
    "backward": "made by the backward: cotangents, gradients, their working buffers",
    "other": "loss, optimizer update, outputs",
}


@dataclasses.dataclass(frozen=True)
class LiveValue:
    """One buffer value alive at the peak: XLA's name for it, its shape, its bytes, the
    instructions (positions in the scheduled program) where it is defined and last used, and
    the JAX operation that produced it."""

    name: str
    shape: str
    bytes: int
    start: int
    end: int
    op_name: str
    kind: str


@dataclasses.dataclass(frozen=True)
class PeakReport:
    compiler: str
    planned_peak_bytes: int  # memory_analysis(): arguments + outputs - aliased + temporaries
    allocated_bytes: int  # the dump's total for device memory (the plan's arena, packed)
    live_bytes: int  # what the values live at the peak hold
    position: int  # the peak's position in the scheduled program
    length: int  # positions in the scheduled program
    at_peak: str  # the JAX operation of the instruction the peak is reached at
    values: tuple[LiveValue, ...]
    # the plan's estimated step time for a GPU target (jaxmem.memory.step_time.of_plan's dict;
    # None for the local backend)
    step_time: dict[str, Any] | None = None

    @classmethod
    def of(cls, compiler: str, planned_peak_bytes: int, parsed: dict[str, Any]) -> PeakReport:
        """The report of ``parse_dump``'s result for a plan of ``compiler``."""
        return cls(
            compiler=compiler,
            planned_peak_bytes=planned_peak_bytes,
            allocated_bytes=parsed["allocated_bytes"],
            live_bytes=parsed["live_bytes"],
            position=parsed["position"],
            length=parsed["length"],
            at_peak=parsed["at_peak"],
            values=tuple(parsed["values"]),
        )

    def by_kind(self) -> dict[str, int]:
        totals = dict.fromkeys(KINDS, 0)
        for v in self.values:
            totals[v.kind] += v.bytes
        return totals

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["by_kind_bytes"] = self.by_kind()
        d["figure"] = (
            "compiled plan: XLA's buffer assignment of the step compiled for "
            f"{self.compiler} (live ranges over its scheduled program)"
        )
        return d


# --------------------------------------------------------------------------- the dump's files
_ASSIGNED = re.compile(r"^ value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_ALLOCATION = re.compile(r"^allocation (\d+): size \d+,(.*)$")


def _one(directory: str, suffix: str, module: str) -> str:
    found = sorted(glob.glob(os.path.join(directory, f"*.{module}*after_optimizations{suffix}")))
    if not found:
        raise RuntimeError(f"XLA wrote no *{suffix} for {module} under {directory}")
    with open(found[-1]) as f:  # the last module compiled is the program itself
        return f.read()


def _kind(name: str, op_name: str, is_parameter: bool) -> str:
    if is_parameter:
        return "argument"
    if "rematted_computation" in op_name:
        return "recomputed"
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "other"


def _argument_path(name: str, op_name: str) -> str:
    """The step argument's path, e.g. ``opt_state/0/mu/wte/embedding/value``: from the
    parameter's ``op_name`` (JAX writes the argument's path there, ``opt_state[0].mu['wte']...``)
    or, without one, from its HLO name (the path with separators folded to underscores)."""
    if op_name:
        path = op_name.replace("\\'", "'")
        path = re.sub(r"\['([^']*)'\]", r"/\1", path)
        path = re.sub(r"\[(\d+)\]", r"/\1", path)
        return path.replace(".", "/").strip("/")
    base = re.sub(r"\.\d+$", "", name.split("{")[0])
    return re.sub(r"_{2,}", "/", base).strip("/")


def _occupied(spans: list[tuple[int, int]]) -> int:
    """Bytes covered by ``[start, stop)`` spans of one allocation (values sharing a buffer,
    e.g. an in-place update and its operand, count once)."""
    total, reached = 0, -1
    for start, stop in sorted(spans):
        if stop > reached:
            total += stop - max(start, reached)
            reached = stop
    return total


def parse_dump(directory: str, module: str = "jit_step") -> dict[str, Any]:
    """Parse XLA's dump of the step: every value's live range over the scheduled program
    (``-live-range.txt``), its allocation, offset and size (``-buffer-assignment.txt``) and the
    instruction that made it (``-buffer-assignment-values.txt``). The peak is the position where
    the device memory the live values cover is largest: per allocation, the union of their
    ``[offset, offset + size)`` spans, so values sharing a buffer count once (XLA's own "peak"
    list adds them up, and counts host memory too). Host-memory values (offloaded residuals,
    colour != 0) are left out: they are not on the device. ``module``: the jitted program's
    HLO module name (``jit_`` and the function's name)."""
    live_range = _one(directory, "-live-range.txt", module)
    values_text = _one(directory, "-buffer-assignment-values.txt", module)
    assignment = _one(directory, "-buffer-assignment.txt", module)
    usage = _one(directory, "-memory-usage-report.txt", module)
    module = _one(directory, ".txt", module)

    length = int(re.search(r"HloLiveRange \(max (\d+)\)", live_range).group(1)) + 1
    sequence = {int(i): n for i, n in re.findall(r"^    (\d+):(\S+)$", live_range, re.M)}
    ranges = {
        n: (int(a), int(b)) for n, a, b in re.findall(r"^    (\S+):(\d+)-(\d+)$", live_range, re.M)
    }

    op_names = {}
    for block in values_text.split("\n<")[1:]:
        instr = re.search(r"from instruction: %(\S+) = (.*)$", block, re.M)
        if instr is None:
            continue
        op = re.search(r'op_name="([^"]*)"', instr.group(2))
        op_names[instr.group(1)] = op.group(1) if op else ""
    # the step's own arguments: the entry computation's parameters (a loop body's parameters
    # are its carried state)
    entry = re.search(r"^ENTRY .*?^}", module, re.M | re.S)
    parameters = set(
        re.findall(r"^\s+%(\S+) = .*?\bparameter\(\d+\)", entry.group(0) if entry else "", re.M)
    )

    placed: dict[str, tuple[int, int, int, str]] = {}  # name -> (allocation, offset, size, shape)
    allocation, on_host = -1, False
    for line in assignment.splitlines():
        alloc = _ALLOCATION.match(line)
        if alloc:
            allocation = int(alloc.group(1))
            on_host = bool(re.search(r"\bcolor (?!0\b)\d+", alloc.group(2)))
            continue
        m = _ASSIGNED.match(line)
        if m and not on_host:
            name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"  # live-range's spelling
            shape = m.group(4) if m.group(4).startswith("(") else m.group(4).split("{")[0]
            placed[name] = (allocation, int(m.group(3)), int(m.group(2)), shape)

    live_at: list[list[str]] = [[] for _ in range(length)]
    for name, (start, end) in ranges.items():
        if name in placed:
            for t in range(start, end + 1):
                live_at[t].append(name)

    def used(names: list[str]) -> int:
        spans: dict[int, list[tuple[int, int]]] = {}
        for n in names:
            a, offset, size, _ = placed[n]
            spans.setdefault(a, []).append((offset, offset + size))
        return sum(_occupied(s) for s in spans.values())

    sharing: dict[tuple[int, int, int], list[str]] = {}
    for name, (a, offset, size, _) in placed.items():
        sharing.setdefault((a, offset, size), []).append(name)

    def op_of(name: str) -> str:
        """The JAX operation that made ``name``; for a value without one (a loop body's
        parameter: the loop's carried state), that of the nearest value in the same buffer
        that has one (the loop itself, or what it was started from)."""
        op = op_names.get(name.split("{")[0], "")
        if op:
            return op
        a, offset, size, _ = placed[name]
        start, end = ranges[name]
        nearest = []
        for other in sharing[(a, offset, size)]:
            other_op = op_names.get(other.split("{")[0], "")
            if other_op and other in ranges:
                s, e = ranges[other]
                nearest.append((max(s - end, start - e, 0), other_op))
        return min(nearest)[1] if nearest else ""

    position = max(range(length), key=lambda t: used(live_at[t]))
    live = []
    covered: dict[int, list[tuple[int, int]]] = {}
    # credit shared bytes to the value that has held them longest (defined first)
    for name in sorted(live_at[position], key=lambda n: (ranges[n][0], n)):
        a, offset, size, shape = placed[name]
        before = _occupied(covered.get(a, []))
        covered.setdefault(a, []).append((offset, offset + size))
        own = _occupied(covered[a]) - before
        if own == 0:
            continue
        instr = name.split("{")[0]
        is_param = instr in parameters
        op = _argument_path(name, op_names.get(instr, "")) if is_param else op_of(name)
        live.append(
            LiveValue(
                name=name,
                shape=shape,
                bytes=own,
                start=ranges[name][0],
                end=ranges[name][1],
                op_name=op,
                kind=_kind(name, op, is_param),
            )
        )
    live.sort(key=lambda v: (-v.bytes, v.start))
    total = re.search(r"Memory Space: default \(color=0\)\nTotal bytes: (\d+)", usage)
    at = sequence.get(position, "")
    return {
        "allocated_bytes": int(total.group(1)) if total else used(live_at[position]),
        "live_bytes": sum(v.bytes for v in live),
        "position": position,
        "length": length,
        "at_peak": op_names.get(at) or at,
        "values": live,
    }

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
    dump = _Dump.read(directory, module)
    live_at: list[list[str]] = [[] for _ in range(dump.length)]
    for name, (start, end) in dump.ranges.items():
        if name in dump.placed:
            for t in range(start, end + 1):
                live_at[t].append(name)
    position = max(range(dump.length), key=lambda t: dump.used(live_at[t]))
    live = dump.live_values(live_at[position])
    at = dump.sequence.get(position, "")
    allocated = dump.allocated
    return {
        "allocated_bytes": dump.used(live_at[position]) if allocated is None else allocated,
        "live_bytes": sum(v.bytes for v in live),
        "position": position,
        "length": dump.length,
        "at_peak": dump.op_names.get(at) or at,
        "values": live,
    }


@dataclasses.dataclass(frozen=True)
class _Dump:
    """What ``parse_dump`` reads from the dump's files: the scheduled program's length and its
    instructions by position, every value's live range, the JAX operation of every instruction,
    the entry computation's parameters, where each device-memory value is placed and which
    values share a place, and the dump's total for device memory (None if not given)."""

    length: int
    sequence: dict[int, str]  # position -> instruction
    ranges: dict[str, tuple[int, int]]  # value -> (first, last position)
    op_names: dict[str, str]  # instruction -> its op_name ("" without one)
    parameters: set[str]
    placed: dict[str, tuple[int, int, int, str]]  # value -> (allocation, offset, size, shape)
    sharing: dict[tuple[int, int, int], list[str]]  # (allocation, offset, size) -> values
    allocated: int | None

    @classmethod
    def read(cls, directory: str, module: str) -> _Dump:
        """The dump's files of ``module`` under ``directory`` (``_one``: of the last module of
        that name compiled, the program itself)."""
        live_range = _one(directory, "-live-range.txt", module)
        values_text = _one(directory, "-buffer-assignment-values.txt", module)
        assignment = _one(directory, "-buffer-assignment.txt", module)
        usage = _one(directory, "-memory-usage-report.txt", module)
        module_text = _one(directory, ".txt", module)
        length = int(re.search(r"HloLiveRange \(max (\d+)\)", live_range).group(1)) + 1
        sequence = {int(i): n for i, n in re.findall(r"^    (\d+):(\S+)$", live_range, re.M)}
        ranges = {
            n: (int(a), int(b))
            for n, a, b in re.findall(r"^    (\S+):(\d+)-(\d+)$", live_range, re.M)
        }
        placed = _placed(assignment)
        sharing: dict[tuple[int, int, int], list[str]] = {}
        for name, (a, offset, size, _) in placed.items():
            sharing.setdefault((a, offset, size), []).append(name)
        total = re.search(r"Memory Space: default \(color=0\)\nTotal bytes: (\d+)", usage)
        return cls(
            length=length,
            sequence=sequence,
            ranges=ranges,
            op_names=_op_names(values_text),
            parameters=_entry_parameters(module_text),
            placed=placed,
            sharing=sharing,
            allocated=int(total.group(1)) if total else None,
        )

    def used(self, names: list[str]) -> int:
        """Device bytes the values ``names`` cover together (shared spans once)."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for n in names:
            a, offset, size, _ = self.placed[n]
            spans.setdefault(a, []).append((offset, offset + size))
        return sum(_occupied(s) for s in spans.values())

    def op_of(self, name: str) -> str:
        """The JAX operation that made ``name``; for a value without one (a loop body's
        parameter: the loop's carried state), that of the nearest value in the same buffer
        that has one (the loop itself, or what it was started from)."""
        op = self.op_names.get(name.split("{")[0], "")
        if op:
            return op
        a, offset, size, _ = self.placed[name]
        start, end = self.ranges[name]
        nearest = []
        for other in self.sharing[(a, offset, size)]:
            other_op = self.op_names.get(other.split("{")[0], "")
            if other_op and other in self.ranges:
                s, e = self.ranges[other]
                nearest.append((max(s - end, start - e, 0), other_op))
        return min(nearest)[1] if nearest else ""

    def live_values(self, names: list[str]) -> list[LiveValue]:
        """The values ``names`` (those live at one position), each with the bytes only it
        covers, largest first: shared bytes are credited to the value that has held them
        longest (defined first); a value left with none is left out."""
        live = []
        covered: dict[int, list[tuple[int, int]]] = {}
        for name in sorted(names, key=lambda n: (self.ranges[n][0], n)):
            a, offset, size, shape = self.placed[name]
            before = _occupied(covered.get(a, []))
            covered.setdefault(a, []).append((offset, offset + size))
            own = _occupied(covered[a]) - before
            if own == 0:
                continue
            instr = name.split("{")[0]
            is_param = instr in self.parameters
            if is_param:
                op = _argument_path(name, self.op_names.get(instr, ""))
            else:
                op = self.op_of(name)
            live.append(
                LiveValue(
                    name=name,
                    shape=shape,
                    bytes=own,
                    start=self.ranges[name][0],
                    end=self.ranges[name][1],
                    op_name=op,
                    kind=_kind(name, op, is_param),
                )
            )
        live.sort(key=lambda v: (-v.bytes, v.start))
        return live


def _op_names(values_text: str) -> dict[str, str]:
    """Every instruction's JAX operation (its ``op_name`` metadata; "" without one), from the
    ``-buffer-assignment-values.txt`` file."""
    op_names = {}
    for block in values_text.split("\n<")[1:]:
        instr = re.search(r"from instruction: %(\S+) = (.*)$", block, re.M)
        if instr is None:
            continue
        op = re.search(r'op_name="([^"]*)"', instr.group(2))
        op_names[instr.group(1)] = op.group(1) if op else ""
    return op_names


def _entry_parameters(module_text: str) -> set[str]:
    """The step's own arguments: the entry computation's parameters (a loop body's parameters
    are its carried state)."""
    entry = re.search(r"^ENTRY .*?^}", module_text, re.M | re.S)
    return set(
        re.findall(r"^\s+%(\S+) = .*?\bparameter\(\d+\)", entry.group(0) if entry else "", re.M)
    )


def _placed(assignment: str) -> dict[str, tuple[int, int, int, str]]:
    """Where each device-memory value is placed, from the ``-buffer-assignment.txt`` file:
    its name (spelled as the live-range file spells it) -> (allocation, offset, size, shape).
    Values in host memory (an allocation of a colour other than 0) are left out."""
    placed: dict[str, tuple[int, int, int, str]] = {}
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
    return placed

"""What is live at the peak of a compiled train step's memory plan, and what made it.

``memory_analysis()`` (``residuals.compiled_plan``) gives a plan's totals; it cannot say which
buffers are alive together at the peak. XLA knows: its buffer assignment computes every value's
live range over the scheduled program and the peak they reach, and writes it out when asked to
dump the compiled module (``--xla_dump_to``). No JAX or XLA Python API returns it, so this
module compiles the step in a child process with that flag set (XLA reads its flags once per
process), parses the three dump files, and maps every live value back to the JAX operation that
produced it (HLO ``op_name`` metadata: ``jvp(...)`` is the forward, ``transpose(...)`` the
backward, ``rematted_computation`` a recomputation, the step's parameters by their argument
path).

The figure is the compiler's own (a compiled plan, for the target the step was compiled for):
``live_bytes`` is what the buffers live at the peak hold; ``allocated_bytes`` the plan's size,
larger by what packing the buffers into one arena costs (fragmentation).

``python -m jaxmem.planner.peak SPEC.json`` is the child (``jaxmem peak`` the command).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from jaxmem.config import ModelConfig, OptimizerConfig
from jaxmem.policy import MemoryPolicy, policy_from_dict, policy_to_dict

KINDS = ("argument", "forward", "recomputed", "backward", "other")
KIND_HELP = {
    "argument": "the step's inputs: parameters, optimizer state, batch",
    "forward": "made by the forward and kept for the backward (activations)",
    "recomputed": "remade in the backward by remat",
    "backward": "made by the backward: cotangents, gradients, their working buffers",
    "other": "loss, optimizer update, outputs",
}
CHILD_TIMEOUT_S = 1800


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


def _one(directory: str, suffix: str) -> str:
    found = sorted(glob.glob(os.path.join(directory, f"*jit_step*after_optimizations{suffix}")))
    if not found:
        raise RuntimeError(f"XLA wrote no *{suffix} for the step under {directory}")
    with open(found[-1]) as f:  # the last module compiled is the step itself
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


def parse_dump(directory: str) -> dict[str, Any]:
    """Parse XLA's dump of the step: every value's live range over the scheduled program
    (``-live-range.txt``), its allocation, offset and size (``-buffer-assignment.txt``) and the
    instruction that made it (``-buffer-assignment-values.txt``). The peak is the position where
    the device memory the live values cover is largest: per allocation, the union of their
    ``[offset, offset + size)`` spans, so values sharing a buffer count once (XLA's own "peak"
    list adds them up, and counts host memory too). Host-memory values (offloaded residuals,
    colour != 0) are left out: they are not on the device."""
    live_range = _one(directory, "-live-range.txt")
    values_text = _one(directory, "-buffer-assignment-values.txt")
    assignment = _one(directory, "-buffer-assignment.txt")
    usage = _one(directory, "-memory-usage-report.txt")
    module = _one(directory, ".txt")

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


# ------------------------------------------------------------------------ compiling, in a child
def explain_peak(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    precision: str,
    opt_cfg: OptimizerConfig,
    batch: int,
    seq_len: int,
    target: str = "cpu",
    accum: int = 1,
    mesh: str | None = None,
) -> PeakReport:
    """Compile the train step ``records.plan_step`` plans for ``target`` (one device, or per
    device over ``mesh``, e.g. ``"fsdp=8"``) in a child process that dumps XLA's buffer
    assignment, and report what is live at its peak."""
    spec = {
        "model": dataclasses.asdict(cfg),
        "policy": policy_to_dict(policy),
        "precision": precision,
        "optimizer": dataclasses.asdict(opt_cfg),
        "batch": batch,
        "seq_len": seq_len,
        "target": target,
        "accum": accum,
        "mesh": mesh,
    }
    with tempfile.TemporaryDirectory(prefix="jaxmem-peak-") as tmp:
        spec_file = os.path.join(tmp, "spec.json")
        with open(spec_file, "w") as f:
            json.dump(spec, f)
        dump = os.path.join(tmp, "xla")
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_module_re=jit_step"
        ).strip()
        # a step read from JAX's persistent compilation cache is not compiled, so not dumped
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        if target == "cpu":
            env.setdefault("JAX_PLATFORMS", "cpu")
        done = subprocess.run(
            [sys.executable, "-m", "jaxmem.planner.peak", spec_file],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            if not tail:  # the child died without a word (the OOM killer's SIGKILL)
                code = done.returncode
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                flags = env["XLA_FLAGS"]
                tail = [f"the child ended with {how} and printed nothing (XLA_FLAGS {flags!r})"]
            raise RuntimeError("compiling the step failed:\n" + "\n".join(tail))
        result = json.loads(done.stdout.strip().splitlines()[-1])
        parsed = parse_dump(dump)
    return PeakReport(
        compiler=result["compiler"],
        planned_peak_bytes=result["planned_peak_bytes"],
        allocated_bytes=parsed["allocated_bytes"],
        live_bytes=parsed["live_bytes"],
        position=parsed["position"],
        length=parsed["length"],
        at_peak=parsed["at_peak"],
        values=tuple(parsed["values"]),
    )


def _child(argv: Sequence[str]) -> None:
    from jaxmem.backend import contain_cuda_plugin

    contain_cuda_plugin()
    from jaxmem.memory.targets import get_target
    from jaxmem.parallel import parse_mesh
    from jaxmem.planner.records import plan_step
    from jaxmem.precision import get_precision

    with open(argv[0]) as f:
        spec = json.load(f)
    parallel = parse_mesh(spec["mesh"]) if spec.get("mesh") else None
    if parallel is not None and spec["target"] == "cpu":
        from jaxmem.sharding import ensure_cpu_devices

        ensure_cpu_devices(parallel.devices)  # before JAX starts its CPU backend
    plan = plan_step(
        ModelConfig(**spec["model"]),
        policy_from_dict(spec["policy"]),
        get_precision(spec["precision"]),
        OptimizerConfig(**spec["optimizer"]),
        spec["batch"],
        spec["seq_len"],
        get_target(spec["target"]),
        accum=spec["accum"],
        parallel=parallel,
    )
    print(
        json.dumps({"compiler": plan["compiler"], "planned_peak_bytes": plan["planned_peak_bytes"]})
    )


if __name__ == "__main__":
    _child(sys.argv[1:])

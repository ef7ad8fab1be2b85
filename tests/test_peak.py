"""``jaxmem peak``: what is live at the peak of a compiled step, from XLA's buffer assignment.

The parser is checked on a hand-written dump (aliased values count once, loop-carried ``phi``
values are read, host memory is left out) and on real compiles: the parameters and optimizer
moments are live at the peak with their bytes, live bytes never exceed the arena, and a policy
that keeps fewer activations shows fewer forward bytes at its peak."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxmem.compare.tolerances import tolerance
from jaxmem.config import get_preset
from jaxmem.memory.targets import get_target
from jaxmem.memory.xla_dump import parse_dump
from jaxmem.parallel import parse_mesh
from jaxmem.planner.peak import explain_peak
from jaxmem.policy import POLICIES
from jaxmem.step.spec import StepSpec

TINY = get_preset("tiny")
BATCH, SEQ = 4, 32
SPEC = StepSpec(model=TINY, policy=POLICIES["full"], batch=BATCH, seq_len=SEQ)  # fp32, AdamW


def _write_dump(directory, live_range: str, values: str, assignment: str, usage: str) -> None:
    stem = "module_0001.jit_step.sm_9.0a_gpu_after_optimizations"
    module = "ENTRY %main (p: f32[25]) -> f32[50] {\n  %p = f32[25]{0} parameter(0)\n}\n"
    for suffix, text in (
        (".txt", module),
        ("-live-range.txt", live_range),
        ("-buffer-assignment-values.txt", values),
        ("-buffer-assignment.txt", assignment),
        ("-memory-usage-report.txt", usage),
    ):
        (directory / f"{stem}{suffix}").write_text(text)


def test_parse_dump_counts_shared_buffers_once_reads_phis_and_drops_host_memory(tmp_path):
    # p: a parameter; a: made at 1, updated in place by b at 2 (same bytes); w: a loop's phi and
    # q: its body's parameter (the carried state, in w's bytes, no op_name of its own); h: an
    # offloaded value in host memory (colour 5), live at the peak but not on the device.
    live_range = """HloLiveRange (max 4)
  InstructionSequence:
    0:p
    1:a
    2:b
    3:w
    4:h
  BufferLiveRange:
    p{}:0-4
    a{}:1-2
    b{}:2-4
    w{}:2-3
    q{}:1-3
    h{}:2-4
  Live ranges at 2 (peak):
    p{}: 100 bytes (cumulative: 100 bytes)
  Stack trace breakdown for peak usage: 100 bytes
"""
    values = """
Total bytes used: 0

Used values:
<0 p @0>
 positions:
  p
 from instruction: %p = f32[25]{0} parameter(0), metadata={op_name="params"}
<1 a @0>
 positions:
  a
 from instruction: %a = f32[50]{0} fusion(%p), metadata={op_name="jit(step)/jvp()/mul"}
<2 b @0>
 positions:
  b
 from instruction: %b = f32[50]{0} fusion(%a), metadata={op_name="jit(step)/transpose(jvp())/add"}
<3 w @0>
 positions:
  w
 from instruction: %w = f32[10]{0} while(%a), metadata={op_name="jit(step)/while"}
<5 q @0>
 positions:
  q
 from instruction: %q = f32[10]{0} parameter(0)
<4 h @0>
 positions:
  h
 from instruction: %h = f32[1000]{0} copy(%a), metadata={op_name="jit(step)/jvp()/copy"}
"""
    assignment = """BufferAssignment:
allocation 0: size 100, parameter 0, shape |f32[25]| at ShapeIndex {}:
 value: <0 p @0> (size=100,offset=0): f32[25]{0}
allocation 1: size 240, preallocated-temp:
 value: <1 a @0> (size=200,offset=0): f32[50]{0}
 value: <2 b @0> (size=200,offset=0): f32[50]{0}
 value: <3 w{} (phi) @0> (size=40,offset=200): f32[10]{0}
 value: <5 q @0> (size=40,offset=200): f32[10]{0}
allocation 2: size 4000, color 5, preallocated-temp:
 value: <5 q @0>
 positions:
  q
 from instruction: %q = f32[10]{0} parameter(0)
<4 h @0> (size=4000,offset=0): f32[1000]{0}
"""
    usage = "Memory Space: default (color=0)\nTotal bytes: 340 (0.00MiB)\n"
    _write_dump(tmp_path, live_range, values, assignment, usage)
    parsed = parse_dump(str(tmp_path))
    # at 1 and 2 the device holds p (100) + one 200-byte buffer (a, then b in its place) + the
    # loop state (40: q, then q and w)
    assert parsed["live_bytes"] == 340
    assert parsed["allocated_bytes"] == 340
    assert parsed["position"] == 1  # the first position reaching the peak
    by_name = {v.name: v for v in parsed["values"]}
    assert set(by_name) == {"p{}", "a{}", "q{}"}  # b shares a's bytes; h is in host memory
    assert by_name["p{}"].kind == "argument" and by_name["p{}"].op_name == "params"
    assert by_name["a{}"].kind == "forward" and by_name["a{}"].shape == "f32[50]"
    assert by_name["q{}"].op_name == "jit(step)/while"  # the loop's, not an argument
    assert by_name["q{}"].kind == "other" and (by_name["q{}"].start, by_name["q{}"].end) == (1, 3)


@pytest.fixture(scope="module")
def reports():
    return {name: explain_peak(SPEC.replace(policy=POLICIES[name])) for name in ("none", "full")}


@pytest.mark.slow
def test_parameters_and_adam_moments_are_live_at_the_peak_with_their_bytes(reports):
    # A leaf whose gradient is ready early (the final norm's) may be updated in place before
    # the peak: its bytes are then the update's output ("other"), not the argument's.
    for report in reports.values():
        args = [v for v in report.values if v.kind == "argument"]
        params = sum(v.bytes for v in args if v.op_name.startswith("params/"))
        moments = sum(
            v.bytes for v in args if v.op_name.startswith(("opt_state/0/mu/", "opt_state/0/nu/"))
        )
        updated = report.by_kind()["other"]
        assert 0 <= TINY.n_params * 4 - params <= updated
        assert 0 <= 2 * TINY.n_params * 4 - moments <= updated
        assert params >= 0.99 * TINY.n_params * 4  # the blocks' and embeddings' weights


@pytest.mark.slow
def test_live_bytes_fit_in_the_arena_and_the_plan(reports):
    for report in reports.values():
        assert 0 < report.live_bytes <= report.allocated_bytes
        assert report.live_bytes <= report.planned_peak_bytes
        assert 0 <= report.position < report.length
        assert sum(report.by_kind().values()) == report.live_bytes


@pytest.mark.slow
def test_full_remat_keeps_fewer_forward_bytes_at_its_peak_than_none(reports):
    none, full = reports["none"].by_kind(), reports["full"].by_kind()
    assert full["forward"] < none["forward"]
    assert reports["full"].live_bytes < reports["none"].live_bytes


@pytest.mark.slow
def test_an_fsdp_plan_reports_one_device_s_share():
    # fsdp=2 on two CPU devices: each holds about half of the parameters (leaves without a dim
    # divisible by 2 stay whole), and the report is per device
    report = explain_peak(SPEC.replace(parallel=parse_mesh("fsdp=2")))
    params = sum(
        v.bytes for v in report.values if v.kind == "argument" and v.op_name.startswith("params/")
    )
    whole = TINY.n_params * 4
    assert 0.45 * whole <= params <= 0.6 * whole
    assert "per device of fsdp=2" in report.compiler


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", "peak", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_peak_command_writes_a_labelled_report(tmp_path):
    out = tmp_path / "peak.json"
    proc = run_cli(
        "--preset", "tiny", "--policy", "full", "--batch-size", "4", "--seq-len", "32",
        "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "live at the peak" in proc.stdout and "compiled plan for XLA:CPU" in proc.stdout
    report = json.loads(out.read_text())
    assert report["figure"].startswith("compiled plan: XLA's buffer assignment")
    assert report["policy"] == "full" and report["live_bytes"] <= report["allocated_bytes"]
    assert sum(report["by_kind_bytes"].values()) == report["live_bytes"]


@pytest.mark.parametrize(
    "args, named",
    [
        (("--policy", "bogus"), "bogus"),
        (("--policy", "nested", "--unroll"), "unroll"),
        (("--seq-len", "100000"), "100000"),
        (("--batch-size", "3", "--accum", "2"), "batch size 3 is not divisible by accum steps 2"),
        (("--target", "tpu9"), "tpu9"),
        (("--mesh", "fsdp=3"), "3"),
    ],
)
def test_peak_command_refuses_bad_input_in_one_line(tmp_path, args, named):
    out = tmp_path / "peak.json"
    proc = run_cli("--preset", "tiny", *args, "--json", str(out))
    assert proc.returncode == 2
    assert named in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_an_offloading_h100_plan_counts_only_device_memory():
    # offload's residuals go to pinned_host (colour 5 in XLA's assignment): were they counted,
    # the live bytes would exceed the device arena, which equals the planned device peak
    report = explain_peak(SPEC.replace(policy=POLICIES["offload"], target=get_target("h100")))
    np.testing.assert_allclose(
        report.allocated_bytes,
        report.planned_peak_bytes,
        **tolerance("bytes", "peak_arena_vs_plan").kwargs(),
    )
    assert 0 < report.live_bytes <= report.allocated_bytes
    assert report.compiler.startswith("XLA:CUDA")


def test_a_flag_xla_does_not_know_is_named_and_nothing_is_written(tmp_path):
    # XLA ends the compiling child natively on an unknown XLA_FLAGS entry: its line comes back
    out = tmp_path / "peak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", "peak", "--preset", "tiny", "--target", "h100"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XLA_FLAGS": "--xla_no_such_flag_in_jaxmem_tests=true"},
    )
    assert proc.returncode == 1
    assert "--xla_no_such_flag_in_jaxmem_tests" in proc.stderr, proc.stderr
    assert not out.exists()


def test_a_child_killed_without_a_word_is_reported_with_its_signal(monkeypatch):
    import jaxmem.planner.peak as peak

    def killed(cmd, **kw):  # what subprocess.run returns for a child the OOM killer ended
        return subprocess.CompletedProcess(cmd, -9, stdout="", stderr="")

    monkeypatch.setattr(peak.subprocess, "run", killed)
    with pytest.raises(RuntimeError, match="ended with signal SIGKILL and printed nothing"):
        explain_peak(SPEC)


@pytest.mark.slow
def test_an_h100_peak_of_host_resident_optimizer_state_plans_it_on_the_device():
    """A deviceless compile cannot place arguments in pinned_host: the plan holds the state on
    the device (an upper bound, said in one line) instead of failing on mixed platforms."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="the gpu-plan extra plans H100s")
    proc = run_cli("--preset", "tiny-llama", "--state-memory", "pinned_host", "--target", "h100")
    assert proc.returncode == 0, proc.stderr
    assert "holds the state on the device" in proc.stdout and "upper bound" in proc.stdout

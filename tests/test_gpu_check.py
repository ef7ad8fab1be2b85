"""benchmarks/gpu_check.py, the one prepared check for a GPU slot, run as ``--dry-run``: every
part of it on the CPU at tiny sizes, so that it cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")


def test_its_help_states_the_expected_time_on_one_h100():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.replace("`", "").split())
    assert "Expected time of --quick on one H100" in text and "about 6 minutes" in text
    assert "--budget-s" in text and "pip install --no-deps --no-build-isolation -e ." in text


@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_writes_at_most_four_files(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(out)) == sorted(
        ["gpu_check.json", "gpu_check.md", "gpu_check.png", "gpu_tests.txt"]
    )
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["environment"]["platform"] == "cpu" and not report["skipped"]
    assert "skipped" in report["tests"]["summary"]  # the GPU-only tests skip on a CPU
    assert report["calibration"]["matmuls"][0]["measured_tflops"] > 0
    kinds = {(c["case"]["stream"], c["case"]["fused"]) for c in report["cases"]}
    assert kinds == {(False, False), (True, False), (False, True)}
    for case in report["cases"]:
        assert "error" not in case, case
        # the deviceless plan for the shipped H100 target, priced in time
        planned = case["deviceless"]
        assert planned["planned_peak_bytes"] > 0 and "H100" in planned["compiler"]
        estimate = planned["step_time"]
        assert estimate["seconds"] > 0 and 0 < estimate["mfu"] < 1
        assert estimate["executed_flops"] >= estimate["model_flops"] > 0
        # run here: timed, and no runtime peak on a CPU
        device = case["device"]
        assert device["step"]["median_s"] > 0 and device["planned_peak_bytes"] > 0
        assert device["runtime_peak_bytes"] is None
    (torch_model,) = report["torch"]
    rows = {(r["policy"], r["compile_backend"]) for r in torch_model["rows"]}
    assert rows == {("none", None), ("selective", None), ("full", None), ("offload", None),
                    ("none", "aot_eager")}  # fmt: skip
    assert all(r["step"]["median_s"] > 0 for r in torch_model["rows"])
    text = (out / "gpu_check.md").read_text()
    for case in report["cases"]:
        assert f"| {case['case']['name']} |" in text
    assert "the shipped h100 target (no GPU here to capture)" in text

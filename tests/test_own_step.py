"""A user's own model through jaxmem's tools: the Flax NNX example (``examples/flax_own_model.py``,
not jaxmem's decoder) planned for an H100 under two policies, and ``jaxmem memory/peak --fn``
with its errors (one line, exit 2)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from jaxmem.compare.tolerances import tolerance
from tests.test_cli_contract import assert_no_stray_lines, run_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flax_own_model.py"
GPU_PLAN = importlib.util.find_spec("jax_cuda12_plugin") is not None
needs_gpu_plan = pytest.mark.skipif(
    not GPU_PLAN,
    reason="deviceless GPU plans need JAX's CUDA plugin and ptxas: pip install "
    "'jaxmem[gpu-plan]' (make test installs it), not installed here",
)
SMALL = "vocab=512, d_model=128, n_heads=2, d_ff=512, n_layers=8, seq_len=512, batch=8"
TINY = "vocab=256, d_model=64, n_heads=2, d_ff=128, n_layers=2, seq_len=64, batch=2"  # plumbing
TIMEOUT = 600


def example():
    spec = importlib.util.spec_from_file_location("flax_own_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["flax_own_model"] = module  # dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


@needs_gpu_plan
@pytest.mark.slow
def test_the_example_prints_its_h100_plans_and_the_policy_moves_them_as_predicted():
    """The example, at a size this machine compiles in seconds: selective keeps the model's own
    tags, per block (q, k, v, proj [B, S, D] and fc1 [B, S, F], bf16; full keeps none), and the
    H100 plan's peak moves by what residual accounting says they cost."""
    sizes = [f"--{k.strip().split('=')[0].replace('_', '-')}={v}" for k, v in
             (kv.split("=") for kv in SMALL.split(","))]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--policies", "selective,full", *sizes],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "plans for h100" in lines[0]
    b, s, d, f, n = 8, 512, 128, 512, 8
    mib = 2**20
    tagged = {"q": n * b * s * d * 2, "k": n * b * s * d * 2, "v": n * b * s * d * 2,
              "proj": n * b * s * d * 2, "fc1": n * b * s * f * 2}  # fmt: skip
    selective = next(line for line in lines if line.strip().startswith("selective: saved"))
    for tag, nbytes in tagged.items():
        assert f"{tag} {nbytes / mib:.2f} MiB" in selective, (tag, selective)
    full = next(line for line in lines if line.strip().startswith("full: saved"))
    assert "fc1" not in full and "q " not in full
    compared = next(line for line in lines if line.startswith("selective against full"))
    predicted = sum(tagged.values())
    assert f"{predicted / mib:.2f} MiB more kept (residual accounting)" in compared
    compiled = float(compared.split("peak ")[1].split(" MiB higher")[0]) * mib
    tol = tolerance("bytes", "tagged_residuals_vs_plan")
    assert abs(compiled - predicted) <= tol.rtol * predicted, (compared, tol.reason)
    assert "fits True" in selective and "fits True" in full


def _entry(tmp_path: pathlib.Path) -> str:
    """A user's entry point file: the example's step at a size this machine compiles fast."""
    path = tmp_path / "small_step.py"
    path.write_text(
        textwrap.dedent(
            f"""
            import importlib.util, sys
            spec = importlib.util.spec_from_file_location("ex", {str(EXAMPLE)!r})
            ex = sys.modules["ex"] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(ex)

            def make_step(policy=None):
                return ex.make_step(policy, ex.Config({TINY}))

            def no_policy():
                return ex.make_step(None, ex.Config({TINY}))

            def broken(policy=None):
                raise KeyError("vocab_size")

            def not_a_step():
                return 42
            """
        )
    )
    return str(path)


def jaxmem(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="120", JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


@needs_gpu_plan
@pytest.mark.slow
def test_memory_and_peak_take_your_step_from_the_command_line(tmp_path):
    entry = _entry(tmp_path)
    done = jaxmem(
        "memory",
        "--fn",
        f"{entry}:make_step",
        "--policies",
        "selective,full",
        "--target",
        "h100",
        "--json",
        "m.json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "deviceless compile for NVIDIA H100" in done.stdout
    assert "saved by tag" in done.stdout and "fc1" in done.stdout
    rows = json.loads((tmp_path / "m.json").read_text())
    assert [r["policy"] for r in rows] == ["selective", "full"]
    assert rows[0]["residuals"]["by_tag"]["fc1"] == 2 * 2 * 64 * 128 * 2  # layers, B, S, F, bf16
    assert rows[1]["matmul_flops"] > rows[0]["matmul_flops"]  # full replays the projections
    done = jaxmem(
        "peak", "--fn", f"{entry}:make_step", "--policy", "selective", "--json", "p.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "live at the peak" in done.stdout and "by tag" in done.stdout
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["live_bytes"] <= report["allocated_bytes"]
    assert report["plan"]["target"] == "cpu"


def test_bad_entry_points_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from jaxmem import cli

    entry = _entry(tmp_path)
    _, script = _user_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    at = f"small_step.py:{_line_of(entry, 'raise KeyError')}"  # where in the user's file
    cases = [
        (("memory", "--fn", "small_step"), "must be MODULE:FUNCTION"),
        (("memory", "--fn", "no_such_module_xyz:make_step"), "importing no_such_module_xyz failed"),
        (("memory", "--fn", "missing.py:make_step"), "no such file missing.py"),
        (("peak", "--fn", f"{entry}:nothing"), "has no 'nothing'"),
        (("memory", "--fn", f"{entry}:broken"), f"broken() raised KeyError: 'vocab_size' at {at}"),
        (("memory", "--fn", f"{entry}:not_a_step"), "returned int"),
        (
            ("memory", "--fn", f"{script}:main"),
            "script.py exited (sys.exit(0) at "
            f"script.py:{_line_of(script, 'sys.exit')}); a module --fn imports must not exit",
        ),
        (("memory", "--fn", f"{entry}:no_policy", "--policies", "full"), "takes no policy"),
        (("memory", "--fn", f"{entry}:make_step", "--preset", "tiny"), "--preset describe"),
        (("peak", "--fn", f"{entry}:make_step", "--target", "h200"), "unknown target 'h200'"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            cli.main(list(argv))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2, (argv, err)
        assert len(err) == 1 and message in err[0], (argv, err)


def _line_of(path: str, text: str) -> int:
    lines = pathlib.Path(path).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def _user_files(tmp_path: pathlib.Path) -> tuple[str, str]:
    """A user's module that uses JAX as it is imported, and one that exits as it is imported
    (a training script without a ``__main__`` guard)."""
    uses_jax = tmp_path / "uses_jax.py"
    uses_jax.write_text(
        textwrap.dedent(
            """
            import sys

            import jax.numpy as jnp

            X = jnp.ones((8, 8))  # JAX's backend starts as the module is imported


            def make_step(policy=None):
                return (lambda x: (x @ x).sum()), (X,)


            def exits(policy=None):
                sys.exit(0)
            """
        )
    )
    script = tmp_path / "script.py"
    script.write_text("import sys\n\nsys.exit(0)\n")
    return str(uses_jax), str(script)


def test_a_module_that_uses_jax_as_it_is_imported_prints_only_jaxmems_lines(tmp_path):
    """JAX's backend starts quietly before the user's module is imported, as it does for
    jaxmem's own runs: none of the CUDA plugin's start-up lines (with the gpu-plan extra and no
    GPU) reach the terminal."""
    uses_jax, _ = _user_files(tmp_path)
    proc = run_cli("memory", "--fn", f"{uses_jax}:make_step")
    assert proc.returncode == 0, proc.stderr
    assert "as written" in proc.stdout and proc.stderr == ""
    assert_no_stray_lines(proc.stdout + proc.stderr)


def test_an_entry_point_that_exits_is_one_line_and_exit_2(tmp_path):
    """``sys.exit(0)`` in the entry point is not a success: one line naming where, exit 2 (a
    module that exits as it is imported: ``test_bad_entry_points_are_one_line_and_exit_2``)."""
    uses_jax, _ = _user_files(tmp_path)
    proc = run_cli("memory", "--fn", f"{uses_jax}:exits")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "", proc
    where = f"uses_jax.py:{_line_of(uses_jax, 'sys.exit')}"
    assert len(err) == 1 and "exits() exited (sys.exit(0) at " in err[0], err
    assert f"{where}); an entry point returns a step and must not exit" in err[0], err


@needs_gpu_plan
@pytest.mark.slow
def test_the_api_pages_snippets_run_and_print_what_the_page_says(tmp_path):
    import re

    page = (ROOT / "docs" / "your-model.md").read_text()
    script = tmp_path / "snippets.py"
    script.write_text("\n".join(re.findall(r"```python\n(.*?)```", page, re.S)))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr
    for shown in (
        "('fc1', 'fc2')",
        "selective 336 MiB {'fc1': 256, '<layer input>': 64, '<untagged>': 16}",
        "full 0.962072674304 TFLOP",
        "528 MiB, fits: True",
        "80 MiB of arguments per device",
        "{'fc1': 256, '<layer input>': 64}",
        "names tag(s) ['fc3'] that the function never produces",
    ):
        assert shown in done.stdout and shown in page, shown

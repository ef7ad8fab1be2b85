"""The ``jaxmem`` command line on its own (JAX only): presets, planning a large preset from
shapes, one-line errors, and the commands that need PyTorch saying so when it is missing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxmem import cli
from jaxmem.cli import common


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_memory_command_plans_a_large_preset_from_shapes(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_cli(
        "memory",
        "--preset",
        "gpt2-1.5b",
        "--policies",
        "full",
        "--precision",
        "bf16",
        "--batch-size",
        "1",
        "--seq-len",
        "256",
        "--frameworks",
        "jax",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    (record,) = json.loads(out.read_text())
    assert record["planned_from_shapes"] is True and record["framework"] == "jax"
    assert record["params_bytes"] == 4 * 1_557_611_200  # fp32 master weights, analytic count
    assert "compiled plan" in record["peak_source"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["memory", "--preset", "huge"], "unknown preset 'huge'"),
        (["memory", "--policies", "none,most"], "unknown memory policy 'most'"),
        (["memory", "--attention", "flash"], "attention='flash' is not one of ('naive', 'fused')"),
        (["memory", "--frameworks", "jax,tf"], "unknown frameworks ['tf']"),
        (["memory", "--frameworks", "jax", "--precision", "fp8"], "unknown precision 'fp8'"),
        (
            ["memory", "--frameworks", "jax", "--seq-len", "100"],
            "seq_len=100 exceeds the model's max_seq_len=64",
        ),
        (["seed-example", "--policy", "most"], "unknown memory policy 'most'"),
        (["memory", "--unroll", "--policies", "full,nested"], "--unroll cannot apply to nested"),
        (
            ["train", "--preset", "tiny", "--num-processes", "2", "--coordinator", "localhost:1"],
            "--num-processes 2 needs a --mesh spanning every process's devices",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["parity"], "jaxmem parity"),
        (["bench", "--quick"], "jaxmem bench"),
        (["memory", "--frameworks", "jax,torch"], "jaxmem memory --frameworks torch"),
        (["train", "--preset", "tiny", "--framework", "torch"], "jaxmem train --framework torch"),
        (["seed-example", "--framework", "torch"], "jaxmem seed-example --framework torch"),
    ],
)
def test_commands_that_need_pytorch_say_which_extra_to_install(args, what, monkeypatch, capsys):
    monkeypatch.setattr(common, "torch_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"jaxmem {args[0]}: error: {what} needs PyTorch, which is not installed: "
        "pip install 'jaxmem[torch]'"
    ]


def test_memory_without_pytorch_reports_jax_alone(monkeypatch, capsys):
    monkeypatch.setattr(common, "torch_available", lambda: False)
    assert cli.main(["memory", "--policies", "full", "--batch-size", "2", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "PyTorch is not installed: JAX only" in out and "jaxmem.memory.remat" in out


@pytest.mark.slow
def test_memory_unroll_says_how_the_stack_ran(monkeypatch, capsys):
    monkeypatch.setattr(common, "torch_available", lambda: False)
    args = ["memory", "--policies", "none", "--batch-size", "2", "--seq-len", "16", "--unroll"]
    assert cli.main(args) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "jax.checkpoint per block, stack unrolled" in out
    assert "--unroll on XLA:CPU" in out


def test_presets_command_lists_every_preset(capsys):
    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny", "small", "seed", "gpt2-124m", "gpt3-6.7b"):
        assert name in out


def test_seed_example_command_trains_in_jax(capsys):
    assert cli.main(["seed-example", "--steps", "3", "--policy", "full"]) == 0
    lines = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[3]) for line in lines]
    assert len(losses) == 3 and losses[-1] < losses[0]

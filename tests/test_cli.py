from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxmem import cli


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_parity_command_writes_json_and_passes(tmp_path):
    out = tmp_path / "parity.json"
    proc = run_cli("parity", "--preset", "tiny", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    for key in ("loss_jax", "loss_torch", "max_abs_grad_diff", "max_rel_grad_diff", "passed"):
        assert key in report
    assert report["passed"] is True
    assert abs(report["loss_jax"] - report["loss_torch"]) < 1e-5
    assert "parity PASSED" in proc.stdout


def test_parity_command_exits_nonzero_when_frameworks_disagree(tmp_path, monkeypatch, capsys):
    import jaxmem.parity as parity

    real = parity.torch_model_from

    def perturbed(model):
        torch_model = real(model)
        import torch

        with torch.no_grad():
            torch_model.wte.weight.mul_(1.01)
        return torch_model

    monkeypatch.setattr(parity, "torch_model_from", perturbed)
    out = tmp_path / "p.json"
    assert cli.main(["parity", "--preset", "tiny", "--json", str(out)]) == cli.EXIT_PARITY_FAILED
    assert json.loads(out.read_text())["passed"] is False
    assert "parity FAILED" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["parity", "--preset", "huge"], "unknown preset 'huge'; choose one of: tiny"),
        (["parity", "--preset", "tiny", "--seq-len", "65"], "--seq-len 65 exceeds"),
        (["parity", "--preset", "gpt2-1.5b"], "parity runs both frameworks in fp32"),
        (["parity", "--json", "/nonexistent/dir/x.json"], "directory /nonexistent/dir"),
        (["train", "--preset", "tiny", "--steps", "0"], "0 must be a positive integer"),
        (["train", "--preset", "tiny", "--lr", "-1"], "-1.0 must be positive"),
        (["train", "--preset", "tiny", "--seq-len", "1000"], "--seq-len 1000 exceeds"),
        (["train", "--preset", "seed"], "--preset seed is the seeds' single layer"),
        (["train", "--preset", "gpt2-124m"], "planning-only shape"),
        (["train", "--preset", "tiny", "--policy", "most"], "unknown memory policy 'most'"),
        (["train", "--preset", "tiny", "--precision", "fp8"], "unknown precision 'fp8'"),
        (["train", "--preset", "tiny", "--optimizer", "lion"], "optimizer='lion' is not one of"),
        (
            ["train", "--preset", "tiny", "--batch-size", "6", "--accum", "4"],
            "batch size 6 is not divisible by accum steps 4",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_memory_command_writes_one_record_per_framework_and_policy(tmp_path):
    out = tmp_path / "m.json"
    proc = run_cli(
        "memory",
        "--preset",
        "tiny",
        "--policies",
        "none,full,selective,offload",
        "--frameworks",
        "jax,torch",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())
    assert {(r["framework"], r["policy"]) for r in records} == {
        (f, p) for f in ("jax", "torch") for p in ("none", "full", "selective", "offload")
    }
    for r in records:
        for key in cli_record_fields():
            assert key in r, key
        assert r["peak_source"] and r["saved_source"] and r["flops_source"]
        assert (r["compiled_temp_bytes"] is None) == (r["framework"] == "torch")
    by = {(r["framework"], r["policy"]): r for r in records}
    for fw in ("jax", "torch"):
        assert by[(fw, "offload")]["saved_activation_bytes_host"] > 0
        assert by[(fw, "full")]["flops"] > by[(fw, "none")]["flops"]
    assert "How each figure was obtained" in proc.stdout


def cli_record_fields():
    from jaxmem.report import RECORD_FIELDS

    return RECORD_FIELDS


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
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    (record,) = json.loads(out.read_text())
    assert record["planned_from_shapes"] is True and record["framework"] == "jax"
    assert record["params_bytes"] == 4 * 1_557_611_200  # fp32 master weights, analytic count
    assert "compiled plan" in record["peak_source"]
    assert "planning-only" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["memory", "--preset", "huge"], "unknown preset 'huge'"),
        (["memory", "--policies", "none,most"], "unknown policies ['most']"),
        (["memory", "--frameworks", "jax,tf"], "unknown frameworks ['tf']"),
        (["memory", "--precision", "fp8"], "unknown precision 'fp8'"),
        (["memory", "--seq-len", "100"], "--seq-len 100 exceeds"),
    ],
)
def test_memory_command_bad_input(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_train_refuses_a_non_empty_out_dir_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--preset", "tiny", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_presets_command_lists_every_preset(capsys):
    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny", "small", "seed", "gpt2-124m", "gpt3-6.7b"):
        assert name in out

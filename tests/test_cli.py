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
    for policy in ("none", "full", "selective", "offload"):
        assert f"{policy}: saved tensors that differ (jaxmem vs torch_ref)" in proc.stdout
        for fw in ("jax", "torch"):
            named = by[(fw, policy)]["saved_by_name"]
            rec = by[(fw, policy)]
            total = rec["saved_activation_bytes_device"] + rec["saved_activation_bytes_host"]
            assert sum(named.values()) == total
    assert by[("torch", "none")]["hook_saved_bytes_device"] > 0


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
        (["bench", "--preset", "gpt2-1.5b"], "cannot run both frameworks on this machine"),
        (["bench", "--preset", "huge"], "unknown preset 'huge'"),
        (["bench", "--accum", "3"], "--accum 3 does not divide --batch-size 8"),
        (["bench", "--depths", "0"], "--depths '0': give comma-separated positive integers"),
        (["bench", "--quick", "--seq-lens", "64,99"], "sequence length 99 exceeds tiny"),
        (["bench", "--time-policies", "none,most"], "unknown policies ['most']"),
        (["bench", "--out", "/nonexistent/dir/x"], "is not a writable directory"),
    ],
)
def test_memory_and_bench_bad_input(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_presets_command_lists_every_preset(capsys):
    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny", "small", "seed", "gpt2-124m", "gpt3-6.7b"):
        assert name in out


def test_bench_command_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "bench"
    proc = run_cli(
        "bench",
        "--quick",
        "--depths",
        "1,2",
        "--seq-lens",
        "16",
        "--accum",
        "1,2",
        "--repeats",
        "1",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "sweep.json").read_text())
    meta = result["meta"]
    for key in ("date", "device", "versions", "plan", "base_config", "cpu_count"):
        assert key in meta, key
    assert meta["plan"]["depths"] == [1, 2] and meta["base_config"]["n_layers"] == 2
    from jaxmem.remat import POLICIES

    assert {(r["policy"], r["precision"]) for r in result["policy_precision"]} == {
        (p, prec) for p in POLICIES for prec in ("fp32", "bf16")
    }
    for r in result["policy_precision"]:
        assert r["jax_flops"] > 0 and r["torch_flops"] > 0
    assert [r["n_layers"] for r in result["depth"] if r["policy"] == "full"] == [1, 2]
    timed = {r["policy"]: r for r in result["step_time"]}
    assert set(timed) == {"none", "full"}
    for r in timed.values():
        assert r["median_s"]["jax"] > 0 and r["median_s"]["torch"] > 0
    for name in (
        "sweep.md",
        "bytes_per_policy.png",
        "memory_vs_layers.png",
        "pareto.png",
        "step_time.png",
    ):
        assert (out / name).stat().st_size > 0, name
    assert "### step time" in (out / "sweep.md").read_text()

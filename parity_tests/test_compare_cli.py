"""The commands that compare with PyTorch: ``jaxmem parity``, ``memory`` (torch rows, stock and
the extension), ``bench`` and ``seed-example --framework torch``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxmem import cli
from jaxmem.compare.bench import PEERS
from jaxmem.planner.records import RECORD_FIELDS
from jaxmem.policy import POLICIES


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_parity_command_writes_json_and_passes_in_float64_and_fp32(tmp_path):
    out = tmp_path / "parity.json"
    proc = run_cli("parity", "--preset", "tiny", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["preset"] == "tiny"
    assert [r["dtype"] for r in report["results"]] == ["float64", "float32"]
    for r in report["results"]:
        for key in ("loss_jax", "loss_torch", "max_abs_grad_diff", "max_rel_grad_diff", "passed"):
            assert key in r
        assert r["passed"] is True
    f64, f32 = report["results"]
    # float64 agrees ~10 orders of magnitude closer than fp32 does
    assert f64["max_rel_grad_diff"] < 1e-12 < f32["max_rel_grad_diff"]
    # the report fits 100 columns with every digit the JSON has: one row per dtype
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("parity PASSED (tiny, batch 4, seq 32)")
    assert max(len(line) for line in lines) <= 100
    for r, row in zip(report["results"], lines[2:4], strict=True):
        assert row.split()[:6] == [
            r["dtype"],
            "PASSED",
            f"{r['loss_jax']:.9f}",
            f"{r['loss_torch']:.9f}",
            f"{r['max_abs_grad_diff']:.3e}",
            f"{r['max_rel_grad_diff']:.3e}",
        ]


def test_parity_command_exits_nonzero_when_frameworks_disagree(tmp_path, monkeypatch, capsys):
    import jaxmem.compare.parity as parity

    real = parity.torch_model_from

    def perturbed(model):
        import torch

        torch_model = real(model)
        with torch.no_grad():
            torch_model.wte.weight.mul_(1.01)
        return torch_model

    monkeypatch.setattr(parity, "torch_model_from", perturbed)
    out = tmp_path / "p.json"
    code = cli.main(["parity", "--preset", "tiny", "--dtype", "float64", "--json", str(out)])
    assert code == cli.EXIT_PARITY_FAILED
    assert json.loads(out.read_text())["passed"] is False
    assert "parity FAILED" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["parity", "--preset", "huge"], "unknown preset 'huge'; choose one of: tiny"),
        (["parity", "--preset", "tiny", "--seq-len", "65"], "--seq-len 65 exceeds"),
        (["parity", "--preset", "gpt2-1.5b"], "parity runs both frameworks in float64"),
        (["parity", "--json", "/nonexistent/dir/x.json"], "directory /nonexistent/dir"),
        (["bench", "--preset", "gpt2-1.5b"], "cannot run both frameworks on this machine"),
        (["bench", "--preset", "huge"], "unknown preset 'huge'"),
        (["bench", "--accum", "3"], "--accum 3 does not divide --batch-size 8"),
        (["bench", "--depths", "0"], "--depths '0': give comma-separated positive integers"),
        (["bench", "--quick", "--seq-lens", "64,99"], "sequence length 99 exceeds tiny"),
        (["bench", "--time-policies", "none,most"], "unknown policies ['most']"),
        (["bench", "--out", "/nonexistent/dir/x"], "is not a writable directory"),
        (["seed-example", "--framework", "torch", "--policy", "most"], "unknown memory policy"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


@pytest.mark.slow
def test_memory_command_shows_stock_pytorch_and_the_extension_beside_jax(tmp_path):
    out = tmp_path / "m.json"
    policies = ("none", "full", "selective", "offload")
    proc = run_cli(
        "memory", "--preset", "tiny", "--policies", ",".join(policies), "--json", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())
    # torch-lean only where the extension differs from stock: selective (offload has no stock
    # translation, so its torch row already is the extension)
    assert {(r["framework"], r["policy"]) for r in records} == {
        *((f, p) for f in ("jax", "torch") for p in policies),
        ("torch-lean", "selective"),
    }
    by = {(r["framework"], r["policy"]): r for r in records}
    for r in records:
        for key in RECORD_FIELDS:
            assert key in r, key
        assert r["peak_source"] and r["saved_source"] and r["flops_source"] and r["translation"]
        assert (r["compiled_temp_bytes"] is None) == (r["framework"] != "jax")
        total = r["saved_activation_bytes_device"] + r["saved_activation_bytes_host"]
        assert sum(r["saved_by_name"].values()) == total
    assert by[("torch", "selective")]["translation"].startswith("stock: checkpoint")
    assert "create_selective_checkpoint_contexts" in by[("torch", "selective")]["translation"]
    assert "no stock API" in by[("torch", "offload")]["translation"]
    assert by[("torch-lean", "selective")]["translation"].startswith("lean (torch_ref extension")
    # stock selective checkpointing caches every output the policy stores, read or not: more
    # bytes than the extension, which keeps what the backward reads (as JAX does)
    stock, lean = by[("torch", "selective")], by[("torch-lean", "selective")]
    assert stock["saved_activation_bytes_device"] > lean["saved_activation_bytes_device"]
    for fw in ("jax", "torch"):
        assert by[(fw, "offload")]["saved_activation_bytes_host"] > 0
        assert by[(fw, "full")]["flops"] > by[(fw, "none")]["flops"]
    assert "How each figure was obtained" in proc.stdout and "What ran" in proc.stdout
    for policy in policies:
        assert f"{policy}: saved tensors that differ (jaxmem vs torch)" in proc.stdout
    assert "selective: saved tensors that differ (jaxmem vs torch-lean)" in proc.stdout
    assert by[("torch", "none")]["hook_saved_bytes_device"] > 0
    # two kinds of peak, two columns: JAX's is a compiled plan, PyTorch's a runtime peak
    assert "planned peak" in proc.stdout and "runtime peak" in proc.stdout
    for r in records:
        planned = r["peak_source"].startswith("compiled plan")
        assert planned == (r["framework"] == "jax"), r["peak_source"]
    # the saved-tensor hooks note appears exactly for the rows where the hooks see other bytes
    for r in records:
        if r["framework"] == "jax":
            continue
        hooks = r["hook_saved_bytes_device"] + r["hook_saved_bytes_host"]
        differs = hooks != r["saved_activation_bytes_device"] + r["saved_activation_bytes_host"]
        note = f"{r['framework']} {r['policy']}: saved-tensor hooks see"
        assert (note in proc.stdout) == differs, (note, differs)
    # stock selective checkpointing caches outside the hooks: that row must carry the note
    assert "torch selective: saved-tensor hooks see" in proc.stdout


@pytest.mark.slow
def test_parity_and_memory_commands_run_the_llama_block(tmp_path):
    """``jaxmem parity --preset tiny-llama`` passes in float64 and fp32, and ``jaxmem memory``
    puts stock PyTorch's and the extension's rows beside JAX's, its listing naming what stock
    PyTorch keeps that jaxmem does not (SwiGLU's ``silu(gate)``)."""
    proc = run_cli("parity", "--preset", "tiny-llama")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("parity PASSED (tiny-llama")
    assert [line.split()[:2] for line in proc.stdout.splitlines()[2:]] == [
        ["float64", "PASSED"],
        ["float32", "PASSED"],
    ]
    out = tmp_path / "m.json"
    proc = run_cli(
        "memory", "--preset", "tiny-llama", "--policies", "none,selective", "--json", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    by = {(r["framework"], r["policy"]): r for r in json.loads(out.read_text())}
    assert set(by) == {
        ("jax", "none"),
        ("torch", "none"),
        ("jax", "selective"),
        ("torch", "selective"),
        ("torch-lean", "selective"),
    }
    assert by[("torch", "none")]["saved_by_name"]["<silu in block>"] > 0
    assert by[("jax", "none")]["flops"] == by[("torch", "none")]["flops"]
    assert "<silu in block>" in proc.stdout


@pytest.mark.slow
def test_memory_for_a_gpu_target_has_torch_rows_from_fake_tensors_at_gpt2_1_5b(tmp_path):
    """At a size this machine cannot hold, the torch column exists: torch_ref's step under
    FakeTensorMode, each row saying how it was obtained (JAX's H100 plan beside it is tested on
    tiny; compiling 1.5B here would double the test); full keeps exactly the 48 layer inputs,
    in bf16, as JAX's residual accounting does."""
    out = tmp_path / "m.json"
    proc = run_cli(
        "memory", "--preset", "gpt2-1.5b", "--target", "h100", "--frameworks", "torch",
        "--policies", "full", "--precision", "bf16", "--batch-size", "1", "--seq-len", "256",
        "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (torch_rec,) = json.loads(out.read_text())
    assert torch_rec["framework"] == "torch"
    assert torch_rec["planned_from_shapes"] and torch_rec["precision"] == "bf16"
    assert torch_rec["saved_by_name"]["<layer input>"] == 48 * 1 * 256 * 1600 * 2
    assert torch_rec["peak_bytes"] is None and "FakeTensorMode" in torch_rec["saved_source"]
    assert torch_rec["opt_state_bytes"] >= 2 * torch_rec["params_bytes"]  # AdamW, fp32 moments
    assert "torch rows: torch_ref's step run under FakeTensorMode" in proc.stdout
    assert "plan columns are JAX's only" in proc.stdout


@pytest.mark.slow
def test_bench_command_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "bench"
    proc = run_cli(
        "bench",
        "--quick",
        "--depths",
        "2",
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
    assert "Warning" not in proc.stderr  # matplotlib's, for one (nothing but jaxmem's lines)
    result = json.loads((out / "sweep.json").read_text())
    assert result["meta"]["compiler"] == "XLA for the local backend"
    meta = result["meta"]
    for key in ("date", "device", "versions", "plan", "base_config", "cpu_count"):
        assert key in meta, key
    assert meta["plan"]["depths"] == [2] and meta["base_config"]["n_layers"] == 2
    assert {(r["policy"], r["precision"]) for r in result["policy_precision"]} == {
        (p, prec) for p in [*POLICIES, *PEERS] for prec in ("fp32", "bf16")
    }
    for r in result["policy_precision"]:
        assert r["jax_flops"] > 0 and r["torch_flops"] > 0 and r["torch_translation"]
        assert r["torch_is_stock"] == (r["policy"] != "offload")
        assert r.get("peer", False) == (r["policy"] in PEERS)
        has_lean = r["policy"] in ("selective", "mlp", "nested", *PEERS)
        assert (r["torch_lean_flops"] is not None) == has_lean, r["policy"]
    assert [r["n_layers"] for r in result["depth"] if r["policy"] == "full"] == [2]
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
    text = (out / "sweep.md").read_text()
    assert "### step time" in text and "torch lean MiB" in text and "†" in text
    assert "dominated by (JAX / torch)" in text and "`dots_with_no_batch_dims_saveable`" in text
    assert "JAX compiled temp: jit(grad)'s plan, XLA for the local backend" in text


@pytest.mark.slow
def test_bench_plans_for_a_gpu_target():
    """``bench --target h100``: the depth axis's jit(grad) plans are compiled for the H100
    without a GPU, offload's host bytes included (XLA:CPU's plan erases them); a bad target is
    a one-line error before anything runs."""
    from jaxmem.compare.bench import memory_point
    from jaxmem.config import PRESETS
    from jaxmem.memory.targets import get_target

    h100 = get_target("h100")
    row = memory_point(PRESETS["tiny"], "offload", "fp32", 2, 16, torch_too=False, target=h100)
    assert row["jax_compiled_host_temp_bytes"] == row["jax_host_bytes"] > 0
    proc = run_cli("bench", "--quick", "--target", "v100", "--out", "unused")
    assert proc.returncode == 2 and "unknown target 'v100'" in proc.stderr


def test_seed_example_command_runs_in_both_frameworks(capsys):
    for framework in ("jax", "torch"):
        assert cli.main(["seed-example", "--framework", framework, "--steps", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    losses = {line.split("(")[1]: float(line.split()[3]) for line in out}
    assert len(out) == 4 and len(losses) == 2


def test_set_threads_pins_both_frameworks_and_refuses_impossible_counts():
    """In a subprocess: the affinity change is the process's, and XLA must not have started."""
    code = """
import json, os
from jaxmem.compare import bench
cores = len(os.sched_getaffinity(0))
try:
    bench.set_threads(cores + 1)
    refused = None
except ValueError as e:
    refused = str(e)
meta = bench.set_threads(1)
print(json.dumps({"cores": cores, "refused": refused, "meta": meta,
                  "affinity": sorted(os.sched_getaffinity(0))}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (
        got["refused"]
        == f"threads={got['cores'] + 1} must be between 1 and the {got['cores']} usable cores"
    )
    assert got["meta"]["threads"] == 1 and got["meta"]["torch_threads"] == 1
    assert got["affinity"] == got["meta"]["cpu_affinity"] and len(got["affinity"]) == 1


def test_busy_warning_fires_only_beyond_the_benchmarks_own_load(monkeypatch):
    from jaxmem.compare import bench

    monkeypatch.setattr(bench, "usable_cores", lambda: 4)
    assert bench.busy_warning([0.1, 0.2, 0.3], [1.9, 1.0, 0.5], threads=2) is None
    assert "busy" in bench.busy_warning([1.5, 1.0, 0.5], [1.9, 1.0, 0.5], threads=2)
    assert "busy" in bench.busy_warning([0.1, 0.2, 0.3], [3.0, 1.0, 0.5], threads=2)
    assert "busy" in bench.busy_warning([0.1, 0.2, 0.3], [4.4, 1.0, 0.5], threads=4)

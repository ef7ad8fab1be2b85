"""GPU memory plans without a GPU: the shipped targets, the deviceless XLA:CUDA compile of the
train step, the `memory --target` command, and keeping JAX's CUDA plugin quiet on a CPU machine.
Needs jaxmem[gpu-plan] (``make test`` installs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jaxmem import cli
from jaxmem.backend import quiet_native_stderr
from jaxmem.config import PRESETS, ConfigError, OptimizerConfig
from jaxmem.memory import gpu_plan
from jaxmem.memory.targets import RATES, SHIPPED, get_target, parse_target, rates_for
from jaxmem.model.flash import cudnn_installed
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

TINY_STEP = StepSpec(model=PRESETS["tiny"], policy=POLICIES["selective"], batch=4, seq_len=32)


@pytest.mark.parametrize("name", list(SHIPPED))
def test_every_shipped_target_parses_and_gives_a_gpu_device(name):
    target = get_target(name)
    assert target.is_gpu and target.device_memory_bytes > 20 * 2**30
    sharding = gpu_plan.target_sharding(target)  # XLA parses the whole proto here
    (device,) = sharding.mesh.devices.flat
    assert device.platform == "gpu" and device.device_kind == target.description


@pytest.mark.parametrize(
    ("name", "sms", "bandwidth", "bf16"),
    [("l40s-48gb", 142, 864e9, 362.05e12), ("rtx4090-24gb", 128, 1008e9, 165.2e12)],
)
def test_the_fine_tuning_cards_carry_their_datasheet_figures(name, sms, bandwidth, bf16):
    """The 48 GB and 24 GB Ada cards (compute capability 8.9): SMs and bandwidth read from their
    target files, dense bf16 rates from the cost model's table; a captured file describing the
    same GPU is costed at the same rates."""
    target = get_target(name)
    assert "cuda_compute_capability { major: 8 minor: 9 }" in target.config_text
    assert (target.multiprocessors, target.memory_bandwidth) == (sms, bandwidth)
    assert rates_for(target).matmul_flops["bfloat16"] == bf16
    captured = parse_target("mine", target.config_text, "mine.txtpb")
    assert rates_for(captured) is RATES[name]


# the two sm_89 cards: each compile takes 10-30 s on 2 shared cores
SM89 = [pytest.param(n, marks=pytest.mark.slow) for n in ("l40s-48gb", "rtx4090-24gb")]


@pytest.mark.parametrize("name", ["v100-32gb", "a10-24gb", *SM89])
def test_the_smaller_cards_compile_a_bf16_step(name):
    """The 48, 32 and 24 GB targets (a V100 of ZeRO-Offload's single-GPU setting, an A10, the
    fine-tuners' L40S and RTX 4090) are not only parsed: XLA:CUDA compiles a bf16 train step for
    them (sm_70, sm_86 and sm_89), and the compiler named is the card's."""
    record = jax_record(TINY_STEP.replace(precision=PRECISIONS["bf16"], target=get_target(name)))
    target = get_target(name)
    assert record["compiler"] == (
        f"XLA:CUDA deviceless compile for {target.description} (target {name})"
    )
    assert record["peak_source"].startswith("compiled plan (XLA:CUDA deviceless compile for")
    assert 0 < record["peak_bytes"] < target.device_memory_bytes


def plan(policy: str, target: str = "h100") -> dict:
    return jax_record(TINY_STEP.replace(policy=POLICIES[policy], target=get_target(target)))


@pytest.mark.slow
def test_the_h100_plan_of_tiny_orders_the_policies_and_shows_offload():
    r = {p: plan(p) for p in ("none", "selective", "full", "offload")}
    temp = {p: x["compiled_temp_bytes"] for p, x in r.items()}
    assert temp["none"] > temp["selective"] > temp["full"]
    assert temp["offload"] < temp["selective"]
    # what offload moves to the host is in the plan (XLA:CPU's plan erases it)
    assert r["offload"]["plan_host_bytes"] > 0
    assert r["offload"]["plan_host_bytes"] == r["offload"]["saved_activation_bytes_host"]
    assert all(x["plan_host_bytes"] == 0 for p, x in r.items() if p != "offload")
    for x in r.values():
        assert (
            x["compiler"] == "XLA:CUDA deviceless compile for NVIDIA H100 80GB HBM3 (target h100)"
        )
        assert x["peak_source"].startswith(f"compiled plan ({x['compiler']})")
        assert x["fits"] is True and x["planned_from_shapes"]


@pytest.mark.slow
def test_a_deviceless_plan_is_deterministic_across_two_compiles():
    """Two real compiles of one train step (a deviceless executable cannot come back from the
    suite's compilation cache, so the second is compiled again, not loaded)."""
    from flax import nnx

    from jaxmem.memory.remat import layers_fn
    from jaxmem.memory.residuals import compiled_plan
    from jaxmem.model import make_model
    from jaxmem.step.train_step import lm_loss_fn, make_optimizer, make_train_step

    cfg, precision = PRESETS["tiny"], PRECISIONS["bf16"]
    graphdef, params = nnx.split(nnx.eval_shape(lambda: make_model(cfg, precision)), nnx.Param)
    tx = make_optimizer(OptimizerConfig())
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(POLICIES["selective"], cfg.n_layers))
    step = make_train_step(loss, tx, precision=precision)
    tokens = jax.ShapeDtypeStruct((4, 32), "int32")
    args = (params, jax.eval_shape(tx.init, params), None, {"inputs": tokens, "targets": tokens})
    first = gpu_plan.compile_for(step, args, get_target("h100"))
    second = gpu_plan.compile_for(step, args, get_target("h100"))
    assert first is not second
    assert compiled_plan(first) == compiled_plan(second)
    assert first.as_text() == second.as_text()


@pytest.mark.slow
def test_memory_command_plans_for_a_gpu_target(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    out = tmp_path / "m.json"
    args = ["memory", "--target", "a100-40gb", "--policies", "offload", "--frameworks", "jax"]
    assert cli.main([*args, "--batch-size", "2", "--seq-len", "16", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    (r,) = records
    assert (r["framework"], r["policy"], r["target"]) == ("jax", "offload", "a100-40gb")
    assert r["device_memory_bytes"] == get_target("a100-40gb").device_memory_bytes
    assert r["plan_host_bytes"] > 0 and r["fits"] is True
    text = " ".join(capsys.readouterr().out.split())
    assert "plans compiled for NVIDIA A100-SXM4-40GB" in text
    assert "fits = planned peak <= a100-40gb's 39.42 GiB" in text


def test_a_captured_target_file_is_accepted_and_a_broken_one_refused(tmp_path):
    text = get_target("h100").config_text.replace("H100 80GB HBM3", "H100 (captured)")
    (tmp_path / "mine.txtpb").write_text(text)
    mine = get_target(str(tmp_path / "mine.txtpb"))
    assert mine.name == "mine" and mine.description == "NVIDIA H100 (captured)"
    (tmp_path / "bad.txtpb").write_text('platform_name: "CUDA"\n')
    with pytest.raises(ConfigError, match=r"bad\.txtpb has no device_memory_size"):
        get_target(str(tmp_path / "bad.txtpb"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--target", "v100"],
            "unknown target 'v100'; valid: cpu, h100, a100-40gb, a100-80gb, v100-32gb, a10-24gb, "
            "l40s-48gb, rtx4090-24gb",
        ),
        (["--target", "nope.txtpb"], "--target nope.txtpb: no such file"),
    ],
)
def test_bad_targets_are_one_line_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["memory", *args])
    assert exc.value.code == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["plan", "--target", "l40s-48gb", "--budget", "50GiB"],
            "--budget 50GiB is more than the NVIDIA L40S has (44.99 GiB)",
        ),
        (
            ["memory", "--target", "rtx4090-24gb", "--frameworks", "jax", "--policies", "nope"],
            "unknown memory policy 'nope'",
        ),
    ],
)
def test_plan_and_memory_take_the_fine_tuning_cards_by_name(args, message, capsys):
    """The names resolve to their targets before anything compiles (the refusals that follow
    are the budget's and the policy's, not the target's)."""
    with pytest.raises(SystemExit) as exc:
        cli.main([*args[:1], "--preset", "tiny", *args[1:]])
    assert exc.value.code == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert message in err and "unknown target" not in err


@pytest.mark.parametrize(
    ("command", "edit", "message"),
    [
        (
            ["plan", "--budget", "10GiB"],
            "newer",
            'line 29: GpuTargetConfigProto has no field named "collective_memory_granularity"',
        ),
        (["train", "--steps", "1"], "newer", "collective_memory_granularity"),
        (["memory"], "negative", "device_memory_size -1 is not a size"),
        (["peak"], "negative", "device_memory_size -1 is not a size"),
    ],
)
def test_a_target_file_this_jaxlib_cannot_read_is_one_line_naming_the_field(
    command, edit, message, tmp_path
):
    """Every command that takes --target: a field a newer XLA writes is named with the installed
    jaxlib's version, a device_memory_size that is not a size is named with its value; one line,
    exit 2, before any compile, nothing written."""
    from importlib.metadata import version

    from tests.test_cli_contract import run_cli

    text = get_target("h100").config_text
    if edit == "newer":
        text += "collective_memory_granularity: 1\n"
    else:
        text = text.replace("device_memory_size: 84942979072", "device_memory_size: -1")
    (tmp_path / "t.txtpb").write_text(text)
    out = tmp_path / "run"
    extra = ["--out", str(out)] if command[0] == "train" else []
    proc = run_cli(*command, "--preset", "tiny", "--target", str(tmp_path / "t.txtpb"), *extra)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"jaxmem {command[0]}: error: ") and message in line
    if edit == "newer":
        assert f"the installed jaxlib {version('jaxlib')} cannot read it" in line
    assert not out.exists()


def test_without_the_extra_the_error_names_it(monkeypatch):
    monkeypatch.setattr(gpu_plan, "cuda_plugin_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'jaxmem\[gpu-plan\]'"):
        gpu_plan.require_gpu_plan(get_target("h100"))


@pytest.mark.slow
def test_the_plugin_is_quiet_on_a_machine_without_a_driver(tmp_path):
    """A fresh process with the plugin installed: the CLI starts JAX on the CPU with no traceback
    and none of the plugin's native start-up lines, and other stderr output still gets through."""
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip(
            "checks a machine without an NVIDIA driver; here the driver exists and the CUDA "
            "plugin is JAX's real backend, so there is no fallback noise to contain"
        )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", "memory", "--target", "h100", "--policies", "full"]
        + ["--frameworks", "jax", "--batch-size", "1", "--seq-len", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    code = (
        "import os\nfrom jaxmem.backend import quiet_native_stderr\n"
        "with quiet_native_stderr():\n"
        "    os.write(2, b'W0 cudart_stub.cc:31] Could not find cuda drivers on your machine\\n')\n"
        "    os.write(2, b'a real error\\n')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.stderr == "a real error\n"


QUIET_BLOCK = (
    "import os, sys\nimport jaxmem.backend as backend\n"
    "backend.cuda_plugin_installed = lambda: True  # the filter runs with or without the plugin\n"
    "from jaxmem.backend import quiet_native_stderr\n"
    "try:\n"
    "    with quiet_native_stderr(drop_on_error=sys.argv[1] == 'drop'):\n"
    "        os.write(2, b'I0 cudart_stub.cc:31] Could not find cuda drivers on your machine\\n')\n"
    "        os.write(2, b'F0 parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS\\n')\n"
    "        if sys.argv[1] == 'exit':\n"
    "            os._exit(1)  # as native code ends a process: no Python unwinding\n"
    "        raise RuntimeError('said in the caller\\'s words')\n"
    "except RuntimeError:\n"
    "    pass\n"
)


@pytest.mark.parametrize(
    "how, err",
    [
        ("exit", "F0 parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS\n"),
        ("keep", "F0 parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS\n"),
        ("drop", ""),
    ],
)
def test_quiet_native_stderr_keeps_the_lines_of_a_block_native_code_ended(how, err):
    """A block that ends the process without unwinding (XLA on an unknown XLA_FLAGS entry) still
    shows what it printed, less the noise; a block that raises under ``drop_on_error`` shows
    nothing (its caller words the error)."""
    proc = subprocess.run(
        [sys.executable, "-c", QUIET_BLOCK, how], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == (1 if how == "exit" else 0)
    assert proc.stderr == err


def test_an_xla_flag_xla_does_not_know_is_named_on_stderr():
    # XLA ends the process natively while the CLI starts JAX with its noise filtered: the line
    # naming the flag reaches the terminal (it printed nothing, exit 1, before)
    env = {**os.environ, "XLA_FLAGS": "--xla_no_such_flag_in_jaxmem_tests=true"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", "memory", "--preset", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0
    assert "--xla_no_such_flag_in_jaxmem_tests" in proc.stderr, proc.stderr


def test_quiet_native_stderr_passes_everything_without_the_plugin(monkeypatch, capfd):
    import jaxmem.backend as backend

    monkeypatch.setattr(backend, "cuda_plugin_installed", lambda: False)
    with quiet_native_stderr():
        os.write(2, b"Could not find cuda drivers on your machine\n")
    assert capfd.readouterr().err == "Could not find cuda drivers on your machine\n"


def test_a_quiet_start_where_jax_moved_its_internals_does_nothing_and_raises_nothing(
    monkeypatch,
):
    """``jax._src.xla_bridge`` gone (a JAX that moved it): ``jaxmem.compat`` says "unknown" for
    both names it reads there, and ``quiet_library_start`` leaves JAX as it is."""
    import jaxmem.backend as backend
    from jaxmem import compat

    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", None)  # importing it: ImportError
    assert compat.jax_backends_started() is None and compat.jax_plugin_loader() is None
    monkeypatch.setattr(backend, "cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(backend, "nvidia_driver_present", lambda: False)
    monkeypatch.setattr(backend, "contain_cuda_plugin", lambda: pytest.fail("JAX was changed"))
    platforms = jax.config.jax_platforms
    backend.quiet_library_start()
    assert jax.config.jax_platforms == platforms


def test_capture_target_needs_a_gpu_and_says_so(tmp_path, capsys):
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip(
            "checks the error on a machine without a GPU; here a GPU exists and the GPU-only "
            "test below captures its target instead"
        )
    with pytest.raises(SystemExit) as exc:
        cli.main(["capture-target", "--out", str(tmp_path / "mine.txtpb")])
    assert exc.value.code == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "capture-target needs a CUDA GPU visible to JAX" in err
    assert not (tmp_path / "mine.txtpb").exists()


@pytest.mark.gpu
@pytest.mark.skipif(
    not os.path.exists("/proc/driver/nvidia/version"),
    reason="GPU-only: captures a real GPU's target config (no NVIDIA driver on this machine)",
)
def test_capture_target_on_a_gpu_writes_a_target_the_planner_takes(tmp_path):
    assert cli.main(["capture-target", "--out", str(tmp_path / "here.txtpb")]) == 0
    target = get_target(str(tmp_path / "here.txtpb"))
    assert target.device_memory_bytes > 0 and gpu_plan.target_sharding(target)


@pytest.mark.slow
def test_host_resident_optimizer_state_is_counted_analytically_and_labelled(capsys):
    """A deviceless compile drops memory kinds on arguments, so offloaded optimizer state is
    planned on the device (the upper bound) and its bytes are counted from shapes: host bytes =
    the state's, the lower bound = the plan without it; parameters in host memory are refused."""
    h100 = get_target("h100")
    spec = StepSpec(
        model=PRESETS["tiny"], policy=POLICIES["full"], batch=2, seq_len=16, target=h100
    )
    offloaded = jax_record(spec.replace(optimizer=OptimizerConfig(state_memory="pinned_host")))
    so = offloaded["state_offload"]
    state = offloaded["opt_state_bytes"]
    assert state == 2 * 4 * PRESETS["tiny"].n_params + 4  # AdamW's mu and nu in fp32, a count
    assert so["host_bytes"] == state
    assert so["device_peak_upper_bytes"] == offloaded["planned_peak_bytes"]
    assert so["device_peak_lower_bytes"] == offloaded["planned_peak_bytes"] - state
    assert offloaded["compiled_plan"]["argument_bytes"] >= state  # planned on the device
    assert "analytic" in so["source"]
    with pytest.raises(ConfigError, match="cannot plan optimizer.params_memory='pinned_host'"):
        jax_record(spec.replace(optimizer=OptimizerConfig(params_memory="pinned_host")))
    cmd = ["memory", "--target", "h100", "--policies", "full", "--frameworks", "jax"]
    assert cli.main([*cmd, "--state-memory", "pinned_host", "--seq-len", "16"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "optimizer state in pinned_host, counted analytically" in text


@pytest.mark.slow
def test_train_prints_the_same_step_planned_for_a_gpu_target(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    args = ["train", "--preset", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "32"]
    assert cli.main([*args, "--sample-tokens", "0", "--policy", "offload", "--target", "h100"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for line in (
        "h100 plan: temporaries",
        "h100 plan: host memory (offloaded)",
        "h100 plan: planned peak",
    ):
        assert line in text, line
    assert "XLA:CUDA deviceless compile for NVIDIA H100" in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--framework", "torch"], "torch_ref has no compiled plan"),
        (["--accum", "2", "--accum-mode", "multisteps"], "plans the scanned train step"),
        (["--set", "optimizer.state_memory=pinned_host"], "drops host memory kinds"),
        (["--target", "v100"], "unknown target 'v100'"),
    ],
)
def test_train_target_refusals_are_one_line_exit_2(extra, message, capsys, tmp_path):
    args = ["train", "--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exc:
        cli.main([*args, "--target", "h100", *extra])
    assert exc.value.code == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert message in err
    assert not (tmp_path / "run").exists()


needs_gpu = pytest.mark.skipif(
    not any(d.platform == "gpu" for d in jax.devices()),
    reason="GPU-only: compares the deviceless plan with the plan compiled on the GPU and the "
    "runtime peak (JAX sees no GPU here)",
)


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_the_deviceless_plan_matches_the_device_and_training_reports_its_peak(
    tmp_path, capsys
):
    """Where CUDA exists: the plan compiled without the device for this GPU's own target config
    equals (within the table's bound) the plan XLA compiles on it, the measured peak of one
    step stays within the plan, and ``jaxmem train`` prints the device's peak beside the plan."""
    from jaxmem.compare.tolerances import tolerance

    assert cli.main(["capture-target", "--out", str(tmp_path / "here.txtpb")]) == 0
    here = get_target(str(tmp_path / "here.txtpb"))
    plan_tol = tolerance("bytes", "deviceless_vs_device_plan")
    peak_tol = tolerance("bytes", "runtime_peak_vs_plan")
    for policy in ("none", "full", "offload"):
        spec = StepSpec(
            model=PRESETS["small"],
            policy=POLICIES[policy],
            precision=PRECISIONS["bf16"],
            batch=8,
            seq_len=256,
        )
        deviceless = jax_record(spec.replace(target=here))
        spec_json = json.dumps(spec.to_dict())
        # compiled on the GPU and one step run, in a fresh process: the device's peak is a
        # high-water mark that never goes down within one
        code = (
            "import json; from jaxmem.planner.records import jax_record; "
            "from jaxmem.step.spec import StepSpec; "
            f"r = jax_record(StepSpec.from_dict(json.loads({spec_json!r}))); "
            "print(json.dumps({k: r[k] for k in ('compiler', 'compiled_temp_bytes', "
            "'peak_bytes', 'peak_source')}))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
        on_device = json.loads(proc.stdout.strip().splitlines()[-1])
        assert on_device["compiler"].startswith("XLA:GPU"), on_device["compiler"]
        a, b = deviceless["compiled_temp_bytes"], on_device["compiled_temp_bytes"]
        assert abs(a - b) <= plan_tol.atol + plan_tol.rtol * b, (policy, a, b)
        planned = deviceless["planned_peak_bytes"]
        assert on_device["peak_bytes"] <= planned + peak_tol.atol + peak_tol.rtol * planned
        assert on_device["peak_source"].startswith("runtime peak")
    capsys.readouterr()
    assert cli.main(["train", "--preset", "tiny", "--steps", "3", "--batch-size", "4"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "device peak" in text and "peak_bytes_in_use" in text


CUDNN_MISSING = (
    "cuDNN's fused attention compiles in a deviceless plan only with cuDNN's library "
    "(pip install -c constraints.txt -e '.[cudnn-plan]': nvidia-cudnn-cu12 with cuBLAS and "
    "NVRTC, about 2.2 GB), not installed here"
)


@pytest.mark.skipif(not cudnn_installed(), reason=CUDNN_MISSING)
def test_the_h100_plan_of_fused_attention_runs_cudnns_kernel():
    """On an NVIDIA target, fused attention is cuDNN's fused kernel (grouped heads included):
    the optimized HLO calls it, the record says so, and the FLOPs are the blockwise kernel's
    (the same FlashAttention-2 matmuls)."""
    import jax.numpy as jnp

    target = get_target("h100")
    q = jax.ShapeDtypeStruct((2, 64, 4, 16), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.bfloat16)

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    text = gpu_plan.compile_for(jax.jit(attend), (q, kv, kv), target).as_text()
    assert "__cudnn$fmha" in text
    cfg = PRESETS["tiny-llama"].replace(attention="fused")
    spec = StepSpec(
        model=cfg, policy=POLICIES["selective"], precision=PRECISIONS["bf16"], batch=2, seq_len=64
    )
    rec = jax_record(spec.replace(target=target))
    assert rec["attention_kernel"].startswith("cuDNN") and rec["fits"]
    blockwise = jax_record(spec)
    assert rec["flops"] == blockwise["flops"]

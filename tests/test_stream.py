"""A streamed step (``optimizer.stream``, ``jaxmem.step.stream``): the block stack's parameters
and optimizer state live in host memory and stream through the step block by block. On CPU it
computes the unstreamed step's numbers; killed and resumed it continues them; its H100 plan
keeps the stack off the device; what it does not compose with yet is one line, exit 2."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem import cli
from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS, AccumConfig, OptimizerConfig
from jaxmem.memory.remat import layers_fn
from jaxmem.model import make_model
from jaxmem.parallel import ParallelConfig
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from jaxmem.step import stream
from jaxmem.step.scaling import DynamicLossScale, init_loss_scale
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import (
    lm_loss_fn,
    make_optimizer,
    make_train_step,
    stack_accumulating_loss,
    tree_bytes,
)

GPU_PLAN = importlib.util.find_spec("jax_cuda12_plugin") is not None
# a deviceless GPU plan needs JAX's CUDA plugin and ptxas (an optional extra; make test has it)
NO_GPU_PLAN = "deviceless GPU plans need pip install 'jaxmem[gpu-plan]', not installed here"
CFG = PRESETS["tiny"]


def _batches(n: int):
    rng = np.random.default_rng(0)
    for _ in range(n):
        tokens = rng.integers(0, CFG.vocab_size, (4, 33))
        yield {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


@pytest.mark.parametrize(
    "precision, policy, optimizer, accum, update",
    [
        pytest.param("bf16", "offload", "adamw", 1, "device", marks=pytest.mark.slow),
        # microbatches: the stack's running sum in host memory
        pytest.param("bf16", "selective", "adamw", 2, "device", marks=pytest.mark.slow),
        ("fp32", "full", "sgd", 1, "device"),
        pytest.param("bf16", "selective", "adamw", 2, "host", marks=pytest.mark.slow),
        # fp16: GradScaler's dynamic loss scale, the skip decided before the stack's update
        ("fp16", "full", "adamw", 2, "device"),
        pytest.param("fp16", "selective", "adamw", 1, "host", marks=pytest.mark.slow),
    ],
)
def test_a_streamed_step_computes_the_unstreamed_steps_numbers(
    precision, policy, optimizer, accum, update
):
    prec, opt = PRECISIONS[precision], OptimizerConfig(name=optimizer)
    acc = AccumConfig(steps=accum)
    graphdef, params = nnx.split(make_model(CFG, prec, seed=0), nnx.Param)
    tx = make_optimizer(opt)
    lf = layers_fn(POLICIES[policy], CFG.n_layers)

    def make_loss(layers):
        return lm_loss_fn(graphdef, layers_fn=layers)

    s_params, s_state = stream.place(jax.tree.map(jnp.copy, params), stream.init_state(tx, params))
    plain = make_train_step(
        make_loss(lf),
        tx,
        precision=prec,
        accum=acc,
        loss_into=stack_accumulating_loss(make_loss, POLICIES[policy], CFG.n_layers, acc),
    )
    streamed = stream.make_streamed_step(
        make_loss, lf, tx, accum_steps=accum, accum_dtype=jnp.dtype(prec.accum_dtype), update=update
    )
    p, o = params, tx.init(params)
    scale = s_scale = init_loss_scale(prec)
    for batch in _batches(2):
        p, o, scale, m = plain(p, o, scale, batch)
        s_params, s_state, s_scale, sm = streamed(s_params, s_state, s_scale, batch)
        assert float(sm["loss"]) == float(m["loss"])  # bit for bit
        assert bool(sm["grads_finite"]) == bool(m["grads_finite"])
        if scale is not None:
            assert float(s_scale.scale) == float(scale.scale)
        norm_tol = tolerance("float32", "streamed_grad_norm")
        np.testing.assert_allclose(
            float(sm["grad_norm"]), float(m["grad_norm"]), **norm_tol.kwargs()
        )
    # the stack and its state stay in host memory between steps; the rest on the device
    rest, stack = stream.split(s_params)
    kinds = {a.sharding.memory_kind for a in jax.tree.leaves((stack, s_state[1]))}
    assert kinds == {"pinned_host"}
    assert {a.sharding.memory_kind for a in jax.tree.leaves((rest, s_state[0]))} == {"device"}
    tol = tolerance("float32", "streamed_sgd_params")
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(s_params), strict=True):
        if optimizer == "adamw":
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), **tol.kwargs())


def _train_cmd(out, *extra):
    return [
        sys.executable, "-m", "jaxmem.cli", "train", "--preset", "tiny", "--batch-size", "4",
        "--seq-len", "32", "--sample-tokens", "0", "--policy", "selective", "--precision",
        "bf16", "--steps", "30", "--checkpoint-every", "5", "--eval-every", "15", "--out",
        str(out), *extra,
    ]  # fmt: skip


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_streamed_run_killed_with_sigkill_resumes_to_the_unstreamed_losses(tmp_path):
    reference = tmp_path / "reference"
    subprocess.run(_train_cmd(reference), check=True, capture_output=True, timeout=300)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(killed, "--stream"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (killed / "checkpoints" / "10").is_dir():
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", "train", "--resume", "--out", str(killed)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    ref, res = _metrics(reference), _metrics(killed)
    assert [r["step"] for r in res] == list(range(1, 31))
    assert [r["loss"] for r in res] == [r["loss"] for r in ref]  # bit-identical
    assert [r.get("val_loss") for r in res] == [r.get("val_loss") for r in ref]
    assert "stream: true" in (killed / "config.yaml").read_text()


@pytest.mark.parametrize("update", ["device", "host"])
def test_an_fp16_step_that_overflows_keeps_every_parameter_and_halves_the_scale(update):
    """A loss scale of 2^100 overflows fp16's gradients: the streamed step, like the
    unstreamed one, applies nothing (the stack's parameters and state in host memory and the
    rest on the device come back unchanged) and halves the scale."""
    prec, tx = PRECISIONS["fp16"], make_optimizer(OptimizerConfig())
    graphdef, params = nnx.split(make_model(CFG, prec, seed=0), nnx.Param)
    s_params, s_state = stream.place(jax.tree.map(jnp.copy, params), stream.init_state(tx, params))
    before = jax.tree.map(np.asarray, (s_params, s_state))
    streamed = stream.make_streamed_step(
        lambda layers: lm_loss_fn(graphdef, layers_fn=layers),
        layers_fn(POLICIES["full"], CFG.n_layers),
        tx,
        update=update,
        donate=False,
    )
    huge = DynamicLossScale.create(init_scale=2.0**100)
    new_params, new_state, new_scale, m = streamed(s_params, s_state, huge, next(_batches(1)))
    assert not bool(m["grads_finite"])
    assert float(new_scale.scale) == 2.0**99
    after = jax.tree.map(np.asarray, (new_params, new_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    _, stack = stream.split(new_params)
    assert {a.sharding.memory_kind for a in jax.tree.leaves((stack, new_state[1]))} == {
        "pinned_host"
    }


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--optimizer", "adafactor"], "optimizer 'adafactor' cannot stream"),
        (["--accum", "2", "--accum-mode", "multisteps"], "sums microbatches in its own scan"),
        (["--unroll"], "runs the stack as one scan"),
        (["--state-memory", "pinned_host"], "leave state_memory and params_memory at 'device'"),
        (["--stream-update", "cpu"], "stream_update='cpu' is not one of ('device', 'host')"),
    ],
)
def test_what_streaming_does_not_compose_with_yet_is_one_line_exit_2(
    extra, message, tmp_path, capsys
):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--preset", "tiny", "--stream", *extra, "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_commands_that_do_not_measure_a_streamed_step_say_so(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["memory", "--preset", "tiny", "--stream"])
    assert e.value.code == 2
    assert "does not measure a streamed step (--stream) yet" in capsys.readouterr().err
    # peak explains one device's streamed step (plan plans it over a mesh; before any compile)
    with pytest.raises(SystemExit) as e:
        cli.main(["peak", "--preset", "tiny", "--stream", "--mesh", "fsdp=2", "--target", "h100"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "jaxmem peak explains a streamed step on one device" in err[0]
    # where a streamed update runs is asked only of a streamed step
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--preset", "tiny", "--stream-update", "host"])
    assert e.value.code == 2
    assert "it goes with stream (--stream)" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not GPU_PLAN, reason=NO_GPU_PLAN)
def test_the_h100_plan_of_a_streamed_step_keeps_the_stack_in_host_memory():
    from jaxmem.backend import contain_cuda_plugin

    contain_cuda_plugin()
    from jaxmem.memory.targets import get_target
    from jaxmem.planner.plans import plan_step

    cfg, prec, policy = PRESETS["tiny"], PRECISIONS["bf16"], POLICIES["full"]
    h100 = get_target("h100")
    spec = StepSpec(model=cfg, policy=policy, precision=prec, batch=2, seq_len=32, target=h100)
    plain = plan_step(spec)
    streamed = plan_step(spec.replace(optimizer=OptimizerConfig(stream=True)))
    graphdef, params = nnx.split(nnx.eval_shape(lambda: make_model(cfg, prec)), nnx.Param)
    _, stack = stream.split(params)
    stack_bytes = tree_bytes(stack)
    info = streamed["stream"]
    # AdamW: the stack's fp32 parameters, both moments, and the step count (int32)
    assert info["host_resident_bytes"] == 3 * stack_bytes + 4
    # the device no longer holds the stack's parameters, gradients and state, only a block's
    # worth of each and the block-by-block update's working set: at least 2x the stack less
    assert plain["planned_peak_bytes"] - streamed["planned_peak_bytes"] >= 2 * stack_bytes
    assert streamed["compiled_plan"]["host_temp_bytes"] >= info["host_resident_bytes"]
    moved = info["transfers"]["bytes"]
    assert moved["parameters to the device"] == 2 * stack_bytes  # full replays each block
    assert info["transfers"]["total_bytes"] == 2 * stack_bytes + stack_bytes + (
        2 * stack_bytes + 2 * stack_bytes + 4
    ) + (stack_bytes + 2 * stack_bytes + 4)
    assert info["transfers"]["source"].startswith("estimate: bytes from shapes over 64 GB/s")
    # the update in host memory: only the parameters and gradients cross the link, and the
    # device no longer holds the block-by-block update's working set
    host = plan_step(spec.replace(optimizer=OptimizerConfig(stream=True, stream_update="host")))
    assert host["stream"]["update"] == "host"
    assert host["stream"]["transfers"]["total_bytes"] == 2 * stack_bytes + stack_bytes
    assert host["planned_peak_bytes"] < streamed["planned_peak_bytes"]
    assert host["stream"]["host_resident_bytes"] == info["host_resident_bytes"]
    # over fsdp=2 (two H100s): each device keeps half of the stack's parameters and state in
    # its host memory (the step count whole), fetches and returns half, and plans less device
    # memory than one device does
    fsdp = plan_step(
        spec.replace(
            optimizer=OptimizerConfig(stream=True),
            parallel=ParallelConfig(strategy="fsdp", devices=2),
        )
    )
    assert "per device of fsdp=2" in fsdp["compiler"]
    half = fsdp["stream"]
    assert half["host_resident_bytes"] == 3 * stack_bytes // 2 + 4
    assert half["transfers"]["bytes"]["parameters to the device"] == stack_bytes
    assert fsdp["planned_peak_bytes"] < streamed["planned_peak_bytes"]
    assert fsdp["compiled_plan"]["host_temp_bytes"] >= half["host_resident_bytes"]


@pytest.mark.slow
@pytest.mark.skipif(not GPU_PLAN, reason=NO_GPU_PLAN)
def test_the_planner_searches_streaming_where_host_memory_is_allowed():
    """A budget below every plan that keeps the stack on the device (state there or in host
    memory): with host memory allowed the planner chooses a streamed step, with its update in
    host memory (estimated cheaper on an H100's host than moving the update's arrays over the
    link, and planned smaller), and its command trains it (--stream --stream-update host); the
    device update's command is plain --stream."""
    from jaxmem.backend import contain_cuda_plugin

    contain_cuda_plugin()
    from jaxmem.job import resolve_job
    from jaxmem.memory.targets import get_target
    from jaxmem.planner.plans import plan_step
    from jaxmem.planner.search import search
    from jaxmem.planner.space import PlanSpace, Problem, candidate_job

    cfg, prec, h100 = PRESETS["tiny"], PRECISIONS["bf16"], get_target("h100")
    streamed = plan_step(
        StepSpec(
            model=cfg,
            policy=POLICIES["full"],
            precision=prec,
            optimizer=OptimizerConfig(stream=True),
            batch=2,
            seq_len=32,
            target=h100,
        )
    )
    budget = int(streamed["planned_peak_bytes"] * 1.05)
    space = PlanSpace(
        policies=("full",),
        mix=(),
        accum=(1,),
        state_memory=("device", "pinned_host", "stream", "stream-host"),
        precisions=("bf16",),
        tags=False,  # the stacks a plan holds on the device: full alone, scanned, whole loss
        unroll=False,
        loss_chunks=0,
    )
    result = search(Problem(cfg, 2, 32, h100, budget, OptimizerConfig()), space)
    assert result.chosen is not None, [o.as_dict() for o in result.outcomes]
    chosen = result.chosen.candidate
    assert chosen.describe().endswith("streamed, update on host"), chosen.describe()
    assert result.chosen.compiled <= budget
    unstreamed = [o for o in result.outcomes if not o.candidate.stream]
    assert unstreamed and all(o.status != "chosen" for o in unstreamed)
    job = candidate_job(resolve_job(defaults={"preset": "tiny"}), chosen, 1)
    assert job.optimizer.stream and job.optimizer.stream_update == "host"
    assert job.optimizer.state_memory == "device"
    (device,) = [o.candidate for o in result.outcomes if o.candidate.stream == "device"]
    assert device.describe().endswith("streamed") and device.seconds > chosen.seconds
    job = candidate_job(resolve_job(defaults={"preset": "tiny"}), device, 1)
    assert job.optimizer.stream and job.optimizer.stream_update is None  # the default


def test_the_planner_streams_over_a_data_parallel_mesh_counting_each_devices_shards():
    """Over 2 devices the lattice holds a streamed step per data-parallel strategy, each moving
    one device's shards over its host link: fsdp half of dp's bytes (parameters and state
    sharded), zero1 in between (state sharded); its command trains it over the mesh."""
    from jaxmem.job import resolve_job
    from jaxmem.memory.targets import get_target
    from jaxmem.planner.predict import FlopModel
    from jaxmem.planner.space import PlanSpace, Problem, candidate_job, enumerate_candidates

    cfg = PRESETS["tiny"]
    space = PlanSpace(
        policies=("full",),
        mix=(),
        accum=(1,),
        state_memory=("stream",),
        strategies=("dp", "zero1", "fsdp"),
        precisions=("bf16",),
        tags=False,
        unroll=False,
    )
    problem = Problem(cfg, 2, 32, get_target("h100"), 1 << 40, OptimizerConfig(), 2)
    found = enumerate_candidates(problem, space, FlopModel(cfg, 32))
    streamed = {c.strategy: c for c in found if c.stream}
    assert set(streamed) == {"dp", "zero1", "fsdp"}
    dp, zero1, fsdp = (streamed[s].host_bytes for s in ("dp", "zero1", "fsdp"))
    assert fsdp * 2 == dp and fsdp < zero1 < dp
    job = candidate_job(resolve_job(defaults={"preset": "tiny"}), streamed["fsdp"], 2)
    assert job.optimizer.stream and job.parallel.mesh_text() == "fsdp=2"


def test_the_planner_weighs_a_host_update_against_the_device_update_by_their_estimates(
    monkeypatch,
):
    """A streamed step's update on the device moves parameters, gradient and state over the host
    link and updates in HBM; in host memory it reads and writes the same bytes there. The planner
    ranks the two by those estimates (same FLOPs): the host update first where host memory is
    faster than the link (every reference host), the device update first where it is not."""
    from jaxmem.memory import targets
    from jaxmem.memory.targets import get_target
    from jaxmem.planner.predict import FlopModel
    from jaxmem.planner.space import PlanSpace, Problem, enumerate_candidates

    cfg, v100 = PRESETS["tiny"], get_target("v100-32gb")
    space = PlanSpace(
        policies=("full",),
        mix=(),
        accum=(1,),
        state_memory=("stream", "stream-host"),
        precisions=("bf16",),
        tags=False,
        unroll=False,
        loss_chunks=0,
    )
    problem = Problem(cfg, 2, 32, v100, 2**30, OptimizerConfig())

    def ranked() -> list:
        return enumerate_candidates(problem, space, FlopModel(cfg, 32))

    device, host = sorted(ranked(), key=lambda c: c.state_memory)
    assert (device.stream, host.stream) == ("device", "host") and device.flops == host.flops
    rates = targets.rates_for(v100)
    # the device update's link bytes are the host update's host-memory bytes
    assert device.host_bytes - host.host_bytes == host.host_update_bytes > 0
    gap = host.host_update_bytes / rates.host_link - host.host_update_bytes / rates.host_memory
    # and the device update reads and writes those bytes in HBM too (both exposed: the update
    # runs after the backward)
    hbm = device.estimate.memory_bound - host.estimate.memory_bound
    assert hbm > 0
    assert device.seconds - host.seconds == pytest.approx(gap + hbm, rel=1e-9)
    assert [c.stream for c in ranked()] == ["host", "device"]
    slow_host = dataclasses.replace(rates, host_memory=rates.host_link / 2)
    monkeypatch.setitem(targets.RATES, "v100-32gb", slow_host)
    assert [c.stream for c in ranked()] == ["device", "host"]

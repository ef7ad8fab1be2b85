"""Planning adapter jobs: `memory`, `peak` and `plan` take the --lora-* and --quantize-base
flags; the planner's predictors know that a frozen base has no gradient and no optimizer state
and that a packed base is stored packed; the lattice lists only what an adapter step composes
with; the chosen plan's command trains the job it planned; a plan from shapes packs nothing,
and a real base packs on the device to the bytes the host packing gives."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem import cli
from jaxmem.adapters import AdapterConfig
from jaxmem.backend import cuda_plugin_installed
from jaxmem.cli.app import build_parser
from jaxmem.config import PRESETS, OptimizerConfig
from jaxmem.job import JobConfig, RunConfig
from jaxmem.memory import analytic
from jaxmem.memory.targets import get_target
from jaxmem.model import make_model, qbase
from jaxmem.planner import cost, predict
from jaxmem.planner.space import (
    PlanSpace,
    Problem,
    candidate_job,
    candidate_spec,
    enumerate_candidates,
)
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from jaxmem.quant import quantize
from jaxmem.step.frozen import refusal
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import tree_bytes

TINY = PRESETS["tiny-llama"]
ADAPTERS = AdapterConfig(rank=8, targets=("q", "v", "down"))
INT8 = AdapterConfig(rank=8, targets=("q", "v", "down"), base="int8")
needs_cuda_plugin = pytest.mark.skipif(
    not cuda_plugin_installed(),
    reason="a GPU target is compiled by JAX's CUDA plugin (the gpu-plan extra), not installed",
)


# ------------------------------------------------------------------ memory and peak, GPU targets
@pytest.mark.slow
@needs_cuda_plugin
@pytest.mark.parametrize(
    "flags",
    [
        ("memory", "--lora-rank", "8", "--quantize-base", "int8", "--frameworks", "jax"),
        ("peak", "--lora-rank", "16", "--policy", "full"),
    ],
    ids=["memory-int8", "peak-lora"],
)
def test_memory_and_peak_plan_an_adapter_job_for_a_gpu_target_from_shapes(tmp_path, flags):
    """The deviceless h100 compile of an adapter step (it once failed on the frozen parameters
    as shapes), with a packed base built from shapes: the step's parameters are the analytic
    frozen base as stored plus the adapters, its gradients the trained parameters'."""
    out = tmp_path / "report.json"
    common = ["--preset", "tiny-llama", "--target", "h100", "--batch-size", "1", "--seq-len", "64"]
    policy = [] if flags[0] == "peak" else ["--policies", "full"]
    assert cli.main([*flags, *common, *policy, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    if flags[0] == "peak":
        assert report["adapters"]["rank"] == int(flags[2]) and report["target"] == "h100"
        assert report["planned_peak_bytes"] > 0
        return
    for record in report:
        assert record["compiler"].startswith("XLA:CUDA deviceless compile")
        state = record["adapter_state"]
        assert record["params_bytes"] == state["params_bytes"]  # packed base: stored packed
        assert record["grads_bytes"] == record["trainable_params_bytes"] == state["grads_bytes"]
        assert record["trainable_params_bytes"] < record["params_bytes"]
        # adamw's two moments of the trained parameters, and optax's step counters
        assert 0 <= record["opt_state_bytes"] - state["opt_state_bytes"] <= 64


# ------------------------------------------------------------------ the packed base
@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_base_packed_on_the_device_holds_the_bytes_the_host_packing_gives(kind, dtype):
    """``qbase.pack_layer`` (jit) against ``jaxmem.quant.quantize`` (numpy; bitsandbytes' bytes:
    tests/test_quant.py), bit for bit, with a row of zeros and ties on the code's midpoints."""
    rng = np.random.default_rng(0)
    for shape in ((96, 64), (64, 192), (7, 5)):
        w = rng.standard_normal(shape).astype(np.float32)
        w[0] = 0.0
        w[1, :4] = [0.5, -0.5, 0.25, 1.0]
        weight = jnp.asarray(w).astype(dtype)
        host = quantize(np.asarray(weight.astype(jnp.float32)), kind)
        device = qbase.pack_layer(weight, kind)
        for field in qbase.FIELDS:
            expected = getattr(host, field)
            if expected is None:
                assert field not in device
                continue
            got = np.asarray(device[field])
            assert (got.dtype, got.shape) == (expected.dtype, expected.shape), (shape, field)
            assert got.tobytes() == expected.tobytes(), (shape, field)


def test_a_base_planned_from_shapes_is_packed_from_shapes_alone(monkeypatch):
    """Llama-3-8B's nf4 base from shapes (a plan) packs no weight, and holds the analytic packed
    bytes: the frozen base as ``jaxmem.memory.analytic.adapter_state`` counts it; the planner's
    traces of an nf4 step pack nothing either."""

    def no_packing(*_, **__):
        raise AssertionError("a base planned from shapes packed real weights")

    monkeypatch.setattr(qbase, "pack_layer", no_packing)
    monkeypatch.setattr(qbase, "quantize", no_packing)
    cfg, bf16 = PRESETS["llama-3-8b"], PRECISIONS["bf16"]
    adapters = AdapterConfig(rank=16, base="nf4")
    model = nnx.eval_shape(lambda: make_model(cfg, bf16, platform="gpu", adapters=adapters))
    qbase.quantize_base(model, "nf4")
    packed = qbase.packed_param_bytes(nnx.state(model, nnx.Param))
    state = analytic.adapter_state(cfg, adapters, OptimizerConfig(), bf16)
    assert packed == state.quantized_bytes
    # nor do the planner's FLOP and work models, which build the step they trace from shapes
    _, (trained, _, frozen) = cost.frozen_base_gradient(
        cfg, POLICIES["full"], bf16, 32, 1, adapters, "gpu"
    )
    assert qbase.packed_param_bytes(frozen) == packed
    assert tree_bytes(trained) == state.trainable_bytes


# ------------------------------------------------------------------ the predictors and lattice
def _problem(adapters: AdapterConfig, devices: int = 1, budget: int = 2**30) -> Problem:
    h100 = get_target("h100")
    return Problem(TINY, 4, 32, h100, budget, OptimizerConfig(), devices, adapters=adapters)


def test_the_argument_floor_of_an_adapter_job_counts_the_base_as_stored_and_no_frozen_state():
    bf16 = PRECISIONS["bf16"]
    places = ("device", "pinned_host", "stream", "stream-host")
    space = PlanSpace(precisions=("bf16",), state_memory=places)
    on_device = PlanSpace(precisions=("bf16",), state_memory=("device",))
    full, _ = predict.argument_floor(_problem(AdapterConfig()), on_device)
    floor, how = predict.argument_floor(_problem(INT8), space)
    state = analytic.adapter_state(TINY, INT8, OptimizerConfig(), bf16)
    tokens = 2 * 4 * 32 * max(1, 4 // max(space.accum))  # one microbatch's inputs, targets
    # on the device, whatever the space offers: an adapter job keeps its state there
    assert floor == state.params_bytes + state.opt_state_bytes + tokens
    assert "LoRA r8" in how and "host memory" not in how
    assert predict.state_bytes(_problem(INT8), bf16) == state.opt_state_bytes
    assert predict.parameter_bytes(_problem(INT8), bf16) == state.params_bytes
    assert full == 3 * analytic.param_bytes(TINY, bf16) + tokens  # fp32 weights, two moments
    assert floor < analytic.param_bytes(TINY, bf16) + tokens


@pytest.fixture(scope="module")
def adapter_lattice():
    """Every candidate of a two-device h100 search of an int8-base adapter job that offers
    every placement, strategy and tensor size (one preset, no per-tag policies: traces only, no
    compiles), and the FLOP model it priced them with."""
    space = PlanSpace(
        policies=("full",),
        mix=(),
        accum=(1, 2),
        state_memory=("device", "pinned_host", "stream", "stream-host"),
        tensor=(1, 2),
        tags=False,
        unroll=False,
    )
    problem, flops = _problem(INT8, devices=2), predict.FlopModel(TINY, 32, INT8)
    return problem, enumerate_candidates(problem, space, flops), flops


@pytest.mark.slow
def test_a_frozen_base_has_no_weight_gradient_matmuls_in_the_flop_model(adapter_lattice):
    """The block projections' and the head's weight gradients are not formed under a frozen
    base: 0.82 of full training's matmul FLOPs under full remat here (forward, recompute and
    the input gradients stay; the adapters' own matmuls are a large share at d_model 64)."""
    fp32, full = PRECISIONS["fp32"], POLICIES["full"]
    lora = adapter_lattice[2].per_row(full, fp32)
    assert 0.6 < lora / predict.FlopModel(TINY, 32).per_row(full, fp32) < 0.9


@pytest.mark.slow
def test_the_lattice_of_an_adapter_job_lists_only_what_an_adapter_step_composes_with(
    adapter_lattice,
):
    """No host placement, streaming or (for a packed base) fsdp: the candidates an adapter step
    refuses are not listed; a tensor axis is (the adapters split as their kernels); each listed
    one is what ``train`` runs for its command (the spec the planner compiles is the job's)."""
    problem, candidates, _ = adapter_lattice
    assert {c.strategy for c in candidates if c.tp == 1} == {"dp", "zero1"}
    assert {(c.state_memory, c.tp) for c in candidates} == {("device", 1), ("device", 2)}
    assert {c.accum for c in candidates} == {1, 2}
    run = RunConfig(steps=1, batch_size=4, seq_len=32, eval_batches=1, sample_tokens=0)
    job = JobConfig(preset="tiny-llama", model=TINY, run=run, adapters=INT8)
    for c in candidates:
        chosen = candidate_job(job, c, problem.devices)
        trained = StepSpec.of_job(chosen, problem.target)
        assert refusal(trained) is None, c.describe()
        assert candidate_spec(problem, c) == trained, c.describe()


# ---------------------------------------------------------- jaxmem plan, train --policy auto
@pytest.mark.slow
def test_plan_searches_an_adapter_job_and_its_command_trains_that_job(tmp_path, capsys):
    """A short local search of a LoRA job on an int8 base: the chosen plan's command carries the
    adapter flags, and the job it resolves to is the one planned."""
    from jaxmem.cli.train import resolve

    out = tmp_path / "plan.json"
    argv = ["plan", "--preset", "tiny-llama", "--lora-rank", "8", "--quantize-base", "int8"]
    argv += ["--batch-size", "2", "--seq-len", "32", "--budget", "8MiB", "--no-tags", "--no-mix"]
    assert cli.main([*argv, "--policies", "full", "--accum", "1", "--json", str(out)]) == 0
    assert "LoRA r8 a8 q,v, int8 base" in capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["adapters"]["rank"] == 8 and plan["adapters"]["base"] == "int8"
    words = plan["commands"]["jax"].split()
    assert words[:2] == ["jaxmem", "train"] and "--lora-rank" in words
    job = resolve(build_parser().parse_args(words[1:]))
    assert job.adapters == AdapterConfig(rank=8, base="int8")
    assert (job.memory.name, job.accum.steps) == (plan["chosen"]["policy"], plan["chosen"]["accum"])
    assert refusal(StepSpec.of_job(job)) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plan", "--quantize-base", "nf4", "--budget", "8MiB"],
            "model d_ff=160 is not a multiple",
        ),
        (
            ["plan", "--quantize-base", "int8", "--budget", "64KiB"],
            r"is below the smallest possible step: .*\(LoRA r8 a8 q,v, int8 base\) \+ adamw state",
        ),
        (
            ["train", "--policy", "auto", "--memory-budget", "64KiB", "--steps", "1"],
            r"is below the smallest possible step: .*\(LoRA r8 a8 q,v\) \+ adamw state",
        ),
    ],
    ids=["plan-nf4-shape", "plan-budget", "auto-budget"],
)
def test_an_adapter_plan_that_cannot_be_met_is_refused_in_one_line_before_tracing(
    tmp_path, capsys, argv, message
):
    import re

    common = ["--preset", "tiny-llama", "--lora-rank", "8", "--batch-size", "2", "--seq-len", "32"]
    run_dir = ["--out", str(tmp_path / "run")] if argv[0] == "train" else []
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, *common, *run_dir])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, line), line
    assert not (tmp_path / "run").exists()


def test_when_nothing_fits_an_adapter_plan_suggests_only_what_the_job_can_use():
    from argparse import Namespace

    from jaxmem.cli.plan import _what_else

    # 32 tokens: no MLP tile divides them (not suggested)
    searched = Namespace(loss_chunks_search=True, mlp_tiles_search=False, policies="none,full")
    unchunked = Namespace(loss_chunks_search=False, mlp_tiles_search=False, policies="full")
    packed = _what_else(unchunked, _problem(INT8))
    assert packed == "allow more (--accum, --precisions, --loss-chunks-search)"
    plain = _what_else(searched, _problem(ADAPTERS))
    assert plain == "add devices (--mesh fsdp=N) or allow more (--accum, --precisions)"
    full = _what_else(searched, _problem(AdapterConfig()))
    assert full.endswith("(--accum, --precisions, --state-offload)")


@pytest.mark.parametrize("targets", ["q,v", "q,k,v,o,gate,up,down"])
def test_an_adapter_steps_model_flops_are_what_its_no_remat_gradient_computes(targets):
    """MFU's model FLOPs of a LoRA step (``analytic.model_flops`` with the adapters) equal the
    matmul FLOPs of its gradient without remat, exactly: full training's less the frozen
    weight gradients, plus the adapters' own (a frozen base's MFU never exceeds its HFU)."""
    from jaxmem.memory.flops import grad_matmul_flops

    cfg = PRESETS["tiny-llama"]
    adapters = AdapterConfig(rank=4, targets=tuple(targets.split(",")))
    fp32, none = PRECISIONS["fp32"], POLICIES["none"]
    loss, args = cost.frozen_base_gradient(cfg, none, fp32, 32, 2, adapters, "cpu")
    counted = analytic.model_flops(cfg, 2, 32, adapters)
    assert grad_matmul_flops(loss, *args) == counted
    assert counted < analytic.model_flops(cfg, 2, 32)

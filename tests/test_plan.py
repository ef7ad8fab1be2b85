"""``jaxmem plan``: the chosen configuration's compiled plan fits the budget and every cheaper
candidate on the lattice compiles over it (optimal on the lattice); mixed stacks are what the
lattice's FLOP and memory models say; an impossible budget is one line and exit 2."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.cli import main
from jaxmem.cli.common import parse_bytes
from jaxmem.cli.render import STATUS_SHORT
from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS, AccumConfig, ConfigError, OptimizerConfig
from jaxmem.figures import format_bytes
from jaxmem.memory.remat import layers_fn
from jaxmem.memory.targets import LOCAL
from jaxmem.model import make_model
from jaxmem.parallel import ParallelConfig
from jaxmem.planner.plans import plan_step
from jaxmem.planner.predict import FlopModel
from jaxmem.planner.records import lm_step_batch
from jaxmem.planner.search import _compiler, search
from jaxmem.planner.space import (
    PlanSpace,
    Problem,
    candidate_job,
    candidate_spec,
    enumerate_candidates,
)
from jaxmem.policy import (
    BLOCKS,
    POLICIES,
    EmbeddingReplay,
    MemoryPolicy,
    StackPart,
    mixed_policy,
)
from jaxmem.policy_config import policy_from_dict, policy_to_dict
from jaxmem.precision import FP64, PRECISIONS
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import lm_loss_fn
from tests.test_cli_contract import run_cli

FP32 = PRECISIONS["fp32"]
CFG = PRESETS["small"]  # 4 layers: d 512, 8 heads
BATCH, SEQ = 8, 128
SPEC = StepSpec(model=CFG, policy=POLICIES["none"], batch=BATCH, seq_len=SEQ)  # fp32, AdamW
MIB = 2**20
SPACE = PlanSpace(
    policies=("none", "selective", "full"), mix=("none", "selective", "full"), accum=(1,)
)


def _peak(policy: MemoryPolicy, accum: int = 1) -> int:
    spec = SPEC.replace(policy=policy, accum=AccumConfig(steps=accum))
    return plan_step(spec)["planned_peak_bytes"]


@pytest.fixture(scope="module")
def bounds():
    return _peak(POLICIES["full"]), _peak(POLICIES["none"])


@pytest.mark.slow
def test_plan_is_optimal_on_the_lattice(bounds):
    full, none = bounds
    assert full < none
    budget = (full + none) // 2
    problem = Problem(CFG, BATCH, SEQ, LOCAL, budget, OptimizerConfig())
    result = search(problem, SPACE)
    assert result.chosen is not None
    chosen = result.chosen
    assert chosen.compiled <= budget
    # the chosen plan is the one compiled: recompile it from scratch
    assert _peak(chosen.candidate.policy) == chosen.compiled
    # and it is the step jaxmem train runs for the command the plan prints
    from jaxmem.job import JobConfig, RunConfig

    job = JobConfig(preset="small", model=CFG, run=RunConfig(batch_size=BATCH, seq_len=SEQ))
    trained = StepSpec.of_job(candidate_job(job, chosen.candidate, 1), LOCAL)
    assert candidate_spec(problem, chosen.candidate) == trained
    # every cheaper candidate, compiled whether or not the search compiled it, is over
    compile_peak = _compiler(problem)
    cheaper = result.outcomes[: result.outcomes.index(chosen)]
    assert cheaper, "the budget should rule out at least none"
    for o in cheaper:
        c = o.candidate
        assert c.seconds <= chosen.candidate.seconds
        peak, _ = compile_peak(candidate_spec(problem, c))
        assert peak > budget, f"{c.describe()} fits ({peak} <= {budget}) and costs less"
        if o.compiled is not None:
            assert o.compiled == peak
    # the search compiled far fewer than the lattice holds
    assert result.candidate_compiles < len(result.outcomes)


@pytest.mark.slow
def test_memory_model_is_affine_in_depth_and_predicts_mixed_stacks(bounds):
    """Plans of one policy are affine in the number of blocks (up to buffer alignment), and a
    mixed stack is predicted from its two parts' slopes: checked against its
    compiled plan."""
    peaks = {
        d: plan_step(SPEC.replace(model=dataclasses.replace(CFG, n_layers=d)))["planned_peak_bytes"]
        for d in (2, 3, 4)
    }
    np.testing.assert_allclose(
        peaks[4] - peaks[3],
        peaks[3] - peaks[2],
        **tolerance("bytes", "plan_depth_increment").kwargs(),
    )
    problem = Problem(CFG, BATCH, SEQ, LOCAL, 10**12, OptimizerConfig())
    candidates = enumerate_candidates(problem, SPACE, FlopModel(CFG, SEQ))
    from jaxmem.planner.predict import MemoryModel

    model = MemoryModel(problem, lambda *a: _compiler(problem)(*a)[0])
    for name in ("none:2+full", "selective:1+full"):  # the best and the worst measured
        mixed = next(c for c in candidates if c.policy.name == name)
        predicted = model.predict(mixed)
        compiled = _peak(mixed.policy)
        assert bounds[0] < compiled < bounds[1]
        np.testing.assert_allclose(
            predicted, compiled, **tolerance("bytes", "mixed_stack_prediction").kwargs()
        )


def test_mixed_stack_flops_are_each_parts_blocks():
    """The FLOP model (per-block FLOPs of each preset from depths 1 and 2) equals the count of
    the mixed stack's own gradient jaxpr."""
    from jaxmem.planner.predict import _flops_per_row

    model = FlopModel(CFG, SEQ)
    for policy in (mixed_policy("full", 1, "none"), mixed_policy("none", 3, "selective")):
        assert model.per_row(policy, FP32) == _flops_per_row(CFG, policy, FP32, SEQ)


@pytest.mark.slow
def test_mixed_stack_gradients_equal_the_unmixed_ones_in_float64():
    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=5)
    with jax.enable_x64(True):
        graphdef, params = nnx.split(make_model(cfg, FP64, seed=0), nnx.Param)
        data = lm_step_batch(cfg, 4, 16, abstract=False)

        def grads(policy):
            loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
            return jax.jit(jax.grad(lambda p: loss(p, data)[0]))(params)

        reference = grads(POLICIES["none"])
        for policy in (mixed_policy("full", 2, "none"), mixed_policy("selective", 4, "full")):
            for run in (policy, policy.replace(unroll=True)):
                got = grads(run)
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True):
                    np.testing.assert_allclose(
                        np.asarray(a),
                        np.asarray(b),
                        **tolerance("float64", "remat_vs_none").kwargs(),
                    )
                assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(got))


def test_mixed_policy_round_trips_and_bad_ones_are_refused():
    policy = mixed_policy("selective", 3, "full")
    assert policy_from_dict(policy_to_dict(policy)) == policy
    with pytest.raises(ConfigError, match="rest='nested'"):
        mixed_policy("full", 2, "nested")
    with pytest.raises(ConfigError, match="needs layers first=k"):
        POLICIES["full"].replace(parts=(*POLICIES["full"].parts, StackPart(block=BLOCKS["none"])))
    with pytest.raises(ConfigError, match="rest='sometimes'"):
        mixed_policy("full", 2, "sometimes")


@pytest.mark.parametrize(
    "text,value",
    [("70GiB", 70 * 2**30), ("512MiB", 512 * MIB), ("1.5GB", 1_500_000_000), ("4096B", 4096)],
)
def test_budget_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["70 apples", "-1GiB", "GiB", "0", "1e30.5GiB"])
def test_bad_budget_is_refused(text):
    with pytest.raises(ConfigError, match="is not a size"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["1e30GiB", "1e300GiB", f"{2**63}B"])
def test_a_budget_no_machine_has_is_refused_naming_it(text):
    """Sizes of 8 EiB and more (1e300GiB overflows a float to inf) are refused, not converted."""
    with pytest.raises(ConfigError, match=f"budget '{text}' is more than any machine's memory"):
        parse_bytes(text)


def _tiny_arguments_floor() -> int:
    """tiny's step arguments from shapes: fp32 parameters, AdamW's two moments, 8 x 128 tokens
    (the default batch and the preset's sequence) as int32 inputs and targets."""
    from jaxmem.memory.analytic import opt_state_bytes, param_bytes

    cfg = PRESETS["tiny"]
    tokens = 2 * 4 * (8 // 8) * cfg.max_seq_len  # one microbatch of the largest --accum, 8
    return param_bytes(cfg, FP32) + opt_state_bytes(cfg, OptimizerConfig(), FP32) + tokens


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget", "100"], "--budget 100: give a unit, e.g. 100GiB"),
        (["--budget", "1KiB", "--max-compiles", "3"], "is below the smallest possible step"),
        (["--budget", "1e6GiB"], "--budget 1e6GiB is more than this machine"),
        (["--budget", "1e300GiB"], "--budget 1e300GiB is more than any machine's memory"),
        (
            ["--budget", "100GiB", "--target", "h100"],
            "--budget 100GiB is more than the NVIDIA H100 80GB HBM3 has (79.11 GiB)",
        ),
    ],
)
def test_a_budget_without_a_unit_below_the_arguments_or_above_the_device_is_one_line(
    extra, message
):
    """Refused at once, before any trace or compile (nothing on stdout: no search began): a
    number with no unit, a budget under the step's arguments alone (named, with how it was
    obtained), a budget over the device's memory (no 34-digit figure)."""
    proc = run_cli("plan", "--preset", "tiny", *extra)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("jaxmem plan: error: ") and message in line
    assert proc.stdout == ""
    assert not re.search(r"\d{20}", line)
    if "1KiB" in extra:
        floor = format_bytes(_tiny_arguments_floor())
        assert f"its arguments alone take {floor} per device (parameters" in line
        assert "adamw state" in line and "from shapes, fp32" in line


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """``jaxmem plan`` of the 2-layer tiny preset at 100 columns, a budget between its
    cheapest stack's plan and a leaner one's, with its JSON."""
    out = tmp_path_factory.mktemp("tiny-plan") / "plan.json"
    args = ["plan", "--preset", "tiny", "--budget", "3.6MiB", "--batch-size", "4"]
    args += ["--seq-len", "32", "--accum", "1", "--max-compiles", "4", "--json", str(out)]
    proc = run_cli(*args, columns=100)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_a_model_under_four_layers_is_planned_by_compiling_each_candidate_whole(tiny_plan):
    """No memory model to fit at two depths of 2+ blocks: every candidate reached is compiled at
    the model's own depth, none predicted, and the command printed trains the same model."""
    proc, plan = tiny_plan
    assert "compiled whole" in plan["memory_source"]
    assert all(c["predicted_bytes"] is None for c in plan["candidates"])
    assert plan["fit_compiles"] == 0
    assert plan["chosen"]["compiled_bytes"] <= plan["budget_bytes"]
    argv = shlex.split(plan["commands"]["jax"])
    assert argv[argv.index("--preset") + 1] == "tiny" and "--n-layers" not in argv
    printed = re.sub(r" \\\n\s*", " ", proc.stdout)
    assert plan["commands"]["jax"] in printed
    assert "a model of 2 layers is compiled whole" in " ".join(proc.stdout.split())


@pytest.mark.slow
def test_the_search_prints_a_line_per_compile_with_its_peak_and_what_is_left(tiny_plan):
    proc, plan = tiny_plan
    lines = [line for line in proc.stdout.splitlines() if line.startswith("compile ")]
    assert len(lines) == plan["candidate_compiles"] >= 2
    for i, line in enumerate(lines, 1):
        assert re.match(rf"compile {i}/4: .+: [\d,.]+ MiB, (over|fits|under)", line)
    assert re.search(r"; \d+ left$", proc.stdout, re.M)


@pytest.mark.slow
def test_the_plan_table_fits_100_columns_and_cuts_no_figure(tiny_plan):
    """At 100 columns every figure is whole: the long configuration (a per-tag policy's saves)
    wraps inside its row instead."""
    proc, plan = tiny_plan
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "…" not in proc.stdout
    cells = [c.strip() for line in lines if line.startswith("│ ") for c in line.split("│")]
    for c in plan["candidates"]:
        if c["compiled_bytes"] is not None:
            assert f"{c['compiled_bytes'] / MIB:,.1f}" in cells
        assert STATUS_SHORT.get(c["status"], c["status"]) in cells
    # the configuration column, line after line: each candidate's name whole, however wrapped
    names = "".join(line.split("│")[1] for line in lines if line.startswith("│ ")).split()
    for c in plan["candidates"]:
        assert "".join(c["configuration"].split()) in "".join(names)


@pytest.mark.slow
def test_impossible_budget_names_the_smallest_plan_and_exits_2(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = [
        "plan",
        "--preset",
        "small",
        "--budget",
        "40MiB",  # above the arguments alone (37.7 MiB), below every plan
        "--batch-size",
        "8",
        "--seq-len",
        "128",
        "--accum",
        "1",
        "--no-mix",
        "--no-tags",
        "--policies",
        "none,full",
        "--json",
        str(out),
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "fits 40.0 MiB" in err[0] and "the smallest plan found is full, fp32, accum 1" in err[0]
    assert not out.exists()  # nothing half-written


@pytest.mark.slow
def test_plan_cli_writes_the_choice(tmp_path, bounds):
    out = tmp_path / "plan.json"
    budget = f"{(bounds[0] + bounds[1]) // 2}B"
    assert (
        main(
            [
                "plan",
                "--preset",
                "small",
                "--budget",
                budget,
                "--batch-size",
                "8",
                "--seq-len",
                "128",
                "--accum",
                "1",
                "--policies",
                "none,selective,full",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    plan = json.loads(out.read_text())
    assert plan["chosen"]["compiled_bytes"] <= plan["budget_bytes"]
    assert plan["chosen"]["status"] == "chosen"
    assert all(c["status"] != "chosen" for c in plan["candidates"][:-1])


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ("1KiB", "--memory-budget 1KiB (1.00 KiB) is below the smallest possible step: its "),
        ("100", "--memory-budget 100: give a unit, e.g. 100GiB"),
    ],
)
def test_train_policy_auto_refuses_a_budget_as_plan_does_naming_its_flag(budget, message, tmp_path):
    """The plan command's budget checks, in ``train --policy auto``: refused at once (no
    search line printed, nothing written), naming --memory-budget and, under the step's
    arguments, that floor from shapes."""
    out = tmp_path / "run"
    proc = run_cli(
        "train", "--preset", "tiny", "--policy", "auto", "--memory-budget", budget, "--steps",
        "1", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("jaxmem train: error: ") and message in line, line
    if budget == "1KiB":
        assert "from shapes, fp32)" in line and "(--mesh fsdp=N)" in line
    assert "compile" not in proc.stdout and not out.exists()


@pytest.mark.slow
def test_train_policy_auto_writes_the_chosen_configuration(tmp_path):
    """``jaxmem train --policy auto --memory-budget X`` trains under what ``jaxmem plan``
    chooses on this backend, and the run's config.yaml says what that was."""
    import yaml

    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=4)
    spec = StepSpec(model=cfg, policy=POLICIES["full"], batch=8, seq_len=32)
    full, none = (
        plan_step(spec.replace(policy=POLICIES[p]))["planned_peak_bytes"] for p in ("full", "none")
    )
    budget = (full + none) // 2
    out = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--n-layers", "4", "--policy", "auto"]
    args += ["--memory-budget", f"{budget}B", "--steps", "1", "--batch-size", "8"]
    args += ["--seq-len", "32", "--sample-tokens", "0", "--out", str(out)]
    assert main(args) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    policy, accum = policy_from_dict(saved["memory"]), saved["accum"]["steps"]
    # what the run recorded is what it planned: that program fits, and it is not the cheapest
    # program of all (none, one microbatch), which the budget rules out
    planned = plan_step(spec.replace(policy=policy, accum=AccumConfig(steps=accum)))
    assert planned["planned_peak_bytes"] <= budget
    assert (policy.name, accum) != ("none", 1)


def test_train_policy_auto_needs_a_budget(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--preset", "tiny", "--policy", "auto", "--steps", "1"])
    assert exit_info.value.code == 2
    assert "--policy auto needs --memory-budget" in capsys.readouterr().err


@pytest.mark.slow
def test_residual_accounting_of_a_mixed_stack_counts_no_weights():
    """The mixed stack's custom VJP keeps the stacked parameters to re-slice each block's
    weights in the backward: residual accounting must see them as the parameters (arguments),
    not as activations. A mixed stack with one preset everywhere keeps what that preset keeps,
    and replacing selective blocks by full ones keeps less."""
    from jaxmem.planner.records import jax_record

    def saved(policy):
        r = jax_record(SPEC.replace(policy=policy), abstract=True)
        return r["saved_activation_bytes_device"]

    selective = saved(POLICIES["selective"])
    everywhere = saved(mixed_policy("selective", CFG.n_layers, "full"))
    np.testing.assert_allclose(
        everywhere, selective, **tolerance("bytes", "mixed_stack_residuals").kwargs()
    )
    assert saved(mixed_policy("selective", 3, "full")) < selective


# ------------------------------------------------------------------------ per-tag policies
def _block_residual_bytes(cfg, policy, batch: int, seq: int) -> int:
    """One block's saved activations by residual accounting: a two-block model's less a
    one-block model's (JAX's own vjp, nothing estimated)."""
    from flax import nnx

    from jaxmem.memory import residuals
    from jaxmem.memory.remat import layers_fn
    from jaxmem.model import make_model
    from jaxmem.planner.records import lm_step_batch

    out = []
    for depth in (1, 2):
        c = cfg.replace(n_layers=depth)
        graphdef, params = nnx.split(nnx.eval_shape(lambda c=c: make_model(c, FP32)), nnx.Param)
        loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, depth))
        data = lm_step_batch(c, batch, seq, abstract=True)
        kept = residuals.saved_residuals(lambda p, b, f=loss: f(p, b)[0], params, data)
        out.append(residuals.summarize_residuals(kept).activation_bytes_device)
    return out[1] - out[0]


@pytest.mark.slow
def test_the_tag_frontier_is_pareto_optimal_and_its_bytes_are_what_jax_keeps():
    """One block's per-tag policies (``jaxmem.planner.tags``, on the Llama block: RoPE, GQA,
    SwiGLU): every subset's FLOPs are its blocks' (the planner's per-block fit agrees), fewer
    bytes always cost more FLOPs along the frontier, which runs from keeping the block input
    alone (``full``'s FLOPs) to recomputing no matmul (``none``'s) and leaves out only
    dominated subsets, and each point's bytes are what JAX's vjp keeps for a block."""
    from jaxmem.planner.predict import _flops_per_row
    from jaxmem.planner.tags import measure, pareto

    cfg, seq = PRESETS["tiny-llama"], 32
    every = measure(cfg, FP32, seq, _flops_per_row)
    points = pareto(every)
    sizes = [p.bytes_per_block for p in points]
    costs = [p.flops_per_block for p in points]
    assert sizes == sorted(set(sizes)) and costs == sorted(set(costs), reverse=True)
    assert points[0].saves == () and len(every) == 2**6  # qkv, probs, context, out, gate, up
    flops = FlopModel(cfg, seq)
    assert costs[0] == flops._part(POLICIES["full"], FP32)[1]
    assert costs[-1] == flops._part(POLICIES["none"], FP32)[1]
    for p in every[::9]:  # a sample: the per-block fit traces two models a subset
        assert p.flops_per_block == flops._part(p.policy, FP32)[1], p.saves
    for p in every:
        best = min(q.flops_per_block for q in points if q.bytes_per_block <= p.bytes_per_block)
        assert best <= p.flops_per_block
    for p in points:
        assert _block_residual_bytes(cfg, p.policy, 2, seq) == 2 * p.bytes_per_block, p.saves


@pytest.mark.slow
def test_the_planner_chooses_a_per_tag_policy_where_it_is_cheapest(tmp_path):
    """Between selective's and none's plans a per-tag policy (selective plus the attention
    context: one attention matmul less per block) is the cheapest that fits; ``--no-tags``
    searches the presets alone and answers selective."""
    common = ["plan", "--preset", "small", "--batch-size", "8", "--seq-len", "128", "--accum", "1"]
    common += ["--no-mix", "--policies", "none,selective,full", "--budget", "122MiB"]
    out = tmp_path / "plan.json"
    assert main([*common, "--json", str(out)]) == 0
    chosen = json.loads(out.read_text())["chosen"]
    assert chosen["policy"] == "keep qkv+context+attn_out+mlp_up"
    command = json.loads(out.read_text())["commands"]["jax"]
    assert "--policy custom --save query_proj,key_proj,value_proj,attn_context" in command
    assert main([*common, "--no-tags", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["chosen"]["policy"] == "selective"


def test_the_planner_runs_the_loss_in_chunks_where_only_that_fits(tmp_path, capsys):
    """A vocabulary of 8,192 on a 4-layer tiny (4 x 64 tokens): the fp32 logits and their
    gradient are most of the step (XLA:CPU plans: `none` 38.3 MiB whole, 20.3 MiB with the loss
    in 8 chunks, `full` 33.6, `none` in 2 microbatches 25.8). At 22 MiB the planner answers
    `none` with the loss in chunks (the same FLOPs, one microbatch) and its command runs it;
    searching the whole loss only (the default), nothing fits."""
    common = ["plan", "--preset", "tiny", "--n-layers", "4", "--set", "model.vocab_size=8192"]
    common += ["--batch-size", "4", "--seq-len", "64", "--accum", "1,2", "--no-tags", "--no-mix"]
    common += ["--policies", "none,full", "--budget", "22MiB"]
    out = tmp_path / "plan.json"
    assert main([*common, "--loss-chunks-search", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    chosen = plan["chosen"]
    assert (chosen["policy"], chosen["accum"], chosen["loss_chunks"]) == ("none", 1, 8)
    assert chosen["compiled_bytes"] <= 22 * MIB
    assert "--loss-chunks 8" in plan["commands"]["jax"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(common)  # the whole loss only (the default)
    assert exc.value.code == 2 and "fits 22.0 MiB" in capsys.readouterr().err


def test_on_a_gpu_target_the_planner_unrolls_a_stack_whose_scan_does_not_fit():
    """Unrolling changes the plan, not the FLOPs: where an unrolled stack plans less than its
    scan (XLA:CUDA: gpt2-124m bf16 `none` 13.30 -> 10.53 GB), a budget between the two gets the
    unrolled `none` rather than a recomputing policy, and its command unrolls. Compiles are
    stood in for (affine in depth, unrolled 0.85x the activations) so the search alone is
    tested."""
    from jaxmem.cli.flags import job_argv
    from jaxmem.job import JobConfig, RunConfig
    from jaxmem.memory import analytic
    from jaxmem.memory.targets import get_target

    cfg, batch, seq = PRESETS["tiny"].replace(n_layers=4), 4, 32

    def compile_peak(spec):
        rows = batch // spec.accum.steps
        est = analytic.saved_activation_bytes(spec.model, spec.policy, rows, seq, FP32)
        return int(2**20 + est.device_bytes * (0.85 if spec.policy.unroll else 1.0)), "stand-in"

    one = StepSpec(model=cfg, policy=POLICIES["none"], batch=batch, seq_len=seq)
    scanned, _ = compile_peak(one)
    unrolled, _ = compile_peak(one.replace(policy=POLICIES["none"].replace(unroll=True)))
    space = PlanSpace(
        policies=("none", "selective", "full"), mix=(), accum=(1,), state_memory=("device",)
    )
    problem = Problem(
        cfg, batch, seq, get_target("h100"), (scanned + unrolled) // 2, OptimizerConfig()
    )
    result = search(problem, dataclasses.replace(space, tags=False), compile_peak=compile_peak)
    chosen = result.chosen.candidate
    assert chosen.policy == POLICIES["none"].replace(unroll=True)
    twin = next(o.candidate for o in result.outcomes if o.candidate.policy == POLICIES["none"])
    # the same FLOPs; the estimate prices the unrolled stack no dearer (its residuals are
    # arrays of their own, not written into stacked buffers and sliced out again)
    assert chosen.flops == twin.flops and chosen.seconds <= twin.seconds
    job = candidate_job(JobConfig(preset="tiny", model=cfg, run=RunConfig(seq_len=seq)), chosen, 1)
    assert "--unroll" in job_argv(job)
    off = search(
        problem, dataclasses.replace(space, tags=False, unroll=False), compile_peak=compile_peak
    )
    assert not off.chosen.candidate.policy.unroll and off.chosen.candidate.policy.head.remat


def test_on_a_gpu_target_the_planner_confirms_its_choice_by_the_compiled_estimates():
    """The order before compiling is an estimate from the traced program; the compiled plan has
    its own. Once a candidate fits, the next ones the first estimate rates faster than the
    fitting plan's compiled estimate are compiled too (at most ``confirm``), and the fastest by
    compiled estimate is chosen. Compiles and their estimates are stood in for."""
    from jaxmem.memory.targets import get_target

    cfg, batch, seq = PRESETS["tiny"].replace(n_layers=4), 4, 32
    space = PlanSpace(
        policies=("none", "selective", "full"), mix=(), accum=(1,), state_memory=("device",)
    )
    space = dataclasses.replace(space, tags=False)
    problem = Problem(cfg, batch, seq, get_target("h100"), 2**40, OptimizerConfig())
    cands = enumerate_candidates(problem, space, FlopModel(cfg, seq))
    order, traced = [c.policy for c in cands], {c.policy: c.seconds for c in cands}
    assert traced[order[2]] < 2 * traced[order[0]]  # near ties, as the stand-ins below need
    # compiled estimates as multiples of the traced ones: the first fit comes out 3x (squeezed)
    compiled_s = {p: f * traced[p] for p, f in zip(order, (3.0, 1.0, 1.5), strict=False)}
    # the first fit's stack plans the most bytes, the rest 1 MiB (by stack: an unrolled one is
    # predicted from its scan's fits)
    planned = {order[0].name: 2**30}

    def compile_peak(spec):
        seconds = compiled_s.get(spec.policy, 9.0)
        compile_peak.step_time = {"seconds": seconds, "mfu": 0.1, "hfu": 0.1, "line": ""}
        return planned.get(spec.policy.name, 2**20), "stand-in"

    def statuses(**kwargs):
        result = search(problem, space, compile_peak=compile_peak, **kwargs)
        status = [o.status for o in result.outcomes]
        return result.chosen.candidate.policy, status, result.candidate_compiles

    slower = "fits (compiled estimate not faster)"
    chosen, status, compiles = statuses()
    assert chosen == order[1]  # confirmed against the next: faster compiled, and not squeezed
    assert status[:3] == [slower, "chosen", "not reached"], status
    chosen, status, first_fit = statuses(confirm=0)
    assert chosen == order[0] and status[:2] == ["chosen", "not reached"]
    assert compiles <= first_fit + 2  # confirming spends at most `confirm` compiles
    # the first fit was squeezed (3x its traced estimate, as XLA's rematerialization near the
    # device's capacity makes it): a runner-up planning as many bytes is not compiled
    planned[order[1].name] = 2**30
    chosen, status, _ = statuses()
    assert chosen == order[2] and status[:3] == [slower, "not reached", "chosen"], status
    del planned[order[1].name]
    # a runner-up within 2 % of the first fit's compiled estimate is a tie: the first fit stays
    compiled_s[order[1]] = 0.99 * compiled_s[order[0]]
    compiled_s[order[2]] = 0.985 * compiled_s[order[0]]
    chosen, status, _ = statuses()
    assert chosen == order[0] and status[:3] == ["chosen", slower, slower], status
    # a candidate rated slower before compiling than the choice's compiled plan is not compiled
    compiled_s[order[0]] = traced[order[0]]
    chosen, status, _ = statuses()
    assert chosen == order[0] and status[:2] == ["chosen", "not reached"]


def test_the_planner_searches_tensor_parallel_layouts_where_data_parallelism_does_not_fit():
    """Over 4 devices the lattice holds each data x tensor layout the model allows (tp = 1, 2,
    4 for tiny: 4 heads; not 3, which divides neither); a budget that only a layout splitting
    the activations over tensor devices meets gets one, its FLOPs per device the blocks' over
    tp plus the LM head whole, and its command trains that mesh. Compiles are stood in for
    (activations, weights and state over the tensor devices) so the search alone is tested."""
    from jaxmem.cli.flags import job_argv
    from jaxmem.job import JobConfig, RunConfig
    from jaxmem.memory import analytic
    from jaxmem.memory.targets import LOCAL
    from jaxmem.planner.predict import FlopModel
    from jaxmem.planner.space import tensor_sizes

    cfg, batch, seq = PRESETS["tiny"], 4, 32

    def compile_peak(spec):
        # dp replicates the weights, gradients and AdamW state; tensor devices split them
        rows, tp = spec.micro_rows, spec.parallel.tp
        est = analytic.saved_activation_bytes(spec.model, spec.policy, rows, seq, FP32)
        state = 4 * analytic.param_bytes(spec.model, FP32)
        return int(2**20 + (est.device_bytes + state) // tp), "stand-in"

    space = PlanSpace(
        policies=("none",), mix=(), accum=(1,), strategies=("dp",), tensor=(1, 2, 3, 4)
    )
    problem = Problem(cfg, batch, seq, LOCAL, 0, OptimizerConfig(), devices=4)
    assert tensor_sizes(problem, space) == [1, 2, 4]
    dp_only, _ = compile_peak(
        StepSpec(
            model=cfg,
            policy=POLICIES["none"],
            batch=batch,
            seq_len=seq,
            parallel=ParallelConfig(strategy="dp", devices=4),
        )
    )
    problem.budget_bytes = dp_only - 1  # data parallelism alone (one row each) is over
    result = search(problem, dataclasses.replace(space, tags=False), compile_peak=compile_peak)
    chosen = result.chosen.candidate
    assert chosen.tp > 1, [o.as_dict() for o in result.outcomes]
    flops = FlopModel(cfg, seq)
    per_row = flops.per_row(POLICIES["none"], FP32)
    head = 6 * seq * cfg.d_model * cfg.vocab_size
    rows = batch // (4 // chosen.tp)
    assert chosen.flops == head * rows + (per_row - head) * rows // chosen.tp
    cands = enumerate_candidates(problem, dataclasses.replace(space, tags=False), flops)
    assert {c.tp for c in cands} == {1, 2, 4}
    job = candidate_job(JobConfig(preset="tiny", model=cfg, run=RunConfig(seq_len=seq)), chosen, 4)
    assert job.parallel.tp == chosen.tp and job.parallel.devices == 4
    argv = job_argv(job)
    assert argv[argv.index("--mesh") + 1].endswith(f"tp={chosen.tp}")


@pytest.mark.slow
def test_the_planner_mixes_two_per_tag_policies_where_that_is_cheapest(tmp_path):
    """``small`` at 105 MiB (XLA:CPU): no whole-stack policy fits below selective's FLOPs, and
    a mix of two neighbours on the per-tag hull does: three blocks keep q, k, v and the MLP's up
    projection, the last the attention output and the up projection (the partitioner's own
    choice per block at these bytes): 22.69 GFLOP, against 22.96 for the best preset mix. Its
    printed command runs that policy."""
    import shlex

    from jaxmem import cli
    from jaxmem.cli import flags as cli_flags

    common = ["plan", "--preset", "small", "--batch-size", "8", "--seq-len", "128", "--accum", "1"]
    out = tmp_path / "plan.json"
    assert main([*common, "--budget", "105MiB", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    chosen = plan["chosen"]
    assert chosen["policy"] == "keep(qkv+mlp_up):3+keep(attn_out+mlp_up)"
    assert chosen["compiled_bytes"] <= 105 * MIB
    assert chosen["flops"] == 22_687_514_624  # 3 x 5.503 + 5.771 in the blocks, 0.407 outside
    args = cli.build_parser().parse_args(shlex.split(plan["commands"]["jax"])[1:])
    policy = cli_flags.job_from_args(args, list(cli_flags.FLAGS)).memory
    assert policy.name == chosen["policy"]


@pytest.mark.slow
def test_on_a_gpu_target_the_planner_replays_the_embedding_where_that_fits():
    """``small`` on an H100 plan at 99.3 MiB (a quarter of the way from full's whole-step plan to
    none's), with the replay searched: the search compiles replayed stacks from fits of their
    own and chooses one that keeps the probabilities in its first block and replays that block's
    input from the token ids, within the budget. Its twin keeping the input (the same FLOPs,
    ordered first) was not compiled: unrolled stacks are predicted from their scans' fits, and
    this one's prediction was over."""
    from jaxmem.memory.targets import get_target

    cfg, opt = PRESETS["small"], OptimizerConfig()
    # selective (whose fits predict the per-tag stacks), full (the family floor) and the
    # per-tag stacks: none, mlp, nested and the mixes with them, ordered after the choice or
    # predicted over, would each add a pair of fits to compile (6 compiles instead of 14; the
    # same choice, twin and predictions)
    space = PlanSpace(
        policies=("selective", "full"),
        mix=("selective",),
        accum=(1,),
        state_memory=("device",),
    )
    problem = Problem(cfg, 8, 128, get_target("h100"), int(99.27 * MIB), opt)
    result = search(problem, dataclasses.replace(space, replay_embedding=True))
    replayed = result.chosen
    assert replayed.candidate.policy.embedding.replay
    assert replayed.compiled <= problem.budget_bytes
    twin = dataclasses.replace(
        replayed.candidate,
        policy=replayed.candidate.policy.replace(embedding=EmbeddingReplay(False)),
    )
    order = [o.candidate for o in result.outcomes]
    assert order.index(twin) < order.index(replayed.candidate)
    assert twin.flops == replayed.candidate.flops
    assert result.outcomes[order.index(twin)].status == "over (predicted)"


def test_the_planner_runs_the_mlp_in_tiles_where_only_that_fits():
    """tiny with 4 layers and d_ff 4,096 at 4 x 256 tokens: under ``full`` each block's
    recompute holds its MLP's [rows, S, d_ff] intermediates (XLA:CPU plans: 126.8 MiB whole,
    66.2 MiB with 64-token tiles). At 96 MiB the planner answers ``full`` with the MLP in
    64-token tiles and its train command says so; searching the whole MLP only, nothing fits."""
    from jaxmem.cli.flags import job_argv
    from jaxmem.job import JobConfig, RunConfig

    cfg = PRESETS["tiny"].replace(n_layers=4, d_ff=4096, max_seq_len=256)
    batch, seq = 4, 256
    space = PlanSpace(
        policies=("full",), mix=(), accum=(1,), state_memory=("device",), tags=False,
        mlp_tiles=(16384, 256, 64),  # 16,384 and 256 do not cut the sequence: not searched
    )  # fmt: skip
    problem = Problem(cfg, batch, seq, LOCAL, 96 * MIB, OptimizerConfig())
    result = search(problem, space)
    chosen = result.chosen
    assert chosen is not None and chosen.compiled <= 96 * MIB
    assert chosen.candidate.policy == POLICIES["full"].replace(mlp_tile_tokens=64)
    assert "MLP in 64-token tiles" in chosen.candidate.describe()
    # the whole MLP predicted (or compiled) over the budget
    (whole,) = [o for o in result.outcomes if not o.candidate.policy.mlp_tile_tokens]
    assert whole.status.startswith("over")
    assert {o.candidate.policy.mlp_tile_tokens for o in result.outcomes} == {0, 64}
    job = JobConfig(preset="tiny", model=cfg, run=RunConfig(batch_size=batch, seq_len=seq))
    argv = job_argv(candidate_job(job, chosen.candidate, 1))
    assert argv[argv.index("--mlp-tile-tokens") + 1] == "64"
    untiled = search(problem, dataclasses.replace(space, mlp_tiles=()))
    assert untiled.chosen is None


def test_mlp_tiles_are_searched_without_a_tensor_axis_only():
    """``jaxmem train`` refuses MLP tiles with tensor parallelism: over 2 devices the lattice
    has tiled stacks at tp=1 and none at tp=2, and it orders the untiled stacks first."""
    from jaxmem.planner.predict import FlopModel as Flops
    from jaxmem.planner.space import enumerate_candidates

    cfg = PRESETS["tiny"].replace(max_seq_len=256)
    space = PlanSpace(
        policies=("full",), mix=(), accum=(1,), state_memory=("device",), tags=False,
        strategies=("fsdp",), tensor=(1, 2), mlp_tiles=(64,),
    )  # fmt: skip
    problem = Problem(cfg, 4, 256, LOCAL, 2**30, OptimizerConfig(), 2)
    cands = enumerate_candidates(problem, space, Flops(cfg, 256))
    tiled = [c for c in cands if c.policy.mlp_tile_tokens]
    assert tiled and {c.tp for c in tiled} == {1} and {c.tp for c in cands} == {1, 2}
    assert cands.index(tiled[0]) > max(
        i for i, c in enumerate(cands) if c.seconds == tiled[0].seconds and c not in tiled
    )


def test_the_planner_searches_context_parallel_layouts_where_only_they_split_a_row():
    """Batch 1 over 4 devices: no data axis can split it, so the lattice holds only the
    layouts that give all 4 devices to tensor and context axes (tp x cp = 4 of those the model
    allows: tiny-llama's 2 key/value heads keep tp=4 off a context axis); a context candidate's
    FLOPs are one device's over cp, its collectives its keys' and values' passes round the
    ring plus the gradient's reduction over the context devices; a budget that only the
    longest context axis meets (stand-in compiles: every activation over tp x cp, the head's
    over cp only) gets it, and its command is that mesh with the ring."""
    from jaxmem.cli.flags import job_argv
    from jaxmem.job import JobConfig, RunConfig
    from jaxmem.memory import analytic
    from jaxmem.planner.space import mesh_layouts

    cfg, seq = PRESETS["tiny-llama"].replace(attention="fused"), 64
    space = PlanSpace(
        policies=("none", "full"), mix=(), accum=(1,), strategies=("fsdp",), tags=False,
        tensor=(1, 2, 4), context=(1, 2, 4), cp_attention="ring",
    )  # fmt: skip
    problem = Problem(cfg, 1, seq, LOCAL, 0, OptimizerConfig(), devices=4)
    assert mesh_layouts(problem, space) == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)]
    flops = FlopModel(cfg, seq)
    cands = enumerate_candidates(problem, space, flops)
    assert {c.layout for c in cands} == {(1, 4, "ring"), (2, 2, "ring"), (4, 1, "")}
    (ring,) = [c for c in cands if c.cp == 4 and c.policy == POLICIES["none"]]
    assert ring.flops == flops.per_row(POLICIES["none"], FP32) // 4
    kv = 2 * seq * cfg.kv_heads * cfg.head_dim  # one row's keys and values, elements
    passes = kv * 4 * 3 / 4 + kv * (4 + 4)  # forward 3/4 of them, backward fp32 grads too
    reduction = 2 * 3 / 4 * analytic.param_bytes(cfg, FP32)  # fsdp over the 4 context devices
    assert ring.collective_bytes == int(passes * cfg.n_layers) + int(1.5 * reduction)
    assert analytic.context_parallel_bytes(
        cfg, FP32, POLICIES["none"], rows=1, seq_len=seq, cp=1
    ) == 0  # fmt: skip

    def compile_peak(spec):
        par = spec.parallel
        est = analytic.saved_activation_bytes(spec.model, spec.policy, 1, seq, FP32)
        head = 3 * seq * cfg.vocab_size * 4  # logits, softmax, gradient: split by sequence
        state = 4 * analytic.param_bytes(spec.model, FP32) // par.devices
        return int(est.device_bytes // (par.tp * par.cp) + head // par.cp + state), "stand-in"

    widest = min(compile_peak(candidate_spec(problem, c))[0] for c in cands)
    problem.budget_bytes = widest
    result = search(problem, space, compile_peak=compile_peak)
    chosen = result.chosen.candidate
    assert chosen.layout == (1, 4, "ring"), [o.as_dict() for o in result.outcomes]
    job = JobConfig(preset="tiny-llama", model=cfg, run=RunConfig(batch_size=4, seq_len=seq))
    argv = job_argv(candidate_job(job, chosen, 4, batch=1))
    assert argv[argv.index("--mesh") + 1] == "fsdp=1,cp=4"
    assert argv[argv.index("--cp-attention") + 1] == "ring"
    assert argv[argv.index("--batch-size") + 1] == "1"


def test_plan_over_a_mesh_a_batch_of_one_cannot_split_chooses_a_context_axis_that_trains(
    tmp_path,
):
    """``jaxmem plan --mesh fsdp=2 --batch-size 1`` (XLA:CPU, 2 CPU devices): the mesh's data axis
    cannot split one row, so the plan gives the devices to a context axis (the ring under
    fused attention, cheaper than tp=2 by the local order) and its printed command trains
    (its torch command, torchrun over 2 ranks with PyTorch's ring, is printed beside it); a
    batch no layout splits, and a mesh no layout of the model takes, are one line, exit 2."""
    common = ("--preset", "tiny-llama", "--attention", "fused", "--mesh", "fsdp=2")
    lean = ("--policies", "none", "--no-mix", "--no-tags", "--accum", "1", "--budget", "50MiB")
    out = tmp_path / "plan.json"
    proc = run_cli("plan", *common, *lean, "--batch-size", "1", "--seq-len", "64", "--json",
                   str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(out.read_text())
    assert plan["batch"] == 1 and plan["chosen"]["cp"] == 2, plan["chosen"]
    assert {(c["tp"], c["cp"]) for c in plan["candidates"]} <= {(1, 2), (2, 1)}
    command = shlex.split(plan["commands"]["jax"])
    assert command[command.index("--mesh") + 1] == "cp=2"
    assert command[command.index("--cp-attention") + 1] == "ring"
    torch = shlex.split(plan["commands"]["torch"])  # PyTorch's ring (parity_tests run it)
    assert torch[:3] == ["torchrun", "--standalone", "--nproc_per_node=2"]
    assert torch[torch.index("--framework") + 1] == "torch"
    assert torch[torch.index("--cp-attention") + 1] == "ring"
    said = " ".join(proc.stdout.split())
    assert "(torch_ref, stock APIs; extensions: its context axis (torch_ref.context)):" in said
    run = tmp_path / "run"
    proc = run_cli(*command[1:], "--steps", "2", "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "metrics.jsonl").exists()
    for extra, fragment in (
        (("--batch-size", "3", "--seq-len", "64", "--cp", "1", "--tp", "1"),
         "batch 3 does not split over the data axis of any layout searched"),
        (("--batch-size", "2", "--seq-len", "62", "--cp", "2", "--tp", "1"),
         "no layout of the mesh's 2 device(s) searched (tp 1 x cp 2)"),
    ):  # fmt: skip
        proc = run_cli("plan", *common, *lean, *extra)
        assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_plans_template_job_holds_the_batch_and_the_form_a_searched_context_axis_runs():
    """``jaxmem plan``'s job over a mesh: a batch its data axis cannot split is planned (the job
    a template of batch x devices rows, the batch kept apart); ``--cp-attention`` over a mesh
    without a context axis names the form a searched one runs (fused: the ring by default;
    gather when named); any other bad value is the job's own line."""
    from jaxmem.cli.app import build_parser
    from jaxmem.cli.common import UsageError
    from jaxmem.cli.plan import _space, template_job

    def plan(*argv):
        base = ("plan", "--preset", "tiny-llama", "--seq-len", "64", "--budget", "9MiB")
        args = build_parser().parse_args([*base, *argv])
        job, batch, form = template_job(args)
        return job, batch, form, _space(args, job, form)

    job, batch, form, space = plan("--attention", "fused", "--mesh", "fsdp=8", "--batch-size", "1")
    assert (batch, job.run.batch_size, job.parallel.devices) == (1, 8, 8)
    assert form is None and space.cp_attention == "ring" and space.context == (1, 2, 4, 8)
    _, _, form, space = plan(
        "--attention", "fused", "--mesh", "fsdp=8", "--batch-size", "8", "--cp-attention", "gather"
    )
    assert form == "gather" and space.cp_attention == "gather"
    _, _, _, space = plan("--mesh", "fsdp=2,cp=2", "--batch-size", "2", "--cp", "1,2")
    assert space.context == (1, 2) and space.cp_attention == "gather"  # naive attention
    for argv, fragment in (
        (("--mesh", "fsdp=2", "--cp-attention", "ring"), "add --attention fused"),
        (("--mesh", "fsdp=2", "--batch-size", "1", "--set", "optimizer.lr=-1"), "lr"),
    ):
        with pytest.raises(UsageError, match=re.escape(fragment)):
            plan(*argv)


def _chunk_twin_search(policies: tuple[str, ...], base: dict[str, float]):
    """A long-sequence stand-in search for the loss-chunk twins' bounds: tiny (2 blocks:
    compiled whole, nothing predicted, so the bounds alone decide) at 1,024 tokens, twins in 8
    and 16 chunks; a stack's "plan" is ``base[stack]`` units plus a tenth of its chunk's
    three fp32 vocabulary buffers (one unit: a 16-chunk's), the budget 100 units. Returns the
    result and each (stack, chunks)'s status."""
    from jaxmem.planner.predict import chunk_savings_bound
    from jaxmem.planner.space import policy_text
    from jaxmem.policy import LossPolicy

    cfg, seq = PRESETS["tiny"].replace(max_seq_len=1024), 1024
    space = PlanSpace(
        policies=policies, mix=(), accum=(1,), state_memory=("device",), tags=False,
        loss_chunks=8, loss_tiles=(64,),
    )  # fmt: skip
    problem = Problem(cfg, 1, seq, LOCAL, 0, OptimizerConfig())
    assert problem.compiled_whole
    cands = enumerate_candidates(problem, space, FlopModel(cfg, seq))
    assert {c.policy.loss.chunks for c in cands} == {0, 8, 16}
    one = chunk_savings_bound(problem, cands[0], 16)
    assert chunk_savings_bound(problem, cands[0]) == 16 * one  # the whole logits' bound
    problem.budget_bytes = 100 * one

    def compile_peak(spec):
        chunks = spec.policy.loss.chunks
        logits = one * 16 // chunks if chunks else 16 * one
        stack = policy_text(spec.policy.replace(loss=LossPolicy()))
        return int(base[stack] * one) + logits // 10, "stand-in"

    result = search(problem, space, compile_peak=compile_peak)
    status = {(policy_text(o.candidate.policy), o.candidate.policy.loss.chunks): o.status
              for o in result.outcomes}  # fmt: skip
    return result, status


def test_loss_chunk_twins_are_bounded_by_their_familys_floor_in_the_most_chunks():
    """At long sequences every stack has a twin per loss chunk count, and the whole-loss bound
    (the whole logits' three fp32 buffers) is too loose to skip them (an 8B at 524,288 tokens
    spent all 40 compiles on tp=8's twins). The family's leanest stack in the most chunks,
    compiled once, bounds them all: a plan in fewer chunks holds at least it less one of its
    chunks' buffers. Over the budget by less than that, it bounds nothing."""
    from jaxmem.planner.search import TWIN_OVER

    policies = ("none", "selective", "full")
    result, status = _chunk_twin_search(policies, {"none": 300, "selective": 200, "full": 101})
    assert result.chosen is None
    assert status[("full", 16)] == "over (compiled)"  # the floor itself
    bounded = [key for key in status if key[1] and key != ("full", 16)]
    assert bounded and all(status[key] == TWIN_OVER["chunk floor"] for key in bounded), status
    assert result.candidate_compiles == 2, [o.as_dict() for o in result.outcomes]
    # full in 16 chunks over by less than one chunk's buffers: the twins are compiled
    _, status = _chunk_twin_search(policies, {"none": 300, "selective": 200, "full": 100.5})
    assert status[("none", 8)] == "over (compiled)", status


def test_a_loss_chunk_twin_is_bounded_by_its_stack_compiled_in_fewer_chunks():
    """Where the family's floor fits (so bounds nothing), a stack compiled in 8 chunks over the
    budget by more than one 8-chunk's buffers needs no compile in 16; over by less, it does."""
    from jaxmem.planner.search import TWIN_OVER
    from jaxmem.planner.space import policy_text

    result, status = _chunk_twin_search(("none", "full"), {"none": 200, "full": 99})
    assert status[("none", 8)] == "over (compiled)"
    assert status[("none", 16)] == TWIN_OVER["coarser"]
    assert result.chosen is not None and policy_text(result.chosen.candidate.policy) == "full"
    _, status = _chunk_twin_search(("none", "full"), {"none": 101.5, "full": 99})
    assert status[("none", 16)] == "over (compiled)", status

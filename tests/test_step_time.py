"""The estimated step time: what a compiled plan's kernels do (``jaxmem.memory.work``, read from
its HLO or, before compiling, from the jaxpr), the stated model that prices them
(``jaxmem.memory.step_time``), and the planner's cost (``jaxmem.planner.cost``). The figures are
estimates; what is tested is that they count what the program holds (FLOPs, host bytes, loop
trip counts), that the model is the one its docstring states, and that the planner's terms move
the way their definitions say."""

from __future__ import annotations

import importlib.util

import jax
import pytest
from flax import nnx

from jaxmem.config import PRESETS, OptimizerConfig
from jaxmem.memory import analytic, step_time
from jaxmem.memory.remat import layers_fn
from jaxmem.memory.targets import get_target, rates_for
from jaxmem.memory.work import Matmul, Work, at_rows, combine, trace_jaxpr, work_of_jaxpr
from jaxmem.model import make_model
from jaxmem.model.flash import cudnn_installed, fused_kernel
from jaxmem.planner import cost
from jaxmem.planner.records import jax_record, lm_step_batch
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import lm_loss_fn

GPU_PLAN = importlib.util.find_spec("jax_cuda12_plugin") is not None
needs_gpu_plan = pytest.mark.skipif(
    not GPU_PLAN, reason="deviceless GPU plans need jaxmem[gpu-plan] (make test installs it)"
)
BF16 = PRECISIONS["bf16"]
H100 = step_time.Device.of(get_target("h100"))


def _grad_jaxpr(cfg, policy, rows, seq):
    model = nnx.eval_shape(lambda: make_model(cfg, BF16, platform="gpu"))
    graphdef, params = nnx.split(model, nnx.Param)
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
    batch = lm_step_batch(cfg, rows, seq, abstract=True)
    return jax.make_jaxpr(jax.grad(lambda p, b: loss(p, b)[0]))(params, batch)


@pytest.fixture(scope="module")
def h100_records():
    """tiny, bf16, 4 x 32, planned for an H100 without a GPU, per policy."""
    return {
        name: jax_record(
            StepSpec(
                model=PRESETS["tiny"],
                policy=POLICIES[name],
                precision=BF16,
                optimizer=OptimizerConfig(),
                batch=4,
                seq_len=32,
                target=get_target("h100"),
            )
        )  # fmt: skip
        for name in ("none", "full", "offload")
    }


@needs_gpu_plan
@pytest.mark.slow
def test_a_plans_kernels_hold_the_jaxprs_matmuls_and_the_offloaded_bytes(h100_records):
    """Read from the compiled program: every matmul the gradient's jaxpr asks for, loops
    counted by their trip counts and recompute included (XLA pads tiny's 259-word head to 288,
    and runs that: a fraction of a percent more); offload's copies to host memory and back are
    the residuals the policy offloads."""
    for name, r in h100_records.items():
        estimate = r["step_time"]
        assert r["flops"] <= estimate["executed_flops"] <= 1.01 * r["flops"], name
        assert 0 < estimate["mfu"] < estimate["hfu"] < 1
        assert estimate["model_flops"] == analytic.mfu_flops(PRESETS["tiny"], 4, 32)
    hw = {n: r["step_time"]["executed_flops"] for n, r in h100_records.items()}
    assert hw["none"] < hw["full"]  # the replay
    offload = h100_records["offload"]
    host = offload["saved_activation_bytes_host"]
    assert host > 0 and offload["step_time"]["activation_offload"] == pytest.approx(
        2 * host / H100.rates.host_link
    )
    assert h100_records["none"]["step_time"]["activation_offload"] == 0


def test_the_efficiency_curve_is_the_one_stated():
    """Wave quantization x depth x the large-product efficiency: an 8192^3 product cuts into
    4,096 128x128 tiles, 32 waves of 132 multiprocessors (the last part full); one tile runs
    on one multiprocessor of 132."""
    st = step_time
    big = Matmul(1, 8192, 8192, 8192, "bfloat16", 0)
    waves = 4096 / (32 * 132)
    assert st.matmul_efficiency(big, H100) == pytest.approx(0.8 * waves * 8192 / (8192 + 64))
    one_tile = Matmul(1, 128, 128, 4096, "bfloat16", 0)
    assert st.matmul_efficiency(one_tile, H100) == pytest.approx(0.8 / 132 * 4096 / 4160)
    # a small product is bound by its bytes, a large one by its FLOPs
    tiny = Matmul(1, 64, 64, 64, "bfloat16", 10**9)
    assert st.matmul_seconds(tiny, H100) == pytest.approx(10**9 / (H100.hbm_bytes_per_s * 0.9))
    assert st.matmul_seconds(big, H100) == pytest.approx(
        big.flops / (989e12 * st.matmul_efficiency(big, H100))
    )


def test_transfers_hide_under_compute_as_far_as_their_overlap_says():
    work = Work(matmuls=((Matmul(1, 8192, 8192, 8192, "bfloat16", 0), 1),), memory_bytes=0)
    compute = step_time.matmul_seconds(work.matmuls[0][0], H100)
    link = H100.rates.host_link
    short = step_time.Transfers(activation_offload=int(0.5 * compute * link))
    assert step_time.estimate(work, H100, model_flops=1, transfers=short).seconds == (
        pytest.approx(compute)
    )  # overlapped (activation offload: 1)
    long = step_time.Transfers(activation_offload=int(3 * compute * link))
    assert step_time.estimate(work, H100, model_flops=1, transfers=long).seconds == (
        pytest.approx(3 * compute, rel=1e-6)
    )
    state = step_time.Transfers(state=int(0.5 * compute * link))  # exposed (state: 0)
    assert step_time.estimate(work, H100, model_flops=1, transfers=state).seconds == (
        pytest.approx(1.5 * compute, rel=1e-6)
    )
    with pytest.raises(ValueError, match="overlap data_parallel=1.5"):
        step_time.Overlap(data_parallel=1.5)


def test_collectives_split_by_the_tensor_axis_of_neighbouring_devices():
    work = Work(collective_bytes=(("all-gather", 100), ("reduce-scatter (neighbours)", 7)))
    assert step_time.collective_transfers(work, data=2, tp=2) == (100, 7)
    assert step_time.collective_transfers(work, data=4, tp=1) == (107, 0)
    assert step_time.collective_transfers(work, data=1, tp=4) == (0, 107)


def test_a_jaxprs_work_is_affine_in_rows_and_in_blocks():
    """What the planner reads off four traces equals a trace of the step itself: every matmul
    dimension and byte count affine in the rows, the blocks' work in the depth."""
    cfg, seq, none = PRESETS["tiny-llama"], 16, POLICIES["none"]
    one, two = (trace_jaxpr(_grad_jaxpr(cfg, none, r, seq)) for r in (1, 2))
    assert at_rows(one, two, 5) == trace_jaxpr(_grad_jaxpr(cfg, none, 5, seq))
    deep = cfg.replace(n_layers=5)  # the model traces depths 1 and 2
    outside, blocks = cost.WorkModel(deep, seq).micro(POLICIES["selective"], BF16, 3)
    direct = work_of_jaxpr(_grad_jaxpr(deep, POLICIES["selective"], 3, seq))
    predicted = combine([(outside, 1), (blocks, 1)])
    assert predicted.matmuls == direct.matmuls
    assert predicted.memory_bytes == direct.memory_bytes
    assert predicted.memory_kernels == direct.memory_kernels


def test_the_planners_terms_move_as_defined():
    """On an H100: more microbatches of the same batch run smaller matmuls (a lower efficiency,
    more time); a streamed step's transfers are exposed; tensor parallelism divides the blocks'
    compute; the update and accumulation bytes are the ones the docstrings state."""
    from jaxmem.planner.predict import FlopModel
    from jaxmem.planner.space import PlanSpace, Problem, enumerate_candidates

    cfg, opt = PRESETS["small"], OptimizerConfig()
    space = PlanSpace(
        policies=("none", "full"), mix=(), accum=(1, 8), state_memory=("device", "stream"),
        precisions=("bf16",), tags=False, unroll=False,
    )  # fmt: skip
    problem = Problem(cfg, 8, 128, get_target("h100"), 2**30, opt)
    cands = enumerate_candidates(problem, space, FlopModel(cfg, 128))
    by = {(c.policy.name, c.accum, c.state_memory): c for c in cands}
    one, eight = by[("full", 1, "device")], by[("full", 8, "device")]
    assert eight.estimate.matmul_efficiency < one.estimate.matmul_efficiency
    assert eight.seconds > one.seconds and eight.flops == one.flops
    streamed = by[("full", 1, "stream")]
    assert streamed.estimate.state > 0
    assert streamed.seconds >= streamed.estimate.compute + streamed.estimate.state - 1e-12
    assert one.estimate.mfu == pytest.approx(
        analytic.mfu_flops(cfg, 8, 128) / (one.seconds * 989e12)
    )
    p = analytic.param_bytes(cfg, BF16)
    s = analytic.opt_state_bytes(cfg, opt, BF16)
    assert cost.update_bytes(cfg, opt, BF16) == 4 * p + 2 * s
    assert cost.accumulation_bytes(cfg, BF16, 4) == 3 * 3 * p
    assert cost.accumulation_bytes(cfg, BF16, 1) == 0


def test_a_context_axis_candidate_is_priced_with_the_blockwise_kernel_over_cp():
    """On H100s a context-parallel candidate runs jaxmem's blockwise attention (not cuDNN's):
    its estimate is one device's blockwise work over cp, its keys' and values' collectives are
    exposed (assumed) at the interconnect's rate, and its MFU counts a cp-th of the model
    FLOPs."""
    from jaxmem.planner.predict import FlopModel
    from jaxmem.planner.space import PlanSpace, Problem, enumerate_candidates

    cfg, opt, seq = PRESETS["tiny-llama"].replace(attention="fused"), OptimizerConfig(), 64
    target, bf16 = get_target("h100"), PRECISIONS["bf16"]
    space = PlanSpace(
        policies=("full",), mix=(), accum=(1,), state_memory=("device",), precisions=("bf16",),
        tags=False, unroll=False, strategies=("fsdp",), context=(2,), cp_attention="ring",
    )  # fmt: skip
    problem = Problem(cfg, 1, seq, target, 2**30, opt, devices=2)
    work = cost.WorkModel(cfg, seq)
    (cand,) = enumerate_candidates(problem, space, FlopModel(cfg, seq), work)
    est = cand.estimate
    outside, blocks = work.micro(POLICIES["full"], bf16, 1, blockwise=True)
    gpu_outside, gpu_blocks = work.micro(POLICIES["full"], bf16, 1)
    assert est.executed_flops == (outside.flops + blocks.flops) // 2
    # the blockwise kernel's own softmax work, not a cuDNN call's (one where cuDNN's library
    # is installed: the gpu trace's fused attention, else blockwise there too)
    assert blocks.attention_flops == 0
    if fused_kernel(cfg.head_dim, "bfloat16", "gpu", cudnn_installed()) == "cudnn":
        assert gpu_blocks.attention_flops > 0
    moved = analytic.context_parallel_bytes(
        cfg, bf16, POLICIES["full"], rows=1, seq_len=seq, cp=2, form="ring"
    )
    assert moved > 0
    assert est.context_parallel == pytest.approx(moved / rates_for(target).interconnect)
    assert est.seconds >= est.compute + est.context_parallel - 1e-12  # exposed
    assert est.model_flops == analytic.mfu_flops(cfg, 1, seq) // 2
    assert "1/cp=2" in est.source


def test_one_devices_model_flops_are_its_share_over_tensor_and_context_axes():
    """A device of ``fsdp=1,cp=2,tp=2`` runs a quarter of its rows' model FLOPs: the MFU it
    implies divides them by tp x cp (not by tp alone)."""
    from jaxmem.parallel import parse_mesh

    work = Work(matmuls=((Matmul(1, 8192, 8192, 8192, "bfloat16", 0), 1),), memory_bytes=0)
    cfg, target = PRESETS["tiny-llama"], get_target("h100")
    args = (work, target, cfg, PRECISIONS["bf16"], 2, 64)
    whole = step_time.of_plan(*args)["model_flops"]
    assert whole == analytic.mfu_flops(cfg, 2, 64)
    assert step_time.of_plan(*args, parse_mesh("fsdp=1,cp=2,tp=2"))["model_flops"] == whole // 4
    assert step_time.of_plan(*args, parse_mesh("cp=2"))["model_flops"] == whole // 2

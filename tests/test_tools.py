"""jaxmem's memory tools on a user's own function (``jaxmem.memory.tools``): a two-matrix MLP
block scanned over layers, whose bytes and FLOPs are written out by hand below, and the
errors a user meets, one typed exception each."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from jaxmem import compat
from jaxmem.config import ConfigError
from jaxmem.memory import tools
from jaxmem.policy import PROJECTIONS

L, B, D, F = 3, 64, 32, 128  # layers, rows, width, hidden width: fp32 throughout
F32 = 4
WEIGHTS = {
    "up": jax.ShapeDtypeStruct((L, D, F), jnp.float32),
    "down": jax.ShapeDtypeStruct((L, F, D), jnp.float32),
}
X = jax.ShapeDtypeStruct((B, D), jnp.float32)
GPU_PLAN = importlib.util.find_spec("jax_cuda12_plugin") is not None
needs_gpu_plan = pytest.mark.skipif(
    not GPU_PLAN,
    reason="deviceless GPU plans need JAX's CUDA plugin and ptxas: pip install "
    "'jaxmem[gpu-plan]' (make test installs it), not installed here",
)


def block(x, w):
    h = checkpoint_name(x @ w["up"], "fc1")  # [B, F]
    a = checkpoint_name(jnp.tanh(h), "act")  # [B, F]
    return x + checkpoint_name(a @ w["down"], "fc2")  # [B, D]


def loss_under(policy: tools.TagPolicy | None):
    def loss(ws, x):
        f = block if policy is None else tools.remat(block, policy)
        y, _ = jax.lax.scan(lambda c, w: (f(c, w), None), x, ws)
        return jnp.mean(y**2)

    return loss


def test_tags_are_read_from_the_function_through_its_scan():
    assert tools.tags(loss_under(None), WEIGHTS, X) == ("fc1", "act", "fc2")


def test_a_preset_over_your_tags_translates_jaxmems_names_to_yours():
    names = {"mlp_up": "fc1", "mlp_act": "act", "mlp_down": "fc2", "query_proj": ("q", "q2")}
    selective = tools.TagPolicy.preset("selective", names)
    assert selective.save == ("q", "q2", "fc1", "fc2")  # PROJECTIONS, in jaxmem's order
    assert set(PROJECTIONS) >= {"query_proj", "mlp_up", "mlp_down"}
    assert tools.TagPolicy.preset("none", names).remat is False
    assert tools.TagPolicy.preset("full", names).names == ()
    offload = tools.TagPolicy.preset("offload", names)
    assert offload.offload == ("q", "q2", "fc1", "fc2") and offload.save == ()
    custom = tools.TagPolicy.custom({"fc1": "device", "act": "offload", "fc2": "recompute"})
    assert (custom.save, custom.offload) == (("fc1",), ("act",))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: tools.TagPolicy.preset("nested", {}), "not a choice of tags"),
        (lambda: tools.TagPolicy.preset("fast", {}), "'fast' is not a preset"),
        (lambda: tools.TagPolicy.preset("full", {"mlp_upp": "fc1"}), "['mlp_upp'] are not jaxmem"),
        (lambda: tools.TagPolicy(save=("a",), offload=("a",)), "both saved and offloaded"),
        (lambda: tools.TagPolicy(remat=False, save=("a",)), "takes no names"),
        (lambda: tools.TagPolicy(save="fc1"), "save='fc1' must be a tuple"),
        (lambda: tools.TagPolicy.custom({"fc1": "gpu"}), "{'fc1': 'gpu'}"),
    ],
)
def test_bad_policies_are_one_line_errors_naming_the_value(make, message):
    with pytest.raises(ConfigError) as e:
        make()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_residuals_by_tag_are_the_bytes_written_by_hand():
    none = tools.residuals(loss_under(None), WEIGHTS, X)
    # without remat every layer keeps act (the down projection's backward reads it; jax up to
    # 0.10 keeps it a second time for tanh's derivative: compat.SCAN_KEEPS_SHARED_RESIDUAL_ONCE)
    # and a [B, F] term of tanh's derivative made from it in the forward; fc1 and fc2 are read
    # by no backward; the loss keeps the stack's output [B, D]
    kept_act = 1 if compat.SCAN_KEEPS_SHARED_RESIDUAL_ONCE else 2
    assert none.by_tag["act"] == kept_act * L * B * F * F32
    assert none.by_tag["<untagged>"] == L * B * F * F32 + B * D * F32
    assert "fc1" not in none.by_tag and "fc2" not in none.by_tag
    keep_fc1 = tools.residuals(loss_under(tools.TagPolicy(save=("fc1",))), WEIGHTS, X)
    assert keep_fc1.by_tag["fc1"] == L * B * F * F32
    assert keep_fc1.by_tag["<layer input>"] == L * B * D * F32
    assert "act" not in keep_fc1.by_tag
    full = tools.residuals(loss_under(tools.TagPolicy()), WEIGHTS, X)
    assert full.by_tag == {"<layer input>": L * B * D * F32, "<untagged>": B * D * F32}
    assert full.by_tag["<layer input>"] == L * B * D * F32
    assert full.device_bytes < keep_fc1.device_bytes < none.device_bytes
    # a policy given to residuals() checkpoints the whole loss under it: only the tags it names
    whole = tools.residuals(loss_under(None), WEIGHTS, X, policy=tools.TagPolicy(save=("act",)))
    assert whole.by_tag["act"] == L * B * F * F32 and "fc1" not in whole.by_tag


def test_offloaded_tags_are_host_bytes():
    kept = tools.residuals(loss_under(tools.TagPolicy(offload=("act",))), WEIGHTS, X)
    assert kept.host_bytes == L * B * F * F32


def test_matmul_flops_count_the_recomputation():
    forward = L * (2 * B * D * F + 2 * B * F * D)
    up = L * 2 * B * D * F  # fc1's matmuls, one per layer

    def flops(policy):
        return tools.matmul_flops(jax.grad(loss_under(policy)), WEIGHTS, X)

    assert flops(None) == 3 * forward  # forward, then the gradients of inputs and weights
    # full replays the block up to what the backward reads: fc2's output is read by none
    assert flops(tools.TagPolicy()) == 3 * forward + up
    # keeping fc1, the replay is tanh alone: no matmul
    assert flops(tools.TagPolicy(save=("fc1",))) == 3 * forward
    # keeping act does not spare fc1: tanh's derivative reads tanh's own output, not the tagged
    # value, so the replay recomputes it (tag the value the backward reads)
    assert flops(tools.TagPolicy(save=("act",))) == 3 * forward + up


def test_a_policy_naming_a_tag_the_function_never_produces_raises_tag_error():
    with pytest.raises(tools.TagError, match=r"\['fc3'\] that the function never produces"):
        tools.residuals(loss_under(tools.TagPolicy(save=("fc3",))), WEIGHTS, X)
    with pytest.raises(tools.TagError, match="it produces \\['fc1', 'act', 'fc2'\\]"):
        tools.residuals(loss_under(None), WEIGHTS, X, policy=tools.TagPolicy(save=("fc3",)))


def test_cpu_plan_counts_the_arguments_and_reflects_remat_under_scan():
    arguments = (L * D * F * 2 + B * D) * F32
    none = tools.plan(jax.grad(loss_under(None)), WEIGHTS, X)
    full = tools.plan(jax.grad(loss_under(tools.TagPolicy())), WEIGHTS, X)
    assert none.argument_bytes == full.argument_bytes == arguments
    # the gradients, and XLA:CPU's table of the output tuple (a pointer per array)
    assert none.output_bytes == L * D * F * 2 * F32 + 2 * 8
    assert full.temp_bytes < none.temp_bytes
    assert none.fits is None and "XLA for the local backend" in none.figure
    assert none.planned_peak_bytes == (
        none.argument_bytes + none.output_bytes - none.alias_bytes + none.temp_bytes
    )


def test_donated_arguments_are_aliased():
    def step(ws, x):
        g = jax.grad(loss_under(None))(ws, x)
        return jax.tree.map(lambda w, d: w - 0.1 * d, ws, g)

    plan = tools.plan(step, WEIGHTS, X, donate_argnums=(0,))
    assert plan.alias_bytes == L * D * F * 2 * F32


def test_peak_lists_the_live_values_and_credits_kept_tags():
    policy = tools.TagPolicy(save=("act",))
    loss = loss_under(policy)
    sp = tools.peak(jax.grad(loss), WEIGHTS, X, loss=loss, loss_args=(WEIGHTS, X))
    report = sp.report
    assert 0 < report.live_bytes <= report.allocated_bytes
    assert sp.plan.planned_peak_bytes == report.planned_peak_bytes
    assert sum(sp.by_operation().values()) == report.live_bytes
    # the stacked act residual [L, B, F] is live when the backward starts
    assert sp.by_tag.get("act", 0) >= L * B * F * F32, sp.by_tag
    assert "residuals the loss keeps" in sp.by_tag_method


def test_errors_are_typed_and_one_line(tmp_path):
    loss = loss_under(None)
    cases = [
        (tools.ArgumentError, lambda: tools.plan(loss, WEIGHTS), "cannot be called with 1"),
        (tools.ArgumentError, lambda: tools.plan(loss, WEIGHTS, "x"), "argument 1 of"),
        (
            tools.TraceError,
            lambda: tools.plan(loss, WEIGHTS, jax.ShapeDtypeStruct((B, D + 1), jnp.float32)),
            "does not trace with these arguments: TypeError: dot_general",
        ),
        (tools.TargetError, lambda: tools.plan(loss, WEIGHTS, X, target="h200"), "'h200'"),
        (
            tools.TargetError,
            lambda: tools.plan(loss, WEIGHTS, X, target=str(tmp_path / "gpu.txtpb")),
            "no such file",
        ),
        (
            tools.ArgumentError,
            lambda: tools.plan(loss, WEIGHTS, X, mesh={"data": 4096}),
            "needs 4096 devices",
        ),
    ]
    for kind, call, message in cases:
        with pytest.raises(kind) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert isinstance(e.value, tools.StepError) and isinstance(e.value, ConfigError)


@needs_gpu_plan
def test_h100_plan_of_your_function_and_its_sharded_plan():
    from jax.sharding import PartitionSpec as P

    step = jax.grad(loss_under(tools.TagPolicy(save=("act",))))
    one = tools.plan(step, WEIGHTS, X, target="h100")
    assert one.fits is True and one.device_memory_bytes == 84942979072
    assert "XLA:CUDA deviceless compile" in one.figure
    # the weights split over 2 GPUs along their hidden width: half of them per device
    two = tools.plan(
        step,
        WEIGHTS,
        X,
        target="h100",
        mesh={"model": 2},
        in_specs=({"up": P(None, None, "model"), "down": P(None, "model", None)}, None),
    )
    assert two.devices == 2 and "per device of 2" in two.figure
    assert two.argument_bytes == (L * D * F * 2 // 2 + B * D) * F32

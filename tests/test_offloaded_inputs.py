"""Offloaded checkpoints: the block inputs a remat policy keeps (``full-host``; ``nested-host``'s
segment inputs; a per-tag block offloading ``block_input``; either in a mixed stack) live in host
memory and come back for the recompute. Written and read wherever a preset is; JAX keeps them in
``pinned_host`` and no device copy (residual accounting, the H100 plan's buffers); torch_ref
sends the checkpoint's saved input to host with stock ``save_on_cpu``; both frameworks' host
bytes equal the analytic model's; float64 gradients equal ``full``'s (``nested``'s) bitwise in
each framework; ``jaxmem train`` runs them in both."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from jaxmem import cli
from jaxmem.compare.bench import memory_point
from jaxmem.compare.parity import torch_model_from
from jaxmem.config import PRESETS, ConfigError
from jaxmem.memory import analytic
from jaxmem.memory.remat import check_backend, layers_fn
from jaxmem.memory.residuals import saved_residuals, summarize_residuals
from jaxmem.model import make_model
from jaxmem.planner.records import lm_step_batch
from jaxmem.policy import (
    BLOCK_INPUT,
    BLOCKS,
    POLICIES,
    PROJECTIONS,
    BlockPolicy,
    EmbeddingReplay,
    MemoryPolicy,
    StackPart,
    describe_kept,
    mixed_policy,
    model_tags,
    policy_label,
)
from jaxmem.policy_config import parse_policy, policy_from_dict, policy_to_dict
from jaxmem.precision import FP64, PRECISIONS
from jaxmem.step.train_step import lm_loss_fn
from tests.test_train import TINY, metrics
from torch_ref.loss import cross_entropy_sum
from torch_ref.remat import apply_memory_policy, validate_for_torch

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=4)  # nested: 2 segments of 2 blocks
B, S = 2, 32
FP32 = PRECISIONS["fp32"]
# selective's projections on the device (those a GPT-2 block has), the block input on host
SELECTIVE_HOST = MemoryPolicy.custom(
    {**{n: "device" for n in PROJECTIONS if n in model_tags(CFG)}, BLOCK_INPUT: "offload"}
)


def with_inputs_on_device(policy: MemoryPolicy) -> MemoryPolicy:
    """``policy`` with nothing offloaded (its block inputs kept on the device)."""
    parts = tuple(
        dataclasses.replace(p, block=dataclasses.replace(p.block, offload=())) for p in policy.parts
    )
    return policy.replace(parts=parts, name="on-device")


def input_bytes(policy: MemoryPolicy, cfg=CFG) -> int:
    return analytic.saved_activation_bytes(cfg, policy, B, S, FP32).input_host_bytes


def test_the_host_presets_are_written_and_read_wherever_a_preset_is():
    """``--policy``, ``HEAD:K+REST``, a run config's ``[memory]`` and the labels: the two
    presets and a per-tag block with its input on host; nested-host only over a whole stack."""
    full_host, nested_host = POLICIES["full-host"], POLICIES["nested-host"]
    assert full_host.head == BlockPolicy(offload=(BLOCK_INPUT,)) and full_host.offloads
    assert nested_host.nested and nested_host.head == BLOCKS["full-host"]
    assert parse_policy("full-host") == full_host and parse_policy("nested-host") == nested_host
    for text in ("full-host:2+full", "none:1+full-host"):
        mixed = parse_policy(text)
        assert mixed.name == text and policy_label(mixed) == text
        assert policy_from_dict(policy_to_dict(mixed)) == mixed
    for policy in (full_host, nested_host, SELECTIVE_HOST, mixed_policy(SELECTIVE_HOST, 1, "full")):
        assert policy_from_dict(policy_to_dict(policy)) == policy
    assert policy_to_dict(nested_host)["policy"] == "nested-host"
    label = "custom keep(qkv+attn_out+mlp_up+mlp_down) host(block_input)"
    assert policy_label(SELECTIVE_HOST) == label
    assert "offloads ['block_input']" in describe_kept(CFG, full_host)
    assert "on device []" in describe_kept(CFG, full_host)
    assert "in host memory" in describe_kept(CFG, nested_host)
    for bad, message in [
        ("none:2+nested-host", "rest='nested-host' must name a preset"),
        ("nested-host:2+full", "a mixed stack's part is a preset or a per-tag policy"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_policy(bad)
    with pytest.raises(ConfigError, match="nested recomputes whole segments"):
        MemoryPolicy(nested=True, parts=(StackPart(block=BlockPolicy(offload=("mlp_up",))),))
    validate_for_torch(SELECTIVE_HOST, cfg=CFG)  # torch_ref expresses it (stock save_on_cpu)
    with pytest.raises(ConfigError, match="needs use_reentrant=False"):
        validate_for_torch(nested_host.replace(use_reentrant=True))  # two-level checkpoints


@pytest.fixture(scope="module")
def jax_case():
    graphdef, params = nnx.split(make_model(CFG, FP32, seed=0), nnx.Param)
    return graphdef, params, lm_step_batch(CFG, B, S, abstract=False)


def host_and_device(jax_case, policy: MemoryPolicy):
    graphdef, params, data = jax_case
    residuals = saved_residuals(scalar_loss(graphdef, data, policy), params)
    return residuals, summarize_residuals(residuals)


@pytest.mark.parametrize(
    "policy,inputs_on_host",
    [
        (POLICIES["full-host"], 4),
        (POLICIES["full-host"].replace(embedding=EmbeddingReplay(True)), 3),
        (POLICIES["nested-host"], 2),
        (SELECTIVE_HOST, 4),
        (parse_policy("full-host:1+full"), 1),
    ],
    ids=["full-host", "replayed", "nested-host", "selective-host", "mixed"],
)
def test_jax_keeps_the_offloaded_inputs_in_host_memory_only(jax_case, policy, inputs_on_host):
    """Residual accounting (the VJP's jaxpr): the host bytes are exactly the offloaded inputs
    (the analytic model's ``input_host_bytes``), and the device keeps what ``full`` (``nested``,
    the per-tag block) keeps less those inputs: no device copy beside the host one. A replayed
    first block keeps neither copy."""
    one_input = analytic.tag_bytes(CFG, B, S, FP32)[BLOCK_INPUT]
    residuals, host = host_and_device(jax_case, policy)
    _, device = host_and_device(jax_case, with_inputs_on_device(policy))
    assert host.activation_bytes_host == inputs_on_host * one_input == input_bytes(policy)
    assert (
        host.activation_bytes_device == device.activation_bytes_device - host.activation_bytes_host
    )
    named_host = {r.name for r in residuals if r.memory_kind is not None}
    assert named_host == ({"segment_input"} if policy.nested else {BLOCK_INPUT})


@pytest.mark.slow
def test_float64_gradients_equal_the_device_inputs_bitwise_in_jax():
    """XLA:CPU erases the host memory space, so the program must be the same math: every
    gradient leaf of full-host is full's, nested-host's nested's, bit for bit."""
    with jax.enable_x64(True):
        graphdef, params = nnx.split(make_model(CFG, FP64, seed=0), nnx.Param)
        data = lm_step_batch(CFG, B, 16, abstract=False)
        for host, device in (("full-host", "full"), ("nested-host", "nested")):
            (la, ga), (lb, gb) = (
                jax.jit(jax.value_and_grad(scalar_loss(graphdef, data, POLICIES[n])))(params)
                for n in (host, device)
            )
            assert float(la) == float(lb), host
            for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def scalar_loss(graphdef, data, policy: MemoryPolicy):
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, CFG.n_layers))
    return lambda p: loss(p, data)[0]


@pytest.fixture(scope="module")
def torch_case():
    with jax.enable_x64(True):
        model = torch_model_from(make_model(CFG, FP64, seed=0))
    data = lm_step_batch(CFG, B, S, abstract=False)
    return model, *(torch.tensor(np.asarray(data[k])).long() for k in ("inputs", "targets"))


def torch_run(torch_case, policy: MemoryPolicy, translation: str = "stock"):
    """(loss, gradients, runner) of torch_ref in float64 under ``policy``."""
    model, x, y = torch_case
    model.zero_grad(set_to_none=True)
    runner = apply_memory_policy(model.blocks, policy, translation)
    loss_sum, n = cross_entropy_sum(model(x), y)
    loss = loss_sum / n
    loss.backward()
    grads = {k: p.grad.numpy().copy() for k, p in model.named_parameters()}
    return loss.item(), grads, runner


@pytest.mark.slow
def test_float64_gradients_equal_the_device_inputs_bitwise_in_torch(torch_case):
    """Stock ``save_on_cpu`` around the checkpoint moves its saved input and nothing else:
    the loss and every gradient are ``full``'s (reentrant or not), nested-host's the two-level
    nested checkpoint's (the lean translation of ``nested``), bit for bit."""
    reentrant = {"use_reentrant": True}
    pairs = [
        (POLICIES["full-host"], POLICIES["full"], "stock"),
        (
            POLICIES["full-host"].replace(**reentrant),
            POLICIES["full"].replace(**reentrant),
            "stock",
        ),
        (POLICIES["nested-host"], POLICIES["nested"], "lean"),
        (SELECTIVE_HOST, with_inputs_on_device(SELECTIVE_HOST), "stock"),
    ]
    for host, device, translation in pairs:
        loss_h, grads_h, runner = torch_run(torch_case, host)
        assert {k.names for k in runner.kept if k.memory == "host"} == {(BLOCK_INPUT,)}
        loss_d, grads_d, _ = torch_run(torch_case, device, translation)
        assert loss_h == loss_d, host.name
        for k, g in grads_d.items():
            np.testing.assert_array_equal(grads_h[k], g, err_msg=f"{host.name} {k}")


def test_the_saved_tensor_hooks_outside_a_checkpoint_see_only_its_input():
    """Why stock ``save_on_cpu`` expresses "input in host memory, block recomputed": a
    non-reentrant checkpoint saves its inputs through an autograd function outside its own
    hooks, and every tensor its block saves through them; the outer hooks see the input only
    (PyTorch 2.11 also saves an empty placeholder there: no storage, nothing to offload)."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(8, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    seen = []

    def pack(t):
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        checkpoint(lambda a: torch.tanh(lin(torch.tanh(a))), x, use_reentrant=False)
    stored = [t for t in seen if t.numel()]
    assert len(stored) == 1 and stored[0] is x, [tuple(t.shape) for t in seen]
    assert len(seen) <= 2, [tuple(t.shape) for t in seen]


@pytest.mark.slow
@pytest.mark.parametrize("name,full", [("full-host", "full")])  # nested-host: the same hooks
def test_both_frameworks_count_the_offloaded_inputs_as_host_bytes(name, full):
    """``jaxmem memory``'s saved device/host columns (JAX: residual accounting; torch_ref:
    live-tensor accounting, the host storages its runner names): the host bytes are the
    analytic model's, in both frameworks, and the device bytes fall by them from ``full``'s."""
    host = memory_point(CFG, name, "fp32", B, S, compile_plan=False)
    device = memory_point(CFG, full, "fp32", B, S, compile_plan=False)
    expected = input_bytes(POLICIES[name])
    assert expected > 0
    assert host["jax_host_bytes"] == host["torch_host_bytes"] == expected
    assert host["jax_device_bytes"] == device["jax_device_bytes"] - expected
    assert host["torch_device_bytes"] == device["torch_device_bytes"] - expected
    assert host["jax_flops"] == device["jax_flops"]
    assert "save_on_cpu" in host["torch_translation"]


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_train_runs_full_host_to_fulls_losses(tmp_path, framework):
    """``jaxmem train --policy full-host`` on the CPU (XLA:CPU has ``pinned_host``) and with
    ``--framework torch``: the same losses as ``full``, bit for bit."""
    runs = {}
    for policy in ("full-host", "full"):
        out = tmp_path / policy
        argv = ["train", *TINY, "--steps", "2", "--framework", framework, "--policy", policy]
        assert cli.main([*argv, "--out", str(out)]) == 0
        runs[policy] = [r["loss"] for r in metrics(out)]
        assert policy in (out / "config.yaml").read_text()
    assert runs["full-host"] == runs["full"] and len(runs["full"]) == 2


@pytest.mark.slow
def test_the_h100_plan_streams_the_inputs_to_host_and_keeps_no_device_copy(jax_case):
    """XLA:CUDA's deviceless plan of full-host's gradient (tiny, 4 blocks): its host temp is the
    analytic input bytes, and the stacked block inputs exist only in the host memory space S(5):
    the forward writes each block's input there (an async dynamic-update-slice) and the
    backward reads it back (an async dynamic-slice); no device buffer of that shape exists
    (``full``'s plan keeps exactly that buffer on the device: docs/policies.md)."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="deviceless GPU plans need gpu-plan")
    from jaxmem.memory.gpu_plan import compile_for
    from jaxmem.memory.targets import get_target

    graphdef, params, data = jax_case
    step = jax.jit(jax.grad(scalar_loss(graphdef, data, POLICIES["full-host"])))
    plan = compile_for(step, (params,), get_target("h100"))
    assert plan.memory_analysis().host_temp_size_in_bytes == input_bytes(POLICIES["full-host"])
    text = plan.as_text()
    stacked = re.escape(f"f32[{CFG.n_layers},{B},{S},{CFG.d_model}]")
    assert set(re.findall(stacked + r"\{([^}]*)\}", text)) == {"3,2,1,0:S(5)"}
    assert "dynamic-update-slice-start" in text and "dynamic-slice-start" in text


@pytest.mark.parametrize("name,instead", [("full-host", "full"), ("nested-host", "nested")])
def test_a_backend_without_pinned_host_refuses_in_one_line_naming_the_fix(name, instead):
    class NoHostDevice:
        def addressable_memories(self):
            return [type("Memory", (), {"kind": "device"})()]

    with pytest.raises(
        ConfigError, match=rf"only has memory kinds \['device'\].*e\.g\. {instead}\)"
    ):
        check_backend(POLICIES[name], NoHostDevice())

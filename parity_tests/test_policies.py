"""Every memory policy in both frameworks: same loss and gradients as the no-remat run and as the
other framework, the same tensors kept (by tag name and memory kind), and FLOPs ordered the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch.utils.checkpoint import checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

import torch_ref
from jaxmem import seed_example as jax_seed
from jaxmem.config import PRESETS, ConfigError
from jaxmem.flops import grad_matmul_flops
from jaxmem.memory import saved_residuals
from jaxmem.model import Decoder
from jaxmem.parity import compare_state_dicts, lm_batch, tolerance, torch_model_from
from jaxmem.precision import PRECISIONS
from jaxmem.remat import POLICIES, LayerSelection, MemoryPolicy, layers_fn
from jaxmem.train import lm_loss_fn, make_model
from jaxmem.weights import to_torch_state_dict
from torch_ref import seed_example as torch_seed
from torch_ref.loss import cross_entropy_sum
from torch_ref.remat import (
    OffloadCheckpoint,
    apply_memory_policy,
    block_ops,
    offload_checkpoint_layers_fn,
    save_on_cpu_layers_fn,
    unread_by_backward,
    validate_for_torch,
)
from torch_ref.train import TORCH_DTYPES

F32 = "float32"
NAMED = ("selective", "mlp", "dots", "offload")
CONFIGS = {
    "pre_causal": PRESETS["tiny"].replace(n_layers=4),
    "post_relu_bidirectional": PRESETS["tiny"].replace(
        n_layers=3, norm="post", activation="relu", causal=False, bias=False
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    cfg = CONFIGS[request.param]
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    inputs, targets = lm_batch(cfg, 4, 24, seed=3)
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    torch_model = torch_model_from(model)
    x_t, y_t = torch.from_numpy(inputs).long(), torch.from_numpy(targets).long()
    return cfg, graphdef, params, batch, torch_model, x_t, y_t


def jax_run(cfg, graphdef, params, batch, policy):
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
    f = lambda p, b: loss(p, b)[0]  # noqa: E731
    value, grads = jax.value_and_grad(f)(params, batch)
    grads_sd = to_torch_state_dict(nnx.merge(graphdef, grads))
    return float(value), grads_sd, f


def torch_run(torch_model, x, y, layers_fn_or_policy):
    if isinstance(layers_fn_or_policy, MemoryPolicy):
        runner = apply_memory_policy(torch_model.blocks, layers_fn_or_policy)
    else:
        torch_model.blocks.layers_fn = runner = layers_fn_or_policy
    torch_model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        loss_sum, n = cross_entropy_sum(torch_model(x), y)
        loss = loss_sum / n
        loss.backward()
    grads = {k: p.grad.detach().numpy().copy() for k, p in torch_model.named_parameters()}
    return loss.item(), grads, counter.get_total_flops(), runner


def assert_grads(actual, expected, quantity):
    diff = compare_state_dicts(actual, expected, tolerance(F32, quantity))
    assert diff.passed, f"{diff.failures} (max abs {diff.max_abs:.3e})"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_numerics_in_both_frameworks(case, name):
    cfg, graphdef, params, batch, torch_model, x, y = case
    policy = POLICIES[name]
    base_j, base_grads_j, _ = jax_run(cfg, graphdef, params, batch, POLICIES["none"])
    loss_j, grads_j, _ = jax_run(cfg, graphdef, params, batch, policy)
    base_t, base_grads_t, _, _ = torch_run(torch_model, x, y, POLICIES["none"])
    loss_t, grads_t, _, _ = torch_run(torch_model, x, y, policy)
    tol = tolerance(F32, "remat_vs_none")
    np.testing.assert_allclose(loss_j, base_j, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(loss_t, base_t, rtol=tol.rtol, atol=tol.atol)
    assert_grads(grads_j, base_grads_j, "remat_vs_none")
    assert_grads(grads_t, base_grads_t, "remat_vs_none")
    tol = tolerance(F32, "loss")
    np.testing.assert_allclose(loss_j, loss_t, rtol=tol.rtol, atol=tol.atol)
    assert_grads(grads_j, grads_t, "grads")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMED)
def test_both_frameworks_keep_the_same_tags_in_the_same_memory(case, name, precision):
    cfg, graphdef, params, batch, torch_model, x, y = case
    policy = POLICIES[name]
    prec = PRECISIONS[precision]
    if prec.is_mixed:  # the same weights, computed in bf16
        model = make_model(cfg, prec)
        nnx.update(model, params)
        graphdef, params = nnx.split(model, nnx.Param)
    *_, f = jax_run(cfg, graphdef, params, batch, policy)
    # A block's input is the previous block's output: JAX's scan keeps it under whichever of
    # the three names it meets first; torch's checkpoint keeps its input. Same tensor, same bytes.
    block_output = "mlp_residual" if cfg.norm == "pre" else "norm2_out"
    layer_inputs = {"<layer input>", "block_input", block_output, "<stack output>"}
    jax_kept: dict[str, set] = {}
    input_bytes = 0
    for r in saved_residuals(f, params, batch):
        if r.origin != "computed" or r.name is None:
            continue
        if r.name in layer_inputs:
            input_bytes += r.nbytes
        else:
            jax_kept.setdefault(r.name, set()).add("host" if r.memory_kind else "device")
    b, s = batch["inputs"].shape
    # Plus the last block's output, which the final norm (pre-norm) or the LM head (post-norm)
    # keeps (torch keeps it too, outside the checkpoints): one more [B, S, D].
    n_inputs = cfg.n_layers + 1
    assert input_bytes == n_inputs * b * s * cfg.d_model * prec.compute.itemsize
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec.is_mixed):
        *_, runner = torch_run(torch_model, x, y, policy)
    # fp32 LayerNorm statistics / softmax output come with the norms and the probabilities
    with_fp32 = any(set(k.names) & {"norm1_out", "norm2_out", "attn_probs"} for k in runner.kept)
    assert {k.dtype for k in runner.kept} == {TORCH_DTYPES[prec.compute_dtype]} | (
        {torch.float32} if prec.is_mixed and with_fp32 else set()
    )
    torch_kept: dict[str, set] = {}
    for k in runner.kept:
        for n in k.names:
            torch_kept.setdefault(n, set()).add(k.memory)
        assert k.layer in range(cfg.n_layers)
    assert torch_kept == jax_kept
    assert not set(torch_kept) & unread_by_backward(cfg, policy)
    # Every layer keeps the same set.
    per_layer = {
        i: {n for k in runner.kept if k.layer == i for n in k.names} for i in range(cfg.n_layers)
    }
    assert all(v == per_layer[0] for v in per_layer.values())


def test_flops_order_is_the_same_in_both_frameworks(case):
    cfg, graphdef, params, batch, torch_model, x, y = case
    order = ("none", "selective", "full", "nested")
    jax_flops = [
        grad_matmul_flops(jax_run(cfg, graphdef, params, batch, POLICIES[n])[2], params, batch)
        for n in order
    ]
    torch_flops = [torch_run(torch_model, x, y, POLICIES[n])[2] for n in order]
    assert jax_flops == sorted(jax_flops) and len(set(jax_flops)) == len(order)
    assert torch_flops == sorted(torch_flops) and len(set(torch_flops)) == len(order)
    # No recompute: both frameworks execute exactly the same matmul FLOPs.
    assert jax_flops[0] == torch_flops[0]
    # Full remat: one extra forward of the blocks in both.
    assert jax_flops[2] == torch_flops[2]
    # Selective: the attention core only; neither framework re-runs out_proj / mlp_down, whose
    # products nothing in the backward reads (torch_ref.remat.skippable_in_recompute).
    assert jax_flops[1] == torch_flops[1]


def test_reentrant_full_checkpoint_gives_the_same_gradients(case):
    cfg, graphdef, params, batch, torch_model, x, y = case
    _, base, _, _ = torch_run(torch_model, x, y, POLICIES["none"])
    _, grads, flops, _ = torch_run(torch_model, x, y, POLICIES["full"].replace(use_reentrant=True))
    _, _, full_flops, _ = torch_run(torch_model, x, y, POLICIES["full"])
    assert_grads(grads, base, "remat_vs_none")
    # Reentrant checkpoint replays the whole block; non-reentrant stops once the tensors the
    # backward needs exist. In a pre-norm block that skips the last matmul (mlp_down), as JAX
    # does; in a post-norm block norm2's backward needs mlp_down's output, so both replay it.
    b, s = x.shape
    mlp_down = 2 * b * s * cfg.d_ff * cfg.d_model
    skipped = cfg.n_layers * mlp_down if cfg.norm == "pre" else 0
    assert flops == full_flops + skipped


def test_nested_matches_checkpoint_sequential(case):
    cfg, graphdef, params, batch, torch_model, x, y = case
    _, nested, _, _ = torch_run(torch_model, x, y, POLICIES["nested"])

    def sequential(layers, h, mask):
        fns = [lambda t, layer=layer: layer(t, mask) for layer in layers]
        return checkpoint_sequential(fns, 2, h, use_reentrant=False)

    _, grads, _, _ = torch_run(torch_model, x, y, sequential)
    assert_grads(grads, nested, "remat_vs_none")


def test_layer_selection_two_of_three_like_seed_004(case):
    cfg, graphdef, params, batch, torch_model, x, y = case
    policy = MemoryPolicy(name="first_two", layers=LayerSelection(first=2))
    _, base_t, f0, _ = torch_run(torch_model, x, y, POLICIES["none"])
    _, grads_t, f2, _ = torch_run(torch_model, x, y, policy)
    _, _, f_full, _ = torch_run(torch_model, x, y, POLICIES["full"])
    assert_grads(grads_t, base_t, "remat_vs_none")
    per_layer = (f_full - f0) // cfg.n_layers
    assert f2 - f0 == 2 * per_layer
    _, grads_j, f = jax_run(cfg, graphdef, params, batch, policy)
    assert_grads(grads_j, grads_t, "grads")
    assert grad_matmul_flops(f, params, batch) - f0 == 2 * per_layer


def test_save_on_cpu_and_offload_checkpoint_give_the_same_gradients(case):
    cfg, graphdef, params, batch, torch_model, x, y = case
    _, base, f0, _ = torch_run(torch_model, x, y, POLICIES["none"])
    reentrant = POLICIES["full"].replace(use_reentrant=True)
    _, _, f_reentrant, _ = torch_run(torch_model, x, y, reentrant)
    everything = LayerSelection()
    _, grads, flops, _ = torch_run(
        torch_model, x, y, save_on_cpu_layers_fn(everything, cfg.n_layers)
    )
    assert_grads(grads, base, "remat_vs_none")
    assert flops == f0  # offload instead of recompute
    _, grads, flops, _ = torch_run(
        torch_model, x, y, offload_checkpoint_layers_fn(everything, cfg.n_layers)
    )
    assert_grads(grads, base, "remat_vs_none")
    assert flops == f_reentrant  # replays each whole block once, like reentrant checkpoint
    assert all(np.abs(g).max() > 0 for g in grads.values())


def test_offload_checkpoint_keeps_only_its_input_in_host_memory():
    cfg = PRESETS["tiny"]
    block = torch_ref.Block(cfg)
    x = torch.randn(2, 8, cfg.d_model, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = OffloadCheckpoint.apply(block, x, None)
    assert [(tuple(t.shape), t.device.type) for t in saved] == [((2, 8, cfg.d_model), "cpu")]
    y.pow(2).mean().backward()
    grads = {k: p.grad.clone() for k, p in block.named_parameters()}
    x_grad = x.grad.clone()
    block.zero_grad()
    x.grad = None
    block(x, None).pow(2).mean().backward()
    tol = tolerance(F32, "remat_vs_none")
    np.testing.assert_allclose(x_grad.numpy(), x.grad.numpy(), rtol=tol.rtol, atol=tol.atol)
    for k, p in block.named_parameters():
        np.testing.assert_allclose(grads[k].numpy(), p.grad.numpy(), rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_block_op_table_matches_the_real_op_stream(cfg_name):
    """Each tagged op of ``block_ops`` produces a tensor of the JAX tag's size."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = CONFIGS[cfg_name]
    b, s = 2, 8
    sizes = {
        "query_proj": 3 * b * s * cfg.d_model,  # fused q, k, v
        "attn_scores": b * cfg.n_heads * s * s,
        "attn_probs": b * cfg.n_heads * s * s,
        "mlp_up": b * s * cfg.d_ff,
        "mlp_act": b * s * cfg.d_ff,
    }

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = out if isinstance(out, torch.Tensor) else out[0]
            self.ops.append((func, first.numel()))
            return out

    block = torch_ref.Block(cfg)
    mask = torch.ones(s, s, dtype=torch.bool).tril() if cfg.causal else None
    with Record() as rec:
        block(torch.randn(b, s, cfg.d_model), mask)
    from torch_ref.remat import _op_kind

    counts: dict[str, int] = {}
    found = {}
    for func, numel in rec.ops:
        kind = _op_kind(func)
        key = (kind, counts.get(kind, 0))
        counts[kind] = key[1] + 1
        if key in block_ops(cfg):
            found[block_ops(cfg)[key][0]] = numel
    assert set(found) == {names[0] for names in block_ops(cfg).values()}
    for name, numel in found.items():
        assert numel == sizes.get(name, b * s * cfg.d_model), name


def test_torch_translation_rejects_what_it_cannot_express():
    with pytest.raises(ConfigError, match="one fused matmul"):
        validate_for_torch(MemoryPolicy.custom({"query_proj": "device", "key_proj": "offload"}))
    with pytest.raises(ConfigError, match="needs use_reentrant=False"):
        validate_for_torch(POLICIES["selective"].replace(use_reentrant=True))
    with pytest.raises(ConfigError, match="block_input"):
        validate_for_torch(MemoryPolicy.custom({"block_input": "offload"}))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_seed_example_runs_under_every_policy_in_both_frameworks(name):
    policy = POLICIES[name]
    data = jax_seed.seed_data(batch=2, seq_len=16)
    stack = torch_ref.BlockStack(jax_seed.SEED_CONFIG)
    state = {k: v.detach().clone() for k, v in stack.state_dict().items()}
    losses_t = torch_seed.train(2, data=data, state_dict=state, policy=policy)
    losses_j = jax_seed.train(
        2, data=data, torch_state_dict={k: v.numpy() for k, v in state.items()}, policy=policy
    )
    tol = tolerance(F32, "adamw_loss")
    np.testing.assert_allclose(losses_j, losses_t, rtol=tol.rtol, atol=tol.atol)


def test_torch_offload_moves_exactly_the_offloaded_bytes_to_host(case):
    """Against the same names kept on device, offload lowers device bytes and raises host bytes
    by exactly the offloaded tensors' bytes, as in jaxmem (tests/test_remat.py)."""
    from torch_ref.memory import forward_live_bytes

    cfg, graphdef, params, batch, torch_model, x, y = case
    offload = POLICIES["offload"]
    on_device = MemoryPolicy(name="on_device", save=offload.save + offload.offload)
    measured = {}
    for policy in (offload, on_device):
        runner = apply_memory_policy(torch_model.blocks, policy)

        def forward():
            loss_sum, n = cross_entropy_sum(torch_model(x), y)
            return loss_sum / n

        loss, live = forward_live_bytes(
            forward,
            host_storages=runner.host_storages,
        )
        loss.backward()
        measured[policy.name] = (live, sum(k.nbytes for k in runner.kept if k.memory == "host"))
    (off, offloaded_bytes), (dev, _) = measured["offload"], measured["on_device"]
    assert offloaded_bytes > 0 and off.host_bytes == offloaded_bytes and dev.host_bytes == 0
    assert dev.device_bytes - off.device_bytes == offloaded_bytes

"""Precision, accumulation and optimizers, in both frameworks.

For every memory policy × {fp32, bf16} × {no accumulation, accumulation}: the loss and every
gradient equal the same framework's no-remat, no-accumulation run (fp32: tight) and the other
framework's (tolerance table). Accumulation over microbatches with unequal valid-token counts
equals one big batch; fp16 loss scaling follows GradScaler; optimizers agree step by step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import torch_ref
from jaxmem.compare.parity import torch_model_from
from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from jaxmem.compare.weights import load_torch_state_dict, to_torch_state_dict
from jaxmem.config import PRESETS, AccumConfig, ConfigError, OptimizerConfig
from jaxmem.model import make_model
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS, Precision
from jaxmem.step.scaling import DynamicLossScale, init_loss_scale
from jaxmem.step.train_step import (
    lm_loss_fn,
    make_multisteps_step,
    make_optimizer,
    make_train_step,
    place,
    tree_bytes,
)
from parity_tests.helpers import (
    jax_grads,
    masked_batch,
    normwise_error,
    reference_model,
    torch_batch,
    torch_grads,
)
from torch_ref.train import HybridDeviceOptimizer, make_scaler, train_step
from torch_ref.train import make_optimizer as make_torch_optimizer

CFG = PRESETS["tiny"].replace(n_layers=3)
BATCH, SEQ = 4, 32
# The matrix runs on GPT-2 blocks and on Llama blocks (RMSNorm, RoPE, SwiGLU, grouped-query
# attention): every policy in both precisions, accumulation on both.
MATRIX_CONFIGS = {"gpt2": CFG, "llama": PRESETS["tiny-llama"].replace(n_layers=3)}


@functools.cache
def reference_of(name: str):
    return reference_model(MATRIX_CONFIGS[name])


@functools.cache
def batch_of(name: str):
    return masked_batch(MATRIX_CONFIGS[name], BATCH, SEQ, seed=7)


@functools.cache
def baselines_of(name: str):
    """fp32, no remat, no accumulation: the reference gradients of each framework."""
    kw = dict(policy=POLICIES["none"], precision=PRECISIONS["fp32"], accum_steps=1)
    ref, b = reference_of(name), batch_of(name)
    return {"jax": jax_grads(ref, b, **kw), "torch": torch_grads(ref, b, **kw)}


@functools.cache
def bf16_no_remat(name: str, accum: int):
    """jaxmem's bf16 gradients without remat, once per configuration and accumulation count."""
    kw = dict(policy=POLICIES["none"], precision=PRECISIONS["bf16"], accum_steps=accum)
    return jax_grads(reference_of(name), batch_of(name), **kw)


@pytest.fixture(scope="module")
def reference():
    return reference_of("gpt2")


@pytest.fixture(scope="module")
def batch():
    return batch_of("gpt2")


@pytest.fixture(scope="module")
def baselines():
    return baselines_of("gpt2")


def assert_close_dicts(actual, expected, tol):
    diff = compare_state_dicts(actual, expected, tol)
    assert diff.passed, f"{diff.failures} (max abs {diff.max_abs:.3e})"


# Every policy × precision without accumulation; with two microbatches, every structure a scan
# over microbatches could interact with: none, full remat, a named keep (mlp is selective's
# structure with other names), host offload and the two-level nested scan (on Llama blocks: a
# named keep, the structure their new tags enter).
ACCUMULATED = {
    "gpt2": ("none", "full", "selective", "offload", "nested"),
    "llama": ("selective",),
}
# The presets with their block inputs in host memory run full's and nested's program (the
# host memory space aside: tests/test_offloaded_inputs.py proves the gradients bitwise equal):
# one row each, on GPT-2 blocks in bf16.
HOST_INPUTS = ("full-host", "nested-host")
MATRIX = [
    (cfg, policy, precision, accum)
    for cfg in sorted(MATRIX_CONFIGS)
    for policy in sorted(POLICIES)
    for precision in ("fp32", "bf16")
    for accum in (1, 2)
    if accum == 1 or policy in ACCUMULATED[cfg]
    if policy not in HOST_INPUTS or (cfg, precision, accum) == ("gpt2", "bf16", 1)
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cfg", "policy", "precision", "accum"),
    MATRIX,
    ids=[f"{c}-{p}-{d}-{'accum2' if a == 2 else 'no_accum'}" for c, p, d, a in MATRIX],
)
def test_policy_precision_accumulation_matrix(cfg, policy, precision, accum):
    reference, batch = reference_of(cfg), batch_of(cfg)
    prec = PRECISIONS[precision]
    kw = dict(policy=POLICIES[policy], precision=prec, accum_steps=accum)
    loss_j, grads_j = jax_grads(reference, batch, **kw)
    loss_t, grads_t = torch_grads(reference, batch, **kw)
    (base_loss_j, base_j), (base_loss_t, base_t) = (
        baselines_of(cfg)["jax"],
        baselines_of(cfg)["torch"],
    )
    if precision == "fp32":
        same = tolerance("float32", "accum_vs_big_batch")
        np.testing.assert_allclose(loss_j, base_loss_j, rtol=same.rtol, atol=same.atol)
        np.testing.assert_allclose(loss_t, base_loss_t, rtol=same.rtol, atol=same.atol)
        assert_close_dicts(grads_j, base_j, same)
        assert_close_dicts(grads_t, base_t, same)
        cross = tolerance("float32", "grads")
        assert_close_dicts(grads_j, grads_t, cross)
        np.testing.assert_allclose(loss_j, loss_t, **tolerance("float32", "loss").kwargs())
        return
    # bf16: each framework's error against its own fp32 reference must be of the same size.
    loss_tol = tolerance("bfloat16", "loss")
    np.testing.assert_allclose(loss_j, loss_t, rtol=loss_tol.rtol, atol=loss_tol.atol)
    err_j, err_t = normwise_error(grads_j, base_j), normwise_error(grads_t, base_t)
    ratio = tolerance("bfloat16", "grad_error_ratio")
    assert max(err_j, err_t) <= (1 + ratio.rtol) * min(err_j, err_t) + ratio.atol, (err_j, err_t)
    # And remat changes nothing beyond bf16 rounding order within a framework.
    _, grads_j0 = bf16_no_remat(cfg, accum)
    assert normwise_error(grads_j, grads_j0) <= tolerance("bfloat16", "remat_vs_none").rtol


def test_mean_of_means_is_wrong_here(reference, batch, baselines):
    """The batch really has unequal token counts per microbatch: averaging per-microbatch means
    (the seeds' loop) gives a different gradient than the big batch, so the matrix above would
    catch that bug."""
    halves = [{k: v[i * 2 : (i + 1) * 2] for k, v in batch.items()} for i in range(2)]
    kw = dict(policy=POLICIES["none"], precision=PRECISIONS["fp32"], accum_steps=1)
    parts = [jax_grads(reference, h, **kw)[1] for h in halves]
    mean_of_means = {k: (parts[0][k] + parts[1][k]) / 2 for k in parts[0]}
    assert not compare_state_dicts(
        mean_of_means, baselines["jax"][1], tolerance("float32", "accum_vs_big_batch")
    ).passed


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["scan", "multisteps"])
def test_accumulated_training_equals_big_batch_training(reference, mode):
    """Three optimizer steps with 4 microbatches equal three steps on the whole batch, in JAX
    (scan or optax.MultiSteps) and in torch_ref. SGD with momentum: its update is linear in the
    gradient, so it passes accumulation differences through unamplified (Adam's first step is
    sign(g), which turns rounding noise in ~0 gradients into ±lr)."""
    opt_cfg = OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.1)
    batches = [masked_batch(CFG, 8, 16, seed=20 + i) for i in range(3)]

    def run_jax(k, mode):
        model = make_model(CFG)
        load_torch_state_dict(model, to_torch_state_dict(reference))
        graphdef, params = nnx.split(model, nnx.Param)
        loss = lm_loss_fn(graphdef)
        tx = make_optimizer(opt_cfg)
        if mode == "scan" or k == 1:
            step = make_train_step(loss, tx, accum=AccumConfig(steps=k))
            opt_state = tx.init(params)
            for b in batches:
                jb = {key: jnp.asarray(v) for key, v in b.items()}
                params, opt_state, _, _ = step(params, opt_state, None, jb)
        else:
            multi, micro_step = make_multisteps_step(loss, tx, k)
            opt_state = multi.init(params)
            for b in batches:
                n_total = jnp.asarray(b["mask"].sum())
                for i in range(k):
                    m = {key: jnp.asarray(v[i * 2 : (i + 1) * 2]) for key, v in b.items()}
                    params, opt_state, _ = micro_step(params, opt_state, m, n_total)
        return to_torch_state_dict(nnx.merge(graphdef, params))

    def run_torch(k):
        model = torch_model_from(reference)
        opt = make_torch_optimizer(model, opt_cfg)
        for b in batches:
            tb = torch_batch(b)
            train_step(model, opt, tb, precision=PRECISIONS["fp32"], accum_steps=k)
        return {key: v.detach().numpy() for key, v in model.state_dict().items()}

    tol = tolerance("float32", "accum_training")
    big = run_jax(1, "scan")
    assert_close_dicts(run_jax(4, mode), big, tol)
    torch_big = run_torch(1)
    assert_close_dicts(run_torch(4), torch_big, tol)
    assert_close_dicts(big, torch_big, tolerance("float32", "sgd_weights"))


def test_accumulation_rejects_an_indivisible_batch():
    with pytest.raises(ConfigError, match="batch size 6 is not divisible by accum steps 4"):
        AccumConfig(steps=4).check_batch(6)


def test_dynamic_loss_scale_follows_grad_scaler():
    """Same finite/overflow pattern → same scale trajectory as torch.amp.GradScaler."""
    pattern = [True, True, True, False, True, True, True, True, False, False, True]
    ours = DynamicLossScale.create(init_scale=2.0**16, growth_interval=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    for finite in pattern:
        opt.zero_grad()
        loss = scaler.scale(param.sum() * (1.0 if finite else float("inf")))
        loss.backward()
        scaler.step(opt)
        scaler.update()
        ours = ours.update(jnp.asarray(finite))
        assert float(ours.scale) == scaler.get_scale()
    assert float(ours.scale) != 2.0**16  # it moved both ways


@pytest.mark.slow
def test_fp16_overflow_steps_are_skipped_and_training_recovers():
    """Start from an absurd loss scale: fp16 gradients overflow, those steps leave the weights
    untouched and halve the scale, then training proceeds (JAX and torch skip alike)."""
    prec = PRECISIONS["fp16"]
    model = make_model(CFG, prec)
    graphdef, params = nnx.split(model, nnx.Param)
    before = to_torch_state_dict(nnx.merge(graphdef, params))
    tx = make_optimizer(OptimizerConfig(lr=1e-3))
    opt_state = tx.init(params)
    step = make_train_step(lm_loss_fn(graphdef), tx, precision=prec)
    scale = DynamicLossScale.create(init_scale=2.0**40)
    b = masked_batch(CFG, BATCH, SEQ, seed=3)
    jb = {k: jnp.asarray(v) for k, v in b.items()}
    params, opt_state, scale, metrics = step(params, opt_state, scale, jb)
    assert not bool(metrics["grads_finite"])
    assert float(scale.scale) == 2.0**39
    after = to_torch_state_dict(nnx.merge(graphdef, params))
    for key in before:
        np.testing.assert_array_equal(after[key], before[key])
    skipped = 1
    for _ in range(30):
        params, opt_state, scale, metrics = step(params, opt_state, scale, jb)
        skipped += not bool(metrics["grads_finite"])
        if bool(metrics["grads_finite"]):
            break
    assert bool(metrics["grads_finite"]) and skipped > 1

    torch_model = torch_ref.Decoder(CFG)
    torch_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in before.items()})
    opt = make_torch_optimizer(torch_model, OptimizerConfig(lr=1e-3))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    tb = torch_batch(b)
    torch_skipped = 0
    for _ in range(31):
        old = scaler.get_scale()
        train_step(torch_model, opt, tb, precision=prec, scaler=scaler)
        torch_skipped += scaler.get_scale() < old
        if scaler.get_scale() >= old:
            break
    assert torch_skipped == skipped
    assert make_scaler(prec).get_scale() == 2.0**16 == float(init_loss_scale(prec).scale)


@pytest.mark.parametrize("name", sorted(MATRIX_CONFIGS))
def test_bf16_logits_kl_on_a_long_sequence(name):
    """bf16 logits on 256-token sequences: the two frameworks' next-token distributions agree
    (Llama blocks: RoPE at positions up to 255, the gated product rounded once in jaxmem and
    after each of silu and the product in PyTorch)."""
    cfg = MATRIX_CONFIGS[name].replace(max_seq_len=256)
    ref = reference_model(cfg, seed=1)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 256)).astype(np.int32)
    prec = PRECISIONS["bf16"]
    model = make_model(cfg, prec)
    load_torch_state_dict(model, to_torch_state_dict(ref))
    logits_j = np.asarray(model(jnp.asarray(tokens)))
    torch_model = torch_model_from(ref)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits_t = torch_model(torch.from_numpy(tokens).long()).float().numpy()
    logp_j = jax.nn.log_softmax(logits_j, -1)
    logp_t = jax.nn.log_softmax(logits_t, -1)
    kl = float(jnp.mean(jnp.sum(jnp.exp(logp_t) * (logp_t - logp_j), -1)))
    assert 0 <= kl <= tolerance("bfloat16", "logits_kl").atol, kl
    assert np.abs(logits_j - logits_t).max() > 0  # really computed in bf16 (not identical)


def _train_both(opt_cfg, steps=10):
    ref = reference_model(CFG)
    model = make_model(CFG)
    load_torch_state_dict(model, to_torch_state_dict(ref))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(opt_cfg)
    opt_state = tx.init(params)
    step = make_train_step(lm_loss_fn(graphdef), tx, opt_cfg=opt_cfg)
    if opt_cfg.state_memory != "device":
        opt_state = place(opt_state, opt_cfg.state_memory)
    if opt_cfg.params_memory != "device":
        params = place(params, opt_cfg.params_memory)
    torch_model = torch_model_from(ref)
    opt = make_torch_optimizer(torch_model, opt_cfg)
    for i in range(steps):
        b = masked_batch(CFG, BATCH, SEQ, seed=100 + i)
        params, opt_state, _, _ = step(
            params, opt_state, None, {k: jnp.asarray(v) for k, v in b.items()}
        )
        tb = torch_batch(b)
        train_step(torch_model, opt, tb, precision=PRECISIONS["fp32"])
    final_j = to_torch_state_dict(nnx.merge(graphdef, params))
    final_t = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
    return final_j, final_t, opt_state, tx, params


def test_sgd_momentum_matches_torch():
    final_j, final_t, *_ = _train_both(OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.01))
    assert_close_dicts(final_j, final_t, tolerance("float32", "sgd_weights"))


@pytest.mark.slow
def test_adafactor_trains_with_factored_state():
    cfg = OptimizerConfig(name="adafactor", lr=1e-2, weight_decay=0.0)
    # optax factors matrices whose dims are both >= 128: use d_model 128 so every one is.
    model = make_model(CFG.replace(d_model=128, d_ff=512))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(cfg)
    opt_state = tx.init(params)
    adam_state = make_optimizer(OptimizerConfig()).init(params)
    assert tree_bytes(opt_state) < 0.1 * tree_bytes(adam_state)
    step = make_train_step(lm_loss_fn(graphdef), tx)
    b = {k: jnp.asarray(v) for k, v in masked_batch(CFG, BATCH, SEQ, seed=1).items()}
    losses = []  # the same batch 8 times: the loss must fall
    for _ in range(8):
        params, opt_state, _, m = step(params, opt_state, None, b)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0]
    torch_model = torch_ref.Decoder(CFG)
    opt = make_torch_optimizer(torch_model, cfg)
    assert isinstance(opt, torch.optim.Adafactor)


@pytest.mark.slow
def test_optimizer_state_in_host_memory_gives_the_same_weights():
    device_cfg = OptimizerConfig(lr=1e-3)
    host_cfg = OptimizerConfig(lr=1e-3, state_memory="pinned_host")
    final_dev, _, _, _, _ = _train_both(device_cfg, steps=4)
    final_host, _, opt_state, tx, params = _train_both(host_cfg, steps=4)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(opt_state)}
    assert kinds == {"pinned_host"}
    for key in final_dev:
        np.testing.assert_array_equal(final_host[key], final_dev[key])
    # The GPU program moves the state to the device for the update and back to host after.
    model = make_model(CFG)
    graphdef, p = nnx.split(model, nnx.Param)
    state = place(tx.init(p), "pinned_host")
    step = make_train_step(lm_loss_fn(graphdef), tx, opt_cfg=host_cfg)
    b = {k: jnp.asarray(v) for k, v in masked_batch(CFG, BATCH, SEQ, seed=1).items()}
    text = step.trace(p, state, None, b).lower(lowering_platforms=("cuda",)).as_text()
    assert 'mhlo.memory_kind = "pinned_host"' in text
    assert sum(
        '"pinned_host"' in line and "annotate_device_placement" in line
        for line in text.splitlines()
    ) >= len(jax.tree_util.tree_leaves(state))


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_hybrid_device_optimizer_matches_the_plain_one(fraction):
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1)
    ref = reference_model(CFG)
    plain, hybrid = torch_model_from(ref), torch_model_from(ref)
    opt_plain = make_torch_optimizer(plain, cfg)
    opt_hybrid = HybridDeviceOptimizer(hybrid.parameters(), cfg, offload_fraction=fraction)
    total = sum(p.numel() for p in hybrid.parameters())
    assert opt_hybrid.offloaded_numel <= fraction * total
    if fraction == 1.0:
        assert opt_hybrid.offloaded_numel == total and opt_hybrid.device is None
    for i in range(5):
        b = masked_batch(CFG, BATCH, SEQ, seed=200 + i)
        tb = torch_batch(b)
        train_step(plain, opt_plain, tb, precision=PRECISIONS["fp32"])
        train_step(hybrid, opt_hybrid, tb, precision=PRECISIONS["fp32"])
    for (k, a), (_, b_) in zip(
        plain.state_dict().items(), hybrid.state_dict().items(), strict=True
    ):
        tol = tolerance("float32", "remat_vs_none")
        np.testing.assert_allclose(b_.numpy(), a.numpy(), rtol=tol.rtol, atol=tol.atol, err_msg=k)
    assert all(t.device.type == "cpu" for t in opt_hybrid.state_tensors())


def test_precision_validation():
    with pytest.raises(ConfigError, match="compute_dtype='float16' needs loss_scale='dynamic'"):
        Precision(name="x", compute_dtype="float16")
    with pytest.raises(ConfigError, match="param_dtype='float16'"):
        Precision(name="x", param_dtype="float16", compute_dtype="float16", loss_scale="dynamic")
    with pytest.raises(ConfigError, match="logits and loss are always float32"):
        Precision(name="x", output_dtype="bfloat16")
    from jaxmem.precision import get_precision

    with pytest.raises(ConfigError, match="unknown precision 'fp8'; choose one of: fp32"):
        get_precision("fp8")


def test_pure_bf16_stores_half_the_parameter_bytes():
    mixed = nnx.state(make_model(CFG, PRECISIONS["bf16"]), nnx.Param)
    pure = nnx.state(make_model(CFG, PRECISIONS["pure-bf16"]), nnx.Param)
    assert tree_bytes(pure) * 2 == tree_bytes(mixed)
    assert optax is not None


@pytest.mark.slow
def test_parameters_and_state_in_host_memory_give_the_same_weights():
    final_dev, *_ = _train_both(OptimizerConfig(lr=1e-3), steps=3)
    host = OptimizerConfig(lr=1e-3, state_memory="pinned_host", params_memory="pinned_host")
    final_host, _, opt_state, _, params = _train_both(host, steps=3)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves((params, opt_state))}
    assert kinds == {"pinned_host"}
    for key in final_dev:
        np.testing.assert_array_equal(final_host[key], final_dev[key])

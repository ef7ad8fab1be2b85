"""Fused attention (``jaxmem.model.flash``) against the naive form: the same function (float64),
the same dtype behaviour (float32, bfloat16), in the op alone and in the whole decoder; what it
keeps for the backward (no [B, H, S, S] tensor) and how policies name it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from jaxmem.config import PRESETS, ConfigError
from jaxmem.data import lm_batch
from jaxmem.job import JobConfig
from jaxmem.memory import analytic
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.memory.remat import layers_fn
from jaxmem.memory.residuals import bytes_by_name, saved_residuals
from jaxmem.model import Decoder
from jaxmem.model.flash import flash_attention
from jaxmem.policy import (
    POLICIES,
    BlockPolicy,
    MemoryPolicy,
    backward_reads,
    check_policy,
    model_tags,
)
from jaxmem.precision import PRECISIONS
from jaxmem.step.train_step import lm_loss_fn

# (sequence, key block): an odd sequence in four blocks, the last mostly padding; and one block
SHAPES = [(13, 4), (16, 128)]


def naive_attention(q, k, v, causal):
    """The decoder's naive core on its own (``SelfAttention.__call__``), heads merged."""
    b, s, h, d = q.shape
    acc = jnp.promote_types(q.dtype, jnp.float32)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=acc) / math.sqrt(d)
    if causal:
        scores = scores + jnp.where(jnp.tril(jnp.ones((s, s), bool)), 0.0, jnp.finfo(acc).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v).reshape(b, s, h * d)


def outputs_and_grads(attention, q, k, v, w):
    """The output and the gradients of q, k, v for a fixed random cotangent ``w``."""

    @jax.jit
    def run(q, k, v, w):
        def f(q, k, v):
            return jnp.sum(attention(q, k, v).astype(w.dtype) * w)

        dq, dk, dv = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
        return {"out": attention(q, k, v), "dq": dq, "dk": dk, "dv": dv}

    return run(q, k, v, w)


def qkvw(dtype, s, b=2, h=3, d=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), dtype) for kk in keys[:3])
    w = jax.random.normal(keys[3], (b, s, h * d), jnp.promote_types(dtype, jnp.float32))
    return q, k, v, w


def as_numpy(tree):
    return {
        key: np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)
        for key, x in tree.items()
    }


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("s,block", SHAPES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_op_equals_naive(dtype, s, block, causal):
    with jax.enable_x64(dtype == "float64"):
        q, k, v, w = qkvw(jnp.dtype(dtype), s)
        fused = outputs_and_grads(lambda *a: flash_attention(*a, causal, block), q, k, v, w)
        naive = outputs_and_grads(lambda *a: naive_attention(*a, causal), q, k, v, w)
        diff = compare_state_dicts(
            as_numpy(fused), as_numpy(naive), tolerance(dtype, "fused_vs_naive")
        )
    assert diff.passed, diff


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("s,block", SHAPES[:1])
def test_fused_op_in_bf16_errs_like_naive(s, block, causal):
    """bf16: each form's error against the float64 result, of the same size."""
    with jax.enable_x64(True):
        q, k, v, w = qkvw(jnp.bfloat16, s)

        def naive_fn(*a):
            return naive_attention(*a, causal)

        wide = (x.astype(jnp.float64) for x in (q, k, v, w))
        exact = as_numpy(outputs_and_grads(naive_fn, *wide))
        fused = as_numpy(
            outputs_and_grads(lambda *a: flash_attention(*a, causal, block), q, k, v, w)
        )
        naive = as_numpy(outputs_and_grads(naive_fn, q, k, v, w))
    tol = tolerance("bfloat16", "fused_vs_naive_error")
    for key in exact:
        scale = np.abs(exact[key]).max()
        err_fused = np.abs(fused[key] - exact[key]).max() / scale
        err_naive = np.abs(naive[key] - exact[key]).max() / scale
        assert err_fused <= err_naive * (1 + tol.rtol) + tol.atol, (key, err_fused, err_naive)


# ------------------------------------------------------------------------------- the decoder
CFG = PRESETS["tiny"].replace(n_layers=2, attention_block=8)


def model_loss_and_grads(cfg, dtype, policy=POLICIES["none"], seq_len=13):
    model = Decoder(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype))
    graphdef, params = nnx.split(model, nnx.Param)
    inputs, targets = lm_batch(cfg, 3, seq_len, seed=1)
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
    (value, _), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, batch)
    flat = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(grads)}
    return float(value), flat


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_decoder_equals_naive(dtype, causal):
    """Same weights (attention adds none), loss and every gradient, odd sequence of two blocks."""
    with jax.enable_x64(dtype == "float64"):
        cfg = CFG.replace(causal=causal)
        loss_f, grads_f = model_loss_and_grads(cfg.replace(attention="fused"), dtype)
        loss_n, grads_n = model_loss_and_grads(cfg, dtype)
    tol = tolerance(dtype, "fused_vs_naive")
    np.testing.assert_allclose(loss_f, loss_n, rtol=tol.rtol, atol=tol.atol)
    diff = compare_state_dicts(grads_f, grads_n, tol)
    assert diff.passed, diff


@pytest.mark.slow
@pytest.mark.parametrize("name", ["selective", "offload"])
def test_policies_under_fused_attention_equal_no_remat(name):
    """Recomputing the fused op (selective) and offloading around it; every preset, in float64
    and against PyTorch: parity_tests/test_policies.py (its fused configuration)."""
    cfg = CFG.replace(attention="fused")
    loss, grads = model_loss_and_grads(cfg, "float32", POLICIES[name])
    base_loss, base_grads = model_loss_and_grads(cfg, "float32")
    tol = tolerance("float32", "remat_vs_none")
    np.testing.assert_allclose(loss, base_loss, rtol=tol.rtol, atol=tol.atol)
    diff = compare_state_dicts(grads, base_grads, tol)
    assert diff.passed, diff


def kept(cfg, policy, seq_len=32):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    inputs, targets = lm_batch(cfg, 2, seq_len, seed=1)
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
    return saved_residuals(lambda p, b: loss(p, b)[0], params, batch)


def test_fused_attention_keeps_no_seq_by_seq_tensor():
    """Naive attention keeps [L, B, H, S, S] probabilities; the fused op keeps its output and a
    [L, B, H, S] log-sum-exp, and nothing has two sequence axes."""
    s, b = 32, 2
    cfg = CFG.replace(attention="fused")
    fused = kept(cfg, POLICIES["none"])
    naive = kept(CFG, POLICIES["none"])
    square = [r for r in naive if r.origin == "computed" and r.shape[-2:] == (s, s)]
    assert square and all(r.name == "attn_probs" for r in square)
    assert not [r for r in fused if len(r.shape) >= 2 and r.shape[-2:] == (s, s)]
    lse = [r for r in fused if r.name == "attn_lse"]
    assert [r.shape for r in lse] == [(cfg.n_layers, b, cfg.n_heads, s)]
    assert {np.dtype(r.dtype) for r in lse} == {np.dtype("float32")}
    names = {r.name for r in fused if r.origin == "computed"}
    assert {"attn_context", "attn_lse"} <= names
    assert sum(r.nbytes for r in fused) < sum(r.nbytes for r in naive)


def test_fused_attention_backward_reads_what_jax_keeps():
    """With every tag stored, what JAX keeps is ``backward_reads`` (the policy vocabulary)."""
    cfg = CFG.replace(attention="fused")
    everything = MemoryPolicy.of(BlockPolicy(save=model_tags(cfg)), name="all")
    seen = {r.name for r in kept(cfg, everything) if r.origin == "computed" and r.name}
    seen -= {"<layer input>", "<stack output>"}
    assert seen == set(backward_reads(cfg))


def test_selective_under_fused_recomputes_the_fused_forward():
    """``selective`` recomputes the core: under fused, that is the fused op's forward, so it
    keeps neither the context nor the log-sum-exp and costs one attention forward more."""
    cfg = CFG.replace(attention="fused")
    names = {r.name for r in kept(cfg, POLICIES["selective"]) if r.origin == "computed"}
    assert not names & {"attn_context", "attn_lse"}
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    inputs, targets = lm_batch(cfg, 2, 32, seed=1)
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    flops = {}
    for name in ("none", "selective"):
        loss = lm_loss_fn(graphdef, layers_fn=layers_fn(POLICIES[name], cfg.n_layers))
        flops[name] = grad_matmul_flops(lambda p, b, loss=loss: loss(p, b)[0], params, batch)
    b, s, h, d = 2, 32, cfg.n_heads, cfg.head_dim
    attention_forward = 2 * (2 * b * h * s * s * d)  # q·kᵀ and p·v, every block computed
    assert flops["selective"] - flops["none"] == cfg.n_layers * attention_forward


def test_policies_naming_tags_the_attention_does_not_produce_are_refused():
    fused = CFG.replace(attention="fused")
    bad = MemoryPolicy.custom({"attn_probs": "device", "mlp_up": "device"})
    with pytest.raises(ConfigError, match=r"saves \['attn_probs'\], which this model does not"):
        check_policy(fused, bad)
    with pytest.raises(ConfigError, match="attn_lse exists only with attention='fused'"):
        check_policy(CFG, MemoryPolicy.custom({"attn_lse": "offload"}))
    for name in POLICIES:  # presets are written for both forms
        check_policy(fused, POLICIES[name])
        check_policy(CFG, POLICIES[name])
    raw = {"preset": "tiny", "model": {"attention": "fused"}}
    raw["memory"] = {"policy": "custom", "save": ["attn_scores"]}
    with pytest.raises(ConfigError, match="attn_scores"):
        JobConfig.from_dict(raw)
    with pytest.raises(ConfigError, match=r"attention='flash' is not one of \('naive', 'fused'\)"):
        CFG.replace(attention="flash")


# ------------------------------------------------------------------------- the analytic model
@pytest.mark.parametrize("name", ["none", "full", "selective", "offload", "nested"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_analytic_model_of_fused_attention_equals_jax_residuals(name, precision):
    cfg, prec, b, s = CFG.replace(n_layers=4, attention="fused"), PRECISIONS[precision], 2, 32
    dt = jnp.dtype(prec.compute_dtype)
    model = Decoder(cfg, rngs=nnx.Rngs(0), dtype=dt, param_dtype=jnp.dtype(prec.param_dtype))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.zeros((b, s), jnp.int32)
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(POLICIES[name], cfg.n_layers))
    measured = bytes_by_name(
        saved_residuals(lambda p, bt: loss(p, bt)[0], params, {"inputs": tokens, "targets": tokens})
    )
    stack = sum(v for k, v in measured.items() if k not in ("<untagged>", "<stack output>"))
    estimate = analytic.saved_activation_bytes(cfg, POLICIES[name], b, s, prec)
    assert stack == estimate.device_bytes + estimate.host_bytes
    if name == "none":  # sbh·16p + 4·a·s·b per layer
        per_layer = s * b * cfg.d_model * 16 * prec.compute_bytes + 4 * cfg.n_heads * s * b
        assert estimate.per_layer == (per_layer,) * cfg.n_layers
        assert grad_matmul_flops(
            lambda p, bt: loss(p, bt)[0], params, {"inputs": tokens, "targets": tokens}
        ) == analytic.model_flops(cfg, b, s)

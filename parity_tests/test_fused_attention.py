"""Fused attention across frameworks: jaxmem's blockwise op (``jaxmem.model.flash``) and
torch_ref's ``F.scaled_dot_product_attention`` compute the same logits, loss and gradients
(float64: every parity configuration, causal and bidirectional, odd sequences; fp32 where no ReLU
can flip), each equals its naive form, bf16 errs like naive, and both count the same FLOPs; with
grouped-query attention too (SDPA's ``enable_gqa``, jaxmem's grouped kernel)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch.utils.flop_counter import FlopCounterMode

import torch_ref
from jaxmem.compare.parity import dtype_context, model_in, run_parity, torch_model_from
from jaxmem.compare.parity import torch_loss_and_grads as parity_loss_and_grads
from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from jaxmem.config import PRESETS
from jaxmem.data import lm_batch
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.memory.remat import layers_fn
from jaxmem.model import make_model
from jaxmem.policy import POLICIES
from jaxmem.step.train_step import lm_loss_fn
from parity_tests.conftest import PARITY_CONFIGS
from torch_ref.loss import cross_entropy_sum

# float64 for every configuration, causal and bidirectional; fp32 for those without ReLU. Odd
# sequences (the odd configuration's 13; 31 for the others) in blocks of 8: the last block padded.
RUNS = [
    (name, causal, dtype)
    for name in sorted(PARITY_CONFIGS)
    for causal in (True, False)
    for dtype in ("float64", "float32")
    if dtype == "float64" or PARITY_CONFIGS[name][0].activation != "relu"
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,causal,dtype",
    RUNS,
    ids=[f"{n}-{'causal' if c else 'bidirectional'}-{d}" for n, c, d in RUNS],
)
def test_fused_attention_agrees_across_frameworks(name, causal, dtype):
    cfg, batch, seq_len = PARITY_CONFIGS[name]
    cfg = cfg.replace(attention="fused", attention_block=8, causal=causal)
    seq_len = seq_len if seq_len % 2 else seq_len - 1
    report = run_parity(cfg, batch=batch, seq_len=seq_len, dtype=dtype)
    assert report["passed"], report


CFG = PRESETS["tiny"].replace(n_layers=2)
# grouped-query attention: SDPA's enable_gqa against torch_ref's grouped einsums and jaxmem's
# grouped flash kernel
CFGS = {"gpt2": CFG, "llama_gqa": PRESETS["tiny-llama"]}


def torch_loss_and_grads(cfg, dtype, bf16_autocast=False, seq_len=31):
    """torch_ref's loss and gradients with jaxmem's seed-0 weights (the same for both attention
    forms), run in ``dtype`` (or fp32 weights under bf16 autocast); the parity helpers'."""
    with dtype_context(dtype):
        torch_model = torch_model_from(model_in(make_model(cfg), dtype))
    inputs, targets = lm_batch(cfg, 3, seq_len, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        loss, _, grads = parity_loss_and_grads(torch_model, inputs, targets)
    return loss, {k: v.astype(np.float64) for k, v in grads.items()}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", sorted(CFGS))
def test_torch_fused_equals_torch_naive(name, causal):
    cfg = CFGS[name].replace(causal=causal)
    for dtype in ("float64", "float32"):
        loss_f, grads_f = torch_loss_and_grads(cfg.replace(attention="fused"), dtype)
        loss_n, grads_n = torch_loss_and_grads(cfg, dtype)
        tol = tolerance(dtype, "fused_vs_naive")
        np.testing.assert_allclose(loss_f, loss_n, rtol=tol.rtol, atol=tol.atol)
        diff = compare_state_dicts(grads_f, grads_n, tol)
        assert diff.passed, (dtype, diff)


@pytest.mark.parametrize("name", sorted(CFGS))
def test_torch_fused_in_bf16_errs_like_naive(name):
    """bf16 autocast: each form's gradients against the float64 ones, of the same size."""
    cfg = CFGS[name]
    exact = torch_loss_and_grads(cfg, "float64")[1]
    errors = {}
    for attention in ("naive", "fused"):
        grads = torch_loss_and_grads(cfg.replace(attention=attention), "float32", True)[1]
        errors[attention] = max(
            np.abs(grads[k] - exact[k]).max() / np.abs(exact[k]).max() for k in exact
        )
    tol = tolerance("bfloat16", "fused_vs_naive_error")
    assert errors["fused"] <= errors["naive"] * (1 + tol.rtol) + tol.atol, errors


@pytest.mark.parametrize("name", sorted(CFGS))
def test_fused_attention_flops_equal_across_frameworks_and_exceed_naive_by_one_matmul(name):
    """Both frameworks execute the same matmul FLOPs under fused attention: naive's plus one
    q·kᵀ per layer (the backward recomputes the scores) — counted from JAX's gradient jaxpr and
    by FlopCounterMode (with torch_ref.flops' formulas for the CPU kernels). Grouped-query
    attention scores every query head: the same core FLOPs as without grouping."""
    base = CFGS[name]
    b, s = 2, 32
    inputs, targets = lm_batch(base, b, s, seed=1)
    flops = {}
    for attention in ("naive", "fused"):
        cfg = base.replace(attention=attention, attention_block=8)
        model = make_model(cfg)
        graphdef, params = nnx.split(model, nnx.Param)
        batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
        loss = lm_loss_fn(graphdef, layers_fn=layers_fn(POLICIES["none"], cfg.n_layers))
        jax_flops = grad_matmul_flops(lambda p, bt, f=loss: f(p, bt)[0], params, batch)
        torch_model = torch_ref.Decoder(cfg)
        with FlopCounterMode(display=False) as counter:
            loss_sum, n = cross_entropy_sum(
                torch_model(torch.from_numpy(inputs).long()), torch.from_numpy(targets).long()
            )
            (loss_sum / n).backward()
        flops[attention] = (jax_flops, counter.get_total_flops())
    assert flops["fused"][0] == flops["fused"][1]
    assert flops["naive"][0] == flops["naive"][1]
    qk = 2 * b * s * s * base.d_model  # one q·kᵀ over every query head
    assert flops["fused"][0] - flops["naive"][0] == base.n_layers * qk

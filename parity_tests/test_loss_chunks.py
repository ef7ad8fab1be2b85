"""Loss chunks (``MemoryPolicy.loss``): the head and loss run over sequence chunks with
each chunk's gradients formed in the forward compute the whole loss's function and derivative,
in both frameworks: in float64 (exactness) jaxmem's chunked loss, torch_ref's chunked loss (an
extension) and both frameworks' whole loss give the same loss and every gradient leaf, on a
masked batch, for a tied LayerNorm head (GPT-2) and an untied RMSNorm one (Llama)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxmem.compare.parity import dtype_context, model_in, torch_model_from
from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from jaxmem.compare.weights import to_torch_state_dict
from jaxmem.model import Decoder
from jaxmem.policy import POLICIES, LossPolicy
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import lm_loss_fn
from parity_tests.conftest import PARITY_CONFIGS
from parity_tests.helpers import masked_batch, torch_batch
from torch_ref.remat import apply_loss_policy


def _jax(model, batch, chunks):
    import jax
    import jax.numpy as jnp

    graphdef, params = nnx.split(model, nnx.Param)
    loss = lm_loss_fn(graphdef, loss_chunks=chunks)
    data = {k: jnp.asarray(v) for k, v in batch.items()}
    (value, _), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, data)
    return float(value), to_torch_state_dict(nnx.merge(graphdef, grads))


def _torch(model, batch, chunks):
    apply_loss_policy(model, POLICIES["none"].replace(loss=LossPolicy(chunks)))
    model.zero_grad(set_to_none=True)
    b = torch_batch(batch)
    loss_sum, n = model(b["inputs"], b["targets"], b["mask"].double())
    (loss_sum / n).backward()
    return float(loss_sum / n), {k: p.grad.numpy() for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["pre_gelu_causal", "llama_gqa"])
def test_chunked_loss_in_both_frameworks_is_the_whole_loss_in_float64(name):
    cfg, batch_size, seq_len = PARITY_CONFIGS[name]
    batch = masked_batch(cfg, batch_size, seq_len, seed=3)
    with dtype_context("float64"):
        model = model_in(Decoder(cfg, rngs=nnx.Rngs(0)), "float64")
        runs = {f"jax-{c}": _jax(model, batch, c) for c in (0, 4)}
    torch_model = torch_model_from(model)
    runs |= {f"torch-{c}": _torch(torch_model, batch, c) for c in (0, 4)}
    loss_tol, grad_tol = tolerance("float64", "loss"), tolerance("float64", "grads")
    ref_loss, ref_grads = runs["jax-0"]
    for key, (loss, grads) in runs.items():
        np.testing.assert_allclose(loss, ref_loss, rtol=loss_tol.rtol, atol=loss_tol.atol)
        diff = compare_state_dicts(grads, ref_grads, grad_tol)
        assert diff.passed, (key, diff.failures)
    # every leaf carries signal, the head's and the final norm's included
    assert all(np.abs(g).max() > 1e-6 for g in ref_grads.values())


def test_both_frameworks_keep_the_same_loss_gradients_and_no_logits():
    """What the step keeps for its backward with the loss in chunks, by name: the stack output's
    and the head's gradients (``<loss gradients>``), the same bytes in both frameworks (JAX:
    residual accounting; torch_ref: live-tensor accounting), instead of the logits and the
    final norm's output: each framework's chunked step keeps its whole-loss step's bytes less
    the logits, plus the loss gradients, at most."""
    from jaxmem.compare.records import torch_record
    from jaxmem.config import PRESETS, OptimizerConfig
    from jaxmem.planner.records import jax_record
    from jaxmem.precision import PRECISIONS

    cfg, batch, seq = PRESETS["tiny"], 4, 32
    fp32, opt = PRECISIONS["fp32"], OptimizerConfig()
    logits = batch * seq * cfg.vocab_size * 4
    saved = {}
    for chunks in (0, 4):
        policy = POLICIES["full"].replace(loss=LossPolicy(chunks))
        saved[("jax", chunks)] = jax_record(
            StepSpec(
                model=cfg, policy=policy, precision=fp32, optimizer=opt, batch=batch, seq_len=seq
            ),
            abstract=True,
        )
        saved[("torch", chunks)] = torch_record(cfg, policy, fp32, opt, batch, seq, fake=True)
    loss_grads = {f: saved[(f, 4)]["saved_by_name"]["<loss gradients>"] for f in ("jax", "torch")}
    head_grad = cfg.vocab_size * cfg.d_model * 4  # the tied table's gradient
    assert loss_grads["jax"] == loss_grads["torch"] >= batch * seq * cfg.d_model * 4 + head_grad
    for f in ("jax", "torch"):
        whole, chunked = (saved[(f, c)]["saved_activation_bytes_device"] for c in (0, 4))
        assert chunked <= whole - logits + loss_grads[f], (f, whole, chunked)
        assert "<loss gradients>" not in saved[(f, 0)]["saved_by_name"]

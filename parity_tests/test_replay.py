"""Replaying the embedding lookup (``MemoryPolicy.replay_embedding``) and per-tag mixed stacks
(``mixed_policy`` of two ``MemoryPolicy.custom`` parts) in both frameworks: in float64 every
gradient leaf equals plain autodiff's (``none``), in JAX and in torch_ref (stock and lean); the
step keeps one block input fewer with the lookup replayed, the same bytes in both frameworks
(JAX: residual accounting; torch_ref: live-tensor accounting)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxmem.compare.parity import dtype_context, model_in, torch_model_from
from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from jaxmem.compare.weights import to_torch_state_dict
from jaxmem.model import Decoder
from jaxmem.policy import POLICIES, QKV, EmbeddingReplay, MemoryPolicy, mixed_policy
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import lm_loss_fn
from parity_tests.conftest import PARITY_CONFIGS
from parity_tests.helpers import masked_batch, torch_batch
from torch_ref.remat import apply_memory_policy

TAG_MIX = mixed_policy(
    MemoryPolicy.custom({n: "device" for n in (*QKV, "mlp_up")}),
    1,
    MemoryPolicy.custom({"attn_out": "device", "mlp_up": "device"}),
)
POLICY_CASES = {
    "full": POLICIES["full"],
    "selective": POLICIES["selective"],
    "tag-mix": TAG_MIX,
}


def _jax(model, batch, policy):
    import jax
    import jax.numpy as jnp

    from jaxmem.memory.remat import layers_fn

    graphdef, params = nnx.split(model, nnx.Param)
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, model.cfg.n_layers))
    data = {k: jnp.asarray(v) for k, v in batch.items()}
    (value, _), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, data)
    return float(value), to_torch_state_dict(nnx.merge(graphdef, grads))


def _torch(model, batch, policy, translation):
    apply_memory_policy(model.blocks, policy, translation)
    model.zero_grad(set_to_none=True)
    b = torch_batch(batch)
    loss_sum, n = model(b["inputs"], b["targets"], b["mask"].double())
    (loss_sum / n).backward()
    return float(loss_sum / n), {k: p.grad.numpy() for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["pre_gelu_causal", "llama_gqa"])
def test_replayed_embedding_and_tag_mixes_are_plain_autodiff_in_float64(name):
    """GPT-2 (learned positions: the replay adds them again) and Llama (RoPE, untied head)."""
    cfg, batch_size, seq_len = PARITY_CONFIGS[name]
    batch = masked_batch(cfg, batch_size, seq_len, seed=5)
    runs = {}
    with dtype_context("float64"):
        model = model_in(Decoder(cfg, rngs=nnx.Rngs(0)), "float64")
        runs["jax none"] = _jax(model, batch, POLICIES["none"])
        for key, policy in POLICY_CASES.items():
            for replay in (False, True):
                p = policy.replace(embedding=EmbeddingReplay(replay))
                runs[f"jax {key} replay={replay}"] = _jax(model, batch, p)
                runs[f"jax {key} unrolled replay={replay}"] = _jax(
                    model, batch, p.replace(unroll=True)
                )
    torch_model = torch_model_from(model)
    for key, policy in POLICY_CASES.items():
        for translation in ("stock", "lean"):
            p = policy.replace(embedding=EmbeddingReplay(True))
            runs[f"torch-{translation} {key} replay"] = _torch(torch_model, batch, p, translation)
    loss_tol, grad_tol = tolerance("float64", "loss"), tolerance("float64", "remat_vs_none")
    ref_loss, ref_grads = runs["jax none"]
    for key, (loss, grads) in runs.items():
        np.testing.assert_allclose(loss, ref_loss, rtol=loss_tol.rtol, atol=loss_tol.atol)
        diff = compare_state_dicts(grads, ref_grads, grad_tol)
        assert diff.passed, (key, diff.failures)
    # the embeddings' gradients come through the replayed lookup
    assert np.abs(ref_grads["wte.weight"]).max() > 1e-6


@pytest.mark.parametrize("policy", ["full", "selective", "tag-mix"])
def test_a_replayed_embedding_keeps_one_block_input_fewer_in_both_frameworks(policy):
    """tiny, 4 x 32 tokens, fp32: each framework's step keeps exactly one [B, S, D] block input
    fewer with the lookup replayed, and the analytic model says so too. Beside it only index
    arrays move: JAX's accounting may count the token ids ([B, S] int32) once more or once less
    (the replay keeps them; so does the lookup's own backward), torch replays the position ids
    (an int64 arange it kept before). The two frameworks keep the same tagged bytes and block
    inputs under the per-tag mix."""
    from jaxmem.compare.records import torch_record
    from jaxmem.config import PRESETS, OptimizerConfig
    from jaxmem.memory import analytic
    from jaxmem.planner.records import jax_record
    from jaxmem.precision import PRECISIONS

    cfg, batch, seq = PRESETS["tiny"], 4, 32
    fp32, opt = PRECISIONS["fp32"], OptimizerConfig()
    block_input = batch * seq * cfg.d_model * 4
    base = POLICY_CASES[policy]
    saved = {}
    for replay in (False, True):
        p = base.replace(embedding=EmbeddingReplay(replay))
        saved[("jax", replay)] = jax_record(
            StepSpec(model=cfg, policy=p, precision=fp32, optimizer=opt, batch=batch, seq_len=seq),
            abstract=True,
        )
        saved[("torch", replay)] = torch_record(cfg, p, fp32, opt, batch, seq, fake=True)
        saved[("analytic", replay)] = analytic.saved_activation_bytes(cfg, p, batch, seq, fp32)
    token_ids, position_ids = batch * seq * 4, seq * 8
    for f in ("jax", "torch"):
        plain, replayed = (saved[(f, r)]["saved_by_name"]["<layer input>"] for r in (False, True))
        assert plain - replayed == block_input, (f, plain, replayed)
        plain, replayed = (saved[(f, r)]["saved_activation_bytes_device"] for r in (False, True))
        assert abs(plain - replayed - block_input) <= max(token_ids, position_ids), f
    plain, replayed = (saved[("analytic", r)].device_bytes for r in (False, True))
    assert plain - replayed == block_input
    if policy == "tag-mix":
        jax_names, torch_names = (saved[(f, True)]["saved_by_name"] for f in ("jax", "torch"))
        assert torch_names["query_proj/key_proj/value_proj"] == sum(jax_names[n] for n in QKV)
        for name in ("mlp_up", "attn_out", "<layer input>", "<stack output>"):
            assert jax_names[name] == torch_names[name], name

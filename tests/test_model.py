from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS
from jaxmem.model import CHECKPOINT_NAMES, BlockStack, Decoder, make_model
from jaxmem.policy import GATED_TAGS, ONLY_IN, ROPE_TAGS, model_tags
from jaxmem.precision import FP64


def _eqns(jaxpr):
    """Every equation of a jaxpr, recursing into sub-jaxprs (scan bodies, pjit, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            subs = param if isinstance(param, (list, tuple)) else [param]
            for sub in subs:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub)


@pytest.fixture(scope="module")
def tiny():
    return Decoder(PRESETS["tiny"], rngs=nnx.Rngs(0))


def test_logits_shape_and_dtype(tiny):
    tokens = jnp.zeros((3, 17), jnp.int32)
    logits = tiny(tokens)
    assert logits.shape == (3, 17, PRESETS["tiny"].vocab_size)
    assert logits.dtype == jnp.float32


@pytest.mark.parametrize("attention", ["naive", "fused"])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_every_checkpoint_name_is_tagged_once_per_block(norm, attention):
    """Every tag the model's attention form produces (``model_tags``: the naive form's scores
    and probabilities, or the fused op's log-sum-exp), once each, inside the scanned body."""
    cfg = PRESETS["tiny"].replace(norm=norm, attention=attention)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    jaxpr = jax.make_jaxpr(lambda t: model(t))(jnp.zeros((2, 8), jnp.int32))
    names = [e.params["name"] for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "name"]
    assert sorted(names) == sorted(model_tags(cfg))
    assert set(CHECKPOINT_NAMES) - set(model_tags(cfg)) == {
        *ONLY_IN["fused" if attention == "naive" else "naive"],
        *ROPE_TAGS,
        *GATED_TAGS,
    }


def test_layers_run_under_one_scan_that_returns_only_the_carry(tiny):
    jaxpr = jax.make_jaxpr(lambda t: tiny(t))(jnp.zeros((2, 8), jnp.int32))
    scans = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
    assert len(scans) == 1
    assert scans[0].params["length"] == PRESETS["tiny"].n_layers
    # Outputs = the [B, S, D] carry only: no stacked copy of the read-only layer parameters.
    assert [tuple(v.aval.shape) for v in scans[0].outvars] == [(2, 8, PRESETS["tiny"].d_model)]


@pytest.mark.parametrize("causal", [True, False])
def test_causal_mask_blocks_the_future_and_only_when_asked(causal):
    cfg = PRESETS["tiny"].replace(causal=causal)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = np.arange(12, dtype=np.int32)[None] % cfg.vocab_size
    changed = tokens.copy()
    changed[0, -1] = 200
    a, b = model(jnp.asarray(tokens)), model(jnp.asarray(changed))
    earlier_same = bool(jnp.allclose(a[0, :-1], b[0, :-1], rtol=0.0, atol=0.0))
    assert earlier_same == causal


def test_block_stack_runs_alone_on_the_seed_shape():
    cfg = PRESETS["seed"]
    stack = BlockStack(cfg, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 64, cfg.d_model))
    assert stack(x).shape == (2, 64, cfg.d_model)


def test_sequence_longer_than_the_position_table_is_rejected(tiny):
    with pytest.raises(ValueError, match="sequence length 65 exceeds max_seq_len=64"):
        tiny(jnp.zeros((1, 65), jnp.int32))


@pytest.mark.slow
def test_layers_fn_hook_replaces_how_layers_run():
    """The same ops run unrolled instead of scanned: an exactness claim, so float64 (in fp32
    the two compiles may fuse and round differently: 1.5e-7 measured with XLA:CPU at LLVM -O0)."""
    calls = []

    def unrolled(layer_fn, x, stacked):
        calls.append(jax.tree_util.tree_leaves(stacked)[0].shape[0])
        for i in range(calls[-1]):
            x = layer_fn(x, jax.tree_util.tree_map(lambda a, i=i: a[i], stacked))
        return x

    tol = tolerance("float64", "remat_vs_none")  # same ops, scan vs unrolled
    with jax.enable_x64(True):
        model = make_model(PRESETS["tiny"], FP64, seed=0)
        tokens = jnp.arange(10, dtype=jnp.int32)[None]
        np.testing.assert_allclose(
            np.asarray(model(tokens, layers_fn=unrolled)),
            np.asarray(model(tokens)),
            rtol=tol.rtol,
            atol=tol.atol,
        )
    assert calls == [PRESETS["tiny"].n_layers]

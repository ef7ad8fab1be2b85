"""The loss: its own VJP computes what differentiating log_softmax and a gather computes, and its
backward needs one vocabulary-sized buffer, not three (deviceless H100 plan: needs
jaxmem[gpu-plan], which ``make test`` installs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmem.compare.tolerances import tolerance
from jaxmem.memory.gpu_plan import compile_for
from jaxmem.memory.targets import get_target
from jaxmem.model.loss import chunked_lm_loss, cross_entropy_sum, token_nll


def autodiff_sum(logits, targets, mask=None):
    """The textbook form, differentiated by JAX: what ``token_nll`` replaces."""
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), -1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return nll.sum() if mask is None else (nll * mask).sum()


def _inputs(dtype, scale=3.0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    logits = (jax.random.normal(k1, (3, 7, 19), jnp.float64) * scale).astype(dtype)
    targets = jax.random.randint(k2, (3, 7), 0, 19)
    mask = (jax.random.uniform(k3, (3, 7)) > 0.3).astype(jnp.float64)
    return logits, targets, mask


@pytest.mark.parametrize("masked", [False, True])
def test_loss_and_gradient_are_the_textbook_ones_in_float64(masked):
    with jax.enable_x64(True):
        logits, targets, mask = _inputs(jnp.float64)
        m = mask if masked else None
        (ours, n), g_ours = jax.value_and_grad(cross_entropy_sum, has_aux=True)(logits, targets, m)
        ref, g_ref = jax.value_and_grad(autodiff_sum)(logits, targets, m)
    assert ours.dtype == g_ours.dtype == jnp.float64
    assert float(n) == (mask.sum() if masked else targets.size)
    np.testing.assert_allclose(ours, ref, **tolerance("float64", "loss").kwargs())
    np.testing.assert_allclose(g_ours, g_ref, **tolerance("float64", "grads").kwargs())
    if masked:  # a masked-out token's logits get no gradient at all
        assert not np.any(np.asarray(g_ours)[np.asarray(mask) == 0])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_gradient_of_large_logits_stays_finite_and_sums_to_zero_per_token(dtype):
    with jax.enable_x64(dtype == "float64"):
        logits, targets, _ = _inputs(jnp.dtype(dtype), scale=1e4)  # exp() overflows unshifted
        g = np.asarray(jax.grad(lambda x: token_nll(x, targets).sum())(logits))
    assert g.dtype == np.dtype(dtype) and np.all(np.isfinite(g))
    # softmax - onehot: the target's entry is softmax - 1 <= 0, and in float64 each token's
    # row sums to 0 up to rounding
    assert np.all(np.take_along_axis(g, np.asarray(targets)[..., None], -1) <= 0)
    if dtype == "float64":
        np.testing.assert_allclose(g.sum(-1), 0.0, **tolerance("float64", "grads").kwargs())


def _head_loss_grad(loss):
    """The gradient of ``loss(x @ W)`` with respect to the hidden states and the head: the step's
    end, where the logits are the largest thing it makes."""
    return jax.jit(jax.grad(lambda x, w, t: loss(x @ w, t), argnums=(0, 1)))


HEAD_SHAPES = (
    jax.ShapeDtypeStruct((4, 128, 64), jnp.float32),
    jax.ShapeDtypeStruct((64, 4096), jnp.float32),
    jax.ShapeDtypeStruct((4, 128), jnp.int32),
)
LOGITS_BYTES = 4 * 128 * 4096 * 4


def test_the_backward_writes_the_logits_gradient_into_the_logits_buffer_on_an_h100_plan():
    target = get_target("h100")
    temp = {
        name: compile_for(_head_loss_grad(loss), HEAD_SHAPES, target)
        .memory_analysis()
        .temp_size_in_bytes
        for name, loss in (
            ("ours", lambda x, t: cross_entropy_sum(x, t)[0]),
            ("autodiff", autodiff_sum),
            ("optax", lambda x, t: optax.softmax_cross_entropy_with_integer_labels(x, t).sum()),
        )
    }
    # measured: 10.0 MiB (the logits, whose buffer their gradient reuses, plus the head's
    # gradient and working buffers); optax's 16.0 (its gather's backward scatters into a zero
    # buffer); the textbook form's 24.0 (logits, the scattered upstream gradient, the logits'
    # gradient)
    assert temp["ours"] < 1.5 * LOGITS_BYTES
    assert temp["optax"] >= temp["ours"] + 0.5 * LOGITS_BYTES
    assert temp["autodiff"] >= 2.5 * LOGITS_BYTES


def test_the_backward_needs_fewer_bytes_on_xla_cpu_too():
    temp = {
        name: f.lower(*HEAD_SHAPES).compile().memory_analysis().temp_size_in_bytes
        for name, f in (
            ("ours", _head_loss_grad(lambda x, t: cross_entropy_sum(x, t)[0])),
            ("autodiff", _head_loss_grad(autodiff_sum)),
        )
    }
    # measured: 24.0 vs 32.0 MiB (XLA:CPU gives the gradient a buffer of its own)
    assert temp["ours"] <= temp["autodiff"] - LOGITS_BYTES


# ---------------------------------------------------------------- the head and loss in chunks
def _head(params, x):
    """A final RMS-style scale and a tied head, as ``Decoder.head`` gives them."""
    x = x * params["scale"]
    return jnp.einsum("bsd,vd->bsv", x, params["table"])


def _head_inputs(dtype):
    ks = jax.random.split(jax.random.PRNGKey(1), 5)
    params = {
        "scale": 1.0 + 0.1 * jax.random.normal(ks[0], (16,), dtype),
        "table": jax.random.normal(ks[1], (23, 16), dtype),
    }
    x = jax.random.normal(ks[2], (3, 8, 16), dtype)
    targets = jax.random.randint(ks[3], (3, 8), 0, 23)
    mask = (jax.random.uniform(ks[4], (3, 8)) > 0.3).astype(dtype)
    return params, x, targets, mask


@pytest.mark.parametrize("chunks", [1, 2, 8])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_loss_is_the_whole_loss_with_the_same_gradients_in_float64(chunks, masked):
    """Each chunk's gradients formed in the forward, scaled by the cotangent in the backward:
    the same function and derivative as the head and loss run whole (here differentiated
    through the mean, whose cotangent 1/n is not 1)."""
    with jax.enable_x64(True):
        params, x, targets, mask = _head_inputs(jnp.float64)
        m = mask if masked else None

        def whole(p, x):
            s, n = cross_entropy_sum(_head(p, x), targets, m)
            return s / n

        def chunked(p, x):
            s, n = chunked_lm_loss(_head, p, x, targets, m, chunks=chunks)
            return s / n

        ref, g_ref = jax.value_and_grad(whole, argnums=(0, 1))(params, x)
        ours, g_ours = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(params, x)
    np.testing.assert_allclose(ours, ref, **tolerance("float64", "loss").kwargs())
    leaves = zip(jax.tree_util.tree_leaves(g_ours), jax.tree_util.tree_leaves(g_ref), strict=True)
    for a, b in leaves:
        assert a.dtype == jnp.float64
        np.testing.assert_allclose(a, b, **tolerance("float64", "grads").kwargs())


def test_chunks_must_divide_the_sequence():
    params, x, targets, _ = _head_inputs(jnp.float32)
    with pytest.raises(ValueError, match="chunks=3 must be a positive divisor of seq_len=8"):
        chunked_lm_loss(_head, params, x, targets, chunks=3)


def test_a_chunked_loss_keeps_no_logits_for_the_backward():
    """jaxmem's loss under ``loss_chunks``: none of the step's saved residuals is vocabulary
    sized; what it keeps instead is the stack output's gradient (and the head's)."""
    from flax import nnx

    from jaxmem.config import PRESETS
    from jaxmem.memory.residuals import saved_residuals
    from jaxmem.model.decoder import make_model
    from jaxmem.planner.records import lm_step_batch
    from jaxmem.step.train_step import lm_loss_fn

    cfg = PRESETS["tiny"]
    graphdef, params = nnx.split(make_model(cfg), nnx.Param)
    batch = lm_step_batch(cfg, 4, 32, abstract=False)
    logits_shape = (4, 32, cfg.vocab_size)
    saved = {}
    for chunks in (0, 4):
        loss = lm_loss_fn(graphdef, loss_chunks=chunks)
        saved[chunks] = saved_residuals(lambda p, loss=loss: loss(p, batch)[0], params)
    assert any(r.shape == logits_shape for r in saved[0])
    assert not any(r.shape[-1:] == (cfg.vocab_size,) and len(r.shape) == 3 for r in saved[4])
    computed = {c: sum(r.nbytes for r in s if r.origin == "computed") for c, s in saved.items()}
    assert computed[4] < computed[0] - 4 * 32 * cfg.vocab_size * 4 // 2


def test_a_chunked_loss_needs_a_fraction_of_the_logits_on_an_h100_plan():
    """The head and loss gradient of HEAD_SHAPES (fp32 logits 8 MiB): whole, the backward holds
    the logits (their gradient written into their buffer); in 8 chunks one chunk's logits exist
    at a time, beside the head's gradient (1 MiB) formed in the forward."""
    target = get_target("h100")

    def whole(x, w, t):
        return cross_entropy_sum(x @ w, t)[0]

    def chunked(x, w, t):
        return chunked_lm_loss(lambda p, x: x @ p, w, x, t, chunks=8)[0]

    temp = {
        name: compile_for(jax.jit(jax.grad(f, argnums=(0, 1))), HEAD_SHAPES, target)
        .memory_analysis()
        .temp_size_in_bytes
        for name, f in (("whole", whole), ("chunked", chunked))
    }
    # measured: 10.0 MiB whole, 1.66 MiB in 8 chunks
    assert temp["whole"] >= LOGITS_BYTES
    assert temp["chunked"] <= LOGITS_BYTES // 4, temp

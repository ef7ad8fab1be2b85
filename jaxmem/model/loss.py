"""Losses, kept outside the model. Each returns a *sum* and a count so that gradient accumulation
can add sums and counts over microbatches and divide once (a mean of per-microbatch means is wrong
whenever microbatches hold different numbers of valid tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.model.ops import wide


# The per-token loss has its own VJP. Differentiated the usual way, log_softmax followed by a gather
# has a backward that scatters the upstream gradient into a zero [B, S, V] buffer and then reads
# the saved logits to form the softmax term: two vocabulary-sized fp32 buffers beside the logits
# at the step's peak whenever the head is the largest thing the step makes (gpt2-124m, 8 x 1024:
# one is 1,570.5 MiB). Here the backward is one elementwise pass over the saved logits,
# ``(softmax - onehot) * g``, which XLA:CUDA writes into the logits' own buffer (their last use).
# Written by hand because no library's loss does this: optax's
# ``softmax_cross_entropy_with_integer_labels`` (logsumexp minus a gather) still scatters into a
# zero buffer in its backward. Head and loss gradient of tests/test_loss.py (4 x 128 tokens,
# vocabulary 4096, fp32 logits 8 MiB), temporaries on an H100 plan: 10.0 MiB here, 16.0 optax's,
# 24.0 log_softmax's (XLA:CPU: 24.0, 16.0, 32.0; XLA:CPU does not fuse the pass into one loop).
@jax.custom_vjp
def token_nll(logits_bsv: jax.Array, targets_bs: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood ``logsumexp(logits) - logits[target]``, ``[B, S]``, in
    the logits' dtype."""
    return _token_nll_fwd(logits_bsv, targets_bs)[0]


def _token_nll_fwd(logits_bsv: jax.Array, targets_bs: jax.Array):
    lse_bs = jax.nn.logsumexp(logits_bsv, axis=-1)
    picked_bs = jnp.take_along_axis(logits_bsv, targets_bs[..., None], axis=-1)[..., 0]
    return lse_bs - picked_bs, (logits_bsv, lse_bs, targets_bs)


def _token_nll_bwd(res, g_bs):
    logits_bsv, lse_bs, targets_bs = res
    vocab = jax.lax.broadcasted_iota(targets_bs.dtype, logits_bsv.shape, logits_bsv.ndim - 1)
    probs = jnp.exp(logits_bsv - lse_bs[..., None])
    d_bsv = jnp.where(vocab == targets_bs[..., None], probs - 1, probs) * g_bs[..., None]
    return d_bsv.astype(logits_bsv.dtype), None


token_nll.defvjp(_token_nll_fwd, _token_nll_bwd)


def cross_entropy_sum(
    logits_bsv: jax.Array, targets_bs: jax.Array, mask_bs: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy (in fp32, or float64 for float64 logits) and the number of
    tokens it covers.

    Args:
      logits_bsv: ``[B, S, V]`` logits (any float dtype; computed in fp32).
      targets_bs: ``[B, S]`` integer target ids.
      mask_bs: optional ``[B, S]`` weights (1 = counts, 0 = padding).

    Returns:
      ``(loss_sum, n_tokens)``, scalars; the mean loss is ``loss_sum / n_tokens``.
    """
    acc = wide(logits_bsv.dtype)
    nll_bs = token_nll(logits_bsv.astype(acc), targets_bs)
    if mask_bs is None:
        return nll_bs.sum(), jnp.asarray(nll_bs.size, acc)
    mask = mask_bs.astype(acc)
    return (nll_bs * mask).sum(), mask.sum()


def mse_sum(pred: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed squared error and element count (``torch.nn.MSELoss()`` is their ratio)."""
    acc = wide(pred.dtype)
    err = pred.astype(acc) - target.astype(acc)
    return jnp.sum(err * err), jnp.asarray(err.size, acc)

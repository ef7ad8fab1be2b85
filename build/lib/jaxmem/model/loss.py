"""Losses, kept outside the model. Each returns a *sum* and a count so that gradient accumulation
can add sums and counts over microbatches and divide once (a mean of per-microbatch means is wrong
whenever microbatches hold different numbers of valid tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.model.ops import wide


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
    logp = jax.nn.log_softmax(logits_bsv.astype(acc), axis=-1)
    nll_bs = -jnp.take_along_axis(logp, targets_bs[..., None], axis=-1)[..., 0]
    if mask_bs is None:
        return nll_bs.sum(), jnp.asarray(nll_bs.size, acc)
    mask = mask_bs.astype(acc)
    return (nll_bs * mask).sum(), mask.sum()


def mse_sum(pred: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed squared error and element count (``torch.nn.MSELoss()`` is their ratio)."""
    acc = wide(pred.dtype)
    err = pred.astype(acc) - target.astype(acc)
    return jnp.sum(err * err), jnp.asarray(err.size, acc)

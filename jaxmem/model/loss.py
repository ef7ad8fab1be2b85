"""Losses, kept outside the model. Each returns a *sum* and a count so that gradient accumulation
can add sums and counts over microbatches and divide once (a mean of per-microbatch means is wrong
whenever microbatches hold different numbers of valid tokens)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxmem.model.ops import wide
from jaxmem.model.sequence import tile_major, tile_minor


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


# ---------------------------------------------------------------- the head and loss in chunks
# Kept whole, the loss's backward reads the [B, S, V] logits (fp32) the forward made: the largest
# activation of a model with a big vocabulary (Llama 3's 128,256 tokens: 8.4 GB for 8 x 2,048
# tokens) and, in the backward, its gradient beside them. ``chunked_lm_loss`` runs the final norm,
# the head and the loss over sequence chunks and forms each chunk's gradients (with respect to the
# stack's output and the head's parameters) in the forward, where its logits exist: no logits are
# kept for the backward and one chunk's exist at a time, at no recomputed FLOP. The backward only
# scales what the forward formed by the loss's cotangent. The same idea as Liger-Kernel's fused
# linear cross-entropy, written here over any head of ``Decoder.head`` in jax.numpy.
def chunked_lm_loss(
    head: Callable[[dict, jax.Array], jax.Array],
    head_params: dict,
    x_bsd: jax.Array,
    targets_bs: jax.Array,
    mask_bs: jax.Array | None = None,
    *,
    chunks: int,
    shards: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """``cross_entropy_sum(head(head_params, x_bsd), targets_bs, mask_bs)`` computed over
    ``chunks`` equal sequence chunks, each chunk's gradients formed in the forward.

    The loss is the same sum; gradients agree with the whole loss's up to the order in which the
    head's parameter gradient adds chunk partials (in the wide dtype) and, in 16-bit compute, one
    rounding per chunk. Its cotangent multiplies the stored gradients, so a loss scaled by a
    factor unknown in the forward (fp16's dynamic loss scale) would lose what the forward's
    unscaled gradients underflowed: ``jaxmem.job`` refuses fp16 with chunks.

    Args:
      head: ``fn(head_params, x) -> logits`` (``Decoder.head``), pure.
      head_params: its parameters (any pytree of arrays).
      x_bsd: ``[B, S, D]`` the stack's output.
      targets_bs: ``[B, S]`` target ids; ``mask_bs``: optional ``[B, S]`` weights.
      chunks: sequence chunks, dividing ``S``.
      shards: the sequence held as that many contiguous shards (one per context device): each
        step of the loop takes one chunk of every shard (``tile_major``); ``chunks`` a multiple.

    Returns:
      ``(loss_sum, n_tokens)`` as ``cross_entropy_sum`` returns them.
    """
    seq = x_bsd.shape[1]
    if not (isinstance(chunks, int) and chunks >= 1 and seq % chunks == 0 and chunks % shards == 0):
        raise ValueError(
            f"loss chunks={chunks!r} must be a positive divisor of seq_len={seq} and a multiple "
            f"of its {shards} shard(s)"
        )
    acc = wide(x_bsd.dtype)
    weights = jnp.ones(targets_bs.shape, acc) if mask_bs is None else mask_bs.astype(acc)
    loss_sum = _chunked_nll_sum(head, (chunks, shards), head_params, x_bsd, targets_bs, weights)
    return loss_sum, weights.sum()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_nll_sum(head, tiling, head_params, x_bsd, targets_bs, weights_bs):
    return _chunked_fwd(head, tiling, head_params, x_bsd, targets_bs, weights_bs)[0]


def _chunked_fwd(head, tiling, head_params, x_bsd, targets_bs, weights_bs):
    # one named call: residual accounting (jaxmem.memory.residuals) names what it leaves for
    # the backward "<loss gradients>"
    call = jax.jit(functools.partial(chunked_loss_gradients, head, tiling))
    return call(head_params, x_bsd, targets_bs, weights_bs)


def chunked_loss_gradients(head, tiling, head_params, x_bsd, targets_bs, weights_bs):
    """The loss and, formed chunk by chunk, its gradients (``_chunked_nll_sum``'s forward);
    ``tiling``: (chunks, shards), ``chunked_lm_loss``'s."""
    chunks, shards = tiling

    def chunk_loss(p, x, t, w):
        logits = head(p, x)
        nll = token_nll(logits.astype(wide(logits.dtype)), t)
        return (nll * w.astype(nll.dtype)).sum()

    def one(p, x, t, w):
        loss, pull = jax.vjp(lambda p_, x_: chunk_loss(p_, x_, t, w), p, x)
        dp, dx = pull(jnp.ones_like(loss))
        return loss, dp, dx

    if chunks == 1:
        loss, dp, dx = one(head_params, x_bsd, targets_bs, weights_bs)
        return loss, (dp, dx)
    acc_dtype = lambda a: jnp.promote_types(a.dtype, wide(x_bsd.dtype))  # noqa: E731

    def body(carry, chunk):
        dp_acc, loss_acc = carry
        loss, dp, dx = one(head_params, *chunk)
        dp_acc = jax.tree_util.tree_map(lambda a, d: a + d.astype(a.dtype), dp_acc, dp)
        return (dp_acc, loss_acc + loss), dx

    zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, acc_dtype(a)), head_params)
    init = (zeros, jnp.zeros((), wide(x_bsd.dtype)))
    # the batch axis (and its split over data devices) whole in every chunk
    xs = tuple(tile_major(a, chunks, shards) for a in (x_bsd, targets_bs, weights_bs))
    (dp, loss), dx_c = jax.lax.scan(body, init, xs)
    dx = tile_minor(dx_c, shards)
    dp = jax.tree_util.tree_map(lambda d, a: d.astype(a.dtype), dp, head_params)
    return loss, (dp, dx)


def _chunked_bwd(head, tiling, res, g):
    del head, tiling
    dp, dx = res

    def scale(d):  # in the wide dtype: a 16-bit copy of the cotangent would round it
        return (d.astype(jnp.promote_types(d.dtype, g.dtype)) * g).astype(d.dtype)

    return jax.tree_util.tree_map(scale, dp), scale(dx), None, None


_chunked_nll_sum.defvjp(_chunked_fwd, _chunked_bwd)

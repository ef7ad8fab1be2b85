"""Ring attention over the context axis (``--cp-attention ring``): keys and values pass from
device to device, each device attending its own queries to one device's keys at a time.

Against ``jaxmem.step.context``'s all-gather (Llama 3's choice, the default), a ring never holds
the row's keys and values whole: a device holds its own share, the share in flight and, in the
backward, that share's key/value gradients (fp32, ``[B, S/cp, Hkv, K]``), which travel with it and
arrive home after ``cp`` steps; the all-gather holds ``[B, S, Hkv, K]`` keys and values and their
gradients before the reduce-scatter. The price: ``cp - 1`` point-to-point steps per attention
(``cp`` in the backward) instead of one collective (XLA may overlap each step's
``collective-permute`` with its compute; a deviceless plan shows the program, not the overlap).

The balanced layout makes every step's work static (device ``i`` holds chunks ``i`` and
``2 cp - 1 - i`` of ``2 cp``; at step ``t`` it holds device ``j = i - t mod cp``'s keys):
- ``t = 0`` (``j = i``): its early queries against its early keys (causal), its late queries
  against its early keys (all visible) and its late keys (causal);
- ``j < i`` (``t <= i``): both chunks of queries against ``j``'s early keys, all visible (``j``'s
  late keys come after every query this device holds);
- ``j > i``: its late queries against both of ``j``'s chunks, all visible (its early queries
  come before every key ``j`` holds).
Each ``t > 0`` step is two chunk-by-chunk products without a mask (a ``lax.cond`` between two
branches of equal work), the diagonal three with two causal: ``2 cp + 1`` chunk products per
device where the all-gathered form computes ``4 cp`` (masked blocks included). Each product is
``jaxmem.model.flash``'s blockwise online softmax, whose carry (row maximum, sum, unnormalised
output) continues from step to step; the backward is FlashAttention-2's given the final
log-sum-exp, so each step's gradients are exact pieces of the whole.

Not cuDNN's kernel per product, even where the model runs it on one device: merging products
needs each one's log-sum-exp, and ``jax.nn.dot_product_attention(..., return_residual=True)``
returns cuDNN's cast to the output's dtype (JAX 0.10.2 to 0.12; bf16: at a log-sum-exp of 15,
merge weights off by up to 3 %), while its backward takes no outside log-sum-exp. jaxmem's
kernel keeps both in fp32, at the price of memory-bound elementwise work on each score block.

Written by hand because JAX has no ring attention (MaxText's and the Ring Attention authors' are
parts of their own models); PyTorch's ``context_parallel`` rotates keys and values the same way.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmem.model.flash import (
    attention_grads,
    online_softmax,
    softmax_delta,
    softmax_finish,
    softmax_start,
)

Array = jax.Array


def _halves(x: Array, axis: int = 1) -> tuple[Array, Array]:
    n = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, None, axis=axis)


def _rotate(x, axis: str, cp: int):
    """Each device's ``x`` to the next device of the ring (a pytree, one collective-permute)."""
    return jax.lax.ppermute(x, axis, [(d, (d + 1) % cp) for d in range(cp)])


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def ring_attention(q: Array, k: Array, v: Array, axis: str, cp: int, block: int) -> Array:
    """Causal attention of this device's queries ``q`` (``[B, 2n, H, K]``: chunks ``i`` and
    ``2 cp - 1 - i`` of the row, ``n`` positions each) against the whole row's keys and values,
    held ``[B, 2n, Hkv, K]`` per device in the same layout over mesh axis ``axis`` (``cp``
    devices): ``[B, 2n, H·K]`` in ``q``'s dtype, tagged ``attn_context``. Call inside
    ``shard_map``; ``block``: keys per block of the blockwise kernel."""
    return _ring_fwd(q, k, v, axis, cp, block)[0]


def _ring_fwd(q, k, v, axis, cp, block):
    b, s, h, d = q.shape
    i = jax.lax.axis_index(axis)
    q_e, q_l = _halves(q)
    k_e, k_l = _halves(k)
    v_e, v_l = _halves(v)
    run = partial(online_softmax, block=block, pos=None, in_map=True)
    # t = 0: this device's own keys
    early = run(q_e, k_e, v_e, True, carry=softmax_start(q_e))
    late = run(q_l, k_e, v_e, False, carry=softmax_start(q_l))
    late = run(q_l, k_l, v_l, True, carry=late)

    def before(carries, kv):  # j < i: every query against j's early keys
        (early, late), (kj, vj) = carries, kv
        kj, vj = _halves(kj)[0], _halves(vj)[0]
        return run(q_e, kj, vj, False, carry=early), run(q_l, kj, vj, False, carry=late)

    def after(carries, kv):  # j > i: the late queries against all of j's keys
        (early, late), (kj, vj) = carries, kv
        return early, run(q_l, kj, vj, False, carry=late)

    def step(state, t):
        carries, kv = state
        kv = _rotate(kv, axis, cp)
        carries = jax.lax.cond(t <= i, before, after, carries, kv)
        return (carries, kv), None

    ((early, late), _), _ = jax.lax.scan(step, ((early, late), (k, v)), jnp.arange(1, cp))
    out_e, lse_e = softmax_finish(early, q.dtype)
    out_l, lse_l = softmax_finish(late, q.dtype)
    out = jnp.concatenate([out_e, out_l], axis=1).reshape(b, s, h * d)
    out = checkpoint_name(out, "attn_context")
    lse = checkpoint_name(jnp.concatenate([lse_e, lse_l], axis=2), "attn_lse")
    return out, (q, k, v, out, lse)


def _ring_bwd(axis, cp, block, res, g):
    q, k, v, out, lse = res
    b, s, h, d = q.shape
    g = g.reshape(b, s, h, d).astype(q.dtype)
    delta = softmax_delta(g, out.reshape(b, s, h, d))
    acc = delta.dtype
    q_e, q_l = _halves(q)
    g_e, g_l = _halves(g)
    lse_e, lse_l = _halves(lse, 2)
    delta_e, delta_l = _halves(delta, 2)

    def grads(rows, kj, vj, causal):  # (dq, dk, dv) of the early or late queries
        if rows == "early":
            return attention_grads(q_e, kj, vj, g_e, lse_e, delta_e, causal, block, None, acc)
        return attention_grads(q_l, kj, vj, g_l, lse_l, delta_l, causal, block, None, acc)

    return _ring_grads(q, k, v, axis, cp, grads)


def _ring_grads(q, k, v, axis, cp, grads):
    """The backward's ring: ``grads(rows, kj, vj, causal)`` (``rows``: ``"early"`` or
    ``"late"``; wide ``(dq, dk, dv)``) for the same products as the forward, the keys' and
    values' gradients travelling with them and sent home after the last step."""
    i = jax.lax.axis_index(axis)
    # t = 0: this device's own keys, as the forward
    k_e, k_l = _halves(k)
    v_e, v_l = _halves(v)
    dq_e, dk_e, dv_e = grads("early", k_e, v_e, True)
    dq_l, dk_e2, dv_e2 = grads("late", k_e, v_e, False)
    dq_l2, dk_l, dv_l = grads("late", k_l, v_l, True)
    dq = (dq_e, dq_l + dq_l2)
    dkv = (jnp.concatenate([dk_e + dk_e2, dk_l], 1), jnp.concatenate([dv_e + dv_e2, dv_l], 1))

    def before(dq, kv, dkv):  # j < i: every query against j's early keys
        kj, vj = _halves(kv[0])[0], _halves(kv[1])[0]
        a_q, a_k, a_v = grads("early", kj, vj, False)
        b_q, b_k, b_v = grads("late", kj, vj, False)
        zero = jnp.zeros_like(a_k)
        dk = dkv[0] + jnp.concatenate([a_k + b_k, zero], 1)
        dv = dkv[1] + jnp.concatenate([a_v + b_v, zero], 1)
        return (dq[0] + a_q, dq[1] + b_q), (dk, dv)

    def after(dq, kv, dkv):  # j > i: the late queries against all of j's keys
        b_q, b_k, b_v = grads("late", kv[0], kv[1], False)
        return (dq[0], dq[1] + b_q), (dkv[0] + b_k, dkv[1] + b_v)

    def step(state, t):
        dq, kv, dkv = state
        kv, dkv = _rotate((kv, dkv), axis, cp)  # j's keys and their gradients so far
        dq, dkv = jax.lax.cond(t <= i, before, after, dq, kv, dkv)
        return (dq, kv, dkv), None

    (dq, _, dkv), _ = jax.lax.scan(step, (dq, (k, v), dkv), jnp.arange(1, cp))
    dk, dv = _rotate(dkv, axis, cp)  # home: every device's keys have met every query
    dq = jnp.concatenate([x.astype(q.dtype) for x in dq], axis=1)  # cast, then join
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


ring_attention.defvjp(_ring_fwd, _ring_bwd)

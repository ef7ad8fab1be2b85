"""Fused (memory-efficient) attention in JAX: FlashAttention's algorithm with a custom VJP.

Why written here: ``jax.nn.dot_product_attention``'s fused kernel is cuDNN's, which exists only
on CUDA (and compiles in a deviceless H100 plan only with the 2.2 GB ``nvidia-cudnn-cu12``
installed); its ``implementation="xla"`` form materialises the ``[B, H, S, S]`` scores and keeps
them for the backward, as naive attention does. This op never stores them, on every backend, so
CPU plans and deviceless GPU plans alike show attention memory linear in the sequence.

Forward (Rabe & Staats 2021; Dao et al. 2022): all queries at once, keys and values in blocks of
``block``, under ``lax.scan``, with the online softmax (a running row maximum ``m``, sum ``l``
and unnormalised output, rescaled as each block arrives). The working set is one
``[B, H, S, block]`` score block. Kept for the backward: q, k, v (the block's ``query_proj``,
``key_proj``, ``value_proj``), the output (``attn_context``) and the row log-sum-exp
``lse = m + log l`` (``attn_lse``, ``[B, H, S]`` fp32) — both tagged inside the forward rule, so
the kept tensors and the tagged ones are one (as ``ops.softmax`` does).

Backward (FlashAttention-2's): ``D = rowsum(dO * O)``; per key block, the probabilities are
recomputed as ``exp(q·kᵀ·scale − lse)``, then ``dV_j = Pᵀ dO``, ``dP = dO V_jᵀ``,
``dS = P (dP − D)``, ``dQ += dS K_j · scale``, ``dK_j = dSᵀ Q · scale``: five block matmuls
(one more than naive attention's backward: the recomputed scores).

Grouped-query attention: k and v have Hkv heads, each serving G = H / Hkv query heads; the block
matmuls run on q viewed as ``[B, S, Hkv, G, K]`` (no copy of k or v), and dK, dV sum over the
group.

Numerics follow the naive form's rule: scores, softmax and their gradients in fp32 (or wider,
``ops.wide``), matmul operands in the compute dtype. The causal mask is applied per block from
positions (no ``[S, S]`` mask array); padding keys of the last block are masked too. FLOPs: every
block is computed, masked ones included (as naive attention computes the whole ``[S, S]``).
"""

from __future__ import annotations

import importlib.util
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmem.model.ops import wide

Array = jax.Array

# How the fused core runs: this module's blockwise kernel (every backend), or cuDNN's fused
# attention through ``jax.nn.dot_product_attention`` (CUDA, 16-bit, head_dim <= 128 and a
# multiple of 8: where cuDNN's flash kernel applies).
KERNELS = ("blockwise", "cudnn")
KERNEL_NAMES = {
    "blockwise": "blockwise (jaxmem.model.flash)",
    "cudnn": "cuDNN (jax.nn.dot_product_attention, implementation='cudnn')",
}


def cudnn_installed() -> bool:
    """Whether cuDNN's library is importable (``nvidia-cudnn-cu12``: part of ``jaxmem[cuda]``;
    for a deviceless plan of the cuDNN path, the ``cudnn-plan`` extra)."""
    try:
        return importlib.util.find_spec("nvidia.cudnn") is not None
    except (ImportError, ValueError):
        return False


def fused_kernel(head_dim: int, compute_dtype: Any, platform: str, cudnn: bool) -> str:
    """The kernel fused attention runs on ``platform`` (``"gpu"``/``"cuda"`` for an NVIDIA GPU,
    its plan included): cuDNN's where it applies, else the blockwise kernel."""
    sixteen_bit = jnp.dtype(compute_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    applies = head_dim <= 128 and head_dim % 8 == 0 and sixteen_bit
    return "cudnn" if platform in ("gpu", "cuda") and cudnn and applies else "blockwise"


def fused_attention(q: Array, k: Array, v: Array, causal: bool, block: int, kernel: str) -> Array:
    """``flash_attention`` (``kernel="blockwise"``) or cuDNN's fused attention (``"cudnn"``),
    the same function of q, k, v (grouped heads included), heads merged and tagged
    ``attn_context``. cuDNN's op keeps its own softmax statistics, untagged: no ``attn_lse``."""
    if kernel == "blockwise":
        return flash_attention(q, k, v, causal, block)
    b, s, h, d = q.shape
    out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    return checkpoint_name(out.reshape(b, s, h * d), "attn_context")


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def flash_attention(q: Array, k: Array, v: Array, causal: bool, block: int) -> Array:
    """Softmax attention of ``q`` (``[B, S, H, K]``), ``k``, ``v`` (``[B, S, Hkv, K]``, Hkv
    dividing H; one dtype) with heads merged: ``[B, S, H·K]`` in that dtype, tagged
    ``attn_context``. ``causal``: position i attends to j ≤ i only. ``block``: keys per block
    (a shorter sequence is one block)."""
    return _flash_fwd(q, k, v, causal, block)[0]


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def flash_attention_at(
    q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array, block: int
) -> Array:
    """``flash_attention``, causal by position: query i (at ``q_pos[i]``) attends to key j
    (at ``k_pos[j]``) where ``k_pos[j] <= q_pos[i]``, whatever order either is held in, and
    ``q`` may hold fewer positions than ``k`` (a device's share of a sequence split over
    devices, against all its keys: ``jaxmem.step.context``)."""
    return _flash_fwd(q, k, v, True, block, (q_pos, k_pos))[0]


def _blocks(x: Array, block: int) -> Array:
    """``[B, S, H, K]`` -> ``[N, B, block, H, K]``, zero-padded to N·block positions."""
    b, s, h, d = x.shape
    n = -(-s // block)
    x = jnp.pad(x, ((0, 0), (0, n * block - s), (0, 0), (0, 0)))
    return jnp.moveaxis(x.reshape(b, n, block, h, d), 1, 0)


def _valid(s: int, block: int, j: Array, causal: bool, pos: Any = None) -> Array:
    """``[Sq, block]`` (``[1, block]`` unmasked): which keys of block ``j`` (of ``s``) each
    query may attend to. ``pos``: the queries' positions ``[Sq]`` and this block's keys'
    ``[block]`` (causal by position, in whatever order the sequence is held); without, causal
    takes queries and keys in order, ``s`` of each."""
    k_idx = j * block + jnp.arange(block)
    if pos is not None:
        q_pos, kj_pos = pos
        ok = k_idx[None, :] < s  # padding keys never
        return ok & (q_pos[:, None] >= kj_pos[None, :])
    ok = k_idx[None, :] < s  # padding keys never (any number of queries)
    if causal:  # queries and keys both in order, s of each
        ok = ok & (jnp.arange(s)[:, None] >= k_idx[None, :])
    return ok


def _scores(q: Array, kj: Array, scale: float | None, acc) -> Array:
    """``[B, H, S, block]`` scores of one key block, times ``scale`` unless None (grouped
    heads: each key head scores its group of query heads)."""
    b, s, h, d = q.shape
    kv = kj.shape[2]
    if kv == h:
        sc = jnp.einsum("bqhk,bshk->bhqs", q, kj, preferred_element_type=acc)
    else:
        qg = q.reshape(b, s, kv, h // kv, d)
        sc = jnp.einsum("bqhgk,bshk->bhgqs", qg, kj, preferred_element_type=acc)
        sc = sc.reshape(b, h, s, kj.shape[1])
    return sc if scale is None else sc * scale


def _grouped(x_bhqs: Array, kv: int) -> Array:
    """``[B, H, S, n]`` -> ``[B, Hkv, G, S, n]`` (a view)."""
    b, h, s, n = x_bhqs.shape
    return x_bhqs.reshape(b, kv, h // kv, s, n)


def _apply(p: Array, vj: Array, acc) -> Array:
    """``[B, S, H, K]``: block probabilities (or score gradients) applied to a block of values
    (or keys)."""
    b, h, s, _ = p.shape
    kv, d = vj.shape[2], vj.shape[3]
    if kv == h:
        return jnp.einsum("bhqs,bshk->bqhk", p, vj, preferred_element_type=acc)
    out = jnp.einsum("bhgqs,bshk->bqhgk", _grouped(p, kv), vj, preferred_element_type=acc)
    return out.reshape(b, s, h, d)


def _apply_t(p: Array, x: Array, kv: int, acc) -> Array:
    """``[B, block, Hkv, K]``: the transpose of ``_apply``: ``pᵀ x`` summed over each group."""
    b, h, s, n = p.shape
    if kv == h:
        return jnp.einsum("bhqs,bqhk->bshk", p, x, preferred_element_type=acc)
    xg = x.reshape(b, s, kv, h // kv, x.shape[-1])
    return jnp.einsum("bhgqs,bqhgk->bshk", _grouped(p, kv), xg, preferred_element_type=acc)


def _key_blocks(k, v, block, pos):
    """The scan's inputs: keys and values in blocks, block indices and (by position) the
    queries' positions with each block's keys'."""
    n = -(-k.shape[1] // block)
    if pos is None:
        return (_blocks(k, block), _blocks(v, block), jnp.arange(n), None)
    q_pos, k_pos = pos
    k_pos = jnp.pad(k_pos, (0, n * block - k_pos.shape[0])).reshape(n, block)
    return (_blocks(k, block), _blocks(v, block), jnp.arange(n), k_pos)


def _block_valid(s, block, j, causal, kj_pos, pos):
    return _valid(s, block, j, causal, None if pos is None else (pos[0], kj_pos))


def softmax_start(q: Array) -> tuple[Array, Array, Array]:
    """The online softmax's carry before any key: row maximum ``[B, H, S]`` (-inf), row sum
    ``[B, H, S]`` and unnormalised output ``[B, S, H, K]`` (zeros), in ``q``'s wide dtype."""
    b, s, h, d = q.shape
    acc = wide(q.dtype)
    return (
        jnp.full((b, h, s), -jnp.inf, acc),
        jnp.zeros((b, h, s), acc),
        jnp.zeros((b, s, h, d), acc),
    )


def online_softmax(q, k, v, causal, block, pos, carry, in_map=False):
    """The online softmax continued over ``k``, ``v``'s blocks from ``carry``
    (``softmax_start``'s or an earlier call's): keys may arrive in several calls (a ring of
    devices, ``jaxmem.step.ring``). ``causal``/``pos`` as ``_valid``; every query row must
    see a key in the first block of the first call. ``in_map``: called inside ``shard_map``
    (as with ``pos``: each step checkpointed, below)."""
    sk = k.shape[1]
    block = min(block, sk)
    acc = wide(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[3])

    def step(carry, xs):
        m, row_sum, o = carry  # [B, H, S], [B, H, S], [B, S, H, K] (fp32)
        kj, vj, j, kj_pos = xs
        valid = _block_valid(sk, block, j, causal, kj_pos, pos)
        sc = jnp.where(valid, _scores(q, kj, scale, acc), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        # every row sees a key in the first block it is given (key 0 under causal masking; the
        # ring's first call is its diagonal), so m_new is finite from then on and
        # exp(-inf - m_new) is an exact 0
        p = jnp.exp(sc - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        row_sum = row_sum * rescale + jnp.sum(p, axis=-1)
        pv = _apply(p.astype(v.dtype), vj, acc)
        o = o * jnp.moveaxis(rescale, 1, 2)[..., None] + pv
        return (m_new, row_sum, o), None

    if pos is not None or in_map:
        # inside shard_map (context parallelism) JAX partially evaluates this scan: each key
        # block's mask, a function of positions (or block indices) alone, would be stacked for
        # every block ([n, B, H, S, block] booleans); a checkpointed step keeps only its inputs
        step = jax.checkpoint(step, prevent_cse=False)
    carry, _ = jax.lax.scan(step, carry, _key_blocks(k, v, block, pos))
    return carry


def softmax_finish(carry, dtype) -> tuple[Array, Array]:
    """The attention output ``[B, S, H, K]`` in ``dtype`` and the row log-sum-exp
    ``[B, H, S]`` (wide) of a finished online softmax."""
    m, row_sum, o = carry
    out = (o / jnp.moveaxis(row_sum, 1, 2)[..., None]).astype(dtype)
    return out, m + jnp.log(row_sum)


def _flash_fwd(q, k, v, causal, block, pos=None):
    b, s, h, d = q.shape
    carry = online_softmax(q, k, v, causal, block, pos, softmax_start(q))
    out, lse = softmax_finish(carry, q.dtype)
    out = checkpoint_name(out.reshape(b, s, h * d), "attn_context")
    lse = checkpoint_name(lse, "attn_lse")
    return out, (q, k, v, out, lse, pos)


def softmax_delta(g: Array, out: Array) -> Array:
    """``D_i = sum_k dO_ik O_ik`` (``[B, H, S]``, wide): the softmax backward's row term, from
    the output's gradient and the output (``[B, S, H, K]`` each)."""
    acc = wide(out.dtype)
    return jnp.moveaxis(jnp.sum(g.astype(acc) * out.astype(acc), axis=-1), 2, 1)


def attention_grads(q, k, v, g, lse, delta, causal, block, pos, kv_dtype):
    """FlashAttention-2's backward of queries ``q`` against one set of keys and values, given
    the rows' final ``lse`` and ``delta`` (over every key they attend to, wherever it is):
    ``dq`` (``[B, S, H, K]``, wide; a sum over key sets) and ``dk``, ``dv`` (``[B, Sk, Hkv,
    K]`` in ``kv_dtype``). ``g``: the output's gradient ``[B, S, H, K]`` in ``q``'s dtype."""
    b, s, h, d = q.shape
    sk, kv = k.shape[1], k.shape[2]
    block = min(block, sk)
    acc = wide(q.dtype)
    scale = 1.0 / math.sqrt(d)
    n = -(-sk // block)

    def step(dq, xs):
        kj, vj, j, kj_pos = xs
        valid = _block_valid(sk, block, j, causal, kj_pos, pos)
        p = jnp.where(valid, jnp.exp(_scores(q, kj, scale, acc) - lse[..., None]), 0.0)
        dv = _apply_t(p.astype(g.dtype), g, kv, acc)
        dp = _scores(g, vj, None, acc)
        ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
        dq = dq + _apply(ds, kj, acc)
        dk = _apply_t(ds, q, kv, acc)
        # each key block's gradients are whole after its step: cast now, not after stacking
        # (the same values; the stack of every block's is half the bytes)
        return dq, (dk.astype(kv_dtype), dv.astype(kv_dtype))

    xs = _key_blocks(k, v, block, pos)
    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros((b, s, h, d), acc), xs)

    def unblock(x):  # [N, B, block, Hkv, K] -> [B, S, Hkv, K]
        return jnp.moveaxis(x, 0, 1).reshape(b, n * block, kv, d)[:, :sk]

    return dq, unblock(dk), unblock(dv)


def _flash_bwd(causal, block, res, g):
    q, k, v, out, lse, pos = res
    b, s, h, d = q.shape
    g = g.reshape(b, s, h, d).astype(q.dtype)
    delta = softmax_delta(g, out.reshape(b, s, h, d))
    dq, dk, dv = attention_grads(q, k, v, g, lse, delta, causal, block, pos, k.dtype)
    grads = dq.astype(q.dtype), dk, dv
    return grads if pos is None else (*grads, None, None)  # positions: integers, no gradient


flash_attention.defvjp(_flash_fwd, _flash_bwd)


def _flash_at_fwd(q, k, v, q_pos, k_pos, block):
    return _flash_fwd(q, k, v, True, block, (q_pos, k_pos))


def _flash_at_bwd(block, res, g):
    return _flash_bwd(True, block, res, g)


flash_attention_at.defvjp(_flash_at_fwd, _flash_at_bwd)

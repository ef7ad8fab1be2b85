"""Context parallelism: each row's sequence split over the mesh's context axis (``--mesh cp=N``),
attention by all-gathering keys and values over it (or, ``--cp-attention ring``, by passing them
round a ring of the devices: ``jaxmem.step.ring``).

Layout (causal load balance, as torchtitan and Megatron lay it out): the sequence is cut into
``2 cp`` chunks and device ``i`` holds chunks ``i`` and ``2 cp - 1 - i``, so every device holds
as many early (cheap under a causal mask) as late (expensive) queries. The step permutes the
batch's token ids, targets and mask into that order once, as the loss starts (``balanced_order``;
a gather of int32 ids), and hands the model a ``SequenceLayout``: the permuted positions
(position embeddings and RoPE follow them) and the attention core below. Everything else in the
block is per token, so XLA's partitioner keeps activations ``[B, S/cp, D]`` on each device; the
loss is a sum over tokens, unchanged by the permutation.

Attention (``attend``): inside ``shard_map`` over the mesh, each device all-gathers the keys and
values of its context group (``[B, S, Hkv, K]``), puts them back in position order, and runs its
own ``[B, S/cp, ...]`` queries against them, causal by position: the naive core
(``jaxmem.model.decoder.naive_attention``) or the blockwise fused kernel
(``jaxmem.model.flash.flash_attention_at``), as ``ModelConfig.attention`` asks. The backward of
the all-gather is a reduce-scatter of the keys' and values' gradients.

Why all-gather by default and not a ring (Ring Attention; torch's ``context_parallel``
default): Llama 3's choice (Dubey et al. 2024, section 3.3.2). Under grouped-query attention K
and V are ``Hkv / H`` of the queries' size (Llama-3-8B: a quarter), so gathering them whole
costs less than the queries' activations it saves; one collective per block instead of
``cp - 1`` point-to-point steps, any attention kernel runs unchanged on the gathered keys (a ring
needs a kernel that merges partial softmaxes), and the mask is one comparison of positions. What it
costs: each device holds the whole ``[B, S, Hkv, K]`` keys and values of one block while it
attends (a ring holds ``2 / cp`` of them), and the gather is not overlapped with compute. Where
that is the peak (the longest sequences), ``--cp-attention ring`` trades it for ``cp - 1``
point-to-point steps and computes only the blocks a causal mask leaves (``jaxmem.step.ring``).

The balance: on the gathered keys jaxmem's own kernels compute every key block, masked ones
included (as naive attention computes the whole ``[S, S]``), so each device does ``S/cp x S``
score work in any layout (the ring computes only what the mask leaves); a kernel that skips
masked blocks (cuDNN's, FlashAttention's) gets the balanced layout's equal work. Written by
hand because JAX has no context-parallel attention (MaxText's is part of its own model, not a
library).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem import parallel
from jaxmem.model.decoder import naive_attention
from jaxmem.model.flash import flash_attention_at
from jaxmem.model.sequence import SequenceLayout
from jaxmem.sharding import AXIS, CONTEXT, TENSOR
from jaxmem.step.ring import ring_attention

# the batch fields that are ``[B, S]`` per-token arrays (permuted with the tokens)
TOKEN_FIELDS = ("inputs", "targets", "mask")


def balanced_order(seq_len: int, cp: int) -> np.ndarray:
    """``jaxmem.parallel.balanced_order`` as an array: ``[S]`` positions in held order."""
    return np.asarray(parallel.balanced_order(seq_len, cp))


def attend_fn(m: Mesh, attention: str, block: int, seq_len: int, how: str = "gather"):
    """``attend(q, k, v, q_pos)``: the context-parallel attention core over mesh ``m``, keys
    and values all-gathered (``how="gather"``) or passed round a ring (``"ring"``:
    ``jaxmem.step.ring``, the blockwise kernel's online softmax)."""
    cp = m.shape[CONTEXT]
    order = balanced_order(seq_len, cp)
    restore = np.argsort(order)  # gathered keys (held order) -> position order

    def local(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array) -> jax.Array:
        if how == "ring":  # positions follow from the balanced layout: each step's are static
            return ring_attention(q, k, v, CONTEXT, cp, block)
        # [B, S/cp, ...] queries of this device; keys and values of the whole row, in order
        k = jax.lax.all_gather(k, CONTEXT, axis=1, tiled=True)[:, restore]  # [B, S, Hkv, K]
        v = jax.lax.all_gather(v, CONTEXT, axis=1, tiled=True)[:, restore]
        k_pos = jnp.arange(seq_len)
        if attention == "fused":
            return flash_attention_at(q, k, v, q_pos, k_pos, block)
        return naive_attention(q, k, v, q_pos[:, None] >= k_pos[None, :])

    # [B, S, heads, K]: rows over the data axis, the sequence over the context axis, and with a
    # tensor axis each device's whole key/value heads and their query heads
    rows = P(AXIS, CONTEXT, TENSOR) if TENSOR in m.axis_names else P(AXIS, CONTEXT)
    return jax.shard_map(
        local,
        mesh=m,
        in_specs=(rows, rows, rows, P(CONTEXT)),
        out_specs=rows,
        check_vma=False,
    )


def layout(
    m: Mesh, attention: str, block: int, seq_len: int, how: str = "gather"
) -> SequenceLayout:
    """The ``SequenceLayout`` the model runs under over ``m``'s context axis: the balanced
    order's positions and ``attend_fn``'s core (``how``: ``ParallelConfig.cp_attention``);
    sequence tiles tile each device's share."""
    order = balanced_order(seq_len, m.shape[CONTEXT])
    core = attend_fn(m, attention, block, seq_len, how)
    positions = jnp.asarray(order, jnp.int32)
    attend = partial(_attend, core, positions)
    return SequenceLayout(positions=order, attend=attend, shards=m.shape[CONTEXT])


def _attend(core: Any, positions: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array):
    return core(q, k, v, positions)


def permuted_loss(loss: Any, m: Mesh, seq_len: int) -> Any:
    """``loss(params, batch)`` run on the batch's token fields permuted into the balanced
    order and split over the context axis (rows over the data axis), once, as it starts."""
    order = balanced_order(seq_len, m.shape[CONTEXT])
    split = NamedSharding(m, P(AXIS, CONTEXT))

    def wrapped(params: Any, batch: dict[str, jax.Array]) -> Any:
        moved = {
            k: jax.lax.with_sharding_constraint(v[:, order], split)
            for k, v in batch.items()
            if k in TOKEN_FIELDS
        }
        return loss(params, {**batch, **moved})

    return wrapped

"""A decoder-only transformer in Flax NNX.

The model is pure: it knows nothing of remat, host offload, precision policy or gradient
accumulation. It only *tags* its intermediate tensors with ``checkpoint_name`` (the names in
``jaxmem.policy.CHECKPOINT_NAMES``, a pure-data module both frameworks share); memory policies
are applied from outside by passing a ``layers_fn`` that decides how the stacked blocks are run
(see ``scan_layers``, the default; ``jaxmem.memory.remat`` builds the others).

Shapes in comments: B batch, S sequence, D d_model, H heads, Hkv key/value heads (grouped-query
attention: G = H / Hkv query heads share each), K head_dim, F d_ff, V vocab, L layers.

Architecture is data (``ModelConfig``): LayerNorm or RMSNorm, learned positions or RoPE, a
standard or gated MLP, grouped-query attention, biases per part; GPT-2 and Llama are presets.
Low-rank adapters (``AdapterConfig``) add ``nnx.LoRA`` parameters beside the projections they
target (see ``lora_delta``), and in training their inputs dropped out by masks drawn from keys
the step passes in (``AdapterDropout``); which parameters train is the step's business, not the
model's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jaxmem.model.ops as ops
from jaxmem.adapters import TARGETS, AdapterConfig
from jaxmem.config import ModelConfig
from jaxmem.model.flash import cudnn_installed, fused_attention, fused_kernel
from jaxmem.model.ops import wide
from jaxmem.model.sequence import RopeTables, SequenceLayout, rope_tables
from jaxmem.precision import Precision

Array = jax.Array
# Where the stacked block parameters sit in ``nnx.split(decoder, nnx.Param)[1]``: what a
# ``layers_fn`` receives as ``stacked_state`` (gradient accumulation adds into this subtree).
STACK_PATH: tuple[str, ...] = ("blocks", "layers")

# ``layer_fn(x, layer_state, mlp=None)``: one block; ``mlp`` (an ``MlpFn``) runs its MLP
LayerFn = Callable[..., Array]
# ``mlp(ffn, x_bsd, dropout)``: how a block applies its ``FeedForward`` (default: ``ffn(x,
# dropout)``); a memory policy's sequence tiling passes its own (``jaxmem.memory.remat``)
MlpFn = Callable[["FeedForward", Array, "AdapterDropout | None"], Array]
# ``layers_fn(layer_fn, x, stacked_state)``; ``x`` is the first block's input or, for a
# ``layers_fn`` whose ``replays_embedding`` attribute is true, the embedding lookup that makes it,
# not yet run (``EmbeddingLookup``; ``materialize(x)`` runs it)
LayersFn = Callable[[LayerFn, Any, Any], Array]


def embed_tokens(
    params: dict[str, Array], tokens_bs: Array, *, dtype: Any, positions: Any = None
) -> Array:
    """The embedding lookup: token embeddings (+ learned position embeddings), cast to the
    compute dtype: ``[B, S]`` ids -> ``[B, S, D]``. A gather and an addition: no matmul.
    ``positions`` (``[S]``): each column's position (``SequenceLayout``); default in order."""
    x = jnp.take(params["wte"], tokens_bs, axis=0)  # nnx.Embed's lookup
    if "wpe" in params:
        at = params["wpe"][: tokens_bs.shape[1]] if positions is None else params["wpe"][positions]
        x = x + at[None]
    return x.astype(dtype)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["params", "tokens", "positions"],
    meta_fields=["dtype"],
)
@dataclasses.dataclass(frozen=True)
class EmbeddingLookup:
    """The stack's input handed over unevaluated (``Decoder.features``, to a ``layers_fn`` whose
    ``replays_embedding`` attribute is true): the embedding tables and the token ids. It runs the
    lookup inside the first block's checkpoint, so that block's backward replays the lookup
    instead of keeping its output (``jaxmem.policy.EmbeddingReplay``). A pytree: it passes
    through ``jax.custom_vjp`` and ``jax.vjp``, its cotangent the tables' gradients."""

    params: dict[str, Array]
    tokens: Array
    dtype: Any
    positions: Any = None

    def __call__(self) -> Array:
        return embed_tokens(self.params, self.tokens, dtype=self.dtype, positions=self.positions)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.tokens.shape, self.params["wte"].shape[1])


def materialize(x: Any) -> Array:
    """The block input ``x`` stands for: the array itself, or its ``EmbeddingLookup`` run."""
    return x() if isinstance(x, EmbeddingLookup) else x


def _normal(std: float) -> nnx.Initializer:
    return nnx.initializers.normal(stddev=std)


def activation(name: str, x: Array, tag: str) -> Array:
    """The MLP non-linearity applied to ``x``, its output tagged ``tag``. ``gelu`` is exact (erf)
    like ``torch.nn.GELU()``; ``relu`` tags inside (see ``ops.relu``)."""
    if name == "relu":
        return ops.relu(x, tag)
    if name in ("gelu", "gelu_tanh"):
        return checkpoint_name(ops.gelu(x, name == "gelu_tanh"), tag)
    raise ValueError(f"activation={name!r} is not one of gelu, gelu_tanh, relu")


def _linear_kwargs(
    cfg: ModelConfig, part: str, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any
) -> dict:
    """Linear layers multiply in the compute dtype, accumulate and add the bias in fp32 (or
    wider), and round once (callers cast the result back): PyTorch's addmm under autocast does the
    same, and it keeps the bias gradient's reduction over batch and sequence in fp32. ``part``
    (``qkv``, ``out``, ``mlp``) says whose bias setting applies."""
    return dict(
        use_bias=cfg.has_bias(part),
        dtype=dtype,
        param_dtype=param_dtype,
        preferred_element_type=wide(dtype),
        rngs=rngs,
    )


# PEFT's init of A (``nn.init.kaiming_uniform_(a=sqrt(5))``, torch's nn.Linear default):
# U(-1/sqrt(in), 1/sqrt(in)); on A's [in, r] layout fan_in is ``in``
LORA_A_INIT = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
# the Rngs stream adapters draw from: adding adapters leaves the base's random init unchanged
LORA_STREAM = "lora"


def make_lora(
    adapters: AdapterConfig | None,
    target: str,
    d_in: int,
    d_out: int,
    *,
    rngs: nnx.Rngs,
    param_dtype: Any,
) -> nnx.LoRA | None:
    """The adapter on projection ``target`` (``d_in`` -> ``d_out``): Flax's ``nnx.LoRA``
    holding ``lora_a`` ``[in, r]`` (PEFT's init) and ``lora_b`` ``[r, out]`` (zeros), both
    ``nnx.LoRAParam``; None where ``adapters`` do not target it. Its keys come from the
    ``lora`` stream of ``rngs`` (``make_model`` adds it)."""
    if adapters is None or not adapters.enabled or target not in adapters.targets:
        return None
    return nnx.LoRA(
        d_in,
        adapters.rank,
        d_out,
        param_dtype=param_dtype,
        a_initializer=LORA_A_INIT,
        rngs=nnx.Rngs(params=getattr(rngs, LORA_STREAM)()),
    )


def lora_delta(lora: nnx.LoRA, x: Array, scale: float, dtype: Any) -> Array:
    """``scale * (x A) B`` in ``wide(dtype)``, what the adapter adds to its projection's output
    before the projection rounds: both products multiply in the compute dtype with fp32 (or
    wider) accumulation, as ``nnx.Linear`` does here. Written by hand because ``nnx.LoRA``'s
    own call multiplies in one promoted dtype with no accumulation type and no scale."""
    acc = wide(dtype)
    a_ir, b_ro = lora.lora_a[...].astype(dtype), lora.lora_b[...].astype(dtype)
    h = jnp.einsum("...i,ir->...r", x, a_ir, preferred_element_type=acc).astype(dtype)
    return jnp.einsum("...r,ro->...o", h, b_ro, preferred_element_type=acc) * scale


def adapted(
    y: Array,
    lora: nnx.LoRA | None,
    x: Array,
    scale: float,
    dtype: Any,
    dropout: AdapterDropout | None = None,
    target: str = "",
) -> Array:
    """A projection's wide output ``y`` of input ``x`` with its adapter's delta added (if any),
    the adapter reading ``dropout(x)`` when ``dropout`` is given (``target`` names the mask)."""
    if lora is None:
        return y
    return y + lora_delta(lora, x if dropout is None else dropout(x, target), scale, dtype)


# The batch field holding each row's dropout key (``[B, *key shape]``, ``jax.random.key_data``)
# for the adapters' dropout: the training step adds it (``jaxmem.step.frozen``); without it
# (evaluation, sampling, a rate of 0) no mask is drawn.
DROPOUT_KEYS = "lora_dropout_keys"


@dataclasses.dataclass(frozen=True)
class AdapterDropout:
    """Inverted dropout on the adapters' input in one block, as PEFT's ``lora_dropout`` (an
    ``nn.Dropout`` per adapted module): each element kept with probability ``1 - rate`` and
    multiplied by ``1 / (1 - rate)`` (in ``x``'s dtype, as torch does), else zero. The masks
    come from ``keys`` (``[B, *key shape]``: row ``b``'s key for this block) folded with the
    target's index, so each projection of each row of each block draws its own mask, and a
    recomputed block (any memory policy) draws the same one: no stateful RNG."""

    rate: float
    keys: Array
    # A window of the sequence (``window``): the masks of positions [start, start + x's length)
    # of a ``seq_len``-token row, so a sequence tile draws its slice of the whole row's masks.
    seq_len: int | None = None
    start: Array | int = 0

    def window(self, start: Array | int, seq_len: int) -> AdapterDropout:
        """This dropout for a tile of the sequence starting at ``start`` of a ``seq_len``-token
        row: the tile's elements get the whole row's masks at their positions."""
        return dataclasses.replace(self, seq_len=seq_len, start=start)

    def __call__(self, x: Array, target: str) -> Array:
        keep = 1.0 - self.rate
        part = TARGETS.index(target)

        def row_mask(key_data: Array, row: Array) -> Array:
            key = jax.random.fold_in(jax.random.wrap_key_data(key_data), part)
            if self.seq_len is None:
                return jax.random.bernoulli(key, keep, row.shape)
            # the whole row's mask, then this window's rows of it (drawn whole: a mask's bits
            # depend on its shape); a transient [S, in] boolean per projection
            whole = jax.random.bernoulli(key, keep, (self.seq_len, *row.shape[1:]))
            return jax.lax.dynamic_slice_in_dim(whole, self.start, row.shape[0])

        mask = jax.vmap(row_mask)(self.keys, x)
        return jnp.where(mask, x * jnp.asarray(1.0 / keep, x.dtype), jnp.zeros((), x.dtype))


def layer_dropout_keys(row_keys: Array, layer: Array) -> Array:
    """Each row's key (``[B, *key shape]``) folded with block ``layer`` (a float index: see
    ``BlockStack``), as key data."""
    index = layer.astype(jnp.int32)

    def one(key_data: Array) -> Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), index)
        return jax.random.key_data(key)

    return jax.vmap(one)(row_keys)


class LayerNorm(nnx.Module):
    """LayerNorm whose statistics and affine transform are always computed in fp32 (or wider).

    The output is cast back to the compute dtype. Written as a thin wrapper so the fp32 rule holds
    whatever compute dtype a precision policy picks (PyTorch autocast does the same on CUDA).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        self.dtype = dtype
        self.eps = cfg.layer_norm_eps
        # nnx.LayerNorm holds the parameters (scale, bias); the math is jaxmem.model.ops.layer_norm,
        # whose backward keeps only the input and per-row statistics.
        self.norm = nnx.LayerNorm(
            cfg.d_model,
            epsilon=cfg.layer_norm_eps,
            use_bias=cfg.has_bias("norm"),
            dtype=wide(dtype),
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: Array) -> Array:
        bias = None if self.norm.bias is None else self.norm.bias[...]
        return ops.layer_norm(x, self.norm.scale[...], bias, self.eps).astype(self.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm (Llama's) computed in fp32 (or wider) and cast back, like ``LayerNorm``; its
    parameter sits at the same path (``norm.scale``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        self.dtype = dtype
        self.eps = cfg.layer_norm_eps
        self.norm = nnx.RMSNorm(
            cfg.d_model,
            epsilon=cfg.layer_norm_eps,
            dtype=wide(dtype),
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: Array) -> Array:
        return ops.rms_norm(x, self.norm.scale[...], self.eps).astype(self.dtype)


def make_norm(cfg: ModelConfig, **kw: Any) -> LayerNorm | RMSNorm:
    return RMSNorm(cfg, **kw) if cfg.norm_type == "rmsnorm" else LayerNorm(cfg, **kw)


class SelfAttention(nnx.Module):
    """Multi-head self-attention with a fused QKV projection; the core (scores, softmax,
    context) naive or fused (``ModelConfig.attention``); keys and values ``n_kv_heads`` wide
    (grouped-query attention, each serving G query heads, never repeated in memory); RoPE on
    queries and keys when ``positions="rope"``.

    Parameters mirror ``torch.nn.MultiheadAttention``: ``in_proj`` ↔ ``in_proj_weight`` /
    ``in_proj_bias`` (q, k, v stacked in that order: D, Hkv·K, Hkv·K rows) and ``out_proj``.

    Adapters: ``lora_q``, ``lora_k``, ``lora_v`` (one per targeted part of the fused kernel, each
    added to its own columns of ``in_proj``'s output: [q | k | v] = D, Hkv·K, Hkv·K) and
    ``lora_o`` on ``out_proj``. One adapter per part, not one on the fused kernel, because that is
    what PEFT trains on a Hugging Face Llama's separate ``q_proj``, ``k_proj``, ``v_proj``: a
    rank-r adapter on the fused [D, D + 2 Hkv·K] kernel would be a different (shared-A) model.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype: Any,
        param_dtype: Any,
        attention_kernel: str = "blockwise",
        adapters: AdapterConfig | None = None,
    ):
        self.kernel = attention_kernel
        self.rotary = cfg.positions == "rope"
        self.n_heads = cfg.n_heads
        self.kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.dtype = dtype
        self.fused = cfg.attention == "fused"
        self.causal = cfg.causal
        self.block = cfg.attention_block
        d, kv = cfg.d_model, cfg.kv_dim
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        qkv = _linear_kwargs(cfg, "qkv", **kw)
        self.in_proj = nnx.Linear(d, d + 2 * kv, kernel_init=_normal(cfg.init_std), **qkv)
        # GPT-2: residual-branch output projections scaled by 1/sqrt(2 L).
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        out = _linear_kwargs(cfg, "out", **kw)
        self.out_proj = nnx.Linear(d, d, kernel_init=_normal(out_std), **out)
        lora = dict(rngs=rngs, param_dtype=param_dtype)
        self.lora_scale = adapters.scale if adapters is not None and adapters.enabled else 0.0
        self.lora_q = make_lora(adapters, "q", d, d, **lora)
        self.lora_k = make_lora(adapters, "k", d, kv, **lora)
        self.lora_v = make_lora(adapters, "v", d, kv, **lora)
        self.lora_o = make_lora(adapters, "o", d, d, **lora)

    def _qkv(self, x_bsd: Array, dropout: AdapterDropout | None = None) -> Array:
        """The fused projection's output in the compute dtype, ``[B, S, D + 2 Hkv K]``, each
        targeted part's adapter added to its columns before rounding (its input dropped out by
        its own mask under ``dropout``)."""
        qkv = self.in_proj(x_bsd)  # wide
        parts = (self.lora_q, self.lora_k, self.lora_v)
        if all(p is None for p in parts):
            return qkv.astype(self.dtype)
        d, kv = x_bsd.shape[-1], self.kv_heads * self.head_dim
        split = jnp.split(qkv, [d, d + kv], axis=-1)
        sc, dt = self.lora_scale, self.dtype
        split = [
            adapted(y, p, x_bsd, sc, dt, dropout, t)
            for y, p, t in zip(split, parts, "qkv", strict=True)
        ]
        return jnp.concatenate(split, axis=-1).astype(self.dtype)

    def _out(self, context: Array, dropout: AdapterDropout | None = None) -> Array:
        sc, dt = self.lora_scale, self.dtype
        y = adapted(self.out_proj(context), self.lora_o, context, sc, dt, dropout, "o")
        return checkpoint_name(y.astype(self.dtype), "attn_out")

    def __call__(
        self,
        x_bsd: Array,
        mask_ss: Array | None,
        rope: RopeTables = None,
        dropout: AdapterDropout | None = None,
        attend: Callable[[Array, Array, Array], Array] | None = None,
    ) -> Array:
        b, s, d = x_bsd.shape
        kv, hd = self.kv_heads, self.head_dim
        qkv = self._qkv(x_bsd, dropout)  # [B, S, D + 2 Hkv K]
        q, k, v = jnp.split(qkv, [d, d + kv * hd], axis=-1)
        # grouped heads, naive core: q as [B, S, Hkv, G, K] from the start, so the tensor the
        # scores' backward keeps is the tagged one (a reshape after tagging would be a second)
        grouped = kv < self.n_heads and not self.fused
        q_shape = (b, s, kv, self.n_heads // kv, hd) if grouped else (b, s, self.n_heads, hd)
        q = checkpoint_name(q.reshape(q_shape), "query_proj")
        k = checkpoint_name(k.reshape(b, s, kv, hd), "key_proj")  # [B, S, Hkv, K]
        v = checkpoint_name(v.reshape(b, s, kv, hd), "value_proj")
        if self.rotary:
            if rope is None:
                raise ValueError("positions='rope': call the block with RoPE's tables")
            q = checkpoint_name(ops.rope(q, *rope), "query_rope")
            k = checkpoint_name(ops.rope(k, *rope), "key_rope")
        if attend is not None:  # the step's core (``SequenceLayout.attend``)
            return self._out(attend(q, k, v), dropout)
        if self.fused:  # one op; its output and log-sum-exp are tagged inside (see flash)
            context = fused_attention(q, k, v, self.causal, self.block, self.kernel)  # [B, S, D]
            return self._out(context, dropout)
        return self._out(naive_attention(q, k, v, mask_ss), dropout)


def naive_attention(q: Array, k: Array, v: Array, mask: Array | None) -> Array:
    """The naive core: ``[B, Sq, D]`` context of q (``[B, Sq, H, K]``; grouped ``[B, Sq, Hkv,
    G, K]``) over k, v ``[B, Sk, Hkv, K]``, ``mask`` ``[Sq, Sk]`` (True: may attend; None: all);
    scores and softmax (tagged) in fp32 or wider whatever the compute dtype (q's)."""
    b, s = q.shape[:2]
    acc = wide(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = _scores(q, k, acc) * scale  # [B, H, Sq, Sk] (grouped: [B, Hkv, G, Sq, Sk])
    if mask is not None:
        # An additive [Sq, Sk] bias: its backward needs nothing (a where() would keep a
        # [B, H, Sq, Sk] broadcast of the mask for the backward pass).
        scores = scores + jnp.where(mask, 0.0, jnp.finfo(acc).min)
    scores = checkpoint_name(scores, "attn_scores")
    probs = ops.softmax(scores, q.dtype, "attn_probs")  # tagged inside (see ops)
    context = _context(probs, v).reshape(b, s, -1)  # [B, Sq, D]
    return checkpoint_name(context, "attn_context")


def _scores(q: Array, k: Array, acc: Any) -> Array:
    """q·kᵀ: ``[B, H, S, S]``; under grouped-query attention (q ``[B, S, Hkv, G, K]``) each key
    head scores its group of query heads, ``[B, Hkv, G, S, S]``, with no copy of the keys (the
    scores, probabilities and their tags keep that layout: the same bytes, and no reshape whose
    output the backward would keep beside the tagged tensor)."""
    if q.ndim == 4:
        return jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=acc)
    return jnp.einsum("bqhgk,bshk->bhgqs", q, k, preferred_element_type=acc)


def _context(probs: Array, v: Array) -> Array:
    """``[B, S, H, K]`` (grouped: ``[B, S, Hkv, G, K]``): the probabilities applied to v."""
    if probs.ndim == 4:
        return jnp.einsum("bhqs,bshk->bqhk", probs, v)
    return jnp.einsum("bhgqs,bshk->bqhgk", probs, v)


class FeedForward(nnx.Module):
    """The MLP. Standard: ``down(act(up(x)))``, ``up`` ↔ PyTorch ``ffn.0``, ``down`` ↔
    ``ffn.2`` (``ffn.1`` is the activation). Gated (``mlp="gated"``; SwiGLU with ``silu``):
    ``down(act(gate(x)) * up(x))``. Adapters: ``lora_gate``, ``lora_up``, ``lora_down``."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype: Any,
        param_dtype: Any,
        adapters: AdapterConfig | None = None,
    ):
        common = _linear_kwargs(cfg, "mlp", rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.dtype = dtype
        self.gated = cfg.mlp == "gated"
        if self.gated:
            init = _normal(cfg.init_std)
            self.gate = nnx.Linear(cfg.d_model, cfg.d_ff, kernel_init=init, **common)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, kernel_init=_normal(cfg.init_std), **common)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, kernel_init=_normal(out_std), **common)
        self.activation = cfg.activation
        d, f = cfg.d_model, cfg.d_ff
        lora = dict(rngs=rngs, param_dtype=param_dtype)
        self.lora_scale = adapters.scale if adapters is not None and adapters.enabled else 0.0
        self.lora_gate = make_lora(adapters, "gate", d, f, **lora) if self.gated else None
        self.lora_up = make_lora(adapters, "up", d, f, **lora)
        self.lora_down = make_lora(adapters, "down", f, d, **lora)

    def _proj(self, name: str, x: Array, dropout: AdapterDropout | None = None) -> Array:
        """Projection ``name`` of ``x`` (its adapter added), rounded to the compute dtype."""
        lora, sc, dt = getattr(self, f"lora_{name}"), self.lora_scale, self.dtype
        return adapted(getattr(self, name)(x), lora, x, sc, dt, dropout, name).astype(dt)

    def __call__(self, x_bsd: Array, dropout: AdapterDropout | None = None) -> Array:
        if self.gated:
            g = checkpoint_name(self._proj("gate", x_bsd, dropout), "mlp_gate")  # [B, S, F]
            u = checkpoint_name(self._proj("up", x_bsd, dropout), "mlp_up")
            h = checkpoint_name(ops.gated(g, u, self.activation), "mlp_act")
        else:
            h = checkpoint_name(self._proj("up", x_bsd, dropout), "mlp_up")  # [B, S, F]
            h = activation(self.activation, h, "mlp_act")
        return checkpoint_name(self._proj("down", h, dropout), "mlp_down")  # [B, S, D]


class Block(nnx.Module):
    """One decoder block; parameter names mirror the seeds' PyTorch ``DecoderLayer``."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        attention_kernel: str = "blockwise",
        adapters: AdapterConfig | None = None,
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.pre_norm = cfg.norm == "pre"
        self.dtype = dtype
        self.self_attn = SelfAttention(
            cfg, attention_kernel=attention_kernel, adapters=adapters, **kw
        )
        self.ffn = FeedForward(cfg, adapters=adapters, **kw)
        self.norm1 = make_norm(cfg, **kw)
        self.norm2 = make_norm(cfg, **kw)

    def __call__(
        self,
        x_bsd: Array,
        mask_ss: Array | None,
        rope: RopeTables = None,
        dropout: AdapterDropout | None = None,
        mlp: MlpFn | None = None,
        attend: Callable[[Array, Array, Array], Array] | None = None,
    ) -> Array:
        """The block on ``x_bsd``; ``mlp`` (an ``MlpFn``) says how its MLP runs (default: at
        once over the whole sequence)."""
        ffn = self.ffn if mlp is None else functools.partial(mlp, self.ffn)
        x = checkpoint_name(x_bsd.astype(self.dtype), "block_input")
        attn = functools.partial(self.self_attn, attend=attend)
        if self.pre_norm:  # GPT-2, Llama: x + f(norm(x))
            h = checkpoint_name(self.norm1(x), "norm1_out")
            x = checkpoint_name(x + attn(h, mask_ss, rope, dropout), "attn_residual")
            h = checkpoint_name(self.norm2(x), "norm2_out")
            return checkpoint_name(x + ffn(h, dropout), "mlp_residual")
        # Post-norm (the seeds' DecoderLayer): norm(x + f(x)).
        x = checkpoint_name(x + attn(x, mask_ss, rope, dropout), "attn_residual")
        x = checkpoint_name(self.norm1(x), "norm1_out")
        x = checkpoint_name(x + ffn(x, dropout), "mlp_residual")
        return checkpoint_name(self.norm2(x), "norm2_out")


def scan_layers(layer_fn: LayerFn, x_bsd: Array, stacked_state: Any) -> Array:
    """Run ``layer_fn`` over the leading (layer) axis of ``stacked_state`` with ``lax.scan``.

    The body returns only the carry: returning the (read-only) layer parameters would make scan
    stack a second [L, params] copy of them.
    """

    def body(x, layer_state):
        return layer_fn(x, layer_state), None

    x_bsd, _ = jax.lax.scan(body, materialize(x_bsd), stacked_state)
    return x_bsd


def causal_mask(cfg: ModelConfig, seq_len: int) -> Array | None:
    """``[S, S]`` boolean mask (True = may attend), or None when attention is not causal."""
    if not cfg.causal:
        return None
    return jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))


class BlockStack(nnx.Module):
    """``n_layers`` blocks with parameters stacked on a leading layer axis.

    Usable on its own: ``[B, S, D] -> [B, S, D]`` (the seeds' single-layer example runs on this).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        attention_kernel: str = "blockwise",
        adapters: AdapterConfig | None = None,
    ):
        self.cfg = cfg
        self.dropout = adapters.dropout if adapters is not None and adapters.enabled else 0.0

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> Block:
            kw = dict(dtype=dtype, param_dtype=param_dtype, attention_kernel=attention_kernel)
            return Block(cfg, rngs=rngs, adapters=adapters, **kw)

        self.layers = make_layers(rngs)

    def __call__(
        self,
        x_bsd: Array,
        *,
        layers_fn: LayersFn | None = None,
        dropout_keys: Array | None = None,
        layout: SequenceLayout | None = None,
    ) -> Array:
        """Apply every block. ``layers_fn(layer_fn, x, stacked_state)`` decides how (default:
        ``scan_layers``); memory policies pass their own (see ``jaxmem.memory.remat``).

        ``dropout_keys`` (``[B, *key shape]``, with a dropout rate): the adapters' inputs are
        dropped out (``AdapterDropout``). Each block's keys are the rows' folded with its index,
        which travels with its parameters as a float ``[L]`` leaf of the stacked state (a
        ``layers_fn`` slices it like a weight; a float, so a custom VJP's cotangent for it is
        an ordinary zero). ``layout``: the sequence held in another order, and attended by
        its core (``SequenceLayout``)."""
        seq_len = x_bsd.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        # fused attention masks by position inside its kernel: no [S, S] mask array
        naive = self.cfg.attention == "naive" and layout is None
        mask_ss = causal_mask(self.cfg, seq_len) if naive else None
        at, attend = (None, None) if layout is None else (layout.positions, layout.attend)
        shards = {} if layout is None or layout.shards == 1 else {"shards": layout.shards}
        rope = rope_tables(self.cfg, seq_len, x_bsd.dtype, at)  # an EmbeddingLookup's too
        graphdef, stacked_state = nnx.split(self.layers)
        run = layers_fn or scan_layers
        if dropout_keys is None or not self.dropout:

            def layer_fn(x, layer_state, mlp=None):
                mlp = functools.partial(mlp, **shards) if mlp and shards else mlp
                block = nnx.merge(graphdef, layer_state)
                return block(x, mask_ss, rope, mlp=mlp, attend=attend)

            return run(layer_fn, x_bsd, stacked_state)

        def dropped_layer_fn(x, layer, mlp=None):
            layer_state, index = layer
            drop = AdapterDropout(self.dropout, layer_dropout_keys(dropout_keys, index))
            return nnx.merge(graphdef, layer_state)(x, mask_ss, rope, drop, mlp=mlp, attend=attend)

        index = jnp.arange(self.cfg.n_layers, dtype=jnp.float32)
        return run(dropped_layer_fn, x_bsd, (stacked_state, index))


class Decoder(nnx.Module):
    """Token embeddings (+ learned position embeddings, or RoPE inside the blocks), a
    ``BlockStack``, optional final norm, LM head; with enabled ``adapters``, LoRA adapters on
    the projections they target (``rngs`` then needs a ``lora`` stream: ``make_model``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        attention_kernel: str = "blockwise",
        adapters: AdapterConfig | None = None,
    ):
        self.cfg = cfg
        self.adapters = adapters if adapters is not None and adapters.enabled else None
        self.dtype = dtype
        self.attention_kernel = attention_kernel if cfg.attention == "fused" else "naive"
        emb = dict(embedding_init=_normal(cfg.init_std), param_dtype=param_dtype, rngs=rngs)
        self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, **emb)
        self.wpe = nnx.Embed(cfg.max_seq_len, cfg.d_model, **emb) if cfg.learned_positions else None
        self.blocks = BlockStack(
            cfg,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            attention_kernel=attention_kernel,
            adapters=self.adapters,
        )
        self.norm_f = (
            make_norm(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
            if cfg.final_norm
            else None
        )
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else nnx.Linear(
                cfg.d_model,
                cfg.vocab_size,
                use_bias=False,
                kernel_init=_normal(cfg.init_std),
                dtype=dtype,
                param_dtype=param_dtype,
                preferred_element_type=wide(dtype),  # compute-dtype inputs, fp32 logits
                rngs=rngs,
            )
        )

    def __call__(
        self,
        tokens_bs: Array,
        *,
        layers_fn: LayersFn | None = None,
        dropout_keys: Array | None = None,
        layout: SequenceLayout | None = None,
    ) -> Array:
        """Token ids ``[B, S]`` → logits ``[B, S, V]`` in fp32 (float64 for a float64 model)."""
        head, head_params = self.head()
        x = self.features(tokens_bs, layers_fn=layers_fn, dropout_keys=dropout_keys, layout=layout)
        return head(head_params, x)

    def features(
        self,
        tokens_bs: Array,
        *,
        layers_fn: LayersFn | None = None,
        dropout_keys: Array | None = None,
        layout: SequenceLayout | None = None,
    ) -> Array:
        """Token ids ``[B, S]`` → the block stack's output ``[B, S, D]`` (compute dtype), what
        the head (``head``) turns into logits. ``dropout_keys``: each row's key for the
        adapters' dropout (training only; ``BlockStack``); ``layout``: the columns' positions
        and the attention core (``SequenceLayout``)."""
        seq_len = tokens_bs.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        x = self.embedding(tokens_bs, None if layout is None else layout.positions)
        replays = getattr(layers_fn, "replays_embedding", False)
        kw = dict(layers_fn=layers_fn, dropout_keys=dropout_keys, layout=layout)
        return self.blocks(x if replays else x(), **kw)

    def embedding(self, tokens_bs: Array, positions: Any = None) -> EmbeddingLookup:
        """The embedding lookup of ``tokens_bs``, not yet run: the stack's input as
        ``features`` hands it to the ``layers_fn`` (which may replay it in the first block's
        backward instead of keeping its output)."""
        params = {"wte": self.wte.embedding[...]}
        if self.wpe is not None:
            params["wpe"] = self.wpe.embedding[...]
        return EmbeddingLookup(params, tokens_bs, jnp.dtype(self.dtype), positions)

    def head(self) -> tuple[HeadFn, dict[str, Array]]:
        """The final norm and LM head as a pure function and its parameters:
        ``fn(head_params, x_bsd) -> logits_bsv`` (fp32, or float64 for a float64 model).

        ``head_params`` holds the parameters as they are (the final norm's scale and bias, the
        tied embedding table or the head's kernel), so a loss that runs the head itself
        (``jaxmem.model.loss.chunked_lm_loss``) differentiates them like any other use."""
        params: dict[str, Array] = {}
        if self.norm_f is not None:
            params["norm_scale"] = self.norm_f.norm.scale[...]
            if getattr(self.norm_f.norm, "bias", None) is not None:
                params["norm_bias"] = self.norm_f.norm.bias[...]
        if self.lm_head is None:
            params["table"] = self.wte.embedding[...]  # [V, D]
        else:
            params["kernel"] = self.lm_head.kernel[...]  # [D, V]
        fn = functools.partial(
            head_logits,
            norm_type=None if self.norm_f is None else self.cfg.norm_type,
            eps=self.cfg.layer_norm_eps,
            dtype=self.dtype,
        )
        return fn, params


HeadFn = Callable[[dict[str, Array], Array], Array]


def head_logits(
    params: dict[str, Array], x_bsd: Array, *, norm_type: str | None, eps: float, dtype: Any
) -> Array:
    """The final norm (if any) and the LM head of ``Decoder.head``: the norm computed in fp32 and
    cast back, the head multiplying in the compute dtype with fp32 accumulation, as the blocks'
    linear layers do."""
    x = x_bsd
    if norm_type == "rmsnorm":
        x = ops.rms_norm(x, params["norm_scale"], eps).astype(dtype)
    elif norm_type is not None:
        x = ops.layer_norm(x, params["norm_scale"], params.get("norm_bias"), eps).astype(dtype)
    acc = wide(dtype)
    if "table" in params:
        table = params["table"].astype(dtype)  # [V, D]
        logits = jnp.einsum("bsd,vd->bsv", x, table, preferred_element_type=acc)
    else:  # nnx.Linear's own contraction of a [D, V] kernel
        kernel = params["kernel"].astype(dtype)
        logits = jax.lax.dot_general(
            x, kernel, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=acc
        )
    return logits.astype(acc)


def make_model(
    cfg: ModelConfig,
    precision: Precision | None = None,
    *,
    seed: int = 0,
    platform: str | None = None,
    adapters: AdapterConfig | None = None,
) -> Decoder:
    """A ``Decoder`` whose parameters are stored and computed in ``precision``'s dtypes (default
    fp32), initialised from ``seed``. Fused attention runs cuDNN's kernel on an NVIDIA GPU where
    it applies (``platform``: the backend the step runs or is planned on; default this
    process's), the blockwise kernel elsewhere (``Decoder.attention_kernel`` says which).
    ``adapters`` (enabled): LoRA adapters too, drawn from their own stream of ``seed`` (the
    base's initial weights are the same with or without them)."""
    p = precision or Precision(name="fp32")
    compute = jnp.dtype(p.compute_dtype)
    where = platform or jax.devices()[0].platform
    kernel = fused_kernel(cfg.head_dim, compute, where, cudnn_installed())
    enabled = adapters is not None and adapters.enabled
    streams = {LORA_STREAM: jax.random.fold_in(jax.random.key(seed), 1)} if enabled else {}
    return Decoder(
        cfg,
        rngs=nnx.Rngs(seed, **streams),
        dtype=compute,
        param_dtype=jnp.dtype(p.param_dtype),
        attention_kernel=kernel,
        adapters=adapters,
    )

"""The jaxmem decoder in plain eager PyTorch.

Module and parameter names mirror ``jaxmem.model``; for the seeds' configuration (post-norm, ReLU,
biases) a ``Block``'s state dict has exactly the keys of the seeds' ``DecoderLayer``
(``self_attn.in_proj_weight``, ``ffn.0.weight``, ``norm1.weight``, ...), so a user's checkpoint of
that module loads with ``strict=True``.

Llama-family blocks are the same data (``ModelConfig``) as in jaxmem, written the way gpt-fast and
torchtitan write them: ``nn.RMSNorm``, RoPE on q and k in fp32 (rotate-half layout, from
``jaxmem.positions``' float64 tables, so both frameworks rotate by the same numbers up to
65,536 positions; beyond, jaxmem builds its tables in the step, within a rounding or two),
grouped-query attention, and the gated MLP as ``down(F.silu(gate(x)) * up(x))``.

Shapes in comments: B batch, S sequence, D d_model, H heads, Hkv key/value heads (G = H / Hkv
query heads share each), K head_dim, F d_ff, V vocab.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from jaxmem.config import ModelConfig
from jaxmem.positions import rope_angles
from torch_ref.dtypes import wide
from torch_ref.loss import chunked_lm_loss, cross_entropy_sum

RopeTables = tuple[torch.Tensor, torch.Tensor]  # RoPE's cos, sin: [S, K] each, wide dtype


def activation_module(name: str) -> nn.Module:
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if name == "relu":
        return nn.ReLU()
    raise ValueError(f"activation={name!r} is not one of gelu, gelu_tanh, relu")


class EmbeddingLookup:
    """The stack's input handed over unevaluated (``Decoder.features``, when the stack's runner
    asks with ``replays_embedding``): ``embed(tokens)`` run inside the first block's checkpoint,
    so its backward replays the lookup instead of keeping its output
    (``jaxmem.policy.EmbeddingReplay``). Carries what ``BlockStack.forward`` reads of its
    input: shape, dtype (the compute dtype), device."""

    def __init__(
        self,
        embed: Callable[[torch.Tensor], torch.Tensor],
        tokens: torch.Tensor,
        d_model: int,
        dtype: torch.dtype,
    ):
        self.embed, self.tokens, self.dtype = embed, tokens, dtype
        self.shape = (*tokens.shape, d_model)
        self.device = tokens.device

    def __call__(self) -> torch.Tensor:
        return self.embed(self.tokens)


def materialize(x: torch.Tensor | EmbeddingLookup) -> torch.Tensor:
    """The block input ``x`` stands for: the tensor itself, or its ``EmbeddingLookup`` run."""
    return x() if isinstance(x, EmbeddingLookup) else x


def compute_dtype_of(x: torch.Tensor | EmbeddingLookup) -> torch.dtype:
    """The dtype matmuls run in: autocast's when it is on, else the tensor's own."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def fp32_einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Compute-dtype operands, fp32 (or wider) result: jnp.einsum(...,
    preferred_element_type=float32).

    Products of bf16/fp16 values are exact in fp32, so rounding the operands to the compute
    dtype and multiplying in fp32 (autocast off, or it would cast them back down) is that op.
    """
    cdt = compute_dtype_of(a)
    acc = wide(cdt)
    with torch.autocast(a.device.type, enabled=False):
        return torch.einsum(equation, a.to(cdt).to(acc), b.to(cdt).to(acc))


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` computed in fp32 (or wider) and cast back (CPU autocast does not upcast
    it; jaxmem always normalises in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = wide(x.dtype)
        weight = None if self.weight is None else self.weight.to(acc)
        bias = None if self.bias is None else self.bias.to(acc)
        return F.layer_norm(x.to(acc), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed in fp32 (or wider) and cast back, as ``LayerNorm``. (On CPU,
    ``F.rms_norm`` is a composite of elementwise ops: autograd keeps the normalised input
    besides the input and 1/rms; jaxmem's custom VJP keeps those two and recomputes it.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = wide(x.dtype)
        weight = None if self.weight is None else self.weight.to(acc)
        return F.rms_norm(x.to(acc), self.normalized_shape, weight, self.eps).to(x.dtype)


def make_norm(cfg: ModelConfig) -> LayerNorm | RMSNorm:
    """The block's norm (``cfg.norm_type``); its parameters are ``weight`` (and ``bias``)."""
    if cfg.norm_type == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.has_bias("norm"))


def rope_tables(
    cfg: ModelConfig,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    positions: torch.Tensor | None = None,
) -> RopeTables | None:
    """RoPE's ``cos``, ``sin`` (``[S, K]``, in ``wide(dtype)``), or None without RoPE: jaxmem's
    float64 tables (``jaxmem.positions.rope_angles``) rounded once to the wide dtype, as jaxmem
    rounds them up to 65,536 positions (beyond, jaxmem builds them in the step by angle addition:
    ``jaxmem.model.sequence``, within a rounding or two). Built per forward, like the
    causal mask: constants, not parameters (no state-dict key). ``positions``: each column's
    position (``BlockStack.positions``); default in order."""
    if cfg.positions != "rope":
        return None
    acc = wide(dtype)
    if positions is None:
        cos, sin = rope_angles(cfg, seq_len)
    else:
        at = positions.cpu().numpy()
        cos, sin = (t[at] for t in rope_angles(cfg, int(at.max()) + 1))
    return torch.tensor(cos, dtype=acc, device=device), torch.tensor(sin, dtype=acc, device=device)


def apply_rope(x_bshk: torch.Tensor, cos_sk: torch.Tensor, sin_sk: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (``[B, S, H, K]``) in the rotate-half layout (Hugging
    Face Llama's: dimension i pairs with i + K/2), computed in the tables' (wide) dtype and cast
    back, as gpt-fast and torchtitan do. Its backward saves only the tables."""
    x = x_bshk.to(cos_sk.dtype)
    cos, sin = cos_sk[:, None], sin_sk[:, None]  # [S, 1, K]: the same angles for every head
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x_bshk.dtype)


class FusedProjection(nn.Module):
    """The fused q/k/v projection's matmul, ``F.linear(x, weight, bias)``, as a module without
    parameters of its own (the weight stays ``SelfAttention.in_proj_weight``, so the state dict
    is ``nn.MultiheadAttention``'s): the place low-rank adapters attach to, one per part
    (``torch_ref.lora``). ``parts``: each part's name and output width, in row order.

    ``forward(x, attention)`` reads ``attention.in_proj_weight`` and ``in_proj_bias``: handed
    the module, not the tensors, because module trackers (``FlopCounterMode``'s, ``MemTracker``)
    hook every tensor input of a module that requires grad, which a parameter (a leaf) or a
    view of one made under ``no_grad`` (a reentrant checkpoint's forward) cannot take."""

    def __init__(self, in_features: int, parts: dict[str, int]):
        super().__init__()
        self.in_features = in_features
        self.parts = dict(parts)
        self.out_features = sum(self.parts.values())
        # an empty tensor that follows the module's device and dtype (.to, .double): where
        # PEFT, reading ``weight``, places the adapters; not state (no state-dict key)
        self.register_buffer("placement", torch.empty(0), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """Not the weight (that is the parent's ``in_proj_weight``): an empty tensor on the
        projection's device, in its dtype, what PEFT reads to place the adapters."""
        return self.placement

    def forward(self, x: torch.Tensor, attention: nn.Module) -> torch.Tensor:
        return F.linear(x, attention.in_proj_weight, attention.in_proj_bias)


class SelfAttention(nn.Module):
    """Multi-head self-attention with ``nn.MultiheadAttention``'s parameter names, written out so
    every intermediate (q, k, v, scores, probabilities, context) is an ordinary tensor; under
    ``attention="fused"`` the core is one ``F.scaled_dot_product_attention`` call (its flash
    kernel: on CPU ``_scaled_dot_product_flash_attention_for_cpu``, which keeps its output and
    the row log-sum-exp and recomputes the probabilities in its backward).

    ``in_proj_weight`` stacks the q, k and v rows (D, Hkv·K, Hkv·K); keys and values have
    ``n_kv_heads`` heads (grouped-query attention), never repeated in memory: the naive core
    groups the query heads in its einsums, the fused one passes ``enable_gqa``. RoPE rotates q
    and k when ``positions="rope"``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.kv_dim = cfg.kv_dim
        self.fused = cfg.attention == "fused"
        self.causal = cfg.causal
        self.rope = cfg.positions == "rope"
        self.in_proj_weight = nn.Parameter(torch.empty(d + 2 * self.kv_dim, d))
        if cfg.has_bias("qkv"):
            self.in_proj_bias = nn.Parameter(torch.zeros(d + 2 * self.kv_dim))
        else:
            self.register_parameter("in_proj_bias", None)
        self.in_proj = FusedProjection(d, {"q": d, "k": self.kv_dim, "v": self.kv_dim})
        self.out_proj = nn.Linear(d, d, bias=cfg.has_bias("out"))
        # ``core(q, k, v) -> [B, S, D]``: the attention core applied from outside (a plain
        # attribute: torch_ref.context's context-parallel core); None: this module's own
        self.core: Callable[..., torch.Tensor] | None = None

    def forward(
        self, x_bsd: torch.Tensor, mask_ss: torch.Tensor | None, rope: RopeTables | None = None
    ) -> torch.Tensor:
        b, s, d = x_bsd.shape
        hd = self.head_dim
        qkv = self.in_proj(x_bsd, self)  # [B, S, D + 2 Hkv K]
        # A tensor-parallel rank holds 1/T of the rows, its heads' q, k and v rows in that order
        # (torch_ref.distributed.HeadAlignedColwise): the same split by the q:k:v ratio, and
        # the head counts read from the shapes, run the whole layer and one rank's part.
        parts = (d + 2 * self.kv_dim) // qkv.shape[-1]  # T (1: the whole layer)
        q, k, v = qkv.split([d // parts, self.kv_dim // parts, self.kv_dim // parts], dim=-1)
        q = q.reshape(b, s, -1, hd)  # [B, S, H, K]
        k, v = (t.reshape(b, s, -1, hd) for t in (k, v))  # [B, S, Hkv, K]
        if self.rope:
            if rope is None:
                raise ValueError("positions='rope': pass RoPE's tables (rope_tables(...))")
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.core is not None:
            return self.out_proj(self.core(q, k, v))
        if self.fused:
            # [B, H, S, K] views in, [B, H, S, K] out; the CPU flash kernel lays its output out
            # as [B, S, H, K], so merging the heads below is a view, not a copy
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
            grouped = kh.shape[1] < qh.shape[1]
            context = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=self.causal, enable_gqa=grouped
            )
            return self.out_proj(context.transpose(1, 2).reshape(b, s, -1))
        scores = _scores(q, k) / math.sqrt(hd)  # [B, H, S, S] fp32
        if mask_ss is not None:
            scores = scores.masked_fill(~mask_ss, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [B, H, S, S]
        context = _context(probs, v).reshape(b, s, -1)  # [B, S, H K]
        return self.out_proj(context)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, S]`` q·kᵀ in fp32 (or wider); under grouped-query attention each key head
    scores its group of query heads (``[B, Hkv, G, S, S]`` in the einsum, no copy of the keys),
    as jaxmem's ``_scores``."""
    b, s, h, hd = q.shape
    kv = k.shape[2]
    if kv == h:
        return fp32_einsum("bqhk,bshk->bhqs", q, k)
    qg = q.reshape(b, s, kv, h // kv, hd)
    return fp32_einsum("bqhgk,bshk->bhgqs", qg, k).reshape(b, h, s, s)


def _context(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, K]``: the probabilities applied to the values (grouped as ``_scores``). The
    grouped product comes out as ``[B, Hkv, G, S, K]``, the layout of the probabilities' rows:
    asked for ``[B, S, Hkv, G, K]``, ``torch.einsum`` would permute the probabilities into that
    row order first, a ``[B, H, S, S]`` copy autograd then keeps."""
    b, h, s, _ = probs.shape
    kv, hd = v.shape[2], v.shape[3]
    if kv == h:
        return torch.einsum("bhqs,bshk->bqhk", probs, v)
    pg = probs.reshape(b, kv, h // kv, s, s)
    return torch.einsum("bhgqs,bshk->bhgqk", pg, v).permute(0, 3, 1, 2, 4).reshape(b, s, h, hd)


class FeedForward(nn.Sequential):
    """``ffn.0`` (up), ``ffn.1`` (activation), ``ffn.2`` (down): the seeds' ``nn.Sequential``."""

    def __init__(self, cfg: ModelConfig):
        bias = cfg.has_bias("mlp")
        super().__init__(
            nn.Linear(cfg.d_model, cfg.d_ff, bias=bias),
            activation_module(cfg.activation),
            nn.Linear(cfg.d_ff, cfg.d_model, bias=bias),
        )


GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class GatedFeedForward(nn.Module):
    """``down(act(gate(x)) * up(x))`` (SwiGLU with ``silu``: Llama's MLP), ``ffn.gate``,
    ``ffn.up``, ``ffn.down`` as in jaxmem. Written the stock way, so autograd keeps
    ``act(gate)`` for the product's backward besides gate and up: a third ``[B, S, F]`` tensor
    that jaxmem's ``ops.gated`` recomputes instead (the memory report shows it)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias = cfg.has_bias("mlp")
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=bias)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=bias)
        self.act = GATE_ACTIVATIONS[cfg.activation]

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x_bsd)) * self.up(x_bsd))  # [B, S, F] -> [B, S, D]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = SelfAttention(cfg)
        self.ffn = GatedFeedForward(cfg) if cfg.mlp == "gated" else FeedForward(cfg)
        self.norm1 = make_norm(cfg)
        self.norm2 = make_norm(cfg)
        init_weights(self, cfg)

    def forward(
        self,
        x_bsd: torch.Tensor,
        mask_ss: torch.Tensor | None = None,
        rope: RopeTables | None = None,
    ) -> torch.Tensor:
        if self.pre_norm:
            x = x_bsd + self.self_attn(self.norm1(x_bsd), mask_ss, rope)
            return x + self.ffn(self.norm2(x))
        x = self.norm1(x_bsd + self.self_attn(x_bsd, mask_ss, rope))
        return self.norm2(x + self.ffn(x))


def causal_mask(cfg: ModelConfig, seq_len: int, device: torch.device) -> torch.Tensor | None:
    if not cfg.causal:
        return None
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def run_layers(
    layers: nn.ModuleList,
    x_bsd: torch.Tensor,
    mask_ss: torch.Tensor | None,
    rope: RopeTables | None,
) -> torch.Tensor:
    """The plain loop over blocks (no memory policy)."""
    x_bsd = materialize(x_bsd)
    for layer in layers:
        x_bsd = layer(x_bsd, mask_ss, rope)
    return x_bsd


class BlockStack(nn.Module):
    """``n_layers`` blocks, ``[B, S, D] -> [B, S, D]``.

    ``layers_fn(layers, x, mask, rope)`` decides how the blocks run (default ``run_layers``);
    ``torch_ref.remat.apply_memory_policy`` sets it, mirroring jaxmem's ``layers_fn`` hook. It is
    a plain attribute, so the state dict is the same under every policy.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.layers_fn = run_layers
        # ``[S]``: each column's position when the sequence is held in another order
        # (torch_ref.context); None: in order. RoPE and position embeddings follow it.
        self.positions: torch.Tensor | None = None

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        seq_len = x_bsd.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        # fused attention masks inside its kernel (is_causal): no [S, S] mask tensor
        fused = self.cfg.attention == "fused"
        mask_ss = None if fused else causal_mask(self.cfg, seq_len, x_bsd.device)
        at = self.positions
        rope = rope_tables(self.cfg, seq_len, x_bsd.device, compute_dtype_of(x_bsd), at)
        return self.layers_fn(self.layers, x_bsd, mask_ss, rope)


class Decoder(nn.Module):
    """Token embeddings (+ learned position embeddings, or RoPE inside the blocks), a
    ``BlockStack``, optional final norm, LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.learned_positions else None
        self.blocks = BlockStack(cfg)
        self.norm_f = make_norm(cfg) if cfg.final_norm else None
        self.lm_head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        # LossPolicy.chunks and .tile_tokens, set by torch_ref.remat.apply_loss_policy: 0 computes
        # the whole logits (autograd keeps them for the loss's backward); N runs the head and
        # loss over N sequence chunks, or chunks of N tokens (torch_ref.loss.chunked_lm_loss)
        self.loss_chunks = 0
        self.loss_tile_tokens = 0
        init_weights(self, cfg)

    def forward(
        self,
        tokens_bs: torch.Tensor,
        targets_bs: torch.Tensor | None = None,
        mask_bs: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token ids ``[B, S]`` → logits ``[B, S, V]`` in fp32 (float64 for a float64 model);
        given targets, the summed next-token loss and its token count instead
        (``torch_ref.loss.cross_entropy_sum``; over ``loss_chunks`` chunks when set), computed
        inside the module's forward so that wrappers (FSDP, DDP) see the head's use."""
        x = self.features(tokens_bs)
        if targets_bs is None:
            return self.head_logits(x)
        tiles = self.loss_tile_tokens
        chunks = tokens_bs.shape[1] // tiles if tiles else self.loss_chunks
        if chunks:
            # the head runs once per chunk: its norm's forward called directly, without the
            # module hooks that expect one call per step (MemTracker refuses a second)
            return chunked_lm_loss(
                functools.partial(self.head_logits, hooks=False),
                [p for p in self.head_parameters() if p.requires_grad],  # a frozen head: none
                x,
                targets_bs,
                mask_bs,
                chunks=chunks,
            )
        return cross_entropy_sum(self.head_logits(x), targets_bs, mask_bs)

    def features(self, tokens_bs: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, S]`` → the block stack's output ``[B, S, D]`` (compute dtype). A stack
        whose runner replays the embedding (``replays_embedding``) gets the lookup unevaluated."""
        if getattr(self.blocks.layers_fn, "replays_embedding", False):
            dtype = compute_dtype_of(self.wte.weight)
            return self.blocks(EmbeddingLookup(self.embed, tokens_bs, self.cfg.d_model, dtype))
        return self.blocks(self.embed(tokens_bs))

    def embed(self, tokens_bs: torch.Tensor) -> torch.Tensor:
        """The embedding lookup: token (+ learned position) embeddings, ``[B, S]`` → ``[B, S, D]``
        in the compute dtype."""
        x = self.wte(tokens_bs)  # [B, S, D]
        if self.wpe is not None:
            at = self.blocks.positions
            at = torch.arange(tokens_bs.shape[1], device=tokens_bs.device) if at is None else at
            x = x + self.wpe(at)[None]
        return x.to(compute_dtype_of(x))  # the residual stream runs in the compute dtype

    def head_logits(self, x_bsd: torch.Tensor, *, hooks: bool = True) -> torch.Tensor:
        """The final norm (if any) and the LM head: ``[B, S, D]`` → fp32 logits ``[B, S, V]``
        (``hooks=False``: the norm's ``forward`` called without its module hooks)."""
        if self.norm_f is not None:
            x_bsd = self.norm_f(x_bsd) if hooks else self.norm_f.forward(x_bsd)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight  # [V, D]
        return fp32_einsum("bsd,vd->bsv", x_bsd, head)  # fp32 logits

    def head_parameters(self) -> list[nn.Parameter]:
        """The parameters ``head_logits`` reads."""
        params = [] if self.norm_f is None else list(self.norm_f.parameters())
        return params + [self.wte.weight if self.lm_head is None else self.lm_head.weight]


# Output projections on the residual branch (GPT-2's 1/sqrt(2 L) scaling; jaxmem's out_std).
RESIDUAL_PROJECTIONS = ("out_proj.weight", "ffn.2.weight", "ffn.down.weight")


def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """GPT-2 initialisation, the same distributions as jaxmem (not the same draws: parity tests
    copy weights across with ``jaxmem.compare.weights``)."""
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, p in module.named_parameters():
        if name.endswith(RESIDUAL_PROJECTIONS):
            nn.init.normal_(p, std=residual_std)
        elif p.ndim >= 2:
            nn.init.normal_(p, std=cfg.init_std)
        elif "norm" in name and name.endswith("weight"):
            nn.init.ones_(p)
        else:
            nn.init.zeros_(p)

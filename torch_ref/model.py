"""The jaxmem decoder in plain eager PyTorch.

Module and parameter names mirror ``jaxmem.model``; for the seeds' configuration (post-norm, ReLU,
biases) a ``Block``'s state dict has exactly the keys of the seeds' ``DecoderLayer``
(``self_attn.in_proj_weight``, ``ffn.0.weight``, ``norm1.weight``, ...), so a user's checkpoint of
that module loads with ``strict=True``.

Shapes in comments: B batch, S sequence, D d_model, H heads, K head_dim, F d_ff, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from jaxmem.config import ModelConfig


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms, softmax, logits and the loss run in: float32, or wider when the compute
    dtype is (float64 in the parity suite's exactness mode); ``jaxmem.model.ops.wide``. (Plain
    Python: ``torch.promote_types`` would dispatch an op inside the block's op stream.)"""
    return torch.float64 if dtype == torch.float64 else torch.float32


def activation_module(name: str) -> nn.Module:
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if name == "relu":
        return nn.ReLU()
    raise ValueError(f"activation={name!r} is not one of gelu, gelu_tanh, relu")


def compute_dtype_of(x: torch.Tensor) -> torch.dtype:
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


class SelfAttention(nn.Module):
    """Multi-head self-attention with ``nn.MultiheadAttention``'s parameter names, written out so
    every intermediate (q, k, v, scores, probabilities, context) is an ordinary tensor; under
    ``attention="fused"`` the core is one ``F.scaled_dot_product_attention`` call (its flash
    kernel: on CPU ``_scaled_dot_product_flash_attention_for_cpu``, which keeps its output and
    the row log-sum-exp and recomputes the probabilities in its backward)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.fused = cfg.attention == "fused"
        self.causal = cfg.causal
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d, d))
        if cfg.bias:
            self.in_proj_bias = nn.Parameter(torch.zeros(3 * d))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(d, d, bias=cfg.bias)

    def forward(self, x_bsd: torch.Tensor, mask_ss: torch.Tensor | None) -> torch.Tensor:
        b, s, d = x_bsd.shape
        qkv = F.linear(x_bsd, self.in_proj_weight, self.in_proj_bias)  # [B, S, 3D]
        q, k, v = (t.reshape(b, s, self.n_heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
        if self.fused:
            # [B, H, S, K] views in, [B, H, S, K] out; the CPU flash kernel lays its output out
            # as [B, S, H, K], so merging the heads below is a view, not a copy
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
            context = F.scaled_dot_product_attention(qh, kh, vh, is_causal=self.causal)
            return self.out_proj(context.transpose(1, 2).reshape(b, s, d))
        scores = fp32_einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(self.head_dim)  # fp32
        if mask_ss is not None:
            scores = scores.masked_fill(~mask_ss, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [B, H, S, S]
        context = torch.einsum("bhqs,bshk->bqhk", probs, v).reshape(b, s, d)
        return self.out_proj(context)


class FeedForward(nn.Sequential):
    """``ffn.0`` (up), ``ffn.1`` (activation), ``ffn.2`` (down): the seeds' ``nn.Sequential``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(
            nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias),
            activation_module(cfg.activation),
            nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias),
        )


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = SelfAttention(cfg)
        self.ffn = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.norm2 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
        init_weights(self, cfg)

    def forward(self, x_bsd: torch.Tensor, mask_ss: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_norm:
            x = x_bsd + self.self_attn(self.norm1(x_bsd), mask_ss)
            return x + self.ffn(self.norm2(x))
        x = self.norm1(x_bsd + self.self_attn(x_bsd, mask_ss))
        return self.norm2(x + self.ffn(x))


def causal_mask(cfg: ModelConfig, seq_len: int, device: torch.device) -> torch.Tensor | None:
    if not cfg.causal:
        return None
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def run_layers(layers: nn.ModuleList, x_bsd: torch.Tensor, mask_ss: torch.Tensor | None):
    """The plain loop over blocks (no memory policy)."""
    for layer in layers:
        x_bsd = layer(x_bsd, mask_ss)
    return x_bsd


class BlockStack(nn.Module):
    """``n_layers`` blocks, ``[B, S, D] -> [B, S, D]``.

    ``layers_fn(layers, x, mask)`` decides how the blocks run (default ``run_layers``);
    ``torch_ref.remat.apply_memory_policy`` sets it, mirroring jaxmem's ``layers_fn`` hook. It is
    a plain attribute, so the state dict is the same under every policy.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.layers_fn = run_layers

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        seq_len = x_bsd.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        # fused attention masks inside its kernel (is_causal): no [S, S] mask tensor
        fused = self.cfg.attention == "fused"
        mask_ss = None if fused else causal_mask(self.cfg, seq_len, x_bsd.device)
        return self.layers_fn(self.layers, x_bsd, mask_ss)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = BlockStack(cfg)
        self.norm_f = (
            LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
            if cfg.final_norm
            else None
        )
        self.lm_head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        init_weights(self, cfg)

    def forward(self, tokens_bs: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, S]`` → logits ``[B, S, V]`` in fp32 (float64 for a float64 model)."""
        seq_len = tokens_bs.shape[1]
        pos = torch.arange(seq_len, device=tokens_bs.device)
        x = self.wte(tokens_bs) + self.wpe(pos)[None]  # [B, S, D]
        x = x.to(compute_dtype_of(x))  # the residual stream runs in the compute dtype, as in jaxmem
        x = self.blocks(x)
        if self.norm_f is not None:
            x = self.norm_f(x)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight  # [V, D]
        return fp32_einsum("bsd,vd->bsv", x, head)  # fp32 logits


def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """GPT-2 initialisation, the same distributions as jaxmem (not the same draws: parity tests
    copy weights across with ``jaxmem.compare.weights``)."""
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, p in module.named_parameters():
        if name.endswith(("out_proj.weight", "ffn.2.weight")):
            nn.init.normal_(p, std=residual_std)
        elif p.ndim >= 2:
            nn.init.normal_(p, std=cfg.init_std)
        elif "norm" in name and name.endswith("weight"):
            nn.init.ones_(p)
        else:
            nn.init.zeros_(p)

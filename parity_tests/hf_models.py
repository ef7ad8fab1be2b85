"""Small random Hugging Face models for the parity suite, built with ``transformers`` from a
config and saved with ``save_pretrained`` (no downloads), and each side's logits, loss and
gradients keyed by Hugging Face's tensor names."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from jaxmem.compare.parity import dtype_context, precision_of
from jaxmem.hf.config import model_config_from_dir
from jaxmem.hf.keys import hf_tensors
from jaxmem.memory.remat import layers_fn
from jaxmem.model import make_model
from jaxmem.model.hf import flat_params, load_hf_weights
from jaxmem.model.loss import cross_entropy_sum
from jaxmem.policy import MemoryPolicy

LLAMA = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "bos_token_id": None,
    "eos_token_id": None,
}
# name -> (architecture, config overrides); each a different corner of the architecture
HF_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # grouped-query attention (2 key/value heads for 4), untied head, plain RoPE
    "llama-gqa-untied": ("llama", {**LLAMA, "num_key_value_heads": 2}),
    # Llama 3.2's scaled RoPE (original length 16: every frequency band is exercised at 32
    # positions), multi-query attention, tied head, attention and MLP biases
    "llama3-scaled-tied": (
        "llama",
        {
            **LLAMA,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    # Qwen2: biases on q, k and v only
    "qwen2": ("qwen2", {**LLAMA, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    # GPT-2 (tied, tanh GELU); dropout off: jaxmem has none
    "gpt2": (
        "gpt2",
        {
            "vocab_size": 300,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 64,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": None,
            "eos_token_id": None,
        },
    ),
}


def save_hf_model(name: str, directory: str, seed: int = 0, **overrides: Any) -> str:
    """A random ``transformers`` model of ``HF_CONFIGS[name]`` (with ``overrides``) saved into
    ``directory``."""
    import transformers

    arch, fields = HF_CONFIGS[name]
    fields = {**fields, **overrides}
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields))
    with torch.no_grad():  # biases and norm scales away from their init (zeros, ones)
        for key, p in model.named_parameters():
            if key.endswith("bias") or "norm" in key or "ln_" in key:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


def load_hf(directory: str, dtype: str, **kwargs: Any) -> Any:
    """``transformers``' own model of ``directory`` in ``dtype`` (eval mode: no dropout)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    return model.to(getattr(torch, dtype)).eval()


def hf_loss_and_grads(
    model: Any, inputs: np.ndarray, targets: np.ndarray
) -> tuple[float, np.ndarray, dict[str, np.ndarray]]:
    """Mean next-token loss (targets given, not shifted), logits and every gradient, keyed by
    the checkpoint's names (tied weights once, under the embedding's name)."""
    model.zero_grad(set_to_none=True)
    logits = model(torch.from_numpy(inputs).long()).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).long().reshape(-1)
    )
    loss.backward()
    grads = {k: p.grad.detach().numpy() for k, p in model.named_parameters()}
    return float(loss.detach()), logits.detach().numpy(), grads


def jaxmem_loss_and_grads(
    directory: str,
    dtype: str,
    inputs: np.ndarray,
    targets: np.ndarray,
    policy: MemoryPolicy | None = None,
) -> tuple[float, np.ndarray, dict[str, np.ndarray]]:
    """The same from jaxmem's model loaded from ``directory`` (stored and computed in
    ``dtype``), under ``policy``'s translation (``jaxmem.memory.remat.layers_fn``);
    gradients keyed by Hugging Face's names (``jaxmem.hf.keys.hf_tensors``)."""
    cfg = model_config_from_dir(directory)
    with dtype_context(dtype):
        model = make_model(cfg, precision_of(dtype))
        load_hf_weights(model, directory)
        graphdef, params = nnx.split(model, nnx.Param)
        layers = None if policy is None else layers_fn(policy, cfg.n_layers)

        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(jnp.asarray(inputs), layers_fn=layers)
            loss_sum, n = cross_entropy_sum(logits, jnp.asarray(targets))
            return loss_sum / n, logits

        (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
        flat = {p: np.asarray(v[...]) for p, v in flat_params(grads).items()}
    return float(loss), np.asarray(logits), hf_tensors(flat, cfg)


def hf_names(grads: dict[str, np.ndarray], directory: str) -> dict[str, np.ndarray]:
    """``transformers``' parameter names as the checkpoint's (a tied head is not a parameter
    of its own; GPT-2's names carry ``transformer.`` in both)."""
    return {k: v for k, v in grads.items() if k in _checkpoint_keys(directory)}


def _checkpoint_keys(directory: str) -> set[str]:
    from jaxmem.hf.keys import key_map

    return {e.key for e in key_map(model_config_from_dir(directory), "hf")}


@contextlib.contextmanager
def float64_internals() -> Iterator[None]:
    """``transformers``' Llama in float64 throughout: its RMSNorm casts to float32 and its
    rotary embedding computes the angles in float32 even in a float64 model. Both are patched
    (RoPE's angles from ``jaxmem.positions``, float64) for the exactness comparison."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    from jaxmem.positions import inverse_frequencies

    def rms_forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    def rope_forward(self, x, position_ids):
        from jaxmem.hf.config import model_config_from_hf

        cfg = model_config_from_hf(self.config.to_dict())
        inv = torch.from_numpy(inverse_frequencies(cfg))
        freqs = position_ids[..., None].double() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    patched = []
    for module, norm, rope in (
        (modeling_llama, "LlamaRMSNorm", "LlamaRotaryEmbedding"),
        (modeling_qwen2, "Qwen2RMSNorm", "Qwen2RotaryEmbedding"),
    ):
        for cls_name, fn in ((norm, rms_forward), (rope, rope_forward)):
            cls = getattr(module, cls_name)
            patched.append((cls, cls.forward))
            cls.forward = fn
    try:
        yield
    finally:
        for cls, forward in patched:
            cls.forward = forward


def hf_dir(tmp_path_factory: Any, name: str) -> str:
    return save_hf_model(name, os.fspath(tmp_path_factory.mktemp(name)))

"""Shared configurations for the cross-framework parity suite."""

from __future__ import annotations

import pytest
import torch

from jaxmem.config import PRESETS, ModelConfig

# The configurations the foundation must agree on, each with the batch shape it is run at.
PARITY_CONFIGS: dict[str, tuple[ModelConfig, int, int]] = {
    # GPT-2-style: pre-norm, exact GELU, causal LM, tied embeddings, biases.
    "pre_gelu_causal": (PRESETS["tiny"], 4, 32),
    # The seeds' block (post-norm, ReLU, no causal mask, d_model 512, 8 heads, d_ff 2048) as an
    # LM of two layers, untied head.
    "post_relu_seed": (PRESETS["seed"].replace(n_layers=2), 2, 64),
    # Odd shapes: d_model not a power of two, 3 heads of 24, 5 layers, sequence 13, vocab 259,
    # no biases, untied head, tanh-GELU.
    "odd": (
        ModelConfig(
            vocab_size=259,
            d_model=72,
            n_heads=3,
            n_layers=5,
            d_ff=200,
            max_seq_len=16,
            bias=False,
            tie_embeddings=False,
            activation="gelu_tanh",
        ),
        3,
        13,
    ),
    # Llama-family: RMSNorm, RoPE, SwiGLU, grouped-query attention (2 key/value heads for 4
    # query heads), no biases, untied head: the tiny-llama preset.
    "llama_gqa": (PRESETS["tiny-llama"], 4, 32),
    # Qwen2-style: biases on the q/k/v projection only, tied head; odd shapes (6 heads of 12,
    # 3 query heads per key/value head, 3 layers, sequence 13) and Llama 3's RoPE frequency
    # scaling (original length 16: both its scaled and its interpolated wavelengths occur).
    "qwen2_qkv_bias": (
        PRESETS["tiny-llama"].replace(
            d_model=72,
            n_heads=6,
            n_kv_heads=2,
            n_layers=3,
            d_ff=200,
            max_seq_len=16,
            qkv_bias=True,
            tie_embeddings=True,
            rope_scaling="llama3",
            rope_original_max_len=16,
        ),
        3,
        13,
    ),
}


# Exactness in float64 for every configuration; the fp32 comparison only where no ReLU can flip
# on rounding (jaxmem.compare.tolerances says why).
PARITY_RUNS = [(name, "float64") for name in sorted(PARITY_CONFIGS)] + [
    (name, "float32")
    for name in sorted(PARITY_CONFIGS)
    if PARITY_CONFIGS[name][0].activation != "relu"
]


@pytest.fixture(params=PARITY_RUNS, ids=[f"{n}-{d}" for n, d in PARITY_RUNS])
def parity_case(request) -> tuple[str, ModelConfig, int, int, str]:
    name, dtype = request.param
    cfg, batch, seq_len = PARITY_CONFIGS[name]
    return name, cfg, batch, seq_len, dtype


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield

"""Shared configurations for the cross-framework parity suite."""

from __future__ import annotations

import pytest
import torch

from jaxmem.config import PRESETS, ModelConfig

# The three configurations the foundation must agree on, each with the batch shape it is run at.
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
}


@pytest.fixture(params=sorted(PARITY_CONFIGS), ids=sorted(PARITY_CONFIGS))
def parity_case(request) -> tuple[str, ModelConfig, int, int]:
    cfg, batch, seq_len = PARITY_CONFIGS[request.param]
    return request.param, cfg, batch, seq_len


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield

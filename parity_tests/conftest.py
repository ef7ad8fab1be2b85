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

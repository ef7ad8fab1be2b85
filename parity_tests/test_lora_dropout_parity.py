"""torch_ref's fused q/k/v adapter (``torch_ref.lora.FusedQKVLora``) drops out its input as
PEFT's ``lora.Linear`` does on a Llama's separate ``q_proj``, ``k_proj``, ``v_proj``: each part
its own ``nn.Dropout`` on the adapter's input only, drawn in q, k, v order. Under the same torch
generator state (the same masks) the fused layer's output equals the three stock PEFT layers'.
JAX's masks cannot equal torch's (different generators): ``tests/test_lora_compose.py`` checks
them on their own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from jaxmem.adapters import AdapterConfig
from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS

pytest.importorskip("peft", reason="peft: the adapters and dev extras (make test installs it)")

import torch_ref  # noqa: E402
from torch_ref.lora import ADAPTER, QKV, add_adapters, lora_config  # noqa: E402

ADAPTERS = AdapterConfig(rank=4, alpha=8.0, targets=QKV, dropout=0.3)


class _Parts(nn.Module):
    """A Llama's separate q, k and v projections holding the rows of a fused weight."""

    def __init__(self, weight: torch.Tensor, sizes: dict[str, int]):
        super().__init__()
        for (name, rows), size in zip(_rows(sizes).items(), sizes.values(), strict=True):
            linear = nn.Linear(weight.shape[1], size, bias=False, dtype=weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(weight[rows])
            setattr(self, f"{name}_proj", linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(self, f"{p}_proj")(x) for p in QKV], dim=-1)


def _rows(sizes: dict[str, int]) -> dict[str, slice]:
    out, start = {}, 0
    for name, size in sizes.items():
        out[name] = slice(start, start + size)
        start += size
    return out


@pytest.fixture(scope="module")
def layers():
    """tiny-llama's first attention in torch_ref with dropped-out q/k/v adapters, and stock PEFT
    layers on separate projections holding the same base rows and adapter weights (float64,
    every B random so the adapters add something)."""
    from peft import inject_adapter_in_model

    torch.manual_seed(0)
    model = add_adapters(torch_ref.Decoder(PRESETS["tiny-llama"]).double(), ADAPTERS)
    attention = model.blocks.layers[0].self_attn
    fused = attention.in_proj
    sizes = fused.get_base_layer().parts
    parts = _Parts(attention.in_proj_weight.detach(), sizes)
    config = lora_config(ADAPTERS, [f"{p}_proj" for p in QKV])
    inject_adapter_in_model(config, parts, adapter_name=ADAPTER)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in QKV:
            peft_layer = getattr(parts, f"{p}_proj")
            for kind in ("lora_A", "lora_B"):
                ours = getattr(fused, kind)[ADAPTER][p].weight
                ours.copy_(0.1 * torch.randn(ours.shape, generator=generator, dtype=ours.dtype))
                getattr(peft_layer, kind)[ADAPTER].weight.copy_(ours)
    return attention, parts


def test_the_fused_qkv_adapter_drops_out_each_parts_input_as_pefts_layers_do(layers):
    attention, parts = layers
    x = torch.randn(2, 16, attention.in_proj.in_features, dtype=torch.float64)
    tol = tolerance("float64", "logits")
    outputs = {}
    with torch.no_grad():
        for seed in (11, 12):
            torch.manual_seed(seed)
            ours = attention.in_proj(x, attention)
            torch.manual_seed(seed)
            theirs = parts(x)
            np.testing.assert_allclose(ours, theirs, rtol=tol.rtol, atol=tol.atol)
            outputs[seed] = ours
        assert not torch.equal(outputs[11], outputs[12])  # dropout draws: other masks
        attention.eval(), parts.eval()
        try:  # no dropout in evaluation: both the deterministic adapted projection
            np.testing.assert_allclose(
                attention.in_proj(x, attention), parts(x), rtol=tol.rtol, atol=tol.atol
            )
            assert not torch.equal(attention.in_proj(x, attention), outputs[11])
        finally:
            attention.train(), parts.train()

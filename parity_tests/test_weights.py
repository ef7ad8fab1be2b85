from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

import torch_ref
from jaxmem.compare.weights import (
    WeightMapError,
    load_safetensors,
    load_torch_state_dict,
    read_safetensors_config,
    save_safetensors,
    to_torch_state_dict,
)
from jaxmem.config import PRESETS, ModelConfig
from jaxmem.hf.keys import key_map
from jaxmem.model import Block, Decoder

ODD = ModelConfig(
    vocab_size=259,
    d_model=72,
    n_heads=3,
    n_layers=5,
    d_ff=200,
    max_seq_len=13,
    bias=False,
    tie_embeddings=False,
)
# Qwen2-style: q/k/v biases only, grouped-query attention, tied head, no position table
QWEN2 = PRESETS["tiny-llama"].replace(qkv_bias=True, tie_embeddings=True)
# biases on the output projection and the MLP only, LayerNorm, a gated GELU MLP, RoPE and
# multi-query attention (one key/value head)
MIXED = PRESETS["tiny"].replace(
    bias=False, out_bias=True, mlp_bias=True, mlp="gated", positions="rope", n_kv_heads=1
)
CONFIGS = {"tiny": PRESETS["tiny"], "odd": ODD, "tiny-llama": PRESETS["tiny-llama"]}
CONFIGS |= {"qwen2": QWEN2, "mixed": MIXED}


@pytest.mark.parametrize("scope", ["decoder", "stack", "block"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_key_map_covers_the_torch_model_exactly(name, scope):
    """Every key on both sides exactly once, every shape the torch module's, for each scope."""
    cfg = CONFIGS[name]
    torch_model = {
        "decoder": torch_ref.Decoder,
        "stack": torch_ref.BlockStack,
        "block": torch_ref.Block,
    }[scope](cfg)
    entries = key_map(cfg, "torch_ref", scope)
    keys = [e.key for e in entries]
    paths = [(e.path, e.layer) for e in entries]
    assert len(set(keys)) == len(keys) and len(set(paths)) == len(paths)
    assert set(keys) == set(torch_model.state_dict())
    for e in entries:
        assert tuple(torch_model.state_dict()[e.key].shape) == e.shape


def test_the_llama_block_maps_the_grouped_projection_and_the_gated_mlp():
    cfg = PRESETS["tiny-llama"]  # d 64, 4 heads of 16, 2 key/value heads, d_ff 160
    shapes = {e.key: e.shape for e in key_map(cfg, "torch_ref", "block")}
    assert shapes == {
        "self_attn.in_proj_weight": (64 + 2 * 32, 64),  # q, k, v rows
        "self_attn.out_proj.weight": (64, 64),
        "ffn.gate.weight": (160, 64),
        "ffn.up.weight": (160, 64),
        "ffn.down.weight": (64, 160),
        "norm1.weight": (64,),
        "norm2.weight": (64,),
    }
    decoder = {e.key for e in key_map(cfg, "torch_ref")}
    assert "wpe.weight" not in decoder and {"norm_f.weight", "lm_head.weight"} <= decoder
    assert {e.key for e in key_map(QWEN2, "torch_ref", "block")} - set(shapes) == {
        "self_attn.in_proj_bias"
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_safetensors_round_trip_jax_torch_jax_is_bitwise(name, tmp_path):
    cfg = CONFIGS[name]
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    save_safetensors(model, tmp_path / "a.safetensors")
    assert read_safetensors_config(tmp_path / "a.safetensors") == cfg

    torch_model = torch_ref.Decoder(cfg)
    torch_model.load_state_dict(torch_load_file(tmp_path / "a.safetensors"), strict=True)
    torch_save_file(torch_model.state_dict(), tmp_path / "b.safetensors")

    back = Decoder(cfg, rngs=nnx.Rngs(1))
    load_safetensors(back, tmp_path / "b.safetensors")
    original, restored = to_torch_state_dict(model), to_torch_state_dict(back)
    for key in original:
        np.testing.assert_array_equal(restored[key], original[key])


def test_missing_unexpected_and_misshaped_keys_are_named_and_nothing_is_written():
    cfg = PRESETS["tiny"]
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    before = to_torch_state_dict(model)
    good = {k: torch.from_numpy(v.copy()) for k, v in before.items()}

    missing = dict(good)
    del missing["blocks.layers.1.ffn.2.bias"]
    with pytest.raises(WeightMapError, match=r"missing \['blocks.layers.1.ffn.2.bias'\]"):
        load_torch_state_dict(model, missing)

    extra = dict(good, **{"lm_head.weight": torch.zeros(259, 64)})
    with pytest.raises(WeightMapError, match=r"unexpected \['lm_head.weight'\]"):
        load_torch_state_dict(model, extra)

    wrong = dict(good)
    wrong["wte.weight"] = torch.zeros(64, 259)  # transposed
    wrong["norm_f.bias"] = torch.ones(64)  # a valid change that must not be applied
    with pytest.raises(WeightMapError, match=r"wte.weight: got \(64, 259\), expected \(259, 64\)"):
        load_torch_state_dict(model, wrong)

    after = to_torch_state_dict(model)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key])


def test_a_single_block_uses_the_seed_layer_keys():
    cfg = PRESETS["seed"]
    block = Block(cfg, rngs=nnx.Rngs(0))
    sd = to_torch_state_dict(block, cfg=cfg)
    assert set(sd) == set(torch_ref.Block(cfg).state_dict())
    assert sd["self_attn.in_proj_weight"].shape == (1536, 512)
    with pytest.raises(ValueError, match="pass cfg="):
        to_torch_state_dict(block)


def test_failed_save_leaves_no_file(tmp_path, monkeypatch):
    import safetensors.numpy

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors(Decoder(PRESETS["tiny"], rngs=nnx.Rngs(0)), tmp_path / "w.safetensors")
    assert list(tmp_path.iterdir()) == []

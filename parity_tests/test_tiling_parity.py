"""Sequence tiling in both frameworks: a step with its MLP in sequence tiles
(``MemoryPolicy.mlp_tile_tokens``; jaxmem.memory.remat's ``tiled_mlp``, torch_ref.remat's
``TiledMLP``) and its LM head and loss in chunks of a token count (``LossPolicy.tile_tokens``)
gives in float64 the untiled step's loss and every gradient leaf, in jaxmem and in torch_ref
(with LoRA on up and down), and jaxmem's tiled run equals torch_ref's. torch_ref's FLOPs
(``FlopCounterMode``): unchanged under none and selective; under full (n - 1) / n more of one MLP
forward per block for n tiles (the block's recompute runs every tile's forward but the last's
before PyTorch's checkpoint stops early)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch.utils.flop_counter import FlopCounterMode

from jaxmem.adapters import AdapterConfig
from jaxmem.compare.parity import dtype_context, model_in, torch_model_from
from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from jaxmem.compare.weights import to_torch_state_dict
from jaxmem.config import PRESETS
from jaxmem.memory.remat import layers_fn
from jaxmem.model import Decoder
from jaxmem.policy import POLICIES, LossPolicy, MemoryPolicy
from jaxmem.step.train_step import lm_loss_fn
from parity_tests.helpers import masked_batch, torch_batch
from torch_ref.remat import apply_loss_policy, apply_memory_policy

BATCH, SEQ, TILE = 2, 16, 4
POLICY_NAMES = ("none", "full", "selective")


def _tiled(name: str, tile: int) -> MemoryPolicy:
    loss = LossPolicy(tile_tokens=tile) if tile else LossPolicy()
    return POLICIES[name].replace(mlp_tile_tokens=tile, loss=loss)


def _jax(model: Decoder, batch: dict, policy: MemoryPolicy):
    graphdef, params = nnx.split(model, nnx.Param)
    chunks = policy.loss.chunks_for(SEQ)
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, model.cfg.n_layers), loss_chunks=chunks)
    data = {k: jnp.asarray(v) for k, v in batch.items()}
    (value, _), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, data)
    return float(value), to_torch_state_dict(nnx.merge(graphdef, grads))


def _torch(model, batch: dict, policy: MemoryPolicy):
    """Loss, gradients (of the parameters that take one) and FLOPs of one torch_ref step."""
    apply_memory_policy(model.blocks, policy)
    apply_loss_policy(model, policy)
    model.zero_grad(set_to_none=True)
    b = torch_batch(batch)
    with FlopCounterMode(display=False) as flops:
        loss_sum, n = model(b["inputs"], b["targets"], b["mask"].double())
        (loss_sum / n).backward()
    grads = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
    return float((loss_sum / n).detach()), grads, flops.get_total_flops()


def _assert_same(runs: dict, reference: str) -> None:
    loss_tol, grad_tol = tolerance("float64", "loss"), tolerance("float64", "grads")
    ref_loss, ref_grads = runs[reference][:2]
    for key, (loss, grads, *_) in runs.items():
        np.testing.assert_allclose(loss, ref_loss, rtol=loss_tol.rtol, atol=loss_tol.atol)
        diff = compare_state_dicts(grads, ref_grads, grad_tol)
        assert diff.passed, (key, diff.failures)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny"])
def test_a_tiled_step_equals_the_untiled_one_in_both_frameworks_in_float64(preset):
    cfg = PRESETS[preset].replace(n_layers=2)
    batch = masked_batch(cfg, BATCH, SEQ, seed=3)
    with dtype_context("float64"):
        model = model_in(Decoder(cfg, rngs=nnx.Rngs(0)), "float64")
        # jaxmem's own tiled and untiled steps: tests/test_tiling.py; here its tiled full step
        runs = {("jax", "full", TILE): _jax(model, batch, _tiled("full", TILE))}
    torch_model = torch_model_from(model)
    runs |= {
        ("torch", n, t): _torch(torch_model, batch, _tiled(n, t))
        for n in POLICY_NAMES
        for t in (0, TILE)
    }
    _assert_same(runs, ("torch", "none", 0))
    flops = {(n, t): runs[("torch", n, t)][2] for n in POLICY_NAMES for t in (0, TILE)}
    assert flops[("none", TILE)] == flops[("none", 0)]
    assert flops[("selective", TILE)] == flops[("selective", 0)]
    mats = 3 if cfg.mlp == "gated" else 2
    mlp_forward = cfg.n_layers * 2 * BATCH * SEQ * mats * cfg.d_model * cfg.d_ff
    tiles = SEQ // TILE  # the recompute stops early before the last tile's forward
    assert flops[("full", TILE)] - flops[("full", 0)] == mlp_forward * (tiles - 1) // tiles


def test_lora_on_up_and_down_under_tiles_in_torch_ref_gives_the_untiled_gradients():
    pytest.importorskip("peft", reason="peft: the adapters and dev extras (make test installs it)")
    from torch_ref.lora import add_adapters

    cfg = PRESETS["tiny-llama"].replace(n_layers=2)
    batch = masked_batch(cfg, BATCH, SEQ, seed=4)
    with dtype_context("float64"):
        model = model_in(Decoder(cfg, rngs=nnx.Rngs(0)), "float64")
    adapters = AdapterConfig(rank=2, alpha=4.0, targets=("up", "down"))
    torch_model = add_adapters(torch_model_from(model), adapters)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in torch_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    runs = {
        (n, t): _torch(torch_model, batch, _tiled(n, t)) for n in POLICY_NAMES for t in (0, TILE)
    }
    _assert_same(runs, ("none", 0))
    grads = runs[("none", 0)][1]
    assert grads and all("lora" in k for k in grads)
    assert all(np.abs(g).max() > 1e-8 for g in grads.values())


@pytest.mark.parametrize(
    "policy, translation",
    [
        (POLICIES["full"].replace(use_reentrant=True), "stock"),
        (POLICIES["selective"], "lean"),
        (POLICIES["mlp"], "lean"),
    ],
    ids=["full-reentrant", "selective-lean", "mlp-lean"],
)
def test_torch_ref_tiles_under_reentrant_checkpoints_and_the_lean_extension(policy, translation):
    """Reentrant tiles inside a reentrant block; the lean extension's dispatch modes naming the
    ops of every tile: the untiled gradients and the same kept bytes."""
    cfg = PRESETS["tiny-llama"].replace(n_layers=2)
    batch = masked_batch(cfg, BATCH, SEQ, seed=5)
    with dtype_context("float64"):
        torch_model = torch_model_from(model_in(Decoder(cfg, rngs=nnx.Rngs(0)), "float64"))
    b, runs, kept = torch_batch(batch), {}, {}
    for tile in (0, TILE):
        runner = apply_memory_policy(
            torch_model.blocks, policy.replace(mlp_tile_tokens=tile), translation
        )
        torch_model.zero_grad(set_to_none=True)
        loss_sum, n = torch_model(b["inputs"], b["targets"], b["mask"].double())
        (loss_sum / n).backward()
        grads = {k: p.grad.numpy().copy() for k, p in torch_model.named_parameters()}
        runs[tile] = (float((loss_sum / n).detach()), grads)
        kept[tile] = sum(k.nbytes for k in runner.kept)
    _assert_same(runs, 0)
    assert kept[TILE] == kept[0]


def test_the_host_presets_tile_as_their_device_forms_do_in_both_frameworks():
    """The long-sequence composition: block (or segment) inputs in host memory, the MLP and the
    loss in tiles. Float64 gradients equal the untiled device form's in both frameworks, and
    torch_ref's tiles are checkpointed under ``full-host`` exactly as under ``full`` (the same
    FLOPs)."""
    cfg = PRESETS["tiny-llama"].replace(n_layers=4)
    batch = masked_batch(cfg, BATCH, SEQ, seed=6)
    with dtype_context("float64"):
        model = model_in(Decoder(cfg, rngs=nnx.Rngs(0)), "float64")
        runs = {
            ("jax", n): _jax(model, batch, _tiled(n, TILE)) for n in ("full-host", "nested-host")
        }
    torch_model = torch_model_from(model)
    names = ("full", "full-host", "nested", "nested-host")
    runs |= {("torch", n): _torch(torch_model, batch, _tiled(n, TILE)) for n in names}
    runs[("torch", "untiled")] = _torch(torch_model, batch, _tiled("full", 0))
    _assert_same(runs, ("torch", "untiled"))
    assert runs[("torch", "full-host")][2] == runs[("torch", "full")][2]


def test_torch_tiles_a_length_they_do_not_divide_with_a_shorter_last_tile():
    """Sampling grows its prompt one token at a time: a tiled model (8-token tiles) runs a
    13-token sequence in tiles of 8 and 5, as the untiled model does, in float64."""
    import torch_ref

    cfg = PRESETS["tiny-llama"]
    torch.manual_seed(0)
    model = torch_ref.Decoder(cfg).double()
    tokens = torch.randint(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        whole = model(tokens)
        apply_memory_policy(model.blocks, POLICIES["full"].replace(mlp_tile_tokens=8))
        tiled = model(tokens)
    np.testing.assert_allclose(
        tiled.numpy(), whole.numpy(), **tolerance("float64", "logits").kwargs()
    )

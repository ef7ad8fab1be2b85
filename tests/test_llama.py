"""The Llama-family block in JAX (RMSNorm, RoPE, SwiGLU, grouped-query attention, biases per
part): the architecture's validation, the presets' real sizes, each new op against a plain
reference, every memory policy's gradients against plain autodiff (float64), what JAX keeps for
the backward against the policy vocabulary, and the analytic model and FLOP model against the
traced program."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS, ConfigError, ModelConfig
from jaxmem.data import lm_batch
from jaxmem.memory import analytic
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.memory.remat import layers_fn
from jaxmem.memory.residuals import bytes_by_name, saved_residuals
from jaxmem.model import Decoder, ops
from jaxmem.model.flash import flash_attention
from jaxmem.policy import (
    CHECKPOINT_NAMES,
    POLICIES,
    BlockPolicy,
    MemoryPolicy,
    backward_reads,
    check_policy,
    mixed_policy,
    model_tags,
)
from jaxmem.positions import inverse_frequencies, rope_angles
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import lm_loss_fn

LLAMA = PRESETS["tiny-llama"].replace(n_layers=4, attention_block=8)
QWEN = LLAMA.replace(qkv_bias=True)  # Qwen2: biases on q, k, v only


def make(cfg: ModelConfig, dtype: str = "float32") -> tuple:
    model = Decoder(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype))
    return nnx.split(model, nnx.Param)


def batch_of(cfg: ModelConfig, b: int = 2, s: int = 13) -> dict:
    inputs, targets = lm_batch(cfg, b, s, seed=1)
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}


# ------------------------------------------------------------------------------- the config
def test_the_llama_presets_have_their_published_sizes():
    """Parameter counts (analytic) of Meta's Llama 3 shapes: 1.24 B, 3.21 B, 8.03 B, 70.55 B."""
    sizes = {n: PRESETS[n].n_params for n in ("llama-3.2-1b", "llama-3.2-3b", "llama-3-8b")}
    assert sizes == {
        "llama-3.2-1b": 1_235_814_400,
        "llama-3.2-3b": 3_212_749_824,
        "llama-3-8b": 8_030_261_248,
    }
    assert PRESETS["llama-3-70b"].n_params == 70_553_706_496


# Meta-Llama-3.1-8B's and -70B's config.json as published on the Hugging Face hub (the fields
# that shape the model and its positions)
LLAMA_31 = {
    "model_type": "llama",
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
SHAPES_31 = {
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                     "num_hidden_layers": 32},
    "llama-3.1-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                      "num_hidden_layers": 80},
}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "n_params"), [("llama-3.1-8b", 8_030_261_248), ("llama-3.1-70b", 70_553_706_496)]
)
def test_the_llama_31_presets_are_the_published_configs_with_their_sizes(name, n_params):
    """8.03 B and 70.6 B parameters (Llama 3's shapes), 128K positions, RoPE scaled as Meta's
    config.json says (llama3: factor 8, low/high frequency factors 1 and 4 over 8,192 original
    positions, theta 500,000): the preset reads back from that file function for function."""
    from jaxmem.hf.config import disagreements, model_config_from_hf

    cfg = PRESETS[name]
    assert cfg.n_params == n_params
    published = model_config_from_hf(LLAMA_31 | SHAPES_31[name])
    assert disagreements(cfg, published) == []
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len) == ("llama3", 8.0, 8192)
    assert (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor) == (1.0, 4.0)
    assert cfg.max_seq_len == 131072 and cfg.layer_norm_eps == 1e-5


@pytest.mark.parametrize("cfg", [LLAMA, QWEN, LLAMA.replace(n_kv_heads=1, tie_embeddings=True)])
def test_the_analytic_parameter_count_is_the_arrays(cfg):
    _, params = make(cfg)
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.n_params
    shapes = sorted(tuple(x.shape) for x in jax.tree.leaves(params))
    assert shapes == sorted(analytic._param_shapes(cfg))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_kv_heads": 3}, "n_kv_heads=3 does not divide n_heads=4"),
        ({"n_kv_heads": 0}, "n_kv_heads=0 must be a positive integer"),
        ({"norm_type": "batchnorm"}, "norm_type='batchnorm' is not one of"),
        ({"positions": "alibi"}, "positions='alibi' is not one of"),
        ({"mlp": "moe"}, "mlp='moe' is not one of"),
        ({"norm_bias": True}, "norm_bias=True: RMSNorm has no bias"),
        ({"rope_theta": 0.5}, "rope_theta=0.5 must be a finite float above 1"),
        (
            {"d_model": 60, "n_heads": 4, "n_kv_heads": 2},
            "head_dim=15 (d_model / n_heads) must be even",
        ),
        (
            {"rope_scaling": "llama3", "rope_low_freq_factor": 4.0},
            "rope_low_freq_factor=4.0 must be below rope_high_freq_factor=4.0",
        ),
        ({"qkv_bias": "yes"}, "qkv_bias='yes' must be true, false or unset"),
    ],
)
def test_bad_architecture_values_are_named(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLAMA.replace(**changes)


# ------------------------------------------------------------------------------- the ops
def test_rope_angles_are_the_textbook_rotation_with_llama3_scaling():
    """theta^(-2i/K) per pair, angles position * frequency; Llama 3's scaling leaves the short
    wavelengths alone and slows the long ones by the factor."""
    cfg = LLAMA
    inv = inverse_frequencies(cfg)
    k = cfg.head_dim
    np.testing.assert_allclose(inv, cfg.rope_theta ** (-np.arange(0, k, 2) / k), rtol=1e-15)
    cos, sin = rope_angles(cfg, 5)
    assert cos.shape == (5, k)
    np.testing.assert_allclose(cos[3, : k // 2], np.cos(3 * inv), rtol=0, atol=0)
    np.testing.assert_array_equal(cos[:, : k // 2], cos[:, k // 2 :])
    scaled = PRESETS["llama-3.2-1b"]
    base = inverse_frequencies(scaled.replace(rope_scaling="none"))
    inv = inverse_frequencies(scaled)
    wavelen = 2 * math.pi / base
    assert np.all(inv[wavelen < 8192 / 4] == base[wavelen < 8192 / 4])
    np.testing.assert_allclose(inv[wavelen > 8192], base[wavelen > 8192] / 32, rtol=1e-15)


def test_rope_rotates_each_pair_and_keeps_norms():
    with jax.enable_x64(True):
        cos, sin = (jnp.asarray(t) for t in rope_angles(LLAMA, 7))
        x = jax.random.normal(jax.random.key(0), (2, 7, 3, LLAMA.head_dim), jnp.float64)
        y = ops.rope(x, cos, sin)
        half = LLAMA.head_dim // 2
        a, b = x[..., :half], x[..., half:]
        c, s = cos[None, :, None, :half], sin[None, :, None, :half]
        np.testing.assert_allclose(y[..., :half], a * c - b * s, rtol=1e-15)
        np.testing.assert_allclose(y[..., half:], b * c + a * s, rtol=1e-15)
        np.testing.assert_allclose(
            jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-14
        )


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_gated_activation_and_rms_norm_gradients_are_autodiffs(activation):
    """The hand-written VJPs (which keep less) give plain autodiff's gradients (float64)."""
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(1), 4)
        g, u, w = (jax.random.normal(k, (3, 5, 6), jnp.float64) for k in keys[:3])
        act = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, False), "relu": jax.nn.relu}
        ref = jax.grad(lambda g, u: jnp.sum(act[activation](g) * u * w), (0, 1))(g, u)
        got = jax.grad(lambda g, u: jnp.sum(ops.gated(g, u, activation) * w), (0, 1))(g, u)
        for a, b in zip(got, ref, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)
        scale = jax.random.normal(keys[3], (6,), jnp.float64)

        def plain(x, s):
            return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * s

        ref = jax.grad(lambda x, s: jnp.sum(plain(x, s) * w), (0, 1))(g, scale)
        got = jax.grad(lambda x, s: jnp.sum(ops.rms_norm(x, s, 1e-5) * w), (0, 1))(g, scale)
        for a, b in zip(got, ref, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kv", [1, 2])
def test_grouped_attention_equals_attention_over_repeated_keys(kv):
    """Grouped-query (and multi-query) attention, naive and fused, equals full multi-head
    attention whose keys and values are repeated over each group (values and gradients)."""
    cfg = LLAMA.replace(n_kv_heads=kv, positions="learned")
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(2), 3)
        b, s, h, d = 2, 13, cfg.n_heads, cfg.head_dim
        q = jax.random.normal(keys[0], (b, s, h, d), jnp.float64)
        k, v = (jax.random.normal(kk, (b, s, kv, d), jnp.float64) for kk in keys[1:])

        def repeated(q, k, v):
            k, v = jnp.repeat(k, h // kv, axis=2), jnp.repeat(v, h // kv, axis=2)
            return flash_attention(q, k, v, True, 4)

        def loss(f):
            return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))

        ref = jax.value_and_grad(loss(repeated), (0, 1, 2))(q, k, v)
        got = jax.value_and_grad(loss(lambda *a: flash_attention(*a, True, 4)), (0, 1, 2))(q, k, v)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-14)
        for a, r in zip(got[1], ref[1], strict=True):
            np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-14)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [LLAMA, QWEN], ids=["llama", "qwen2"])
def test_fused_decoder_equals_naive_in_float64(cfg):
    with jax.enable_x64(True):
        out = {}
        for attention in ("naive", "fused"):
            c = cfg.replace(attention=attention)
            graphdef, params = make(c, "float64")
            loss = lm_loss_fn(graphdef, layers_fn=layers_fn(POLICIES["none"], c.n_layers))
            batch = batch_of(c)
            value, grads = jax.jit(jax.value_and_grad(lambda p, f=loss, b=batch: f(p, b)[0]))(
                params
            )
            out[attention] = (float(value), jax.tree.leaves(grads))
    tol = tolerance("float64", "fused_vs_naive")
    np.testing.assert_allclose(out["fused"][0], out["naive"][0], rtol=tol.rtol, atol=tol.atol)
    for a, b in zip(out["fused"][1], out["naive"][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=tol.rtol, atol=tol.atol)


# ----------------------------------------------------------------------- memory policies
POLICY_CASES = {**POLICIES, "none:2+selective": mixed_policy("none", 2, "selective")}


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["naive", "fused"])
def test_every_policy_gives_the_no_remat_gradients_in_float64(attention):
    cfg = LLAMA.replace(attention=attention)
    with jax.enable_x64(True):
        graphdef, params = make(cfg, "float64")
        batch = batch_of(cfg)

        def grads(policy):
            loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
            return jax.tree.leaves(jax.jit(jax.grad(lambda p: loss(p, batch)[0]))(params))

        base = grads(POLICIES["none"])
        tol = tolerance("float64", "remat_vs_none")
        for name, policy in POLICY_CASES.items():
            for a, b in zip(grads(policy), base, strict=True):
                np.testing.assert_allclose(a, b, rtol=tol.rtol, atol=tol.atol, err_msg=name)


def kept_names(cfg: ModelConfig, policy: MemoryPolicy) -> set[str]:
    graphdef, params = make(cfg)
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
    residuals = saved_residuals(lambda p, b: loss(p, b)[0], params, batch_of(cfg, s=16))
    names = {r.name for r in residuals if r.origin == "computed" and r.name}
    return names - {"<layer input>", "<stack output>"}


@pytest.mark.parametrize("attention", ["naive", "fused"])
def test_with_every_tag_stored_jax_keeps_what_the_backward_reads(attention):
    """The rotated q/k, not the projections; gate and up (the product's sources) and the
    product (down's input); RMSNorm's inputs."""
    cfg = LLAMA.replace(attention=attention)
    everything = MemoryPolicy.of(BlockPolicy(save=model_tags(cfg)), name="all")
    assert kept_names(cfg, everything) == set(backward_reads(cfg))
    assert {"query_rope", "key_rope", "mlp_gate", "mlp_up", "mlp_act"} <= backward_reads(cfg)
    assert not {"query_proj", "key_proj"} & backward_reads(cfg)


def test_selective_keeps_the_projections_and_recomputes_rope_and_the_activation():
    names = kept_names(LLAMA, POLICIES["selective"])
    assert {"query_proj", "key_proj", "value_proj", "mlp_gate", "mlp_up"} <= names
    assert not names & {"query_rope", "key_rope", "mlp_act", "attn_probs", "norm1_out"}


def test_tags_the_block_does_not_produce_are_refused_with_the_reason():
    gpt = PRESETS["tiny"]
    with pytest.raises(ConfigError, match="query_rope and key_rope exist only with positions"):
        check_policy(gpt, MemoryPolicy.of(BlockPolicy(save=("query_rope",)), name="custom"))
    with pytest.raises(ConfigError, match="mlp_gate exists only with mlp='gated'"):
        check_policy(gpt, MemoryPolicy.of(BlockPolicy(save=("mlp_gate",)), name="custom"))
    check_policy(
        LLAMA, MemoryPolicy.of(BlockPolicy(save=("query_rope", "mlp_gate")), name="custom")
    )
    assert set(CHECKPOINT_NAMES) - set(model_tags(LLAMA)) == {"attn_lse"}


@pytest.mark.parametrize("name", ["none", "full", "selective", "mlp", "offload", "nested"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["naive", "fused"])
def test_the_analytic_model_equals_jax_residuals(name, precision, attention):
    """Byte for byte, per policy, precision and attention form, with GQA (keys and values
    kv_heads wide), RoPE and SwiGLU; and model FLOPs equal the traced matmuls under none."""
    cfg, prec, b, s = LLAMA.replace(attention=attention), PRECISIONS[precision], 2, 16
    dt = jnp.dtype(prec.compute_dtype)
    model = Decoder(cfg, rngs=nnx.Rngs(0), dtype=dt, param_dtype=jnp.dtype(prec.param_dtype))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.zeros((b, s), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(POLICIES[name], cfg.n_layers))
    measured = bytes_by_name(saved_residuals(lambda p, bt: loss(p, bt)[0], params, batch))
    stack = sum(v for k, v in measured.items() if k not in ("<untagged>", "<stack output>"))
    estimate = analytic.saved_activation_bytes(cfg, POLICIES[name], b, s, prec)
    assert stack == estimate.device_bytes + estimate.host_bytes
    if name == "none":
        flops = grad_matmul_flops(lambda p, bt: loss(p, bt)[0], params, batch)
        assert flops == analytic.model_flops(cfg, b, s)


# ------------------------------------------------------------------ the fused kernel on a GPU
@pytest.mark.parametrize(
    ("head_dim", "dtype", "platform", "cudnn", "kernel"),
    [
        (64, "bfloat16", "gpu", True, "cudnn"),
        (128, "float16", "cuda", True, "cudnn"),
        (64, "float32", "gpu", True, "blockwise"),  # cuDNN's flash kernel is 16-bit only
        (256, "bfloat16", "gpu", True, "blockwise"),  # beyond its head size
        (64, "bfloat16", "gpu", False, "blockwise"),  # cuDNN not installed
        (64, "bfloat16", "cpu", True, "blockwise"),
    ],
)
def test_fused_attention_runs_cudnn_on_a_gpu_where_it_applies(
    head_dim, dtype, platform, cudnn, kernel
):
    from jaxmem.model.flash import fused_kernel

    assert fused_kernel(head_dim, jnp.dtype(dtype), platform, cudnn) == kernel


def test_a_record_says_which_fused_kernel_ran():
    from jaxmem.planner.records import jax_record

    cfg = LLAMA.replace(attention="fused", n_layers=2)
    spec = StepSpec(
        model=cfg, policy=POLICIES["none"], precision=PRECISIONS["bf16"], batch=2, seq_len=16
    )
    rec = jax_record(spec)
    assert rec["attention_kernel"] == "blockwise (jaxmem.model.flash)"  # this CPU backend
    rec = jax_record(spec.replace(model=LLAMA.replace(n_layers=2)))
    assert rec["attention_kernel"] == "naive"


def test_silu_is_a_gate_and_a_rope_block_needs_its_tables():
    with pytest.raises(ConfigError, match="activation='silu' is SwiGLU's gate: it needs mlp="):
        PRESETS["tiny"].replace(activation="silu")
    block = Decoder(LLAMA, rngs=nnx.Rngs(0)).blocks.layers
    graphdef, state = nnx.split(block)
    layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    with pytest.raises(ValueError, match="call the block with RoPE's tables"):
        layer(jnp.zeros((1, 4, LLAMA.d_model)), None)

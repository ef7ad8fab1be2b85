"""LoRA on a quantized frozen base (QLoRA), jaxmem's side: the block projections are stored
packed in the parameter tree (q, k, v packed separately), as many bytes as the analytic model
counts; a step keeps no dequantized weight among its residuals; the loss is that of the model
whose kernels are their dequantized values; and ``jaxmem train --init-from DIR --lora-rank R
--quantize-base nf4`` trains and resumes bit for bit."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.adapters import AdapterConfig
from jaxmem.config import PRESETS, OptimizerConfig
from jaxmem.memory.analytic import adapter_state
from jaxmem.memory.residuals import saved_residuals
from jaxmem.model import make_model
from jaxmem.model.qbase import PackedBase, QuantizedLinear, packed_param_bytes, quantize_base
from jaxmem.model.quant import dequantize
from jaxmem.policy import POLICIES
from jaxmem.precision import Precision
from jaxmem.step.build import build_step
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import lm_loss_fn
from tests.test_cli_contract import run_cli
from tests.test_hub import TINY_LLAMA, write_model_dir
from tests.test_lora import LORA_FLAGS

LLAMA = PRESETS["tiny-llama"]
QLORA = AdapterConfig(rank=4, targets=("q", "k", "v", "o"), base="nf4")


def _batch() -> dict[str, jax.Array]:
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, LLAMA.vocab_size)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _loss(model) -> float:
    graphdef, params = nnx.split(model, nnx.Param)
    return float(jax.jit(lambda p, b: lm_loss_fn(graphdef)(p, b)[0])(params, _batch()))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_the_packed_base_takes_the_analytic_bytes_and_never_trains(kind):
    ad = dataclasses.replace(QLORA, base=kind)
    spec = StepSpec(model=LLAMA, policy=POLICIES["none"], batch=2, seq_len=16, adapters=ad)
    built, params = build_step(spec)  # shapes
    expected = adapter_state(LLAMA, ad, OptimizerConfig(), Precision(name="fp32"))
    assert packed_param_bytes(params) == expected.quantized_bytes
    trained, frozen = built.trainable.split(params)
    n_trained, n_frozen = built.trainable.counts(params)  # the weights packed, not their bytes
    assert n_frozen == LLAMA.n_params and n_trained == expected.adapter_params
    assert not jax.tree.leaves(trained.filter(PackedBase))
    # no float kernel left in the blocks: embeddings, head and norms stay as they were
    kernels = [p for p, _ in nnx.to_flat_state(params) if p[-1] == "kernel"]
    assert kernels == [("lm_head", "kernel")] or all("blocks" not in p for p in kernels)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_a_qlora_step_saves_no_dequantized_weight(policy):
    """Whatever the policy, the step's backward keeps the packed arrays, never a weight."""
    spec = StepSpec(model=LLAMA, policy=POLICIES[policy], batch=2, seq_len=16, adapters=QLORA)
    built, params = build_step(spec, make_model(LLAMA, adapters=QLORA))
    trained, _, loss = built.trainable.bind(lambda p, b: built.plain_loss(p, b)[0], params)
    saved = saved_residuals(loss, trained, _batch())
    d, kv, f, n = LLAMA.d_model, LLAMA.kv_dim, LLAMA.d_ff, LLAMA.n_layers
    weights = {(o, i) for o, i in [(d, d), (kv, d), (f, d), (d, f)]}
    weights |= {(n, *w) for w in weights} | {(i, o) for o, i in weights}
    computed = [r.shape for r in saved if r.origin != "argument"]
    assert computed and not set(computed) & weights, set(computed) & weights


def test_the_nf4_loss_is_that_of_the_dequantized_kernels_in_fp32():
    model = make_model(LLAMA, seed=3, adapters=QLORA)
    reference = nnx.clone(model)
    quantize_base(model, "nf4")
    layers, ref = model.blocks.layers, reference.blocks.layers

    def kernel(linear: QuantizedLinear) -> jax.Array:  # [L, in, out], dequantized
        cols = []
        for name in linear.names:
            qw = getattr(linear, name).weight()
            layers = range(LLAMA.n_layers)
            cols.append(
                jnp.stack([dequantize(jax.tree.map(lambda a, i=i: a[i], qw)).T for i in layers])
            )
        return jnp.concatenate(cols, axis=-1)

    pairs = [(layers.self_attn, ref.self_attn, n) for n in ("in_proj", "out_proj")]
    pairs += [(layers.ffn, ref.ffn, n) for n in ("gate", "up", "down")]
    for ours, theirs, name in pairs:
        getattr(theirs, name).kernel[...] = kernel(getattr(ours, name))
    assert _loss(model) == _loss(reference)


def _losses(run) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


@pytest.mark.slow
def test_qlora_trains_from_a_directory_and_resumes_2_plus_2_as_4_bit_for_bit(tmp_path):
    # nf4 packs blocks of 64 along the input: d_ff a multiple of 64
    model = write_model_dir(tmp_path / "model", TINY_LLAMA | {"intermediate_size": 128})
    common = ("train", "--init-from", model, "--quantize-base", "nf4", *LORA_FLAGS)
    common += ("--batch-size", "2", "--seq-len", "16", "--checkpoint-every", "2")
    common += ("--eval-every", "2", "--sample-tokens", "0")
    straight = run_cli(*common, "--steps", "4", "--out", str(tmp_path / "straight"))
    half = run_cli(*common, "--steps", "2", "--out", str(tmp_path / "resumed"))
    resumed = run_cli(*common, "--steps", "4", "--out", str(tmp_path / "resumed"), "--resume")
    for proc in (straight, half, resumed):
        assert proc.returncode == 0, proc.stderr
    losses = _losses(tmp_path / "straight")
    assert len(losses) == 4 and np.isfinite(losses).all() and losses[-1] < losses[0]
    assert _losses(tmp_path / "resumed") == losses

"""Per-tag mixed stacks and the replayed embedding lookup in JAX: written as data, run by every
step form (scanned, unrolled, accumulated in place), trained and resumed by ``jaxmem train``,
planned for an H100, and refused in one line where they cannot apply. Both frameworks' float64
gradients and kept bytes: ``parity_tests/test_replay.py``."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmem import cli
from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS, ConfigError
from jaxmem.memory.remat import accumulating_layers_fn, layers_fn
from jaxmem.model import make_model
from jaxmem.planner.records import lm_step_batch
from jaxmem.policy import (
    BLOCKS,
    POLICIES,
    QKV,
    BlockPolicy,
    EmbeddingReplay,
    LayerSelection,
    MemoryPolicy,
    StackPart,
    mixed_policy,
)
from jaxmem.policy_config import policy_from_dict, policy_to_dict
from jaxmem.precision import FP64
from jaxmem.step.train_step import lm_loss_fn
from tests.test_train import TINY, metrics, snapshot

QKV_UP = MemoryPolicy.custom({n: "device" for n in (*QKV, "mlp_up")})
OUT_UP = MemoryPolicy.custom({"attn_out": "device", "mlp_up": "device"})
TAG_MIX = mixed_policy(QKV_UP, 2, OUT_UP)


def test_a_per_tag_mix_is_data_named_by_what_each_part_keeps():
    assert TAG_MIX.name == "keep(qkv+mlp_up):2+keep(attn_out+mlp_up)"
    assert TAG_MIX.parts[1] == StackPart(block=BlockPolicy(save=("attn_out", "mlp_up")))
    section = policy_to_dict(TAG_MIX)
    assert (section["rest"], section["rest_save"]) == ("custom", ["attn_out", "mlp_up"])
    for policy in (
        TAG_MIX,
        TAG_MIX.replace(embedding=EmbeddingReplay(True)),
        mixed_policy("full", 1, OUT_UP),
    ):
        assert policy_from_dict(policy_to_dict(policy)) == policy
    with pytest.raises(ConfigError, match="set rest='custom'"):
        policy_from_dict(
            {"policy": "full", "layers_first": 1, "rest": "none", "rest_save": ["mlp_up"]}
        )
    with pytest.raises(ConfigError, match="rest_save has unknown tag"):
        policy_from_dict({**section, "rest_save": ["mlp_upp"]})


@pytest.mark.parametrize(
    "policy",
    [
        POLICIES["none"],
        POLICIES["nested"],
        mixed_policy("none", 2, "full"),
        MemoryPolicy.of(BLOCKS["full"], name="full", layers=LayerSelection(layers=(1, 2))),
    ],
    ids=["none", "nested", "none-first", "layers-without-0"],
)
def test_replay_is_refused_where_the_first_block_keeps_its_input(policy):
    with pytest.raises(ConfigError, match="replay_embedding needs the first block rematerialised"):
        policy.replace(embedding=EmbeddingReplay(True))


@pytest.mark.slow
def test_replay_in_every_step_form_is_plain_autodiff_in_float64():
    """Scanned, unrolled and accumulated in place (the custom VJP that adds each block's
    gradient into the running sum): with the lookup replayed, every gradient leaf (the
    embeddings' included) is ``none``'s, for a preset and a per-tag mix."""
    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=3)
    with jax.enable_x64(True):
        graphdef, params = nnx.split(make_model(cfg, FP64, seed=0), nnx.Param)
        data = lm_step_batch(cfg, 4, 16, abstract=False)

        def grads(lf):
            loss = lm_loss_fn(graphdef, layers_fn=lf)
            return jax.jit(jax.grad(lambda p: loss(p, data)[0]))(params)

        reference = grads(layers_fn(POLICIES["none"], cfg.n_layers))
        stack = reference["blocks"]["layers"]
        for base in (POLICIES["selective"], TAG_MIX):
            policy = base.replace(embedding=EmbeddingReplay(True))
            runs = [layers_fn(policy, cfg.n_layers), layers_fn(policy.replace(unroll=True), 3)]
            for lf in runs:
                got = grads(lf)
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True):
                    np.testing.assert_allclose(
                        np.asarray(a),
                        np.asarray(b),
                        **tolerance("float64", "remat_vs_none").kwargs(),
                    )
            # in place: the stack's gradient arrives as the running sum's cotangent
            acc = jax.tree.map(lambda a: a * 0 + 1.0, stack)

            def summed(a, policy=policy):
                lf = accumulating_layers_fn(policy, cfg.n_layers, a)
                return lm_loss_fn(graphdef, layers_fn=lf)(params, data)[0]

            d_acc = jax.jit(jax.grad(summed))(acc)
            for a, b in zip(jax.tree.leaves(d_acc), jax.tree.leaves(stack), strict=True):
                np.testing.assert_allclose(
                    np.asarray(a) - 1.0,
                    np.asarray(b),
                    **tolerance("float64", "remat_vs_none").kwargs(),
                )
        assert float(np.abs(np.asarray(reference["wte"]["embedding"])).max()) > 0


def test_a_per_tag_mix_with_the_embedding_replayed_trains_and_resumes(tmp_path, capsys):
    """``jaxmem train`` runs a per-tag mix with the lookup replayed, accumulated in place,
    to ``none``'s losses, resumes it from its config (the policy read back from it), and refuses
    a resume that turns the replay off, changing nothing."""
    mixed, plain = tmp_path / "mixed", tmp_path / "plain"
    policy = ["--policy", "custom", "--save", "query_proj,key_proj,value_proj,mlp_up"]
    policy += ["--set", "memory.layers_first=1", "--set", "memory.rest=custom"]
    policy += ["--set", 'memory.rest_save=["attn_out", "mlp_up"]', "--replay-embedding"]
    common = ["--accum", "2", "--checkpoint-every", "2", "--eval-every", "2"]

    def train(*args: str) -> int:
        return cli.main(["train", *TINY, *common, *args])

    assert train("--steps", "2", *policy, "--out", str(mixed)) == 0
    assert train("--steps", "4", "--out", str(mixed), "--resume") == 0
    assert train("--steps", "4", "--policy", "none", "--out", str(plain)) == 0
    got, want = metrics(mixed), metrics(plain)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [r["loss"] for r in got],
        [r["loss"] for r in want],
        **tolerance("float32", "remat_vs_none").kwargs(),
    )
    written = (mixed / "config.yaml").read_text()
    assert "keep(qkv+mlp_up):1+keep(attn_out+mlp_up)" in written
    before = snapshot(mixed)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        train(
            "--steps",
            "5",
            "--set",
            "memory.replay_embedding=false",
            "--out",
            str(mixed),
            "--resume",
        )
    assert exc.value.code == 2 and "replay_embedding" in capsys.readouterr().err
    assert snapshot(mixed) == before

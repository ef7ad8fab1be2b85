from __future__ import annotations

import dataclasses
import json

import pytest
from flax import nnx

from jaxmem.config import PRESETS, ConfigError, ModelConfig, OptimizerConfig, get_preset
from jaxmem.job import JobConfig
from jaxmem.model import Decoder
from jaxmem.policy import BLOCKS, POLICIES, BlockPolicy, LayerSelection, LossPolicy, MemoryPolicy
from jaxmem.policy_config import policy_from_dict, policy_to_dict
from jaxmem.precision import FP64, PRECISIONS
from jaxmem.step.train_step import tree_bytes


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates_and_round_trips(name):
    cfg = get_preset(name)
    assert ModelConfig(**dataclasses.asdict(cfg)) == cfg
    assert cfg.n_params > 0


def test_gpt2_124m_parameter_count_is_the_published_one():
    # 124,439,808: GPT-2 small with tied embeddings (nanoGPT prints the same count).
    assert PRESETS["gpt2-124m"].n_params == 124_439_808
    assert 6.5e9 < PRESETS["gpt3-6.7b"].n_params < 6.9e9


@pytest.mark.parametrize(
    "cfg",
    [
        PRESETS["tiny"],
        PRESETS["seed"],
        ModelConfig(
            vocab_size=259,
            d_model=72,
            n_heads=3,
            n_layers=5,
            d_ff=200,
            max_seq_len=13,
            bias=False,
            tie_embeddings=False,
            norm="post",
        ),
    ],
    ids=["tiny", "seed", "odd"],
)
def test_analytic_parameter_count_matches_the_real_arrays(cfg):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert tree_bytes(nnx.state(model, nnx.Param)) == 4 * cfg.n_params


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"d_model": 100, "n_heads": 3}, "d_model=100 is not divisible by n_heads=3"),
        ({"n_layers": 0}, "n_layers=0 must be a positive integer"),
        ({"vocab_size": 2.5}, "vocab_size=2.5"),
        ({"norm": "middle"}, "norm='middle' is not one of"),
        ({"activation": "swish"}, "activation='swish' is not one of"),
        ({"bias": 1}, "bias=1 must be True or False"),
        ({"layer_norm_eps": 0.0}, "layer_norm_eps=0.0"),
    ],
)
def test_bad_model_values_are_named(change, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        PRESETS["tiny"].replace(**change)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown preset 'huge'; choose one of: tiny, small"):
        get_preset("huge")


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny"].d_model = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"lr": 0.0}, "lr=0.0 must be a positive, finite float"),
        ({"lr": float("inf")}, "lr=inf must be a positive, finite float"),
        ({"name": "lion"}, "optimizer='lion' is not one of"),
        ({"b2": 1.0}, "b2=1.0 must be in"),
        ({"weight_decay": -1.0}, "weight_decay=-1.0"),
    ],
)
def test_bad_optimizer_values_are_named(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        OptimizerConfig(**kwargs)


@pytest.mark.parametrize(
    "policy",
    [
        *POLICIES.values(),
        MemoryPolicy.of(
            BLOCKS["full"], layers=LayerSelection(every=2), name="full", use_reentrant=True
        ),
        MemoryPolicy.of(
            BLOCKS["selective"], layers=LayerSelection(layers=(0, 2)), name="selective"
        ),
        POLICIES["none"].replace(unroll=True),
        MemoryPolicy.custom({"mlp_up": "device"}, unroll=True),
        MemoryPolicy.custom({"mlp_up": "device", "norm1_out": "offload"}),
        MemoryPolicy.custom({"attn_out": "offload"}, layers=LayerSelection(first=1)),
        POLICIES["selective"].replace(loss=LossPolicy(4)),
        MemoryPolicy.custom({"mlp_up": "device"}).replace(loss=LossPolicy(2)),
    ],
    ids=lambda p: (
        f"{p.name}-{p.parts[0].layers}{'-unrolled' if p.unroll else ''}"
        f"{f'-loss{p.loss.chunks}' if p.loss.chunks else ''}"
    ),
)
def test_memory_policies_round_trip_through_the_run_config(policy):
    """Names at the file boundary only: a run config's [memory] section reads back to the very
    same MemoryPolicy object (JobConfig holds objects)."""
    section = json.loads(json.dumps(policy_to_dict(policy)))  # as a file gives it back
    assert policy_from_dict(section) == policy
    job = JobConfig.from_dict({"preset": "tiny", "model": {"n_layers": 3}, "memory": section})
    assert job.memory == policy and JobConfig.from_dict(job.to_dict()) == job


def test_a_job_holds_objects_and_refuses_what_a_file_cannot_name():
    job = JobConfig.from_dict({"preset": "tiny", "precision": "bf16"})
    assert job.precision == PRECISIONS["bf16"] and job.memory == POLICIES["none"]
    with pytest.raises(ConfigError, match="'fp64' is not one of the named precisions"):
        JobConfig(preset="tiny", model=PRESETS["tiny"], precision=FP64)
    with pytest.raises(ConfigError, match="must be a MemoryPolicy"):
        JobConfig(preset="tiny", model=PRESETS["tiny"], memory="selective")
    with pytest.raises(ConfigError, match="cannot be written to a run config"):
        policy_to_dict(MemoryPolicy.of(BlockPolicy(save_dots=True), name="mine"))
    with pytest.raises(ConfigError, match="layer indices \\[5\\] are out of range"):
        JobConfig.from_dict({"preset": "tiny", "memory": {"policy": "full", "layers": [5]}})

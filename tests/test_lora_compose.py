"""What adapters compose with beyond the basics of ``tests/test_lora.py``: their dropout (PEFT's
``lora_dropout``, on the adapter's input only, masks drawn from keys of the run's seed, the
update count and the row) and tensor parallelism (the adapters split like the kernels they sit
beside). Cross-framework equality of dropout masks is not tested: JAX and torch draw from
different generators; torch_ref's fused q/k/v adapter is checked against PEFT's per-part layers
under the same torch generator state instead."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.adapters import TARGETS, AdapterConfig
from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS
from jaxmem.memory.remat import layers_fn
from jaxmem.model import make_model
from jaxmem.model.decoder import DROPOUT_KEYS, AdapterDropout
from jaxmem.policy import POLICIES, mixed_policy
from jaxmem.precision import FP64
from jaxmem.sharding import tensor_dim
from jaxmem.step.frozen import DropoutRng, Trainable, dropout_keys
from jaxmem.step.train_step import lm_loss_fn
from tests.test_cli_contract import run_cli
from tests.test_lora import RUN_FLAGS, _batch, _losses, _refused, _with_random_b

LLAMA = PRESETS["tiny-llama"]
DROPPED = AdapterConfig(rank=4, alpha=16.0, targets=TARGETS, dropout=0.25)


def _keys(step: int, rows: int = 2, seed: int = 3) -> jax.Array:
    return dropout_keys(DropoutRng(jnp.uint32(seed), jnp.int32(step)), rows)


# ------------------------------------------------------------------------------- the masks
def test_dropout_zeroes_or_scales_each_input_element_by_one_over_keep():
    """Inverted dropout: each element is 0 or x / (1 - p) (torch's arithmetic: x times the
    rounded 1 / (1 - p)), kept at a rate near 1 - p, so the adapter's expected input is x;
    each row, block and target draws its own mask, the same keys the same mask."""
    x = jnp.asarray(np.random.default_rng(0).uniform(1.0, 2.0, (2, 64, 128)), jnp.float32)
    p = 0.25
    drop = AdapterDropout(p, _keys(0))
    y = drop(x, "q")
    scaled = x * jnp.float32(1 / (1 - p))
    assert bool(jnp.all((y == 0) | (y == scaled)))
    kept = float(jnp.mean(y != 0))
    assert abs(kept - (1 - p)) < 0.01  # 16,384 draws: 5 standard deviations is 0.017
    assert abs(float(jnp.mean(y / x)) - 1.0) < 0.02  # E[dropout(x)] = x
    assert bool(jnp.all(drop(x, "q") == y))  # a recompute draws the same mask
    assert not bool(jnp.all((drop(x, "k") == 0) == (y == 0)))  # each target its own
    assert not bool(jnp.all((y[0] == 0) == (y[1] == 0)))  # each row its own
    other_step = AdapterDropout(p, _keys(1))(x, "q")
    assert not bool(jnp.all((other_step == 0) == (y == 0)))
    assert bool(jnp.all(AdapterDropout(0.0, _keys(0))(x, "q") == x))


def test_a_rows_keys_do_not_depend_on_the_batch_split():
    """Row i's key is the step's key folded with i: the first rows of a batch of 4 have the
    keys of a batch of 2 (so microbatches and data-parallel shards draw the same masks)."""
    assert np.array_equal(_keys(5, rows=4)[:2], _keys(5, rows=2))


@pytest.fixture(scope="module")
def fp64_model():
    with jax.enable_x64(True):
        graphdef, params = nnx.split(make_model(LLAMA, FP64, adapters=DROPPED), nnx.Param)
        yield graphdef, _with_random_b(params)


def test_dropout_zero_and_no_keys_compute_the_model_without_dropout_exactly(fp64_model):
    graphdef, params = fp64_model
    batch = _batch(LLAMA)
    with jax.enable_x64(True):
        zero = dataclasses.replace(DROPPED, dropout=0.0)
        undropped = nnx.merge(graphdef, params)(batch["inputs"])
        as_zero = make_model(LLAMA, FP64, adapters=zero)
        nnx.update(as_zero, params)
        keyed = as_zero(batch["inputs"], dropout_keys=_keys(0))
        assert np.array_equal(keyed, undropped)  # rate 0: no mask drawn
        loss = lm_loss_fn(graphdef)
        dropped = loss(params, {**batch, DROPOUT_KEYS: _keys(0)})[0]
        assert float(dropped) != float(loss(params, batch)[0])  # the keys drop out inputs


@pytest.mark.slow
def test_recomputed_blocks_draw_the_no_remat_masks_and_gradients_in_float64(fp64_model):
    """The masks come from keys passed in, so a block's recompute (scanned, nested, mixed,
    unrolled) draws the masks its forward drew: the gradients equal no remat's."""
    graphdef, params = fp64_model
    with jax.enable_x64(True):
        trainable = Trainable(DROPPED)
        trained, frozen = trainable.split(params)
        batch = {**_batch(LLAMA), DROPOUT_KEYS: _keys(7)}

        def grads(policy):
            loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, LLAMA.n_layers))
            of = lambda t: loss(trainable.merge(t, frozen), batch)[0]  # noqa: E731
            return jax.jit(jax.value_and_grad(of))(trained)

        base_loss, base = grads(POLICIES["none"])
        tol = tolerance("float64", "remat_vs_none").kwargs()
        # one policy per way the stack runs (tests/test_lora.py runs every policy without
        # dropout): a scanned checkpoint, nested segments, several parts under one custom VJP,
        # unrolled blocks
        cases = {name: POLICIES[name] for name in ("selective", "nested")}
        cases["none:1+full"] = mixed_policy("none", 1, "full")
        cases["full, unrolled"] = POLICIES["full"].replace(unroll=True)
        for name, policy in cases.items():
            loss, g = grads(policy)
            np.testing.assert_allclose(loss, base_loss, **tol, err_msg=name)
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(base), strict=True):
                np.testing.assert_allclose(a, b, **tol, err_msg=name)


# ------------------------------------------------------------------ tensor parallelism layout
def _path(*names: str) -> tuple:
    return tuple(jax.tree_util.DictKey(n) for n in names)


@pytest.mark.parametrize(
    ("module", "target", "leaf", "dim"),
    [
        ("self_attn", "lora_q", "lora_b", 2),  # column-parallel: B [L, r, out] by columns
        ("self_attn", "lora_v", "lora_a", None),  # ... A replicated
        ("ffn", "lora_gate", "lora_b", 2),
        ("ffn", "lora_up", "lora_a", None),
        ("self_attn", "lora_o", "lora_a", 1),  # row-parallel: A [L, in, r] by rows
        ("self_attn", "lora_o", "lora_b", None),  # ... B replicated
        ("ffn", "lora_down", "lora_a", 1),
        ("ffn", "lora_down", "lora_b", None),
    ],
)
def test_adapters_split_over_the_tensor_axis_as_their_kernels(module, target, leaf, dim):
    path = _path("blocks", "layers", module, target, leaf)
    assert tensor_dim(path, (2, 32, 4) if leaf == "lora_a" else (2, 4, 32), True) == dim


# ------------------------------------------------------------------- jaxmem train, CLI runs
DROPOUT_FLAGS = ("--lora-rank", "4", "--lora-targets", "q,k,v,o,gate,up,down")
DROPOUT_FLAGS += ("--lora-dropout", "0.1", "--accum", "2")


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory):
    """tiny-llama with dropped-out adapters over 2 microbatches: 4 steps straight, 2 steps
    then resumed to 4, and 4 steps over a tp=2 mesh of 2 CPU devices (each a subprocess)."""
    root = tmp_path_factory.mktemp("lora-dropout")
    common = ("train", "--preset", "tiny-llama", *DROPOUT_FLAGS, *RUN_FLAGS)
    runs = [
        ("--steps", "4", "--out", str(root / "straight")),
        ("--steps", "2", "--out", str(root / "resumed")),
        ("--steps", "4", "--out", str(root / "resumed"), "--resume"),
        ("--steps", "4", "--mesh", "tp=2", "--out", str(root / "tp")),
    ]
    for args in runs:
        proc = run_cli(*common, *args)
        assert proc.returncode == 0, proc.stderr
    return root


@pytest.mark.slow
def test_a_dropout_run_resumed_after_2_steps_equals_4_straight_bit_for_bit(dropout_runs):
    """The masks' keys come from the seed and the update count the checkpoint holds."""
    straight = _losses(dropout_runs / "straight")
    assert len(straight) == 4 and all(np.isfinite(straight))
    assert _losses(dropout_runs / "resumed") == straight


@pytest.mark.slow
def test_a_tensor_parallel_adapter_run_with_dropout_logs_the_one_device_losses(dropout_runs):
    """Adapters on every projection split over tp=2 (and their dropout masks per row, the same
    on any layout): the one-device losses within the data-parallel bound."""
    np.testing.assert_allclose(
        _losses(dropout_runs / "tp"),
        _losses(dropout_runs / "straight"),
        **tolerance("float32", "data_parallel_loss").kwargs(),
    )


# ---------------------------------------------------------------- what stays refused, and where
STILL_REFUSED = {
    "stream": (["--stream"], "--stream: a streamed stack with adapters is not built yet"),
    "host-state": (["--state-memory", "pinned_host"], "--state-memory pinned_host: adapters"),
    "host-params": (
        ["--set", "optimizer.params_memory=pinned_host"],
        "optimizer.params_memory='pinned_host': adapters keep the parameters on the device",
    ),
}


@pytest.mark.parametrize("command", ["train", "memory", "peak"])
def test_what_adapters_do_not_compose_with_is_one_line_exit_2_in_every_step_command(
    command, capsys, tmp_path
):
    """Refused before anything compiles (``jaxmem peak`` before its child process starts),
    naming the value and the flag to drop; nothing written."""
    for case, (args, message) in STILL_REFUSED.items():
        if command == "memory" and case == "stream":
            continue  # memory measures no streamed step at all (its own one-line refusal)
        out = ["--out", str(tmp_path / case)] if command == "train" else []
        line = _refused(
            capsys, [command, "--preset", "tiny-llama", "--lora-rank", "4", *args, *out]
        )
        assert line.startswith(f"jaxmem {command}: error: ") and message in line, (case, line)
    assert not list(tmp_path.iterdir())

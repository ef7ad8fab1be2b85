from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.job import config_conflicts
from jaxmem.model import make_model
from jaxmem.precision import get_precision
from jaxmem.run_layout import CheckpointError
from jaxmem.step.scaling import DynamicLossScale, init_loss_scale
from jaxmem.step.train_step import lm_loss_fn, make_optimizer, make_train_step
from jaxmem.train.checkpoint import TMP_SUFFIX, RunCheckpointer, read_config

TINY = get_preset("tiny")
OPT = OptimizerConfig(lr=3e-3, weight_decay=0.1)
RUN_CONFIG = {
    "model": {"d_model": 64, "n_layers": 2, "norm": "pre"},
    "optimizer": {"name": "adamw", "lr": 3e-3, "betas": (0.9, 0.999)},
    "steps": 6,
    "batch_size": 4,
}


def fresh_state(precision: str = "fp32", seed: int = 0):
    """(graphdef, params, tx, opt_state, loss_scale) of a newly initialised tiny run."""
    prec = get_precision(precision)
    graphdef, params = nnx.split(make_model(TINY, prec, seed=seed), nnx.Param)
    tx = make_optimizer(OPT)
    return graphdef, params, tx, tx.init(params), init_loss_scale(prec)


def scrambled(tree, seed: int):
    """``tree`` with every floating leaf replaced by random values of the same dtype and
    sharding (so a round trip cannot pass by restoring zeros or the initial values)."""
    leaves, treedef = jax.tree.flatten(tree)
    rng = np.random.default_rng(seed)
    out = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)
        out.append(x)
    return jax.tree.unflatten(treedef, out)


def assert_identical(a, b) -> None:
    """Same tree structure (types included) and bit-identical leaves of equal dtype/sharding."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.sharding == y.sharding
        bits = lambda a: np.asarray(a).reshape(-1).view(np.uint8)  # noqa: E731
        np.testing.assert_array_equal(bits(x), bits(y), strict=True)


def batches(n: int, seed: int = 0) -> list[dict[str, jax.Array]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, TINY.vocab_size, size=(4, 33), dtype=np.int32)
        out.append({"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])})
    return out


def save_state(ck: RunCheckpointer, step: int, params, opt_state, loss_scale, **kw) -> bool:
    return ck.save(
        step,
        params=params,
        opt_state=opt_state,
        loss_scale=loss_scale,
        run_config=kw.pop("run_config", RUN_CONFIG),
        extra=kw.pop("extra", {"loss": 1.25}),
        **kw,
    )


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "fp16", "pure-bf16"])
def test_round_trip_is_bit_identical_with_the_same_structure(tmp_path, precision):
    _, params, _, opt_state, loss_scale = fresh_state(precision)
    params, opt_state = scrambled(params, 1), scrambled(opt_state, 2)
    if loss_scale is not None:  # fp16: a non-default scale, tracker and (static) interval
        loss_scale = DynamicLossScale.create(init_scale=1024.0, growth_interval=100).replace(
            growth_tracker=jnp.asarray(17, jnp.int32)
        )
    extra = {"loss": 2.718281828459045, "data": {"position": 123, "seed": 0}}
    ck = RunCheckpointer(tmp_path / "ckpt", keep=2)
    assert ck.latest_step() is None and ck.all_steps() == []
    assert save_state(ck, 7, params, opt_state, loss_scale, extra=extra)

    # Restore into a different, freshly initialised state: every value must come from disk.
    _, like_p, _, like_o, like_ls = fresh_state(precision, seed=1)
    if like_ls is not None:
        like_ls = DynamicLossScale.create(growth_interval=100)
    reader = RunCheckpointer(tmp_path / "ckpt", keep=2)
    got_p, got_o, got_ls, cfg, got_extra = reader.restore(
        params_like=like_p, opt_state_like=like_o, loss_scale_like=like_ls
    )
    assert type(got_p) is nnx.State and type(got_o) is type(opt_state)
    assert_identical(got_p, params)
    assert_identical(got_o, opt_state)
    if loss_scale is None:
        assert got_ls is None
    else:
        assert isinstance(got_ls, DynamicLossScale) and got_ls.growth_interval == 100
        assert_identical(got_ls, loss_scale)
    assert cfg == json.loads(json.dumps(RUN_CONFIG))  # tuples come back as lists
    assert got_extra == extra


def test_restore_follows_the_targets_placement(tmp_path):
    _, params, _, opt_state, _ = fresh_state()
    params, opt_state = scrambled(params, 3), scrambled(opt_state, 4)
    ck = RunCheckpointer(tmp_path, keep=1)
    save_state(ck, 1, params, opt_state, None)

    # Fresh nnx/optax state is uncommitted; so is what is restored into it (jit caches on it).
    _, like_p, _, like_o, _ = fresh_state(seed=1)
    got_p, got_o, *_ = ck.restore(params_like=like_p, opt_state_like=like_o, loss_scale_like=None)
    assert not any(x.committed for x in jax.tree.leaves((like_p, like_o, got_p, got_o)))
    assert_identical((got_p, got_o), (params, opt_state))

    # Committed targets (explicit placement) and jax.eval_shape output both work too.
    device = jax.devices()[0]
    committed = jax.device_put((like_p, like_o), device)
    abstract = jax.eval_shape(lambda: fresh_state()[1:4:2])
    for target in (committed, abstract):
        got_p, got_o, *_ = ck.restore(
            1, params_like=target[0], opt_state_like=target[1], loss_scale_like=None
        )
        assert_identical((got_p, got_o), (params, opt_state))
    assert all(
        x.committed
        for x in jax.tree.leaves(
            ck.restore(params_like=committed[0], opt_state_like=committed[1], loss_scale_like=None)[
                :2
            ]
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resumed_training_is_bit_identical_to_an_uninterrupted_run(tmp_path, precision):
    data = batches(6)
    graphdef, params, tx, opt_state, loss_scale = fresh_state(precision)
    step = make_train_step(lm_loss_fn(graphdef), tx, precision=get_precision(precision))

    straight = []
    for batch in data:
        params, opt_state, loss_scale, metrics = step(params, opt_state, loss_scale, batch)
        straight.append(float(metrics["loss"]))
    final = (params, opt_state, loss_scale)

    ck = RunCheckpointer(tmp_path / "ckpt", keep=2)
    _, params, _, opt_state, loss_scale = fresh_state(precision)
    resumed = []
    for i, batch in enumerate(data[:3], start=1):
        params, opt_state, loss_scale, metrics = step(params, opt_state, loss_scale, batch)
        resumed.append(float(metrics["loss"]))
        # Save the arrays the step returned, before the next step donates them.
        save_state(ck, i, params, opt_state, loss_scale, extra={"loss": resumed[-1]})
    del params, opt_state, loss_scale, ck

    # A new "process": new checkpointer, a differently seeded state as the restore target.
    ck = RunCheckpointer(tmp_path / "ckpt", keep=2)
    assert ck.all_steps() == [2, 3]
    _, like_p, _, like_o, like_ls = fresh_state(precision, seed=42)
    params, opt_state, loss_scale, _, extra = ck.restore(
        params_like=like_p, opt_state_like=like_o, loss_scale_like=like_ls
    )
    assert extra == {"loss": resumed[-1]}
    for batch in data[3:]:
        params, opt_state, loss_scale, metrics = step(params, opt_state, loss_scale, batch)
        resumed.append(float(metrics["loss"]))

    assert resumed == straight
    assert_identical((params, opt_state, loss_scale), final)
    assert step._cache_size() == 1  # restored arrays fit the compiled step: no recompilation


# -- retention and atomicity -------------------------------------------------------------------


def test_keeps_only_the_last_k_and_respects_the_save_interval(tmp_path):
    _, params, _, opt_state, _ = fresh_state()
    ck = RunCheckpointer(tmp_path, keep=2, save_interval_steps=2)
    assert save_state(ck, 2, params, opt_state, None)
    assert not save_state(ck, 3, params, opt_state, None)  # not a multiple of 2
    assert save_state(ck, 4, params, opt_state, None)
    assert save_state(ck, 5, params, opt_state, None, force=True)  # e.g. the final step
    assert ck.all_steps() == [4, 5] and ck.latest_step() == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]
    with pytest.raises(CheckpointError, match="already holds step 5"):
        save_state(ck, 4, params, opt_state, None, force=True)
    with pytest.raises(ValueError, match="keep=0"):
        RunCheckpointer(tmp_path, keep=0)


def test_saves_are_atomic_and_partial_tmp_checkpoints_are_ignored(tmp_path, monkeypatch):
    assert TMP_SUFFIX == ocp.path.atomicity_types.TMP_DIR_SUFFIX
    _, params, _, opt_state, _ = fresh_state()
    ck = RunCheckpointer(tmp_path, keep=3)
    save_state(ck, 1, params, opt_state, None)
    assert not [p for p in tmp_path.rglob("*") if TMP_SUFFIX in p.name]
    assert (tmp_path / "1" / "commit_success.txt").exists()

    # A save killed half-way leaves `<step>.orbax-checkpoint-tmp/`: invisible to readers.
    partial = tmp_path / f"9{TMP_SUFFIX}"
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "junk").write_text("half-written")
    assert ck.latest_step() == 1 and ck.all_steps() == [1]
    assert read_config(tmp_path) == json.loads(json.dumps(RUN_CONFIG))
    got_p, *_ = ck.restore(params_like=params, opt_state_like=opt_state, loss_scale_like=None)
    assert_identical(got_p, params)

    # A save that fails before its final rename is not published either ...
    import orbax.checkpoint._src.path.atomicity as atomicity

    async def crash(*args, **kwargs):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(atomicity.async_path, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_state(ck, 2, params, opt_state, None)
    monkeypatch.undo()
    assert (tmp_path / f"2{TMP_SUFFIX}").is_dir()
    assert ck.latest_step() == 1

    # ... and the next run's checkpointer removes the leftovers.
    ck = RunCheckpointer(tmp_path, keep=3)
    save_state(ck, 2, params, opt_state, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_survives_sigkill_right_after_save(tmp_path):
    child = textwrap.dedent(
        f"""
        import os, signal
        from flax import nnx
        from jaxmem.config import OptimizerConfig, get_preset
        from jaxmem.model import make_model
        from jaxmem.train.checkpoint import RunCheckpointer
        from jaxmem.step.train_step import make_optimizer
        _, params = nnx.split(make_model(get_preset("tiny"), seed=0), nnx.Param)
        tx = make_optimizer(OptimizerConfig(lr=3e-3, weight_decay=0.1))
        ck = RunCheckpointer({str(tmp_path)!r}, keep=1)
        ck.save(5, params=params, opt_state=tx.init(params), loss_scale=None,
                run_config={{"steps": 5}}, extra={{}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert read_config(tmp_path) == {"steps": 5}
    _, params, _, opt_state, _ = fresh_state()
    ck = RunCheckpointer(tmp_path, keep=1)
    got_p, got_o, *_ = ck.restore(
        params_like=params, opt_state_like=opt_state, loss_scale_like=None
    )
    assert_identical(got_p, params)
    assert_identical(got_o, opt_state)


# -- configs ---------------------------------------------------------------------------------


def test_read_config_returns_the_latest_saved_dict_without_writing(tmp_path):
    assert read_config(tmp_path / "missing") is None
    assert not (tmp_path / "missing").exists()
    assert read_config(tmp_path) is None  # exists, but holds no checkpoint
    _, params, _, opt_state, _ = fresh_state()
    ck = RunCheckpointer(tmp_path / "ckpt", keep=2)
    save_state(ck, 1, params, opt_state, None, run_config={"steps": 1, "model": {"d_model": 64}})
    save_state(ck, 2, params, opt_state, None, run_config={"steps": 2, "model": {"d_model": 64}})
    assert read_config(tmp_path / "ckpt") == {"steps": 2, "model": {"d_model": 64}}
    assert ck.read_config(1) == {"steps": 1, "model": {"d_model": 64}}
    with pytest.raises(TypeError, match="JSON"):
        save_state(ck, 3, params, opt_state, None, run_config={"dtype": jnp.float32})


def test_config_conflicts_reports_differences_and_ignores_allowed_keys():
    job = {**RUN_CONFIG, "run": {"steps": 6, "batch_size": 4, "eval_every": 3}}
    saved = json.loads(json.dumps(job))
    new = {
        **job,
        "model": {"d_model": 128, "n_layers": 2, "norm": "pre", "bias": True},
        "optimizer": {"name": "adamw", "lr": 3e-3, "betas": (0.9, 0.95)},
        # extending the run and evaluating more often are fine (jaxmem.job.RESUMABLE_CHANGES)
        "run": {"steps": 600, "eval_every": 50},
    }
    assert config_conflicts(saved, new) == [
        "model.bias: checkpoint absent, now true",
        "model.d_model: checkpoint 64, now 128",
        "optimizer.betas: checkpoint [0.9, 0.999], now [0.9, 0.95]",
        "run.batch_size: checkpoint 4, now absent",
    ]
    assert config_conflicts(saved, job) == []  # tuple vs saved list: equal
    assert config_conflicts({"a": {"b": 1, "c": 2}}, {"a": {"b": 2, "c": 3}}, allowed=["a.b"]) == [
        "a.c: checkpoint 2, now 3"
    ]
    assert config_conflicts({"x": 1}, {"x": True}, allowed=()) == ["x: checkpoint 1, now true"]
    assert config_conflicts({"s": "pre"}, {"s": "post"}) == ["s: checkpoint pre, now post"]
    # a setting the checkpoint's config does not have is a conflict, whatever its value
    naive = {"model": {"d_model": 64, "attention": "naive"}}
    assert config_conflicts({"model": {"d_model": 64}}, naive) == [
        "model.attention: checkpoint absent, now naive"
    ]


# -- errors ----------------------------------------------------------------------------------


def test_restore_refuses_a_checkpoint_of_a_different_model_or_precision(tmp_path):
    _, params, _, opt_state, _ = fresh_state()
    ck = RunCheckpointer(tmp_path, keep=1)
    save_state(ck, 1, params, opt_state, None)

    wider = nnx.split(make_model(TINY.replace(d_model=128), seed=0), nnx.Param)[1]
    with pytest.raises(CheckpointError, match=r"d_model|\(2, 64\) float32, now \(2, 128\)"):
        ck.restore(
            params_like=wider, opt_state_like=make_optimizer(OPT).init(wider), loss_scale_like=None
        )
    _, bf16, _, bf16_opt, _ = fresh_state("pure-bf16")  # orbax alone would silently cast
    with pytest.raises(CheckpointError, match="float32, now .* bfloat16"):
        ck.restore(params_like=bf16, opt_state_like=bf16_opt, loss_scale_like=None)
    with pytest.raises(CheckpointError, match="has no loss scale but this run has a loss scale"):
        ck.restore(
            params_like=params, opt_state_like=opt_state, loss_scale_like=DynamicLossScale.create()
        )
    with pytest.raises(CheckpointError, match="no checkpoint for step 3"):
        ck.restore(3, params_like=params, opt_state_like=opt_state, loss_scale_like=None)


# Reading a checkpoint whose array files are gone makes orbax's pending asyncio reads complain
# after the error is raised; that is orbax's noise on a genuinely broken directory.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_or_missing_directories_raise_checkpoint_error(tmp_path):
    _, params, _, opt_state, _ = fresh_state()
    like = {"params_like": params, "opt_state_like": opt_state, "loss_scale_like": None}

    with pytest.raises(CheckpointError, match="no checkpoint that verifies in .*empty"):
        RunCheckpointer(tmp_path / "empty", keep=1).restore(**like)

    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        RunCheckpointer(a_file, keep=1)
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        read_config(a_file)

    ckpt = tmp_path / "ckpt"
    ck = RunCheckpointer(ckpt, keep=3)
    save_state(ck, 1, params, opt_state, None)
    (ckpt / "1" / "run_config" / "metadata").write_text("{truncated")
    with pytest.raises(CheckpointError, match=rf"cannot read checkpoint {ckpt}/1 .*delete or move"):
        read_config(ckpt)
    with pytest.raises(CheckpointError, match=r"1 does not verify: file run_config/metadata has"):
        ck.restore(1, **like)

    save_state(ck, 2, params, opt_state, None)
    for f in (ckpt / "2" / "params" / "d").iterdir():  # array data lost
        f.unlink()
    with pytest.raises(CheckpointError, match=r"2 does not verify: file params/d/\S+ is missing"):
        ck.restore(2, **like)
    # neither verifies: restoring "the newest" names none of them
    with pytest.raises(CheckpointError, match="no checkpoint that verifies"):
        ck.restore(**like)

    (ckpt / "3").mkdir()  # an empty step directory (copied by hand, say)
    with pytest.raises(CheckpointError, match=rf"{ckpt}/3 does not verify: no integrity") as exc:
        ck.restore(3, **like)
    assert isinstance(exc.value, ValueError) and "\n" not in str(exc.value)

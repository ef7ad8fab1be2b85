"""Learning-rate schedules and gradient clipping (``OptimizerConfig.schedule``, ``clip_norm``):
bad settings are one line before anything runs; the optax schedule is the configured one; a run
written before these settings existed resumes as constant and unclipped; the schedule's length
is saved with the run, so a resumed run continues it and equals an uninterrupted one bit for
bit; clipping runs once per optimizer step under accumulation and over a mesh; a streamed step
follows the same schedule. (Both frameworks' equal learning rates and losses:
``parity_tests/test_adamw_parity.py``.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS, AccumConfig, ConfigError, OptimizerConfig
from jaxmem.job import JobConfig, config_conflicts, resolve_job
from jaxmem.memory.remat import layers_fn
from jaxmem.model import make_model
from jaxmem.policy import POLICIES
from jaxmem.step import stream
from jaxmem.step.train_step import (
    lm_loss_fn,
    make_multisteps_step,
    make_optimizer,
    make_schedule,
    make_train_step,
)
from tests.test_parallel import WORKER
from tests.test_train import metrics, snapshot, train

SCHEDULE = ["--warmup-steps", "2", "--schedule", "cosine", "--clip-norm", "0.5"]

BAD = [
    (["--schedule", "exp"], "schedule='exp' is not one of ('constant', 'cosine', 'linear')"),
    (["--warmup-steps", "-1"], "-1 must be 0 or more"),
    (["--clip-norm", "-1"], "clip_norm=-1.0 must be a positive, finite number"),
    (["--clip-norm", "nan"], "clip_norm=nan must be a positive, finite number"),
    (["--schedule", "cosine", "--min-lr", "0.5"], "min_lr=0.5 is above lr=0.001"),
    (["--decay-steps", "5"], "decay_steps=5 belongs to a decaying schedule"),
    (
        ["--schedule", "linear", "--warmup-steps", "4", "--steps", "4"],
        "decay_steps=4 must exceed warmup_steps=4",
    ),
    (["--clip-norm", "1", "--stream"], "clip_norm=1.0 with stream"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_schedule_or_clipping_is_one_line_exit_2_and_writes_nothing(
    args, message, tmp_path, capsys
):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        train(*args, "--out", str(out))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message in err, err
    assert len(err.splitlines()) == 1 or err.startswith("usage:"), err  # argparse: usage + line
    assert snapshot(out) == {}


@pytest.mark.parametrize(
    "opt_cfg",
    [
        OptimizerConfig(schedule="cosine", warmup_steps=3, decay_steps=10, min_lr=1e-4),
        OptimizerConfig(schedule="linear", decay_steps=6, min_lr=5e-4),
        OptimizerConfig(warmup_steps=2),
    ],
    ids=["warmup+cosine", "linear", "warmup+constant"],
)
def test_the_optax_schedule_is_the_configured_one(opt_cfg):
    """optax's stock schedule equals ``OptimizerConfig.lr_at`` (the documented formula) over
    the schedule and past its end."""
    schedule = make_schedule(opt_cfg)
    np.testing.assert_allclose(
        [float(schedule(i)) for i in range(14)],
        [opt_cfg.lr_at(i) for i in range(14)],
        **tolerance("float32", "learning_rate").kwargs(),
    )
    assert make_schedule(OptimizerConfig()) == OptimizerConfig().lr  # constant: the float


def test_decay_steps_are_the_runs_steps_and_stay_with_the_run():
    """Unset, ``decay_steps`` is ``run.steps`` when the job is made; the saved config keeps it,
    so resuming with a larger ``--steps`` continues the same schedule."""
    job = resolve_job(flags={"preset": "tiny", "optimizer": {"schedule": "cosine"}, "run": {}})
    assert job.optimizer.decay_steps == job.run.steps == 200
    resumed = resolve_job(saved=job.to_dict(), flags={"run": {"steps": 500}})
    assert resumed.optimizer.decay_steps == 200 and resumed.run.steps == 500
    assert config_conflicts(job.to_dict(), resumed.to_dict()) == []


def test_a_run_config_written_before_schedules_reads_back_constant_and_unclipped():
    new = JobConfig.from_dict({"preset": "tiny"}).to_dict()
    old = json.loads(json.dumps(new))
    for key in ("schedule", "warmup_steps", "decay_steps", "min_lr", "clip_norm"):
        del old["optimizer"][key]
    job = JobConfig.from_dict(old)
    assert job.optimizer == OptimizerConfig() and not job.optimizer.scheduled
    assert not job.optimizer.clips
    assert config_conflicts(old, job.to_dict()) == []
    clipped = JobConfig.from_dict({**old, "optimizer": {**old["optimizer"], "clip_norm": 1.0}})
    assert config_conflicts(old, clipped.to_dict()) == [
        "optimizer.clip_norm: checkpoint absent, now 1.0"
    ]


def test_optional_numbers_written_as_yaml_text_are_read_as_numbers(tmp_path):
    """YAML 1.1 reads ``1e-1`` and ``1e3`` as text; a setting annotated ``float | None`` or
    ``int | None`` (clip_norm, decay_steps, n_kv_heads) converts them, from ``--set`` and from a
    config file alike, and still says which value is wrong."""
    sets = ["optimizer.clip_norm=1e-1", "optimizer.decay_steps=1e3", "model.n_kv_heads=2"]
    config = tmp_path / "job.yaml"
    config.write_text(
        "optimizer:\n  schedule: cosine\n  clip_norm: 1e-1\n  decay_steps: 1e3\n"
        "model:\n  n_kv_heads: 2e0\n"
    )
    from_set = resolve_job(
        defaults={"preset": "tiny", "optimizer": {"schedule": "cosine"}}, assignments=sets
    )
    from_file = resolve_job(defaults={"preset": "tiny"}, config_file=str(config))
    for job in (from_set, from_file):
        assert (job.optimizer.clip_norm, job.optimizer.decay_steps) == (0.1, 1000)
        assert job.model.n_kv_heads == 2 and type(job.optimizer.decay_steps) is int
    assert resolve_job(assignments=["optimizer.clip_norm=null"]).optimizer.clip_norm is None
    for bad, message in (
        ("clip_norm=x", "optimizer.clip_norm='x' must be a number"),
        ("decay_steps=2.5e0", "optimizer.decay_steps='2.5e0' must be an integer"),
        ("decay_steps=2.5", "decay_steps=2.5 must be a positive integer"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            resolve_job(assignments=[f"optimizer.{bad}"])


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """4 steps, 2 of warmup then cosine decay, clipped to 0.5, without a break."""
    out = tmp_path_factory.mktemp("schedule") / "whole"
    assert train("--steps", "4", *SCHEDULE, "--out", str(out)) == 0
    return metrics(out)


def test_a_scheduled_clipped_run_logs_its_learning_rates(whole_run):
    opt_cfg = OptimizerConfig(schedule="cosine", warmup_steps=2, decay_steps=4, clip_norm=0.5)
    np.testing.assert_allclose(
        [r["lr"] for r in whole_run],
        [opt_cfg.lr_at(i) for i in range(4)],
        **tolerance("float32", "learning_rate").kwargs(),
    )
    assert whole_run[0]["lr"] == 0.0  # the warmup's start; its end, the peak rate:
    np.testing.assert_allclose(
        whole_run[2]["lr"], 1e-3, **tolerance("float32", "learning_rate").kwargs()
    )
    assert min(r["grad_norm"] for r in whole_run) > 0.5  # the clip is active at every step


def test_a_resumed_run_continues_the_schedule_bit_for_bit(whole_run, tmp_path):
    """2 steps, then ``--resume`` to 4 without repeating the schedule's flags: the same
    losses, learning rates and gradient norms as the run without a break."""
    out = tmp_path / "resumed"
    first = ["--steps", "2", "--decay-steps", "4", "--checkpoint-every", "2"]  # a 4-step schedule
    assert train(*first, *SCHEDULE, "--out", str(out)) == 0
    assert train("--steps", "4", "--out", str(out), "--resume") == 0
    keys = ("step", "loss", "lr", "grad_norm")
    assert [[r[k] for k in keys] for r in metrics(out)] == [[r[k] for k in keys] for r in whole_run]


def _batches(n: int, rows: int = 4):
    rng = np.random.default_rng(0)
    cfg = PRESETS["tiny"]
    for _ in range(n):
        tokens = rng.integers(0, cfg.vocab_size, (rows, 33))
        yield {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def test_multisteps_clips_the_summed_gradient_once_per_step():
    """``optax.MultiSteps`` runs the clip (and the schedule) inside its inner transformation,
    on the summed gradient: 2 microbatches give scan accumulation's losses. Clipping each
    microbatch's half-gradient instead would apply ~twice the update."""
    cfg = PRESETS["tiny"]
    opt_cfg = OptimizerConfig(schedule="linear", warmup_steps=1, decay_steps=4, clip_norm=0.2)
    graphdef, params = nnx.split(make_model(cfg, seed=0), nnx.Param)
    loss = lm_loss_fn(graphdef)
    tx = make_optimizer(opt_cfg)
    scan = make_train_step(loss, tx, accum=AccumConfig(steps=2), opt_cfg=opt_cfg)
    multi_tx, micro = make_multisteps_step(loss, tx, 2, opt_cfg)
    p, o = jax.tree.map(jnp.copy, params), tx.init(params)  # the scan step donates them
    mp, mo = params, multi_tx.init(params)
    scan_losses, multi_losses = [], []
    for batch in _batches(4):
        p, o, _, m = scan(p, o, None, batch)
        scan_losses.append(float(m["loss"]))
        assert float(m["grad_norm"]) > opt_cfg.clip_norm
        n_total = jnp.float32(batch["targets"].size)
        loss_sum = 0.0
        for i in range(2):
            half = {k: v[2 * i : 2 * i + 2] for k, v in batch.items()}
            mp, mo, mm = micro(mp, mo, half, n_total)
            loss_sum += float(mm["loss_sum"])
            assert float(mm["lr"]) == float(m["lr"])  # the same update's learning rate
        multi_losses.append(loss_sum / float(n_total))
    tol = tolerance("float32", "accum_training")
    np.testing.assert_allclose(multi_losses, scan_losses, **tol.kwargs())


@pytest.mark.slow
def test_clipping_and_a_schedule_over_a_mesh_train_as_one_device():
    """fsdp and zero1 over 4 CPU devices (``tests/parallel_worker.py``): the global norm is the
    whole gradient's, so the losses are the one-device ones within the data-parallel bound."""
    case = {
        "policy": "none",
        "precision": "fp32",
        "steps": 3,
        "strategies": ["fsdp", "zero1"],
        "optimizer": {
            "schedule": "cosine",
            "warmup_steps": 1,
            "decay_steps": 3,
            "clip_norm": 0.5,
        },
    }
    proc = subprocess.run(
        [sys.executable, WORKER, json.dumps([case])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])
    tol = tolerance("float32", "data_parallel_loss")
    for name in ("fsdp", "zero1"):
        np.testing.assert_allclose(row[name]["losses"], row["one_device"]["losses"], **tol.kwargs())


def test_a_streamed_step_follows_the_schedule_of_an_unstreamed_one():
    """The streamed step's optimizer state is a pair (the rest's, the stack's), both counting
    the same updates: the same losses and learning rates, bit for bit."""
    cfg = PRESETS["tiny"]
    opt_cfg = OptimizerConfig(schedule="linear", warmup_steps=1, decay_steps=3)
    graphdef, params = nnx.split(make_model(cfg, seed=0), nnx.Param)
    tx = make_optimizer(opt_cfg)
    layers = layers_fn(POLICIES["full"], cfg.n_layers)

    def make_loss(lf):
        return lm_loss_fn(graphdef, layers_fn=lf)

    s_params, s_state = stream.place(jax.tree.map(jnp.copy, params), stream.init_state(tx, params))
    plain = make_train_step(make_loss(layers), tx, opt_cfg=opt_cfg)
    streamed = stream.make_streamed_step(make_loss, layers, tx, opt_cfg=opt_cfg)
    p, o = params, tx.init(params)
    for batch in _batches(3):
        p, o, _, m = plain(p, o, None, batch)
        s_params, s_state, _, sm = streamed(s_params, s_state, None, batch)
        assert (float(sm["loss"]), float(sm["lr"])) == (float(m["loss"]), float(m["lr"]))


def test_the_planner_streams_a_scheduled_job_but_not_a_clipped_one():
    """Streaming, which cannot clip, is not among a clipped job's candidates; a schedule does
    not keep it out."""
    from jaxmem.memory.targets import LOCAL
    from jaxmem.planner.space import Problem, _streams

    scheduled = OptimizerConfig(schedule="cosine", warmup_steps=2, decay_steps=10)
    for opt_cfg, streams in ((scheduled, True), (OptimizerConfig(clip_norm=1.0), False)):
        problem = Problem(PRESETS["tiny"], 4, 32, LOCAL, 10**12, opt_cfg)
        assert _streams(problem, POLICIES["full"], None) is streams

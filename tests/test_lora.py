"""LoRA adapters on a frozen base, jaxmem's side: the decoder's adapters (Flax's ``nnx.LoRA``,
one per targeted part of the fused q/k/v kernel) leave the base model unchanged at init, their
gradients are the textbook ones, only they (and what ``--lora-train`` unfreezes) get gradients
and optimizer state, every memory policy gives the no-remat gradients, and ``jaxmem train
--init-from DIR --lora-rank R`` trains them, keeps the base bit-identical and resumes bit for
bit; bad adapter options are one line, exit 2, before anything runs."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.adapters import TARGETS, AdapterConfig
from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS, ModelConfig
from jaxmem.memory.remat import layers_fn
from jaxmem.model import make_model
from jaxmem.model.decoder import FeedForward, SelfAttention
from jaxmem.model.hf import flat_params, read_hf_weights
from jaxmem.policy import POLICIES, mixed_policy
from jaxmem.precision import FP64
from jaxmem.step.build import build_step
from jaxmem.step.frozen import Trainable
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import lm_loss_fn
from jaxmem.train.checkpoint import restore_params
from tests.test_cli_contract import run_cli
from tests.test_hub import TINY_LLAMA, write_model_dir

LLAMA = PRESETS["tiny-llama"]
EVERY_TARGET = AdapterConfig(rank=4, alpha=16.0, targets=TARGETS)


def _tokens(cfg: ModelConfig, b: int = 2, s: int = 16) -> jax.Array:
    return jax.random.randint(jax.random.key(1), (b, s), 0, cfg.vocab_size)


def _batch(cfg: ModelConfig) -> dict[str, jax.Array]:
    tokens = _tokens(cfg, s=17)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _with_random_b(params: nnx.State, seed: int = 2) -> nnx.State:
    """``params`` with every adapter's B drawn at random (at init B is zero, and so would be
    every gradient through A)."""
    key = jax.random.key(seed)

    def draw(path, x):
        if "lora_b" not in [str(getattr(k, "key", "")) for k in path]:
            return x
        return 0.1 * jax.random.normal(jax.random.fold_in(key, x.size), x.shape, x.dtype)

    return jax.tree_util.tree_map_with_path(draw, params)


# ------------------------------------------------------------------------------ the model
def test_adapters_start_as_the_base_model_with_its_weights_and_loss_unchanged():
    """B starts at zero and the adapters draw from their own stream: the base's initial
    weights, logits and loss are exactly those of the model without adapters."""
    base = make_model(LLAMA, seed=3)
    adapted = make_model(LLAMA, seed=3, adapters=EVERY_TARGET)
    theirs, ours = flat_params(base), flat_params(adapted)
    assert theirs.keys() == ours.keys()
    for path in theirs:
        assert np.array_equal(theirs[path][...], ours[path][...]), path
    batch = _batch(LLAMA)

    def logits_and_loss(model):
        graphdef, params = nnx.split(model, nnx.Param)
        run = jax.jit(
            lambda p: (nnx.merge(graphdef, p)(batch["inputs"]), lm_loss_fn(graphdef)(p, batch)[0])
        )
        return run(params)

    (l0, loss0), (l1, loss1) = logits_and_loss(base), logits_and_loss(adapted)
    assert np.array_equal(l0, l1) and loss0 == loss1
    # PEFT's A init: U(-1/sqrt(in), 1/sqrt(in)), drawn per layer
    a = adapted.blocks.layers.ffn.lora_down.lora_a[...]  # [L, F, r]
    assert a.shape == (LLAMA.n_layers, LLAMA.d_ff, 4)
    assert 0.9 / np.sqrt(LLAMA.d_ff) < np.abs(a).max() <= 1 / np.sqrt(LLAMA.d_ff)
    assert not np.array_equal(a[0], a[1])


def test_the_fused_qkv_adapters_are_three_separate_adapters_on_q_k_and_v():
    """Each targeted part of the fused kernel's output ([q | k | v] columns) gets its own
    adapter, computed here by hand as PEFT computes q_proj, k_proj and v_proj (float64)."""
    cfg = LLAMA
    ad = AdapterConfig(rank=3, alpha=6.0, targets=("q", "k", "v"))
    with jax.enable_x64(True):
        kw = dict(dtype=jnp.float64, param_dtype=jnp.float64)
        rngs = nnx.Rngs(0, lora=1)
        attn = SelfAttention(cfg, rngs=rngs, adapters=ad, **kw)
        _, state = nnx.split(attn, nnx.Param)
        nnx.update(attn, _with_random_b(state))
        x = jax.random.normal(jax.random.key(5), (2, 7, cfg.d_model), jnp.float64)
        fused = attn._qkv(x)
        w = attn.in_proj.kernel[...]
        d, kv = cfg.d_model, cfg.kv_dim
        cols = {"q": slice(0, d), "k": slice(d, d + kv), "v": slice(d + kv, d + 2 * kv)}
        for part, lora in (("q", attn.lora_q), ("k", attn.lora_k), ("v", attn.lora_v)):
            a, b = lora.lora_a[...], lora.lora_b[...]
            assert a.shape == (d, 3) and b.shape == (3, cols[part].stop - cols[part].start)
            by_hand = x @ w[:, cols[part]] + ad.scale * (x @ a) @ b
            np.testing.assert_allclose(
                fused[..., cols[part]], by_hand, **tolerance("float64", "block_output").kwargs()
            )
    assert attn.lora_o is None


def test_adapter_gradients_are_the_textbook_formula_in_float64():
    """One MLP with adapters on up and down, ``y = relu(x Wu + s x Au Bu) Wd + s h Ad Bd``:
    jax.grad of ``sum(y * g)`` against the gradients written out by hand."""
    cfg = PRESETS["tiny"].replace(activation="relu", bias=False)
    ad = AdapterConfig(rank=2, alpha=3.0, targets=("up", "down"))
    s = ad.scale
    with jax.enable_x64(True):
        kw = dict(dtype=jnp.float64, param_dtype=jnp.float64)
        ffn = FeedForward(cfg, rngs=nnx.Rngs(0, lora=1), adapters=ad, **kw)
        graphdef, state, rest = nnx.split(ffn, nnx.LoRAParam, ...)
        lora = _with_random_b(state)
        x = jax.random.normal(jax.random.key(3), (2, 5, cfg.d_model), jnp.float64)
        g = jax.random.normal(jax.random.key(4), (2, 5, cfg.d_model), jnp.float64)
        grads = jax.grad(lambda t: (nnx.merge(graphdef, t, rest)(x) * g).sum())(lora)

        wu, wd = ffn.up.kernel[...], ffn.down.kernel[...]
        au, bu = lora["lora_up"]["lora_a"][...], lora["lora_up"]["lora_b"][...]
        a_d, bd = lora["lora_down"]["lora_a"][...], lora["lora_down"]["lora_b"][...]
        x2, g2 = x.reshape(-1, cfg.d_model), g.reshape(-1, cfg.d_model)
        u = x2 @ wu + s * (x2 @ au) @ bu
        h = np.maximum(u, 0.0)
        gh = g2 @ wd.T + s * (g2 @ bd.T) @ a_d.T
        gu = gh * (u > 0)
        expected = {
            ("lora_down", "lora_b"): s * (h @ a_d).T @ g2,
            ("lora_down", "lora_a"): s * h.T @ (g2 @ bd.T),
            ("lora_up", "lora_b"): s * (x2 @ au).T @ gu,
            ("lora_up", "lora_a"): s * x2.T @ (gu @ bu.T),
        }
    tol = tolerance("float64", "grads").kwargs()
    for (module, leaf), value in expected.items():
        np.testing.assert_allclose(grads[module][leaf][...], value, **tol)


# ------------------------------------------------------------------------------- the step
def _frozen_kernel_grads(jaxpr: jax.extend.core.Jaxpr, shapes: set[tuple]) -> int:
    """Matmuls in ``jaxpr`` (and the jaxprs inside it) whose output has a frozen kernel's
    per-layer shape: what differentiating a kernel computes."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            count += sum(tuple(v.aval.shape) in shapes for v in eqn.outvars)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    count += _frozen_kernel_grads(sub, shapes)
    return count


@pytest.fixture(scope="module")
def norm_step():
    """The step of tiny-llama with q, k, v, o adapters and the norms unfrozen, from shapes."""
    ad = AdapterConfig(rank=4, targets=("q", "k", "v", "o"), train=("norm",))
    spec = StepSpec(model=LLAMA, policy=POLICIES["none"], batch=2, seq_len=16, adapters=ad)
    return build_step(spec)


def test_only_adapters_and_unfrozen_norms_get_gradients_and_optimizer_state(norm_step):
    built, params = norm_step
    trained, frozen = built.trainable.split(params)
    trained_paths = {path for path, _ in nnx.to_flat_state(trained)}
    assert trained_paths and all(
        any(k.startswith("lora_") or k == "norm" for k in path) for path in trained_paths
    )
    assert not any(k.startswith("lora_") for path, _ in nnx.to_flat_state(frozen) for k in path)
    opt_state = built.init_state(params)
    opt_leaves = [x for x in jax.tree.leaves(opt_state) if x.ndim > 0]
    trained_leaves = jax.tree.leaves(trained)
    # adamw: its two moments, each exactly the trained leaves (no zero-filled frozen state)
    assert len(opt_leaves) == 2 * len(trained_leaves)
    nbytes = sum(x.size * x.dtype.itemsize for x in opt_leaves)
    n_trained, n_frozen = built.trainable.counts(params)
    d, kv, layers = LLAMA.d_model, LLAMA.kv_dim, LLAMA.n_layers
    adapters = layers * 4 * ((d + d) + (d + kv) * 2 + (d + d))  # q, k, v, o: r (in + out)
    norms = layers * 2 * d + d
    assert n_trained == adapters + norms and nbytes == 2 * 4 * n_trained
    assert n_frozen == LLAMA.n_params - norms
    assert jax.tree.leaves(built.grad_shapes(params, _batch(LLAMA)))[0].shape in {
        x.shape for x in trained_leaves
    }


def test_the_step_differentiates_no_frozen_kernel(norm_step):
    """The step's program has no matmul shaped like a frozen kernel's gradient; the same step
    training every parameter has them (so the check sees what it looks for)."""
    built, params = norm_step
    d, kv, f = LLAMA.d_model, LLAMA.kv_dim, LLAMA.d_ff
    kernels = {(d, d + 2 * kv), (d, d), (d, f), (d, LLAMA.vocab_size)}
    kernels |= {(b, a) for a, b in kernels}  # a kernel's gradient may come out transposed
    args = built.shapes(params)
    assert _frozen_kernel_grads(jax.make_jaxpr(built.step)(*args).jaxpr, kernels) == 0
    full, full_params = build_step(built.spec.replace(adapters=AdapterConfig()))
    jaxpr = jax.make_jaxpr(full.step)(*full.shapes(full_params)).jaxpr
    assert _frozen_kernel_grads(jaxpr, kernels) >= 6  # q|k|v, o, gate, up, down, the head


@pytest.mark.slow
def test_every_memory_policy_gives_the_adapters_the_no_remat_gradients_in_float64():
    cfg = LLAMA
    with jax.enable_x64(True):
        ad = dataclasses.replace(EVERY_TARGET, train=("norm",))
        graphdef, params = nnx.split(make_model(cfg, FP64, adapters=ad), nnx.Param)
        trainable = Trainable(ad)
        trained, frozen = trainable.split(_with_random_b(params))
        batch = _batch(cfg)

        def grads(policy):
            loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, cfg.n_layers))
            of = lambda t: loss(trainable.merge(t, frozen), batch)[0]  # noqa: E731
            return jax.jit(jax.value_and_grad(of))(trained)

        base_loss, base = grads(POLICIES["none"])
        tol = tolerance("float64", "remat_vs_none").kwargs()
        cases = {**POLICIES, "none:1+selective": mixed_policy("none", 1, "selective")}
        cases["full, unrolled"] = POLICIES["full"].replace(unroll=True)
        for name, policy in cases.items():
            loss, g = grads(policy)
            np.testing.assert_allclose(loss, base_loss, **tol, err_msg=name)
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(base), strict=True):
                np.testing.assert_allclose(a, b, **tol, err_msg=name)


# ---------------------------------------------------------------------- jaxmem train, CLI
LORA_FLAGS = ("--lora-rank", "4", "--lora-targets", "q,k,v,o,down")
RUN_FLAGS = ("--batch-size", "2", "--seq-len", "16", "--checkpoint-every", "2")
RUN_FLAGS += ("--eval-every", "2", "--sample-tokens", "0")


def _losses(run) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """tiny-llama from a random Hugging Face directory with adapters: 4 steps straight, 2
    steps then resumed to 4, and 4 steps over an fsdp mesh of 2 CPU devices (each a
    subprocess)."""
    root = tmp_path_factory.mktemp("lora")
    model = write_model_dir(root / "model", TINY_LLAMA)
    common = ("train", "--init-from", model, *LORA_FLAGS, *RUN_FLAGS)
    straight = run_cli(*common, "--steps", "4", "--out", str(root / "straight"))
    half = run_cli(*common, "--steps", "2", "--out", str(root / "resumed"))
    resumed = run_cli(*common, "--steps", "4", "--out", str(root / "resumed"), "--resume")
    sharded = run_cli(*common, "--steps", "4", "--mesh", "fsdp=2", "--out", str(root / "fsdp"))
    for proc in (straight, half, resumed, sharded):
        assert proc.returncode == 0, proc.stderr
    return root, model, straight


def _final_params(run, cfg: ModelConfig, adapters: AdapterConfig) -> nnx.State:
    like = nnx.split(make_model(cfg, adapters=adapters), nnx.Param)[1]
    return restore_params(run / "checkpoints", 4, like)


@pytest.mark.slow
def test_training_adapters_from_a_directory_keeps_the_base_bit_identical(lora_runs):
    from jaxmem.hf.config import model_config_from_dir

    root, model, straight = lora_runs
    cfg = model_config_from_dir(model)
    ad = AdapterConfig(rank=4, targets=("q", "k", "v", "o", "down"))
    d, kv, f, r = cfg.d_model, cfg.kv_dim, cfg.d_ff, 4
    trained = cfg.n_layers * r * (2 * d + 2 * (d + kv) + 2 * d + (f + d))
    text = " ".join(straight.stdout.split())  # the first line wraps at the terminal's width
    first = text.split(" step 1")[0]
    assert f"LoRA r4 a8 q,k,v,o,down: {trained:,} trainable, {cfg.n_params:,} frozen" in first
    losses = _losses(root / "straight")
    assert len(losses) == 4 and losses[-1] < losses[0]
    final = _final_params(root / "straight", cfg, ad)
    start = read_hf_weights(model, cfg, "float32")
    after = flat_params(final)
    assert start.keys() == after.keys()
    for path, value in start.items():
        assert np.array_equal(value, np.asarray(after[path][...])), path
    b = final["blocks"]["layers"]["ffn"]["lora_down"]["lora_b"][...]
    assert b.shape == (cfg.n_layers, r, d) and np.abs(b).max() > 0  # the adapters trained


@pytest.mark.slow
def test_an_adapter_run_resumed_after_2_steps_equals_4_straight_bit_for_bit(lora_runs):
    from jaxmem.hf.config import model_config_from_dir

    root, model, _ = lora_runs
    assert _losses(root / "resumed") == _losses(root / "straight")
    cfg = model_config_from_dir(model)
    ad = AdapterConfig(rank=4, targets=("q", "k", "v", "o", "down"))
    a = _final_params(root / "straight", cfg, ad)
    b = _final_params(root / "resumed", cfg, ad)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(x, y)


BAD_OPTIONS = {
    "rank-0-quantized": (
        ["--lora-rank", "0", "--quantize-base", "nf4"],
        "adapters.base='nf4' quantizes a frozen base: it needs adapters",
    ),
    "unknown-target": (
        ["--lora-rank", "4", "--lora-targets", "q,qkv"],
        "'qkv' is not a projection",
    ),
    "gate-on-gpt2": (
        ["--preset", "tiny", "--lora-rank", "4", "--lora-targets", "gate"],
        "'gate' is a gated MLP's projection",
    ),
    "rank-too-large": (["--lora-rank", "33"], "exceeds the model's narrowest projection (32)"),
    "quantized-base-fsdp": (
        ["--lora-rank", "4", "--quantize-base", "int8", "--mesh", "fsdp=2"],
        "packed base weights are not sharded yet",
    ),
    "stream": (["--lora-rank", "4", "--stream"], "--stream"),
    "host-state": (["--lora-rank", "4", "--state-memory", "pinned_host"], "--state-memory"),
    "multisteps": (["--lora-rank", "4", "--accum", "2", "--accum-mode", "multisteps"], "scan"),
}


def _refused(capsys, argv: list[str]) -> str:
    from jaxmem import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_bad_adapter_options_are_one_line_exit_2_and_write_nothing(capsys, tmp_path):
    for case, (args, message) in BAD_OPTIONS.items():
        argv = ["train", "--preset", "tiny-llama", *args, "--out", str(tmp_path / case)]
        if args[0] == "--preset":
            argv = ["train", *args, "--out", str(tmp_path / case)]
        line = _refused(capsys, argv)
        assert line.startswith("jaxmem train: error: ") and message in line, (case, line)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_resume_that_changes_the_adapters_is_refused(lora_runs, capsys):
    root, model, _ = lora_runs
    run = root / "straight"
    before = sorted(p.name for p in run.rglob("*"))
    argv = ["train", "--init-from", model, "--lora-rank", "8", "--lora-targets", "q,k,v,o,down"]
    line = _refused(capsys, [*argv, *RUN_FLAGS, "--steps", "6", "--out", str(run), "--resume"])
    assert "adapters.rank: checkpoint 4, now 8" in line
    assert sorted(p.name for p in run.rglob("*")) == before


@pytest.mark.slow
def test_adapters_over_an_fsdp_mesh_train_as_on_one_device(lora_runs):
    """Parameters (frozen and trained) and the adapters' optimizer state sharded over 2
    devices: the same losses as one device, within the data-parallel bound."""
    root, _, _ = lora_runs
    np.testing.assert_allclose(
        _losses(root / "fsdp"),
        _losses(root / "straight"),
        **tolerance("float32", "data_parallel_loss").kwargs(),
    )

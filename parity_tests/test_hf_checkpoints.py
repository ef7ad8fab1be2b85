"""Hugging Face checkpoints through jaxmem: ``transformers``' own Llama, Qwen2 and GPT-2 (random,
tiny, saved with ``save_pretrained``; no downloads) loaded by ``jaxmem.model.hf`` give
``transformers``' logits, loss and every gradient, under every memory policy; an exported run
loads back into ``transformers`` with the same logits; GPT-2 trains the same 20 steps."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from jaxmem.policy import POLICIES
from parity_tests.hf_models import (
    HF_CONFIGS,
    float64_internals,
    hf_loss_and_grads,
    hf_names,
    jaxmem_loss_and_grads,
    load_hf,
    save_hf_model,
)

pytest.importorskip(
    "transformers",
    reason="transformers is the hf extra (pip install 'jaxmem[hf]'; make test installs it)",
)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        name: save_hf_model(name, os.fspath(tmp_path_factory.mktemp(name))) for name in HF_CONFIGS
    }


def _batch(seed: int = 5, batch: int = 3, seq_len: int = 32):
    tokens = np.random.default_rng(seed).integers(0, 300, (batch, seq_len + 1))
    return tokens[:, :-1], tokens[:, 1:]


_REFERENCE: dict[tuple[str, str], tuple] = {}


def _transformers(directory: str, dtype: str, exact: bool = True):
    """transformers' loss, logits and gradients (float64: with its float32 internals patched
    when ``exact``), computed once per directory and dtype."""
    key = (directory, f"{dtype}{'' if exact else '-as-shipped'}")
    if key not in _REFERENCE:
        patch = float64_internals() if dtype == "float64" and exact else contextlib.nullcontext()
        with patch:
            loss, logits, grads = hf_loss_and_grads(load_hf(directory, dtype), *_batch())
        _REFERENCE[key] = (loss, logits, hf_names(grads, directory))
    return _REFERENCE[key]


def _assert_same(directory: str, dtype: str, policy=None, quantities=None):
    loss_t, logits_t, grads_t = _transformers(directory, dtype)
    loss_j, logits_j, grads_j = jaxmem_loss_and_grads(directory, dtype, *_batch(), policy=policy)
    q = quantities or {"logits": "logits", "loss": "loss", "grads": "grads"}
    for name, actual, expected in (("logits", logits_j, logits_t), ("loss", loss_j, loss_t)):
        tol = tolerance(dtype, q[name])
        np.testing.assert_allclose(actual, expected, rtol=tol.rtol, atol=tol.atol, err_msg=name)
    assert set(grads_j) == set(grads_t)
    diff = compare_state_dicts(grads_j, grads_t, tolerance(dtype, q["grads"]))
    print(f"[{os.path.basename(directory)} {dtype}] logits {np.abs(logits_j - logits_t).max():.2e}")
    print(f"  grads max abs {diff.max_abs:.2e}, normwise rel {diff.max_rel:.2e}")
    assert diff.passed, f"gradients out of tolerance: {diff.failures} (max abs {diff.max_abs})"
    assert all(np.abs(g).max() > 1e-7 for g in grads_t.values())  # every leaf carries signal
    return diff


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_a_transformers_checkpoint_gives_its_logits_loss_and_every_gradient_in_fp32(hf_dirs, name):
    _assert_same(hf_dirs[name], "float32")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_float64_is_exact_where_transformers_computes_in_float64(hf_dirs, name):
    """transformers' Llama and Qwen2 norm and rotate in float32 even in a float64 model; with
    those two steps in float64 (``float64_internals``) every difference is a few ulps."""
    _assert_same(hf_dirs[name], "float64")


@pytest.mark.parametrize("name", ["llama3-scaled-tied", "qwen2"])
def test_transformers_float64_llama_rounds_its_norm_and_rope_in_float32(hf_dirs, name):
    """Unpatched, transformers' float64 Llama differs from jaxmem's by float32 rounding (its
    RoPE angles and RMSNorm), beyond the float64 exactness bounds and within its own entry."""
    directory = hf_dirs[name]
    loss_t, logits_t, grads_t = _transformers(directory, "float64", exact=False)
    loss_j, logits_j, grads_j = jaxmem_loss_and_grads(directory, "float64", *_batch())
    exact = tolerance("float64", "logits")
    assert not np.allclose(logits_j, logits_t, rtol=exact.rtol, atol=exact.atol)
    tol = tolerance("float64", "transformers_float32_internals")
    np.testing.assert_allclose(logits_j, logits_t, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(loss_j, loss_t, rtol=tol.rtol)
    diff = compare_state_dicts(grads_j, grads_t, tol)
    assert diff.passed, diff


@pytest.mark.slow
# full-host and nested-host run full's and nested's math (tests/test_offloaded_inputs.py)
@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"full-host", "nested-host"}))
@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_every_memory_policy_gives_transformers_gradients(hf_dirs, name, policy):
    _assert_same(hf_dirs[name], "float32", POLICIES[policy])


# ------------------------------------------------------------------------- the command line
def _jaxmem(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _exported_logits_match(run: str, out: str) -> None:
    """``out`` (``jaxmem export`` of ``run``) in transformers gives the logits of jaxmem's model
    holding the run's newest checkpoint."""
    from jaxmem.hf.config import disagreements, model_config_from_dir
    from jaxmem.job import JobConfig
    from jaxmem.model import make_model
    from jaxmem.model.hf import load_hf_weights
    from jaxmem.train.checkpoint import latest_checkpoint

    step, saved, _ = latest_checkpoint(run)
    job = JobConfig.from_dict(saved)
    assert disagreements(model_config_from_dir(out), job.model) == []
    inputs, _ = _batch(seed=9, batch=2, seq_len=16)
    inputs = inputs % job.model.vocab_size
    with torch.no_grad():
        expected = load_hf(out, "float32")(torch.from_numpy(inputs).long()).logits.numpy()
    if job.run.framework == "torch":
        from jaxmem.compare.torch_run import restored_model

        model = restored_model(run, step, job)
    else:
        from jaxmem.run_layout import CHECKPOINT_DIR
        from jaxmem.train.checkpoint import restore_params

        model = make_model(job.model, job.precision)
        graphdef, like = nnx.split(model, nnx.Param)
        model = nnx.merge(graphdef, restore_params(os.path.join(run, CHECKPOINT_DIR), step, like))
    actual = np.asarray(model(jnp.asarray(inputs)))
    tol = tolerance("float32", "logits")
    np.testing.assert_allclose(actual, expected, rtol=tol.rtol, atol=tol.atol)
    # and jaxmem reads its own export back to the same weights
    reread = make_model(job.model, job.precision)
    load_hf_weights(reread, out)
    np.testing.assert_array_equal(np.asarray(reread(jnp.asarray(inputs))), actual)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-gqa-untied", "gpt2"])
def test_a_run_started_from_a_checkpoint_exports_back_into_transformers(hf_dirs, name, tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    proc = _jaxmem(
        "train", "--init-from", hf_dirs[name], "--steps", "3", "--batch-size", "4",
        "--seq-len", "32", "--sample-tokens", "8", "--out", str(run),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"weights from {hf_dirs[name]}" in proc.stdout
    saved = json.loads((run / "summary.json").read_text())
    assert saved["init_from"] == hf_dirs[name] == saved["config"]["run"]["init_from"]
    assert saved["config"]["preset"] == hf_dirs[name]
    # step 1's loss is the checkpoint's on that batch (a random init's differs by ~1e-2)
    from jaxmem.job import JobConfig
    from jaxmem.train.loop import train_batch
    from jaxmem.train.prepare import prepare_job

    job = JobConfig.from_dict(json.loads((run / "summary.json").read_text())["config"])
    batch = train_batch(prepare_job(job, None).dataset, job)(1)
    expected, _, _ = hf_loss_and_grads(load_hf(hf_dirs[name], "float32"), *batch.values())
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    np.testing.assert_allclose(first, expected, rtol=tolerance("float32", "loss").rtol)
    proc = _jaxmem("export", str(run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    _exported_logits_match(str(run), str(out))
    # a second export into the same directory is refused, nothing changed
    before = (out / "model.safetensors").read_bytes()
    proc = _jaxmem("export", str(run), "--out", str(out))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "exists and is not empty" in proc.stderr
    assert (out / "model.safetensors").read_bytes() == before


@pytest.mark.slow
def test_a_torch_run_exports_through_torch_refs_state_dict(tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    proc = _jaxmem(
        "train", "--framework", "torch", "--preset", "tiny", "--steps", "2", "--batch-size",
        "4", "--seq-len", "32", "--sample-tokens", "0", "--out", str(run),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    proc = _jaxmem("export", str(run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "gpt2" in proc.stdout and "torch run" in proc.stdout
    _exported_logits_match(str(run), str(out))


# ------------------------------------------------------------------------------- GPT-2 steps
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_gpt2_with_and_without_its_gradient_checkpointing_agrees_with_jaxmem(
    hf_dirs, checkpointing, dtype
):
    """transformers' GPT2LMHeadModel in training mode (dropout 0), with its own gradient
    checkpointing or not: jaxmem's gradients within the table, exact in float64 (measured max
    normwise relative 1.1e-15) and within fp32's rounding in float32 (measured 9.7e-7 to 1.0e-6,
    by thread count and XLA:CPU's code generation)."""
    directory = hf_dirs["gpt2"]
    model = load_hf(directory, dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    loss_t, logits_t, grads_t = hf_loss_and_grads(model, *_batch())
    loss_j, logits_j, grads_j = jaxmem_loss_and_grads(directory, dtype, *_batch())
    tol = tolerance(dtype, "logits")
    np.testing.assert_allclose(logits_j, logits_t, rtol=tol.rtol, atol=tol.atol)
    diff = compare_state_dicts(grads_j, hf_names(grads_t, directory), tolerance(dtype, "grads"))
    assert diff.passed, diff


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_gpt2_trains_twenty_steps_as_jaxmem_does(tmp_path, optimizer):
    """20 steps of transformers' GPT-2 under torch.optim (decay on matrices and embeddings
    only, as jaxmem) and of jaxmem's step: the same losses and the same final weights."""
    from jaxmem.config import OptimizerConfig
    from jaxmem.hf.config import model_config_from_dir
    from jaxmem.hf.keys import hf_tensors
    from jaxmem.model import make_model
    from jaxmem.model.hf import flat_params, load_hf_weights
    from jaxmem.step.train_step import lm_loss_fn, make_optimizer, make_train_step
    from parity_tests.test_adamw_parity import STEPS, counting_batch

    # a vocabulary of 64: the counting data is learnt within 20 steps
    directory = save_hf_model("gpt2", os.fspath(tmp_path), vocab_size=64)
    cfg = model_config_from_dir(directory)
    lr = 1e-3 if optimizer == "adamw" else 0.1
    opt_cfg = OptimizerConfig(name=optimizer, lr=lr, weight_decay=0.1)
    batches = [counting_batch(cfg.vocab_size, 4, 32, seed=100 + i) for i in range(STEPS)]

    model = make_model(cfg)
    load_hf_weights(model, directory)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(opt_cfg)
    opt_state, step = tx.init(params), make_train_step(lm_loss_fn(graphdef), tx)
    losses_j = []
    for inputs, targets in batches:
        batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
        params, opt_state, _, metrics = step(params, opt_state, None, batch)
        losses_j.append(float(metrics["loss"]))
    final_j = hf_tensors({p: np.asarray(v[...]) for p, v in flat_params(params).items()}, cfg)

    hf = load_hf(directory, "float32").train()
    initial = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    decay = [p for k, p in hf.named_parameters() if p.ndim == 2]  # matrices and embeddings
    rest = [p for k, p in hf.named_parameters() if p.ndim != 2]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=0.1)
    losses_t = []
    for inputs, targets in batches:
        opt.zero_grad(set_to_none=True)
        logits = hf(torch.from_numpy(inputs).long()).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).long().reshape(-1)
        )
        loss.backward()
        opt.step()
        losses_t.append(loss.item())
    final_t = hf_names({k: v.detach().numpy() for k, v in hf.state_dict().items()}, directory)

    name = "adamw" if optimizer == "adamw" else "sgd"
    tol = tolerance("float32", "adamw_loss")
    np.testing.assert_allclose(losses_j, losses_t, rtol=tol.rtol, atol=tol.atol)
    assert losses_j[-1] < losses_j[0] - 0.1, "the run must actually train"
    if optimizer == "adamw":
        # the key bias's true gradient is zero (softmax cancels it); Adam turns each side's
        # rounding noise into steps of up to lr: compared against that bound (see
        # parity_tests/test_adamw_parity.py), the rest elementwise
        d = cfg.d_model
        for i in range(cfg.n_layers):
            key = f"transformer.h.{i}.attn.c_attn.bias"
            for final in (final_j, final_t):
                drift = np.abs(final[key][d : 2 * d] - initial[key][d : 2 * d]).max()
                assert drift <= STEPS * lr, (key, drift)
                final[key] = np.concatenate([final[key][:d], final[key][2 * d :]])
    diff = compare_state_dicts(final_j, final_t, tolerance("float32", f"{name}_weights"))
    assert diff.passed, diff

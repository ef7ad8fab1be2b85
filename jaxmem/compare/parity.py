"""Cross-framework parity: the same weights in jaxmem and torch_ref must give the same logits,
loss and gradients.

``float64`` (``jax.enable_x64`` and ``torch.float64``) is the exactness check; ``float32`` the
dtype people train in (see ``jaxmem.compare.tolerances`` for which checks belong where).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import torch_ref
from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from jaxmem.compare.weights import load_torch_state_dict, to_torch_state_dict
from jaxmem.config import ModelConfig
from jaxmem.data import lm_batch
from jaxmem.model import Decoder, make_model
from jaxmem.model.loss import cross_entropy_sum
from jaxmem.precision import FP64, PRECISIONS, Precision
from torch_ref.loss import cross_entropy_sum as torch_cross_entropy_sum

PARITY_DTYPES: tuple[str, ...] = ("float64", "float32")


@contextlib.contextmanager
def dtype_context(dtype: str) -> Iterator[None]:
    """JAX computes in float64 only with x64 enabled; scoped, so nothing else changes."""
    with jax.enable_x64(dtype == "float64"):
        yield


def precision_of(dtype: str) -> Precision:
    """Everything stored and computed in ``dtype`` (float64 or float32)."""
    return FP64 if dtype == "float64" else PRECISIONS["fp32"]


def model_in(reference: Decoder, dtype: str) -> Decoder:
    """``reference``'s weights in a model stored and computed in ``dtype`` (call inside
    ``dtype_context(dtype)``). fp32 weights are exact in float64, so both dtypes run the very
    same weights."""
    model = make_model(reference.cfg, precision_of(dtype))
    load_torch_state_dict(model, to_torch_state_dict(reference))
    return model


def torch_model_from(model: Decoder) -> torch_ref.Decoder:
    """A ``torch_ref.Decoder`` holding exactly ``model``'s weights (through the key map), in the
    same dtype."""
    state = {k: torch.from_numpy(v.copy()) for k, v in to_torch_state_dict(model).items()}
    dtype = next(iter(state.values())).dtype
    torch_model = torch_ref.Decoder(model.cfg).to(dtype)
    torch_model.load_state_dict(state, strict=True)
    return torch_model


def jax_loss_and_grads(
    model: Decoder, inputs: np.ndarray, targets: np.ndarray
) -> tuple[float, np.ndarray, dict[str, np.ndarray]]:
    """Mean LM loss, logits and gradients (as a PyTorch-keyed state dict) from jaxmem."""
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p)(jnp.asarray(inputs))
        loss_sum, n = cross_entropy_sum(logits, jnp.asarray(targets))
        return loss_sum / n, logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return float(loss), np.asarray(logits), to_torch_state_dict(nnx.merge(graphdef, grads))


def torch_loss_and_grads(
    torch_model: Any, inputs: np.ndarray, targets: np.ndarray
) -> tuple[float, np.ndarray, dict[str, np.ndarray]]:
    """Mean LM loss, logits and gradients from torch_ref (gradients keyed like its state dict)."""
    torch_model.zero_grad(set_to_none=True)
    logits = torch_model(torch.from_numpy(inputs).long())
    loss_sum, n = torch_cross_entropy_sum(logits, torch.from_numpy(targets).long())
    loss = loss_sum / n
    loss.backward()
    grads = {k: p.grad.detach().numpy() for k, p in torch_model.named_parameters()}
    return float(loss.detach()), logits.detach().numpy(), grads


def run_parity(
    cfg: ModelConfig,
    *,
    batch: int = 4,
    seq_len: int | None = None,
    seed: int = 0,
    dtype: str = "float64",
) -> dict[str, Any]:
    """Build the model from ``seed``, copy it to torch_ref, compare logits, loss and gradients
    in ``dtype`` on one deterministic batch. Returns a JSON-ready report."""
    if dtype not in PARITY_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {PARITY_DTYPES}")
    seq_len = seq_len or min(cfg.max_seq_len, 32)
    reference = make_model(cfg, seed=seed)
    inputs, targets = lm_batch(cfg, batch, seq_len, seed)
    # Full fp32 matmuls on every backend (TF32 would be the default on recent NVIDIA GPUs).
    torch.backends.cuda.matmul.allow_tf32 = False
    with dtype_context(dtype), jax.default_matmul_precision("highest"):
        model = model_in(reference, dtype)
        loss_jax, logits_jax, grads_jax = jax_loss_and_grads(model, inputs, targets)
        torch_model = torch_model_from(model)
    loss_torch, logits_torch, grads_torch = torch_loss_and_grads(torch_model, inputs, targets)

    tol_logits, tol_loss, tol_grads = (tolerance(dtype, q) for q in ("logits", "loss", "grads"))
    logits_diff = compare_state_dicts({"logits": logits_jax}, {"logits": logits_torch}, tol_logits)
    loss_diff = compare_state_dicts({"loss": loss_jax}, {"loss": loss_torch}, tol_loss)
    grad_diff = compare_state_dicts(grads_jax, grads_torch, tol_grads)
    return {
        "config": dataclasses.asdict(cfg),
        "batch": batch,
        "seq_len": seq_len,
        "seed": seed,
        "dtype": dtype,
        "loss_jax": loss_jax,
        "loss_torch": loss_torch,
        "abs_loss_diff": abs(loss_jax - loss_torch),
        "max_abs_logits_diff": logits_diff.max_abs,
        "max_abs_grad_diff": grad_diff.max_abs,
        "max_rel_grad_diff": grad_diff.max_rel,
        "n_grad_leaves": len(grads_torch),
        "failed_grad_leaves": list(grad_diff.failures),
        "tolerances": {
            "logits": tol_logits.kwargs(),
            "loss": tol_loss.kwargs(),
            "grads": tol_grads.kwargs(),
        },
        "passed": logits_diff.passed and loss_diff.passed and grad_diff.passed,
    }

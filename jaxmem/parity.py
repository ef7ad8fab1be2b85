"""Cross-framework parity: the same weights in jaxmem and torch_ref must give the same logits,
loss and gradients.

Holds the one tolerance table (per dtype, a reason per entry) that ``parity_tests/`` and the
``jaxmem parity`` command both use. PyTorch is imported lazily so ``import jaxmem.parity`` stays
cheap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmem.config import ModelConfig
from jaxmem.loss import cross_entropy_sum
from jaxmem.model import Decoder
from jaxmem.weights import to_torch_state_dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tolerance:
    """Elementwise ``|jax - torch| <= atol + rtol * |torch|`` and why these numbers."""

    rtol: float
    atol: float
    reason: str

    def kwargs(self) -> dict[str, float]:
        return {"rtol": self.rtol, "atol": self.atol}


# fp32 unit roundoff is 6e-8. XLA:CPU and PyTorch (oneDNN / ATen) sum matmuls, softmax and
# LayerNorm reductions in different orders, so results differ by a few ulps of the largest
# partial sums. Each bound below is about 10-30x what was measured on the tiny, seed and odd
# configurations (see the issue notes), and ~1000x below what a real bug produces (a wrong mask,
# transpose or scale changes values at the 1e-2 level).
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "float32": {
        "logits": Tolerance(
            rtol=1e-5,
            atol=1e-5,
            reason="O(1) logits after L blocks; measured max abs diff 3.6e-7",
        ),
        "block_output": Tolerance(
            rtol=1e-5,
            atol=1e-5,
            reason="O(1) activations (LayerNorm outputs, residual stream); a few ulps of d_ff-long "
            "dot products",
        ),
        "loss": Tolerance(
            rtol=2e-6,
            atol=0.0,
            reason="mean cross-entropy ~5.5 summed over B*S tokens in different orders; measured "
            "relative diff <= 3.5e-7",
        ),
        "grads": Tolerance(
            rtol=1e-5,
            atol=1e-6,
            reason="gradient leaves reach 0.2; measured max abs diff 7.8e-8. atol covers elements "
            "that are ~0 in one framework and a rounding residue in the other",
        ),
        "remat_vs_none": Tolerance(
            rtol=1e-6,
            atol=1e-7,
            reason="same framework, same ops: recompute replays the forward exactly, but XLA may "
            "fuse the recomputed and the original forward differently; measured max abs diff "
            "3.7e-8 on tiny x4 layers for every preset",
        ),
        "accum_vs_big_batch": Tolerance(
            rtol=1e-5,
            atol=1e-7,
            reason="k microbatches summed then divided once vs one batch: the same terms added in "
            "a different order (and remat/scan fusion differences, <= 4e-8)",
        ),
        "accum_training": Tolerance(
            rtol=1e-5,
            atol=1e-6,
            reason="3 SGD-momentum steps at lr 0.1 from accumulated vs big-batch gradients that "
            "differ by summation order only (~6e-8); SGD passes that through scaled by lr",
        ),
        "sgd_weights": Tolerance(
            rtol=1e-5,
            atol=1e-6,
            reason="10 SGD-momentum steps at lr 0.1: updates are linear in the gradients, so the "
            "fp32 gradient differences (<1e-7) pass through scaled by lr and momentum",
        ),
        "adamw_weights": Tolerance(
            rtol=1e-5,
            atol=5e-6,
            reason="20 AdamW steps at lr 1e-3. Adam divides by sqrt(v)+eps, so gradient elements "
            "within a few orders of eps (directions of the key projection that softmax cancels, "
            "rarely used value directions) carry their relative rounding error straight into the "
            "update; measured max abs diff 2.1e-6 (in_proj_weight), 5e-7 elsewhere. A misapplied "
            "decay or bias correction moves weights by >= 1e-4",
        ),
        "adamw_loss": Tolerance(
            rtol=1e-5,
            atol=0.0,
            reason="loss curve over 20 steps: per-step loss differences compound through the "
            "updates; measured relative diff <= 6e-7",
        ),
    },
    "bfloat16": {
        "loss": Tolerance(
            rtol=1e-3,
            atol=0.0,
            reason="bf16 has 8 mantissa bits (eps 3.9e-3); the mean loss over ~100 tokens averages "
            "per-token rounding; measured jax-vs-torch relative diff <= 1e-5 (tiny), 5e-6 (seed)",
        ),
        "logits_kl": Tolerance(
            rtol=0.0,
            atol=1e-4,
            reason="KL(torch || jax) of next-token distributions from bf16 logits; measured 3e-7 "
            "(tiny) and 3e-6 (seed block) per token",
        ),
        "grad_error_ratio": Tolerance(
            rtol=0.5,
            atol=2e-3,
            reason="bf16 gradients are compared through each framework's error against its own "
            "fp32 gradients (max normwise over leaves): the larger error may exceed the smaller by "
            "50% + 2e-3. Measured 0.85% vs 0.81% (tiny), 22.6% vs 22.3% (seed, cancellation-heavy "
            "ReLU gradients)",
        ),
        "remat_vs_none": Tolerance(
            rtol=2e-2,
            atol=0.0,
            reason="bf16 recompute replays the same ops but XLA may fuse the replay differently, "
            "changing where intermediate bf16 roundings happen; normwise bound",
        ),
    },
}


def tolerance(dtype: str, quantity: str) -> Tolerance:
    try:
        return TOLERANCES[dtype][quantity]
    except KeyError:
        raise KeyError(f"no tolerance for dtype={dtype!r} quantity={quantity!r}") from None


@dataclasses.dataclass(frozen=True)
class TreeDiff:
    """Result of comparing two state dicts elementwise."""

    max_abs: float  # max over every element of |a - b|
    max_rel: float  # max over leaves of max|a - b| / max|b| (normwise, robust to zeros)
    failures: tuple[str, ...]  # keys whose elements violate the tolerance

    @property
    def passed(self) -> bool:
        return not self.failures


def compare_state_dicts(
    actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], tol: Tolerance
) -> TreeDiff:
    """Compare two ``key -> array`` dicts with the same keys under ``tol``."""
    if set(actual) != set(expected):
        raise KeyError(
            f"key sets differ: only in actual {sorted(set(actual) - set(expected))}, "
            f"only in expected {sorted(set(expected) - set(actual))}"
        )
    max_abs = max_rel = 0.0
    failures = []
    for key in sorted(expected):
        a = np.asarray(actual[key], dtype=np.float64)
        b = np.asarray(expected[key], dtype=np.float64)
        if a.shape != b.shape:
            raise ValueError(f"{key}: shape {a.shape} vs {b.shape}")
        diff = np.abs(a - b)
        max_abs = max(max_abs, float(diff.max(initial=0.0)))
        scale = float(np.abs(b).max(initial=0.0))
        max_rel = max(max_rel, float(diff.max(initial=0.0)) / scale if scale > 0 else 0.0)
        if not np.all(diff <= tol.atol + tol.rtol * np.abs(b)):
            failures.append(key)
    return TreeDiff(max_abs=max_abs, max_rel=max_rel, failures=tuple(failures))


def lm_batch(cfg: ModelConfig, batch: int, seq_len: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Deterministic random token ids: ``(inputs [B, S], targets [B, S])`` (targets shifted)."""
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq_len + 1))
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


def torch_model_from(model: Decoder) -> Any:
    """A ``torch_ref.Decoder`` holding exactly ``model``'s weights (through the key map)."""
    import torch

    import torch_ref

    torch_model = torch_ref.Decoder(model.cfg)
    state = {k: torch.from_numpy(v.copy()) for k, v in to_torch_state_dict(model).items()}
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

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    grad_sd = {
        k: v.astype(np.float32) for k, v in to_torch_state_dict(nnx.merge(graphdef, grads)).items()
    }
    return float(loss), np.asarray(logits), grad_sd


def torch_loss_and_grads(
    torch_model: Any, inputs: np.ndarray, targets: np.ndarray
) -> tuple[float, np.ndarray, dict[str, np.ndarray]]:
    """Mean LM loss, logits and gradients from torch_ref (gradients keyed like its state dict)."""
    import torch

    from torch_ref.loss import cross_entropy_sum as torch_cross_entropy_sum

    torch_model.zero_grad(set_to_none=True)
    logits = torch_model(torch.from_numpy(inputs).long())
    loss_sum, n = torch_cross_entropy_sum(logits, torch.from_numpy(targets).long())
    loss = loss_sum / n
    loss.backward()
    grads = {k: p.grad.detach().float().numpy() for k, p in torch_model.named_parameters()}
    return float(loss.detach()), logits.detach().float().numpy(), grads


def run_parity(
    cfg: ModelConfig, *, batch: int = 4, seq_len: int | None = None, seed: int = 0
) -> dict[str, Any]:
    """Build the model from ``seed``, copy it to torch_ref, compare logits, loss and gradients
    in fp32 on one deterministic batch. Returns a JSON-ready report."""
    import torch

    seq_len = seq_len or min(cfg.max_seq_len, 32)
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    torch_model = torch_model_from(model)
    inputs, targets = lm_batch(cfg, batch, seq_len, seed)
    # Full fp32 matmuls on every backend (TF32 would be the default on recent NVIDIA GPUs).
    torch.backends.cuda.matmul.allow_tf32 = False
    with jax.default_matmul_precision("highest"):
        loss_jax, logits_jax, grads_jax = jax_loss_and_grads(model, inputs, targets)
    loss_torch, logits_torch, grads_torch = torch_loss_and_grads(torch_model, inputs, targets)

    tol_logits, tol_loss, tol_grads = (tolerance("float32", q) for q in ("logits", "loss", "grads"))
    logits_diff = compare_state_dicts({"logits": logits_jax}, {"logits": logits_torch}, tol_logits)
    loss_diff = compare_state_dicts({"loss": loss_jax}, {"loss": loss_torch}, tol_loss)
    grad_diff = compare_state_dicts(grads_jax, grads_torch, tol_grads)
    return {
        "config": dataclasses.asdict(cfg),
        "batch": batch,
        "seq_len": seq_len,
        "seed": seed,
        "dtype": "float32",
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

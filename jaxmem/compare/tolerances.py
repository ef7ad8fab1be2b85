"""The one tolerance table (per dtype, a reason per entry) and the elementwise comparison every
parity and consistency check uses. Pure (numpy only): ``tests/`` (jaxmem alone),
``parity_tests/`` and ``jaxmem parity`` share it.

Which dtype checks what:

- ``float64``: exactness. The two frameworks (and a policy against no remat) must compute the
  same function; in float64 rounding is ~1e-16, so a real bug (wrong mask, transpose, scale,
  missing gradient) stands out by ten orders of magnitude, and a ReLU input would have to lie
  within ~1e-16 of zero to land on different sides in the two frameworks.
- ``float32``: dtype behaviour at the precision people train in, on configurations without a
  kink at zero (GELU). A ReLU pre-activation within fp32 rounding of zero (measured: 1.8e-7 in
  a 3-layer post-norm ReLU stack) flips its mask in one framework and moves that parameter's
  gradient by 3e-2 relative, so ReLU configurations are compared in float64, not here.
- ``bfloat16``: mixed precision: each framework's error against its own fp32 result must be of
  the same size, and the next-token distributions close (KL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tolerance:
    """Elementwise ``|jax - torch| <= atol + rtol * |torch|`` and why these numbers."""

    rtol: float
    atol: float
    reason: str

    def kwargs(self) -> dict[str, float]:
        return {"rtol": self.rtol, "atol": self.atol}


FLOAT64_TOLERANCE_NOTE = (
    "float64 unit roundoff is 1.1e-16; the frameworks sum reductions in different orders, so "
    "results differ by a few ulps of the largest partial sums"
)

# fp32 unit roundoff is 6e-8. XLA:CPU and PyTorch (oneDNN / ATen) sum matmuls, softmax and
# LayerNorm reductions in different orders, so results differ by a few ulps of the largest
# partial sums. Each bound below is about 10-30x what was measured on the tiny, seed and odd
# configurations, and ~1000x below what a real bug produces (a wrong mask, transpose or scale
# changes values at the 1e-2 level).
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "float64": {
        "logits": Tolerance(
            rtol=1e-12,
            atol=1e-13,
            reason="exactness: O(1) logits after L blocks; measured max abs diff 2.0e-15 (tiny, "
            "seed, odd; 6.7e-16 on Llama and Qwen2-style blocks), so 50x headroom, and 1e10 "
            "below a real bug",
        ),
        "block_output": Tolerance(
            rtol=1e-12,
            atol=1e-13,
            reason="exactness: O(1) activations (LayerNorm outputs, residual stream); a few ulps "
            "of d_ff-long dot products",
        ),
        "loss": Tolerance(
            rtol=1e-13,
            atol=0.0,
            reason="exactness: mean cross-entropy ~5.5 summed over B*S tokens in different "
            "orders; measured relative diff <= 3.2e-16",
        ),
        "grads": Tolerance(
            rtol=1e-11,
            atol=1e-14,
            reason="exactness: gradient leaves reach 0.2; measured max abs diff 1.2e-16 and max "
            "normwise relative 1.1e-15 (tiny, seed, odd; every preset policy and six random "
            "custom ones, stock and lean), 8.3e-17 and 1.2e-15 on Llama and Qwen2-style blocks "
            "(RMSNorm, RoPE, SwiGLU, grouped-query attention; naive and fused). atol covers "
            "elements that are ~0 in one framework and a rounding residue in the other",
        ),
        "transformers_float32_internals": Tolerance(
            rtol=1e-6,
            atol=1e-7,
            reason="transformers' Llama (and Qwen2) run a float64 model with two float32 steps: "
            "RMSNorm casts its input to float32, and the rotary embedding computes inv_freq and "
            "the angles position * inv_freq in float32 (jaxmem: float64, from jaxmem.positions). "
            "Measured on the tiny models of parity_tests/hf_models.py (sequence 32): logits "
            "1.1e-7 abs, loss 4.1e-10 relative, gradients 1.0e-8 abs; with both steps patched "
            "to float64 the float64 bounds above hold (so nothing else differs)",
        ),
        "fused_vs_naive": Tolerance(
            rtol=1e-11,
            atol=1e-14,
            reason="exactness: the fused op sums the softmax over key blocks with an online "
            "rescaling, naive in one pass; same function, different rounding. Measured normwise "
            "<= 7.0e-16 (op alone: sequence 13 in 4 blocks and 16 in one, causal and not) and "
            "9.4e-16 (gradients of the tiny decoder, 2 layers, sequence 13 in blocks of 8)",
        ),
        "remat_vs_none": Tolerance(
            rtol=1e-11,
            atol=1e-14,
            reason="exactness: recompute replays the same ops; measured 0 (bitwise equal) for "
            "every preset policy and six random custom ones in both frameworks, but XLA may fuse "
            "a replay differently, so the bound is the cross-framework one",
        ),
        "rope_tables": Tolerance(
            rtol=0.0,
            atol=1e-11,
            reason="RoPE's cos/sin at long sequences, built by angle addition (position = hi * "
            "step + lo) against the angles p * f formed directly: float64 rounds an angle by "
            "|angle| * 1.1e-16 either way, and angles reach S radians (5,137 in the test: "
            "5.7e-13); measured 4.5e-13 abs. A wrong factor or index moves values by >= 1e-3",
        ),
        "learning_rate": Tolerance(
            rtol=1e-15,
            atol=0.0,
            reason="torch's LambdaLR rate against the schedule's formula (OptimizerConfig.lr_at), "
            "both Python floats: LambdaLR multiplies the base rate by lr_at(i) / lr, two "
            "roundings; measured 1 ulp (2.7e-20 at 2e-4, 1.4e-16 relative) and 0 at a floor "
            "of 0; a step off the schedule moves a rate by >= 1e-2 relative",
        ),
    },
    "float32": {
        "streamed_grad_norm": Tolerance(
            rtol=1e-6,
            atol=0.0,
            reason="a streamed step sums the gradient's squares block by block (the rest, then "
            "each block of the stack) where the unstreamed one sums them leaf by leaf: the same "
            "terms in another order. Measured 1.2e-7 relative at most over 400 steps of tiny "
            "(bf16, selective); the losses are bit-identical",
        ),
        "streamed_sgd_params": Tolerance(
            rtol=0.0,
            atol=1e-8,
            reason="a streamed step updates the stack block by block with the same elementwise "
            "SGD arithmetic (weight decay added to the gradient, momentum, step); XLA:CPU fuses "
            "the per-block update differently from the whole-tree one: measured 3.7e-9 on tiny "
            "fp32 parameters after 4 steps, losses still bit-identical (AdamW's updates are)",
        ),
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
        "rope_tables": Tolerance(
            rtol=0.0,
            atol=1e-6,
            reason="RoPE's cos/sin built in float32 by angle addition from factor tables rounded "
            "to float32, against the float64 angles: a product of two roundings and a sum, a "
            "few ulps of 1 (6e-8 each); measured 1.4e-7 abs at 5,137 positions (the float32 "
            "constants' own rounding: 3.0e-8). A wrong factor or index moves values by >= 1e-3",
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
            reason="gradient leaves reach 0.2; measured max abs diff 7.8e-8 (3.7e-8 on Llama and "
            "Qwen2-style blocks). atol covers elements that are ~0 in one framework and a "
            "rounding residue in the other",
        ),
        "fused_vs_naive": Tolerance(
            rtol=1e-5,
            atol=1e-6,
            reason="fp32 rounding of two summation orders of the softmax (blockwise with "
            "rescaling vs one pass) and of the recomputed probabilities in the backward; "
            "measured max abs diff 4.8e-7 and normwise 3.2e-7 (op alone, outputs ~1), 8.2e-8 and "
            "4.9e-7 (tiny decoder's gradients); the fp32 gradient bound",
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
            "updates; measured relative diff <= 6e-7 (one device each), 9.1e-7 for jaxmem "
            "--mesh fsdp=2 vs torch_ref FSDP2 on 2 torchrun ranks (tiny, 10 steps)",
        ),
        "learning_rate": Tolerance(
            rtol=2e-6,
            atol=1e-10,
            reason="a schedule's learning rate per step: optax computes it in float32 (the "
            "cosine too), torch's LambdaLR in float64; measured max relative diff 1.2e-6 where "
            "a cosine nears its floor and max abs diff 8.2e-11 at lr 1e-3 (float32 rounding of "
            "values near the peak); a schedule off by one step moves a value by >= 1e-2 relative",
        ),
        "data_parallel_loss": Tolerance(
            rtol=5e-6,
            atol=0.0,
            reason="the same 10 AdamW steps on 4 devices vs 1: the gradient all-reduce (or "
            "reduce-scatter) adds per-device partial sums in another order; measured max "
            "relative diff 2.6e-7 (dp, zero1) and 1.7e-7 (fsdp) on tiny, 1.7e-7 for all three "
            "with 2 microbatches (jaxmem), 1.7e-7 for DDP and FSDP2 on 2 torchrun ranks "
            "(torch_ref, 2 microbatches); 20x below the bound; a wrong batch split or a missing "
            "reduction moves the loss at the 1e-2 level",
        ),
    },
    "bfloat16": {
        "loss_chunks_loss": Tolerance(
            rtol=2e-4,
            atol=0.0,
            reason="the head and loss in chunks vs whole (LossPolicy.chunks), bf16 "
            "compute: the head's parameter gradient is rounded to bf16 once per chunk and the "
            "partials added in fp32 (whole: one rounding), compounding through the AdamW "
            "updates; measured max relative diff 1.5e-5 (tiny, selective, 2 microbatches, 4 "
            "chunks, 6 steps; 9.4e-8 in fp32). A chunk's gradient dropped or counted twice moves "
            "the loss at the 1e-2 level",
        ),
        "loss": Tolerance(
            rtol=1e-3,
            atol=0.0,
            reason="bf16 has 8 mantissa bits (eps 3.9e-3); the mean loss over ~100 tokens averages "
            "per-token rounding; measured jax-vs-torch relative diff <= 1e-5 (tiny), 5e-6 (seed), "
            "5.9e-5 (Qwen2-style block, fused attention)",
        ),
        "logits_kl": Tolerance(
            rtol=0.0,
            atol=1e-4,
            reason="KL(torch || jax) of next-token distributions from bf16 logits; measured 3e-7 "
            "(tiny), 3e-6 (seed block) and <= 1.6e-7 (Llama and Qwen2-style blocks, 256 tokens) "
            "per token",
        ),
        "grad_error_ratio": Tolerance(
            rtol=0.5,
            atol=2e-3,
            reason="bf16 gradients are compared through each framework's error against its own "
            "fp32 gradients (max normwise over leaves): the larger error may exceed the smaller by "
            "50% + 2e-3. Measured 0.85% vs 0.81% (tiny), 22.6% vs 22.3% (seed, cancellation-heavy "
            "ReLU gradients), 1.06% vs 1.11% (Llama block: jaxmem rounds the SwiGLU product "
            "once, PyTorch's F.silu(g) * u after each op)",
        ),
        "fused_vs_naive_error": Tolerance(
            rtol=0.5,
            atol=2e-3,
            reason="bf16 output and q/k/v gradients compared through each form's error against "
            "the float64 result (normwise): the fused form's may exceed the naive form's by 50% "
            "+ 2e-3 (it rounds the unnormalised probabilities to bf16 before p·v and dS before "
            "its matmuls, as FlashAttention-2 does). Measured (sequence 13 in 4 blocks) fused vs "
            "naive: dK 6.2e-3 vs 3.5e-3, dQ 5.8e-3 vs 4.3e-3, dV equal, output 1.8e-3 vs 3.2e-3",
        ),
        "remat_vs_none": Tolerance(
            rtol=2e-2,
            atol=0.0,
            reason="bf16 recompute replays the same ops but XLA may fuse the replay differently, "
            "changing where intermediate bf16 roundings happen; normwise bound",
        ),
        "data_parallel_loss": Tolerance(
            rtol=5e-5,
            atol=0.0,
            reason="bf16 compute, fp32 master weights, 5 AdamW steps of 2 microbatches on 4 "
            "devices (fsdp) vs 1: partial sums reduced in another order, then rounded through "
            "bf16 activations; measured max relative diff 2.6e-6 on tiny (optimizer state on the "
            "device) and 6.1e-6 (in pinned_host), 8x below the bound",
        ),
    },
}


# Memory figures of one program measured two ways (bytes, not values): the key is "bytes".
TOLERANCES["bytes"] = {
    "deviceless_vs_device_plan": Tolerance(
        rtol=0.10,
        atol=0.0,
        reason="a deviceless compile runs no autotuning, so GEMM workspaces and some fusion "
        "choices may differ from the plan XLA compiles on the GPU; the difference is "
        "bounded at 10 %. Unmeasured where CI runs (no GPU): GPU-only test",
    ),
    "runtime_peak_vs_plan": Tolerance(
        rtol=0.10,
        atol=256 * 2**20,
        reason="the allocator's peak adds rounding to its size classes, the step's inputs "
        "transferred before it and what other executables left resident (the CUDA context "
        "itself is not counted); 10 % + 256 MiB. Unmeasured where CI runs (no GPU): GPU-only test",
    ),
    "plan_depth_increment": Tolerance(
        rtol=1e-3,
        atol=0.0,
        reason="a uniform stack's planned peak is affine in its depth up to buffer alignment: "
        "measured on small fp32 8 x 128 (XLA:CPU, none) 33,624,064 B from 2 to 3 blocks and "
        "33,636,288 from 3 to 4 (3.6e-4); the memory model jaxmem plan fits rests on it",
    ),
    "peak_arena_vs_plan": Tolerance(
        rtol=1e-3,
        atol=0.0,
        reason="XLA's memory-usage report of a step's device arena also counts its constants, "
        "which memory_analysis() leaves out: measured on tiny fp32 4 x 32 `offload` for an "
        "H100, 3,088,581 B vs 3,087,713 (868 B, 2.8e-4); host memory is in neither",
    ),
    "mixed_stack_residuals": Tolerance(
        rtol=0.01,
        atol=0.0,
        reason="a stack run through the mixed stack's custom VJP with one preset on every block "
        "keeps what the scanned stack keeps, by residual accounting; measured on small fp32 "
        "8 x 128, selective: 39.09 vs 39.05 MiB (+0.1 %: the scan's iteration indices and "
        "carries); counting the block weights once more would add 12.1 MiB (+31 %)",
    ),
    "mixed_stack_prediction": Tolerance(
        rtol=0.20,
        atol=0.0,
        reason="jaxmem plan's memory model: a mixed stack (k blocks under one preset, the rest "
        "under another) predicted from each preset's plans at two depths as max of the "
        "intercepts + each part's per-block slope; the two scans' working sets overlap "
        "differently from either uniform stack's. Measured on small fp32 8 x 128, every mix "
        "of none/selective/full: XLA:CPU -0.189..+0.120 (a one-block part loses its remat "
        "there: XLA:CPU removes a one-iteration loop, then the replay), H100 plan "
        "-0.096..+0.074; jaxmem plan's default --slack is this bound",
    ),
    "tagged_residuals_vs_plan": Tolerance(
        rtol=0.15,
        atol=0.0,
        reason="what a policy's kept tags cost by residual accounting against how far the "
        "compiled plan's peak moves (a user's Flax model, selective against full, H100 plans): "
        "the peak sits where the backward starts with every kept tensor live, but XLA's "
        "schedule and fusions around it differ by policy. Measured 0.984 (8 blocks, d 128, "
        "8 x 512) and 1.125 (8 blocks, d 2048, 8 x 2048: 4.00 vs 4.50 GiB); with 2 blocks of "
        "d 256 at 4 x 256 the peak is elsewhere (0.24): the test uses the first size",
    ),
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

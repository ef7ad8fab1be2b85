"""torch_ref: the same decoder and memory strategies in plain, eager PyTorch, written as a
PyTorch user would write them: the oracle of the parity suite and the other column of every
benchmark.

Imports no JAX: only jaxmem's pure-data modules (``jaxmem.config``, ``jaxmem.policy``,
``jaxmem.precision``, ``jaxmem.data``, ``jaxmem.run_layout``, ``jaxmem.quant``: a quantized
base's packed arrays, and ``jaxmem.positions``: RoPE's float64 tables), so a policy, a config
object or a rotation means the same thing on both sides.
Modules: ``model``, ``remat`` (a ``MemoryPolicy`` in stock PyTorch, and torch_ref's labelled
``lean`` extension), ``train`` (autocast + GradScaler, accumulation, optimizers),
``forward_memory`` (what a forward leaves for the backward: live-tensor and saved-tensor
accounting, by tag), ``mesh_memory`` (one step's memory per rank over a mesh), ``loss``,
``checkpoint``, ``generate``, ``quant`` (a quantized frozen base: dequantization and a linear
that re-dequantizes in its backward), ``flops`` (FlopCounterMode formulas for the CPU attention
kernels), ``module_memory`` (the public API for any ``nn.Module``: checkpoint plans in
``checkpoint_plan``, saved activations in ``module_activations``, step peaks in
``module_peak``). What needs both frameworks (weights from jaxmem, parity, benchmarks, the
seeds' example, ``jaxmem train --framework torch``) is ``jaxmem.compare``.
"""

import torch_ref.flops  # noqa: F401  (FLOP formulas for the CPU SDPA kernels; see there)
from torch_ref.model import (
    Block,
    BlockStack,
    Decoder,
    FeedForward,
    GatedFeedForward,
    SelfAttention,
)

__all__ = ["Block", "BlockStack", "Decoder", "FeedForward", "GatedFeedForward", "SelfAttention"]

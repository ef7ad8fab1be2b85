"""FLOP formulas ``torch.utils.flop_counter.FlopCounterMode`` lacks (beyond stock PyTorch).

Stock ``FlopCounterMode`` (torch 2.13) counts 0 FLOPs for the CPU flash-attention kernel that
``F.scaled_dot_product_attention`` runs on CPU (``_scaled_dot_product_flash_attention_for_cpu``
and its backward): the registry holds formulas for the CUDA kernels only. This registers PyTorch's
own formulas for those kernels (``sdpa_flop``: q·kᵀ and p·v; ``sdpa_backward_flop``: five
matmuls, the scores recomputed) for the CPU ones too, so fused attention's FLOPs count on CPU as
they would on a GPU. Masked (causal) blocks are counted, as PyTorch's formulas and jaxmem's
jaxpr counter both do. On torch 2.11, whose formulas refuse grouped-query attention (fewer
key/value heads than query heads), torch 2.12's are registered for every attention kernel
(``torch_ref.compat.FLOPS_KNOW_GQA``). Imported by ``torch_ref``; registering twice is a no-op.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter

from torch_ref.compat import FLOPS_KNOW_GQA

_aten = torch.ops.aten


def _bmm(b: int, m: int, k: int, n: int) -> int:
    return 2 * b * m * k * n


def _gqa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """torch 2.12's ``sdpa_flop``: q·kᵀ and p·v, key/value heads broadcast to the query's."""
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return _bmm(b * h, s_q, d_q, s_k) + _bmm(b * h, s_q, s_k, d_v)


def _gqa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                  **kwargs) -> int:  # fmt: skip
    """torch 2.12's ``sdpa_backward_flop``: the scores recomputed, then four products."""
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return (
        _bmm(b * h, s_q, d_q, s_k)
        + _bmm(b * h, s_q, d_v, s_k)
        + _bmm(b * h, s_k, s_q, d_v)
        + _bmm(b * h, s_q, s_k, d_q)
        + _bmm(b * h, d_q, s_q, s_k)
    )


_GQA_KERNELS = {
    "_scaled_dot_product_efficient_attention": _gqa_forward,
    "_scaled_dot_product_flash_attention": _gqa_forward,
    "_scaled_dot_product_cudnn_attention": _gqa_forward,
    "_scaled_dot_product_flash_attention_for_cpu": _gqa_forward,
    "_scaled_dot_product_efficient_attention_backward": _gqa_backward,
    "_scaled_dot_product_flash_attention_backward": _gqa_backward,
    "_scaled_dot_product_cudnn_attention_backward": _gqa_backward,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _gqa_backward,
}
CPU_SDPA = {
    "_scaled_dot_product_flash_attention_for_cpu": flop_counter.sdpa_flop,
    "_scaled_dot_product_flash_attention_for_cpu_backward": flop_counter.sdpa_backward_flop,
}


def register() -> None:
    if not FLOPS_KNOW_GQA:  # torch 2.11: 2.12's formulas for every attention kernel
        for name, formula in _GQA_KERNELS.items():
            packet = getattr(_aten, name, None)
            if packet is not None:
                flop_counter.flop_registry[packet] = flop_counter.shape_wrapper(formula)
        return
    for name, formula in CPU_SDPA.items():
        packet = getattr(_aten, name, None)
        if packet is not None and packet not in flop_counter.flop_registry:
            # the registry's formulas take shapes: sdpa_flop / sdpa_backward_flop are already
            # wrapped (shape_wrapper), so register them raw
            flop_counter.register_flop_formula(packet, get_raw=True)(formula)


register()

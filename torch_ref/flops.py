"""FLOP formulas ``torch.utils.flop_counter.FlopCounterMode`` lacks (beyond stock PyTorch).

Stock ``FlopCounterMode`` (torch 2.13) counts 0 FLOPs for the CPU flash-attention kernel that
``F.scaled_dot_product_attention`` runs on CPU (``_scaled_dot_product_flash_attention_for_cpu``
and its backward): the registry holds formulas for the CUDA kernels only. This registers PyTorch's
own formulas for those kernels (``sdpa_flop``: q·kᵀ and p·v; ``sdpa_backward_flop``: five
matmuls, the scores recomputed) for the CPU ones too, so fused attention's FLOPs count on CPU as
they would on a GPU. Masked (causal) blocks are counted, as PyTorch's formulas and jaxmem's
jaxpr counter both do. Imported by ``torch_ref``; registering twice is a no-op.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter

_aten = torch.ops.aten
CPU_SDPA = {
    "_scaled_dot_product_flash_attention_for_cpu": flop_counter.sdpa_flop,
    "_scaled_dot_product_flash_attention_for_cpu_backward": flop_counter.sdpa_backward_flop,
}


def register() -> None:
    for name, formula in CPU_SDPA.items():
        packet = getattr(_aten, name, None)
        if packet is not None and packet not in flop_counter.flop_registry:
            # the registry's formulas take shapes: sdpa_flop / sdpa_backward_flop are already
            # wrapped (shape_wrapper), so register them raw
            flop_counter.register_flop_formula(packet, get_raw=True)(formula)


register()

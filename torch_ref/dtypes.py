"""The dtype rule both torch_ref's model and its losses follow (``jaxmem.model.ops.wide``)."""

from __future__ import annotations

import torch


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms, softmax, logits and the loss run in: float32, or wider when the compute
    dtype is (float64 in the parity suite's exactness mode); ``jaxmem.model.ops.wide``. (Plain
    Python: ``torch.promote_types`` would dispatch an op inside the block's op stream.)"""
    return torch.float64 if dtype == torch.float64 else torch.float32

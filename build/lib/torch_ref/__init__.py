"""torch_ref: the plain, eager PyTorch mirror of jaxmem, used as the oracle in parity tests.

Module names mirror jaxmem's (``config`` is shared: ``jaxmem.config`` imports no JAX).
"""

from torch_ref.model import Block, BlockStack, Decoder, FeedForward, SelfAttention

__all__ = ["Block", "BlockStack", "Decoder", "FeedForward", "SelfAttention"]

"""The model, in Flax NNX: a pure decoder that only tags its intermediates (``decoder``), the
memory-lean elementwise ops it uses (``ops``), losses outside the model (``loss``), sampling
(``generate``) and a quantized frozen base's dequantization and linear (``quant``)."""

from jaxmem.model.decoder import (
    STACK_PATH,
    Block,
    BlockStack,
    Decoder,
    LayerFn,
    LayersFn,
    causal_mask,
    make_model,
    scan_layers,
)
from jaxmem.policy import CHECKPOINT_NAMES

__all__ = [
    "CHECKPOINT_NAMES",
    "Block",
    "BlockStack",
    "Decoder",
    "LayerFn",
    "LayersFn",
    "STACK_PATH",
    "causal_mask",
    "make_model",
    "scan_layers",
]

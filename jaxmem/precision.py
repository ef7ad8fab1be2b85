"""Precision as data: one object says in which dtype parameters are stored, computation runs,
gradients are accumulated and the loss is computed, and whether the loss is dynamically scaled.

Pure data (no JAX, no PyTorch): each framework maps the dtype names to its own dtypes
(``jaxmem.step.train_step`` / ``torch_ref.train.TORCH_DTYPES``). Norms, softmax, logits and the loss
always run in float32 or wider ("at least fp32"): the models enforce that, so ``output_dtype`` is
float32, or float64 for the float64 exactness mode (``FP64``).

Dynamic loss scaling (``loss_scale="dynamic"``) follows ``torch.amp.GradScaler`` exactly: initial
scale 2**16; a step whose gradients contain inf/nan is skipped and halves the scale; after 2000
consecutive finite steps the scale doubles (JAX: ``jaxmem.step.scaling.DynamicLossScale``).
"""

from __future__ import annotations

import dataclasses

from jaxmem.config import lookup, require

DTYPES = ("float32", "bfloat16", "float16", "float64")
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """Attributes:
    name: label.
    param_dtype: storage dtype of the parameters (the master weights the optimizer updates).
    compute_dtype: dtype of matmuls and activations.
    accum_dtype: dtype of gradient-accumulation buffers.
    output_dtype: logits / loss dtype (float32; float64 only when computing in float64).
    loss_scale: ``"none"`` or ``"dynamic"`` (GradScaler semantics; required for float16).
    """

    name: str
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    accum_dtype: str = "float32"
    output_dtype: str = "float32"
    loss_scale: str = "none"

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "accum_dtype", "output_dtype"):
            value = getattr(self, field)
            require(value in DTYPES, f"{field}={value!r} is not one of {DTYPES}")
        wide = "float64" if self.compute_dtype == "float64" else "float32"
        require(
            self.output_dtype == wide,
            f"output_dtype={self.output_dtype!r}: logits and loss are always {wide} with "
            f"compute_dtype={self.compute_dtype!r}",
        )
        require(
            self.param_dtype != "float16",
            "param_dtype='float16' (pure fp16) is not supported: keep float32 master weights "
            "with compute_dtype='float16' and loss_scale='dynamic'",
        )
        require(
            self.loss_scale in ("none", "dynamic"),
            f"loss_scale={self.loss_scale!r} is not one of ('none', 'dynamic')",
        )
        require(
            self.compute_dtype != "float16" or self.loss_scale == "dynamic",
            "compute_dtype='float16' needs loss_scale='dynamic': fp16 gradients underflow "
            "without it",
        )

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def is_mixed(self) -> bool:
        return self.param_dtype != self.compute_dtype


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(name="fp32"),
    # Mixed precision: fp32 master weights, bf16 matmuls and activations.
    "bf16": Precision(name="bf16", compute_dtype="bfloat16"),
    # Mixed precision with fp16 compute: needs dynamic loss scaling.
    "fp16": Precision(name="fp16", compute_dtype="float16", loss_scale="dynamic"),
    # Lower memory, lower fidelity: bf16 parameters and optimizer updates (no fp32 master copy);
    # small updates are lost to bf16 rounding.
    "pure-bf16": Precision(
        name="pure-bf16", param_dtype="bfloat16", compute_dtype="bfloat16", accum_dtype="bfloat16"
    ),
}

# Everything in float64: the exactness mode of the parity suite (JAX needs jax_enable_x64). Not a
# training precision, so not in PRECISIONS: an fp32 check can flip on a ReLU whose input is within
# rounding of zero; in float64 that needs an input within 1e-16 of zero.
FP64 = Precision(
    name="fp64",
    param_dtype="float64",
    compute_dtype="float64",
    accum_dtype="float64",
    output_dtype="float64",
)


def get_precision(name: str) -> Precision:
    """The named precision; an unknown name raises ``ConfigError`` listing the valid ones."""
    return lookup(PRECISIONS, name, "precision")

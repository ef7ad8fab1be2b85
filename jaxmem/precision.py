"""Precision as data: one object says in which dtype parameters are stored, computation runs,
gradients are accumulated and the loss is computed, and whether the loss is dynamically scaled.

Norms and softmax always run in fp32 and logits are always fp32 (the model enforces that, see
``jaxmem.model``); ``output_dtype`` is therefore fixed to float32 and validated.

Dynamic loss scaling is written here because optax has none and jmp's ``DynamicLossScale`` loses
``min_loss_scale`` under jit. It follows ``torch.amp.GradScaler`` exactly: initial scale 2**16;
a step whose gradients contain inf/nan is skipped and halves the scale; after 2000 consecutive
finite steps the scale doubles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxmem.config import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """Attributes:
    name: label.
    param_dtype: storage dtype of the parameters (the master weights the optimizer updates).
    compute_dtype: dtype of matmuls and activations.
    accum_dtype: dtype of gradient-accumulation buffers.
    output_dtype: logits / loss dtype (always float32).
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
            if value not in DTYPES:
                raise ConfigError(f"{field}={value!r} is not one of {DTYPES}")
        if self.output_dtype != "float32":
            raise ConfigError(
                f"output_dtype={self.output_dtype!r}: logits and loss are always float32"
            )
        if self.param_dtype == "float16":
            raise ConfigError(
                "param_dtype='float16' (pure fp16) is not supported: keep float32 master "
                "weights with compute_dtype='float16' and loss_scale='dynamic'"
            )
        if self.loss_scale not in ("none", "dynamic"):
            raise ConfigError(f"loss_scale={self.loss_scale!r} is not one of ('none', 'dynamic')")
        if self.compute_dtype == "float16" and self.loss_scale != "dynamic":
            raise ConfigError(
                "compute_dtype='float16' needs loss_scale='dynamic': fp16 gradients underflow "
                "without it"
            )

    @property
    def param(self) -> Any:
        return jnp.dtype(self.param_dtype)

    @property
    def compute(self) -> Any:
        return jnp.dtype(self.compute_dtype)

    @property
    def accum(self) -> Any:
        return jnp.dtype(self.accum_dtype)

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


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ConfigError(
            f"unknown precision {name!r}; choose one of: {', '.join(PRECISIONS)}"
        ) from None


@struct.dataclass
class DynamicLossScale:
    """``torch.amp.GradScaler``'s state and update rule, as a jit-friendly pytree."""

    scale: jax.Array
    growth_tracker: jax.Array  # consecutive finite steps since the last change
    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    growth_interval: int = struct.field(pytree_node=False, default=2000)

    @classmethod
    def create(cls, init_scale: float = 2.0**16, growth_interval: int = 2000) -> DynamicLossScale:
        return cls(
            scale=jnp.asarray(init_scale, jnp.float32),
            growth_tracker=jnp.asarray(0, jnp.int32),
            growth_interval=growth_interval,
        )

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        return loss * self.scale.astype(loss.dtype)

    def unscale(self, grads: Any) -> Any:
        inv = 1.0 / self.scale
        return jax.tree_util.tree_map(lambda g: g * inv.astype(g.dtype), grads)

    def update(self, grads_finite: jax.Array) -> DynamicLossScale:
        """GradScaler.update(): back off on overflow, grow after ``growth_interval`` good steps."""
        tracker = jnp.where(grads_finite, self.growth_tracker + 1, 0)
        grow = tracker >= self.growth_interval
        scale = jnp.where(
            grads_finite,
            jnp.where(grow, self.scale * self.growth_factor, self.scale),
            self.scale * self.backoff_factor,
        )
        return self.replace(scale=scale, growth_tracker=jnp.where(grow, 0, tracker))


def all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def check_precision_backend(precision: Precision, device: jax.Device | None = None) -> None:
    """Raise ``ConfigError`` if the backend cannot compute in ``precision``'s dtypes.

    TPUs have no float16 arithmetic; elsewhere a one-element matmul is compiled and run in each
    16-bit dtype the precision uses, so an unsupported backend fails here, with the fix, rather
    than in the middle of a compile.
    """
    device = device or jax.devices()[0]
    for dtype in {precision.compute_dtype, precision.param_dtype} - {"float32"}:
        if dtype == "float16" and device.platform == "tpu":
            raise ConfigError(
                f"precision {precision.name!r} computes in float16, which {device.platform} "
                "does not support; use bf16"
            )
        try:
            x = jax.device_put(jnp.ones((1, 1), dtype), device)
            jax.block_until_ready(jnp.dot(x, x))
        except Exception as e:  # backends raise their own error types
            raise ConfigError(
                f"precision {precision.name!r} needs {dtype}, which this {device.platform} "
                f"backend rejects ({type(e).__name__}); use fp32 or bf16"
            ) from None

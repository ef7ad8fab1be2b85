"""Dynamic loss scaling in JAX, following ``torch.amp.GradScaler`` exactly: initial scale 2**16;
a step whose gradients contain inf/nan is skipped and halves the scale; after 2000 consecutive
finite steps the scale doubles.

Written here because optax has no loss scaling and jmp's ``DynamicLossScale`` loses
``min_loss_scale`` under jit. The precision that asks for it is data
(``jaxmem.precision.Precision.loss_scale``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxmem.precision import Precision


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


def init_loss_scale(precision: Precision) -> DynamicLossScale | None:
    """GradScaler's initial state for a dynamically scaled precision (fp16), else None."""
    return DynamicLossScale.create() if precision.loss_scale == "dynamic" else None

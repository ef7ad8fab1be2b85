"""Optimizer construction and the jitted training step.

The step is a pure function of ``(params, opt_state, batch)``; parameters and optimizer state are
donated so XLA updates them in place instead of holding two copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxmem.config import OptimizerConfig
from jaxmem.loss import cross_entropy_sum

DECAYED_LEAVES = ("kernel", "embedding")  # matrices; biases and norm scales are not decayed


def _param_name(path: tuple) -> str:
    """The parameter's own name (``kernel``, ``bias``, ...): the last dict key of its path (an
    NNX ``Param`` adds a trailing ``.value`` attribute key, which is skipped)."""
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]


def decay_mask(params: nnx.State) -> Any:
    """True for the leaves that get weight decay (Linear kernels and embedding tables)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _param_name(path) in DECAYED_LEAVES, params
    )


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """optax transformation with ``torch.optim.AdamW``'s exact semantics (``eps`` outside the
    square root, bias correction on both moments, decoupled decay ``lr * wd * param``)."""
    if cfg.name == "adamw":
        return optax.adamw(
            learning_rate=cfg.lr,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    raise ValueError(f"optimizer={cfg.name!r} is not supported")


def lm_loss_fn(graphdef: nnx.GraphDef, **model_kwargs: Any) -> Callable[..., tuple]:
    """``loss(params, batch) -> (mean_loss, (loss_sum, n_tokens))`` for next-token prediction.

    ``batch`` is ``{"inputs": [B, S] ids, "targets": [B, S] ids, "mask": [B, S] (optional)}``.
    """

    def loss(params: nnx.State, batch: dict[str, jax.Array]):
        model = nnx.merge(graphdef, params)
        logits = model(batch["inputs"], **model_kwargs)
        loss_sum, n_tokens = cross_entropy_sum(logits, batch["targets"], batch.get("mask"))
        return loss_sum / n_tokens, (loss_sum, n_tokens)

    return loss


def make_train_step(
    loss_fn: Callable[..., tuple], tx: optax.GradientTransformation
) -> Callable[..., tuple]:
    """A jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` that donates
    ``params`` and ``opt_state``. ``metrics`` stay on device (no host sync in the step)."""

    def step(params, opt_state, batch):
        (loss, (loss_sum, n_tokens)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        grad_norm = optax.tree.norm(grads)
        return params, opt_state, {"loss": loss, "n_tokens": n_tokens, "grad_norm": grad_norm}

    return jax.jit(step, donate_argnums=(0, 1))


def tree_bytes(tree: Any) -> int:
    """Bytes held by the array leaves of ``tree`` (counted from shapes and dtypes)."""
    return sum(
        math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype")
    )

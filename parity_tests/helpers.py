"""Shared pieces of the training parity tests: one deterministic masked batch, and each
framework's accumulated gradient under a (policy, precision, accumulation) combination."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import torch_ref
from jaxmem.compare.weights import load_torch_state_dict, to_torch_state_dict
from jaxmem.config import AccumConfig, ModelConfig
from jaxmem.memory.remat import layers_fn
from jaxmem.model import Decoder, make_model
from jaxmem.policy import MemoryPolicy
from jaxmem.precision import Precision
from jaxmem.step.train_step import lm_loss_fn, stack_accumulating_loss, summed_grads
from torch_ref.remat import apply_memory_policy
from torch_ref.train import TORCH_DTYPES, accumulate_grads


def masked_batch(cfg: ModelConfig, batch: int, seq_len: int, seed: int) -> dict[str, np.ndarray]:
    """Random tokens with right padding: row i keeps a different number of valid tokens, so
    equal-sized microbatches hold unequal token counts (the mean-of-means trap)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq_len + 1)).astype(np.int32)
    lengths = rng.integers(1, seq_len + 1, batch)
    lengths[0] = 1  # one nearly empty row
    mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def torch_batch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The same batch as torch tensors (token ids as int64, as nn.Embedding wants)."""
    out = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items()}
    out["inputs"], out["targets"] = out["inputs"].long(), out["targets"].long()
    return out


def jax_grads(
    reference: Decoder,
    batch: dict[str, np.ndarray],
    *,
    policy: MemoryPolicy,
    precision: Precision,
    accum_steps: int,
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean loss and mean-loss gradients (PyTorch keys, fp32 numpy) of ``reference``'s weights
    stored and computed in ``precision``."""
    cfg = reference.cfg
    model = make_model(cfg, precision)
    load_torch_state_dict(model, to_torch_state_dict(reference))
    graphdef, params = nnx.split(model, nnx.Param)

    def make(lf):
        return lm_loss_fn(graphdef, layers_fn=lf)

    # the train step's default: the stack's gradient accumulated in place where it can be
    into = stack_accumulating_loss(make, policy, cfg.n_layers, AccumConfig(steps=accum_steps))
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
    grads, loss_sum, n = jax.jit(
        lambda p, b: summed_grads(
            make(layers_fn(policy, cfg.n_layers)),
            p,
            b,
            accum_steps=accum_steps,
            accum_dtype=jnp.dtype(precision.accum_dtype),
            loss_into=into,
        )
    )(params, jbatch)
    grads = jax.tree_util.tree_map(lambda g: g / n, grads)
    sd = to_torch_state_dict(nnx.merge(graphdef, grads))
    return float(loss_sum / n), {k: v.astype(np.float32) for k, v in sd.items()}


def torch_grads(
    reference: Decoder,
    batch: dict[str, np.ndarray],
    *,
    policy: MemoryPolicy,
    precision: Precision,
    accum_steps: int,
) -> tuple[float, dict[str, np.ndarray]]:
    """The same in torch_ref (autocast for mixed precision, bf16 parameters for pure-bf16)."""
    model = torch_ref.Decoder(reference.cfg)
    state = {k: torch.from_numpy(v.copy()) for k, v in to_torch_state_dict(reference).items()}
    model.load_state_dict(state, strict=True)
    model = model.to(TORCH_DTYPES[precision.param_dtype])
    apply_memory_policy(model.blocks, policy)
    tbatch = torch_batch(batch)
    loss_sum, n = accumulate_grads(model, tbatch, precision=precision, accum_steps=accum_steps)
    grads = {k: p.grad.detach().float().numpy() for k, p in model.named_parameters()}
    return float(loss_sum / n), grads


def normwise_error(actual: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    """max over leaves of max|a - r| / max|r|."""
    return max(
        float(
            np.abs(actual[k].astype(np.float64) - reference[k]).max() / np.abs(reference[k]).max()
        )
        for k in reference
    )


def reference_model(cfg: ModelConfig, seed: int = 0) -> Decoder:
    return Decoder(cfg, rngs=nnx.Rngs(seed))

"""Text sampling from a trained decoder (the sample ``jaxmem train`` prints at the end).

No KV cache: the model runs on a fixed-size buffer whose tail is padding, which a causal mask
keeps from influencing earlier positions; one jitted ``fori_loop`` produces all new tokens, so
the sample costs one compile and ``n_new`` forward passes of the buffer. Good enough for a
short sample of a small model; not a serving path.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmem.data import PAD


def generate(
    graphdef: nnx.GraphDef,
    params: Any,
    prompt: np.ndarray,
    n_new: int,
    *,
    max_seq_len: int,
    temperature: float = 0.8,
    seed: int = 0,
    pad: int = PAD,
) -> np.ndarray:
    """``prompt`` followed by up to ``n_new`` sampled tokens (fewer if the buffer would exceed
    ``max_seq_len``). ``temperature=0`` is greedy. ``pad`` fills the buffer's tail (any id of
    the vocabulary: the causal mask hides it; out of the vocabulary its embedding is NaN)."""
    prompt = np.asarray(prompt, dtype=np.int32)
    if prompt.size == 0:
        raise ValueError("the prompt needs at least one token")
    prompt = prompt[-(max_seq_len - 1) :]  # keep room for at least one new token
    total = min(prompt.size + n_new, max_seq_len)
    buf = np.full((1, total), pad, np.int32)
    buf[0, : prompt.size] = prompt

    @jax.jit
    def run(params, buf, key):
        model = nnx.merge(graphdef, params)

        def body(i, state):
            buf, key = state
            logits_v = model(buf)[0, i - 1].astype(jnp.float32)  # [vocab]
            key, sub = jax.random.split(key)
            if temperature == 0.0:
                token = jnp.argmax(logits_v)
            else:
                token = jax.random.categorical(sub, logits_v / temperature)
            return buf.at[0, i].set(token.astype(buf.dtype)), key

        buf, _ = jax.lax.fori_loop(prompt.size, total, body, (buf, key))
        return buf

    return np.asarray(run(params, jnp.asarray(buf), jax.random.key(seed)))[0]

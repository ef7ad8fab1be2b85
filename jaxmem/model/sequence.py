"""Where each column of a step's sequence sits: its layout (``SequenceLayout``, for a step
that holds the sequence in another order) and RoPE's cos/sin tables in the compute's wide
dtype (``jaxmem.positions`` holds the float64 angles both frameworks share). Up to
``ROPE_CONSTANT_POSITIONS`` positions the tables are those float64 values rounded once and
embedded in the program; beyond it they are built in the step from two small factor tables,
since a constant ``[S, K]`` pair at a million positions is gigabytes of program (XLA refuses
to serialize a program over 2 GiB)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxmem.config import ModelConfig
from jaxmem.model.ops import wide
from jaxmem.positions import rope_angles, split_angles

Array = jax.Array
RopeTables = tuple[Array, Array] | None  # RoPE's cos, sin: [S, K] each


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """The sequence held in another order than its positions and attended another way (a step
    splitting rows over devices builds it: ``jaxmem.step.context``; the model only reads it).
    ``positions``: ``[S]`` ints, each column's position (position embeddings and RoPE follow
    it). ``attend(q, k, v) -> [B, S, D]`` (tagged ``attn_context``): the attention core for q
    ``[B, S, H, K]`` (naive grouped: ``[B, S, Hkv, G, K]``), k, v ``[B, S, Hkv, K]``, causal by
    ``positions``. ``shards``: the sequence is held as that many contiguous shards, one per
    device of a context axis; sequence tiles (the MLP's, the loss's) tile each shard on its own
    (``tile_major``), so no device gathers another's columns to run a tile."""

    positions: Any
    attend: Callable[[Array, Array, Array], Array]
    shards: int = 1


def tile_major(a: Array, tiles: int, shards: int = 1) -> Array:
    """``[B, S, ...]`` -> ``[tiles / shards, B, shards * S / tiles, ...]``: ``tiles`` equal tiles
    of the sequence, the step ``i`` of a loop over the leading axis taking the ``i``-th tile of
    each of ``shards`` contiguous shards (one shard: ``[tiles, B, S / tiles, ...]``, tile ``i``
    at step ``i``). With the sequence split over ``shards`` devices each device then runs its
    own columns' tile at every step: the loop's axis is never a split one."""
    b, s, rest = a.shape[0], a.shape[1], a.shape[2:]
    n, t = tiles // shards, s // tiles
    a = jnp.moveaxis(a.reshape(b, shards, n, t, *rest), 2, 0)  # [n, B, shards, T, ...]
    return a.reshape(n, b, shards * t, *rest)


def tile_minor(a: Array, shards: int = 1) -> Array:
    """``tile_major``'s inverse: ``[n, B, shards * T, ...]`` -> ``[B, S, ...]``."""
    n, b, st, rest = a.shape[0], a.shape[1], a.shape[2], a.shape[3:]
    a = a.reshape(n, b, shards, st // shards, *rest)
    return jnp.moveaxis(a, 0, 2).reshape(b, n * st, *rest)


# Up to this many positions RoPE's tables are float64 values rounded once to the wide dtype and
# embedded in the program as constants; beyond it (a long-context step), a constant [S, K] pair
# would be gigabytes of program (XLA refuses to serialize a program over 2 GiB), so the step
# builds the tables from two small factor tables (``jaxmem.positions.split_angles``): within a
# rounding or two of the constants' values in the wide dtype.
ROPE_CONSTANT_POSITIONS = 1 << 16
ROPE_STEP = 1024  # the fine table's length when the tables are built in the step


def rope_tables(cfg: ModelConfig, seq_len: int, dtype: Any, positions: Any = None) -> RopeTables:
    """RoPE's ``cos``, ``sin`` (``[S, K]``, in ``wide(dtype)``) for ``cfg``, or None without
    RoPE: computed once per forward, outside the blocks (constants to every remat policy).
    ``positions`` (``[S]``): each column's position (``SequenceLayout``); default in order."""
    if cfg.positions != "rope":
        return None
    acc = wide(dtype)
    if seq_len > ROPE_CONSTANT_POSITIONS:
        return built_rope_tables(cfg, seq_len, acc, positions)
    cos, sin = rope_angles(cfg, seq_len)
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    return jnp.asarray(cos, acc), jnp.asarray(sin, acc)


def built_rope_tables(
    cfg: ModelConfig, seq_len: int, acc: Any, positions: Any = None
) -> tuple[Array, Array]:
    """RoPE's tables built in the step by angle addition from ``split_angles``' factors:
    ``cos(a + b) = cos a cos b - sin a sin b``, ``sin(a + b) = sin a cos b + cos a sin b``;
    at ``positions`` (``[S]``) or in order."""
    hc, hs, lc, ls = (jnp.asarray(t, acc) for t in split_angles(cfg, seq_len, ROPE_STEP))
    pos = jnp.arange(seq_len) if positions is None else jnp.asarray(positions)
    hi, lo = pos // ROPE_STEP, pos % ROPE_STEP
    hc, hs, lc, ls = hc[hi], hs[hi], lc[lo], ls[lo]
    return hc * lc - hs * ls, hs * lc + hc * ls

"""Rotary position embedding's angles (RoPE; Su et al. 2021), as pure numpy in float64, so both
frameworks rotate by the very same numbers (jaxmem and torch_ref cast the tables to their wide
dtype). Llama 3.1/3.2's frequency scaling is Hugging Face's ``rope_type="llama3"``."""

from __future__ import annotations

import math

import numpy as np

from jaxmem.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """``[K/2]`` float64: ``theta ** (-2i / K)``, Llama 3's scaling applied when configured
    (wavelengths above ``original_max_len / low_freq_factor`` slowed by ``factor``, below
    ``original_max_len / high_freq_factor`` kept, smoothly interpolated between)."""
    k = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, k, 2, dtype=np.float64) / k)
    if cfg.rope_scaling == "none":
        return inv
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_max_len
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, smoothed, scaled)


def rope_angles(cfg: ModelConfig, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of each position's angles, ``[S, K]`` float64, each frequency twice
    (the rotate-half layout: dimension i pairs with i + K/2)."""
    freqs = np.outer(np.arange(seq_len, dtype=np.float64), inverse_frequencies(cfg))
    angles = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(angles), np.sin(angles)


def split_angles(cfg: ModelConfig, seq_len: int, step: int) -> tuple[np.ndarray, ...]:
    """RoPE's angles factored for long sequences: position ``p = hi * step + lo`` turns by
    ``hi * step`` then by ``lo``. Returns ``cos``, ``sin`` of the coarse angles (``[ceil(S /
    step), K]``) and of the fine ones (``[step, K]``), float64, in ``rope_angles``' layout; the
    angle-addition formulas rebuild any position's ``cos``/``sin`` from one row of each. At a
    million positions the whole ``[S, K]`` tables are gigabytes; these are kilobytes."""
    inv = inverse_frequencies(cfg)
    coarse = np.outer(np.arange(0, seq_len, step, dtype=np.float64), inv)
    fine = np.outer(np.arange(step, dtype=np.float64), inv)
    coarse, fine = (np.concatenate([a, a], axis=-1) for a in (coarse, fine))
    return np.cos(coarse), np.sin(coarse), np.cos(fine), np.sin(fine)

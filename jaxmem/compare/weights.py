"""Weight exchange between jaxmem (Flax NNX) and torch_ref / PyTorch state dicts.

Every parameter crosses through the one key-and-shape map, ``jaxmem.hf.keys.key_map(cfg,
"torch_ref", scope)`` (the map Hugging Face checkpoints use too, with torch_ref's names): each
entry names the NNX path, the PyTorch key and shape and whether the matrix is transposed (Flax
``Linear`` kernels are ``[in, out]``, PyTorch weights ``[out, in]``). Conversion asserts that
every key on both sides is mapped exactly once and that every shape matches, so a silently
missing or mis-shaped tensor is impossible. Files are safetensors (never pickle) with PyTorch key
names, so ``torch_ref`` (or any PyTorch code) loads them with ``safetensors.torch.load_file``.

Public API: ``to_torch_state_dict``, ``load_torch_state_dict``, ``save_safetensors``,
``load_safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmem.config import ModelConfig
from jaxmem.hf.keys import KeyMapEntry, key_map
from jaxmem.model import Block, BlockStack, Decoder

Path = tuple[Any, ...]


class WeightMapError(ValueError):
    """A state dict does not match the model: missing, unexpected or mis-shaped tensors."""


def _entries(module: nnx.Module, cfg: ModelConfig) -> list[KeyMapEntry]:
    """The key map of ``module``'s scope (decoder, stack or block) with torch_ref's names."""
    return key_map(cfg, "torch_ref", _scope_of(module))


def _scope_of(module: nnx.Module) -> str:
    if isinstance(module, Decoder):
        return "decoder"
    if isinstance(module, BlockStack):
        return "stack"
    if isinstance(module, Block):
        return "block"
    raise TypeError(f"expected a jaxmem Decoder, BlockStack or Block, got {type(module).__name__}")


def _config_of(module: nnx.Module, cfg: ModelConfig | None) -> ModelConfig:
    found = getattr(module, "cfg", None)
    if cfg is None and found is None:
        raise ValueError("a bare Block does not carry its ModelConfig: pass cfg=")
    return cfg or found


def _flat_params(module: nnx.Module) -> dict[Path, Any]:
    return {tuple(path): var for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _check_jax_coverage(entries: list[KeyMapEntry], flat: Mapping[Path, Any]) -> None:
    mapped = {e.path for e in entries}
    unmapped = sorted(".".join(map(str, p)) for p in set(flat) - mapped)
    absent = sorted(".".join(map(str, p)) for p in mapped - set(flat))
    if unmapped or absent:
        raise WeightMapError(
            f"jaxmem parameters and the key map disagree: not in the map {unmapped}, "
            f"in the map but not in the model {absent}"
        )


def to_torch_state_dict(
    module: nnx.Module, *, cfg: ModelConfig | None = None
) -> dict[str, np.ndarray]:
    """The PyTorch state dict (``key -> numpy array``) of a jaxmem ``Decoder``, ``BlockStack`` or
    ``Block``. Load it with ``torch_model.load_state_dict({k: torch.from_numpy(v) ...},
    strict=True)``."""
    cfg = _config_of(module, cfg)
    entries = _entries(module, cfg)
    flat = _flat_params(module)
    _check_jax_coverage(entries, flat)
    out: dict[str, np.ndarray] = {}
    for e in entries:
        value = np.asarray(flat[e.path][...])
        if e.layer is not None:
            value = value[e.layer]
        if value.shape != e.param_shape:
            raise WeightMapError(
                f"{'.'.join(e.path)}[{e.layer}] has shape {value.shape}, "
                f"the map expects {e.param_shape} for {e.key}"
            )
        out[e.key] = np.ascontiguousarray(value.T if e.transpose else value)
    return out


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch.Tensor: go through float32 when numpy lacks the dtype
        t = value.detach().cpu()
        try:
            return t.numpy()
        except TypeError:
            return t.float().numpy()
    return np.asarray(value)


def load_torch_state_dict(
    module: nnx.Module, state_dict: Mapping[str, Any], *, cfg: ModelConfig | None = None
) -> None:
    """Copy a PyTorch state dict (numpy arrays or torch tensors) into a jaxmem module in place.

    Raises ``WeightMapError`` naming every missing, unexpected or mis-shaped key; nothing is
    written unless everything matches. Values are cast to each parameter's dtype.
    """
    cfg = _config_of(module, cfg)
    entries = _entries(module, cfg)
    flat = _flat_params(module)
    _check_jax_coverage(entries, flat)
    expected = {e.key for e in entries}
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    bad_shapes = [
        f"{e.key}: got {tuple(state_dict[e.key].shape)}, expected {e.shape}"
        for e in entries
        if e.key in state_dict and tuple(state_dict[e.key].shape) != e.shape
    ]
    if missing or unexpected or bad_shapes:
        raise WeightMapError(
            f"state dict does not match the {type(module).__name__} of this config: "
            f"missing {missing}, unexpected {unexpected}, wrong shapes {bad_shapes}"
        )
    new_values: dict[Path, np.ndarray] = {path: np.array(var[...]) for path, var in flat.items()}
    for e in entries:
        value = _to_numpy(state_dict[e.key])
        value = value.T if e.transpose else value
        target = new_values[e.path]
        if e.layer is None:
            new_values[e.path] = value.astype(target.dtype)
        else:
            target[e.layer] = value.astype(target.dtype)
    for path, var in flat.items():
        var[...] = jnp.asarray(new_values[path], dtype=var[...].dtype)


def save_safetensors(
    module: nnx.Module, path: str | os.PathLike, *, cfg: ModelConfig | None = None
) -> None:
    """Write the module's weights as a safetensors file with PyTorch key names.

    The model config is stored in the file's metadata (``jaxmem_config``, JSON). The file is
    written to a temporary name and renamed, so a crash never leaves a half-written file.
    """
    from safetensors.numpy import save_file

    cfg = _config_of(module, cfg)
    tensors = to_torch_state_dict(module, cfg=cfg)
    metadata = {
        "format": "pt",
        "jaxmem_config": json.dumps(dataclasses.asdict(cfg)),
        "jaxmem_scope": _scope_of(module),
    }
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_safetensors_config(path: str | os.PathLike) -> ModelConfig | None:
    """The ``ModelConfig`` stored in a file written by ``save_safetensors`` (None if absent)."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="numpy") as f:
        meta = f.metadata() or {}
    raw = meta.get("jaxmem_config")
    return None if raw is None else ModelConfig(**json.loads(raw))


def load_safetensors(
    module: nnx.Module, path: str | os.PathLike, *, cfg: ModelConfig | None = None
) -> None:
    """Load a safetensors file with PyTorch key names (from ``save_safetensors``, from
    ``torch_ref`` or from any PyTorch model of the same architecture) into ``module``."""
    from safetensors.numpy import load_file

    load_torch_state_dict(module, load_file(os.fspath(path)), cfg=cfg)

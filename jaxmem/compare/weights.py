"""Weight exchange between jaxmem (Flax NNX) and torch_ref / PyTorch state dicts.

Every parameter crosses through the one key-and-shape map, ``jaxmem.hf.keys.key_map(cfg,
"torch_ref", scope)`` (the map Hugging Face checkpoints use too, with torch_ref's names): each
entry names the NNX path, the PyTorch key and shape and whether the matrix is transposed (Flax
``Linear`` kernels are ``[in, out]``, PyTorch weights ``[out, in]``). Conversion asserts that
every key on both sides is mapped exactly once and that every shape matches, so a silently
missing or mis-shaped tensor is impossible. Files are safetensors (never pickle) with PyTorch key
names, so ``torch_ref`` (or any PyTorch code) loads them with ``safetensors.torch.load_file``.

LoRA adapters cross through their own map (``adapter_key_map``): jaxmem's
``blocks.layers.{self_attn,ffn}.lora_{target}.lora_a`` ``[L, in, r]`` and ``lora_b``
``[L, r, out]`` against ``torch_ref.lora``'s PEFT names, ``blocks.layers.{i}.<module>.lora_A.
default[.part].weight`` ``[r, in]`` and ``lora_B`` ``[out, r]`` (transposed, layer by layer;
q, k and v are parts of the fused ``self_attn.in_proj``). The base's functions leave the
adapters out; ``to_torch_adapter_state_dict`` and ``load_torch_adapter_state_dict`` carry them.

Public API: ``to_torch_state_dict``, ``load_torch_state_dict``, ``to_torch_adapter_state_dict``,
``load_torch_adapter_state_dict``, ``save_safetensors``, ``load_safetensors``.
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
    """The base's parameters (the key map's side): every ``nnx.Param`` but the adapters'."""
    return {p: v for p, v in _all_params(module).items() if not _is_adapter(p)}


def _all_params(module: nnx.Module) -> dict[Path, Any]:
    return {tuple(path): var for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _is_adapter(path: Path) -> bool:
    return any(str(s).startswith("lora_") for s in path)


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


@dataclasses.dataclass(frozen=True)
class AdapterEntry:
    """One layer's adapter matrix: jaxmem's ``path`` (stacked, ``[L, ...]``) at ``layer``, and
    torch_ref's ``key`` holding it transposed, of shape ``shape``."""

    path: Path
    layer: int
    key: str
    shape: tuple[int, ...]


LORA_LEAVES = ("lora_a", "lora_b")  # nnx.LoRA's matrices: [in, r] and [r, out]


def _torch_module(target: str, cfg: ModelConfig) -> str:
    """The torch_ref module PEFT's LoRA layer wraps for ``target`` (q, k, v: a part suffix)."""
    if target in ("q", "k", "v"):
        return "self_attn.in_proj"
    if target == "o":
        return "self_attn.out_proj"
    if cfg.mlp == "gated":
        return f"ffn.{target}"
    return {"up": "ffn.0", "down": "ffn.2"}[target]  # the standard MLP's nn.Sequential


def adapter_key_map(module: nnx.Module, *, cfg: ModelConfig | None = None) -> list[AdapterEntry]:
    """Every adapter matrix of ``module`` (a jaxmem ``Decoder`` with adapters) and its
    torch_ref key; raises ``WeightMapError`` for an adapter path outside the map."""
    cfg = _config_of(module, cfg)
    out = []
    for path, var in _all_params(module).items():
        if not _is_adapter(path):
            continue
        if path[:2] != ("blocks", "layers") or len(path) != 5 or path[-1] not in LORA_LEAVES:
            raise WeightMapError(f"{'.'.join(map(str, path))} is not an adapter of the map")
        target = str(path[3]).removeprefix("lora_")
        module_name = _torch_module(target, cfg)
        part = f".{target}" if module_name == "self_attn.in_proj" else ""
        kind = "A" if path[-1] == "lora_a" else "B"
        shape = tuple(reversed(var[...].shape[1:]))  # [in, r] -> [r, in]; [r, out] -> [out, r]
        for i in range(var[...].shape[0]):
            key = f"blocks.layers.{i}.{module_name}.lora_{kind}.default{part}.weight"
            out.append(AdapterEntry(path, i, key, shape))
    return out


def to_torch_adapter_state_dict(
    module: nnx.Module, *, cfg: ModelConfig | None = None
) -> dict[str, np.ndarray]:
    """The adapters of a jaxmem ``Decoder`` under torch_ref's keys (``torch_ref.lora``'s
    ``adapter_state_dict``), each layer's matrix transposed."""
    flat = _all_params(module)
    return {
        e.key: np.ascontiguousarray(np.asarray(flat[e.path][...][e.layer]).T)
        for e in adapter_key_map(module, cfg=cfg)
    }


def load_torch_adapter_state_dict(
    module: nnx.Module, state_dict: Mapping[str, Any], *, cfg: ModelConfig | None = None
) -> None:
    """Copy torch_ref's adapters (``adapter_state_dict``: numpy arrays or tensors) into a
    jaxmem ``Decoder`` with the same adapters, in place; ``WeightMapError`` naming every
    missing, unexpected or mis-shaped key, nothing written unless everything matches."""
    entries = adapter_key_map(module, cfg=cfg)
    expected = {e.key for e in entries}
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    given = {k: tuple(v.shape) for k, v in state_dict.items()}
    bad = [e.key for e in entries if given.get(e.key, e.shape) != e.shape]
    if missing or unexpected or bad:
        raise WeightMapError(
            f"adapters do not match the model's: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, wrong shapes {bad[:3]}"
        )
    flat = _all_params(module)
    values = {path: np.array(flat[path][...]) for path in {e.path for e in entries}}
    for e in entries:
        values[e.path][e.layer] = _to_numpy(state_dict[e.key]).T.astype(values[e.path].dtype)
    for path, value in values.items():
        flat[path][...] = jnp.asarray(value)


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

"""Weight exchange between jaxmem (Flax NNX) and torch_ref / PyTorch state dicts.

Every parameter crosses through one explicit key-and-shape map (``key_map``): each entry names the
NNX path, the PyTorch key, both shapes and whether the matrix is transposed (Flax ``Linear``
kernels are ``[in, out]``, PyTorch weights ``[out, in]``). Conversion asserts that every key on
both sides is mapped exactly once and that every shape matches, so a silently missing or
mis-shaped tensor is impossible. Files are safetensors (never pickle) with PyTorch key names, so
``torch_ref`` (or any PyTorch code) loads them with ``safetensors.torch.load_file``.

Public API: ``key_map``, ``to_torch_state_dict``, ``load_torch_state_dict``, ``save_safetensors``,
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
from jaxmem.model import Block, BlockStack, Decoder

Path = tuple[Any, ...]


class WeightMapError(ValueError):
    """A state dict does not match the model: missing, unexpected or mis-shaped tensors."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyMapEntry:
    """One parameter: NNX path (+ layer index into the stacked axis) ↔ PyTorch key."""

    jax_path: Path
    layer: int | None  # index into the leading layer axis of a stacked BlockStack parameter
    torch_key: str
    torch_shape: tuple[int, ...]
    transpose: bool  # True for Linear kernels: Flax [in, out] vs PyTorch [out, in]

    @property
    def jax_shape(self) -> tuple[int, ...]:
        """Shape of this entry's slice on the JAX side (layer axis removed)."""
        return tuple(reversed(self.torch_shape)) if self.transpose else self.torch_shape


Row = tuple[Path, str, tuple[int, ...], bool]


def _linear_rows(jax_path: Path, torch_key: str, shape: tuple[int, ...], bias: bool) -> list[Row]:
    """A Linear's kernel (transposed: Flax ``[in, out]``, PyTorch ``[out, in]``) and its bias."""
    rows: list[Row] = [(jax_path + ("kernel",), f"{torch_key}.weight", shape, True)]
    if bias:
        rows.append((jax_path + ("bias",), f"{torch_key}.bias", shape[:1], False))
    return rows


def _norm_rows(jax_name: str, torch_name: str, cfg: ModelConfig) -> list[Row]:
    """A norm's scale (LayerNorm's or RMSNorm's, ``weight`` in PyTorch) and LayerNorm's bias."""
    d = cfg.d_model
    rows: list[Row] = [((jax_name, "norm", "scale"), f"{torch_name}.weight", (d,), False)]
    if cfg.has_bias("norm"):
        rows.append(((jax_name, "norm", "bias"), f"{torch_name}.bias", (d,), False))
    return rows


def _mlp_rows(cfg: ModelConfig) -> list[Row]:
    """Standard: the seeds' ``nn.Sequential`` keys (``ffn.0`` up, ``ffn.2`` down); gated:
    ``ffn.gate``, ``ffn.up``, ``ffn.down`` on both sides."""
    d, f, bias = cfg.d_model, cfg.d_ff, cfg.has_bias("mlp")
    if cfg.mlp == "gated":
        names = (
            ("gate", "ffn.gate", (f, d)),
            ("up", "ffn.up", (f, d)),
            ("down", "ffn.down", (d, f)),
        )
    else:
        names = (("up", "ffn.0", (f, d)), ("down", "ffn.2", (d, f)))
    return [
        row for name, key, shape in names for row in _linear_rows(("ffn", name), key, shape, bias)
    ]


def _block_entries(cfg: ModelConfig) -> list[Row]:
    """(NNX path inside a Block, PyTorch key inside a Block, PyTorch shape, transpose).

    The fused input projection stacks q, k and v rows in that order (``D + 2 Hkv K`` of them:
    fewer key/value rows under grouped-query attention), as ``nn.MultiheadAttention``'s
    ``in_proj_weight`` does."""
    d, qkv = cfg.d_model, cfg.d_model + 2 * cfg.kv_dim
    in_proj: list[Row] = [
        (("self_attn", "in_proj", "kernel"), "self_attn.in_proj_weight", (qkv, d), True)
    ]
    if cfg.has_bias("qkv"):
        in_proj.append((("self_attn", "in_proj", "bias"), "self_attn.in_proj_bias", (qkv,), False))
    out_proj = _linear_rows(
        ("self_attn", "out_proj"), "self_attn.out_proj", (d, d), cfg.has_bias("out")
    )
    norms = _norm_rows("norm1", "norm1", cfg) + _norm_rows("norm2", "norm2", cfg)
    return in_proj + out_proj + _mlp_rows(cfg) + norms


def key_map(cfg: ModelConfig, scope: str = "decoder") -> list[KeyMapEntry]:
    """The complete parameter map for ``scope``.

    Args:
      cfg: the model configuration.
      scope: ``"decoder"`` (``jaxmem.model.Decoder`` ↔ ``torch_ref.Decoder``), ``"stack"``
        (``BlockStack`` ↔ ``torch_ref.BlockStack``, keys ``layers.{i}.…``) or ``"block"`` (one
        unstacked ``Block`` ↔ ``torch_ref.Block`` or the seeds' ``DecoderLayer``).
    """
    entries: list[KeyMapEntry] = []
    if scope == "block":
        for path, key, shape, t in _block_entries(cfg):
            entries.append(
                KeyMapEntry(
                    jax_path=path, layer=None, torch_key=key, torch_shape=shape, transpose=t
                )
            )
        return entries
    if scope not in ("stack", "decoder"):
        raise ValueError(f"scope={scope!r} is not one of 'decoder', 'stack', 'block'")
    prefix_jax: Path = ("layers",) if scope == "stack" else ("blocks", "layers")
    prefix_torch = "layers" if scope == "stack" else "blocks.layers"
    for i in range(cfg.n_layers):
        for path, key, shape, t in _block_entries(cfg):
            entries.append(
                KeyMapEntry(
                    jax_path=prefix_jax + path,
                    layer=i,
                    torch_key=f"{prefix_torch}.{i}.{key}",
                    torch_shape=shape,
                    transpose=t,
                )
            )
    if scope == "stack":
        return entries
    d = cfg.d_model

    def top(path: Path, key: str, shape: tuple[int, ...], transpose: bool = False) -> None:
        entries.append(
            KeyMapEntry(
                jax_path=path, layer=None, torch_key=key, torch_shape=shape, transpose=transpose
            )
        )

    top(("wte", "embedding"), "wte.weight", (cfg.vocab_size, d))
    if cfg.learned_positions:
        top(("wpe", "embedding"), "wpe.weight", (cfg.max_seq_len, d))
    if cfg.final_norm:
        for path, key, shape, _ in _norm_rows("norm_f", "norm_f", cfg):
            top(path, key, shape)
    if not cfg.tie_embeddings:
        top(("lm_head", "kernel"), "lm_head.weight", (cfg.vocab_size, d), transpose=True)
    return entries


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
    mapped = {e.jax_path for e in entries}
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
    entries = key_map(cfg, _scope_of(module))
    flat = _flat_params(module)
    _check_jax_coverage(entries, flat)
    out: dict[str, np.ndarray] = {}
    for e in entries:
        value = np.asarray(flat[e.jax_path][...])
        if e.layer is not None:
            value = value[e.layer]
        if value.shape != e.jax_shape:
            raise WeightMapError(
                f"{'.'.join(e.jax_path)}[{e.layer}] has shape {value.shape}, "
                f"the map expects {e.jax_shape} for {e.torch_key}"
            )
        out[e.torch_key] = np.ascontiguousarray(value.T if e.transpose else value)
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
    entries = key_map(cfg, _scope_of(module))
    flat = _flat_params(module)
    _check_jax_coverage(entries, flat)
    expected = {e.torch_key for e in entries}
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    bad_shapes = [
        f"{e.torch_key}: got {tuple(state_dict[e.torch_key].shape)}, expected {e.torch_shape}"
        for e in entries
        if e.torch_key in state_dict and tuple(state_dict[e.torch_key].shape) != e.torch_shape
    ]
    if missing or unexpected or bad_shapes:
        raise WeightMapError(
            f"state dict does not match the {type(module).__name__} of this config: "
            f"missing {missing}, unexpected {unexpected}, wrong shapes {bad_shapes}"
        )
    new_values: dict[Path, np.ndarray] = {path: np.array(var[...]) for path, var in flat.items()}
    for e in entries:
        value = _to_numpy(state_dict[e.torch_key])
        value = value.T if e.transpose else value
        target = new_values[e.jax_path]
        if e.layer is None:
            new_values[e.jax_path] = value.astype(target.dtype)
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

"""Hugging Face checkpoints in and out of a jaxmem ``Decoder``: the JAX end of ``jaxmem.hf``
(imports no PyTorch and no ``transformers``). It lives in ``jaxmem.model`` because it needs the
``Decoder``, and ``jaxmem.hf`` is pure (base level, below ``model``); the files, the key-and-shape
map and ``config.json`` are ``jaxmem.hf``'s (``files``, ``keys``, ``config``).

``load_hf_weights(model, DIR)`` fills a model built from ``DIR``'s config (every tensor present
once, shapes asserted, values finite, converted to the model's parameter dtype;
``read_hf_weights`` reads them before the model exists); ``export_hf(params, cfg, OUT)``
writes a directory ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmem.config import ConfigError, ModelConfig
from jaxmem.hf.config import (
    SPECIAL_TOKEN_IDS,
    TOKENIZER_FILES,
    hf_config_from_model,
    is_model_dir,
    model_config_from_dir,
    read_hf_config,
)
from jaxmem.hf.files import read_params, save_model_dir
from jaxmem.hf.keys import Path, hf_tensors
from jaxmem.model.decoder import Decoder

# a model's own weights: every parameter but its adapters (``nnx.LoRAParam``)
BASE_PARAMS = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


def flat_params(params: Any) -> dict[Path, Any]:
    """An ``nnx.State`` of parameters (or a module) as ``path -> variable``: the base model's
    (adapters are not a Hugging Face model's tensors)."""
    if isinstance(params, nnx.Module):
        state = nnx.state(params, BASE_PARAMS)
    else:
        state = nnx.filter_state(params, BASE_PARAMS)
    return {tuple(str(k) for k in path): var for path, var in nnx.to_flat_state(state)}


def all_arrays(params: Any) -> dict[Path, np.ndarray]:
    """Every parameter of an ``nnx.State`` of parameters, adapters included, as
    ``path -> numpy array``."""
    state = nnx.filter_state(params, nnx.Param)
    return {tuple(str(k) for k in p): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}


def read_hf_weights(directory: str, cfg: ModelConfig, dtype: Any) -> dict[Path, np.ndarray]:
    """The Hugging Face checkpoint in ``directory`` as jaxmem's flat parameter tree in
    ``dtype``, read before any model exists (a run reads them before its random init
    compiles). ``cfg`` must compute the function of ``directory``'s config
    (``jaxmem.hf.config.disagreements``); raises ``ConfigError`` (one line) otherwise, or when a
    tensor is missing, unexpected, mis-shaped or holds nan or inf."""
    from jaxmem.hf.config import disagreements

    differ = disagreements(cfg, model_config_from_dir(directory))
    if differ:
        raise ConfigError(
            f"the model differs from {directory}'s config.json: {'; '.join(differ[:4])}; drop "
            "the settings that change it"
        )
    return read_params(directory, cfg, np.dtype(dtype))


def load_hf_weights(
    model: Decoder, directory: str, values: dict[Path, np.ndarray] | None = None
) -> None:
    """Copy the Hugging Face checkpoint in ``directory`` into ``model`` in place, converted to
    its parameters' dtype (``values``: ``read_hf_weights`` of it, in that dtype, when already
    read); the errors are ``read_hf_weights``'s, raised before the model changes."""
    flat = flat_params(model)
    dtypes = {np.dtype(var[...].dtype) for var in flat.values()}
    if len(dtypes) != 1:
        raise ConfigError(f"the model's parameters mix dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    if values is None:
        values = read_hf_weights(directory, model.cfg, dtype)
    ours = {p: (tuple(v[...].shape), dtype) for p, v in flat.items()}
    theirs = {p: (v.shape, v.dtype) for p, v in values.items()}
    assert ours == theirs, f"the weights read are not the model's shapes and dtype: {ours}"
    for path, var in flat.items():
        var[...] = jnp.asarray(values[path])


def export_hf(
    params: Any,
    cfg: ModelConfig,
    out_dir: str,
    *,
    tokenizer_from: str | None = None,
) -> list[str]:
    """Write ``params`` (an ``nnx.State`` or ``Decoder`` of ``cfg``, or its base parameters as
    ``path -> array``: ``jaxmem.hf.adapters.merged_params``) as a Hugging Face model
    directory: ``config.json``, ``model.safetensors`` (Hugging Face key names, the parameters'
    dtype) and the tokenizer files of ``tokenizer_from`` that exist. ``out_dir`` must be new
    or empty; written whole or not at all. Returns the file names."""
    if type(params) is dict:
        arrays = params
    else:
        arrays = {p: np.asarray(v[...]) for p, v in flat_params(params).items()}
    dtype = next(iter(arrays.values())).dtype.name
    tensors = hf_tensors(arrays, cfg)
    config = hf_config_from_model(cfg, dtype=dtype)
    if tokenizer_from is not None and is_model_dir(tokenizer_from):
        # the special tokens' ids belong with the tokenizer the files come from
        source = read_hf_config(tokenizer_from)
        config |= {k: source[k] for k in SPECIAL_TOKEN_IDS if k in source}
    return save_model_dir(
        out_dir,
        config,
        tensors,
        copy_from=tokenizer_from,
        files=TOKENIZER_FILES,
    )

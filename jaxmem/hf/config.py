"""Hugging Face model directories: ``config.json`` to a ``ModelConfig`` and back, and ``--preset
DIR`` (pure: no JAX, no PyTorch, no ``transformers``).

A model directory is what ``save_pretrained`` writes (or a hub download holds): ``config.json``,
``model.safetensors`` (or shards with ``model.safetensors.index.json``) and, optionally, the
tokenizer files. This module reads and writes the config; ``jaxmem.hf.files`` the tensors,
through ``jaxmem.hf.keys``' map; ``jaxmem.model.hf`` puts them into a jaxmem model.

Architectures read: ``gpt2`` (``GPT2LMHeadModel``), ``llama``, and where the block is Llama's,
``mistral`` (without a sliding window) and ``qwen2`` (q/k/v biases). A field jaxmem cannot
represent is refused with a ``ConfigError`` naming the field, its value and the fix; a field
absent from ``config.json`` takes ``transformers``' default for that ``model_type`` (what
``from_pretrained`` would use). Dropout is not applied: jaxmem's model has none.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from jaxmem.config import PRESETS, ConfigError, ModelConfig, get_preset, require, size_problem

CONFIG_JSON = "config.json"
MODEL_TYPES: tuple[str, ...] = ("gpt2", "llama", "mistral", "qwen2")
LLAMA_LIKE: tuple[str, ...] = ("llama", "mistral", "qwen2")
# the files a tokenizer brings (copied with an exported run whose model directory had them)
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)

SPECIAL_TOKEN_IDS: tuple[str, ...] = ("bos_token_id", "eos_token_id", "pad_token_id")

# transformers' defaults (its *Config classes, 5.x) for the fields jaxmem reads: a config.json
# that leaves a field out gets what from_pretrained would give it.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "add_cross_attention": False,
    },
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": None,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "head_dim": None,
        "sliding_window": 4096,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "layer_types": None,
    },
}

# transformers' activation names (ACT2FN) and jaxmem's
_ACTIVATIONS_IN = {
    "gelu": "gelu",  # exact (erf)
    "gelu_new": "gelu_tanh",  # GPT-2's tanh approximation
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
_GPT2_ACTIVATION_OUT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
_LLAMA_ACTIVATION_OUT = {
    "gelu": "gelu",
    "gelu_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
    "silu": "silu",
}


# ------------------------------------------------------------------------------- the directory
def is_model_dir(path: str) -> bool:
    """``path`` is a directory holding a ``config.json``."""
    return os.path.isfile(os.path.join(path, CONFIG_JSON))


def check_model_dir(directory: str, flag: str = "model directory") -> None:
    """A one-line ``ConfigError`` (naming ``flag``) unless ``directory`` is a directory: one
    that does not exist, or a file in one (``DIR/config.json``) named instead of it."""
    if os.path.isfile(directory):
        holder = os.path.dirname(directory) or "."
        raise ConfigError(
            f"{flag} {directory} is a file; give the directory that holds it ({holder})"
        )
    require(
        os.path.isdir(directory),
        f"{flag} {directory}: the directory does not exist; give a directory holding a Hugging "
        "Face config.json (what save_pretrained writes)",
    )


def read_hf_config(directory: str) -> dict[str, Any]:
    """``directory``'s ``config.json`` as a dict; a one-line ``ConfigError`` when it is not a
    model directory."""
    check_model_dir(directory)
    path = os.path.join(directory, CONFIG_JSON)
    require(
        os.path.isfile(path),
        f"{directory} has no {CONFIG_JSON}; give a Hugging Face model directory (what "
        "save_pretrained writes)",
    )
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON, bad UTF-8, a 5,000-digit number
        raise ConfigError(f"{path} is not readable JSON ({e}); fix or replace it") from None
    require(isinstance(raw, dict), f"{path} must hold a JSON object")
    return raw


def resolve_preset(name: str) -> ModelConfig:
    """A preset by name, or a Hugging Face model directory's model (``--preset DIR``): names
    first (a directory called ``tiny`` does not hide the preset)."""
    require(isinstance(name, str), f"preset={name!r} must be a preset name or a directory")
    if name in PRESETS:
        return get_preset(name)
    if os.path.isdir(name) or os.sep in name or (os.altsep and os.altsep in name):
        return model_config_from_dir(name)
    try:
        return get_preset(name)
    except ConfigError as e:
        raise ConfigError(
            f"{e}, or a directory holding a Hugging Face config.json (--preset DIR)"
        ) from None


def model_config_from_dir(directory: str) -> ModelConfig:
    """The ``ModelConfig`` of the Hugging Face model in ``directory``."""
    return model_config_from_hf(
        read_hf_config(directory), where=os.path.join(directory, CONFIG_JSON)
    )


# ------------------------------------------------------------------------------ config.json in
class _Fields:
    """``config.json``'s fields over transformers' defaults; every refusal names the file."""

    def __init__(self, raw: Mapping[str, Any], model_type: str, where: str):
        self.raw, self.where = raw, where
        self.values = {**_DEFAULTS[model_type], **raw}

    def __getitem__(self, key: str) -> Any:
        return self.values.get(key)

    def refuse(self, key: str, value: Any, fix: str) -> ConfigError:
        shown = json.dumps(value)
        if len(shown) > 40:  # a number of hundreds of digits, a long list: its start says enough
            shown = f"{shown[:20]}... ({len(shown)} characters)"
        return ConfigError(f"{self.where}: {key}={shown} {fix}")

    def integer(self, key: str, value: Any = None) -> int:
        """``key``'s value (or ``value``, read from inside another field) as a size."""
        value = self[key] if value is None else value
        problem = size_problem(value)
        if problem is not None:
            raise self.refuse(key, value, f"{problem}; fix config.json")
        return value

    def number(self, key: str, value: Any = None, fix: str = "fix config.json") -> float:
        """``key``'s value (or ``value``, read from inside another field) as a finite float."""
        value = self[key] if value is None else value
        number = math.nan
        if isinstance(value, int | float) and not isinstance(value, bool):
            with contextlib.suppress(OverflowError):  # an integer of 400 digits
                number = float(value)
        if not math.isfinite(number):
            raise self.refuse(key, value, f"must be a finite number; {fix}")
        return number

    def flag(self, key: str) -> bool:
        value = self[key]
        if not isinstance(value, bool):
            raise self.refuse(key, value, "must be true or false; fix config.json")
        return value


def model_config_from_hf(raw: Mapping[str, Any], *, where: str = CONFIG_JSON) -> ModelConfig:
    """A Hugging Face ``config.json`` (as a dict) as a ``ModelConfig``; ``ConfigError`` (one
    line: field, value, fix) for what jaxmem cannot represent."""
    model_type = raw.get("model_type")
    require(
        model_type in MODEL_TYPES,
        f"{where}: model_type={json.dumps(model_type)} is not one jaxmem reads; it reads "
        f"{', '.join(MODEL_TYPES)} (other architectures need their own block in jaxmem.model)",
    )
    f = _Fields(raw, model_type, where)
    cfg = _gpt2_config(f) if model_type == "gpt2" else _llama_config(f, model_type)
    return cfg


def _activation(f: _Fields, key: str, allowed: tuple[str, ...]) -> str:
    value = f[key]
    ours = _ACTIVATIONS_IN.get(value) if isinstance(value, str) else None
    if ours not in allowed:
        names = [k for k, v in _ACTIVATIONS_IN.items() if v in allowed]
        raise f.refuse(key, value, f"is not an activation jaxmem has here; use one of {names}")
    return ours


def _gpt2_config(f: _Fields) -> ModelConfig:
    for key, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if f[key] is not ok:
            raise f.refuse(
                key,
                f[key],
                f"is not jaxmem's GPT-2 block (scores scaled by 1/sqrt(head_dim) only, no "
                f"cross-attention); use {json.dumps(ok)}",
            )
    d = f.integer("n_embd")
    d_ff = d * 4 if f["n_inner"] is None else f.integer("n_inner")
    return _build(
        f,
        vocab_size=f.integer("vocab_size"),
        d_model=d,
        n_heads=f.integer("n_head"),
        n_layers=f.integer("n_layer"),
        d_ff=d_ff,
        max_seq_len=f.integer("n_positions"),
        activation=_activation(f, "activation_function", ("gelu", "gelu_tanh", "relu")),
        layer_norm_eps=f.number("layer_norm_epsilon"),
        init_std=f.number("initializer_range"),
        tie_embeddings=f.flag("tie_word_embeddings"),
        bias=True,
    )


def _rope(f: _Fields) -> dict[str, Any]:
    """RoPE's fields: transformers 5 writes ``rope_parameters`` (with ``rope_theta`` inside),
    earlier versions ``rope_theta`` and ``rope_scaling`` (``type`` or ``rope_type``)."""
    params = f["rope_parameters"] or f["rope_scaling"] or {}
    key = "rope_parameters" if f["rope_parameters"] else "rope_scaling"
    if not isinstance(params, Mapping):
        raise f.refuse(key, params, "must be an object or null; fix config.json")
    theta = params.get("rope_theta", f["rope_theta"] if f["rope_theta"] is not None else 1e4)
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": f.number("rope_theta", theta)}
    partial = params.get("partial_rotary_factor", f["partial_rotary_factor"])
    if partial not in (None, 1, 1.0):
        raise f.refuse(
            "partial_rotary_factor",
            partial,
            "rotates part of each head; jaxmem rotates whole heads (use 1.0)",
        )
    if kind == "default":
        return out | {"rope_scaling": "none"}
    if kind != "llama3":
        raise f.refuse(
            f"{key}.rope_type",
            kind,
            "is not a RoPE scaling jaxmem has; it has default (none) and llama3",
        )
    names = {
        "factor": "rope_factor",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
        "original_max_position_embeddings": "rope_original_max_len",
    }
    for theirs, ours in names.items():
        value = params.get(theirs)
        if ours == "rope_original_max_len":  # a size: 8192.0 is taken, 1e400 (inf) is not
            whole = isinstance(value, float) and value.is_integer()
            out[ours] = f.integer(f"{key}.{theirs}", int(value) if whole else value)
            continue
        out[ours] = f.number(f"{key}.{theirs}", value, "llama3 scaling needs it")
    return out | {"rope_scaling": "llama3"}


def _llama_config(f: _Fields, model_type: str) -> ModelConfig:
    d, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    max_len = f.integer("max_position_embeddings")
    head_dim = f["head_dim"]
    if head_dim is not None and (d % heads or head_dim != d // heads):
        raise f.refuse(
            "head_dim",
            head_dim,
            f"differs from hidden_size / num_attention_heads = {d} / {heads}; jaxmem's heads "
            "are d_model / n_heads wide (models with wider heads are not supported)",
        )
    if model_type == "mistral":
        window = f["sliding_window"]
        if window is not None and (not isinstance(window, int) or window < max_len):
            raise f.refuse(
                "sliding_window",
                window,
                f"limits attention to a window shorter than max_position_embeddings={max_len}; "
                "jaxmem attends to every earlier token (use null)",
            )
    if model_type == "qwen2":
        types = f["layer_types"] or []
        if f["use_sliding_window"] or "sliding_attention" in types:
            key = "use_sliding_window" if f["use_sliding_window"] else "layer_types"
            raise f.refuse(
                key,
                f[key],
                "gives some layers a sliding window; jaxmem attends to every earlier token "
                "(use false / full_attention)",
            )
    kv = f["num_key_value_heads"]
    if model_type == "qwen2":  # q/k/v biases, none on the output projection or the MLP
        biases = {"qkv_bias": True, "out_bias": False, "mlp_bias": False}
    elif model_type == "mistral":
        biases = {"qkv_bias": False, "out_bias": False, "mlp_bias": False}
    else:  # llama: attention_bias on q, k, v and o alike
        attn = f.flag("attention_bias")
        biases = {"qkv_bias": attn, "out_bias": attn, "mlp_bias": f.flag("mlp_bias")}
    return _build(
        f,
        vocab_size=f.integer("vocab_size"),
        d_model=d,
        n_heads=heads,
        n_kv_heads=heads if kv is None else f.integer("num_key_value_heads"),
        n_layers=f.integer("num_hidden_layers"),
        d_ff=f.integer("intermediate_size"),
        max_seq_len=max_len,
        norm_type="rmsnorm",
        positions="rope",
        mlp="gated",
        activation=_activation(f, "hidden_act", ("silu", "gelu", "gelu_tanh", "relu")),
        layer_norm_eps=f.number("rms_norm_eps"),
        init_std=f.number("initializer_range"),
        tie_embeddings=f.flag("tie_word_embeddings"),
        bias=False,
        **biases,
        **_rope(f),
    )


def _build(f: _Fields, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise ConfigError(f"{f.where}: {e}") from None


# ----------------------------------------------------------------------------- config.json out
def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face architecture that computes ``cfg``'s function: ``gpt2`` (LayerNorm,
    learned positions, standard MLP, every bias), ``llama`` (RMSNorm, RoPE, gated MLP, one
    attention bias setting) or ``qwen2`` (q/k/v biases only); ``ConfigError`` otherwise."""
    require(
        cfg.causal and cfg.norm == "pre",
        f"norm={cfg.norm!r}, causal={cfg.causal}: Hugging Face's GPT-2 and Llama are causal "
        "pre-norm decoders; only such a model exports",
    )
    gpt2 = (cfg.norm_type, cfg.positions, cfg.mlp) == ("layernorm", "learned", "standard")
    llama = (cfg.norm_type, cfg.positions, cfg.mlp) == ("rmsnorm", "rope", "gated")
    parts = {p: cfg.has_bias(p) for p in ("qkv", "out", "mlp", "norm")}
    if gpt2:
        require(
            all(parts.values()) and cfg.kv_heads == cfg.n_heads,
            f"biases {parts}, {cfg.kv_heads} key/value heads: GPT-2 has every bias and no "
            "grouped-query attention; this model matches no Hugging Face architecture",
        )
        require(
            cfg.activation in _GPT2_ACTIVATION_OUT,
            f"activation={cfg.activation!r}: GPT-2's MLP takes gelu, gelu_tanh or relu",
        )
        return "gpt2"
    require(
        llama,
        f"norm_type={cfg.norm_type!r}, positions={cfg.positions!r}, mlp={cfg.mlp!r}: Hugging "
        "Face has GPT-2 (layernorm, learned, standard) and Llama (rmsnorm, rope, gated); this "
        "mix exports as neither",
    )
    if parts["qkv"] and not parts["out"] and not parts["mlp"]:
        return "qwen2"
    require(
        parts["qkv"] == parts["out"],
        f"qkv_bias={parts['qkv']}, out_bias={parts['out']}: Llama's attention_bias covers q, k, "
        "v and o alike (Qwen2: q, k, v only, no MLP bias); this model matches neither",
    )
    return "llama"


def hf_config_from_model(cfg: ModelConfig, *, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` for ``cfg`` (``model_type`` from ``hf_model_type``) that
    ``transformers.AutoConfig`` reads back to the same architecture; ``dtype`` is the stored
    tensors'. Dropout is written as 0: the model was trained without it."""
    model_type = hf_model_type(cfg)
    common = {"vocab_size": cfg.vocab_size, "initializer_range": cfg.init_std, "dtype": dtype}
    common["tie_word_embeddings"] = cfg.tie_embeddings
    if model_type == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            **common,
            "n_embd": cfg.d_model,
            "n_head": cfg.n_heads,
            "n_layer": cfg.n_layers,
            "n_inner": cfg.d_ff,
            "n_positions": cfg.max_seq_len,
            "activation_function": _GPT2_ACTIVATION_OUT[cfg.activation],
            "layer_norm_epsilon": cfg.layer_norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": None,
            "eos_token_id": None,
        }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    out = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type,
        **common,
        "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "num_hidden_layers": cfg.n_layers,
        "intermediate_size": cfg.d_ff,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": _LLAMA_ACTIVATION_OUT[cfg.activation],
        "rms_norm_eps": cfg.layer_norm_eps,
        "rope_parameters": rope,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if model_type == "llama":
        out |= {"attention_bias": cfg.has_bias("qkv"), "mlp_bias": cfg.has_bias("mlp")}
    else:
        out |= {"use_sliding_window": False}
    return out


# ------------------------------------------------------------------ a model and its directory
def function_fields(cfg: ModelConfig) -> dict[str, Any]:
    """What decides the function ``cfg``'s weights compute, field by field: not how the
    attention core runs, not the init, not a field another one makes moot (RoPE's under learned
    positions, the longest sequence under RoPE: there is no table to fit)."""
    out: dict[str, Any] = {
        name: getattr(cfg, name)
        for name in (
            "vocab_size", "d_model", "n_heads", "kv_heads", "n_layers", "d_ff", "norm",
            "norm_type", "activation", "causal", "tie_embeddings", "layer_norm_eps",
            "positions", "mlp",
        )
    }  # fmt: skip
    out |= {f"{part}_bias": cfg.has_bias(part) for part in ("qkv", "out", "mlp", "norm")}
    if cfg.positions == "learned":
        return out | {"max_seq_len": cfg.max_seq_len}
    out |= {"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling}
    if cfg.rope_scaling == "llama3":
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            out[name] = getattr(cfg, name)
        out["rope_original_max_len"] = cfg.rope_original_max_len
    return out


def disagreements(model: ModelConfig, reference: ModelConfig) -> list[str]:
    """``field ours vs theirs`` wherever ``model`` computes another function than
    ``reference`` (a directory's config) with the same weights; empty when they agree."""
    ours, theirs = function_fields(model), function_fields(reference)
    return [
        f"{name} {ours.get(name)!r} vs {theirs.get(name)!r}"
        for name in dict.fromkeys([*ours, *theirs])
        if ours.get(name) != theirs.get(name)
    ]

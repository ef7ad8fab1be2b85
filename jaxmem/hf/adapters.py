"""LoRA adapters out of jaxmem as Hugging Face PEFT writes them (pure: numpy, no JAX, no PyTorch,
no ``peft``): ``adapter_config.json`` (``peft_config``), the tensors of
``adapter_model.safetensors`` (``peft_tensors``) and the base with the adapters merged in
(``merged_params``), all from jaxmem's flat parameter tree (``path -> array``, block parameters
stacked on a leading layer axis; adapters under ``lora_{target}`` with ``lora_a`` ``[L, in, r]``
and ``lora_b`` ``[L, r, out]``).

PEFT's keys on a Hugging Face Llama: ``base_model.model.model.layers.{i}.self_attn.q_proj.
lora_A.weight`` ``[r, in]`` (``lora_a[i].T``) and ``...lora_B.weight`` ``[out, r]``
(``lora_b[i].T``), without the adapter's name (``get_peft_model_state_dict`` strips
``.default``); unfrozen norms (``modules_to_save``) under their model keys. GPT-2's Hugging Face
naming fuses q, k and v into one ``c_attn`` ``Conv1D``, which holds one adapter, not one per part:
``check_exportable`` refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxmem.adapters import AdapterConfig
from jaxmem.config import ModelConfig, require
from jaxmem.hf.config import hf_model_type
from jaxmem.hf.keys import Path, key_map

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_BLOCKS: Path = ("blocks", "layers")
# where each target's adapter and its base kernel live in a block (q, k, v: column slices of
# the fused in_proj), and its module on a Hugging Face Llama
_MODULES = {
    "q": ("self_attn", "self_attn.q_proj"),
    "k": ("self_attn", "self_attn.k_proj"),
    "v": ("self_attn", "self_attn.v_proj"),
    "o": ("self_attn", "self_attn.o_proj"),
    "gate": ("ffn", "mlp.gate_proj"),
    "up": ("ffn", "mlp.up_proj"),
    "down": ("ffn", "mlp.down_proj"),
}
# the Hugging Face Llama modules holding the norms (``adapters.train = norm``)
NORM_MODULES = ["input_layernorm", "post_attention_layernorm", "norm"]


def check_exportable(cfg: ModelConfig) -> None:
    """``ConfigError`` (one line) unless PEFT's naming of ``cfg``'s Hugging Face model holds
    jaxmem's adapters: a Llama-family model (GPT-2's fused ``c_attn`` cannot)."""
    kind = hf_model_type(cfg)
    require(
        kind != "gpt2",
        "a GPT-2 model's adapters cannot be written as a PEFT adapter: Hugging Face's GPT-2 "
        "fuses q, k and v into one c_attn Conv1D, which holds one adapter, not one per part as "
        "jaxmem trains; export with --merge (the merged weights)",
    )


def peft_config(adapters: AdapterConfig, base_model: str | None) -> dict[str, Any]:
    """``adapter_config.json`` with the keys PEFT 0.21's ``save_pretrained`` writes for a
    ``LoraConfig`` (less ``peft_version``: no PEFT wrote it)."""
    return {
        "task_type": "CAUSAL_LM",
        "peft_type": "LORA",
        "auto_mapping": None,
        "base_model_name_or_path": base_model,
        "revision": None,
        "inference_mode": True,
        "r": adapters.rank,
        "target_modules": [_MODULES[t][1].split(".")[1] for t in adapters.targets],
        "exclude_modules": None,
        "lora_alpha": adapters.alpha,
        "lora_dropout": adapters.dropout,
        "fan_in_fan_out": False,
        "bias": "none",
        "use_rslora": adapters.rslora,
        "modules_to_save": NORM_MODULES if "norm" in adapters.train else None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "trainable_token_indices": None,
        "loftq_config": {},
        "eva_config": None,
        "corda_config": None,
        "lora_ga_config": None,
        "use_dora": False,
        "velora_config": None,
        "alora_invocation_tokens": None,
        "use_qalora": False,
        "qalora_group_size": 16,
        "monteclora_config": None,
        "layer_replication": None,
        "lora_bias": False,
        "target_parameters": None,
        "use_bdlora": None,
        "arrow_config": None,
        "kasa_config": None,
        "ensure_weight_tying": False,
    }


def _lora(params: Mapping[Path, np.ndarray], target: str) -> tuple[np.ndarray, np.ndarray]:
    where = (*_BLOCKS, _MODULES[target][0], f"lora_{target}")
    return params[(*where, "lora_a")], params[(*where, "lora_b")]


def peft_tensors(
    params: Mapping[Path, np.ndarray], cfg: ModelConfig, adapters: AdapterConfig
) -> dict[str, np.ndarray]:
    """``adapter_model.safetensors``'s tensors, PEFT's keys, in the adapters' dtype (and the
    unfrozen norms', ``modules_to_save``)."""
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.n_layers):
        for t in adapters.targets:
            a, b = _lora(params, t)
            key = f"{PEFT_PREFIX}model.layers.{i}.{_MODULES[t][1]}"
            out[f"{key}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            out[f"{key}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    if "norm" in adapters.train:
        for e in key_map(cfg, "hf"):
            if any(p.startswith("norm") for p in e.path):
                value = params[e.path] if e.layer is None else params[e.path][e.layer]
                out[PEFT_PREFIX + e.key] = np.ascontiguousarray(value)
    return out


def merged_params(
    params: Mapping[Path, np.ndarray],
    cfg: ModelConfig,
    adapters: AdapterConfig,
    dtype: Any = None,
) -> dict[Path, np.ndarray]:
    """The base parameters (every path but the adapters') with each adapter merged into its
    kernel: ``W + scale · A B`` per layer, computed in float64 and rounded once to ``dtype``
    (default ``W``'s own: a packed base's dequantized float32 ``W`` goes to the run's
    parameter dtype in one rounding); every other parameter as it is."""
    out = {p: v for p, v in params.items() if not any(s.startswith("lora_") for s in p)}
    d, kv = cfg.d_model, cfg.kv_dim
    columns = {"q": (0, d), "k": (d, d + kv), "v": (d + kv, d + 2 * kv)}
    kernels = {"o": ("self_attn", "out_proj"), "gate": ("ffn", "gate")}
    kernels |= {"up": ("ffn", "up"), "down": ("ffn", "down")}
    wide: dict[Path, np.ndarray] = {}
    for t in adapters.targets:
        path = (*_BLOCKS, *kernels.get(t, ("self_attn", "in_proj")), "kernel")
        if path not in wide:
            wide[path] = np.asarray(out[path], np.float64)
        a, b = (np.asarray(x, np.float64) for x in _lora(params, t))
        lo, hi = columns.get(t, (0, wide[path].shape[-1]))
        wide[path][..., lo:hi] += adapters.scale * np.matmul(a, b)
    for path, value in wide.items():
        out[path] = value.astype(dtype or np.asarray(params[path]).dtype)
    return out

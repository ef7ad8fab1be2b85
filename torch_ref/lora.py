"""LoRA adapters on torch_ref's ``Decoder`` with Hugging Face PEFT, from a jaxmem ``AdapterConfig``.

The stock way: ``peft.LoraConfig(r, lora_alpha, target_modules, lora_dropout, use_rslora,
bias="none")`` and ``peft.inject_adapter_in_model`` (``get_peft_model``'s injection, leaving the
``Decoder`` itself in place, so the memory policy, loss chunks and the trainer see the same
module). PEFT names its targets on a Hugging Face Llama (``q_proj`` ... ``down_proj``); here
``o`` is ``self_attn.out_proj``, the gated MLP's ``gate``/``up``/``down`` are ``ffn.gate``,
``ffn.up``, ``ffn.down``, the standard MLP's ``up``/``down`` are ``ffn.0``/``ffn.2``: stock
``peft.tuners.lora.Linear`` layers on each.

One extension, ``FusedQKVLora``: torch_ref's q/k/v projection is one fused parameter
(``self_attn.in_proj_weight`` ``[D + 2 Hkv K, D]``, as ``nn.MultiheadAttention``), and PEFT has
no way to put one adapter per part on it: its ``MultiheadAttention`` layer puts a single adapter
on the whole fused weight (a rank-r update of all three parts together, not the three rank-r
updates PEFT trains on a Llama's separate ``q_proj``, ``k_proj``, ``v_proj``), and
``target_parameters`` (``ParamWrapper``) likewise adapts a whole parameter (and refuses
dropout). So the fused matmul is a parameterless module (``torch_ref.model.FusedProjection``,
``self_attn.in_proj``; the base's state-dict names are unchanged), and ``FusedQKVLora`` (a PEFT
``LoraLayer``, registered with PEFT's own ``LoraConfig._register_custom_module``) adds
``scale * B_p(A_p(dropout(x)))`` to each targeted part ``p`` of its output: the arithmetic of
PEFT's ``lora.Linear`` on that part's rows.

A packed base (``torch_ref.quant.quantize_base``, applied before ``add_adapters``): each
packed ``QuantizedLinear`` gets PEFT's stock ``lora.Linear`` (registered with
``_register_custom_module``, as PEFT dispatches only ``nn.Linear`` itself), the packed q/k/v
(``PackedProjection``, a ``FusedProjection``) ``FusedQKVLora``; the base's state dict then holds
each projection's packed buffers (``packed``, ``absmax``, ...) where its weight was, and
``merged_state_dict`` merges onto their dequantized values.

State-dict keys (per block ``blocks.layers.{i}.``; A ``[r, in]``, B ``[out, r]`` as
``nn.Linear`` weights, adapter name ``default``):

- ``self_attn.in_proj.lora_A.default.{q,k,v}.weight`` ``[r, D]``;
  ``self_attn.in_proj.lora_B.default.q.weight`` ``[D, r]``, ``...{k,v}.weight`` ``[Hkv K, r]``
  (PEFT on a Llama: ``self_attn.{q,k,v}_proj.lora_{A,B}.weight``)
- ``self_attn.out_proj.lora_{A,B}.default.weight``, ``ffn.{gate,up,down}...`` or
  ``ffn.{0,2}...``: stock PEFT (a Llama's ``o_proj``, ``mlp.{gate,up,down}_proj``).

A wrapped layer's base weight is ``....base_layer.weight`` (PEFT's naming);
``base_state_dict`` gives the base under torch_ref's own names (what checkpoints hold and
``jaxmem.compare.weights`` maps), ``adapter_state_dict`` the adapters.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import Linear as PeftLinear
from peft.tuners.lora import LoraLayer
from torch import nn

from jaxmem.adapters import AdapterConfig
from jaxmem.config import ModelConfig
from torch_ref.model import Decoder, FusedProjection
from torch_ref.quant import QuantizedLinear, dense_state_dict

ADAPTER = "default"  # PEFT's default adapter name
QKV = ("q", "k", "v")
BASE_LAYER = ".base_layer"


def target_modules(adapters: AdapterConfig, cfg: ModelConfig) -> list[str]:
    """The module names (suffixes, as PEFT matches them) ``adapters.targets`` name in torch_ref."""
    mlp = {"gate": "ffn.gate", "up": "ffn.up", "down": "ffn.down"}
    if cfg.mlp != "gated":
        mlp = {"up": "ffn.0", "down": "ffn.2"}
    names = {"o": "self_attn.out_proj", **mlp}
    out = ["self_attn.in_proj"] if any(t in QKV for t in adapters.targets) else []
    return out + [names[t] for t in adapters.targets if t not in QKV]


def hf_target_modules(adapters: AdapterConfig) -> list[str]:
    """``adapters.targets`` as PEFT names them on a Hugging Face Llama (``q_proj`` ...)."""
    return [f"{t}_proj" for t in adapters.targets]


def lora_config(adapters: AdapterConfig, targets: list[str]) -> Any:
    """PEFT's ``LoraConfig`` for ``adapters`` on the modules ``targets``."""
    return LoraConfig(
        r=adapters.rank,
        lora_alpha=adapters.alpha,
        target_modules=targets,
        lora_dropout=adapters.dropout,
        use_rslora=adapters.rslora,
        bias="none",
    )


def add_adapters(model: Decoder, adapters: AdapterConfig) -> Decoder:
    """Put ``adapters`` on ``model`` in place (PEFT's ``inject_adapter_in_model``) and freeze the
    base: only the adapters, and the groups ``adapters.train`` names (``norm``: every norm's
    scale and bias), keep ``requires_grad``. The adapters take the base's dtype and device;
    ``B`` starts at zero (PEFT's default init), so the model computes what it did."""
    config = lora_config(adapters, target_modules(adapters, model.cfg))
    parts = tuple(t for t in QKV if t in adapters.targets)
    # a packed base (torch_ref.quant.quantize_base): PEFT's own lora.Linear on each packed
    # projection, as on an nn.Linear
    custom: dict[type, type] = {QuantizedLinear: PeftLinear}
    if parts:
        custom[FusedProjection] = fused_qkv_lora(parts)
    config._register_custom_module(custom)
    with warnings.catch_warnings():  # PEFT's note on every registered custom layer type
        warnings.filterwarnings("ignore", "Unsupported layer type", UserWarning)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or _unfrozen(name, adapters))
    return model


def _unfrozen(name: str, adapters: AdapterConfig) -> bool:
    return "norm" in adapters.train and ".norm" in f".{name}"


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` of a model with adapters is an adapter's (A or B)."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A parameter's name in the model without adapters (PEFT's ``base_layer`` dropped)."""
    return name.replace(BASE_LAYER, "")


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """A model state dict with adapters as ``(base, adapters)``: the base under torch_ref's own
    names (as without adapters: what ``jaxmem.compare.weights`` maps), the adapters under the
    keys of the module docstring."""
    base = {base_name(k): v for k, v in state.items() if not is_adapter(k)}
    return base, {k: v for k, v in state.items() if is_adapter(k)}


def join_state(model: nn.Module, base: dict, adapters: dict) -> dict[str, torch.Tensor]:
    """Inverse of ``split_state`` for ``model``: one state dict under ``model``'s own names;
    raises ``KeyError`` naming keys that differ (adapters saved with other targets)."""
    names = list(model.state_dict())
    own = {base_name(k): k for k in names if not is_adapter(k)}
    differ = sorted(set(own) ^ set(base)) + sorted(
        {k for k in names if is_adapter(k)} ^ set(adapters)
    )
    if differ:
        raise KeyError(f"the saved state's keys differ from the model's: {differ[:3]}")
    return {**{own[k]: v for k, v in base.items()}, **adapters}


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base's state dict under torch_ref's own names (as without adapters)."""
    return split_state(model.state_dict())[0]


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' state dict (the keys in the module docstring)."""
    return split_state(model.state_dict())[1]


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base's state dict with every adapter merged in: ``W + (B @ A) * scale`` per targeted
    weight (per part of ``in_proj_weight``), the arithmetic and order of PEFT's
    ``merge_and_unload`` (``get_delta_weight``), so the two agree bit for bit. A packed base
    (``torch_ref.quant.quantize_base``) gives ``W`` dequantized: the merged weights differ from
    the original unpacked ones by the quantization error."""
    state = {k: v.detach().clone() for k, v in base_state_dict(model).items()}
    state = dense_state_dict(model, state)  # a packed base: its dequantized weights
    for name, module in model.named_modules():
        if isinstance(module, FusedQKVLora):
            weight = state[f"{name.rsplit('.', 1)[0]}.in_proj_weight"]
            for part, rows in module.part_rows().items():
                weight[rows] += module.delta(ADAPTER, part)
        elif hasattr(module, "get_delta_weight") and hasattr(module, "lora_A"):
            state[f"{name}.weight"] += module.get_delta_weight(ADAPTER)
    return state


@functools.cache
def fused_qkv_lora(parts: tuple[str, ...]) -> type:
    """``FusedQKVLora`` adapting the parts ``parts`` (of q, k, v) of the fused projection."""
    return type(f"FusedQKVLora_{''.join(parts)}", (FusedQKVLora,), {"parts": parts})


class FusedQKVLora(nn.Module, LoraLayer):
    """PEFT LoRA layer for ``FusedProjection`` (see the module docstring): one adapter (A, B,
    dropout) per targeted part (``parts``; ``fused_qkv_lora`` makes the class for a choice), so
    PEFT's adapter bookkeeping (trainable marking, enabling and disabling, ``lora_*`` names)
    applies. Merging into the base weight is ``merged_state_dict``:
    the fused weight lives on the parent ``SelfAttention``."""

    parts: tuple[str, ...] = QKV

    def __init__(self, base_layer: FusedProjection, adapter_name: str, config: Any, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, kwargs["r"], kwargs["lora_alpha"], config)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def update_layer(self, adapter_name: str, r: int, lora_alpha: float, config: Any, **kw):
        sizes = self.get_base_layer().parts
        self.r[adapter_name], self.lora_alpha[adapter_name] = r, lora_alpha
        self.use_rslora[adapter_name] = config.use_rslora
        self.scaling[adapter_name] = lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        self.lora_bias[adapter_name] = False
        self.use_dora[adapter_name] = False
        drop = config.lora_dropout
        self.lora_dropout[adapter_name] = nn.ModuleDict(
            {p: nn.Dropout(drop) if drop > 0 else nn.Identity() for p in self.parts}
        )
        self.lora_A[adapter_name] = nn.ModuleDict(
            {p: nn.Linear(self.in_features, r, bias=False) for p in self.parts}
        )
        self.lora_B[adapter_name] = nn.ModuleDict(
            {p: nn.Linear(r, sizes[p], bias=False) for p in self.parts}
        )
        for p in self.parts:  # PEFT's default init (init_lora_weights=True)
            nn.init.kaiming_uniform_(self.lora_A[adapter_name][p].weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[adapter_name][p].weight)
        self._move_adapter_to_device_of_base_layer(adapter_name)  # the placement's dtype
        self.set_adapter(self.active_adapters)

    def part_rows(self) -> dict[str, slice]:
        """The rows of the fused weight (columns of its output) each targeted part owns."""
        out, start = {}, 0
        for name, size in self.get_base_layer().parts.items():
            if name in self.parts:
                out[name] = slice(start, start + size)
            start += size
        return out

    def delta(self, adapter: str, part: str) -> torch.Tensor:
        """``(B @ A) * scale`` of ``part``: PEFT's ``lora.Linear.get_delta_weight``."""
        a, b = self.lora_A[adapter][part].weight, self.lora_B[adapter][part].weight
        return (b @ a) * self.scaling[adapter]

    def merge(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "the fused q/k/v weight is its SelfAttention's: merge with "
            "torch_ref.lora.merged_state_dict"
        )

    def forward(self, x: torch.Tensor, attention: nn.Module) -> torch.Tensor:
        result = self.base_layer(x, attention)  # [B, S, D + 2 Hkv K]
        if self.disable_adapters:
            return result
        sizes = self.get_base_layer().parts  # every part, in row order
        out = dict(zip(sizes, result.split(list(sizes.values()), dim=-1), strict=True))
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            for part in self.parts:  # PEFT's lora.Linear.forward on the part's columns
                a, b = self.lora_A[adapter][part], self.lora_B[adapter][part]
                drop = self.lora_dropout[adapter][part]
                xa = self._cast_input_dtype(x, a.weight.dtype)
                out[part] = out[part] + b(a(drop(xa))) * self.scaling[adapter]
        return torch.cat(list(out.values()), dim=-1)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


# torch_ref module (under blocks.layers.{i}.) -> a Hugging Face Llama's (under model.layers.{i}.)
_HF_MODULES = {
    "self_attn.out_proj": "self_attn.o_proj",
    "ffn.gate": "mlp.gate_proj",
    "ffn.up": "mlp.up_proj",
    "ffn.down": "mlp.down_proj",
    "ffn.0": "mlp.up_proj",  # a standard MLP's up and down, as PEFT targets them by role
    "ffn.2": "mlp.down_proj",
}


def hf_adapter_key(name: str) -> str:
    """The key PEFT's adapter file (``adapter_model.safetensors``, without its
    ``base_model.model.`` prefix) gives torch_ref's adapter parameter ``name`` on a Hugging Face
    Llama: ``blocks.layers.0.self_attn.in_proj.lora_A.default.q.weight`` ->
    ``model.layers.0.self_attn.q_proj.lora_A.weight``."""
    head, _, tail = name.partition(".lora_")
    layer, _, module = head.removeprefix("blocks.layers.").partition(".")
    kind, adapter, *part = tail.removesuffix(".weight").split(".")
    if adapter != ADAPTER or not layer.isdigit():
        raise KeyError(f"{name!r} is not an adapter parameter of torch_ref's decoder")
    if module == "self_attn.in_proj":
        target = f"self_attn.{part[0]}_proj"
    else:
        target = _HF_MODULES[module]
    return f"model.layers.{layer}.{target}.lora_{kind}.weight"

"""Adapters as data: low-rank adapters (LoRA) on a frozen base, and how that base is stored.

``AdapterConfig`` is the ``[adapters]`` section of a job (``jaxmem.job.JobConfig.adapters``):
pure data, validated here with one-line messages that name the bad value. ``rank=0`` (the
default) is full fine-tuning: every parameter trained, no adapter. With ``rank > 0`` the base is
frozen (no gradient, no optimizer state) and each targeted projection ``W`` computes
``x W + scale * (dropout(x) A) B``, ``A`` ``[in, r]`` and ``B`` ``[r, out]`` (``B`` starts at
zero, so the first step is the base's), ``scale = alpha / r`` (``alpha / sqrt(r)`` with
``rslora``), as Hugging Face PEFT's ``LoraConfig`` defines them.

Targets are named as PEFT names the projections of a Hugging Face Llama (``q``, ``k``, ``v``,
``o`` for ``q_proj`` ... ``o_proj``; ``gate``, ``up``, ``down`` for the MLP's); a GPT-2 model
has ``up`` and ``down`` but no ``gate``. jaxmem's fused q/k/v kernel gets one adapter per part
it targets, so an adapter trained here is the one PEFT trains on the separate projections.

``base`` is the frozen base's storage: ``compute`` (the precision's parameter dtype), ``int8``
(per-output-channel absmax) or ``nf4`` (QLoRA's 4-bit NormalFloat in blocks of 64 with
double-quantized absmax). A quantized base is dequantized block by block where it is used, and
again in the backward (never kept for it). ``train`` unfreezes named parameter groups beside the
adapters (``norm``: every norm's scale and bias).

Pure data: imports only ``jaxmem.config``.
"""

from __future__ import annotations

import dataclasses
import math

from jaxmem.config import ModelConfig, require

# the projections an adapter can target, as PEFT names them on a Hugging Face Llama
TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
# PEFT's default target modules for Llama (``q_proj``, ``v_proj``) and its default alpha
DEFAULT_TARGETS: tuple[str, ...] = ("q", "v")
BASES: tuple[str, ...] = ("compute", "int8", "nf4")
# parameter groups ``train`` may unfreeze beside the adapters
TRAINABLE_GROUPS: tuple[str, ...] = ("norm",)
NF4_BLOCK = 64  # QLoRA's block of weights per absmax
NF4_STATS_BLOCK = 256  # QLoRA's block of absmax values per second-level scale (double quant)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """LoRA adapters and the frozen base's storage (see the module docstring)."""

    rank: int = 0
    alpha: float = 8.0
    rslora: bool = False
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0
    base: str = "compute"
    train: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        require(
            isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank >= 0,
            f"adapters.rank={self.rank!r} must be an integer >= 0 (0: no adapters, full "
            "fine-tuning; e.g. --lora-rank 16)",
        )
        require(
            isinstance(self.alpha, (int, float))
            and not isinstance(self.alpha, bool)
            and math.isfinite(self.alpha)
            and self.alpha > 0,
            f"adapters.alpha={self.alpha!r} must be a positive, finite number (e.g. 16)",
        )
        require(
            isinstance(self.targets, tuple) and all(isinstance(t, str) for t in self.targets),
            f"adapters.targets={self.targets!r} must be a list of projection names from "
            f"{', '.join(TARGETS)}",
        )
        unknown = [t for t in self.targets if t not in TARGETS]
        require(
            not unknown,
            f"adapters.targets: {', '.join(map(repr, unknown))} is not a projection; choose "
            f"from {', '.join(TARGETS)} (as PEFT names a Llama's q_proj ... down_proj)",
        )
        require(
            len(set(self.targets)) == len(self.targets),
            f"adapters.targets={list(self.targets)} names a projection twice",
        )
        require(
            not self.rank or self.targets,
            "adapters.targets is empty: name at least one projection (e.g. q,v) or set rank 0",
        )
        require(
            isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0,
            f"adapters.dropout={self.dropout!r} must be in [0, 1)",
        )
        require(self.base in BASES, f"adapters.base={self.base!r} is not one of {BASES}")
        require(
            self.rank > 0 or self.base == "compute",
            f"adapters.base={self.base!r} quantizes a frozen base: it needs adapters to train "
            "(e.g. --lora-rank 16)",
        )
        bad = [g for g in self.train if g not in TRAINABLE_GROUPS]
        require(
            not bad,
            f"adapters.train: {', '.join(map(repr, bad))} is not a parameter group; choose from "
            f"{', '.join(TRAINABLE_GROUPS)}",
        )
        require(
            self.rank > 0 or not self.train,
            f"adapters.train={list(self.train)} unfreezes parameters beside adapters: it needs "
            "adapters (e.g. --lora-rank 16); without them every parameter trains",
        )

    @property
    def enabled(self) -> bool:
        """Adapters on a frozen base (rank > 0); False: full fine-tuning."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """What the adapter's product is multiplied by: alpha / r (alpha / sqrt(r): rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def check_model(self, model: ModelConfig) -> None:
        """Raise ``ConfigError`` unless every target exists in ``model`` and the rank fits."""
        if not self.enabled:
            return
        if model.mlp != "gated":
            require(
                "gate" not in self.targets,
                "adapters.targets: 'gate' is a gated MLP's projection; this model's MLP is "
                f"{model.mlp!r} (up, down): drop gate",
            )
        smallest = min(model.d_model, model.d_ff, model.kv_dim)
        require(
            self.rank <= smallest,
            f"adapters.rank={self.rank} exceeds the model's narrowest projection ({smallest}): "
            "a low-rank adapter needs rank below it",
        )
        if self.base == "nf4":
            for name, size in (("d_model", model.d_model), ("d_ff", model.d_ff)):
                require(
                    size % NF4_BLOCK == 0,
                    f"adapters.base='nf4' packs weights in blocks of {NF4_BLOCK} along the "
                    f"input dimension: model {name}={size} is not a multiple; use base int8 or "
                    "compute",
                )

    def label(self) -> str:
        """The adapters in words (report headers): ``LoRA r16 a16 q,v, nf4 base``."""
        if not self.enabled:
            return "full fine-tuning"
        rs = " rslora" if self.rslora else ""
        base = "" if self.base == "compute" else f", {self.base} base"
        alpha = f"{self.alpha:g}"
        return f"LoRA r{self.rank} a{alpha}{rs} {','.join(self.targets)}{base}"

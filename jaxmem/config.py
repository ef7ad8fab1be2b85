"""Model, optimizer and accumulation configuration, and the named model presets.

One frozen, keyword-only dataclass per concern. Pure data: this module imports neither JAX nor
PyTorch, so ``torch_ref`` uses the very same config objects.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Literal, TypeVar

Norm = Literal["pre", "post"]
NormType = Literal["layernorm", "rmsnorm"]
Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]
Attention = Literal["naive", "fused"]
Positions = Literal["learned", "rope"]
Mlp = Literal["standard", "gated"]

NORMS: tuple[str, ...] = ("pre", "post")
NORM_TYPES: tuple[str, ...] = ("layernorm", "rmsnorm")
ACTIVATIONS: tuple[str, ...] = ("gelu", "gelu_tanh", "relu", "silu")
ATTENTIONS: tuple[str, ...] = ("naive", "fused")
POSITIONS: tuple[str, ...] = ("learned", "rope")
ROPE_SCALINGS: tuple[str, ...] = ("none", "llama3")
MLPS: tuple[str, ...] = ("standard", "gated")


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the value and how to fix it."""


def require(ok: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``ok``: the message names the value and the fix."""
    if not ok:
        raise ConfigError(message)


T = TypeVar("T")


def lookup(table: Mapping[str, T], name: str, what: str) -> T:
    """``table[name]``; an unknown name raises ``ConfigError`` listing the valid ones."""
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown {what} {name!r}; choose one of: {', '.join(table)}") from None


# The largest size a model field may take: token ids, positions and the indices into an axis
# are int32 in the step (JAX's default), so a size (or an id below it) beyond this overflows.
MAX_SIZE = 2**31 - 1


def size_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a size (a count of ids, positions, heads, layers or
    features): not a positive integer, or above ``MAX_SIZE``; None when it is fine."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return "must be a positive integer"
    if value > MAX_SIZE:
        return f"is above {MAX_SIZE:,} (2^31 - 1), the most int32 token ids and indices reach"
    return None


def _require_positive_int(name: str, value: object) -> None:
    problem = size_problem(value)
    require(problem is None, f"{name}={value!r} {problem}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and architecture of the decoder-only transformer.

    Attributes:
      vocab_size: number of token ids (the byte tokenizer uses 256 bytes + 3 specials = 259).
      d_model: width of the residual stream.
      n_heads: attention heads; must divide ``d_model``.
      n_layers: number of decoder blocks (stacked and scanned over).
      d_ff: hidden width of the MLP.
      max_seq_len: size of the learned position table; longer sequences are rejected.
      norm: ``"pre"`` (GPT-2: LayerNorm before each sub-layer, final LayerNorm) or ``"post"``
        (original Transformer / the seeds' ``DecoderLayer``: LayerNorm after each residual add).
      activation: MLP non-linearity: ``"gelu"`` (exact, erf), ``"gelu_tanh"`` (GPT-2's tanh
        approximation), ``"relu"``, or ``"silu"`` (a gated MLP's gate only: SwiGLU).
      bias: biases in every Linear and LayerNorm.
      tie_embeddings: the LM head reuses the token embedding matrix.
      causal: causal (autoregressive) attention mask; ``False`` attends to every position, like the
        seeds' ``nn.MultiheadAttention`` without a mask.
      layer_norm_eps: LayerNorm epsilon (PyTorch's default).
      init_std: standard deviation of the normal weight init (GPT-2's 0.02).
      attention: how the attention core (scores, softmax, context) runs. ``"naive"``: three ops
        that materialise the ``[B, H, S, S]`` scores and probabilities (tagged ``attn_scores``,
        ``attn_probs``). ``"fused"``: one op that never stores them: its backward recomputes the
        probabilities block by block from q, k, v, its output (``attn_context``) and the
        softmax's row log-sum-exp (``attn_lse``, ``[B, H, S]`` fp32) — FlashAttention's
        algorithm. JAX: ``jaxmem.model.flash`` (blockwise, custom VJP, any backend); PyTorch:
        ``F.scaled_dot_product_attention`` (its flash kernel on CPU).
      attention_block: keys per block of JAX's fused attention (a shorter sequence is one
        block); PyTorch's kernel picks its own blocking.
      norm_type: ``"layernorm"`` (GPT-2) or ``"rmsnorm"`` (Llama: scale only, no mean, no bias);
        ``layer_norm_eps`` is either's epsilon.
      positions: ``"learned"`` (a ``[max_seq_len, d_model]`` table added to the embeddings,
        GPT-2) or ``"rope"`` (rotary embeddings applied to queries and keys in every block,
        Su et al. 2021, in the rotate-half layout Hugging Face's Llama uses; no table, so
        ``max_seq_len`` only bounds the sequence).
      rope_theta: RoPE's base (10,000 in the paper; Llama 3: 500,000).
      rope_scaling: ``"none"``, or ``"llama3"``: Llama 3.1/3.2's frequency scaling of the long
        wavelengths (``rope_factor``, ``rope_low_freq_factor``, ``rope_high_freq_factor``,
        ``rope_original_max_len``: Hugging Face's ``rope_scaling`` fields).
      mlp: ``"standard"`` (``down(act(up(x)))``, GPT-2) or ``"gated"``
        (``down(act(gate(x)) * up(x))``: with ``activation="silu"`` SwiGLU, Llama's; d_ff is
        the width of gate and up).
      n_kv_heads: key/value heads (grouped-query attention, Ainslie et al. 2023: each serves
        ``n_heads / n_kv_heads`` query heads; 1 is multi-query attention); None: ``n_heads``.
      qkv_bias, out_bias, mlp_bias, norm_bias: biases of the q/k/v projections, the attention
        output projection, the MLP's matrices and the LayerNorms; None follows ``bias``
        (Qwen2: ``bias=False, qkv_bias=True``). RMSNorm has no bias.
    """

    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    max_seq_len: int
    norm: Norm = "pre"
    activation: Activation = "gelu"
    bias: bool = True
    tie_embeddings: bool = True
    causal: bool = True
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    attention: Attention = "naive"
    attention_block: int = 128
    norm_type: NormType = "layernorm"
    positions: Positions = "learned"
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    mlp: Mlp = "standard"
    n_kv_heads: int | None = None
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    mlp_bias: bool | None = None
    norm_bias: bool | None = None

    def __post_init__(self) -> None:
        names = ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len")
        for name in (*names, "attention_block"):
            _require_positive_int(name, getattr(self, name))
        require(
            self.d_model % self.n_heads == 0,
            f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
            f"pick n_heads from the divisors of {self.d_model}",
        )
        require(self.norm in NORMS, f"norm={self.norm!r} is not one of {NORMS}")
        require(
            self.activation in ACTIVATIONS,
            f"activation={self.activation!r} is not one of {ACTIVATIONS}",
        )
        require(
            self.attention in ATTENTIONS,
            f"attention={self.attention!r} is not one of {ATTENTIONS}",
        )
        for name in ("bias", "tie_embeddings", "causal"):
            value = getattr(self, name)
            require(isinstance(value, bool), f"{name}={value!r} must be True or False")
        require(
            isinstance(self.layer_norm_eps, float) and 0.0 < self.layer_norm_eps < 1.0,
            f"layer_norm_eps={self.layer_norm_eps!r} must be a float in (0, 1)",
        )
        require(
            isinstance(self.init_std, float) and self.init_std > 0.0,
            f"init_std={self.init_std!r} must be a positive float",
        )
        self._check_architecture()

    def _check_architecture(self) -> None:
        for name, valid in (
            ("norm_type", NORM_TYPES),
            ("positions", POSITIONS),
            ("rope_scaling", ROPE_SCALINGS),
            ("mlp", MLPS),
        ):
            value = getattr(self, name)
            require(value in valid, f"{name}={value!r} is not one of {valid}")
        if self.n_kv_heads is not None:
            _require_positive_int("n_kv_heads", self.n_kv_heads)
            require(
                self.n_heads % self.n_kv_heads == 0,
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}: each "
                "key/value head serves a whole group of query heads; pick a divisor of "
                f"{self.n_heads}",
            )
        for name in ("qkv_bias", "out_bias", "mlp_bias", "norm_bias"):
            value = getattr(self, name)
            require(
                value is None or isinstance(value, bool),
                f"{name}={value!r} must be true, false or unset (follows bias)",
            )
        require(
            not (self.norm_type == "rmsnorm" and self.norm_bias),
            "norm_bias=True: RMSNorm has no bias; use norm_type='layernorm' or drop norm_bias",
        )
        require(
            self.activation != "silu" or self.mlp == "gated",
            "activation='silu' is SwiGLU's gate: it needs mlp='gated' (a standard MLP takes "
            "gelu, gelu_tanh or relu)",
        )
        if self.positions == "rope":
            require(
                self.head_dim % 2 == 0,
                f"positions='rope' rotates pairs of a head's dimensions: head_dim={self.head_dim} "
                "(d_model / n_heads) must be even",
            )
        require(
            isinstance(self.rope_theta, float)
            and math.isfinite(self.rope_theta)
            and self.rope_theta > 1.0,
            f"rope_theta={self.rope_theta!r} must be a finite float above 1 (e.g. 10000.0)",
        )
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            value = getattr(self, name)
            require(
                isinstance(value, float) and math.isfinite(value) and value > 0.0,
                f"{name}={value!r} must be a positive, finite float",
            )
        _require_positive_int("rope_original_max_len", self.rope_original_max_len)
        require(
            self.rope_scaling == "none" or self.rope_low_freq_factor < self.rope_high_freq_factor,
            f"rope_low_freq_factor={self.rope_low_freq_factor} must be below "
            f"rope_high_freq_factor={self.rope_high_freq_factor}",
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``n_kv_heads``, or ``n_heads`` without grouping)."""
        return self.n_kv_heads or self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def learned_positions(self) -> bool:
        return self.positions == "learned"

    def has_bias(self, part: str) -> bool:
        """Whether ``part`` (``"qkv"``, ``"out"``, ``"mlp"``, ``"norm"``) has biases."""
        value = getattr(self, f"{part}_bias")
        if part == "norm" and self.norm_type == "rmsnorm":
            return False
        return self.bias if value is None else value

    @property
    def final_norm(self) -> bool:
        """Pre-norm stacks end with a LayerNorm (GPT-2's ``ln_f``); post-norm blocks already do."""
        return self.norm == "pre"

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with ``changes`` applied and validated again."""
        return dataclasses.replace(self, **changes)

    # Analytic parameter count, term by term (checked against the real arrays in tests).
    @property
    def block_params(self) -> int:
        d, f = self.d_model, self.d_ff
        qkv = d + 2 * self.kv_dim  # the fused in_proj's output: q, k, v
        attn = d * qkv + self.has_bias("qkv") * qkv + d * d + self.has_bias("out") * d
        mats = 3 if self.mlp == "gated" else 2  # (gate,) up, down
        mlp = mats * d * f + self.has_bias("mlp") * ((mats - 1) * f + d)
        norms = 2 * (d + self.has_bias("norm") * d)  # norm1, norm2: scale (+ bias)
        return attn + mlp + norms

    @property
    def n_params(self) -> int:
        d = self.d_model
        embed = self.vocab_size * d + (self.max_seq_len * d if self.learned_positions else 0)
        final = (d + self.has_bias("norm") * d) if self.final_norm else 0
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return embed + self.n_layers * self.block_params + final + head


def _gpt2(d_model: int, n_heads: int, n_layers: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=50257,
        d_model=d_model,
        n_heads=n_heads,
        n_layers=n_layers,
        d_ff=4 * d_model,
        max_seq_len=1024,
        norm="pre",
        activation="gelu_tanh",
        bias=True,
        tie_embeddings=True,
        causal=True,
    )


def _llama(
    d_model: int,
    n_heads: int,
    n_layers: int,
    d_ff: int,
    *,
    max_seq_len: int,
    tie: bool,
    scaled: bool,
    rope_factor: float = 32.0,
) -> ModelConfig:
    """A Llama 3 shape (Meta's published configs, as on the Hugging Face hub): RMSNorm, RoPE with
    theta 500,000 (Llama 3.1/3.2: with their frequency scaling, ``rope_factor`` 8 for 3.1 and 32
    for 3.2, low and high frequency factors 1 and 4 over the original 8,192 positions), SwiGLU,
    8 key/value heads, no biases, vocabulary 128,256."""
    return ModelConfig(
        vocab_size=128256,
        d_model=d_model,
        n_heads=n_heads,
        n_layers=n_layers,
        d_ff=d_ff,
        max_seq_len=max_seq_len,
        norm="pre",
        norm_type="rmsnorm",
        activation="silu",
        mlp="gated",
        positions="rope",
        rope_theta=500000.0,
        rope_scaling="llama3" if scaled else "none",
        rope_factor=rope_factor,
        n_kv_heads=8,
        bias=False,
        tie_embeddings=tie,
    )


BYTE_VOCAB = 259  # 256 byte values + BOS, EOS, PAD (see jaxmem.data)

PRESETS: dict[str, ModelConfig] = {
    # Unit and parity tests: compiles in about a second on CPU.
    "tiny": ModelConfig(
        vocab_size=BYTE_VOCAB, d_model=64, n_heads=4, n_layers=2, d_ff=256, max_seq_len=64
    ),
    # The CPU demo (`make demo`): about 3.3 M parameters.
    "small": ModelConfig(
        vocab_size=BYTE_VOCAB, d_model=256, n_heads=8, n_layers=4, d_ff=1024, max_seq_len=256
    ),
    # The seeds' example layer (shared/seeds/003): one post-norm ReLU DecoderLayer, d_model 512,
    # 8 heads, d_ff 2048, no causal mask. Used through the block stack (vocab is unused there).
    "seed": ModelConfig(
        vocab_size=BYTE_VOCAB,
        d_model=512,
        n_heads=8,
        n_layers=1,
        d_ff=2048,
        max_seq_len=64,
        norm="post",
        activation="relu",
        causal=False,
        tie_embeddings=False,
    ),
    # GPT-2 shapes (Radford et al. 2019), for memory planning; never given real weights in tests.
    "gpt2-124m": _gpt2(768, 12, 12),
    "gpt2-355m": _gpt2(1024, 16, 24),
    "gpt2-774m": _gpt2(1280, 20, 36),
    "gpt2-1.5b": _gpt2(1600, 25, 48),
    # GPT-3 6.7B's shape (Brown et al. 2020, table 2.1) with GPT-2's vocabulary: the 7B class,
    # for planning only.
    "gpt3-6.7b": dataclasses.replace(_gpt2(4096, 32, 32), max_seq_len=2048),
    # GPT-3 13B's shape (40 layers, 40 heads of 128; width 5120 as Megatron-LM and most
    # reproductions use it, the paper's table prints 5140): the model ZeRO-Offload trained on one
    # 32 GB V100. Planning only.
    "gpt3-13b": dataclasses.replace(_gpt2(5120, 40, 40), max_seq_len=2048),
    # A Llama-family block at test size: RMSNorm, RoPE, SwiGLU, grouped-query attention (2 key/
    # value heads for 4 query heads), no biases, untied head; the byte vocabulary.
    "tiny-llama": ModelConfig(
        vocab_size=BYTE_VOCAB,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        d_ff=160,
        max_seq_len=64,
        norm_type="rmsnorm",
        activation="silu",
        mlp="gated",
        positions="rope",
        bias=False,
        tie_embeddings=False,
    ),
    # Llama 3.2 1B and 3B (tied embeddings, RoPE scaled for 128K contexts), Llama 3 8B and 70B
    # (8K contexts), Llama 3.1 8B and 70B (Llama 3's shapes, RoPE scaled by 8 for 128K contexts):
    # their real shapes, for planning.
    "llama-3.2-1b": _llama(2048, 32, 16, 8192, max_seq_len=131072, tie=True, scaled=True),
    "llama-3.2-3b": _llama(3072, 24, 28, 8192, max_seq_len=131072, tie=True, scaled=True),
    "llama-3-8b": _llama(4096, 32, 32, 14336, max_seq_len=8192, tie=False, scaled=False),
    "llama-3-70b": _llama(8192, 64, 80, 28672, max_seq_len=8192, tie=False, scaled=False),
    "llama-3.1-8b": _llama(
        4096, 32, 32, 14336, max_seq_len=131072, tie=False, scaled=True, rope_factor=8.0
    ),
    "llama-3.1-70b": _llama(
        8192, 64, 80, 28672, max_seq_len=131072, tie=False, scaled=True, rope_factor=8.0
    ),
}

PLANNING_ONLY: frozenset[str] = frozenset(
    {
        "gpt2-124m",
        "gpt2-355m",
        "gpt2-774m",
        "gpt2-1.5b",
        "gpt3-6.7b",
        "gpt3-13b",
        "llama-3.2-1b",
        "llama-3.2-3b",
        "llama-3-8b",
        "llama-3-70b",
        "llama-3.1-8b",
        "llama-3.1-70b",
    }
)


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; an unknown name raises ``ConfigError`` listing the valid ones."""
    return lookup(PRESETS, name, "preset")


OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd", "adafactor")
MEMORY_KINDS: tuple[str, ...] = ("device", "pinned_host")


STREAM_OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd")  # elementwise: updated block by block
# where a streamed stack's optimizer update runs (None: the framework's own, JAX on the device
# block by block, torch_ref's FSDP2 on the CPU)
STREAM_UPDATES: tuple[str, ...] = ("device", "host")
# the learning rate over the steps, after the linear warmup: held, cosine or linear decay
SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Optimizer hyper-parameters, identical in meaning for optax and ``torch.optim``.

    - ``adamw``: decoupled weight decay (``torch.optim.AdamW`` semantics).
    - ``sgd``: SGD with (heavy-ball) momentum and L2 weight decay added to the gradient
      (``torch.optim.SGD`` semantics).
    - ``adafactor``: factored second moments (Shazeer & Stern 2018): optimizer state of
      O(rows + cols) per matrix instead of O(rows * cols). optax's and PyTorch's variants differ
      in their defaults, so adafactor is not part of the cross-framework parity tests.

    Weight decay applies only to matrices and embeddings (Linear kernels, ``wte``/``wpe``).
    ``state_memory="pinned_host"`` keeps the optimizer state in host memory between steps (it is
    brought to the device for the update); ``params_memory`` does the same for the parameters.
    ``stream`` keeps the block stack's fp32 parameters and their optimizer state in host memory
    and streams them through the step block by block: each block's parameters are brought to the
    device as the block runs, its gradient goes back as the backward makes it, and the update
    runs block by block (``jaxmem.step.stream``); the embeddings and head stay on the device.
    ``stream_update`` says where the stack's update runs: ``device`` (block by block, the
    parameters, gradient and state brought over and sent back) or ``host`` (in host memory,
    where they live: only the parameters and gradients cross the link, ZeRO-Offload's way);
    None: the framework's own (JAX: device; torch_ref: FSDP2's CPU offload steps on the host).

    The learning rate over the steps (``jaxmem.step.train_step.make_schedule``; torch_ref:
    ``torch_ref.train.make_schedulers``): ``warmup_steps`` of linear warmup from 0 to ``lr``,
    then ``schedule``: ``constant`` (held at ``lr``), ``cosine`` or ``linear`` decay from ``lr``
    to ``min_lr`` (an absolute rate, as optax's ``end_value`` and torch's ``eta_min``) at step
    ``decay_steps``, held there after. ``decay_steps`` is the schedule's whole length, warmup
    included (optax's ``warmup_cosine_decay_schedule`` counts it so); a job fills it with its
    ``run.steps`` when unset, and the run's config keeps it, so a resumed run continues the
    same schedule whatever ``--steps`` it is given. ``clip_norm``: the gradient is scaled down
    to this global L2 norm (over every parameter) before the update when it is larger
    (``optax.clip_by_global_norm``, ``torch.nn.utils.clip_grad_norm_``); None or 0: no
    clipping. Neither adds optimizer state beyond the schedule's step count.
    """

    name: str = "adamw"
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum: float = 0.9
    state_memory: str = "device"
    params_memory: str = "device"
    stream: bool = False
    stream_update: str | None = None
    schedule: str = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_lr: float = 0.0
    clip_norm: float | None = None

    def __post_init__(self) -> None:
        self._check_schedule()
        require(self.name in OPTIMIZERS, f"optimizer={self.name!r} is not one of {OPTIMIZERS}")
        require(
            self.stream_update is None or self.stream_update in STREAM_UPDATES,
            f"stream_update={self.stream_update!r} is not one of {STREAM_UPDATES}",
        )
        require(
            self.stream_update is None or self.stream,
            f"stream_update={self.stream_update!r} places a streamed stack's update: it goes "
            "with stream (--stream)",
        )
        require(
            isinstance(self.lr, float) and math.isfinite(self.lr) and self.lr > 0.0,
            f"lr={self.lr!r} must be a positive, finite float (e.g. 3e-4)",
        )
        for name in ("b1", "b2", "momentum"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"{name}={value!r} must be in [0, 1)")
        require(
            math.isfinite(self.eps) and self.eps > 0.0,
            f"eps={self.eps!r} must be positive and finite",
        )
        require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0.0,
            f"weight_decay={self.weight_decay!r} must be >= 0 and finite",
        )
        for name in ("state_memory", "params_memory"):
            value = getattr(self, name)
            require(value in MEMORY_KINDS, f"{name}={value!r} is not one of {MEMORY_KINDS}")
        require(isinstance(self.stream, bool), f"stream={self.stream!r} must be true or false")
        if self.stream:
            require(
                self.name in STREAM_OPTIMIZERS,
                f"optimizer {self.name!r} cannot stream: its update reads whole tensors "
                "(adafactor clips by a leaf's RMS), not block by block; use "
                f"{' or '.join(STREAM_OPTIMIZERS)}",
            )
            require(
                (self.state_memory, self.params_memory) == ("device", "device"),
                "stream keeps the stack's parameters and state in host memory itself and the "
                "rest on the device: leave state_memory and params_memory at 'device' (got "
                f"{self.state_memory!r}, {self.params_memory!r})",
            )
            require(
                not self.clips,
                f"clip_norm={self.clip_norm!r} with stream: a streamed step updates the stack "
                "block by block before the whole gradient's norm is known; drop --clip-norm "
                "or --stream",
            )

    def _check_schedule(self) -> None:
        require(
            self.schedule in SCHEDULES,
            f"schedule={self.schedule!r} is not one of {SCHEDULES}",
        )
        require(
            isinstance(self.warmup_steps, int)
            and not isinstance(self.warmup_steps, bool)
            and self.warmup_steps >= 0,
            f"warmup_steps={self.warmup_steps!r} must be a non-negative integer",
        )
        if self.decay_steps is not None:
            _require_positive_int("decay_steps", self.decay_steps)
        require(
            isinstance(self.min_lr, float) and math.isfinite(self.min_lr) and self.min_lr >= 0.0,
            f"min_lr={self.min_lr!r} must be a finite float >= 0 (the decay's floor)",
        )
        clip = self.clip_norm
        require(
            clip is None
            or (isinstance(clip, (int, float)) and not isinstance(clip, bool))
            and math.isfinite(clip)
            and clip >= 0.0,
            f"clip_norm={clip!r} must be a positive, finite number (unset or 0: no clipping)",
        )
        if self.schedule == "constant":
            for name, default in (("decay_steps", None), ("min_lr", 0.0)):
                value = getattr(self, name)
                require(
                    value == default,
                    f"{name}={value!r} belongs to a decaying schedule; schedule='constant' "
                    "never decays: use --schedule cosine or linear, or drop it",
                )
            return
        require(
            self.min_lr <= self.lr,
            f"min_lr={self.min_lr!r} is above lr={self.lr!r}: the decay ends at min_lr; use "
            f"at most {self.lr!r}",
        )
        require(
            self.decay_steps is None or self.decay_steps > self.warmup_steps,
            f"decay_steps={self.decay_steps} must exceed warmup_steps={self.warmup_steps}: it "
            "is the schedule's whole length, warmup included (unset: the run's --steps)",
        )

    @property
    def clips(self) -> bool:
        """The gradient is clipped to ``clip_norm`` (set and not 0)."""
        return bool(self.clip_norm)

    @property
    def scheduled(self) -> bool:
        """The learning rate changes over the steps (warmup or decay)."""
        return self.schedule != "constant" or self.warmup_steps > 0

    @property
    def lr_text(self) -> str:
        """The learning rate, its schedule and clipping in words (a run's first line)."""
        text = f"lr {self.lr}"
        if self.warmup_steps:
            text += f", warmup {self.warmup_steps}"
        if self.schedule != "constant":
            text += f", {self.schedule} to {self.min_lr} at step {self.decay_steps}"
        return text + (f", clip {self.clip_norm}" if self.clips else "")

    def lr_at(self, step: int) -> float:
        """The learning rate of update ``step`` (0: the first), in float64: the formula both
        frameworks' stock schedules compute (their own values are what a run logs)."""
        warm, lr = self.warmup_steps, self.lr
        if step < warm:
            return lr * step / warm
        if self.schedule == "constant":
            return lr
        assert self.decay_steps is not None, "a job sets decay_steps"
        frac = min(step - warm, self.decay_steps - warm) / (self.decay_steps - warm)
        if self.schedule == "cosine":
            return self.min_lr + (lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))
        return lr + (self.min_lr - lr) * frac


ACCUM_MODES: tuple[str, ...] = ("scan", "multisteps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AccumConfig:
    """Gradient accumulation over ``steps`` microbatches of one batch.

    - ``scan``: one jitted step scans the microbatches, sums loss sums, valid-token counts and
      gradients, and divides once. With ``inplace`` (the default) the block stack's gradient is
      added into the running sum block by block as the backward produces it, as PyTorch adds
      into ``.grad`` (``jaxmem.memory.remat.accumulating_layers_fn``), so no microbatch's
      stack gradient is held beside the sum; ``inplace=False`` adds each microbatch's whole
      gradient to the sum (the scan carry). Unrolled stacks always use the carry.
    - ``multisteps``: ``optax.MultiSteps`` (summing, ``use_grad_mean=False``) called once per
      microbatch; each microbatch's gradient is divided by the whole batch's valid-token count,
      so the sum is the big batch's mean gradient.
    """

    steps: int = 1
    mode: str = "scan"
    inplace: bool = True

    def __post_init__(self) -> None:
        _require_positive_int("accum steps", self.steps)
        require(self.mode in ACCUM_MODES, f"accum mode={self.mode!r} is not one of {ACCUM_MODES}")
        require(
            isinstance(self.inplace, bool),
            f"accum inplace={self.inplace!r} must be true or false",
        )

    def check_batch(self, batch_size: int) -> None:
        require(
            batch_size % self.steps == 0,
            f"batch size {batch_size} is not divisible by accum steps {self.steps}; "
            f"use a multiple of {self.steps}",
        )

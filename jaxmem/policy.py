"""Memory policies as pure data: what the backward pass keeps, recomputes or sends to host memory.

This module imports neither JAX nor PyTorch. It holds the vocabulary both frameworks share —
the tag names the model puts on its intermediates (``CHECKPOINT_NAMES``), the facts of which
tags a block's backward reads (``backward_reads``, ``kept_tags``) — and the policy objects
themselves. Each framework translates a policy in exactly one place: ``jaxmem.memory.remat``
(``jax.checkpoint`` policies under ``lax.scan``) and ``torch_ref.remat`` (stock
``torch.utils.checkpoint``, selective checkpointing, ``checkpoint_sequential``).

Presets (``POLICIES``):

- ``none``: plain autodiff, every residual kept in device memory.
- ``full``: recompute the whole block; only each block's input is kept.
- ``selective``: Megatron's choice (Korthikanti et al. 2022): recompute the attention core
  (scores, softmax, context; under fused attention the fused op, re-run in the backward), keep
  the projections (q/k/v, attention output, MLP up and down) so no projection is recomputed, and
  recompute the elementwise ops (norms, activation, residual additions), which cost no matmul
  FLOPs. The paper also keeps the elementwise outputs: more bytes at the same FLOPs and, measured,
  no faster a step (``benchmarks/results/megatron_set.md``), so that set is not a preset
  (``MemoryPolicy.custom`` writes it). Kept by name rather than with JAX's
  ``dots_with_no_batch_dims_saveable`` (a benchmark peer row, ``MemoryPolicy(save_dots=True)``):
  the projections accumulate in fp32, so the built-in keeps their fp32 results under bf16; the
  tags hold the compute-dtype values.
- ``mlp``: keep the attention side, recompute the MLP (fewer FLOPs than ``selective`` only when
  seq > 2·d_model, at O(seq²) bytes).
- ``offload``: ``selective`` with the projections it keeps sent to host memory (``pinned_host``)
  and the block input on the device: device memory close to ``full``'s at ``selective``'s FLOPs.
- ``nested``: about √L segments: checkpoint every ``nested_segment_size(L)`` blocks and fully
  recompute inside.
- ``HEAD:K+REST`` (``parse_policy``, e.g. ``none:2+selective``): the first K blocks under one
  preset, the others under another (``mixed_policy``; what ``jaxmem plan`` searches); a part may
  be a per-tag policy (``rest="custom"``), named ``keep(...)`` by what it keeps.
- ``replay_embedding``: with any policy that rematerialises the first block, that block keeps
  no input; its backward replays the embedding lookup.
- ``MemoryPolicy.custom({...})``: a per-name choice of ``device`` / ``offload`` / ``recompute``,
  like MaxText's per-tensor remat config.

Attention forms (``ModelConfig.attention``): the presets are written for both. Naive attention
produces ``attn_scores`` and ``attn_probs``; fused attention never builds them and produces
``attn_lse`` (its softmax statistics) instead. A custom policy naming a tag its model does not
produce is refused (``check_policy``) rather than silently keeping nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from jaxmem.config import ConfigError, ModelConfig, lookup, require

# The tags a memory policy can refer to, in the order a pre-norm block computes them. The model
# (jaxmem.model) applies every tag exactly once per block; tests check each appears in the
# traced program. Shapes: B batch, S sequence, D d_model, H heads, K head_dim, F d_ff.
CHECKPOINT_NAMES: tuple[str, ...] = (
    "block_input",  # [B, S, D] the residual stream entering the block
    "norm1_out",  # [B, S, D] output of norm1 (pre-norm: attention input; post-norm: MLP input)
    "query_proj",  # [B, S, H, K] queries from the fused in_proj ([B, S, Hkv, G, K] grouped)
    "key_proj",  # [B, S, Hkv, K] (Hkv = n_kv_heads: grouped-query attention; else H)
    "value_proj",  # [B, S, Hkv, K]
    "query_rope",  # [B, S, H, K] the queries rotated by RoPE (positions="rope" only)
    "key_rope",  # [B, S, Hkv, K] the keys rotated by RoPE (positions="rope" only)
    "attn_scores",  # [B, H, S, S] q·k / sqrt(K), masked, fp32 (naive attention only; grouped
    #                 query attention lays it out [B, Hkv, G, S, S], as it does query_*)
    "attn_probs",  # [B, H, S, S] softmax of the scores, fp32, then compute dtype (naive only)
    "attn_lse",  # [B, H, S] the softmax's row log-sum-exp, fp32 (fused attention only)
    "attn_context",  # [B, S, D] probabilities applied to values, heads merged
    "attn_out",  # [B, S, D] out_proj of the context
    "attn_residual",  # [B, S, D] block input + attention output (before norm1 in post-norm)
    "norm2_out",  # [B, S, D] output of norm2 (pre-norm: MLP input; post-norm: block output)
    "mlp_gate",  # [B, S, F] the gate projection of a gated MLP (mlp="gated" only)
    "mlp_up",  # [B, S, F] the up projection (ffn.0 in PyTorch's standard MLP)
    "mlp_act",  # [B, S, F] act(mlp_up), or act(mlp_gate) * mlp_up in a gated MLP
    "mlp_down",  # [B, S, D] the down projection (ffn.2 in PyTorch's standard MLP)
    "mlp_residual",  # [B, S, D] residual add after the MLP (before norm2 in post-norm)
)

Choice = Literal["device", "offload", "recompute"]
CHOICES: tuple[str, ...] = ("device", "offload", "recompute")
HOST_MEMORY_KIND = "pinned_host"

# Tags only some architectures produce (``ModelConfig``): naive attention builds the [B, H, S, S]
# scores and probabilities, the fused op keeps the row log-sum-exp in their place; RoPE adds the
# rotated queries and keys; a gated MLP adds the gate projection.
ONLY_IN = {"naive": ("attn_scores", "attn_probs"), "fused": ("attn_lse",)}
ROPE_TAGS = ("query_rope", "key_rope")
GATED_TAGS = ("mlp_gate",)
PROJECTIONS = ("query_proj", "key_proj", "value_proj", "attn_out", "mlp_gate", "mlp_up", "mlp_down")
MLP_SIDE = ("mlp_gate", "mlp_up", "mlp_act", "mlp_down", "mlp_residual")
QKV = ("query_proj", "key_proj", "value_proj")


def model_tags(cfg: ModelConfig) -> tuple[str, ...]:
    """The tags ``cfg``'s block produces, in ``CHECKPOINT_NAMES`` order: every tag but those of
    the other attention form, the rotated q/k without RoPE and the gate without a gated MLP."""
    absent = {n for form in ONLY_IN if form != cfg.attention for n in ONLY_IN[form]}
    if cfg.positions != "rope":
        absent |= set(ROPE_TAGS)
    if cfg.mlp != "gated":
        absent |= set(GATED_TAGS)
    return tuple(n for n in CHECKPOINT_NAMES if n not in absent)


def _check_names(field: str, names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in CHECKPOINT_NAMES]
    require(
        not unknown,
        f"{field} has unknown tag name(s) {unknown}; valid names: {', '.join(CHECKPOINT_NAMES)}",
    )
    dupes = sorted({n for n in names if names.count(n) > 1})
    require(not dupes, f"{field} lists {dupes} more than once")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSelection:
    """Which layers a policy applies to; the others run without remat (everything kept).

    Exactly one of: ``every=k`` (layers 0, k, 2k, ...: Megatron's "uniform"), ``first=n``
    (layers 0..n-1: Megatron's "block"), ``layers=(i, j, ...)``; or none of them for all layers.
    """

    every: int | None = None
    first: int | None = None
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("every", "first", "layers") if getattr(self, k) is not None]
        require(len(given) <= 1, f"layer selection takes one of every/first/layers, got {given}")
        for name in ("every", "first"):
            value = getattr(self, name)
            require(
                value is None or (isinstance(value, int) and value > 0),
                f"layers {name}={value!r} must be a positive integer",
            )
        if self.layers is not None:
            require(
                isinstance(self.layers, tuple) and bool(self.layers),
                f"layers={self.layers!r} must be a non-empty tuple of indices",
            )
            require(
                len(set(self.layers)) == len(self.layers),
                f"layers={self.layers!r} lists a layer more than once",
            )

    @property
    def is_all(self) -> bool:
        return self.every is None and self.first is None and self.layers is None

    def indices(self, n_layers: int) -> tuple[int, ...]:
        """Sorted layer indices for a stack of ``n_layers``; raises if any is out of range."""
        if self.every is not None:
            return tuple(range(0, n_layers, self.every))
        if self.first is not None:
            require(
                self.first <= n_layers, f"layers first={self.first} exceeds n_layers={n_layers}"
            )
            return tuple(range(self.first))
        if self.layers is not None:
            bad = [i for i in self.layers if not (isinstance(i, int) and 0 <= i < n_layers)]
            require(
                not bad,
                f"layer indices {bad} are out of range for n_layers={n_layers} "
                f"(valid: 0..{n_layers - 1})",
            )
            return tuple(sorted(self.layers))
        return tuple(range(n_layers))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPolicy:
    """What the backward pass of each selected block keeps, recomputes or offloads.

    Attributes:
      name: label used in reports.
      remat: False = plain autodiff (keep every residual); True = checkpoint the block and keep
        only what ``save`` / ``offload`` / ``save_dots`` name.
      save: tag names kept in device memory.
      offload: tag names moved to host memory (``pinned_host``) in the forward pass and brought
        back for the backward pass.
      save_dots: also keep matmul outputs without batch dimensions (the projections).
      nested: about √L segments of fully recomputed blocks (takes no names).
      layers: which layers the policy applies to.
      use_reentrant: PyTorch only: ``torch.utils.checkpoint``'s mode (chosen explicitly, never
        left to its default).
      unroll: JAX only: run the blocks as an unrolled loop instead of one ``lax.scan`` (MaxText's
        ``scan_layers=False``). A scan holds each residual as one stacked ``[L, ...]`` buffer
        until the whole backward has run, beside the stacked gradients; unrolled, XLA frees a
        block's residuals once its backward has run, as PyTorch's autograd does. It compiles
        slower, and XLA:CPU drops remat in an unrolled stack (a GPU compiler keeps it): see
        ``jaxmem.memory.remat``. A layer selection always runs unrolled. PyTorch always runs
        its blocks one by one, so torch_ref ignores it.
      rest: the preset the layers ``layers`` leaves out run under (``layers=first=k``: the first
        k blocks under this policy, the other L - k under ``rest``; ``jaxmem plan``'s mixed
        stacks), or ``"custom"``: they keep the tags ``rest_save`` on the device and send
        ``rest_offload`` to host memory (a per-tag policy, as ``custom``'s ``save``/``offload``).
        JAX runs the two parts as consecutive scans, with one gradient buffer for the whole
        stack. None: the left-out layers keep everything (no remat), the stack unrolled.
      replay_embedding: the first block does not keep its input: its backward replays the
        embedding lookup (a gather from the token ids: no matmul) to get it back, as
        AOTAutograd's min-cut partitioner does. Saves one ``[B, S, D]`` block input for no
        FLOP; needs the first block rematerialised (``jaxmem.memory.remat``'s first unit runs
        the lookup inside its checkpoint; torch_ref's first block checkpoints the lookup with
        the block).
      loss_chunks: 0 (default): the loss reads the whole ``[B, S, V]`` logits and its backward
        keeps them (fp32; at a 128k vocabulary the largest activation a step makes). N >= 1: the
        final norm, LM head and loss run over N sequence chunks, each chunk's gradients formed
        in the forward where its logits exist (Liger-Kernel's fused linear cross-entropy), so no
        logits are kept and one chunk's exist at a time, at no recomputed FLOP: the backward
        keeps the stack output's gradient and the head's instead (``jaxmem.model.loss
        .chunked_lm_loss``, ``torch_ref.loss.ChunkedLMLoss``). N must divide the sequence length.

    Why two switches that only one framework reads (``use_reentrant``, ``unroll``) live here
    rather than in each framework's translation: a run's ``[memory]`` section records the whole
    policy, and a resume refuses a config that changes it; both switches change what a step
    keeps (``unroll``: when JAX frees residuals; ``use_reentrant``: which tensors PyTorch's
    checkpoint saves and whether parameters get gradients through it), so they belong to the
    recorded policy. Each translation reads its own and ignores the other's
    (``jaxmem.memory.remat.layers_fn``, ``torch_ref.remat.apply_memory_policy``); the rest of
    the policy means the same in both frameworks.
    """

    name: str = "custom"
    remat: bool = True
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    save_dots: bool = False
    nested: bool = False
    layers: LayerSelection = LayerSelection()
    use_reentrant: bool = False
    unroll: bool = False
    rest: str | None = None
    rest_save: tuple[str, ...] = ()
    rest_offload: tuple[str, ...] = ()
    replay_embedding: bool = False
    loss_chunks: int = 0

    def __post_init__(self) -> None:
        for field in ("save", "offload"):
            value = getattr(self, field)
            require(isinstance(value, tuple), f"{field}={value!r} must be a tuple of tag names")
            _check_names(field, value)
        both = sorted(set(self.save) & set(self.offload))
        # jax.checkpoint_policies.save_and_offload_only_these_names silently keeps such a name
        # on device and never offloads it.
        require(not both, f"{both} are both saved and offloaded; choose one place for each name")
        require(
            self.remat or not (self.save or self.offload or self.save_dots or self.nested),
            "remat=False keeps everything: it takes no save/offload/save_dots/nested",
        )
        # save_from_both_policies (dots + names) raises on offloading policies.
        require(
            not (self.save_dots and self.offload),
            f"save_dots cannot be combined with offload={list(self.offload)}: name the "
            "projections to offload instead",
        )
        require(
            not (self.nested and (self.save or self.offload or self.save_dots)),
            "nested recomputes whole segments: it takes no save/offload names",
        )
        require(
            not (self.nested and not self.layers.is_all),
            "nested applies to the whole stack: it takes no layer selection",
        )
        require(
            isinstance(self.use_reentrant, bool),
            f"use_reentrant={self.use_reentrant!r} must be True or False",
        )
        require(isinstance(self.unroll, bool), f"unroll={self.unroll!r} must be True or False")
        require(
            isinstance(self.loss_chunks, int)
            and not isinstance(self.loss_chunks, bool)
            and self.loss_chunks >= 0,
            f"loss_chunks={self.loss_chunks!r} must be 0 (the whole logits, kept for the "
            "backward) or a number of sequence chunks >= 1",
        )
        require(
            self.rest == "custom" or not (self.rest_save or self.rest_offload),
            f"rest_save/rest_offload name the tags of a custom rest: set rest='custom' (not "
            f"{self.rest!r}) or drop them",
        )
        if self.rest is not None:
            presets = [n for n in POLICIES if n != "nested"]
            require(
                self.rest in presets or self.rest == "custom",
                f"rest={self.rest!r} must name a preset the other layers run under, one of "
                f"{', '.join(presets)} (nested applies to a whole stack), or 'custom' (with "
                "rest_save/rest_offload)",
            )
            for field in ("rest_save", "rest_offload"):
                value = getattr(self, field)
                require(isinstance(value, tuple), f"{field}={value!r} must be a tuple of tag names")
                _check_names(field, value)
            both = sorted(set(self.rest_save) & set(self.rest_offload))
            require(not both, f"{both} are both saved and offloaded in the rest; choose one place")
            require(
                self.layers.first is not None,
                f"rest={self.rest!r} needs layers first=k (the first k blocks under "
                f"{self.name!r}, the others under {self.rest!r}); got {self.layers}",
            )
            require(not self.nested, "nested applies to the whole stack: it takes no rest policy")
        require(
            not (self.nested and self.unroll),
            "nested runs its segments under scan (that is how it keeps √L block inputs): it "
            "takes no unroll",
        )
        require(
            isinstance(self.replay_embedding, bool),
            f"replay_embedding={self.replay_embedding!r} must be True or False",
        )
        if self.replay_embedding:
            require(
                can_replay_embedding(self),
                f"replay_embedding needs the first block rematerialised (policy {self.name!r} "
                "keeps its input anyway: no remat, nested or a layer selection without layer "
                "0); drop replay_embedding or choose such a policy",
            )

    @classmethod
    def custom(
        cls,
        choices: Mapping[str, Choice],
        *,
        layers: LayerSelection = LayerSelection(),
        name: str = "custom",
        use_reentrant: bool = False,
        unroll: bool = False,
    ) -> MemoryPolicy:
        """Per-name choices; names not mentioned are recomputed.

        ``MemoryPolicy.custom({"query_proj": "device", "mlp_up": "offload"})``
        """
        bad = {k: v for k, v in choices.items() if v not in CHOICES}
        require(not bad, f"choices {bad} must each be one of {CHOICES}")
        _check_names("choices", tuple(choices))
        return cls(
            name=name,
            save=tuple(n for n in CHECKPOINT_NAMES if choices.get(n) == "device"),
            offload=tuple(n for n in CHECKPOINT_NAMES if choices.get(n) == "offload"),
            layers=layers,
            use_reentrant=use_reentrant,
            unroll=unroll,
        )

    def replace(self, **changes: Any) -> MemoryPolicy:
        return dataclasses.replace(self, **changes)

    def choice(self, name: str) -> Choice:
        """Where tag ``name`` lives under this policy (for remat layers)."""
        if not self.remat or name in self.save:
            return "device"
        return "offload" if name in self.offload else "recompute"

    @property
    def is_named(self) -> bool:
        """Keeps chosen tensors by name (``save``/``offload``/``save_dots``)."""
        return bool(self.save or self.offload or self.save_dots)


POLICIES: dict[str, MemoryPolicy] = {
    "none": MemoryPolicy(name="none", remat=False),
    "full": MemoryPolicy(name="full"),
    "selective": MemoryPolicy(name="selective", save=PROJECTIONS),
    "mlp": MemoryPolicy(name="mlp", save=tuple(n for n in CHECKPOINT_NAMES if n not in MLP_SIDE)),
    "offload": MemoryPolicy(
        name="offload",
        save=("block_input",),
        offload=PROJECTIONS,
    ),
    "nested": MemoryPolicy(name="nested", nested=True),
}


def can_replay_embedding(policy: MemoryPolicy) -> bool:
    """The policy rematerialises the first block (so ``replay_embedding`` can apply): remat,
    not nested, block 0 among its layers."""
    first = policy.layers.layers is None or 0 in policy.layers.layers
    return policy.remat and not policy.nested and first


def rest_policy(policy: MemoryPolicy) -> MemoryPolicy | None:
    """The policy of the blocks ``policy.layers`` leaves out when ``rest`` is set: its preset,
    or the per-tag policy of ``rest_save``/``rest_offload``, in ``policy``'s checkpoint mode and
    stack form; None without ``rest``."""
    if policy.rest is None:
        return None
    modes = dict(use_reentrant=policy.use_reentrant, unroll=policy.unroll)
    if policy.rest == "custom":
        return MemoryPolicy(
            name=part_label(MemoryPolicy(save=policy.rest_save, offload=policy.rest_offload)),
            save=policy.rest_save,
            offload=policy.rest_offload,
            **modes,
        )
    return POLICIES[policy.rest].replace(**modes)


SHORT_TAGS = {"attn_probs": "probs", "attn_context": "context", "attn_lse": "lse"}


def preset_named(policy: MemoryPolicy) -> str | None:
    """The preset ``policy`` is whatever its name says (None: none is)."""
    return next((n for n, p in POLICIES.items() if p == policy.replace(name=n)), None)


def tags_text(tags: tuple[str, ...]) -> str:
    """Tag names in short words, ``+``-joined (q, k and v together as ``qkv``)."""
    out = list(tags)
    if all(n in out for n in QKV):
        out = ["qkv", *(n for n in out if n not in QKV)]
    return "+".join(SHORT_TAGS.get(n, n) for n in out)


def part_label(policy: MemoryPolicy) -> str:
    """A stack part in words: a preset's name, or a per-tag policy's ``keep(...)``
    (``tags_text``; ``host(...)`` for offloaded tags)."""
    preset = preset_named(_as_preset(policy.replace(name="custom")))
    if preset is not None:
        return preset
    host = f" host({tags_text(policy.offload)})" if policy.offload else ""
    return f"keep({tags_text(policy.save) or 'block_input'}){host}"


def is_preset(policy: MemoryPolicy) -> bool:
    """``policy`` is a preset of ``POLICIES`` (with any layer selection and checkpoint mode)."""
    preset = POLICIES.get(base_preset_name(policy))
    return preset is not None and _as_preset(policy) == preset


def base_preset_name(policy: MemoryPolicy) -> str:
    """The preset name of a mixed stack's first part (``full:3+none`` -> ``full``)."""
    return policy.name.split(":", 1)[0] if policy.rest is not None else policy.name


def _as_preset(policy: MemoryPolicy) -> MemoryPolicy:
    """``policy`` without the settings a preset may carry (layers, checkpoint mode, unroll,
    the other layers' preset)."""
    return policy.replace(
        name=base_preset_name(policy),
        layers=LayerSelection(),
        use_reentrant=False,
        unroll=False,
        rest=None,
        rest_save=(),
        rest_offload=(),
        replay_embedding=False,
        loss_chunks=0,
    )


def split_policy(policy: MemoryPolicy, n_layers: int) -> list[tuple[int, MemoryPolicy]]:
    """A policy with ``rest`` as consecutive parts ``[(n_blocks, policy), ...]`` covering the
    stack, each part's policy applying to all its blocks; one part for any other policy."""
    if policy.rest is None:
        return [(n_layers, policy)]
    k = len(policy.layers.indices(n_layers))
    head = policy.replace(
        name=base_preset_name(policy),
        layers=LayerSelection(),
        rest=None,
        rest_save=(),
        rest_offload=(),
        loss_chunks=0,
    )
    tail = rest_policy(policy)
    return [(n, p) for n, p in ((k, head), (n_layers - k, tail)) if n]


def mixed_policy(
    head: str | MemoryPolicy, k: int, rest: str | MemoryPolicy, *, unroll: bool = False
) -> MemoryPolicy:
    """The first ``k`` blocks under ``head``, the others under ``rest``, each a preset (by
    name) or a per-tag policy (``MemoryPolicy.custom``), named ``head:k+rest`` with
    ``part_label``'s words for a per-tag part."""
    first = POLICIES[head] if isinstance(head, str) else head
    for part in (first, rest):
        require(
            isinstance(part, str) or (part.layers.is_all and part.rest is None and not part.nested),
            f"a mixed stack's part is a preset or a per-tag policy over its blocks, not "
            f"{getattr(part, 'name', part)!r}",
        )
    if isinstance(rest, str):  # a preset, by name (MemoryPolicy names a bad one)
        label, fields = rest, {"rest": rest}
    else:
        label = part_label(rest)
        custom = label not in POLICIES
        fields = {
            "rest": "custom" if custom else label,
            "rest_save": rest.save if custom else (),
            "rest_offload": rest.offload if custom else (),
        }
    return first.replace(
        name=f"{part_label(first)}:{k}+{label}",
        layers=LayerSelection(first=k),
        unroll=unroll,
        **fields,
    )


def check_policy(cfg: ModelConfig, policy: MemoryPolicy) -> None:
    """Raise ``ConfigError`` when a custom policy names a tag ``cfg``'s block does not produce
    (``attn_scores``/``attn_probs`` under fused attention, ``attn_lse`` under naive): storing
    nothing where the user asked for something would be a silent no-op. Presets are written for
    both attention forms: under ``fused`` the attention core they recompute or keep is the fused
    op's output and log-sum-exp (e.g. ``selective`` re-runs the fused forward in the backward)."""
    if is_preset(policy):
        return
    tags = set(model_tags(cfg))
    for field in ("save", "offload"):
        absent = [n for n in getattr(policy, field) if n not in tags]
        if absent:
            raise ConfigError(
                f"policy {policy.name!r} {field}s {absent}, which this model does not produce "
                f"({'; '.join(_why_absent(cfg, absent))}); drop them or change the model"
            )


def _why_absent(cfg: ModelConfig, names: list[str]) -> list[str]:
    why = []
    if set(names) & {n for ns in ONLY_IN.values() for n in ns}:
        why.append(
            "fused attention keeps attn_context and attn_lse (the softmax's log-sum-exp) "
            "instead of the [B, H, S, S] scores and probabilities"
            if cfg.attention == "fused"
            else "attn_lse exists only with attention='fused'"
        )
    if set(names) & set(ROPE_TAGS):
        why.append("query_rope and key_rope exist only with positions='rope'")
    if set(names) & set(GATED_TAGS):
        why.append("mlp_gate exists only with mlp='gated'")
    return why


def get_policy(name: str) -> MemoryPolicy:
    """The preset called ``name``; an unknown name raises ``ConfigError`` listing the valid ones."""
    return lookup(POLICIES, name, "memory policy")


MIXED_NOTATION = "HEAD:K+REST"


def parse_policy(text: str) -> MemoryPolicy:
    """A policy as it is written on the command line, in config files and in ``jaxmem plan``'s
    output: a preset name (``selective``), or ``HEAD:K+REST`` (``none:2+selective``: the first
    K blocks under preset HEAD, the others under preset REST)."""
    head, colon, tail = text.partition(":")
    if not colon:
        return get_policy(text)
    k, plus, rest = tail.partition("+")
    require(
        bool(plus) and k.isdigit() and int(k) > 0,
        f"policy {text!r} is neither a preset nor {MIXED_NOTATION} (e.g. none:2+selective: the "
        "first 2 blocks under none, the rest under selective)",
    )
    for name in (head, rest):
        get_policy(name)  # an unknown preset is named with the valid ones
    return mixed_policy(head, int(k), rest)


def nested_segment_size(n_layers: int) -> int:
    """Blocks per segment, about √L (Chen et al. 2016, "Training Deep Nets with Sublinear
    Memory"): the divisor of L (other than 1 and L) nearest √L, the smaller on a tie, when its
    segments keep at most one block input more than ⌈√L⌉-block segments would; else ⌈√L⌉, with
    a shorter last segment.

    Equal segments matter in JAX: a shorter last segment slices the stacked parameters into a
    head and a tail, and the backward then concatenates their gradients into one more full-size
    gradient buffer (measured in the H100 plan of gpt2-1.5b, 48 layers, bf16 8 × 1024: temp
    17.11 GB with 7-block segments and a 6-block tail vs 10.38 GB with 6-block segments)."""
    ceil = math.ceil(math.sqrt(n_layers))
    cost = ceil + math.ceil(n_layers / ceil)  # inputs kept: segments + one segment's blocks
    divisors = [d for d in range(2, n_layers) if n_layers % d == 0]  # 1 and L: no nesting
    if not divisors:
        return ceil
    best = min(divisors, key=lambda d: (abs(d - math.sqrt(n_layers)), d))
    return best if best + n_layers // best <= cost + 1 else ceil


# ---------------------------------------------------------------------- files and command lines
LAYER_FIELDS = {"layers_every": "every", "layers_first": "first", "layers": "layers"}


def policy_to_dict(policy: MemoryPolicy) -> dict[str, Any]:
    """The ``[memory]`` section of a run config: a preset by name (with its layer selection and
    checkpoint mode), or ``policy = "custom"`` with the tag lists. ``policy_from_dict`` inverts
    it exactly."""
    layers = {key: getattr(policy.layers, attr) for key, attr in LAYER_FIELDS.items()}
    layers = {k: (list(v) if isinstance(v, tuple) else v) for k, v in layers.items()}
    modes = {"use_reentrant": policy.use_reentrant, "unroll": policy.unroll}
    if policy.rest is not None:
        modes["rest"] = policy.rest
    if policy.rest == "custom":
        modes["rest_save"] = list(policy.rest_save)
        modes["rest_offload"] = list(policy.rest_offload)
    if policy.replay_embedding:
        modes["replay_embedding"] = True
    if policy.loss_chunks:
        modes["loss_chunks"] = policy.loss_chunks
    if is_preset(policy):
        return {"policy": base_preset_name(policy), **layers, **modes}
    require(
        not (policy.save_dots or policy.nested) and policy.remat,
        f"policy {policy.name!r} (save_dots/nested/no remat, not a preset) cannot be written to a "
        "run config; use a preset or save/offload tag lists",
    )
    return {
        "policy": "custom",
        "save": list(policy.save),
        "offload": list(policy.offload),
        **layers,
        **modes,
    }


def policy_from_dict(section: Mapping[str, Any]) -> MemoryPolicy:
    """A ``MemoryPolicy`` from a ``[memory]`` section (see ``policy_to_dict``); bad names, a tag
    both saved and offloaded and bad layer selections raise ``ConfigError``."""
    known = {
        "policy",
        "save",
        "offload",
        "use_reentrant",
        "unroll",
        "rest",
        "rest_save",
        "rest_offload",
        "replay_embedding",
        "loss_chunks",
        *LAYER_FIELDS,
    }
    unknown = sorted(set(section) - known)
    require(not unknown, f"unknown setting(s) {unknown} in [memory]; valid: {', '.join(known)}")
    name = section.get("policy", "none")
    require(isinstance(name, str), f"memory policy={name!r} must be a name")
    save, offload = tuple(section.get("save") or ()), tuple(section.get("offload") or ())
    if name != "custom":
        require(
            not (save or offload),
            f"save/offload lists define a custom policy: set policy = 'custom' (not {name!r}) "
            "or drop them",
        )
    layers = {}
    for key, attr in LAYER_FIELDS.items():
        value = section.get(key)
        layers[attr] = tuple(value) if isinstance(value, list) else value
    selection = LayerSelection(**layers)
    modes = {
        "use_reentrant": section.get("use_reentrant", False),
        "unroll": section.get("unroll", False),
        "rest": section.get("rest"),
        "rest_save": tuple(section.get("rest_save") or ()),
        "rest_offload": tuple(section.get("rest_offload") or ()),
    }
    chunks = {
        "loss_chunks": section.get("loss_chunks", 0),
        "replay_embedding": section.get("replay_embedding", False),
    }
    if name == "custom":
        policy = MemoryPolicy(
            name="custom", save=save, offload=offload, layers=selection, **modes, **chunks
        )
        return policy.replace(name=mixed_name(policy)) if policy.rest is not None else policy
    if ":" in name:  # HEAD:K+REST, as the command line writes it
        require(
            selection.is_all and modes["rest"] is None,
            f"memory policy={name!r} already says which layers run under which preset: drop "
            "layers_every/layers_first/layers/rest",
        )
        mixed = parse_policy(name)
        return mixed.replace(use_reentrant=modes["use_reentrant"], unroll=modes["unroll"], **chunks)
    preset = get_policy(name).replace(layers=selection, **modes, **chunks)
    if preset.rest is not None:
        preset = preset.replace(name=mixed_name(preset))
    return preset


def mixed_name(policy: MemoryPolicy) -> str:
    """A mixed stack's name, ``HEAD:K+REST`` (``part_label``'s words for each part), from its
    fields (the name ``mixed_policy`` gives it)."""
    head = policy.replace(layers=LayerSelection(), rest=None, rest_save=(), rest_offload=())
    return f"{part_label(head)}:{policy.layers.first}+{part_label(rest_policy(policy))}"


# ------------------------------------------------------------------------- the block's backward
def backward_reads(cfg: ModelConfig) -> frozenset[str]:
    """The tags a block's backward reads (each op's minimal needs):

    - a norm (LayerNorm or RMSNorm) reads its input (pre-norm: block_input, attn_residual;
      post-norm: attn_residual, mlp_residual);
    - a Linear reads its input (in_proj: norm1_out or block_input; out_proj: attn_context;
      gate and up: norm2_out or norm1_out; down: mlp_act);
    - RoPE reads nothing (a rotation by constant angles): the attention core reads the rotated
      q and k (query_rope, key_rope) instead of the projections;
    - naive attention: q·k reads q and k; softmax reads its output (attn_probs); probs·v reads
      attn_probs and v; fused attention: its backward reads q, k, v, its output (attn_context)
      and the softmax's log-sum-exp (attn_lse);
    - GELU and SiLU read their input (mlp_up), ReLU its output (mlp_act, read by down anyway);
      a gated MLP's product act(gate) * up reads gate and up; additions read nothing.

    Tests check this against both frameworks independently: the tensors JAX keeps when a policy
    may keep every tag, and the op outputs PyTorch's autograd saves without checkpointing.
    """
    q, k = ("query_rope", "key_rope") if cfg.positions == "rope" else ("query_proj", "key_proj")
    common = {
        q,
        k,
        "value_proj",
        "attn_lse" if cfg.attention == "fused" else "attn_probs",
        "attn_context",
        "mlp_act",
        "attn_residual",
    }
    if cfg.mlp == "gated":
        common |= {"mlp_gate", "mlp_up"}
    elif cfg.activation != "relu":
        common.add("mlp_up")
    if cfg.norm == "pre":
        return frozenset(common | {"block_input", "norm1_out", "norm2_out"})
    return frozenset(common | {"block_input", "norm1_out", "mlp_residual"})


def recomputed_from(cfg: ModelConfig) -> dict[str, str]:
    """A tag the backward reads, when not stored, recomputed from one stored source without a
    matmul: the residual additions, the softmax, the activation, RoPE's rotations. JAX's partial
    evaluation keeps such a source instead of recomputing further back."""
    out = {"attn_residual": "attn_out", "mlp_residual": "mlp_down", "attn_probs": "attn_scores"}
    if cfg.mlp != "gated":  # a gated product's sources, gate and up, are read anyway
        out["mlp_act"] = "mlp_up"
    if cfg.positions == "rope":
        out |= {"query_rope": "query_proj", "key_rope": "key_proj"}
    return out


def kept_tags(cfg: ModelConfig, policy: MemoryPolicy) -> frozenset[str]:
    """The tags a rematerialised block keeps (in device or host memory) under ``policy`` when
    only what the backward needs is kept (JAX's partial evaluation; torch_ref's ``lean``
    extension): the stored tags its backward reads, plus stored sources of unstored tags it
    reads."""
    reads = backward_reads(cfg)
    stored = set(policy.save) | set(policy.offload)
    kept = stored & (reads | {"block_input"})
    for needed, source in recomputed_from(cfg).items():
        if needed in reads and needed not in stored and source in stored:
            kept.add(source)
    return frozenset(kept)


def describe_kept(cfg: ModelConfig, policy: MemoryPolicy) -> str:
    """One line for ``config.yaml`` and reports: what the JAX translation keeps and where."""
    loss = (
        f"; the LM head and loss in {policy.loss_chunks} chunks (no logits kept)"
        if policy.loss_chunks
        else ""
    )
    return _describe_blocks(cfg, policy) + loss


def _describe_blocks(cfg: ModelConfig, policy: MemoryPolicy) -> str:
    if not policy.remat:
        return "keeps every activation (no remat)"
    if policy.nested:
        return "keeps one block input per segment of about √L blocks and recomputes the rest"
    needed = kept_tags(cfg, policy) | {"block_input"}
    on_device = ["block_input"] + [n for n in policy.save if n in needed - {"block_input"}]
    on_host = [n for n in policy.offload if n in needed]
    return (
        f"keeps on device {on_device}, offloads {on_host or '-'}"
        f"{', and matmul outputs' if policy.save_dots else ''} (what the backward needs of what "
        "it stores); recomputes the rest"
    )

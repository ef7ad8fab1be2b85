"""Memory policies as pure data: what the backward pass keeps, recomputes or sends to host memory.

This module imports neither JAX nor PyTorch. It holds the vocabulary both frameworks share —
the tag names the model puts on its intermediates (``CHECKPOINT_NAMES``), the facts of which
tags a block's backward reads (``backward_reads``, ``kept_tags``) — and the policy objects
themselves: a ``MemoryPolicy`` is an ordered tuple of ``StackPart``s (a run of layers under a
``BlockPolicy``: a preset's, or per-tag ``save``/``offload`` names), the stack-wide form
(``nested``, ``unroll``, PyTorch's ``use_reentrant``), the loss (``LossPolicy``) and the
embedding's replay (``EmbeddingReplay``); each validates itself. Names (``[memory]`` sections,
``--policy`` strings) are read and written in ``jaxmem.policy_config``. Each framework
translates a policy in exactly one place: ``jaxmem.memory.remat`` (``jax.checkpoint``
policies under ``lax.scan``) and ``torch_ref.remat`` (stock ``torch.utils.checkpoint``,
selective checkpointing, ``checkpoint_sequential``).

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
  ``dots_with_no_batch_dims_saveable`` (a benchmark peer row, ``BlockPolicy(save_dots=True)``):
  the projections accumulate in fp32, so the built-in keeps their fp32 results under bf16; the
  tags hold the compute-dtype values.
- ``mlp``: keep the attention side, recompute the MLP (fewer FLOPs than ``selective`` only when
  seq > 2·d_model, at O(seq²) bytes).
- ``offload``: ``selective`` with the projections it keeps sent to host memory (``pinned_host``)
  and the block input on the device: device memory close to ``full``'s at ``selective``'s FLOPs.
- ``full-host``: ``full`` with each block's input in host memory (``pinned_host``), brought
  back for the block's recompute: no activation of the stack stays on the device between the
  forward and the backward, for 2 × the block inputs' bytes over the host link per step
  (``jaxmem.memory.analytic``'s ``input_host_bytes``). ``BlockPolicy(save=...,
  offload=("block_input",))`` does the same for a per-tag block (``selective``'s projections
  on the device, its input in host memory).
- ``nested``: about √L segments: checkpoint every ``nested_segment_size(L)`` blocks and fully
  recompute inside.
- ``nested-host``: ``nested`` with each segment's input in host memory: a segment's blocks'
  inputs, remade by its recompute, stay on the device only while its backward runs.
- ``HEAD:K+REST`` (``parse_policy``, e.g. ``none:2+selective``): the first K blocks under one
  preset, the others under another (``mixed_policy``: two ``StackPart``s; what ``jaxmem plan``
  searches); a part may be a per-tag block policy, named ``keep(...)`` by what it keeps.
- ``EmbeddingReplay(True)`` (``replay_embedding`` in a run config): with any policy that
  rematerialises the first block, that block keeps no input; its backward replays the
  embedding lookup.
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

# The tag on a quantized frozen base's dequantized weight (``jaxmem.model.quant``). Not a block
# activation, so not in CHECKPOINT_NAMES (each of those is tagged once per block of every model,
# sized by the analytic model and mapped to PyTorch ops): it exists only with an int8 or nf4
# base, and the quantized linear's own checkpoint decides it (``save_weight``; default: not kept,
# re-dequantized in the backward), whatever the block policy keeps around it.
BASE_WEIGHT = "base_weight"
WEIGHT_TAGS: tuple[str, ...] = (BASE_WEIGHT,)

Choice = Literal["device", "offload", "recompute"]
CHOICES: tuple[str, ...] = ("device", "offload", "recompute")
HOST_MEMORY_KIND = "pinned_host"
BLOCK_INPUT = "block_input"  # the tag of what a rematerialised block keeps at least

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


def check_names(field: str, names: tuple[str, ...]) -> None:
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
class BlockPolicy:
    """What the backward pass of one block keeps, recomputes or offloads.

    Attributes:
      remat: False = plain autodiff (keep every residual); True = checkpoint the block and keep
        only what ``save`` / ``offload`` / ``save_dots`` name (nothing named: ``full``).
      save: tag names kept in device memory.
      offload: tag names moved to host memory (``pinned_host``) in the forward pass and brought
        back for the backward pass.
      save_dots: also keep matmul outputs without batch dimensions (the projections).
    """

    remat: bool = True
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    save_dots: bool = False

    def __post_init__(self) -> None:
        for field in ("save", "offload"):
            value = getattr(self, field)
            require(isinstance(value, tuple), f"{field}={value!r} must be a tuple of tag names")
            check_names(field, value)
        both = sorted(set(self.save) & set(self.offload))
        # jax.checkpoint_policies.save_and_offload_only_these_names silently keeps such a name
        # on device and never offloads it.
        require(not both, f"{both} are both saved and offloaded; choose one place for each name")
        require(
            self.remat or not (self.save or self.offload or self.save_dots),
            "remat=False keeps everything: it takes no save/offload/save_dots/nested",
        )
        # save_from_both_policies (dots + names) raises on offloading policies.
        require(
            not (self.save_dots and self.offload),
            f"save_dots cannot be combined with offload={list(self.offload)}: name the "
            "projections to offload instead",
        )

    @classmethod
    def custom(cls, choices: Mapping[str, Choice]) -> BlockPolicy:
        """Per-name choices; names not mentioned are recomputed:
        ``BlockPolicy.custom({"query_proj": "device", "mlp_up": "offload"})``."""
        bad = {k: v for k, v in choices.items() if v not in CHOICES}
        require(not bad, f"choices {bad} must each be one of {CHOICES}")
        check_names("choices", tuple(choices))
        return cls(
            save=tuple(n for n in CHECKPOINT_NAMES if choices.get(n) == "device"),
            offload=tuple(n for n in CHECKPOINT_NAMES if choices.get(n) == "offload"),
        )

    def choice(self, name: str) -> Choice:
        """Where tag ``name`` lives under this block policy."""
        if not self.remat or name in self.save:
            return "device"
        return "offload" if name in self.offload else "recompute"

    @property
    def is_named(self) -> bool:
        """Keeps chosen tensors by name (``save``/``offload``/``save_dots``)."""
        return bool(self.save or self.offload or self.save_dots)

    @property
    def label(self) -> str:
        """The block policy in words: a preset's name, or a per-tag policy's ``keep(...)``
        (``tags_text``; ``host(...)`` for offloaded tags)."""
        preset = next((n for n, b in BLOCKS.items() if b == self), None)
        if preset is not None:
            return preset
        host = f" host({tags_text(self.offload)})" if self.offload else ""
        return f"keep({tags_text(self.save) or 'block_input'}){host}"


# The block policies of the presets (``nested`` is a stack form over ``full`` blocks).
BLOCKS: dict[str, BlockPolicy] = {
    "none": BlockPolicy(remat=False),
    "full": BlockPolicy(),
    "selective": BlockPolicy(save=PROJECTIONS),
    "mlp": BlockPolicy(save=tuple(n for n in CHECKPOINT_NAMES if n not in MLP_SIDE)),
    "offload": BlockPolicy(save=("block_input",), offload=PROJECTIONS),
    "full-host": BlockPolicy(offload=(BLOCK_INPUT,)),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackPart:
    """A part of the block stack under one block policy.

    ``layers``: in a stack of several parts, ``first=k`` takes the next k blocks and the last
    part (no selection) every block the others left. A one-part stack may select its layers
    (``every=k``, ``first=n``, ``layers=(...)``): the layers it leaves out run without remat
    (everything kept) and the stack runs unrolled.
    """

    layers: LayerSelection = LayerSelection()
    block: BlockPolicy = BlockPolicy()


@dataclasses.dataclass(frozen=True)
class LossPolicy:
    """How the LM head and loss run. ``chunks`` 0 (default): the loss reads the whole
    ``[B, S, V]`` logits and its backward keeps them (fp32; at a 128k vocabulary the largest
    activation a step makes). N >= 1: the final norm, LM head and loss run over N sequence
    chunks, each chunk's gradients formed in the forward where its logits exist (Liger-Kernel's
    fused linear cross-entropy), so no logits are kept and one chunk's exist at a time, at no
    recomputed FLOP: the backward keeps the stack output's gradient and the head's instead
    (``jaxmem.model.loss.chunked_lm_loss``, ``torch_ref.loss.ChunkedLMLoss``). N must divide
    the sequence length (``jaxmem.job.check_loss_chunks``). ``tile_tokens`` T says the same by
    token count, whatever the sequence length: chunks of T tokens (``S / T`` chunks,
    ``chunks_for``); T must divide the sequence length. At most one of the two is set."""

    chunks: int = 0
    tile_tokens: int = 0

    def __post_init__(self) -> None:
        require(
            isinstance(self.chunks, int) and not isinstance(self.chunks, bool) and self.chunks >= 0,
            f"loss_chunks={self.chunks!r} must be 0 (the whole logits, kept for the "
            "backward) or a number of sequence chunks >= 1",
        )
        require(
            _count(self.tile_tokens),
            f"loss_tile_tokens={self.tile_tokens!r} must be 0 (untiled) or a number of tokens "
            "per chunk >= 1",
        )
        require(
            not (self.chunks and self.tile_tokens),
            f"loss_chunks={self.chunks} and loss_tile_tokens={self.tile_tokens} both size the "
            "loss's chunks: set one",
        )

    def chunks_for(self, seq_len: int) -> int:
        """The number of sequence chunks for sequences of ``seq_len`` tokens (0: untiled)."""
        return seq_len // self.tile_tokens if self.tile_tokens else self.chunks

    @property
    def brief(self) -> str:
        """The loss's chunking in a few words ('loss in 4 chunks'; '' untiled)."""
        if self.tile_tokens:
            return f"loss in tiles of {self.tile_tokens} tokens"
        return f"loss in {self.chunks} chunks" if self.chunks else ""

    @property
    def label(self) -> str:
        """The loss's chunking in words ('' untiled)."""
        return f"the LM head and {self.brief}" if self.brief else ""


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclasses.dataclass(frozen=True)
class EmbeddingReplay:
    """``replay``: the first block does not keep its input: its backward replays the embedding
    lookup (a gather from the token ids: no matmul) to get it back, as AOTAutograd's min-cut
    partitioner does. Saves one ``[B, S, D]`` block input for no FLOP; needs the first block
    rematerialised (``can_replay_embedding``; ``jaxmem.memory.remat``'s first unit runs the
    lookup inside its checkpoint; torch_ref's first block checkpoints the lookup with the
    block)."""

    replay: bool = False

    def __post_init__(self) -> None:
        require(
            isinstance(self.replay, bool),
            f"replay_embedding={self.replay!r} must be True or False",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPolicy:
    """What a step keeps for its backward pass: the block stack's parts, the loss, the
    embedding's replay, and two stack-wide switches.

    Attributes:
      name: label used in reports.
      parts: the stack's parts in order, each a run of layers under a block policy
        (``StackPart``). One part over every layer: one policy for the whole stack. Several:
        ``jaxmem plan``'s mixed stacks (``mixed_policy``), which JAX runs as consecutive scans
        with one gradient buffer for the whole stack. One part selecting layers: the others
        keep everything, the stack unrolled.
      nested: about √L segments of fully recomputed blocks over the whole stack (one part of
        ``full`` blocks, scanned).
      use_reentrant: PyTorch only: ``torch.utils.checkpoint``'s mode (chosen explicitly, never
        left to its default).
      unroll: JAX only: run the blocks as an unrolled loop instead of one ``lax.scan`` (MaxText's
        ``scan_layers=False``). A scan holds each residual as one stacked ``[L, ...]`` buffer
        until the whole backward has run, beside the stacked gradients; unrolled, XLA frees a
        block's residuals once its backward has run, as PyTorch's autograd does. It compiles
        slower, and XLA:CPU drops remat in an unrolled stack (a GPU compiler keeps it): see
        ``jaxmem.memory.remat``. A layer selection always runs unrolled. PyTorch always runs
        its blocks one by one, so torch_ref ignores it.
      loss: the LM head and loss (``LossPolicy``).
      embedding: the embedding lookup's replay (``EmbeddingReplay``).
      mlp_tile_tokens: 0 (default): each block's MLP runs over the whole sequence. T: it runs
        over sequence tiles of T tokens of each row (T divides the sequence length), each tile
        in a checkpoint of its own under the block's policy, so one tile's ``[B, T, d_ff]``
        intermediates exist at a time in the forward and in the block's recompute and backward
        (ALST's TiledMLP), at the same FLOPs (``jaxmem.memory.remat``, ``torch_ref.remat``).

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
    parts: tuple[StackPart, ...] = (StackPart(),)
    nested: bool = False
    use_reentrant: bool = False
    unroll: bool = False
    loss: LossPolicy = LossPolicy()
    embedding: EmbeddingReplay = EmbeddingReplay()
    mlp_tile_tokens: int = 0

    def __post_init__(self) -> None:
        require(
            _count(self.mlp_tile_tokens),
            f"mlp_tile_tokens={self.mlp_tile_tokens!r} must be 0 (the MLP over the whole "
            "sequence) or a number of tokens per tile >= 1",
        )
        require(
            isinstance(self.parts, tuple)
            and bool(self.parts)
            and all(isinstance(p, StackPart) for p in self.parts),
            f"parts={self.parts!r} must be a non-empty tuple of StackPart",
        )
        require(
            isinstance(self.use_reentrant, bool),
            f"use_reentrant={self.use_reentrant!r} must be True or False",
        )
        require(isinstance(self.unroll, bool), f"unroll={self.unroll!r} must be True or False")
        if len(self.parts) > 1:
            rest = self.parts[-1]
            for part in self.parts[:-1]:
                require(
                    part.layers.first is not None,
                    f"rest={rest.block.label!r} needs layers first=k (the first k blocks under "
                    f"{self.name!r}, the others under {rest.block.label!r}); got {part.layers}",
                )
            require(
                rest.layers.is_all,
                f"a stack's last part takes the blocks the others leave: it takes no layer "
                f"selection, got {rest.layers}",
            )
        if self.nested:
            self._check_nested()
        if self.embedding.replay:
            require(
                can_replay_embedding(self),
                f"replay_embedding needs the first block rematerialised (policy {self.name!r} "
                "keeps its input anyway: no remat, nested or a layer selection without layer "
                "0); drop replay_embedding or choose such a policy",
            )

    def _check_nested(self) -> None:
        block = self.head
        require(
            block.remat,
            "remat=False keeps everything: it takes no save/offload/save_dots/nested",
        )
        require(
            not block.is_named or block == BLOCKS["full-host"],
            "nested recomputes whole segments: it takes no save/offload names (but "
            "offload=('block_input',): its segments' inputs in host memory, nested-host)",
        )
        require(len(self.parts) == 1, "nested applies to the whole stack: it takes no rest policy")
        require(
            self.parts[0].layers.is_all,
            "nested applies to the whole stack: it takes no layer selection",
        )
        require(
            not self.unroll,
            "nested runs its segments under scan (that is how it keeps √L block inputs): it "
            "takes no unroll",
        )

    @classmethod
    def of(
        cls, block: BlockPolicy, *, layers: LayerSelection = LayerSelection(), **fields: Any
    ) -> MemoryPolicy:
        """One block policy over the layers ``layers`` selects (all by default)."""
        return cls(parts=(StackPart(layers=layers, block=block),), **fields)

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
        """Per-name choices (``BlockPolicy.custom``) over the selected layers; names not
        mentioned are recomputed.

        ``MemoryPolicy.custom({"query_proj": "device", "mlp_up": "offload"})``
        """
        return cls.of(
            BlockPolicy.custom(choices),
            layers=layers,
            name=name,
            use_reentrant=use_reentrant,
            unroll=unroll,
        )

    def replace(self, **changes: Any) -> MemoryPolicy:
        return dataclasses.replace(self, **changes)

    @property
    def head(self) -> BlockPolicy:
        """The first part's block policy (the only one's, in a one-part stack)."""
        return self.parts[0].block

    @property
    def blocks(self) -> tuple[BlockPolicy, ...]:
        """Each part's block policy, in order."""
        return tuple(p.block for p in self.parts)

    @property
    def selects(self) -> bool:
        """The parts leave layers out (one part with a layer selection): those keep everything
        and the stack runs unrolled."""
        return not self.parts[-1].layers.is_all

    def layer_blocks(self, n_layers: int) -> tuple[BlockPolicy, ...]:
        """Each layer's block policy in a stack of ``n_layers`` (layers the parts leave out:
        ``none``'s, keeping everything); raises if a selection does not fit the stack."""
        if len(self.parts) == 1:
            chosen = set(self.parts[0].layers.indices(n_layers))
            return tuple(self.head if i in chosen else BLOCKS["none"] for i in range(n_layers))
        out: list[BlockPolicy] = []
        for part in self.parts[:-1]:
            require(
                len(out) + part.layers.first <= n_layers,
                f"layers first={len(out) + part.layers.first} exceeds n_layers={n_layers}",
            )
            out += [part.block] * part.layers.first
        return tuple(out + [self.parts[-1].block] * (n_layers - len(out)))

    def runs(self, n_layers: int) -> list[tuple[int, BlockPolicy]]:
        """The stack as consecutive runs ``[(n_blocks, block policy), ...]`` covering its
        ``n_layers``: one per part of a several-part stack (empty parts dropped); a one-part
        stack's layers grouped by equal block policy (a selection's chosen and left-out
        layers)."""
        out: list[tuple[int, BlockPolicy]] = []
        if len(self.parts) > 1:
            for part in self.parts[:-1]:
                out.append((part.layers.first, part.block))
            out.append((n_layers - sum(n for n, _ in out), self.parts[-1].block))
            self.layer_blocks(n_layers)  # the runs fit the stack
            return [(n, b) for n, b in out if n]
        for block in self.layer_blocks(n_layers):
            if out and out[-1][1] == block:
                out[-1] = (out[-1][0] + 1, block)
            else:
                out.append((1, block))
        return out

    @property
    def offloads(self) -> tuple[str, ...]:
        """The tags any part sends to host memory, once each."""
        return tuple(dict.fromkeys(n for b in self.blocks for n in b.offload))


def can_replay_embedding(policy: MemoryPolicy) -> bool:
    """The policy rematerialises the first block (so ``replay_embedding`` can apply): remat,
    not nested, block 0 among its first part's layers."""
    layers = policy.parts[0].layers
    first = layers.layers is None or 0 in layers.layers
    return policy.head.remat and not policy.nested and first


POLICIES: dict[str, MemoryPolicy] = {
    **{name: MemoryPolicy.of(block, name=name) for name, block in BLOCKS.items()},
    "nested": MemoryPolicy(name="nested", nested=True),
    "nested-host": MemoryPolicy.of(BLOCKS["full-host"], name="nested-host", nested=True),
}


def get_policy(name: str) -> MemoryPolicy:
    """The preset called ``name``; an unknown name raises ``ConfigError`` listing the valid ones."""
    return lookup(POLICIES, name, "memory policy")


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


def is_preset(policy: MemoryPolicy) -> bool:
    """``policy``'s first part is the preset its name (its head's, ``full`` in ``full:3+none``)
    says, with any layer selection, checkpoint mode, other parts, loss and replay."""
    preset = POLICIES.get(base_preset_name(policy))
    return preset is not None and (preset.head, preset.nested) == (policy.head, policy.nested)


def base_preset_name(policy: MemoryPolicy) -> str:
    """The preset name of a mixed stack's first part (``full:3+none`` -> ``full``)."""
    return policy.name.split(":", 1)[0] if len(policy.parts) > 1 else policy.name


def rest_block(name: str) -> BlockPolicy:
    """The block policy of preset ``name`` for a stack's other part (``nested`` is none)."""
    presets = list(BLOCKS)
    require(
        name in BLOCKS,
        f"rest={name!r} must name a preset the other layers run under, one of "
        f"{', '.join(presets)} (nested applies to a whole stack), or 'custom' (with "
        "rest_save/rest_offload)",
    )
    return BLOCKS[name]


def mixed_policy(
    head: str | MemoryPolicy, k: int, rest: str | MemoryPolicy, *, unroll: bool = False
) -> MemoryPolicy:
    """The first ``k`` blocks under ``head``, the others under ``rest``, each a preset (by
    name) or a one-part policy (``MemoryPolicy.custom``), named ``head:k+rest`` with
    ``BlockPolicy.label``'s words for each part."""
    first = POLICIES[head] if isinstance(head, str) else head
    for part in (first, rest):
        require(
            isinstance(part, str)
            or (len(part.parts) == 1 and not part.selects and not part.nested),
            f"a mixed stack's part is a preset or a per-tag policy over its blocks, not "
            f"{getattr(part, 'name', part)!r}",
        )
    tail = rest_block(rest) if isinstance(rest, str) else rest.head
    parts = (StackPart(layers=LayerSelection(first=k), block=first.head), StackPart(block=tail))
    return first.replace(name=mixed_name(parts), parts=parts, unroll=unroll)


def mixed_name(parts: tuple[StackPart, ...]) -> str:
    """A two-part stack's name, ``HEAD:K+REST`` (``BlockPolicy.label``'s words for each)."""
    head, rest = parts
    return f"{head.block.label}:{head.layers.first}+{rest.block.label}"


FIELDS = ("save", "offload")


def check_policy(cfg: ModelConfig, policy: MemoryPolicy) -> None:
    """Raise ``ConfigError`` when a custom policy names a tag ``cfg``'s block does not produce
    (``attn_scores``/``attn_probs`` under fused attention, ``attn_lse`` under naive): storing
    nothing where the user asked for something would be a silent no-op. Presets are written for
    both attention forms: under ``fused`` the attention core they recompute or keep is the fused
    op's output and log-sum-exp (e.g. ``selective`` re-runs the fused forward in the backward)."""
    tags = set(model_tags(cfg))
    blocks = policy.blocks[1:] if is_preset(policy) else policy.blocks
    for block, field in ((b, f) for b in blocks if b not in BLOCKS.values() for f in FIELDS):
        absent = [n for n in getattr(block, field) if n not in tags]
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


def kept_tags(cfg: ModelConfig, block: BlockPolicy) -> frozenset[str]:
    """The tags a rematerialised block keeps (in device or host memory) under ``block`` when
    only what the backward needs is kept (JAX's partial evaluation; torch_ref's ``lean``
    extension): the stored tags its backward reads, plus stored sources of unstored tags it
    reads."""
    reads = backward_reads(cfg)
    stored = set(block.save) | set(block.offload)
    kept = stored & (reads | {"block_input"})
    for needed, source in recomputed_from(cfg).items():
        if needed in reads and needed not in stored and source in stored:
            kept.add(source)
    return frozenset(kept)


def policy_label(policy: MemoryPolicy) -> str:
    """The policy's name, with its tags where the name does not say them (a per-tag policy:
    ``custom keep(qkv+mlp_up) host(attn_out)``, ``BlockPolicy.label``'s words)."""
    if len(policy.parts) > 1 or policy.nested or not policy.head.remat or is_preset(policy):
        return policy.name  # a preset's name, or a mix named by its parts' labels
    return f"{policy.name} {policy.head.label}"


def describe_kept(cfg: ModelConfig, policy: MemoryPolicy) -> str:
    """One line for ``config.yaml`` and reports: what the JAX translation keeps and where (in
    the first part's blocks)."""
    loss = f"; {policy.loss.label} (no logits kept)" if policy.loss.label else ""
    tiles = policy.mlp_tile_tokens
    mlp = f"; the MLP in sequence tiles of {tiles} tokens" if tiles else ""
    return _describe_blocks(cfg, policy) + mlp + loss


def _describe_blocks(cfg: ModelConfig, policy: MemoryPolicy) -> str:
    block = policy.head
    if not block.remat:
        return "keeps every activation (no remat)"
    if policy.nested:
        host = " in host memory" if BLOCK_INPUT in block.offload else ""
        return f"keeps one block input per segment of about √L blocks{host} and recomputes the rest"
    needed = kept_tags(cfg, block) | {BLOCK_INPUT}
    stored = dict.fromkeys((BLOCK_INPUT, *block.save))
    on_device = [n for n in stored if n in needed and n not in block.offload]
    on_host = [n for n in block.offload if n in needed]
    return (
        f"keeps on device {on_device}, offloads {on_host or '-'}"
        f"{', and matmul outputs' if block.save_dots else ''} (what the backward needs of what "
        "it stores); recomputes the rest"
    )

"""jaxmem's ``MemoryPolicy`` in PyTorch (the JAX translation is ``jaxmem.memory.remat``).

``apply_memory_policy(stack, policy, translation=...)`` sets the block stack's ``layers_fn``; the
model and its state dict do not change. Two translations, reported side by side:

**stock** (the default): the PyTorch a PyTorch user writes, and nothing else.

- ``none``: the plain loop.
- ``full``: ``torch.utils.checkpoint.checkpoint`` per selected block, ``use_reentrant`` taken
  from the policy (both modes work; never left to PyTorch's default).
- ``nested``: ``torch.utils.checkpoint.checkpoint_sequential`` over ⌈L / k⌉ segments (k =
  ``nested_segment_size(L)``, about √L). Stock
  runs its *last* segment without checkpointing, so it keeps that segment's activations.
- names (``selective``, ``mlp``, ``dots``, custom): non-reentrant checkpoint with
  ``create_selective_checkpoint_contexts``; the policy function answers ``MUST_SAVE`` for the ops
  whose output the policy stores (by tag) and ``PREFER_RECOMPUTE`` for the rest
  (``save_dots``: ``MUST_SAVE`` for every ``mm``/``addmm``). Selective checkpointing caches every
  output it is told to save, read by the backward or not.
- the block input offloaded (``full-host``, ``nested-host``'s segments, a per-tag block naming
  ``block_input``): the checkpoint inside ``torch.autograd.graph.save_on_cpu``, which sees the
  checkpoint's saved input and nothing else (``_offloading_input``).
- other offloaded names: stock PyTorch has no API for them. ``CheckpointPolicy.MUST_CPU_OFFLOAD``
  exists but is honoured only under ``torch.compile``; in eager mode it recomputes. Such policies
  use the ``lean`` extension below, and say so (``PolicyLayers.translation``).

**lean** (torch_ref's extension, beyond stock): two small dispatch modes keep only what the
backward reads of what the policy stores (``jaxmem.policy.kept_tags``, what JAX's partial
evaluation keeps, at the granularity of an op's output: ``op_kept_tags``), send offloaded names
to host memory, and skip replaying a matmul whose product nothing the backward uses reads
(out_proj / mlp_down when their residual add is kept, a ReLU MLP's first matmul when the
activation is kept, naive attention's q·kᵀ when the scores or probabilities are kept: stock
replays it, ``mlp``'s one FLOP difference from JAX);
``nested`` checkpoints every segment (the last included) and every block inside it again, as
JAX's two-level scan does.

PyTorch ops carry no names, so ``block_ops`` maps each tag of ``jaxmem.policy.CHECKPOINT_NAMES``
to the op that produces it in ``torch_ref.model.Block`` (by op kind and occurrence within a
block, counted from the block's op sequence: LayerNorm or RMSNorm, RoPE, the standard or gated
MLP); a test records the real op stream and checks every entry's shape against the JAX tag.
Tags a model does not produce name no op, so the presets that list them (``mlp`` keeps RoPE's
rotated q and k, ``selective`` the gate) ignore them; a custom policy naming one is refused
(``jaxmem.policy.check_policy``).

A policy's ``mlp_tile_tokens`` runs each block's MLP over sequence tiles (``TiledMLP``: stock
``torch.utils.checkpoint`` per tile, set as the ``ffn`` module's forward; the model's math and
state dict unchanged).

PyTorch users' own offload helpers (``save_on_cpu_layers_fn``, ``OffloadCheckpoint``) are in
``torch_ref.offload``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
)

from jaxmem.config import ConfigError, ModelConfig
from jaxmem.policy import (
    BLOCK_INPUT,
    CHECKPOINT_NAMES,
    QKV,
    BlockPolicy,
    MemoryPolicy,
    backward_reads,
    check_policy,
    kept_tags,
    nested_segment_size,
)
from torch_ref.compat import selective_checkpoint_contexts
from torch_ref.context import inside_ring
from torch_ref.model import BlockStack, EmbeddingLookup, RopeTables, materialize, run_layers

Translation = Literal["stock", "lean"]
TRANSLATIONS: tuple[str, ...] = ("stock", "lean")
LINEAR_OPS = ("addmm", "mm")  # nn.Linear with / without bias
# F.scaled_dot_product_attention's fused kernels (which one runs depends on device and inputs)
SDPA_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
# The CUDA kernel torch.rms_norm may dispatch to instead of its composite (see _op_kind).
FUSED_RMS_NORM = "_fused_rms_norm"


def _op_kind(func: Any) -> str:
    name = func.overloadpacket.__name__
    if name in LINEAR_OPS:
        return "linear"
    if name == FUSED_RMS_NORM:
        raise NotImplementedError(
            "torch.rms_norm ran its fused kernel (aten._fused_rms_norm, a CUDA path): "
            "torch_ref's op table names the ops of its composite form (this CPU build's); "
            "measure RMSNorm models' torch rows on CPU"
        )
    return "sdpa" if name in SDPA_OPS else name


OpSeq = list[tuple[str, tuple[str, ...]]]  # (op kind, tag names) in the order a block runs them


def _norm_ops(cfg: ModelConfig, tag: str) -> OpSeq:
    """LayerNorm is one op; ``torch.rms_norm`` on CPU is a composite whose second product (the
    weight applied to the normalised input) is the output."""
    if cfg.norm_type == "rmsnorm":
        return [("mul", ()), ("mul", (tag,))]
    return [("native_layer_norm", (tag,))]


def _rope_ops(tag: str) -> OpSeq:
    """``apply_rope``: two products (x·cos, rotated x·sin), then their sum: the tag."""
    return [("mul", ()), ("mul", ()), ("add", (tag,))]


def _attention_ops(cfg: ModelConfig) -> OpSeq:
    ops: OpSeq = [("linear", QKV)]  # q, k and v come out of one fused matmul
    if cfg.positions == "rope":
        ops += _rope_ops("query_rope") + _rope_ops("key_rope")
    if cfg.attention == "fused":  # one op returns the context and the log-sum-exp (and more)
        ops += [("sdpa", ("attn_context", "attn_lse"))]
    else:
        scores = "masked_fill" if cfg.causal else "div"
        ops += [
            ("bmm", ()),  # q·kᵀ (QK_MATMUL): its tag sits on the scaled, masked result
            (scores, ("attn_scores",)),
            ("_softmax", ("attn_probs",)),
            ("bmm", ("attn_context",)),
        ]
    return ops + [("linear", ("attn_out",))]


def _mlp_ops(cfg: ModelConfig) -> OpSeq:
    act = "gelu" if cfg.activation == "gelu_tanh" else cfg.activation
    if cfg.mlp == "gated":  # down(act(gate(x)) * up(x)); act(gate) carries no tag
        return [
            ("linear", ("mlp_gate",)),
            (act, ()),
            ("linear", ("mlp_up",)),
            ("mul", ("mlp_act",)),
            ("linear", ("mlp_down",)),
        ]
    return [("linear", ("mlp_up",)), (act, ("mlp_act",)), ("linear", ("mlp_down",))]


def block_ops(cfg: ModelConfig, tiles: int = 1) -> dict[tuple[str, int], tuple[str, ...]]:
    """``(op kind, occurrence within one block) -> tag names`` for ``torch_ref.model.Block``.

    Built from the block's op sequence in the order ``Block.forward`` runs it (pre- or
    post-norm), untagged ops of the counted kinds included, so each tag's occurrence is counted
    rather than written by hand. q, k and v come out of one fused matmul, so they share one
    entry; so do fused attention's output and log-sum-exp. With the MLP in ``tiles`` sequence
    tiles (``TiledMLP``) its ops run once per tile.
    """
    norm1, norm2 = _norm_ops(cfg, "norm1_out"), _norm_ops(cfg, "norm2_out")
    attn = _attention_ops(cfg) + [("add", ("attn_residual",))]
    mlp = _mlp_ops(cfg) * tiles + [("add", ("mlp_residual",))]
    sequence = norm1 + attn + norm2 + mlp if cfg.norm == "pre" else attn + norm1 + mlp + norm2
    table: dict[tuple[str, int], tuple[str, ...]] = {}
    counts: dict[str, int] = {}
    for kind, tags in sequence:
        index = counts.get(kind, 0)
        counts[kind] = index + 1
        if tags:
            table[(kind, index)] = tags
    return table


class _OpNamer:
    """Names the ops of one block by (kind, occurrence) as they come; one per pass."""

    def __init__(self, cfg: ModelConfig, tiles: int = 1):
        self.ops = block_ops(cfg, tiles)
        self.counts: dict[str, int] = {}
        self.last: tuple[str, int] = ("", -1)  # (kind, occurrence) of the op just named

    def __call__(self, func: Any) -> tuple[str, tuple[str, ...]]:
        if inside_ring():  # PyTorch's ring attention: one function, its ops neither counted
            return "ring", ()  # nor named
        kind = _op_kind(func)
        index = self.counts.get(kind, 0)
        self.counts[kind] = index + 1
        self.last = (kind, index)
        return kind, self.ops.get((kind, index), ())


# Naive attention's q·kᵀ: an untagged matmul (its tag, attn_scores, sits on the masked, scaled
# result), the block's first bmm.
QK_MATMUL = ("bmm", 0)


def op_kept_tags(cfg: ModelConfig, block: BlockPolicy) -> frozenset[str]:
    """``jaxmem.policy.kept_tags`` at torch_ref's granularity, an op's output: the tags of every
    op one of whose tags is kept. q, k and v come out of one matmul, one tensor: under RoPE the
    backward reads v and only the rotated q and k, so keeping v (``mlp``) keeps the q and k
    projections' bytes too, where JAX keeps v alone."""
    kept = kept_tags(cfg, block)
    grouped = {n for names in block_ops(cfg).values() if kept & set(names) for n in names}
    return kept | grouped


def unread_by_backward(cfg: ModelConfig, block: BlockPolicy | None = None) -> frozenset[str]:
    """Tags the lean translation need not keep under ``block``: no backward op reads them, no
    read tag is recomputed from them (``jaxmem.policy.kept_tags``) and they share no op with a
    kept tag (``op_kept_tags``). Without ``block``: the tags no backward op reads."""
    reads = backward_reads(cfg) | {"block_input"}
    unread = frozenset(CHECKPOINT_NAMES) - reads
    return unread if block is None else unread - op_kept_tags(cfg, block)


# The block's matmul outputs and their one consumer: (matmul tag, the consumer's tag).
_FEEDS = {"attn_out": "attn_residual", "mlp_down": "mlp_residual", "mlp_up": "mlp_act"}


def skippable_in_recompute(cfg: ModelConfig, block: BlockPolicy) -> frozenset[str]:
    """Matmul tags the lean recompute need not compute: not kept, read by no backward op, and
    their one consumer (a residual addition, or ReLU, whose backward reads its output) is
    either kept — its value comes back from storage — or read by no backward op. Their inputs
    are still saved by autograd when the op is replayed; only the product is skipped."""
    kept, reads = kept_tags(cfg, block), backward_reads(cfg)
    return frozenset(
        tag
        for tag, consumer in _FEEDS.items()
        if tag not in kept and tag not in reads and (consumer in kept or consumer not in reads)
    )


@dataclasses.dataclass(frozen=True)
class KeptTensor:
    """One op output a policy kept for the backward pass (for tests and memory reports)."""

    layer: int
    names: tuple[str, ...]  # tag names, or ("<linear>",) for an untagged matmul under dots
    memory: str  # "device" or "host" (offloaded; on a CPU-only machine both are host RAM)
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    storage: int  # storage_key of the kept copy (for memory accounting)


def _kept(layer: int, names: tuple[str, ...], memory: str, t: torch.Tensor) -> KeptTensor:
    return KeptTensor(
        layer=layer,
        names=names,
        memory=memory,
        shape=tuple(t.shape),
        dtype=t.dtype,
        device=t.device,
        nbytes=t.numel() * t.element_size(),
        # torch_ref.forward_memory.storage_key (not imported: forward_memory imports this module)
        storage=t.untyped_storage()._cdata,
    )


# ------------------------------------------------------------------------------------- stock
class _Phase:
    """Whether the ops running now are the replayed embedding lookup's, which no tag names
    (its addition of the position embeddings must not count as a block's ``add``)."""

    embedding = False


def _stock_contexts(
    block: BlockPolicy,
    cfg: ModelConfig,
    kept: list,
    layer: int,
    phase: _Phase | None = None,
    tiles: int = 1,
):
    """``create_selective_checkpoint_contexts`` with a policy function over jaxmem's tags."""
    name_op = _OpNamer(cfg, tiles)

    def decide(op, *args, **kwargs):
        if phase is not None and phase.embedding:
            return CheckpointPolicy.PREFER_RECOMPUTE, None
        kind, names = name_op(op)
        save = (block.save_dots and kind == "linear") or (bool(names) and names[0] in block.save)
        if not save:
            return CheckpointPolicy.PREFER_RECOMPUTE, None

        def saved(output):
            # selective checkpointing caches every tensor the op returns (LayerNorm: its
            # output, mean and rstd)
            outs = [output] if isinstance(output, torch.Tensor) else output
            kept.extend(
                _kept(layer, names or ("<linear>",), "device", t)
                for t in outs
                if isinstance(t, torch.Tensor)
            )

        return CheckpointPolicy.MUST_SAVE, saved

    return selective_checkpoint_contexts(decide)


# -------------------------------------------------------------------------------------- lean
class _Decider:
    """Lean translation: counts ops per kind within one block, returns the policy's choice."""

    def __init__(
        self, block: BlockPolicy, cfg: ModelConfig, phase: _Phase | None = None, tiles: int = 1
    ):
        self.block, self.phase = block, phase
        self.unread = unread_by_backward(cfg, block)
        self.skip = skippable_in_recompute(cfg, block)
        # q·kᵀ need not be replayed when the scores or probabilities come back from storage:
        # nothing the backward uses reads its product (stock selective checkpointing replays it:
        # its replay runs every op it does not cache)
        kept = kept_tags(cfg, block)
        self.skip_qk = cfg.attention == "naive" and bool({"attn_scores", "attn_probs"} & kept)
        self.namers = {False: _OpNamer(cfg, tiles), True: _OpNamer(cfg, tiles)}

    def __call__(self, func: Any, recompute: bool) -> tuple[str, tuple[str, ...]]:
        if self.phase is not None and self.phase.embedding:
            return "recompute", ()
        kind, names = self.namers[recompute](func)
        if recompute and self.skip_qk and self.namers[True].last == QK_MATMUL:
            return "skip", names
        if self.block.save_dots and kind == "linear":
            return "device", names or ("<linear>",)
        if recompute and kind == "linear" and names and names[0] in self.skip:
            return "skip", names
        if not names or names[0] in self.unread:
            return "recompute", names
        return self.block.choice(names[0]), names


class _KeepMode(TorchDispatchMode):
    """Forward pass of a checkpointed block: keep (or offload) the chosen op outputs."""

    def __init__(self, decide: _Decider, storage: list, kept: list, layer: int):
        super().__init__()
        self.decide, self.storage, self.kept, self.layer = decide, storage, kept, layer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        choice, names = self.decide(func, recompute=False)
        if choice == "recompute":
            return out
        if choice == "offload":
            pin = torch.cuda.is_available()

            def move(t: torch.Tensor) -> torch.Tensor:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                return host.copy_(t.detach(), non_blocking=pin)

            stored = tree_map_only(torch.Tensor, move, out)
        else:
            stored = tree_map_only(torch.Tensor, lambda t: t.detach(), out)
        self.storage.append((func, stored))
        copies = [stored] if isinstance(stored, torch.Tensor) else stored
        memory = "host" if choice == "offload" else "device"
        self.kept.extend(
            _kept(self.layer, names, memory, c) for c in copies if isinstance(c, torch.Tensor)
        )
        return out


class _ReplayMode(TorchDispatchMode):
    """Recompute pass: hand back kept outputs (from host memory if offloaded), run the rest."""

    def __init__(self, decide: _Decider, storage: list):
        super().__init__()
        self.decide, self.storage, self.next = decide, storage, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        choice, _ = self.decide(func, recompute=True)
        if choice == "recompute":
            return func(*args, **(kwargs or {}))
        if choice == "skip":
            # Autograd has already saved this matmul's inputs (all its backward needs); its
            # output is read by nothing the backward uses, so its FLOPs are not spent again.
            # (JAX's partial evaluation skips the same matmuls.)
            mat1, mat2 = args[-2], args[-1]  # addmm(bias, mat1, mat2) / mm / bmm(mat1, mat2)
            shape = (*mat1.shape[:-1], mat2.shape[-1])
            return torch.empty(shape, dtype=mat1.dtype, device=mat1.device)
        stored_func, stored = self.storage[self.next]
        self.next += 1
        if stored_func is not func:
            raise RuntimeError(f"recompute diverged from the forward: {func} vs {stored_func}")
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), stored)


# ------------------------------------------------------------------------------------ policy
def resolve_translation(policy: MemoryPolicy, translation: str) -> Translation:
    """The translation that runs: ``lean`` where a part offloads by name (no stock API in eager
    PyTorch), ``stock`` where the extension would run what stock runs (no remat, or whole
    blocks without names), else the one asked for; ``lean`` when any part's is."""
    if translation not in TRANSLATIONS:
        raise ConfigError(f"translation={translation!r} is not one of {TRANSLATIONS}")
    used = {_block_translation(policy, b, translation) for b in policy.blocks}
    return "lean" if "lean" in used else "stock"


def _block_translation(policy: MemoryPolicy, block: BlockPolicy, translation: str) -> Translation:
    if set(block.offload) - {BLOCK_INPUT}:
        return "lean"
    # nested-host's stock form is already the two-level one the extension runs for nested
    two_level = policy.nested and BLOCK_INPUT not in block.offload
    if not (block.remat and (_stores_tags(block) or two_level)):
        return "stock"
    return translation  # type: ignore[return-value]


def _stores_tags(block: BlockPolicy) -> bool:
    """The block keeps tensors of its own by name (its input aside: ``_offloading_input``)."""
    return block.save_dots or bool(block.save) or bool(set(block.offload) - {BLOCK_INPUT})


def _offloading_input(block: BlockPolicy):
    """Stock PyTorch's offload of the block input (``block_input`` offloaded): the checkpoint's
    saved inputs (a non-reentrant checkpoint saves them through ``_NoopSaveInputs``, a reentrant
    one through ``save_for_backward``: outside the checkpoint's own hooks either way) go to
    host memory under ``torch.autograd.graph.save_on_cpu``, pinned when CUDA is present; the
    block's recompute brings them back. A null context for any other block."""
    if BLOCK_INPUT not in block.offload:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def describe(policy: MemoryPolicy, translation: str) -> str:
    """What runs, in PyTorch's own words (one line for reports; one clause per part)."""
    if len(policy.parts) == 1:
        return _describe_block(policy, policy.head, translation)
    return "; ".join(
        f"blocks {i}: {_describe_block(policy, b, translation)}"
        for i, b in enumerate(policy.blocks)
    )


def _describe_block(policy: MemoryPolicy, block: BlockPolicy, translation: str) -> str:
    how = _describe_kept(policy, block, translation)
    if block.remat and BLOCK_INPUT in block.offload:
        return f"{how}, inside torch.autograd.graph.save_on_cpu (stock: its input in host memory)"
    return how


def _describe_kept(policy: MemoryPolicy, block: BlockPolicy, translation: str) -> str:
    used = _block_translation(policy, block, translation)
    mode = f"use_reentrant={policy.use_reentrant}"
    if not block.remat:
        return "stock: plain loop (autograd keeps what each op saves)"
    if policy.nested and BLOCK_INPUT in block.offload:  # segments' inputs to host: all checkpointed
        return "stock: checkpoint(use_reentrant=False) per segment of about √L blocks and per block"
    if used == "stock":
        if policy.nested:
            return f"stock: checkpoint_sequential({mode}; its last segment is not checkpointed)"
        if _stores_tags(block):
            return (
                "stock: checkpoint(use_reentrant=False, context_fn=create_selective_checkpoint_"
                "contexts: MUST_SAVE for the stored tags)"
            )
        return f"stock: checkpoint({mode}) per block"
    why = "no stock API for name-based offload in eager PyTorch; " if translation == "stock" else ""
    if policy.nested:
        return "lean (torch_ref extension): two-level checkpoint, every segment and block"
    return (
        f"lean (torch_ref extension; {why}keeps what the backward reads of what the policy "
        "stores, skips matmuls nothing reads)"
    )


def validate_for_torch(
    policy: MemoryPolicy, translation: str = "stock", cfg: ModelConfig | None = None
) -> None:
    """Raise for what the policy asks that torch_ref cannot express (and, given the model's
    ``cfg``, for tags that model does not produce: ``jaxmem.policy.check_policy``)."""
    if cfg is not None:
        check_policy(cfg, policy)
    resolve_translation(policy, translation)  # a translation torch_ref has
    for block in policy.blocks:
        _validate_block(block, cfg)
    if policy.use_reentrant and policy.embedding.replay:
        raise ConfigError(
            "replay_embedding needs use_reentrant=False: a reentrant checkpoint of the first "
            "block would take the token ids, which need no gradient, and give the parameters none"
        )
    for block in policy.blocks:
        two_level = policy.nested and (
            _block_translation(policy, block, translation) == "lean" or BLOCK_INPUT in block.offload
        )
        if policy.use_reentrant and (_stores_tags(block) or two_level):
            raise ConfigError(
                f"policy {policy.name!r} needs use_reentrant=False: reentrant checkpoint "
                "supports neither selective context_fn nor nesting"
            )


def _validate_block(block: BlockPolicy, cfg: ModelConfig | None) -> None:
    qkv = {block.choice(n) for n in QKV}
    if len(qkv) > 1:
        raise ConfigError(
            "torch_ref computes query_proj, key_proj and value_proj with one fused matmul: give "
            f"them the same choice (got {sorted(qkv)})"
        )
    core = {block.choice(n) for n in ("attn_context", "attn_lse")}
    if cfg is not None and cfg.attention == "fused" and len(core) > 1:
        raise ConfigError(
            "fused attention returns attn_context and attn_lse from one op "
            f"(F.scaled_dot_product_attention): give them the same choice (got {sorted(core)})"
        )


class _LookupThenBlock:
    """The first block run on the embedding lookup of its token ids: what its checkpoint
    replays. ``phase.embedding`` is on while the lookup runs (``_Phase``)."""

    def __init__(self, layer: nn.Module, embed: Callable[[torch.Tensor], torch.Tensor], phase):
        self.layer, self.embed, self.phase = layer, embed, phase

    def __call__(self, tokens: torch.Tensor, mask: Any, rope: RopeTables | None) -> torch.Tensor:
        self.phase.embedding = True
        try:
            x = self.embed(tokens)
        finally:
            self.phase.embedding = False
        return self.layer(x, mask, rope)


def _grad_input(x: torch.Tensor) -> torch.Tensor:
    # Reentrant checkpoint back-propagates to parameters only when an input requires grad (the
    # classic pitfall with a frozen first input).
    return x if x.requires_grad else x.detach().requires_grad_(True)


class PolicyLayers:
    """A ``layers_fn`` for ``torch_ref.BlockStack`` running ``policy``. ``kept`` lists what the
    last forward kept for the backward pass (named policies: what selective checkpointing cached
    under stock, what the dispatch modes kept under lean); ``translation`` says which ran."""

    def __init__(self, policy: MemoryPolicy, cfg: ModelConfig, translation: str = "stock"):
        validate_for_torch(policy, translation, cfg)
        # ``torch_ref.Decoder.features`` hands the first block the lookup unevaluated
        self.replays_embedding = policy.embedding.replay
        self.policy, self.cfg = policy, cfg
        self.blocks = policy.layer_blocks(cfg.n_layers)  # each layer's block policy
        self.translations = {b: _block_translation(policy, b, translation) for b in self.blocks}
        self.translation = resolve_translation(policy, translation)
        self.description = describe(policy, translation)
        self.kept: list[KeptTensor] = []

    def _checkpointed(
        self, i: int, layer: nn.Module, x: Any, mask: Any, rope: RopeTables | None
    ) -> torch.Tensor:
        """Block ``i`` under its block policy: the one checkpoint of a stack of blocks."""
        block, phase = self.blocks[i], None
        if not block.remat:
            return layer(materialize(x), mask, rope)
        if isinstance(x, EmbeddingLookup):  # the first block replays the lookup: no input kept
            phase = _Phase()
            layer, x = _LookupThenBlock(layer, x.embed, phase), x.tokens
        elif BLOCK_INPUT in block.offload:
            # only the block input is the checkpoint's argument (mask and RoPE's tables are
            # shared by every block: not copied per block); on a CPU-only machine save_on_cpu
            # keeps the tensor itself, counted as host memory (``host_storages``)
            layer, mask, rope = functools.partial(layer, mask_ss=mask, rope=rope), None, None
            with _offloading_input(block):
                x = self._checkpoint_block(i, block, phase, layer, x)
            return x
        return self._checkpoint_block(i, block, phase, layer, x, mask, rope)

    def _checkpoint_block(
        self, i: int, block: BlockPolicy, phase: _Phase | None, layer: Any, x: Any, *rest: Any
    ) -> torch.Tensor:
        """``checkpoint(layer, x, *rest)`` as ``block`` says (whole, or keeping tags)."""
        if BLOCK_INPUT in block.offload and isinstance(x, torch.Tensor) and x.device.type == "cpu":
            self.kept.append(_kept(i, (BLOCK_INPUT,), "host", x))
        if self.policy.use_reentrant:
            return checkpoint(layer, _grad_input(x), *rest, use_reentrant=True)
        if not _stores_tags(block):
            return checkpoint(layer, x, *rest, use_reentrant=False)
        tokens = self.policy.mlp_tile_tokens
        tiles = x.shape[1] // tokens if tokens else 1  # x: [B, S, D], or the lookup's [B, S]
        if self.translations[block] == "stock":
            context_fn = functools.partial(
                _stock_contexts, block, self.cfg, self.kept, i, phase, tiles
            )
        else:

            def context_fn():
                decide, storage = _Decider(block, self.cfg, phase, tiles), []
                return _KeepMode(decide, storage, self.kept, i), _ReplayMode(decide, storage)

        return checkpoint(layer, x, *rest, use_reentrant=False, context_fn=context_fn)

    def host_storages(self) -> set[int]:
        """Storages of the copies the last forward moved to host memory (for accounting)."""
        return {k.storage for k in self.kept if k.memory == "host"}

    def kept_names(self) -> dict[int, str]:
        """Storage of each copy the last forward kept -> its tag(s), ``/``-joined."""
        return {k.storage: "/".join(k.names) for k in self.kept}

    def __call__(
        self, layers: nn.ModuleList, x: torch.Tensor, mask: Any, rope: RopeTables | None
    ) -> torch.Tensor:
        """Run ``layers`` on ``x``; ``mask`` and ``rope`` (RoPE's tables) go to every block."""
        self.kept = []
        if not (self.replays_embedding and self.policy.head.remat):
            x = materialize(x)
        if not any(b.remat for b in self.blocks):
            return run_layers(layers, x, mask, rope)
        if self.policy.nested:
            if self.translation == "stock" and BLOCK_INPUT not in self.policy.head.offload:
                return self._sequential(layers, x, mask, rope)
            return self._two_level(layers, x, mask, rope)
        for i, layer in enumerate(layers):
            x = self._checkpointed(i, layer, x, mask, rope)
        return x

    def _sequential(
        self, layers: nn.ModuleList, x: torch.Tensor, mask: Any, rope: RopeTables | None
    ) -> torch.Tensor:
        n = len(layers)
        segments = -(-n // nested_segment_size(n))  # ⌈L / k⌉, k about √L
        functions = [functools.partial(layer, mask_ss=mask, rope=rope) for layer in layers]
        reentrant = self.policy.use_reentrant
        x = _grad_input(x) if reentrant else x
        return checkpoint_sequential(functions, segments, x, use_reentrant=reentrant)

    def _two_level(
        self, layers: nn.ModuleList, x: torch.Tensor, mask: Any, rope: RopeTables | None
    ) -> torch.Tensor:
        k = nested_segment_size(len(layers))

        def segment(x: torch.Tensor, start: int) -> torch.Tensor:
            for layer in layers[start : start + k]:
                x = checkpoint(layer, x, mask, rope, use_reentrant=False)
            return x

        for start in range(0, len(layers), k):
            with _offloading_input(self.policy.head):  # nested-host: the segment's input
                x = self._checkpoint_block(start, self.policy.head, None, segment, x, start)
        return x


def apply_memory_policy(
    stack: BlockStack, policy: MemoryPolicy, translation: str = "stock"
) -> PolicyLayers:
    """Run ``stack`` (a ``torch_ref.BlockStack``, e.g. ``decoder.blocks``) under ``policy``
    (its MLPs in sequence tiles when the policy says so: ``TiledMLP``)."""
    runner = PolicyLayers(policy, stack.cfg, translation)
    stack.layers_fn = runner
    blocks = policy.layer_blocks(stack.cfg.n_layers)
    for layer, block in zip(stack.layers, blocks, strict=True):
        ffn = layer.ffn
        ffn.__dict__.pop("forward", None)  # a previous policy's tiling
        if policy.mlp_tile_tokens:
            ffn.forward = TiledMLP(ffn.forward, policy, block)
    return runner


class TiledMLP:
    """A block's MLP run over sequence tiles of ``policy.mlp_tile_tokens`` tokens (ALST's
    TiledMLP; stock ``torch.utils.checkpoint`` per tile), set as the ``forward`` of the block's
    own ``ffn`` module, so its parameters and state dict do not change and its math is the
    model's: each tile calls the module's own forward.

    Under a block policy that recomputes everything (``full``; nested), each tile runs in a
    checkpoint of its own (in the policy's ``use_reentrant`` mode), nested in the block's: the
    block's recompute and backward build one tile's ``[B, T, d_ff]`` intermediates at a time.
    Unlike JAX, the block's recompute also runs each tile's forward but the last's (their
    outputs, which no backward reads, are computed before the next tile's input is saved, where
    PyTorch's checkpoint stops early): with n tiles, (n - 1) / n of one more MLP forward per
    block than untiled (``FlopCounterMode``, parity_tests/test_tiling_parity.py). Under a
    named policy (``selective``) the tiles run inside the block's selective checkpoint without
    one of their own: it caches the tagged projections of every tile (the op table counts the
    MLP's ops once per tile), at the untiled FLOPs; under ``none`` they keep everything, as
    untiled."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], policy, block):
        self.forward, self.tokens = forward, policy.mlp_tile_tokens
        self.reentrant = policy.use_reentrant
        self.checkpointed = (block.remat and not _stores_tags(block)) or policy.nested

    def __call__(self, x_bsd: torch.Tensor) -> torch.Tensor:
        # a training sequence divides into equal tiles (checked with the job); a length the
        # tiles do not divide (sampling's growing prompt) ends in a shorter tile
        seq = x_bsd.shape[1]
        outs = []
        for start in range(0, seq, self.tokens):
            x_btd = x_bsd[:, start : start + self.tokens]  # [B, T, D]
            # a reentrant block's forward runs without grad: nothing to checkpoint there
            if self.checkpointed and torch.is_grad_enabled():
                y = checkpoint(self.forward, x_btd, use_reentrant=self.reentrant)
            else:
                y = self.forward(x_btd)
            outs.append(y)
        return torch.cat(outs, dim=1)  # [B, S, D]


def describe_loss(policy: MemoryPolicy) -> str:
    """What runs the head and loss, for reports ('' for the whole loss, stock)."""
    if not policy.loss.label:
        return ""
    return (
        f"; {policy.loss.label}: torch_ref.loss.chunked_lm_loss "
        "(torch_ref extension; no stock fused loss in PyTorch)"
    )


def apply_loss_policy(decoder: nn.Module, policy: MemoryPolicy) -> None:
    """Run ``decoder``'s head and loss (``torch_ref.Decoder.forward`` given targets) as
    ``policy.loss`` says: the whole logits (0), or over N sequence chunks with each chunk's
    gradients formed in the forward (``torch_ref.loss.chunked_lm_loss``, an extension); N
    resolved from the sequence length when the policy gives tokens per chunk."""
    decoder.loss_chunks = policy.loss.chunks
    decoder.loss_tile_tokens = policy.loss.tile_tokens

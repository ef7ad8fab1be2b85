"""A memory policy (``jaxmem.policy.MemoryPolicy``, pure data) translated to JAX, in exactly one
place: ``layers_fn`` turns it into a ``jax.checkpoint`` policy applied to the model's scanned
block stack. ``torch_ref.remat`` translates the same object to PyTorch. The model itself never
changes.

How each policy runs in JAX:

- ``none``: the plain ``lax.scan`` over the blocks, every residual kept;
- remat policies: the scan body is ``jax.checkpoint``-ed with ``save_only_these_names`` (or
  ``save_and_offload_only_these_names`` to ``pinned_host`` for offloaded names, or
  ``dots_with_no_batch_dims_saveable`` for ``save_dots``; ``nothing_saveable`` for ``full``);
  JAX's partial evaluation then keeps only what the backward reads of what the policy stores;
- ``nested``: an outer scan over segments of about √L blocks (``nested_segment_size``), each
  checkpointed, each block inside
  checkpointed again (every segment, the last included); ``nested-host`` offloads each
  segment's input, named ``SEGMENT_INPUT`` inside the segment's checkpoint;
- ``full-host`` (``block_input`` offloaded): the block's input reaches the checkpoint's
  residuals only through its tag, so the scan stacks the host copy alone;
- a layer subset: the stack unrolled, remat only on the selected layers;
- ``unroll``: every block unrolled (``none`` included), each slicing its parameters out of the
  stack inside its own ``jax.checkpoint`` (see ``layers_fn``);
- several parts (``MemoryPolicy.parts``: the first k blocks under one block policy, the others
  under another): consecutive scans under one custom VJP that writes every part's gradients
  into one buffer (``_custom_stack``);
- ``mlp_tile_tokens``: each block's MLP over sequence tiles, each tile checkpointed under the
  block's policy (``tiled_mlp``, bound to the block function by ``_tiling``);
- ``EmbeddingReplay``: the stack's input arrives as the unevaluated embedding lookup
  (``EmbeddingLookup``); the first block runs outside the scan, in a checkpoint that takes the
  lookup, so its backward replays it instead of keeping the block input (``_replayed``; every
  other form runs the lookup first, ``materialize``).

Each kind of stack applies ``jax.checkpoint`` in one place, reading the policy's parts: the
scanned stacks (one part, several parts, in-place accumulation) through ``_checkpointed``,
the unrolled stack in ``_unrolled_stack``, nested in ``_nested_segment``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmem.config import ConfigError
from jaxmem.model import LayerFn, LayersFn, scan_layers
from jaxmem.model.decoder import EmbeddingLookup, MlpFn, materialize
from jaxmem.model.sequence import tile_major, tile_minor
from jaxmem.policy import (
    BLOCK_INPUT,
    HOST_MEMORY_KIND,
    BlockPolicy,
    MemoryPolicy,
    nested_segment_size,
)

# Bumped whenever a policy's translation changes what runs (benchmarks that keep measured rows
# re-measure rows of an older revision). 2: nested's segment replay stops before its last block.
REMAT_REVISION = 2
PEEL_FROM = 3  # nested segments of at least this many blocks replay all but their last
SEGMENT_INPUT = "segment_input"  # nested-host's name for a segment's input (not a block tag)


def backend_memory_kinds(device: jax.Device | None = None) -> tuple[str, ...]:
    device = device or jax.devices()[0]
    return tuple(m.kind for m in device.addressable_memories())


def check_backend(policy: MemoryPolicy, device: jax.Device | None = None) -> None:
    """Raise if the policy needs a memory kind the backend lacks (offload needs pinned_host)."""
    offloaded = policy.offloads
    if offloaded:
        kinds = backend_memory_kinds(device)
        if HOST_MEMORY_KIND not in kinds:
            # the same program with its inputs on the device, or selective's FLOPs
            inputs_only = set(offloaded) == {BLOCK_INPUT}
            instead = ("nested" if policy.nested else "full") if inputs_only else "selective"
            raise ConfigError(
                f"policy {policy.name!r} offloads {list(offloaded)} to {HOST_MEMORY_KIND}, "
                f"but this backend only has memory kinds {list(kinds)}; use a policy without "
                f"offload (e.g. {instead})"
            )


def block_checkpoint_policy(block: BlockPolicy) -> Any:
    """The ``jax.checkpoint`` policy for a remat block under ``block``."""
    return names_policy(block.save, block.offload, save_dots=block.save_dots)


def _checkpointed(block: BlockPolicy, fn: Any, *, in_scan: bool, tile: int = 0) -> Any:
    """``fn`` (one block, or the replayed first block) checkpointed as ``block`` says, or as it
    is when ``block`` keeps everything: the one ``jax.checkpoint`` of the scanned stacks
    (``_scanned_stack``, ``_units``); its MLP in tiles of ``tile`` tokens (``_tiling``)."""
    fn = _tiling(block, fn, tile)
    if not block.remat:
        return fn
    # prevent_cse=False is safe (and faster) inside scan, which cannot CSE across iterations.
    return jax.checkpoint(fn, policy=block_checkpoint_policy(block), prevent_cse=not in_scan)


def names_policy(
    save: Sequence[str], offload: Sequence[str] = (), *, save_dots: bool = False
) -> Any:
    """The ``jax.checkpoint`` policy that keeps the tags ``save`` in device memory, moves the
    tags ``offload`` to ``pinned_host`` (and back for the backward), keeps matmul outputs without
    batch dimensions when ``save_dots``, and recomputes everything else: the one translation of
    jaxmem's policies, for jaxmem's tags and for a user's own
    (``jaxmem.memory.tools.TagPolicy``).

    Never uses ``save_anything_except_these_names``: it ignores its names in this JAX version.
    """
    cp = jax.checkpoint_policies
    if offload:
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=list(save),
            names_which_can_be_offloaded=list(offload),
            offload_src="device",
            offload_dst=HOST_MEMORY_KIND,
        )
    if save_dots and save:
        return cp.save_from_both_policies(
            cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names(*save)
        )
    if save_dots:
        return cp.dots_with_no_batch_dims_saveable
    if save:
        return cp.save_only_these_names(*save)
    return cp.nothing_saveable


# ------------------------------------------------------------------ the MLP in sequence tiles
def _tiling(block: BlockPolicy, layer_fn: LayerFn, tokens: int) -> LayerFn:
    """``layer_fn`` with its block's MLP run in sequence tiles of ``tokens`` tokens
    (``tiled_mlp``; 0: as it is): the one place tiling is applied, by every kind of stack."""
    if not tokens:
        return layer_fn
    return functools.partial(layer_fn, mlp=tiled_mlp(block, tokens))


def tiled_mlp(block: BlockPolicy, tokens: int) -> MlpFn:
    """An ``MlpFn`` running a block's ``FeedForward`` over sequence tiles of ``tokens`` tokens
    of each row: a ``lax.map`` over the tiles of one MLP application checkpointed under
    ``block``'s own policy (ALST's TiledMLP).

    How it reaches the MLP: the block takes an ``mlp`` argument (an ``MlpFn``, as it takes the
    adapters' ``dropout``) that ``BlockStack``'s layer function passes on, and ``_tiling`` binds
    it where each stack applies its block policy. Rewriting the module instead (swapping each
    block's ``ffn`` for a tiling wrapper, NNX surgery) would change the parameter tree the
    optimizer, checkpoints and weight maps read; a context variable read by the model would make
    it impure. The MLP's math stays the model's: each tile calls ``FeedForward`` itself.

    Why a checkpoint per tile under the block's policy: under a rematerialising block the
    tile's checkpoint keeps only what the block policy names (under ``full``, the tile's input,
    a slice of ``norm2_out``), so the block's recompute builds one tile's ``[B, T, d_ff]``
    intermediates at a time and the backward rebuilds each tile's in its turn; a policy keeping
    ``mlp_up`` keeps every tile's (the map stacks them: the untiled bytes). The MLP's output is
    read by no backward (a residual addition), so the recompute's forward over the tiles is
    dead and dropped: the FLOPs equal the untiled step's. Under a block that keeps everything
    (``none``) the tiles are not checkpointed: every tile's intermediates are kept, as untiled.
    Dropout masks are the whole row's at the tile's positions (``AdapterDropout.window``).
    """
    ckpt_policy = block_checkpoint_policy(block) if block.remat else None

    def mlp(ffn: Any, x_bsd: jax.Array, dropout: Any, shards: int = 1) -> jax.Array:
        s = x_bsd.shape[1]
        if s % shards or (s // shards) % tokens:
            raise ValueError(
                f"mlp_tile_tokens={tokens} does not divide a device's {s // shards} positions"
            )
        if dropout is not None and shards > 1:
            raise ValueError("adapter dropout's masks follow positions: not over sequence shards")
        graphdef, state = nnx.split(ffn)

        def one_tile(state: Any, x_btd: jax.Array, start: jax.Array) -> jax.Array:
            drop = None if dropout is None else dropout.window(start, s)
            return nnx.merge(graphdef, state)(x_btd, drop)

        if ckpt_policy is not None:
            # inside the map's scan: no CSE across iterations to prevent
            one_tile = jax.checkpoint(one_tile, policy=ckpt_policy, prevent_cse=False)
        x_nbtd = tile_major(x_bsd, s // tokens, shards)  # [n, B, shards * T, D]
        starts = jnp.arange(x_nbtd.shape[0], dtype=jnp.int32) * tokens
        y_nbtd = jax.lax.map(lambda tile: one_tile(state, *tile), (x_nbtd, starts))
        return tile_minor(y_nbtd, shards)

    return mlp


def _layer(stacked: Any, i: int) -> Any:
    return jax.tree_util.tree_map(lambda a: a[i], stacked)


# Primitives that make a layer's copy of a parameter (its slice of the stack, the compute-dtype
# cast): an unrolled block recomputes them in its backward rather than keeping the copies. Every
# other output stays saveable, so ``none`` unrolled still recomputes no activation.
_PARAMETER_COPY_PRIMITIVES = frozenset(
    {"slice", "squeeze", "dynamic_slice", "convert_element_type"}
)


def _keep_all_but_parameter_copies(prim: Any, *_: Any, **__: Any) -> bool:
    return prim.name not in _PARAMETER_COPY_PRIMITIVES


def _nested_segment(layer_fn: LayerFn, block: BlockPolicy, tile: int = 0) -> LayerFn:
    """``nested``'s segment: ``(x, state of n blocks) -> x``, checkpointed, each block inside
    checkpointed again: the one ``jax.checkpoint`` of the nested stacks (``_nested_stack``,
    ``_units``). Under ``nested-host`` (``block`` offloads ``block_input``) the segment's input,
    named ``SEGMENT_INPUT`` here, goes to host memory; its blocks' inputs, remade by the
    segment's recompute, stay on the device for that segment's backward only. (Offloading
    ``block_input`` itself from the segment's checkpoint would reach into the blocks' own
    checkpoints and send every block's input to host: ``full-host``'s program, at nested's
    FLOPs saved.)"""
    inner = jax.checkpoint(
        _tiling(block, layer_fn, tile), policy=names_policy(()), prevent_cse=False
    )
    offload = BLOCK_INPUT in block.offload
    outer = names_policy((), (SEGMENT_INPUT,)) if offload else block_checkpoint_policy(block)

    def segment(x: jax.Array, seg_state: Any) -> jax.Array:
        x = checkpoint_name(x, SEGMENT_INPUT) if offload else x
        # From 3 blocks on, the last block runs outside the inner scan: replaying the
        # segment for its blocks' inputs then stops before it (partial evaluation drops
        # an output nothing the backward needs reads), as a non-reentrant PyTorch
        # checkpoint stops early; inside the scan it would be replayed once more per
        # segment. Slicing it off costs a copy of one segment's parameters in the
        # backward, which the smaller replay pays for from 3 blocks on, not at 2
        # (measured, XLA:CPU, small fp32 8 x 128: 4 layers +15 MiB temp, 9 layers -4.5
        # MiB; gpt2-124m bf16 8 x 1024 on the H100 plan: +0.12 GB at batch 8, equal at
        # batch 64, 5.7 % fewer FLOPs).
        n = jax.tree_util.tree_leaves(seg_state)[0].shape[0]
        if n < PEEL_FROM:
            return scan_layers(inner, x, seg_state)
        head = jax.tree_util.tree_map(lambda a: a[: n - 1], seg_state)
        return inner(scan_layers(inner, x, head), _layer(seg_state, n - 1))

    return jax.checkpoint(segment, policy=outer, prevent_cse=False)


def layers_fn(policy: MemoryPolicy, n_layers: int) -> LayersFn:
    """How the block stack runs under ``policy`` (pass as ``model(tokens, layers_fn=...)``).

    - one part over all layers: one ``lax.scan`` over a ``jax.checkpoint``-ed body (the default
      path; XLA's compiled memory plan reflects remat only under scan);
    - nested: an outer scan over equal segments of about √L blocks, each segment checkpointed,
      each block inside fully recomputed; a shorter last segment only when no divisor of L is
      near √L (``nested_segment_size``);
    - several parts, or the embedding replayed: the parts' scans under one custom VJP
      (``_custom_stack``);
    - a layer subset: unrolled, remat only on the selected layers;
    - ``unroll``: every block unrolled, each slicing its parameters out of the stack inside
      its own ``jax.checkpoint``, so the backward re-slices (and re-casts) them instead of
      keeping a copy per block; under ``none`` the checkpoint keeps every other output
      (measured, H100 plans: gpt2-124m bf16 8 x 1024 `none` 14.73 GB scanned, 12.37 GB
      unrolled; unrolled keeping the slices and casts, 15.95 GB).
    """
    check_backend(policy)
    if policy.nested:
        run = _nested_stack(policy.head, n_layers, policy.mlp_tile_tokens)
    elif _unrolled(policy, n_layers):
        run = _unrolled_stack(policy, n_layers)
    elif len(policy.parts) > 1 or policy.embedding.replay:
        run = _custom_stack(policy, n_layers, None)
    else:
        run = _scanned_stack(policy.head, policy.mlp_tile_tokens)
    return _replaying(policy, run)


def _replaying(policy: MemoryPolicy, run: LayersFn) -> LayersFn:
    """``run``, marked to take the unevaluated embedding lookup when ``policy`` replays it
    (``Decoder.features`` hands it over only then)."""
    run.replays_embedding = policy.embedding.replay  # type: ignore[attr-defined]
    return run


def _unrolled(policy: MemoryPolicy, n_layers: int) -> bool:
    """The stack runs unrolled: ``unroll``, or a rematerialising part that leaves layers out."""
    part = policy.parts[0]
    leaves_out = len(policy.parts) == 1 and len(part.layers.indices(n_layers)) < n_layers
    return policy.unroll or (leaves_out and part.block.remat)


def _scanned_stack(block: BlockPolicy, tile: int) -> LayersFn:
    def run_scanned(layer_fn: LayerFn, x: Any, stacked: Any) -> jax.Array:
        body = _checkpointed(block, layer_fn, in_scan=True, tile=tile)
        return scan_layers(body, materialize(x), stacked)

    return run_scanned


def _nested_stack(block: BlockPolicy, n_layers: int, tile: int) -> LayersFn:
    k = nested_segment_size(n_layers)

    def run_nested(layer_fn: LayerFn, x: Any, stacked: Any) -> jax.Array:
        x = materialize(x)
        segment = _nested_segment(layer_fn, block, tile)
        n_full = n_layers // k
        if n_full:
            # [L, ...] -> [L/k, k, ...] is a reshape (no copy) of the resident parameters; the
            # segment's slice then arrives through scan, so the backward accumulates each
            # segment's gradient into its own slice (slicing inside the checkpoint instead
            # makes XLA build full-size [L, ...] gradient buffers per segment).
            head = jax.tree_util.tree_map(
                lambda a: a[: n_full * k].reshape(n_full, k, *a.shape[1:]), stacked
            )
            x = scan_layers(segment, x, head)
        if n_layers % k:
            tail = jax.tree_util.tree_map(lambda a: a[n_full * k :], stacked)
            x = segment(x, tail)
        return x

    return run_nested


def _unrolled_stack(policy: MemoryPolicy, n_layers: int) -> LayersFn:
    blocks = policy.layer_blocks(n_layers)

    def run_unrolled(layer_fn: LayerFn, x: Any, stacked: Any) -> jax.Array:
        replay = policy.embedding.replay and isinstance(x, EmbeddingLookup)
        x = x if replay else materialize(x)
        for i, block in enumerate(blocks):
            block = _replaying_block(block) if replay and i == 0 else block

            # Slice inside the checkpoint: the layer's parameters stay views, not saved copies
            # (a layer without remat keeps everything else). Under replay the first layer's
            # checkpoint runs (and replays) the lookup.
            def one_layer(x, stacked, i=i, block=block):
                fn = _tiling(block, layer_fn, policy.mlp_tile_tokens)
                return fn(materialize(x), _layer(stacked, i))

            keep = block_checkpoint_policy(block) if block.remat else _keep_all_but_parameter_copies
            x = jax.checkpoint(one_layer, policy=keep)(x, stacked)
        return x

    return run_unrolled


# ------------------------------------------------ gradient accumulation into one buffer, in place
# With accumulation, ``jax.grad`` of a microbatch returns its whole gradient and the scan over
# microbatches then adds it to the running sum: two gradient-sized buffers live at once (the
# sum and this microbatch's gradient). PyTorch adds each parameter's gradient into ``.grad`` as
# the backward produces it. No JAX or optax API does that (``optax.MultiSteps`` adds whole
# gradients too), so it is written here: the block stack gets a custom VJP whose backward runs
# the blocks' pullbacks in reverse and adds each block's weight gradient into its slice of the
# running sum, which the backward's scan carries (a loop state XLA updates in place). The
# stack's gradient then never exists on its own. Policies are unchanged: each block's pullback
# comes from ``jax.vjp`` of the same checkpointed body, so it keeps and recomputes what the
# policy says.


@dataclasses.dataclass(frozen=True)
class _Unit:
    """A run of the stack: ``count`` scan iterations of ``body`` over ``group`` consecutive
    blocks each, from block ``start`` (``grouped``: ``body`` takes the group's state with its
    leading block axis; else one block's state)."""

    body: LayerFn
    start: int
    count: int
    group: int = 1
    grouped: bool = False
    replay: bool = False  # one block whose body runs the embedding lookup (``_replayed``)
    recomputes: bool = True  # its backward recomputes (False: no remat, everything kept)

    def state(self, stacked: Any) -> Any:
        stop = self.start + self.count * self.group

        def cut(a: jax.Array) -> jax.Array:
            a = a if (self.start, stop) == (0, a.shape[0]) else a[self.start : stop]
            return a.reshape(self.count, self.group, *a.shape[1:]) if self.grouped else a

        return jax.tree_util.tree_map(cut, stacked)

    def whole(self, stacked: Any) -> bool:
        """The unit runs over the whole stack (its state is the stack itself, or a reshape)."""
        n = jax.tree_util.tree_leaves(stacked)[0].shape[0]
        return (self.start, self.start + self.count * self.group) == (0, n)

    def block(self, stacked: Any, j: jax.Array) -> Any:
        """Iteration ``j``'s state, sliced from the stack (a transient one-iteration copy)."""
        first = self.start + j * self.group

        def cut(a: jax.Array) -> jax.Array:
            if self.grouped:
                at = (first,) + (0,) * (a.ndim - 1)
                return jax.lax.dynamic_slice(a, at, (self.group, *a.shape[1:]))
            return jax.lax.dynamic_index_in_dim(a, first, keepdims=False)

        return jax.tree_util.tree_map(cut, stacked)


def accumulates_in_place(policy: MemoryPolicy, n_layers: int) -> bool:
    """Whether ``accumulating_layers_fn`` can run ``policy``: the scanned stacks (every part's
    blocks, ``none`` included, and ``nested``). An unrolled stack (``unroll``, a layer subset)
    slices each block's parameters inside its own checkpoint, which a per-block pullback taking
    the block's slice cannot reproduce."""
    return not _unrolled(policy, n_layers)


def _replayed(units: list[_Unit], layer_fn: LayerFn, policy: MemoryPolicy) -> list[_Unit]:
    """``units`` with the first block split off into a unit of its own whose checkpointed body
    takes the ``EmbeddingLookup`` and runs it first: the block's backward replays the lookup
    rather than keeping its output (``EmbeddingReplay``)."""
    first, *rest = units

    def body(e: Any, w: Any, **mlp: Any) -> jax.Array:
        return layer_fn(materialize(e), w, **mlp)

    fn = _checkpointed(
        _replaying_block(policy.head), body, in_scan=False, tile=policy.mlp_tile_tokens
    )
    replay = _Unit(fn, 0, 1, replay=True)
    after = [dataclasses.replace(first, start=1, count=first.count - 1)] if first.count > 1 else []
    return [replay, *after, *rest]


def _replaying_block(block: BlockPolicy) -> BlockPolicy:
    """``block`` for the first block when it replays the embedding lookup: it keeps no input,
    on the device or (``full-host``) in host memory."""
    return dataclasses.replace(block, offload=tuple(n for n in block.offload if n != BLOCK_INPUT))


def _units(policy: MemoryPolicy, n_layers: int, layer_fn: LayerFn) -> list[_Unit]:
    """The stack as scanned units: one per part (``MemoryPolicy.runs``), or nested's
    segments."""
    if not policy.nested:
        units, start = [], 0
        for n, block in policy.runs(n_layers):
            body = _checkpointed(block, layer_fn, in_scan=True, tile=policy.mlp_tile_tokens)
            units.append(_Unit(body, start, n, recomputes=block.remat))
            start += n
        return units
    k = nested_segment_size(n_layers)
    segment = _nested_segment(layer_fn, policy.head, policy.mlp_tile_tokens)
    n_full, rest = divmod(n_layers, k)
    units = [_Unit(segment, 0, n_full, k, grouped=True)] if n_full else []
    if rest:
        units.append(_Unit(segment, n_full * k, 1, rest, grouped=True))
    return units


def accumulating_layers_fn(policy: MemoryPolicy, n_layers: int, acc: Any) -> LayersFn:
    """A ``layers_fn`` running the stack as ``layers_fn(policy, n_layers)`` does, whose gradient
    is added into ``acc`` (the stacked blocks' running gradient sum, shaped like their
    parameters, in the accumulation dtype) instead of being returned.

    Differentiate the loss with respect to ``acc``: its cotangent is ``acc`` plus this
    microbatch's stack gradient (the stacked parameters' own cotangent is zero). Only for
    policies ``accumulates_in_place`` accepts.
    """
    if not accumulates_in_place(policy, n_layers):
        raise ValueError(
            f"policy {policy.name!r} runs an unrolled stack; accumulate with the scan carry "
            "(AccumConfig(inplace=False))"
        )
    check_backend(policy)
    return _replaying(policy, _custom_stack(policy, n_layers, acc))


def _drop_weights(pb: Any, w: Any, layout: dict[str, Any]) -> list:
    """The leaves of pullback ``pb`` that are not block weights ``w`` (those are re-sliced from
    the stack in the backward); ``layout`` records where each leaf goes."""
    leaves, layout["tree"] = jax.tree_util.tree_flatten(pb)
    position = {id(leaf): i for i, leaf in enumerate(jax.tree_util.tree_leaves(w))}
    layout["from_w"] = [position.get(id(leaf)) for leaf in leaves]
    return [leaf for leaf in leaves if id(leaf) not in position]


def _forward_units(
    units: list[_Unit], layouts: list[dict[str, Any]], x: Any, stacked: Any
) -> tuple[jax.Array, list]:
    """``_custom_stack``'s forward: each unit's blocks run under ``jax.vjp``; returns the
    output and each unit's pullbacks (its residuals: what the policy keeps)."""
    pullbacks = []
    for u, layout in zip(units, layouts, strict=True):
        if u.replay:  # one block, outside a scan: its input is the lookup
            w = u.block(stacked, 0)
            x, pb = jax.vjp(u.body, x, w)
            pullbacks.append(_drop_weights(pb, w, layout))
            continue
        if u.whole(stacked):
            # each block's pullback stacked by scan; JAX forwards the weights the pullbacks
            # keep to the stack itself
            x, pb = jax.lax.scan(lambda x, w, f=u.body: jax.vjp(f, x, w), x, u.state(stacked))
            pullbacks.append(pb)
            continue

        def body(x, j, u=u, layout=layout):
            w = u.block(stacked, j)
            y, pb = jax.vjp(u.body, x, w)
            return y, _drop_weights(pb, w, layout)

        x, kept = jax.lax.scan(body, x, jnp.arange(u.count))
        pullbacks.append(kept)
    return x, pullbacks


def _custom_stack(policy: MemoryPolicy, n_layers: int, acc: Any) -> LayersFn:
    """The stack's units under one custom VJP: each block's pullback runs in reverse and adds
    its weight gradient into its slice of a buffer carried by the backward's scans: ``acc``
    (returned as ``acc``'s cotangent) or, with ``acc`` None, zeros (returned as the stacked
    parameters' cotangent). Without accumulation it runs a stack of several parts: there,
    differentiating the parts' scans over slices of the stack the usual way would build each
    part's gradient and then concatenate them into one more gradient-sized buffer (the cost
    ``nested_segment_size`` avoids for nested's tail)."""
    own = acc is None

    def run(layer_fn: LayerFn, x: Any, stacked: Any) -> jax.Array:
        units = _units(policy, n_layers, layer_fn)
        if policy.embedding.replay and isinstance(x, EmbeddingLookup):
            units = _replayed(units, layer_fn, policy)
        else:
            x = materialize(x)

        @jax.custom_vjp
        def stack(x, stacked, acc):
            for u in units:
                x = scan_layers(u.body, x, u.state(stacked))
            return x

        # Units over part of the stack (a mixed stack's parts, nested's shorter tail) slice the
        # parameters per iteration instead of scanning over a sliced copy, and their pullbacks
        # keep no copy of the weights: the leaves of a pullback that are the block's own weights
        # are dropped from the stacked residuals and re-sliced from the stack in the backward
        # (a sliced copy scanned over would stay alive as residuals: measured +23 MiB, one copy
        # of the blocks' parameters, on an 8-layer `small` H100 plan). ``layouts`` records,
        # while the forward is traced, where each pullback's weight leaves go.
        layouts: list[dict[str, Any]] = [{} for _ in units]

        def fwd(x, stacked, acc):
            x, pullbacks = _forward_units(units, layouts, x, stacked)
            return x, (pullbacks, stacked, None if own else acc)

        def bwd(res, ct):
            pullbacks, stacked, acc = res
            if own:  # the gradient buffer, zeros shaped like the stack (which is a residual)
                acc = jax.tree_util.tree_map(jnp.zeros_like, stacked)
            for u, pb, layout in reversed(list(zip(units, pullbacks, layouts, strict=True))):

                def pullback_of(item, j, u=u, layout=layout):
                    if u.whole(stacked) and not u.replay:
                        return item
                    weights = jax.tree_util.tree_leaves(u.block(stacked, j))
                    kept = iter(item)
                    leaves = [next(kept) if i is None else weights[i] for i in layout["from_w"]]
                    return jax.tree_util.tree_unflatten(layout["tree"], leaves)

                def body(carry, item, u=u):
                    ct, acc = carry
                    kept, j = item
                    if u.count == 1 and u.recomputes:
                        # a rematerialised block outside a loop (the replayed first block, a
                        # one-block part: XLA drops a loop of one trip) waits for the cotangent
                        # before its replay, which the scheduler otherwise runs as soon as its
                        # residuals exist, in the forward, its activations then living until
                        # its backward (H100 plans, small fp32 8 x 128: full:1+full 101.3 ->
                        # 82.1 MiB). Elsewhere a barrier only moves XLA's schedule, either way
                        # (on every block's replay, in-place accumulation at accum 2 planned
                        # none 106.8 -> 110.6 MiB, selective 86.3 -> 84.3), so it is only here
                        kept, ct = jax.lax.optimization_barrier((kept, ct))
                    ct, d_state = pullback_of(kept, j)(ct)
                    first = u.start + j * u.group

                    def add(a: jax.Array, d: jax.Array) -> jax.Array:
                        d = d.reshape(u.group, *a.shape[1:]).astype(a.dtype)
                        at = (first,) + (0,) * (a.ndim - 1)
                        old = jax.lax.dynamic_slice(a, at, d.shape)
                        return jax.lax.dynamic_update_slice(a, old + d, at)

                    return (ct, jax.tree_util.tree_map(add, acc, d_state)), None

                if u.replay:  # ct becomes the lookup's cotangent: the tables' gradients
                    (ct, acc), _ = body((ct, acc), (pb, 0))
                    continue
                (ct, acc), _ = jax.lax.scan(
                    body, (ct, acc), (pb, jnp.arange(u.count)), reverse=True
                )
            return (ct, acc, None) if own else (ct, None, acc)

        stack.defvjp(fwd, bwd)
        return stack(x, stacked, acc)

    return run

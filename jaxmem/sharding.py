"""A ``ParallelConfig`` (``jaxmem.parallel``, pure data) translated to JAX shardings, in one
place: a one-axis device mesh, where each parameter, optimizer-state leaf and batch lives on
it, and the checks that the process has the devices. The train step applies these from outside
(``jaxmem.step.train_step.make_train_step(shardings=...)``); XLA's SPMD partitioner then inserts the
collectives (all-reduce for ``dp``, reduce-scatter + all-gather for ``zero1``/``fsdp``).

Which dimension a leaf is sharded on: the largest one divisible by the device count, never the
stacked layer axis of the blocks' parameters (``lax.scan`` slices one layer per iteration; with
the layer axis sharded each iteration would need another device's layer). A leaf with no such
dimension (a scalar, a bias narrower than the mesh) is replicated: ``per_device_bytes`` counts
what that costs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem.config import ConfigError
from jaxmem.parallel import (
    COLUMN_TAGS,
    KV_TAGS,
    QUERY_TAGS,
    SCORE_TAGS,
    STREAM_TAGS,
    ParallelConfig,
    shard_dim,
)

AXIS = "data"  # the data-parallel axis (dp, zero1, fsdp)
TENSOR = "tensor"  # the tensor-parallel axis (--mesh ...,tp=N): a second mesh axis
CONTEXT = "context"  # the context-parallel axis (--mesh ...,cp=N): the sequence split over it


def ensure_cpu_devices(n: int) -> None:
    """Ask for ``n`` CPU devices before JAX starts its backends (a no-op for GPUs/TPUs, and
    when JAX already started: ``mesh`` then says what is missing)."""
    try:
        # a count already chosen (by the CLI, for this process's share of a multi-process
        # mesh, or by the user) is kept
        if jax.config.jax_num_cpu_devices < 1:
            jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already initialised: the device count is fixed
        pass


def mesh(cfg: ParallelConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """The mesh over the first ``cfg.devices`` devices (``devices``: a target's): one data axis,
    or data x tensor with tensor parallelism (neighbouring devices on the tensor axis, whose
    collectives run every block, as NVLink domains are laid out)."""
    available = devices if devices is not None else jax.devices()
    if len(available) < cfg.devices:
        platform = available[0].platform if available else "?"
        hint = (
            " (on a CPU: set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{cfg.devices} before Python starts JAX)"
            if platform == "cpu"
            else ""
        )
        raise ConfigError(
            f"--mesh {cfg.mesh_text()} needs {cfg.devices} devices; this process sees "
            f"{len(available)} {platform} device(s){hint}"
        )
    chosen = np.array(available[: cfg.devices])
    if cfg.cp > 1 and cfg.tp > 1:  # the tensor axis innermost: collectives every projection
        return Mesh(chosen.reshape(cfg.data, cfg.cp, cfg.tp), (AXIS, CONTEXT, TENSOR))
    if cfg.cp > 1:  # neighbouring devices on the context axis: it gathers keys every block
        return Mesh(chosen.reshape(cfg.data, cfg.cp), (AXIS, CONTEXT))
    if cfg.tp == 1:
        return Mesh(chosen, (AXIS,))
    return Mesh(chosen.reshape(cfg.data, cfg.tp), (AXIS, TENSOR))


def state_axes(m: Mesh) -> str | tuple[str, str]:
    """The mesh axes a sharded parameter or optimizer-state leaf splits over: the data axis,
    and with a context axis both (each context device holds the same parameters)."""
    return (AXIS, CONTEXT) if CONTEXT in m.axis_names else AXIS


def _is_stacked(path: tuple) -> bool:
    return any(getattr(k, "key", None) == "blocks" for k in path)


def leaf_spec(
    shape: tuple[int, ...],
    n: int,
    stacked: bool,
    tensor_dim: int | None = None,
    axes: str | tuple[str, str] = AXIS,
) -> P:
    """Where one array lives when it is sharded over ``n`` devices of the ``axes`` (the data
    axis, or data and context: ``state_axes``; ``shard_dim``, never the dimension the tensor
    axis splits) and, given ``tensor_dim``, over the tensor axis there."""
    dims: list[str | None] = [None] * len(shape)
    if tensor_dim is not None:
        dims[tensor_dim] = TENSOR
    if n > 1:
        free = tuple(1 if d == tensor_dim else x for d, x in enumerate(shape))
        best = shard_dim(free, n, stacked)
        if best is not None:
            dims[best] = axes
    return P(*dims)


# Megatron's layout of a block's weights over the tensor axis, by parameter name: column-
# parallel (the output dimension split: each device computes its heads or MLP columns) or
# row-parallel (the input dimension split: each device's partial sums are reduced). The fused
# q/k/v projection (``in_proj``, HF GPT-2's c_attn layout [q | k | v]) is split in contiguous
# column blocks: its heads do not line up with the devices' shares, so XLA moves q, k and v into
# the heads layout the attention runs in (``tag_spec``) with a collective that Megatron's
# interleaved layout avoids.
COLUMN = ("in_proj", "up", "gate")
ROW = ("out_proj", "down")
# A projection's adapter (``lora_<target>``: A [L, in, r], B [L, r, out]) follows its kernel:
# column-parallel, B split by output columns (each device adds its heads' or columns' share of
# the delta) and A replicated; row-parallel, A split by input rows (each device's partial
# x A is summed with the kernel's) and B replicated. The fused kernel's q, k and v adapters
# each split their own part's columns, which line up with the heads layout of the query, key
# and value tags (not with the fused kernel's contiguous blocks).
LORA_COLUMN = ("lora_q", "lora_k", "lora_v", "lora_gate", "lora_up")
LORA_ROW = ("lora_o", "lora_down")


def tensor_dim(path: tuple, shape: tuple[int, ...], stacked: bool) -> int | None:
    """The dimension the tensor axis splits a parameter on (None: replicated over it)."""
    keys = [k.key for k in path if hasattr(k, "key")]  # names, not nnx's trailing .value
    if not stacked or len(keys) < 2:
        return None
    layer, leaf = keys[-2], keys[-1]
    if (layer, leaf) in ((c, "lora_b") for c in LORA_COLUMN):  # B [L, r, out]
        return len(shape) - 1
    if (layer, leaf) in ((r, "lora_a") for r in LORA_ROW):  # A [L, in, r]
        return len(shape) - 2
    if layer in COLUMN:  # kernel [L, in, out] or bias [L, out]: the output columns
        return len(shape) - 1
    if layer in ROW and leaf == "kernel":  # kernel [L, in, out]: the input rows
        return len(shape) - 2
    return None  # norms, the row-parallel biases (added once, after the reduction)


def tree_shardings(
    tree: Any, m: Mesh, shard: bool, memory_kind: str = "device", *, stacked: bool = False
) -> Any:
    """A ``NamedSharding`` per array leaf of ``tree``: sharded by ``leaf_spec`` or replicated
    over the data axis (``shard``), and split over the tensor axis by Megatron's layout when the
    mesh has one. ``stacked``: every leaf of ``tree`` is the block stack's (its first axis the
    layers')."""
    axes = state_axes(m)
    n = int(np.prod([m.shape[a] for a in np.atleast_1d(axes)]))
    tp = TENSOR in m.axis_names

    def one(path: tuple, x: Any) -> NamedSharding:
        shape = tuple(x.shape)
        in_stack = stacked or _is_stacked(path)
        dim = tensor_dim(path, shape, in_stack) if tp else None
        spec = leaf_spec(shape, n if shard else 1, in_stack, dim, axes)
        return NamedSharding(m, spec, memory_kind=memory_kind)

    return jax.tree_util.tree_map_with_path(one, tree)


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """Where a train step's inputs and outputs live: parameters, optimizer state, the batch
    (split on its first dimension), and everything replicated (loss scale, metrics)."""

    mesh: Mesh
    params: Any
    opt_state: Any
    batch: NamedSharding
    replicated: NamedSharding

    def micro(self) -> NamedSharding:
        """A stack of microbatches ``[k, B/k, ...]``: each microbatch split over the devices."""
        return NamedSharding(self.mesh, P(None, AXIS))


def step_shardings(
    cfg: ParallelConfig,
    params: Any,
    opt_state: Any,
    *,
    devices: list[jax.Device] | None = None,
    state_memory: str = "device",
    params_memory: str = "device",
    m: Mesh | None = None,
) -> StepShardings:
    m = m if m is not None else mesh(cfg, devices)
    return StepShardings(
        mesh=m,
        params=tree_shardings(params, m, cfg.shards_params, params_memory),
        opt_state=tree_shardings(opt_state, m, cfg.shards_opt_state, state_memory),
        # rows over the data axis; a context-parallel loss permutes and splits the sequence
        batch=NamedSharding(m, P(AXIS)),
        replicated=NamedSharding(m, P()),
    )


def per_device_bytes(tree: Any, device: jax.Device | None = None) -> int:
    """Bytes of ``tree``'s arrays resident on ``device`` (default: the first device holding
    them), counted from the shards each device actually holds."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        shards = x.addressable_shards
        d = device or shards[0].device
        total += sum(s.data.nbytes for s in shards if s.device == d)
    return total


def sharded_bytes(tree: Any, shardings: Any) -> int:
    """Per-device bytes of ``tree`` (arrays or shapes) placed by ``shardings``, from shapes:
    each leaf's shard shape on one device."""
    total = 0
    for x, s in zip(
        jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings), strict=True
    ):
        shard = s.shard_shape(tuple(x.shape))
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


# --------------------------------------------------------------- fsdp: gather weights at use
# With parameters sharded on the same mesh axis as the batch, XLA's SPMD partitioner may keep a
# weight sharded and gather the *activations* instead (measured: gpt2-124m bf16 on 8 H100s,
# the tied embedding sharded on d_model made it gather the [B, S, vocab] logits: 17.1 GiB of
# temporaries per device vs 3.5 under dp). FSDP gathers the weights: each block's parameters
# are constrained to be replicated where the block uses them (inside its remat, so the backward
# gathers them again), the rest where the loss starts; activations stay split by rows.


def _replicated(tree: Any, m: Mesh) -> Any:
    return jax.lax.with_sharding_constraint(tree, NamedSharding(m, P()))


def _layer_specs(tree: Any, m: Mesh) -> Any:
    """One block's weights gathered over the data axis: replicated there, still split over the
    tensor axis (Megatron's layout) when the mesh has one."""
    tp = TENSOR in m.axis_names

    def one(path: tuple, x: Any) -> NamedSharding:
        dim = tensor_dim(path, (1, *x.shape), stacked=True) if tp else None
        dims = [None] * x.ndim
        if dim is not None:
            dims[dim - 1] = TENSOR
        return NamedSharding(m, P(*dims))

    return jax.tree_util.tree_map_with_path(one, tree)


def gather_at_use(layers: Any, m: Mesh) -> Any:
    """A ``layers_fn`` that runs ``layers`` with each block's weights all-gathered over the data
    axis as the block starts (wrapping the block function: the model is unchanged)."""

    def run(layer_fn: Any, x: jax.Array, stacked: Any) -> jax.Array:
        def gathered_layer(x: jax.Array, layer_params: Any, **mlp: Any) -> jax.Array:
            specs = _layer_specs(layer_params, m)
            return layer_fn(x, jax.lax.with_sharding_constraint(layer_params, specs), **mlp)

        return layers(gathered_layer, x, stacked)

    # x passes through untouched: the lookup unevaluated where ``layers`` replays it
    run.replays_embedding = getattr(layers, "replays_embedding", False)
    return run


def gather_outside_blocks(loss: Any, m: Mesh) -> Any:
    """``loss(params, batch)`` with the parameters outside the block stack (embeddings, final
    norm) all-gathered as it starts."""

    def wrapped(params: Any, batch: Any) -> Any:
        def one(path: tuple, x: Any) -> Any:
            return x if _is_stacked(path) else _replicated(x, m)

        return loss(jax.tree_util.tree_map_with_path(one, params), batch)

    return wrapped


# ------------------------------------------------- tensor parallelism: the activations' layout
# The block's activations are laid out by the tags the model already puts on them
# (``checkpoint_name``): each tagged tensor is constrained to Megatron's layout over the tensor
# axis just before it is tagged, so what a memory policy saves is the constrained tensor. Heads
# and MLP columns are split over the tensor axis; the residual stream, the norms' outputs and
# the row-parallel outputs are split by sequence (sequence parallelism) or replicated on each
# tensor device (the tags of each kind: ``jaxmem.parallel``, which also counts each device's
# share). XLA's SPMD partitioner inserts the all-gathers and reduce-scatters between.
def tag_spec(
    name: str, shape: tuple[int, ...], tp: int, sequence_parallel: bool, cp: bool = False
) -> P | None:
    """Where a tagged activation of ``shape`` lives on the data x tensor mesh, or data x
    context x tensor (``cp``: every ``[B, S, ...]`` tag split by sequence over the context axis
    too) (None: left to XLA, e.g. a tag this layout does not name)."""
    dims: list[Any] = [AXIS] + [None] * (len(shape) - 1)
    if cp and name in SCORE_TAGS:  # inside the context axis' attention (shard_map): its own
        return None
    if cp:
        dims[1] = CONTEXT

    def split(d: int) -> bool:
        if shape[d] % tp:
            return False
        dims[d] = (CONTEXT, TENSOR) if dims[d] == CONTEXT else TENSOR
        return True

    if name in QUERY_TAGS or name in KV_TAGS:  # [B, S, H, K], grouped [B, S, Hkv, G, K]
        split(2) or (len(shape) == 5 and split(3))
    elif name in SCORE_TAGS:  # [B, H, S, S], grouped [B, Hkv, G, S, S]; the lse [B, H, S]
        split(1) or (len(shape) == 5 and split(2))
    elif name in COLUMN_TAGS:
        split(len(shape) - 1)
    elif name in STREAM_TAGS:
        if sequence_parallel:  # within each context device's share
            split(1)
    else:
        return None
    return P(*dims)


def tensor_parallel_layers(layers: Any, m: Mesh, cfg: ParallelConfig) -> Any:
    """A ``layers_fn`` that runs ``layers`` with each block's tagged activations laid out over
    the tensor axis (``tag_spec``), by re-evaluating the block's jaxpr with a sharding
    constraint before each tag. Written by hand: JAX has no hook on ``checkpoint_name``, and the
    tags are the one contract between the model and what applies policies to it (MaxText puts
    logical-axis constraints in its model instead)."""

    def run(layer_fn: Any, x: jax.Array, stacked: Any) -> jax.Array:
        def constrained_layer(x: jax.Array, layer_params: Any) -> jax.Array:
            args, in_tree = jax.tree_util.tree_flatten((x, layer_params))
            closed, out_shape = jax.make_jaxpr(
                lambda *a: layer_fn(*jax.tree_util.tree_unflatten(in_tree, a)),
                return_shape=True,
            )(*args)
            out = _eval_constrained(closed.jaxpr, closed.consts, args, m, cfg)
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), out)

        return layers(constrained_layer, x, stacked)

    # x passes through untouched: the lookup unevaluated where ``layers`` replays it
    run.replays_embedding = getattr(layers, "replays_embedding", False)
    return run


def _eval_constrained(jaxpr: Any, consts: list, args: list, m: Mesh, cfg: ParallelConfig) -> list:
    """``jax.core.eval_jaxpr`` with each ``name`` equation's input constrained by ``tag_spec``
    (the equations re-bound as they are, so every tag stays where policies look for it)."""
    from jax.extend.core import Literal

    env: dict = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "name":
            (value,) = invals
            spec = tag_spec(
                eqn.params["name"],
                tuple(value.shape),
                cfg.tp,
                cfg.sequence_parallel,
                cfg.context_parallel,
            )
            if spec is not None:
                invals = [jax.lax.with_sharding_constraint(value, NamedSharding(m, spec))]
        with eqn.ctx.manager:  # as jax.core.eval_jaxpr binds (this JAX's bind parameters)
            outvals = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        if not eqn.primitive.multiple_results:
            outvals = [outvals]
        for v, x in zip(eqn.outvars, outvals, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def parallel_loss(make_loss: Any, layers: Any, cfg: ParallelConfig, m: Mesh | None) -> Any:
    """``make_loss(layers_fn)`` as the strategy runs it: with tensor parallelism the blocks'
    activations laid out over the tensor axis; under ``fsdp`` over more than one data device
    the weights gathered at use; otherwise unchanged."""
    if m is None or not cfg.sharded:
        return make_loss(layers)
    if cfg.tensor_parallel:
        layers = tensor_parallel_layers(layers, m, cfg)
    if not cfg.shards_params:
        return make_loss(layers)
    return gather_outside_blocks(make_loss(gather_at_use(layers, m)), m)

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
from jaxmem.parallel import ParallelConfig, shard_dim

AXIS = "data"  # the mesh's one axis: every strategy here is data parallel


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
    """The one-axis mesh over the first ``cfg.devices`` devices (``devices``: a target's)."""
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
    return Mesh(np.array(available[: cfg.devices]), (AXIS,))


def _is_stacked(path: tuple) -> bool:
    return any(getattr(k, "key", None) == "blocks" for k in path)


def leaf_spec(shape: tuple[int, ...], n: int, stacked: bool) -> P:
    """Where one array lives on an ``n``-device axis when it is sharded (``shard_dim``)."""
    best = shard_dim(shape, n, stacked)
    if best is None:
        return P()
    return P(*(AXIS if d == best else None for d in range(len(shape))))


def tree_shardings(
    tree: Any, m: Mesh, shard: bool, memory_kind: str = "device", *, stacked: bool = False
) -> Any:
    """A ``NamedSharding`` per array leaf of ``tree``: sharded by ``leaf_spec`` or replicated.
    ``stacked``: every leaf of ``tree`` is the block stack's (its first axis the layers')."""
    n = m.shape[AXIS]

    def one(path: tuple, x: Any) -> NamedSharding:
        spec = leaf_spec(tuple(x.shape), n, stacked or _is_stacked(path)) if shard else P()
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


def gather_at_use(layers: Any, m: Mesh) -> Any:
    """A ``layers_fn`` that runs ``layers`` with each block's weights all-gathered as the block
    starts (wrapping the block function: the model is unchanged)."""

    def run(layer_fn: Any, x: jax.Array, stacked: Any) -> jax.Array:
        def gathered_layer(x: jax.Array, layer_params: Any) -> jax.Array:
            return layer_fn(x, _replicated(layer_params, m))

        return layers(gathered_layer, x, stacked)

    return run


def gather_outside_blocks(loss: Any, m: Mesh) -> Any:
    """``loss(params, batch)`` with the parameters outside the block stack (embeddings, final
    norm) all-gathered as it starts."""

    def wrapped(params: Any, batch: Any) -> Any:
        def one(path: tuple, x: Any) -> Any:
            return x if _is_stacked(path) else _replicated(x, m)

        return loss(jax.tree_util.tree_map_with_path(one, params), batch)

    return wrapped


def parallel_loss(make_loss: Any, layers: Any, cfg: ParallelConfig, m: Mesh | None) -> Any:
    """``make_loss(layers_fn)`` as the strategy runs it: under ``fsdp`` on more than one device
    the weights are gathered at use; otherwise unchanged."""
    if m is None or not cfg.shards_params:
        return make_loss(layers)
    return gather_outside_blocks(make_loss(gather_at_use(layers, m)), m)

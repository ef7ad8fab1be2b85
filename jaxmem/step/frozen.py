"""The frozen base of an adapter step: which parameters train, and the step's parameters split
into the trained and the frozen.

With adapters (``AdapterConfig.enabled``) the step differentiates only the trainable subtree
(every ``nnx.LoRAParam`` the decoder holds, and the groups ``AdapterConfig.train`` unfreezes),
and the optimizer is built over that subtree alone: a frozen parameter gets no gradient and no
optimizer state at all (not a zero-filled one, as ``optax.masked`` would keep). The parameters
still enter and leave the step whole (the frozen ones unchanged), so checkpoints, evaluation
and export see one tree. ``check_composes`` names, in one line each, what an adapter step does
not compose with yet; the step builder calls it before anything compiles.

The adapters' dropout (``AdapterConfig.dropout``) draws its masks from keys, not from state
the model keeps: the step folds the run's seed and the update count (``DropoutRng``, kept in
the optimizer state, so a checkpoint resumes it) into one key per batch row, which the model
folds with the block and projection (``jaxmem.model.decoder.AdapterDropout``). A row's masks
are therefore the same however the batch is split into microbatches or over devices, and a
resumed run draws the masks the uninterrupted one did.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxmem.adapters import AdapterConfig
from jaxmem.config import ConfigError
from jaxmem.model.decoder import DROPOUT_KEYS
from jaxmem.model.qbase import PackedBase

# folded into the run's seed for the dropout's keys (the adapters' init folds in 1)
DROPOUT_STREAM = 2


class DropoutRng(NamedTuple):
    """The adapters' dropout's random state, a leaf of the optimizer state: the run's seed
    (``with_dropout_seed`` sets it) and the updates done so far."""

    seed: jax.Array  # uint32 scalar
    step: jax.Array  # int32 scalar


def dropout_rng() -> optax.GradientTransformation:
    """The optimizer part that counts updates for the dropout's keys (the updates pass
    unchanged)."""

    def init(params: Any) -> DropoutRng:
        del params
        return DropoutRng(jnp.zeros((), jnp.uint32), jnp.zeros((), jnp.int32))

    def update(updates: Any, state: DropoutRng, params: Any = None) -> tuple[Any, DropoutRng]:
        del params
        return updates, state._replace(step=state.step + 1)

    return optax.GradientTransformation(init, update)


def _is_rng(x: Any) -> bool:
    return isinstance(x, DropoutRng)


def with_dropout_seed(opt_state: Any, seed: int) -> Any:
    """``opt_state`` with its ``DropoutRng``'s seed set to the run's ``seed`` (where it is:
    unchanged without adapter dropout), on the devices the old seed was on."""

    def put(x: Any) -> Any:
        if not _is_rng(x):
            return x
        value = jnp.asarray(seed, jnp.uint32)
        where = getattr(x.seed, "sharding", None)
        return x._replace(seed=value if where is None else jax.device_put(value, where))

    return jax.tree_util.tree_map(put, opt_state, is_leaf=_is_rng)


def dropout_keys(rng: DropoutRng, rows: int) -> jax.Array:
    """One dropout key per batch row (``[rows, *key shape]`` key data) for the step ``rng``
    counts: the run's seed folded with ``DROPOUT_STREAM``, the step and the row."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(rng.seed), DROPOUT_STREAM), rng.step)
    return jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(jnp.arange(rows))


# the path element each group of ``AdapterConfig.train`` is recognised by: every norm's
# parameters sit under a ``norm`` module (``norm1.norm.scale``, ``norm_f.norm.bias``)
GROUP_PATHS: dict[str, str] = {"norm": "norm"}


def trainable_filter(adapters: AdapterConfig) -> Any:
    """The ``nnx`` filter of the parameters ``adapters`` train (every one without adapters)."""
    if not adapters.enabled:
        return nnx.Param
    groups = [nnx.PathContains(GROUP_PATHS[g]) for g in adapters.train]
    return nnx.Any(nnx.LoRAParam, *groups)


@dataclasses.dataclass(frozen=True)
class Trainable:
    """The split of a step's parameters (an ``nnx.State``) by ``adapters``: ``split`` gives
    ``(trained, frozen)`` (frozen None without adapters: every parameter trains), ``merge``
    puts them back together; both run inside the jitted step."""

    adapters: AdapterConfig

    @property
    def frozen_base(self) -> bool:
        return self.adapters.enabled

    def split(self, params: Any) -> tuple[Any, Any]:
        if not self.frozen_base:
            return params, None
        return nnx.split_state(params, trainable_filter(self.adapters), ...)

    def trained(self, params: Any) -> Any:
        """The subtree the optimizer updates (and holds state for)."""
        return self.split(params)[0]

    @property
    def dropout(self) -> bool:
        return self.adapters.enabled and self.adapters.dropout > 0

    def optimizer(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """``tx``, with the dropout's update counter (``DropoutRng``) under adapter dropout."""
        return optax.chain(tx, dropout_rng()) if self.dropout else tx

    def with_dropout_keys(self, batch: dict[str, Any], opt_state: Any) -> dict[str, Any]:
        """``batch`` with this step's dropout keys (``DROPOUT_KEYS``) under adapter dropout."""
        if not self.dropout:
            return batch
        (rng,) = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_rng) if _is_rng(x)]
        return {**batch, DROPOUT_KEYS: dropout_keys(rng, batch["inputs"].shape[0])}

    def merge(self, trained: Any, frozen: Any) -> Any:
        return trained if frozen is None else nnx.merge_state(trained, frozen)

    def bind(self, loss_fn: Any, params: Any) -> tuple[Any, Any, Any]:
        """``(trained, frozen, loss)``: ``loss(trained, batch)`` is ``loss_fn`` of the whole
        parameters with the frozen ones held (``(params, None, loss_fn)`` without adapters).
        Inside a trace only (the frozen part is closed over); from shapes, ``frozen_loss``."""
        trained, frozen = self.split(params)
        if frozen is None:
            return params, None, loss_fn
        return trained, frozen, lambda t, b: loss_fn(self.merge(t, frozen), b)

    def frozen_loss(self, loss_fn: Any, params: Any) -> tuple[Any, tuple]:
        """``(loss, (trained, frozen))``: ``loss(trained, batch, frozen)`` is ``loss_fn`` of the
        whole parameters, the frozen part an argument rather than a closure, so ``params`` may
        be shapes (``jax.make_jaxpr`` of its gradient: the FLOP counts)."""
        trained, frozen = self.split(params)
        return (lambda t, b, f: loss_fn(self.merge(t, f), b)), (trained, frozen)

    def counts(self, params: Any) -> tuple[int, int]:
        """``(trainable, frozen)`` parameter counts of ``params`` (arrays or shapes)."""
        trained, frozen = self.split(params)

        def size(tree: Any) -> int:
            return sum(x.size for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "size"))

        def frozen_size(tree: Any) -> int:
            # a packed base counts the weights it packs (nf4: two a byte), not its bytes
            plain, packed = nnx.split_state(tree, nnx.Not(PackedBase), PackedBase)
            weights = [v for p, v in nnx.to_flat_state(packed) if p[-1] == "packed"]
            return size(plain) + sum(v.size * (2 if v.dtype == jnp.uint8 else 1) for v in weights)

        return size(trained), (0 if frozen is None else frozen_size(frozen))


def counts_line(adapters: AdapterConfig, params: Any) -> str:
    """What the run's first line says of the adapters: their label and the parameter counts."""
    trained, frozen = Trainable(adapters).counts(params)
    return f"{adapters.label()}: {trained:,} trainable, {frozen:,} frozen parameters"


def refusal(spec: Any) -> str | None:
    """The one line saying why ``spec`` (a ``StepSpec``) cannot train its adapters yet, or
    None. Every flag named is the one to drop."""
    ad = spec.adapters
    if not ad.enabled:
        return None
    opt = spec.optimizer
    reasons = (
        (
            ad.base != "compute" and spec.parallel.shards_params,
            f"--quantize-base {ad.base} with --mesh {spec.parallel.mesh_text()}: packed "
            "base weights are not sharded yet; use dp or zero1, or drop --quantize-base",
        ),
        (
            opt.stream,
            "--stream: a streamed stack with adapters is not built yet; drop --stream "
            "(the frozen base has no optimizer state to stream)",
        ),
        (
            opt.state_memory != "device",
            f"--state-memory {opt.state_memory}: adapters keep "
            "their (small) optimizer state on the device; drop --state-memory",
        ),
        (
            opt.params_memory != "device",
            f"optimizer.params_memory={opt.params_memory!r}: "
            "adapters keep the parameters on the device; set it to device",
        ),
        (
            spec.accum.mode != "scan",
            f"--accum-mode {spec.accum.mode}: adapters accumulate "
            "with the scanned step; use --accum-mode scan",
        ),
    )
    return next((line for bad, line in reasons if bad), None)


def check_composes(spec: Any) -> None:
    """Raise ``ConfigError`` (``refusal``'s line) unless ``spec``'s adapters can be trained."""
    line = refusal(spec)
    if line is not None:
        raise ConfigError(line)

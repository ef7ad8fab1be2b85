"""A train step that streams the block stack's parameters through host memory (ZeRO-Offload's
idea, written with JAX memory spaces).

Between steps the stack's fp32 master parameters and their optimizer state live in host memory
(``pinned_host``); the embeddings, final norm and head stay on the device. Inside the step:

- each block's parameters are brought to the device inside the layer scan just before the block
  runs (``fetch``), and again for its backward under any remat policy that replays the block;
- ``fetch``'s backward sends each block's gradient to host memory as the backward produces it,
  so the stack's gradient never exists whole on the device;
- the stack's optimizer update runs on the device block by block (a scan over the layers: one
  block's parameters, gradient and state brought over, updated, sent back), with the same
  arithmetic as the unstreamed update (AdamW and SGD are elementwise; the gradient is divided
  by the same token count first).

What stays on the device is then one or two blocks' parameters and their update's working set,
the activations the memory policy keeps, and the embeddings and head with their state.

Over a mesh (``--mesh dp|zero1|fsdp=N``, ``jaxmem.sharding``) every device keeps its shard of the
stack in its host memory, placed as the unstreamed step places it: a block's shard is fetched to
the device and then all-gathered (fsdp), its gradient reduce-scattered and the shard sent to host
memory, and the update runs on each device's shards. XLA inserts the collectives, as it does for
the unstreamed step.

Written by hand (no library streams a scanned stack through JAX memory spaces): JAX types an
array's memory space, so the transfers are explicit ``jax.device_put(x, jax.memory.Space.*)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmem.compat import JAX
from jaxmem.config import OptimizerConfig
from jaxmem.model import LayersFn
from jaxmem.model.decoder import STACK_PATH
from jaxmem.parallel import ParallelConfig
from jaxmem.sharding import StepShardings, tree_shardings
from jaxmem.step.scaling import all_finite
from jaxmem.step.train_step import (
    _split_microbatches,
    _subtree,
    learning_rate,
    tree_bytes,
    valid_tokens,
)

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def host_computation(fn: Any, out_memory_spaces: Any) -> Any:
    """``fn`` (jitted) for XLA to run on the host, where its operands live; its outputs in
    ``out_memory_spaces`` (a prefix of its output tree of ``jax.memory.Space`` values: jax >=
    0.11 asks for them; up to 0.10 the caller moves the outputs where they belong)."""
    from jax.experimental.compute_on import compute_on

    if JAX >= (0, 11):
        return compute_on(fn, compute_type="device_host", out_memory_spaces=out_memory_spaces)
    return compute_on("device_host")(fn)


@jax.custom_vjp
def fetch(tree: Any) -> Any:
    """``tree`` (in host memory) on the device; its cotangent goes back to host memory."""
    return jax.tree_util.tree_map(lambda a: jax.device_put(a, DEVICE), tree)


def _fetch_fwd(tree: Any) -> tuple[Any, None]:
    return fetch(tree), None


def _fetch_bwd(_: None, ct: Any) -> tuple[Any]:
    return (jax.tree_util.tree_map(lambda g: jax.device_put(g, HOST), ct),)


fetch.defvjp(_fetch_fwd, _fetch_bwd)


def streamed_layers_fn(layers_fn: LayersFn) -> LayersFn:
    """``layers_fn`` with each block's parameters fetched from host memory inside the block
    (so a remat policy that replays the block fetches them again for its backward)."""

    def run(layer_fn: Callable, x: jax.Array, stacked: Any) -> jax.Array:
        return layers_fn(lambda h, state, **mlp: layer_fn(h, fetch(state), **mlp), x, stacked)

    return run


def split(params: Any) -> tuple[Any, Any]:
    """(the parameters outside the stack, the stack's), as pure dicts."""
    pure = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
    stack = _subtree(pure, STACK_PATH)
    rest = jax.tree_util.tree_map(lambda a: a, pure)  # a fresh copy of the containers
    parent = _subtree(rest, STACK_PATH[:-1])
    del parent[STACK_PATH[-1]]
    return rest, stack


def join(params: Any, rest: Any, stack: Any) -> Any:
    """``params`` (an ``nnx.State``) with ``rest`` and ``stack`` as its values."""
    pure = jax.tree_util.tree_map(lambda a: a, rest)
    _subtree(pure, STACK_PATH[:-1])[STACK_PATH[-1]] = stack
    out = jax.tree_util.tree_map(lambda a: a, params)
    out.replace_by_pure_dict(pure)
    return out


def init_state(tx: optax.GradientTransformation, params: Any) -> tuple[Any, Any]:
    """The optimizer state of a streamed step: (rest's, the stack's)."""
    rest, stack = split(params)
    return tx.init(rest), tx.init(stack)


def _sum_squares(tree: Any) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(tree)
    return sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves), jnp.float32(0))


def _stack_update(tx, params_h, grads_h, state_h, divisor, finite=None):
    """The stack's update, block by block on the device: returns (params, state) in host memory
    and the divided gradient's sum of squares. ``finite`` (fp16's dynamic loss scale): where
    False, every block keeps its parameters and state (the fetched old values written back)."""
    leaves, treedef = jax.tree_util.tree_flatten(state_h)
    per_block = [i for i, a in enumerate(leaves) if a.ndim >= 1]
    shared = {i: a for i, a in enumerate(leaves) if a.ndim == 0}  # AdamW's step count

    def body(sq, xs):
        p, g, blocks = jax.tree_util.tree_map(lambda a: jax.device_put(a, DEVICE), xs)
        g = jax.tree_util.tree_map(lambda t: (t / divisor).astype(t.dtype), g)
        state_leaves = [
            blocks[per_block.index(i)] if i in per_block else jax.device_put(shared[i], DEVICE)
            for i in range(len(leaves))
        ]
        updates, new_state = tx.update(g, jax.tree_util.tree_unflatten(treedef, state_leaves), p)
        new_p = optax.apply_updates(p, updates)
        new_leaves = jax.tree_util.tree_leaves(new_state)
        if finite is not None:
            new_p = _keep(finite, new_p, p)
            new_leaves = _keep(finite, new_leaves, state_leaves)
        out = (new_p, [new_leaves[i] for i in per_block], [new_leaves[i] for i in shared])
        return sq + _sum_squares(g), jax.tree_util.tree_map(lambda a: jax.device_put(a, HOST), out)

    blocks = [leaves[i] for i in per_block]
    sq, (new_params, new_blocks, new_shared) = jax.lax.scan(
        body, jnp.float32(0), (params_h, grads_h, blocks)
    )
    new_leaves = list(leaves)
    for i, a in zip(per_block, new_blocks, strict=True):
        new_leaves[i] = a
    for i, a in zip(shared, new_shared, strict=True):
        new_leaves[i] = a[0]  # the same in every block; in host memory with the rest
    return new_params, jax.tree_util.tree_unflatten(treedef, new_leaves), sq


def _host_stack_update(tx, params_h, grads_h, state_h, divisor, finite=None):
    """The stack's update in host memory (``compute_on("device_host")``: XLA runs it on the
    host, where the parameters, gradient and state live); returns (params, state) in host
    memory and the divided gradient's sum of squares. The same arithmetic as on the device,
    ``finite`` too."""

    @jax.jit
    def update(p, g, s, d, ok):
        g = jax.tree_util.tree_map(lambda t: (t / d).astype(t.dtype), g)
        updates, new_s = tx.update(g, s, p)
        new_p = optax.apply_updates(p, updates)
        if ok is not None:
            new_p, new_s = _keep(ok, new_p, p), _keep(ok, new_s, s)
        return new_p, new_s, _sum_squares(g)

    ok = None if finite is None else jax.device_put(finite, HOST)
    on_host = host_computation(update, (HOST, HOST, HOST))
    new_p, new_s, sq = on_host(params_h, grads_h, state_h, jax.device_put(divisor, HOST), ok)
    # a scalar the host computation returns (AdamW's count) may come back in device memory
    return new_p, jax.device_put(new_s, HOST), jax.device_put(sq, DEVICE)


def _keep(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``finite``, else ``old`` (a skipped fp16 step)."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)


def _stack_finite(grads_h: Any) -> jax.Array:
    """Whether every element of the stack's gradient (in host memory) is finite, computed on
    the host (``compute_on("device_host")``): it reads the gradient where it lies, so fp16's
    skip decision costs no host-link traffic."""

    @jax.jit
    def check(g):
        return all_finite(g)

    return jax.device_put(host_computation(check, HOST)(grads_h), DEVICE)


def _blockwise(fn: Callable[..., Any], *trees_h: Any) -> Any:
    """``fn`` of stacked trees in host memory, block by block on the device, the result back in
    host memory (the stack's running gradient never exists whole on the device)."""

    def body(_, blocks):
        on_device = jax.tree_util.tree_map(lambda t: jax.device_put(t, DEVICE), blocks)
        return None, jax.tree_util.tree_map(lambda t: jax.device_put(t, HOST), fn(*on_device))

    return jax.lax.scan(body, None, trees_h)[1]


def _summed(grad_fn: Any, rest: Any, stack_h: Any, micro: Any, accum_dtype: Any) -> tuple:
    """Gradients, loss sum and valid tokens summed over the microbatches ``micro`` as
    ``summed_grads`` sums them (every microbatch added to zeros in ``accum_dtype``, in order):
    the rest's on the device, the stack's block by block in host memory."""

    def add(acc: Any, g: Any) -> Any:
        return jax.tree_util.tree_map(lambda a, x: a + x.astype(accum_dtype), acc, g)

    def zeros(tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, accum_dtype), tree)

    def body(carry, b):
        acc_rest, acc_stack, s_acc, n_acc = carry
        (g_r, g_s), (s, n) = grad_fn(rest, stack_h, b)
        acc_stack = _blockwise(add, acc_stack, g_s)
        return (add(acc_rest, g_r), acc_stack, s_acc + s, n_acc + n), None

    wide_float = jnp.result_type(float)
    init = (
        zeros(rest),
        _blockwise(zeros, stack_h),
        jnp.zeros((), wide_float),
        jnp.zeros((), wide_float),
    )
    return jax.lax.scan(body, init, micro)[0]


def make_streamed_step(
    make_loss: Callable[[LayersFn], Callable[..., tuple]],
    layers_fn: LayersFn,
    tx: optax.GradientTransformation,
    *,
    accum_steps: int = 1,
    accum_dtype: Any = jnp.float32,
    donate: bool = True,
    shardings: StepShardings | None = None,
    placement: Placement | None = None,
    update: str = "device",
    opt_cfg: OptimizerConfig | None = None,
) -> Callable[..., tuple]:
    """A jitted ``step(params, opt_state, loss_scale, batch) -> (params, opt_state, loss_scale,
    metrics)`` like ``train_step.make_train_step``'s, streaming the stack (module docstring).
    ``loss_scale``: fp16's ``DynamicLossScale`` (or None), applied as the unstreamed step
    applies it; a step with a non-finite gradient keeps every parameter and state (decided
    before the stack's update starts: its gradient is checked in host memory, on the host).
    ``opt_state`` is ``init_state``'s; the stack's parameters and state enter and leave in host
    memory. ``make_loss(layers_fn)`` is the loss with the stack run by ``layers_fn``.

    With ``accum_steps`` microbatches the gradients are summed as ``summed_grads`` sums them
    (in ``accum_dtype``, in microbatch order, divided once): the rest's on the device, the
    stack's in host memory, added block by block.

    Over a mesh: ``shardings`` (the unstreamed step's) and ``placement`` (``placement(...)`` of
    them): the step's inputs and outputs are placed by it; ``make_loss`` gathers the weights at
    use (``jaxmem.sharding.parallel_loss``), after each block's shard is fetched.

    ``update``: where the stack's update runs, ``device`` (block by block) or ``host`` (in host
    memory, ``_host_stack_update``). ``opt_cfg``: the metrics carry the update's learning
    rate (``train_step.learning_rate``)."""
    loss_fn = make_loss(streamed_layers_fn(layers_fn))
    micro_sharding = shardings.micro() if shardings is not None else None

    def step(params, opt_state, loss_scale, batch):
        rest, stack = split(params)
        stack_h = jax.device_put(stack, HOST)  # where it lives between steps: a no-op there
        state_rest, state_stack = opt_state
        state_stack = jax.device_put(state_stack, HOST)
        # fp16: GradScaler's scale on the mean loss, as the unstreamed step applies it
        factor = None if loss_scale is None else loss_scale.scale / valid_tokens(batch)

        def scaled_sum(r, s, b):
            loss_sum, n = loss_fn(join(params, r, s), b)[1]
            return loss_sum if factor is None else loss_sum * factor, (loss_sum, n)

        grad_fn = jax.grad(scaled_sum, argnums=(0, 1), has_aux=True)
        if accum_steps == 1:
            (g_rest, g_stack), (loss_sum, n_tokens) = grad_fn(rest, stack_h, batch)
        else:
            micro = _split_microbatches(batch, accum_steps)
            if micro_sharding is not None:
                micro = jax.lax.with_sharding_constraint(micro, micro_sharding)
            summed = _summed(grad_fn, rest, stack_h, micro, accum_dtype)
            g_rest, g_stack, loss_sum, n_tokens = summed
        divisor = n_tokens if loss_scale is None else loss_scale.scale
        g_rest = jax.tree_util.tree_map(lambda g: (g / divisor).astype(g.dtype), g_rest)
        # fp16: whether to apply this step is known before any block is updated (the stack's
        # gradient checked where it lies, in host memory), so a skipped step writes the old
        # values back and never needs them from host memory again
        finite = None
        if loss_scale is not None:
            finite = jnp.logical_and(all_finite(g_rest), _stack_finite(g_stack))
        updates, new_state_rest = tx.update(g_rest, state_rest, rest)
        new_rest = optax.apply_updates(rest, updates)
        if finite is not None:
            new_rest = _keep(finite, new_rest, rest)
            new_state_rest = _keep(finite, new_state_rest, state_rest)
            loss_scale = loss_scale.update(finite)
        stack_update = _host_stack_update if update == "host" else _stack_update
        new_stack, new_state_stack, sq = stack_update(
            tx, stack_h, g_stack, state_stack, divisor, finite
        )
        total_sq = _sum_squares(g_rest) + sq
        metrics = {
            "loss": loss_sum / n_tokens,
            "n_tokens": n_tokens,
            "grad_norm": jnp.sqrt(total_sq),
            "grads_finite": jnp.isfinite(total_sq) if finite is None else finite,
        }
        if opt_cfg is not None and opt_cfg.scheduled:
            metrics["lr"] = learning_rate(opt_cfg, state_rest)
        new_params = join(params, new_rest, new_stack)
        return new_params, (new_state_rest, new_state_stack), loss_scale, metrics

    # A deviceless compile drops the arguments' memory kinds, so the stack arrives there in
    # device memory; donating it to a host-memory output fails XLA's host-offload check: plans
    # compile with donate=False (``plan_bytes`` then counts the aliasing from shapes).
    donated = (0, 1) if donate else ()
    if shardings is None:
        return jax.jit(step, donate_argnums=donated)
    assert placement is not None, "a sharded streamed step needs its placement"
    rep = shardings.replicated
    return jax.jit(
        step,
        donate_argnums=donated,
        in_shardings=(placement.params, placement.opt_state, rep, shardings.batch),
        out_shardings=(placement.params, placement.opt_state, rep, rep),
    )


class Placement(NamedTuple):
    """Where a streamed step's parameters and optimizer state live (trees of shardings, as
    ``place`` and ``make_streamed_step`` take them)."""

    params: Any
    opt_state: tuple[Any, Any]


def placement(
    tx: optax.GradientTransformation,
    params: Any,
    shardings: StepShardings,
    parallel: ParallelConfig,
) -> Placement:
    """The shardings of a streamed step over ``shardings.mesh``: every array placed as the
    unstreamed step places it (``jaxmem.sharding``: fsdp shards the parameters, zero1/fsdp the
    optimizer state, never on the stacked layer axis), the stack's in ``pinned_host``."""
    rest_sh, stack_sh = split(shardings.params)
    stack_sh = jax.tree_util.tree_map(lambda s: s.with_memory_kind("pinned_host"), stack_sh)
    state_rest, state_stack = jax.eval_shape(lambda p: init_state(tx, p), params)
    m, sharded = shardings.mesh, parallel.shards_opt_state
    return Placement(
        params=join(shardings.params, rest_sh, stack_sh),
        opt_state=(
            tree_shardings(state_rest, m, sharded),
            tree_shardings(state_stack, m, sharded, "pinned_host", stacked=True),
        ),
    )


def place(
    params: Any, opt_state: tuple[Any, Any], where: Placement | None = None
) -> tuple[Any, tuple[Any, Any]]:
    """``params`` and ``opt_state`` where a streamed step takes them: the stack's parameters and
    state in ``pinned_host``, the rest on the device; on the first device, or by ``where``."""
    if where is not None:
        return jax.device_put(params, where.params), jax.device_put(opt_state, where.opt_state)
    from jax.sharding import SingleDeviceSharding

    host = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    rest, stack = split(params)
    return join(params, rest, jax.device_put(stack, host)), (
        opt_state[0],
        jax.device_put(opt_state[1], host),
    )


def host_bytes(params: Any, opt_state: Any) -> int:
    """Bytes a streamed step keeps in host memory between steps (the stack's parameters and
    optimizer state), from shapes."""
    _, stack = split(params)
    return tree_bytes(stack) + tree_bytes(opt_state[1])

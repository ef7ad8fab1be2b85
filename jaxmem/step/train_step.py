"""Optimizers and the jitted training step: precision, loss scaling, gradient accumulation and
optimizer-state placement, all driven by config objects.

The step is a pure function of ``(params, opt_state, loss_scale, batch)``; parameters and
optimizer state are donated so XLA updates them in place instead of holding two copies.
Accumulation sums loss sums, valid-token counts and gradients over microbatches and divides
once: a mean of per-microbatch means would weight tokens unequally whenever microbatches hold
different numbers of valid tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxmem.config import AccumConfig, ConfigError, OptimizerConfig
from jaxmem.memory.remat import accumulates_in_place, accumulating_layers_fn
from jaxmem.model import STACK_PATH
from jaxmem.model.decoder import DROPOUT_KEYS
from jaxmem.model.loss import chunked_lm_loss, cross_entropy_sum
from jaxmem.policy import MemoryPolicy
from jaxmem.precision import PRECISIONS, Precision
from jaxmem.step.scaling import all_finite

# matrices; biases and norm scales are not decayed. Adapters' A and B are decayed, as the
# Hugging Face Trainer decays every parameter of a PEFT model but biases and norms.
DECAYED_LEAVES = ("kernel", "embedding", "lora_a", "lora_b")
FP32 = PRECISIONS["fp32"]
NO_ACCUM = AccumConfig()
# Bumped whenever what the step runs changes outside a policy's translation (which has
# ``remat.REMAT_REVISION``): benchmarks that keep measured rows re-measure older ones.
# 2: the loss's own VJP (``jaxmem.model.loss.token_nll``).
STEP_REVISION = 2


def _param_name(path: tuple) -> str:
    """The parameter's own name (``kernel``, ``bias``, ...): the last dict key of its path (an
    NNX ``Param`` adds a trailing ``.value`` attribute key, which is skipped)."""
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]


def decay_mask(params: nnx.State) -> Any:
    """True for the leaves that get weight decay (Linear kernels and embedding tables)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _param_name(path) in DECAYED_LEAVES, params
    )


def make_schedule(cfg: OptimizerConfig) -> optax.ScalarOrSchedule:
    """The learning rate of ``cfg`` as optax gives it: the float ``lr`` when it never changes,
    else an optax schedule of the update count (``OptimizerConfig``: linear warmup from 0, then
    held, cosine or linear decay to ``min_lr`` at ``decay_steps``)."""
    if not cfg.scheduled:
        return cfg.lr
    warm = cfg.warmup_steps
    if cfg.schedule != "constant" and cfg.decay_steps is None:
        raise ConfigError(
            f"schedule={cfg.schedule!r} needs decay_steps (the schedule's length, warmup "
            "included; a job sets it to run.steps)"
        )
    if cfg.schedule == "cosine":
        # optax counts decay_steps with the warmup in it, as OptimizerConfig does
        return optax.warmup_cosine_decay_schedule(
            0.0, cfg.lr, warm, cfg.decay_steps, end_value=cfg.min_lr
        )
    if cfg.schedule == "linear":
        after = optax.linear_schedule(cfg.lr, cfg.min_lr, cfg.decay_steps - warm)
    else:
        after = optax.constant_schedule(cfg.lr)
    if not warm:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warm), after], [warm])


def learning_rate(cfg: OptimizerConfig, opt_state: Any) -> jax.Array:
    """The learning rate the next update of ``opt_state`` applies: ``cfg.lr``, or the schedule
    at the count optax's ``scale_by_schedule`` keeps (inside ``MultiSteps`` or a streamed
    step's pair of states too: the first found, they all count alike)."""
    lr = make_schedule(cfg)
    if not callable(lr):
        return jnp.asarray(lr, jnp.float32)
    counts = [
        count
        for path, count in optax.tree_utils.tree_get_all_with_path(opt_state, "count")
        if getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState"
    ]
    return jnp.asarray(lr(counts[0]), jnp.float32)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """optax transformation with the ``torch.optim`` semantics described in
    ``OptimizerConfig``: the learning rate ``make_schedule``'s, the gradient clipped to
    ``cfg.clip_norm`` first when set. Under ``optax.MultiSteps`` all of it runs once per
    optimizer step, on the summed gradient."""
    lr = make_schedule(cfg)
    if cfg.name == "adamw":
        # eps outside the square root, bias correction on both moments, decay lr * wd * param.
        tx = optax.adamw(
            learning_rate=lr,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    elif cfg.name == "sgd":
        # torch.optim.SGD: g += wd * p, then buf = momentum * buf + g, p -= lr * buf.
        tx = optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
            optax.sgd(lr, momentum=cfg.momentum),
        )
    elif cfg.name == "adafactor":
        tx = optax.adafactor(
            learning_rate=lr,
            weight_decay_rate=cfg.weight_decay or None,
            weight_decay_mask=decay_mask,
        )
    else:
        raise ValueError(f"optimizer={cfg.name!r} is not supported")
    if cfg.clips:
        # torch: clip_grad_norm_ on the gradient, then optimizer.step(); SGD's L2 decay is added
        # after the clip in both
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
    return tx


def lm_loss_fn(
    graphdef: nnx.GraphDef, *, loss_chunks: int = 0, **model_kwargs: Any
) -> Callable[..., tuple]:
    """``loss(params, batch) -> (mean_loss, (loss_sum, n_tokens))`` for next-token prediction.

    ``batch`` is ``{"inputs": [B, S] ids, "targets": [B, S] ids, "mask": [B, S] (optional)}``,
    and the adapters' dropout keys where the training step adds them (``DROPOUT_KEYS``).
    ``loss_chunks`` (``LossPolicy.chunks``): 0 computes the whole logits and keeps them
    for the backward; N runs the head and loss over N sequence chunks with each chunk's gradients
    formed in the forward (``chunked_lm_loss``).
    """

    def loss(params: nnx.State, batch: dict[str, jax.Array]):
        model = nnx.merge(graphdef, params)
        kw = {**model_kwargs, "dropout_keys": batch.get(DROPOUT_KEYS)}
        if loss_chunks:
            head, head_params = model.head()
            x = model.features(batch["inputs"], **kw)
            layout = model_kwargs.get("layout")  # a sequence split over devices: tiled per shard
            shards = 1 if layout is None else layout.shards
            loss_sum, n_tokens = chunked_lm_loss(
                head, head_params, x, batch["targets"], batch.get("mask"), chunks=loss_chunks,
                shards=shards,
            )  # fmt: skip
        else:
            logits = model(batch["inputs"], **kw)
            loss_sum, n_tokens = cross_entropy_sum(logits, batch["targets"], batch.get("mask"))
        return loss_sum / n_tokens, (loss_sum, n_tokens)

    return loss


def _split_microbatches(batch: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
    def split(a):
        if a.shape[0] % k:
            raise ValueError(f"batch size {a.shape[0]} is not divisible by accum steps {k}")
        return a.reshape(k, a.shape[0] // k, *a.shape[1:])

    return jax.tree_util.tree_map(split, batch)


def summed_grads(
    loss_fn: Callable[..., tuple],
    params: Any,
    batch: dict[str, jax.Array],
    *,
    accum_steps: int = 1,
    accum_dtype: Any = jnp.float32,
    scale: jax.Array | None = None,
    micro_sharding: Any = None,
    loss_into: Callable[[Any], Callable[..., tuple]] | None = None,
) -> tuple[Any, jax.Array, jax.Array]:
    """``(d(scale * Σ loss_sum)/dθ, Σ loss_sum, Σ n_tokens)`` over ``accum_steps`` microbatches.

    Nothing is divided here: the caller divides once by the total token count (and the scale).
    ``micro_sharding``: where the ``[k, B/k, ...]`` microbatch stack lives (data parallel: each
    microbatch split over the devices, not whole microbatches per device).
    ``loss_into(acc)``: the same loss with its block stack adding its gradient into ``acc``
    (the running sum at ``STACK_PATH``; ``stack_accumulating_loss``); given, the stack's
    gradient is accumulated in place, else each microbatch's whole gradient is added.
    """

    def scaled(loss_sum, n_tokens):
        return (loss_sum if scale is None else loss_sum * scale), (loss_sum, n_tokens)

    def scaled_sum(p, b):
        return scaled(*loss_fn(p, b)[1])

    grad_fn = jax.grad(scaled_sum, has_aux=True)
    if accum_steps == 1:
        grads, (loss_sum, n_tokens) = grad_fn(params, batch)
        return grads, loss_sum, n_tokens

    def add(a, x):
        return a + x.astype(accum_dtype)

    def body(carry, micro):
        g_acc, s_acc, n_acc = carry
        if loss_into is None:
            g, (s, n) = grad_fn(params, micro)
            g_acc = jax.tree_util.tree_map(add, g_acc, g)
        else:
            # d/d(acc) of the stack is acc + this microbatch's stack gradient (added block by
            # block in the backward); the stacked parameters' own gradient is zero (unused)
            (g, stack), (s, n) = jax.grad(
                lambda p, acc: scaled(*loss_into(acc)(p, micro)[1]), argnums=(0, 1), has_aux=True
            )(params, _subtree(g_acc, STACK_PATH))
            g_acc = _with_subtree(jax.tree_util.tree_map(add, g_acc, g), STACK_PATH, stack)
        return (g_acc, s_acc + s, n_acc + n), None

    zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, accum_dtype), params)
    # float32 sums (float64 when x64 is on: a float64 model's loss sums are float64)
    wide_float = jnp.result_type(float)
    init = (zeros, jnp.zeros((), wide_float), jnp.zeros((), wide_float))
    micro = _split_microbatches(batch, accum_steps)
    if micro_sharding is not None:
        micro = jax.lax.with_sharding_constraint(micro, micro_sharding)
    (grads, loss_sum, n_tokens), _ = jax.lax.scan(body, init, micro)
    return grads, loss_sum, n_tokens


def _subtree(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _with_subtree(tree: Any, path: tuple[str, ...], value: Any) -> Any:
    """``tree`` (a fresh tree: it is updated) with its subtree at ``path`` replaced."""
    _subtree(tree, path[:-1])[path[-1]] = value
    return tree


def stack_accumulating_loss(
    make_loss: Callable[[Any], Callable[..., tuple]],
    policy: MemoryPolicy,
    n_layers: int,
    accum: AccumConfig,
) -> Callable[[Any], Callable[..., tuple]] | None:
    """``summed_grads``'s ``loss_into`` for ``make_loss(layers_fn)`` under ``policy``: None
    without accumulation, with ``accum.inplace`` off, or for an unrolled stack (which
    accumulates with the scan carry)."""
    if accum.steps == 1 or not accum.inplace or not accumulates_in_place(policy, n_layers):
        return None
    return lambda acc: make_loss(accumulating_layers_fn(policy, n_layers, acc))


def valid_tokens(batch: dict[str, jax.Array]) -> jax.Array:
    """Number of tokens the loss counts: the mask's sum, or every target without a mask."""
    if batch.get("mask") is not None:
        return batch["mask"].astype(jnp.float32).sum()
    return jnp.asarray(batch["targets"].size, jnp.float32)


def memory_sharding(kind: str, device: jax.Device | None = None) -> SingleDeviceSharding:
    return SingleDeviceSharding(device or jax.devices()[0], memory_kind=kind)


def place(tree: Any, kind: str, shardings: Any = None) -> Any:
    """Put every array of ``tree`` in memory kind ``kind`` (``device`` or ``pinned_host``): on
    the first device, or where ``shardings`` (a matching tree) puts each leaf."""
    if shardings is None:
        return jax.device_put(tree, memory_sharding(kind))
    return jax.device_put(
        tree, jax.tree_util.tree_map(lambda s: s.with_memory_kind(kind), shardings)
    )


def make_train_step(
    loss_fn: Callable[..., tuple],
    tx: optax.GradientTransformation,
    *,
    precision: Precision = FP32,
    accum: AccumConfig = NO_ACCUM,
    opt_cfg: OptimizerConfig | None = None,
    shardings: Any = None,
    loss_into: Callable[[Any], Callable[..., tuple]] | None = None,
    trainable: Any = None,
) -> Callable[..., tuple]:
    """A jitted ``step(params, opt_state, loss_scale, batch) -> (params, opt_state, loss_scale,
    metrics)``, donating params and optimizer state. ``loss_scale`` is a ``DynamicLossScale``
    for fp16 precision and None otherwise; an fp16 step with non-finite gradients leaves params
    and optimizer state unchanged and halves the scale. ``metrics`` stay on device.

    With ``opt_cfg.state_memory == "pinned_host"`` the optimizer state enters and leaves the step in
    host memory, brought to the device only for the update (likewise ``params_memory``).

    ``shardings`` (``jaxmem.sharding.StepShardings``): the step runs over its mesh, inputs and
    outputs placed by it (the updated parameters and state leave sharded as they came in).

    ``loss_into`` (``stack_accumulating_loss``): with accumulation, the block stack's gradient
    is added into the running sum in place (see ``summed_grads``).
    ``trainable`` (``jaxmem.step.frozen.Trainable.bind``): only the trained subtree is
    differentiated and updated (``opt_state`` is its); the frozen parameters pass through.
    """
    if accum.mode != "scan":
        raise ValueError("make_train_step runs scan accumulation; use make_multisteps_step")
    state_kind = opt_cfg.state_memory if opt_cfg else "device"
    params_kind = opt_cfg.params_memory if opt_cfg else "device"

    p_sh = shardings.params if shardings is not None else None
    o_sh = shardings.opt_state if shardings is not None else None

    def step(params, opt_state, loss_scale, batch):
        params = place(params, "device", p_sh) if params_kind != "device" else params
        opt_state = place(opt_state, "device", o_sh) if state_kind != "device" else opt_state
        # GradScaler scales the *mean* loss; the batch's valid-token count is known before the
        # forward, so each microbatch's summed loss is weighted by scale / n_total (fp16
        # overflow then happens at the same scales as in PyTorch).
        factor = None if loss_scale is None else loss_scale.scale / valid_tokens(batch)
        if trainable is not None:  # the adapters' dropout keys of this step, one per row
            batch = trainable.with_dropout_keys(batch, opt_state)
        params, frozen, of = (
            (params, None, loss_fn) if trainable is None else trainable.bind(loss_fn, params)
        )
        grads, loss_sum, n_tokens = summed_grads(
            of,
            params,
            batch,
            accum_steps=accum.steps,
            accum_dtype=jnp.dtype(precision.accum_dtype),
            scale=factor,
            micro_sharding=shardings.micro() if shardings is not None else None,
            loss_into=loss_into,
        )
        divisor = n_tokens if loss_scale is None else loss_scale.scale
        # With accumulation the norm reads the summed gradient (a buffer of its own, the
        # accumulator), before the division the update reads: reading the divided one makes
        # XLA:CPU keep it whole beside the update's temporaries (small, fp32, full, Adafactor,
        # 16 x 256 in 16 microbatches: 53.5 -> 41.3 MiB). Without, the gradient is the
        # backward's output and the norm reads the divided gradient; reading it before the
        # division plans the same peak (`none`, scanned / unrolled: gpt2-124m bf16 8 x 1024 for
        # an H100 13.30 / 10.53 GB, small fp32 16 x 256 on XLA:CPU 575 / 565 MB).
        summed_norm = optax.tree.norm(grads) / divisor if accum.steps > 1 else None
        grads = jax.tree_util.tree_map(lambda g: (g / divisor).astype(g.dtype), grads)
        grad_norm = summed_norm if summed_norm is not None else optax.tree.norm(grads)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = all_finite(grads)
        if loss_scale is not None:
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_params = jax.tree_util.tree_map(keep, new_params, params)
            new_opt_state = jax.tree_util.tree_map(keep, new_opt_state, opt_state)
            loss_scale = loss_scale.update(finite)
        new_params = new_params if frozen is None else trainable.merge(new_params, frozen)
        if params_kind != "device":
            new_params = place(new_params, params_kind, p_sh)
        if state_kind != "device":
            new_opt_state = place(new_opt_state, state_kind, o_sh)
        metrics = {
            "loss": loss_sum / n_tokens,
            "n_tokens": n_tokens,
            "grad_norm": grad_norm,
            "grads_finite": finite,
        }
        if opt_cfg is not None and opt_cfg.scheduled:
            metrics["lr"] = learning_rate(opt_cfg, opt_state)
        return new_params, new_opt_state, loss_scale, metrics

    if shardings is None:
        return jax.jit(step, donate_argnums=(0, 1))
    rep = shardings.replicated
    return jax.jit(
        step,
        donate_argnums=(0, 1),
        in_shardings=(p_sh, o_sh, rep, shardings.batch),
        out_shardings=(p_sh, o_sh, rep, rep),
    )


def make_multisteps_step(
    loss_fn: Callable[..., tuple],
    tx: optax.GradientTransformation,
    accum_steps: int,
    opt_cfg: OptimizerConfig | None = None,
) -> tuple[optax.GradientTransformation, Callable[..., tuple]]:
    """``optax.MultiSteps`` accumulation: returns ``(multi_tx, micro_step)``.

    ``micro_step(params, opt_state, micro_batch, n_total)`` is called once per microbatch with
    ``n_total``, the valid-token count of the whole batch; the parameters change on every
    ``accum_steps``-th call. MultiSteps sums (``use_grad_mean=False``) gradients of
    ``loss_sum / n_total``, which add up to the big batch's mean gradient. The inner ``tx``
    (its clipping and schedule too) runs once per ``accum_steps`` calls, on that sum; with a
    scheduled ``opt_cfg`` the metrics carry the learning rate of the update the call is part of.
    """
    multi = optax.MultiSteps(tx, every_k_schedule=accum_steps, use_grad_mean=False)

    def micro_step(params, opt_state, micro_batch, n_total):
        def normalised(p):
            loss_sum, n = loss_fn(p, micro_batch)[1]
            return loss_sum / n_total, (loss_sum, n)

        grads, (loss_sum, n) = jax.grad(normalised, has_aux=True)(params)
        metrics = {"loss_sum": loss_sum, "n": n}
        if opt_cfg is not None and opt_cfg.scheduled:
            metrics["lr"] = learning_rate(opt_cfg, opt_state)
        updates, opt_state = multi.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return multi, jax.jit(micro_step, donate_argnums=(0, 1))


def tree_bytes(tree: Any) -> int:
    """Bytes held by the array leaves of ``tree`` (counted from shapes and dtypes)."""
    return sum(
        math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype")
    )


def check_precision_backend(precision: Precision, device: jax.Device | None = None) -> None:
    """Raise ``ConfigError`` if the backend cannot compute in ``precision``'s dtypes.

    TPUs have no float16 arithmetic; elsewhere a one-element matmul is compiled and run in each
    16-bit dtype the precision uses, so an unsupported backend fails here, with the fix, rather
    than in the middle of a compile.
    """
    device = device or jax.devices()[0]
    for dtype in {precision.compute_dtype, precision.param_dtype} - {"float32"}:
        if dtype == "float16" and device.platform == "tpu":
            raise ConfigError(
                f"precision {precision.name!r} computes in float16, which {device.platform} "
                "does not support; use bf16"
            )
        try:
            x = jax.device_put(jnp.ones((1, 1), dtype), device)
            jax.block_until_ready(jnp.dot(x, x))
        except Exception as e:  # backends raise their own error types
            raise ConfigError(
                f"precision {precision.name!r} needs {dtype}, which this {device.platform} "
                f"backend rejects ({type(e).__name__}); use fp32 or bf16"
            ) from None

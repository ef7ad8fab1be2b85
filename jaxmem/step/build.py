"""``build_step``: the one place jaxmem's training step is assembled from a ``StepSpec``.

Everything that differs between steps is decided here, once, from the spec: the optimizer, how
the stack runs under the memory policy (``jaxmem.memory.remat.layers_fn``), the loss (whole
logits or chunks), the mesh and the strategy's shardings, the stack streamed from host memory or
not, scan or ``optax.MultiSteps`` accumulation with the stack's gradient summed in place, and
where parameters and optimizer state live between steps. The trainer runs what it returns on
arrays (``BuiltStep.state``); the records and the planner lower it from shapes placed as the
trainer places its arrays (``BuiltStep.shapes``), so both compile the same program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxmem.memory.remat import layers_fn
from jaxmem.model import make_model
from jaxmem.model.qbase import quantize_base
from jaxmem.sharding import StepShardings, mesh, parallel_loss, step_shardings
from jaxmem.step import context, stream
from jaxmem.step.frozen import Trainable, check_composes
from jaxmem.step.scaling import init_loss_scale
from jaxmem.step.spec import StepSpec
from jaxmem.step.train_step import (
    lm_loss_fn,
    make_multisteps_step,
    make_optimizer,
    make_train_step,
    place,
    stack_accumulating_loss,
)

Loss = Callable[..., tuple]


def platform_of(spec: StepSpec) -> str:
    """The platform the step is built for: ``gpu`` for a GPU target, else this backend's."""
    return "gpu" if spec.target.is_gpu else jax.devices()[0].platform


def model_shapes(spec: StepSpec) -> nnx.Module:
    """The decoder of ``spec`` as shapes (no weights allocated), on the spec's platform (which
    picks the attention kernel)."""
    return nnx.eval_shape(
        lambda: make_model(
            spec.model, spec.precision, platform=platform_of(spec), adapters=spec.adapters
        )
    )


def batch_shapes(spec: StepSpec, rows: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of a batch of ``rows`` rows (default: the spec's whole batch)."""
    return batch_shapes_of(rows or spec.batch, spec.seq_len, masked=spec.loss_mask)


def batch_shapes_of(
    rows: int, seq_len: int, *, masked: bool = False
) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of a token batch: ``rows`` x ``seq_len`` int32 inputs and targets, and with
    ``masked`` (instruction data) an int32 loss mask of the same shape."""
    shape = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32)
    return {"inputs": shape, "targets": shape} | ({"mask": shape} if masked else {})


def _placed(tree: Any, where: Any) -> Any:
    """``tree``'s leaves as shape structs placed by the matching shardings of ``where``."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, where
    )


def _everywhere(tree: Any, sharding: Any) -> Any:
    """``tree``'s leaves as shape structs all placed by ``sharding`` (None stays None)."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
    )


@dataclasses.dataclass(frozen=True)
class BuiltStep:
    """A ``StepSpec``'s step and what runs beside it.

    Attributes:
      spec: what was built.
      graphdef: the decoder's structure (its parameters travel separately).
      tx: the optimizer (``optax.MultiSteps`` of it under ``multisteps`` accumulation).
      layers: how the stack runs under the policy.
      make_loss: ``make_loss(layers_fn)``: the loss with the stack run by ``layers_fn``, as the
        strategy runs it (laid out over the mesh).
      loss: the step's loss, ``make_loss(layers)``.
      plain_loss: the same loss on one device, no mesh (residual accounting reads it).
      eval_loss: jitted ``(params, batch) -> (loss_sum, n_tokens)``, parameters kept in host
        memory brought in as the step brings them.
      step: the jitted ``step(params, opt_state, loss_scale, batch) -> (params, opt_state,
        loss_scale, metrics)``; under ``multisteps`` accumulation the jitted
        ``micro_step(params, opt_state, micro_batch, n_total)`` of
        ``jaxmem.step.train_step.make_multisteps_step``.
      shardings: the strategy's shardings over the mesh (None on one device).
      placement: a streamed step's shardings over the mesh (None otherwise).
      trainable: which parameters the step trains (``jaxmem.step.frozen``): the optimizer's
        state is of ``trainable.trained(params)``, every parameter without adapters.
    """

    spec: StepSpec
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    layers: Any
    make_loss: Callable[[Any], Loss]
    loss: Loss
    plain_loss: Loss
    eval_loss: Any
    step: Any
    shardings: StepShardings | None
    placement: stream.Placement | None
    trainable: Trainable

    @property
    def params_sharding(self) -> Any:
        """Where the step takes the parameters over the mesh (None: the first device)."""
        if self.placement is not None:
            return self.placement.params
        return self.shardings.params if self.shardings is not None else None

    def init_state(self, params: Any) -> Any:
        """The optimizer's initial state of ``params`` as the step takes it, from shapes when
        ``params`` are shapes (placed nowhere)."""
        if self.spec.streamed:
            return jax.eval_shape(lambda p: stream.init_state(self.tx, p), params)
        return jax.eval_shape(lambda p: self.tx.init(self.trainable.trained(p)), params)

    def grad_shapes(self, params: Any, batch: Any) -> Any:
        """The shapes of the gradients the step forms of ``params`` on ``batch`` (the plain
        loss's): of the trained subtree only under a frozen base."""
        trained, frozen = self.trainable.split(params)

        def loss(t: Any, f: Any, b: Any) -> Any:
            return self.plain_loss(self.trainable.merge(t, f), b)[0]

        return jax.eval_shape(jax.grad(loss), trained, frozen, batch)

    def state(self, params: Any) -> tuple[Any, Any]:
        """``(params, opt_state)``: the arrays ``params`` and their optimizer's initial state,
        placed where the step takes them (host memory, the mesh's shards, a streamed stack in
        host memory)."""
        spec, opt = self.spec, self.spec.optimizer
        if spec.accum.mode == "multisteps":
            return params, self.tx.init(params)
        if self.shardings is not None:
            params = jax.device_put(params, self.shardings.params)
        if spec.streamed:
            return stream.place(params, stream.init_state(self.tx, params), self.placement)
        if self.shardings is not None:
            init = jax.jit(
                lambda p: self.tx.init(self.trainable.trained(p)),
                out_shardings=self.shardings.opt_state,
            )
            return params, init(params)
        opt_state = place(self.tx.init(self.trainable.trained(params)), opt.state_memory)
        return place(params, opt.params_memory), opt_state

    def shapes(self, params: Any, batch: Any = None) -> tuple[Any, Any, Any, Any]:
        """The step's arguments ``(params, opt_state, loss_scale, batch)`` as shape structs, placed
        over the mesh as ``state`` places the arrays (on one device: unplaced, so a GPU target's
        compile puts them on its device). ``batch``: the batch's shapes (default: the spec's)."""
        params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        opt_state = self.init_state(params)
        scale = init_loss_scale(self.spec.precision)  # fp16's dynamic loss scale (None otherwise)
        batch = batch if batch is not None else batch_shapes(self.spec)
        if self.shardings is None:
            return params, opt_state, scale, batch
        where = self.placement or self.shardings
        return (
            _placed(params, where.params),
            _placed(opt_state, where.opt_state),
            _everywhere(scale, self.shardings.replicated),
            _everywhere(batch, self.shardings.batch),
        )

    def lower(self, params: Any, batch: Any = None) -> Any:
        """The step lowered from ``shapes(params, batch)`` (XLA has not compiled it yet)."""
        return self.step.lower(*self.shapes(params, batch))


def _mesh_shardings(
    spec: StepSpec, tx: Any, params: Any, trainable: Trainable
) -> StepShardings | None:
    """The strategy's shardings over the spec's mesh: this backend's devices, or a GPU target's
    without any GPU (None on one device); the optimizer state's are of the trained subtree."""
    if not spec.sharded:
        return None
    devices = None
    if spec.target.is_gpu:
        from jaxmem.memory.gpu_plan import target_devices

        devices = target_devices(spec.target, spec.parallel.devices)
    opt = spec.optimizer
    return step_shardings(
        spec.parallel,
        params,
        jax.eval_shape(lambda p: tx.init(trainable.trained(p)), params),
        state_memory=opt.state_memory,
        params_memory=opt.params_memory,
        m=mesh(spec.parallel, devices),
    )


def _eval_loss(spec: StepSpec, loss: Loss, where: Any) -> Any:
    """The jitted evaluation: ``loss``'s sums, host-resident parameters brought to the device
    first (a streamed stack is fetched block by block by ``loss`` itself)."""
    opt = spec.optimizer
    host_params = opt.params_memory != "device" and not opt.stream
    return jax.jit(lambda p, b: loss(place(p, "device", where) if host_params else p, b)[1])


def build_step(spec: StepSpec, model: nnx.Module | None = None) -> tuple[BuiltStep, Any]:
    """``spec``'s training step: ``(built, params)``, ``params`` being ``model``'s parameters
    (arrays, for a run) or, without a model, the spec's decoder as shapes (for a plan)."""
    check_composes(spec)  # before anything compiles
    if model is None:
        model = model_shapes(spec)
    if spec.adapters.base != "compute":  # the frozen projections packed, once
        quantize_base(model, spec.adapters.base)
    graphdef, params = nnx.split(model, nnx.Param)
    trainable = Trainable(spec.adapters)
    cfg, policy, opt = spec.model, spec.policy, spec.optimizer
    tx = trainable.optimizer(make_optimizer(opt))
    layers = layers_fn(policy, cfg.n_layers)

    def plain(lf: Any, **model_kw: Any) -> Loss:
        chunks = policy.loss.chunks_for(spec.seq_len)
        return lm_loss_fn(graphdef, layers_fn=lf, loss_chunks=chunks, **model_kw)

    shardings = _mesh_shardings(spec, tx, params, trainable)
    make_loss = plain
    if shardings is not None:
        m, cp = shardings.mesh, spec.parallel.context_parallel
        sharded = plain
        if cp:  # the sequence split over the context axis: the model runs under its layout
            how = spec.parallel.cp_attention
            at = context.layout(m, cfg.attention, cfg.attention_block, spec.seq_len, how)
            sharded = partial(plain, layout=at)

        def make_loss(lf: Any) -> Loss:
            loss = parallel_loss(sharded, lf, spec.parallel, m)
            return context.permuted_loss(loss, m, spec.seq_len) if cp else loss

    loss = make_loss(layers)
    placement = None
    if spec.accum.mode == "multisteps":
        tx, step = make_multisteps_step(loss, tx, spec.accum.steps, opt)
    elif spec.streamed:
        if shardings is not None:
            placement = stream.placement(tx, params, shardings, spec.parallel)
        step = stream.make_streamed_step(
            make_loss,
            layers,
            tx,
            accum_steps=spec.accum.steps,
            accum_dtype=jnp.dtype(spec.precision.accum_dtype),
            donate=spec.donate,
            shardings=shardings,
            placement=placement,
            update=opt.stream_update or "device",
            opt_cfg=opt,
        )
    else:
        step = make_train_step(
            loss,
            tx,
            precision=spec.precision,
            accum=spec.accum,
            opt_cfg=opt,
            shardings=shardings,
            # a frozen base's trained stack is small: its gradient is summed whole
            loss_into=None
            if trainable.frozen_base
            else stack_accumulating_loss(make_loss, policy, cfg.n_layers, spec.accum),
            trainable=trainable,
        )
    eval_of = make_loss(stream.streamed_layers_fn(layers)) if spec.streamed else loss
    where = shardings.params if shardings is not None else None
    built = BuiltStep(
        spec=spec,
        graphdef=graphdef,
        tx=tx,
        layers=layers,
        make_loss=make_loss,
        loss=loss,
        plain_loss=plain(layers),
        eval_loss=_eval_loss(spec, eval_of, where),
        step=step,
        shardings=shardings,
        placement=placement,
        trainable=trainable,
    )
    return built, params

"""jaxmem's memory tools on your own JAX function: any jitted training step, any model.

Every call takes a function and example arguments (arrays, or ``jax.ShapeDtypeStruct`` for sizes
that need no memory) and returns a frozen dataclass whose figures say how they were obtained:

- ``plan(fn, *args, target=...)``: the compiled plan, ``memory_analysis()`` of ``jax.jit(fn)``
  compiled for ``target``: ``"cpu"`` (the local backend), ``"h100"``, ``"a100-40gb"``,
  ``"a100-80gb"`` or a ``GpuTargetConfig`` ``.txtpb`` file, the GPU ones compiled by XLA:CUDA on a
  machine without a GPU (``jaxmem[gpu-plan]``);
- ``peak(fn, *args, target=...)``: what is live at that plan's peak (XLA's buffer assignment,
  dumped for this one compile), by JAX operation, by kind (argument, forward, recomputed,
  backward) and by your ``checkpoint_name`` tags;
- ``residuals(loss_fn, *args, policy=...)``: what ``jax.grad(loss_fn)`` keeps for the backward,
  by tag (residual accounting of the VJP's jaxpr), under a policy or as written;
- ``matmul_flops(fn, *args)``: the matmul FLOPs ``fn`` executes (recomputation included);
- ``tags(fn, *args)``: the ``checkpoint_name`` tags ``fn`` produces;
- ``TagPolicy``: jaxmem's memory policies over your own tag names, translated to the
  ``jax.checkpoint`` policy once (``TagPolicy.checkpoint_policy()``), for ``jax.checkpoint``,
  ``nnx.remat`` or ``remat`` here.

Bad input raises a ``StepError`` subclass with one line naming what is wrong: ``ArgumentError``
(arguments that do not fit the function's signature, or leaves that are not arrays),
``TraceError`` (the function does not trace with them), ``TargetError``, ``TagError`` (a policy
names a tag the function never produces).
"""

# ruff: noqa: E402  (JAX is imported after quiet_library_start, on purpose)
from __future__ import annotations

from jaxmem.backend import quiet_library_start

# before JAX starts: with JAX's CUDA plugin installed and no GPU, the program runs on the CPU
# without the plugin's start-up lines and traceback (GPU targets still compile deviceless)
quiet_library_start()

import dataclasses
import functools
import inspect
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmem.config import ConfigError
from jaxmem.memory.flops import jaxpr_matmul_flops
from jaxmem.memory.remat import names_policy
from jaxmem.memory.residuals import (
    Residual,
    bytes_by_name,
    compiled_plan,
    planned_peak,
    saved_residuals,
    summarize_residuals,
)
from jaxmem.memory.targets import Target, get_target
from jaxmem.memory.xla_dump import PeakReport, parse_dump
from jaxmem.policy import CHOICES, POLICIES, Choice

__all__ = [
    "ArgumentError",
    "Plan",
    "Residuals",
    "StepError",
    "Step",
    "StepPeak",
    "TagError",
    "TagPolicy",
    "TargetError",
    "TraceError",
    "matmul_flops",
    "peak",
    "plan",
    "remat",
    "residuals",
    "tags",
]


# ------------------------------------------------------------------------------------ errors
class StepError(ConfigError):
    """A function, its arguments, a target or a policy that jaxmem cannot measure; the message is
    one line naming the value and the fix."""


class ArgumentError(StepError):
    """The example arguments do not fit the function's signature, or a leaf is not an array."""


class TraceError(StepError):
    """The function raised while JAX traced it with the example arguments."""


class TargetError(StepError):
    """A target that is not ``cpu``, a shipped GPU name or a readable ``.txtpb`` file."""


class TagError(StepError):
    """A policy names a ``checkpoint_name`` tag the function never produces."""


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _check_arguments(fn: Callable[..., Any], args: tuple, static_argnums: Sequence[int]) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a C function: JAX's trace will say
        signature = None
    if signature is not None:
        try:
            signature.bind(*args)
        except TypeError as e:
            raise ArgumentError(
                f"{_name(fn)}{signature} cannot be called with {len(args)} example argument(s): {e}"
            ) from None
    for i, arg in enumerate(args):
        if i in static_argnums:
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if not isinstance(leaf, jax.Array | np.ndarray | jax.ShapeDtypeStruct | int | float):
                where = f"argument {i}{jax.tree_util.keystr(path)}"
                raise ArgumentError(
                    f"{where} of {_name(fn)} is a {type(leaf).__name__}, not an array or "
                    "jax.ShapeDtypeStruct: pass arrays (or shape structs), or list its position "
                    "in static_argnums"
                )


def _trace(fn: Callable[..., Any], args: tuple, static_argnums: Sequence[int] = ()) -> Any:
    """``fn``'s closed jaxpr for ``args``; a ``TraceError`` naming the failure otherwise."""
    _check_arguments(fn, args, static_argnums)
    try:
        return jax.make_jaxpr(fn, static_argnums=tuple(static_argnums))(*args)
    except StepError:
        raise
    except Exception as e:
        raise TraceError(
            f"{_name(fn)} does not trace with these arguments: {_first_line(e)}"
        ) from e


def _get_target(target: str | Target) -> Target:
    if isinstance(target, Target):
        return target
    try:
        return get_target(target)
    except ConfigError as e:
        raise TargetError(str(e)) from None
    except (ValueError, OSError) as e:
        raise TargetError(f"target {target!r} does not parse: {_first_line(e)}") from None


# ------------------------------------------------------------------------------------ steps
@dataclasses.dataclass(frozen=True)
class Step:
    """A function with its example arguments and how to compile it: what an entry point for
    ``jaxmem memory --fn`` / ``jaxmem peak --fn`` returns (``plan(**step.compile_kwargs())``
    style: the fields are ``plan``'s and ``peak``'s keyword arguments). ``loss`` and
    ``loss_args``: the loss ``fn`` differentiates, for residual accounting."""

    fn: Callable[..., Any]
    args: tuple
    static_argnums: tuple[int, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    mesh: Mapping[str, int] | None = None
    in_specs: Any = None
    loss: Callable[..., Any] | None = None
    loss_args: tuple | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ArgumentError(f"Step fn={self.fn!r} is not callable")
        if not isinstance(self.args, tuple):
            raise ArgumentError(
                f"Step args must be a tuple of example arguments, got {self.args!r}"
            )
        if self.loss is not None and self.loss_args is None:
            raise ArgumentError("Step loss needs loss_args, the example arguments of the loss")

    def compile_kwargs(self) -> dict[str, Any]:
        return {
            "static_argnums": self.static_argnums,
            "donate_argnums": self.donate_argnums,
            "mesh": self.mesh,
            "in_specs": self.in_specs,
        }


# ------------------------------------------------------------------------------ compiling
def _mesh(target: Target, mesh: Mapping[str, int]) -> Mesh:
    bad = {k: v for k, v in mesh.items() if not (isinstance(v, int) and v > 0)}
    if not mesh or bad:
        raise ArgumentError(f"mesh={dict(mesh)!r} must map axis names to positive sizes")
    n = math.prod(mesh.values())
    if target.is_gpu:
        from jaxmem.memory.gpu_plan import target_devices

        devices = target_devices(target, n)
    else:
        devices = jax.devices()
        if len(devices) < n:
            raise ArgumentError(
                f"mesh={dict(mesh)!r} needs {n} devices; this process has {len(devices)} "
                f"{devices[0].platform} device(s) (on a CPU: jax.config.update("
                f"'jax_num_cpu_devices', {n}) before JAX starts)"
            )
    return Mesh(np.array(devices[:n]).reshape(tuple(mesh.values())), tuple(mesh))


def _placed(
    args: tuple,
    target: Target,
    static_argnums: Sequence[int],
    mesh: Mapping[str, int] | None,
    in_specs: Any,
) -> tuple:
    """``args`` as shape structs placed for ``target``: on its one device, or over ``mesh`` with
    ``in_specs`` (a ``PartitionSpec`` per argument, or a tree of them; None: replicated)."""
    if mesh is None and not target.is_gpu:
        return tuple(
            a if i in static_argnums else jax.tree_util.tree_map(_struct, a)
            for i, a in enumerate(args)
        )
    if mesh is None:
        from jaxmem.memory.gpu_plan import target_sharding

        sharding = target_sharding(target)
        return tuple(
            a if i in static_argnums else jax.tree_util.tree_map(lambda x: _struct(x, sharding), a)
            for i, a in enumerate(args)
        )
    device_mesh = _mesh(target, mesh)
    specs = in_specs if in_specs is not None else (None,) * len(args)
    if not isinstance(specs, tuple | list) or len(specs) != len(args):
        raise ArgumentError(
            f"in_specs must give one PartitionSpec (or tree of them, or None) per argument: "
            f"{len(args)} argument(s), got {specs!r}"
        )
    out = []
    for i, (a, spec) in enumerate(zip(args, specs, strict=True)):
        if i in static_argnums:
            out.append(a)
            continue
        try:
            if spec is None or isinstance(spec, PartitionSpec):
                s = NamedSharding(device_mesh, spec or PartitionSpec())
                out.append(jax.tree_util.tree_map(lambda x, s=s: _struct(x, s), a))
            else:
                out.append(
                    jax.tree_util.tree_map(
                        lambda x, p: _struct(x, NamedSharding(device_mesh, p or PartitionSpec())),
                        a,
                        spec,
                        is_leaf=lambda p: p is None or isinstance(p, PartitionSpec),
                    )
                )
        except ValueError as e:
            raise ArgumentError(f"in_specs[{i}] does not match argument {i}: {e}") from None
    return tuple(out)


def _struct(x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    """An array, shape struct or Python scalar as a shape struct (placed by ``sharding``)."""
    if not hasattr(x, "dtype"):  # a Python scalar: the dtype JAX gives it
        x = jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _compile(
    fn: Callable[..., Any],
    args: tuple,
    target: Target,
    *,
    static_argnums: Sequence[int],
    donate_argnums: Sequence[int],
    mesh: Mapping[str, int] | None,
    in_specs: Any,
    options: dict[str, Any] | None = None,
) -> Any:
    import warnings

    from jaxmem.backend import quiet_native_stderr

    _trace(fn, args, static_argnums)  # bad arguments and trace failures, named
    if target.is_gpu:
        from jaxmem.memory.gpu_plan import require_gpu_plan

        require_gpu_plan(target)
    placed = _placed(args, target, static_argnums, mesh, in_specs)
    jitted = jax.jit(fn, static_argnums=tuple(static_argnums), donate_argnums=tuple(donate_argnums))
    try:
        lowered = jitted.lower(*placed)
    except StepError:
        raise
    except Exception as e:
        raise TraceError(f"{_name(fn)} does not lower for {target.name}: {_first_line(e)}") from e
    with warnings.catch_warnings(), quiet_native_stderr():
        # a deviceless executable is written to JAX's persistent cache but cannot be read back
        warnings.filterwarnings("ignore", "Error reading persistent compilation cache entry")
        return lowered.compile(options) if options else lowered.compile()


# ---------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class Plan:
    """A compiled plan's memory, per device: ``memory_analysis()`` of ``fn`` compiled for
    ``target``. ``planned_peak_bytes`` = arguments + outputs - aliased (donated) + temporaries.
    ``fits`` compares it with the GPU's memory (None for the local backend, whose limit XLA does
    not know); a deviceless compile never fails for lack of memory, so the check is jaxmem's.
    Host bytes are what the plan moves to ``pinned_host`` inside the function (offloaded
    residuals); memory kinds on the jitted function's own arguments are dropped by a deviceless
    compile."""

    target: str
    compiler: str
    devices: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    host_bytes: int
    planned_peak_bytes: int
    device_memory_bytes: int | None

    @property
    def fits(self) -> bool | None:
        if self.device_memory_bytes is None:
            return None
        return self.planned_peak_bytes <= self.device_memory_bytes

    @property
    def figure(self) -> str:
        per = f", per device of {self.devices}" if self.devices > 1 else ""
        return f"compiled plan: memory_analysis() of {self.compiler}{per}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"fits": self.fits, "figure": self.figure}


def _plan_of(compiled: Any, target: Target, devices: int) -> Plan:
    stats = compiled_plan(compiled)
    return Plan(
        target=target.name,
        compiler=target.compiler(),
        devices=devices,
        argument_bytes=stats["argument_bytes"],
        output_bytes=stats["output_bytes"],
        alias_bytes=stats["alias_bytes"],
        temp_bytes=stats["temp_bytes"],
        host_bytes=stats["host_argument_bytes"]
        + stats["host_output_bytes"]
        - stats["host_alias_bytes"]
        + stats["host_temp_bytes"],
        planned_peak_bytes=planned_peak(stats),
        device_memory_bytes=target.device_memory_bytes if target.is_gpu else None,
    )


def plan(
    fn: Callable[..., Any],
    *args: Any,
    target: str | Target = "cpu",
    static_argnums: Sequence[int] = (),
    donate_argnums: Sequence[int] = (),
    mesh: Mapping[str, int] | None = None,
    in_specs: Any = None,
) -> Plan:
    """Compile ``jax.jit(fn)`` for ``target`` from ``args`` (arrays or ``jax.ShapeDtypeStruct``;
    nothing is allocated) and return its memory plan.

    ``mesh`` (e.g. ``{"data": 8}``) compiles over that many devices of the target (CPU: this
    process's devices; GPU: one host of that many GPUs, nothing needs to exist), with each
    argument placed by ``in_specs`` (one ``PartitionSpec``, tree of them, or None = replicated,
    per argument); figures are then per device.

    >>> p = plan(train_step, params, opt_state, batch, target="h100", donate_argnums=(0, 1))
    >>> p.planned_peak_bytes, p.fits
    """
    tgt = _get_target(target)
    compiled = _compile(
        fn,
        args,
        tgt,
        static_argnums=static_argnums,
        donate_argnums=donate_argnums,
        mesh=mesh,
        in_specs=in_specs,
    )
    return _plan_of(compiled, tgt, math.prod(mesh.values()) if mesh else 1)


# ---------------------------------------------------------------------------------- tags
_HLO_DTYPES = {
    "float64": "f64",
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "int64": "s64",
    "int32": "s32",
    "int16": "s16",
    "int8": "s8",
    "uint32": "u32",
    "uint8": "u8",
    "bool": "pred",
}


def _tag_shapes(jaxpr: Any, stacked: tuple[int, ...] = ()) -> dict[str, set[str]]:
    """Each ``checkpoint_name`` tag in ``jaxpr`` with the HLO shapes its values can have: its own,
    and stacked by the scans around it (a scan keeps a residual as one ``[length, ...]``
    buffer)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out: dict[str, set[str]] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            aval = eqn.outvars[0].aval
            out.setdefault(eqn.params["name"], set()).update(
                _hlo_shapes(aval.shape, aval.dtype, stacked)
            )
            continue
        inner = stacked + ((eqn.params["length"],) if eqn.primitive.name == "scan" else ())
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            for tag, shapes in _tag_shapes(sub, inner).items():
                out.setdefault(tag, set()).update(shapes)
    return out


def tags(fn: Callable[..., Any], *args: Any, static_argnums: Sequence[int] = ()) -> tuple[str, ...]:
    """The ``checkpoint_name`` tags ``fn`` produces when called with ``args``, in the order they
    first appear (nested calls, scans and remat regions included).

    >>> tags(loss_fn, params, batch)
    ('qkv', 'attn_out', 'fc1', 'fc2')
    """
    return tuple(_tag_shapes(_trace(fn, args, static_argnums)))


# -------------------------------------------------------------------------------- policies
@dataclasses.dataclass(frozen=True, kw_only=True)
class TagPolicy:
    """A memory policy over your own ``checkpoint_name`` tags: what the backward of a
    checkpointed region keeps in device memory (``save``), moves to host memory (``offload``)
    or recomputes (everything else). ``remat=False`` is plain autodiff (everything kept).

    Build one from a jaxmem preset and a map from jaxmem's tags to yours
    (``TagPolicy.preset("selective", {"query_proj": "q", ...})``), from per-tag choices
    (``TagPolicy.custom({"fc1": "offload", "qkv": "device"})``) or directly.
    """

    name: str = "custom"
    remat: bool = True
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    save_dots: bool = False

    def __post_init__(self) -> None:
        for field in ("save", "offload"):
            value = getattr(self, field)
            if not isinstance(value, tuple) or not all(isinstance(n, str) and n for n in value):
                raise ConfigError(f"TagPolicy {field}={value!r} must be a tuple of tag names")
        both = sorted(set(self.save) & set(self.offload))
        if both:  # jax's offload policy would silently keep such a name on the device
            raise ConfigError(f"TagPolicy: {both} are both saved and offloaded; choose one each")
        if not self.remat and (self.save or self.offload or self.save_dots):
            raise ConfigError("TagPolicy remat=False keeps everything: it takes no names")
        if self.save_dots and self.offload:  # jax's save_from_both_policies raises with offload
            raise ConfigError(
                f"TagPolicy save_dots cannot be combined with offload={list(self.offload)}: "
                "name the projections to offload instead"
            )

    @classmethod
    def preset(cls, name: str, tag_map: Mapping[str, str | Sequence[str]]) -> TagPolicy:
        """jaxmem's preset ``name`` (``none``, ``full``, ``selective``, ``mlp``, ``offload``)
        over your tags: ``tag_map`` maps jaxmem's tag names (``jaxmem.policy.CHECKPOINT_NAMES``)
        to yours (one name or several). A jaxmem tag your model has no counterpart for is
        recomputed (there is nothing to keep)."""
        if name not in POLICIES:
            raise ConfigError(
                f"TagPolicy.preset: {name!r} is not a preset; one of {list(POLICIES)}"
            )
        policy = POLICIES[name]
        if policy.nested:
            raise ConfigError(
                "TagPolicy.preset: 'nested' is a way of running a stack of blocks (about √L "
                "segments, each recomputed whole), not a choice of tags: nest jax.checkpoint "
                "over segments of your own stack with TagPolicy.preset('full', ...)"
            )
        from jaxmem.policy import CHECKPOINT_NAMES

        unknown = sorted(k for k in tag_map if k not in CHECKPOINT_NAMES)
        if unknown:
            raise ConfigError(
                f"TagPolicy.preset: {unknown} are not jaxmem tags; the map's keys are jaxmem's "
                f"tags ({', '.join(CHECKPOINT_NAMES)}) and its values yours"
            )

        def yours(names: Iterable[str]) -> tuple[str, ...]:
            out: list[str] = []
            for n in names:
                mapped = tag_map.get(n, ())
                for m in (mapped,) if isinstance(mapped, str) else mapped:
                    if m not in out:
                        out.append(m)
            return tuple(out)

        block = policy.head
        return cls(
            name=name,
            remat=block.remat,
            save=yours(block.save),
            offload=yours(block.offload),
            save_dots=block.save_dots,
        )

    @classmethod
    def custom(cls, choices: Mapping[str, Choice], *, name: str = "custom") -> TagPolicy:
        """Per-tag choices, ``"device"``, ``"offload"`` or ``"recompute"``; tags not named are
        recomputed."""
        bad = {k: v for k, v in choices.items() if v not in CHOICES}
        if bad:
            raise ConfigError(f"TagPolicy.custom: choices {bad} must each be one of {CHOICES}")
        return cls(
            name=name,
            save=tuple(n for n, c in choices.items() if c == "device"),
            offload=tuple(n for n, c in choices.items() if c == "offload"),
        )

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.save, *self.offload)

    def checkpoint_policy(self) -> Any:
        """The ``jax.checkpoint`` (``nnx.remat``) policy: jaxmem's one translation
        (``jaxmem.memory.remat.names_policy``). Under ``remat=False``: everything saveable."""
        if not self.remat:
            return jax.checkpoint_policies.everything_saveable
        return names_policy(self.save, self.offload, save_dots=self.save_dots)

    def check(self, produced: Iterable[str]) -> None:
        """A ``TagError`` if the policy names a tag not in ``produced`` (e.g. ``tags(fn, ...)``):
        ``jax.checkpoint`` would silently keep nothing for it."""
        produced = tuple(produced)
        missing = [n for n in self.names if n not in produced]
        if missing:
            raise TagError(
                f"policy {self.name!r} names tag(s) {missing} that the function never produces; "
                f"it produces {list(produced) or 'no checkpoint_name tags'}"
            )


def remat(
    fn: Callable[..., Any], policy: TagPolicy, *, static_argnums: Sequence[int] = ()
) -> Callable[..., Any]:
    """``jax.checkpoint(fn)`` under ``policy``; each call first checks that ``fn`` produces every
    tag the policy names (a ``TagError`` otherwise). ``remat=False``: ``fn`` itself."""
    if not policy.remat:
        return fn
    checkpointed = jax.checkpoint(
        fn, policy=policy.checkpoint_policy(), static_argnums=tuple(static_argnums)
    )

    @functools.wraps(fn)
    def wrapped(*args: Any) -> Any:
        policy.check(_tag_shapes(jax.make_jaxpr(fn, static_argnums=tuple(static_argnums))(*args)))
        return checkpointed(*args)

    return wrapped


# ------------------------------------------------------------------------------- residuals
@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the backward keeps, by residual accounting (the residual outputs of the VJP's
    jaxpr: ``jax.ad_checkpoint.print_saved_residuals``' method): activations in device and in
    host memory, by tag (``"<untagged>"`` for the rest), the function's own arguments the
    backward reads (memory that exists anyway), compute-dtype copies of them."""

    device_bytes: int
    host_bytes: int
    argument_bytes: int
    parameter_copy_bytes: int
    by_tag: dict[str, int]
    residuals: tuple[Residual, ...]
    figure: str = "residual accounting (the VJP's jaxpr)"


def residuals(
    loss_fn: Callable[..., Any],
    *args: Any,
    policy: TagPolicy | None = None,
    static_argnums: Sequence[int] = (),
) -> Residuals:
    """What ``jax.grad(loss_fn)`` keeps for its backward with ``args`` (arrays or shape structs).

    With ``policy``, ``loss_fn`` runs as one region checkpointed under it (what a policy applied
    to each of your blocks keeps, summed over them); without, as written (your model applies
    its own ``jax.checkpoint``/``nnx.remat``, if any)."""
    jaxpr = _trace(loss_fn, args, static_argnums)
    static = {i: args[i] for i in static_argnums}
    dynamic = tuple(a for i, a in enumerate(args) if i not in static)

    def f(*dyn: Any) -> Any:
        it = iter(dyn)
        return loss_fn(*(static[i] if i in static else next(it) for i in range(len(args))))

    if policy is not None:
        policy.check(_tag_shapes(jaxpr))
        f = remat(f, policy) if policy.remat else f
    try:
        kept = saved_residuals(f, *dynamic)
    except StepError:
        raise
    except Exception as e:
        raise TraceError(
            f"{_name(loss_fn)} has no gradient with these arguments: {_first_line(e)}"
        ) from e
    summary = summarize_residuals(kept)
    return Residuals(
        device_bytes=summary.activation_bytes_device,
        host_bytes=summary.activation_bytes_host,
        argument_bytes=summary.argument_bytes,
        parameter_copy_bytes=summary.parameter_copy_bytes,
        by_tag=bytes_by_name(kept),
        residuals=tuple(kept),
    )


def matmul_flops(fn: Callable[..., Any], *args: Any, static_argnums: Sequence[int] = ()) -> int:
    """Matmul FLOPs ``fn`` executes with ``args``, counted from its jaxpr: 2·M·N·K per
    ``dot_general``, scan bodies times their length, remat's recomputation included (XLA's
    ``cost_analysis()`` counts a scan body once). Give a training step, or
    ``jax.grad(loss_fn)``, for forward + backward."""
    try:
        return jaxpr_matmul_flops(_trace(fn, args, static_argnums))
    except NotImplementedError as e:
        raise TraceError(f"{_name(fn)}: {e}") from None


# ------------------------------------------------------------------------------------ peak
@dataclasses.dataclass(frozen=True)
class StepPeak:
    """What is live at the peak of ``plan``: XLA's buffer assignment of that compile
    (``report``: every value live at the peak, its bytes, live range and the JAX operation that
    made it), and the live forward or recomputed values credited to ``checkpoint_name`` tags
    (``by_tag``) by HLO shape and dtype, as ``by_tag_method`` says: against the residuals
    ``residuals(loss, *loss_args)`` keeps (named tags, ``<layer input>``, ``<untagged>``) when a
    loss is given, else against every tag ``fn`` produces (a value of a tag's shape that is not
    that tag is then credited to it). A shape several owners share is credited to ``"a|b"``, a
    value matching none to ``"<unmatched>"``."""

    plan: Plan
    report: PeakReport
    by_tag: dict[str, int]
    by_tag_method: str

    def by_operation(self) -> dict[str, int]:
        """Live bytes by kind and JAX primitive (``forward dot_general``, ``argument``...)."""
        out: dict[str, int] = {}
        for v in self.report.values:
            key = v.kind if v.kind == "argument" else f"{v.kind} {v.op_name.rsplit('/', 1)[-1]}"
            out[key] = out.get(key, 0) + v.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _hlo_shapes(shape: tuple[int, ...], dtype: Any, stacked: tuple[int, ...] = ()) -> set[str]:
    """``shape`` as XLA prints it (``bf16[8,128]``), alone and stacked by the enclosing scans."""
    short = _HLO_DTYPES.get(str(dtype), str(dtype))
    return {
        f"{short}[{','.join(map(str, (*stacked[len(stacked) - k :], *shape)))}]"
        for k in range(len(stacked) + 1)
    }


def _by_tag(report: PeakReport, shapes: Mapping[str, set[str]]) -> dict[str, int]:
    owners: dict[str, list[str]] = {}
    for tag, tag_shapes in shapes.items():
        for s in tag_shapes:
            owners.setdefault(s, []).append(tag)
    out: dict[str, int] = {}
    for v in report.values:
        if v.kind not in ("forward", "recomputed"):
            continue
        key = "|".join(sorted(owners.get(v.shape, []))) or "<unmatched>"
        out[key] = out.get(key, 0) + v.bytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def peak(
    fn: Callable[..., Any],
    *args: Any,
    target: str | Target = "cpu",
    static_argnums: Sequence[int] = (),
    donate_argnums: Sequence[int] = (),
    mesh: Mapping[str, int] | None = None,
    in_specs: Any = None,
    loss: Callable[..., Any] | None = None,
    loss_args: tuple | None = None,
) -> StepPeak:
    """Compile ``fn`` as ``plan`` does, with XLA's dump of this one compile on (a compile
    option: nothing else is dumped), and report what is live at the plan's peak. Give ``loss``
    and ``loss_args`` (the loss ``fn`` differentiates, and its arguments) to credit live values
    to the residuals the loss keeps rather than to every tag of the same shape."""
    tgt = _get_target(target)
    jaxpr = _trace(fn, args, static_argnums)
    if loss is not None:
        kept = residuals(loss, *(loss_args or ())).residuals
        shapes: dict[str, set[str]] = {}
        for r in kept:
            if r.origin in ("computed", "constant"):
                shapes.setdefault(r.name or "<untagged>", set()).update(
                    _hlo_shapes(r.shape, r.dtype)
                )
        method = "shape and dtype, against the residuals the loss keeps (residual accounting)"
    else:
        shapes = _tag_shapes(jaxpr)
        method = "shape and dtype, against every checkpoint_name tag the function produces"
    with tempfile.TemporaryDirectory(prefix="jaxmem-peak-") as dump:
        compiled = _compile(
            fn,
            args,
            tgt,
            static_argnums=static_argnums,
            donate_argnums=donate_argnums,
            mesh=mesh,
            in_specs=in_specs,
            # the dump directory is a compile option, so it is part of the persistent cache's
            # key: a fresh directory is a fresh compile, never an executable read from the cache
            options={"xla_dump_to": dump, "xla_dump_hlo_module_re": ".*"},
        )
        parsed = parse_dump(dump, _module_name(dump))
    stats = _plan_of(compiled, tgt, math.prod(mesh.values()) if mesh else 1)
    report = PeakReport.of(tgt.compiler(), stats.planned_peak_bytes, parsed)
    return StepPeak(plan=stats, report=report, by_tag=_by_tag(report, shapes), by_tag_method=method)


def _module_name(dump: str) -> str:
    """The HLO module name of the one program compiled into ``dump`` (``jit_<function>``)."""
    names = sorted(
        f for f in os.listdir(dump) if f.endswith("after_optimizations-buffer-assignment.txt")
    )
    if not names:
        raise RuntimeError(f"XLA wrote no buffer assignment under {dump}")
    # module_0004.jit_step.cpu_after_optimizations-buffer-assignment.txt
    return names[-1].split(".")[1]

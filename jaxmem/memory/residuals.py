"""Measuring JAX memory. Nothing is reported that was not measured: a runtime peak appears only
where the backend reports one. Figures name their method (``jaxmem.figures``):

- ``residual accounting``: the residuals ``jax.vjp`` keeps for the backward pass, read from the
  jaxpr of the VJP (the same method as ``jax.ad_checkpoint.print_saved_residuals``), with the
  memory kind each lives in and the tag it was saved under;
- ``compiled plan (XLA:<platform>)``: ``compiled.memory_analysis()`` of a jitted program;
- ``runtime peak``: ``device.memory_stats()["peak_bytes_in_use"]`` (GPU/TPU only; None on CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem.compat import scan_operand_counts
from jaxmem.model.loss import chunked_loss_gradients


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array the backward pass keeps."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    origin: str  # "argument" (an input of f, e.g. a parameter, or a view of one), "parameter
    # copy" (a slice or cast of an input: new memory, not an activation), "computed", "constant"
    # or "literal"
    memory_kind: str | None  # "host" for offloaded residuals; None = default device memory
    name: str | None = None  # the checkpoint_name tag it was saved under, if any; "<layer input>"
    # for the input of a scanned (checkpointed) block, which scan keeps without a tag;
    # "<stack output>" for the last block's output kept by what follows the stack


def _aval_bytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def saved_residuals(f: Callable[..., Any], *args: Any) -> list[Residual]:
    """The arrays ``jax.vjp(f, *args)`` saves for the backward pass, each counted once.

    Written here because ``jax.ad_checkpoint.print_saved_residuals`` only prints: it reads the
    same thing, the residual outputs of the VJP's jaxpr.
    """
    flat_args, in_tree = jax.tree_util.tree_flatten(args)

    def flat_f(*flat):
        return f(*jax.tree_util.tree_unflatten(in_tree, flat))

    # The same recipe as jax's own (private) saved_residuals.
    closed, (_, vjp_shape) = jax.make_jaxpr(lambda *a: jax.vjp(flat_f, *a), return_shape=True)(
        *flat_args
    )
    jaxpr = closed.jaxpr
    n_res = len(jax.tree_util.tree_leaves(vjp_shape))
    outvars = jaxpr.outvars[len(jaxpr.outvars) - n_res :]
    invars = set(jaxpr.invars)
    constvars = set(jaxpr.constvars)
    seen: set[Any] = set()
    out: list[Residual] = []
    for v in outvars:
        is_literal = isinstance(v, jax.extend.core.Literal)
        if not is_literal:
            if v in seen:
                continue
            seen.add(v)
        aval = v.aval
        root = v if is_literal else _alias_root(jaxpr, v)
        origin = (
            "literal"
            if is_literal
            else "argument"
            if root in invars
            else "constant"
            if root in constvars
            else "parameter copy"
            if _parameter_copy(jaxpr, root)
            else "computed"
        )
        kind = getattr(aval, "memory_space", None)
        kind_name = None if kind is None else str(kind).split(".")[-1].lower()
        out.append(
            Residual(
                shape=tuple(aval.shape),
                dtype=str(aval.dtype),
                nbytes=_aval_bytes(aval),
                origin=origin,
                memory_kind=None if kind_name in (None, "device", "any") else kind_name,
                name=None if is_literal else _residual_name(jaxpr, v),
            )
        )
    return out


# Reshapes of an input are views of memory that exists anyway (XLA lays them out as bitcasts): a
# residual derived from a parameter only through these is the parameter, not new memory.
_VIEWS = ("reshape", "squeeze", "expand_dims")
# A slice or a cast of a parameter the backward keeps is new memory: the compute-dtype copies of
# the weights under mixed precision, and the head and tail slices of the stacked parameters when
# nested segments do not divide the stack (measured: a 7-layer nested stack's XLA:CPU plan holds
# 2.5 MB of temporaries more than full's, for 1.5 MB of parameters).
_COPIES = ("slice", "convert_element_type", "copy", "copy_p", "dynamic_slice")


def _alias_root(jaxpr: Any, var: Any) -> Any:
    for eqn in jaxpr.eqns:
        if var in eqn.outvars and eqn.primitive.name in _VIEWS:
            return _alias_root(jaxpr, eqn.invars[0])
    return var


def _parameter_copy(jaxpr: Any, var: Any, depth: int = 0) -> bool:
    """``var`` is derived from an input of ``jaxpr`` through views, slices and casts only, at
    least one of them a copy (followed through scan bodies: a scan that casts each layer's
    weights returns a stacked copy)."""
    if depth > 32:
        return False
    for eqn in jaxpr.eqns:
        if var not in eqn.outvars:
            continue
        prim = eqn.primitive.name
        if prim in _VIEWS:
            return _parameter_copy(jaxpr, eqn.invars[0], depth + 1)
        if prim in _COPIES:
            source = eqn.invars[0]
            return _alias_root(jaxpr, source) in jaxpr.invars or _parameter_copy(
                jaxpr, source, depth + 1
            )
        sub = _sub_jaxpr(eqn)
        if prim != "scan" or sub is None:
            return False
        n_consts, n_carry = scan_operand_counts(eqn)
        index = eqn.outvars.index(var)
        if index < n_carry:
            return False
        inner = sub.outvars[index]
        # a stacked output: a copy when each iteration's value is a per-layer slice (an xs
        # input) of a parameter, or a copy of one
        if not (_parameter_copy(sub, inner, depth + 1) or _alias_root(sub, inner) in sub.invars):
            return False
        root = _root_through_copies(sub, inner)
        if root not in sub.invars:  # e.g. the stacked output of a scan nested in this one
            return False
        position = sub.invars.index(root)
        if position < n_consts + n_carry:
            return False
        outer = eqn.invars[position]
        return _alias_root(jaxpr, outer) in jaxpr.invars or _parameter_copy(jaxpr, outer, depth + 1)
    return False


def _root_through_copies(jaxpr: Any, var: Any) -> Any:
    for eqn in jaxpr.eqns:
        if var in eqn.outvars and eqn.primitive.name in _VIEWS + _COPIES:
            return _root_through_copies(jaxpr, eqn.invars[0])
    return var


# Primitives a saved value may pass through after its checkpoint_name tag: the rounding marker
# remat inserts, the copy to host memory of an offloaded name, and no-op casts.
_PASS_THROUGH = ("reduce_precision", "device_put", "convert_element_type", "copy", "copy_p")


def _sub_jaxpr(eqn: Any) -> Any | None:
    for key in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            return getattr(sub, "jaxpr", sub)
    return None


def _residual_name(jaxpr: Any, var: Any, depth: int = 0) -> str | None:
    """The tag a residual was saved under, following it through scan bodies and calls."""
    if depth > 16:
        return None
    for eqn in jaxpr.eqns:
        # A value saved before its tag (e.g. a matmul output kept by a dots policy) is named by
        # the tag that consumes it.
        if eqn.primitive.name == "name" and eqn.invars[0] is var:
            return eqn.params["name"]
    for eqn in jaxpr.eqns:
        if var not in eqn.outvars:
            continue
        prim = eqn.primitive.name
        if prim == "name":
            return eqn.params["name"]
        if prim in _PASS_THROUGH:
            return _residual_name(jaxpr, eqn.invars[0], depth + 1)
        sub = _sub_jaxpr(eqn)
        if sub is None:
            return None
        if prim in ("jit", "pjit") and eqn.params.get("name") == chunked_loss_gradients.__name__:
            return "<loss gradients>"  # formed in the forward (LossPolicy.chunks)
        index = eqn.outvars.index(var)
        n_consts, n_carry = scan_operand_counts(eqn) if prim == "scan" else (0, 0)
        if prim == "scan" and index < n_carry:
            return "<stack output>"  # the final carry: the last layer's output, kept downstream
        inner = sub.outvars[index]
        if prim == "scan" and inner in sub.invars:
            position = sub.invars.index(inner)
            if n_consts <= position < n_consts + n_carry:
                return "<layer input>"
        return _residual_name(sub, inner, depth + 1)
    return None


@dataclasses.dataclass(frozen=True)
class ResidualSummary:
    activation_bytes_device: int  # computed residuals in device memory
    activation_bytes_host: int  # computed residuals placed in host memory (offloaded)
    argument_bytes: int  # inputs/parameters the backward keeps anyway (not extra memory)
    n_residuals: int
    # slices and compute-dtype casts of parameters the backward keeps: new memory, reported
    # apart from activations (a bf16 step's weight copies are not activations)
    parameter_copy_bytes: int = 0


def bytes_by_name(residuals: Sequence[Residual]) -> dict[str, int]:
    """Computed residual bytes grouped by tag name (``"<untagged>"`` for the rest)."""
    out: dict[str, int] = {}
    for r in residuals:
        if r.origin in ("computed", "constant"):
            key = r.name or "<untagged>"
            out[key] = out.get(key, 0) + r.nbytes
    return out


def summarize_residuals(residuals: Sequence[Residual]) -> ResidualSummary:
    computed = [r for r in residuals if r.origin in ("computed", "constant")]
    return ResidualSummary(
        activation_bytes_device=sum(r.nbytes for r in computed if r.memory_kind is None),
        activation_bytes_host=sum(r.nbytes for r in computed if r.memory_kind is not None),
        argument_bytes=sum(r.nbytes for r in residuals if r.origin == "argument"),
        n_residuals=len(residuals),
        parameter_copy_bytes=sum(r.nbytes for r in residuals if r.origin == "parameter copy"),
    )


def planned_peak(plan: dict[str, int]) -> int:
    """The peak a compiled plan implies: arguments + outputs - aliased (donated) + temporaries."""
    return plan["argument_bytes"] + plan["output_bytes"] - plan["alias_bytes"] + plan["temp_bytes"]


def compiled_plan(compiled: Any) -> dict[str, int]:
    """``memory_analysis()`` of a compiled program (``jax.jit(f).lower(*args).compile()``, where
    ``args`` may be arrays or ``jax.ShapeDtypeStruct``s)."""
    stats = compiled.memory_analysis()
    return {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "generated_code_bytes": int(stats.generated_code_size_in_bytes),
        # host memory the plan uses (offloaded residuals on a GPU; XLA:CPU reports none)
        "host_argument_bytes": int(stats.host_argument_size_in_bytes),
        "host_output_bytes": int(stats.host_output_size_in_bytes),
        "host_alias_bytes": int(stats.host_alias_size_in_bytes),
        "host_temp_bytes": int(stats.host_temp_size_in_bytes),
    }


class Plan(dict):
    """A compiled plan (``compiled_plan``'s bytes, a plain dict to every reader) and, where it
    was asked for, what the compiled program's kernels do (``work``: a
    ``jaxmem.memory.work.Work`` of its optimized HLO, the input of a step-time estimate;
    None otherwise)."""

    work: Any = None


# The plans of programs compiled in this process, by platform and program text (at most
# ``_PLANS_KEPT``, oldest dropped first): see ``plan_of_lowered``.
_PLANS: dict[tuple[str, str], Plan] = {}
_PLANS_KEPT = 4096


def plan_of_lowered(
    lowered: Any,
    where: str,
    compile: Callable[[Any], Any] | None = None,
    *,
    with_work: bool = False,
) -> Plan:
    """``compiled_plan`` of ``lowered`` compiled for ``where`` (a platform or target and device
    count), memoised in this process by the lowered program's text: its StableHLO with its
    shardings, memory kinds and donations, which is everything XLA compiles from. jaxmem
    compiles the same program many times over in one process (``jaxmem plan`` compiles a
    candidate to fit the memory model and again at its depth, ``memory`` and ``peak`` plan what
    ``plan`` planned), each time from a step function built afresh, which JAX's own in-memory
    cache (keyed by the function) misses, and a deviceless GPU executable cannot be read back
    from JAX's persistent cache. XLA compiles one program to one plan (checked for XLA:CUDA by
    ``tests/test_gpu_plan``), so a repeat returns the plan the first compile made. ``compile``
    (default: ``lowered.compile()``) compiles it on a miss. ``with_work``: the plan's ``work``
    is read from the compiled program's HLO too (compiled again if a first compile did not
    keep it)."""
    import hashlib

    key = (where, hashlib.sha256(lowered.as_text().encode()).hexdigest())
    plan = _PLANS.get(key)
    if plan is None or (with_work and plan.work is None):
        compiled = compile(lowered) if compile is not None else lowered.compile()
        plan = Plan(compiled_plan(compiled))
        if with_work:
            from jaxmem.memory.work import work_of_hlo

            plan.work = work_of_hlo(
                compiled.as_text(), "per-kernel count of the compiled plan's HLO"
            )
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    out = Plan(plan)
    out.work = plan.work
    return out


def device_peak_bytes() -> int | None:
    """Peak bytes in use on the default device, or None where the backend does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])

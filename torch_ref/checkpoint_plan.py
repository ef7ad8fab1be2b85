"""A checkpoint plan for any ``nn.Module``, as data, and the model run under it: which
submodules are checkpoint units (by class, or by a glob on qualified names such as
``"model.layers.*"``) and the mode (``none``, ``full``, ``selective``), applied from outside
with stock PyTorch (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, selective
checkpointing through ``create_selective_checkpoint_contexts``) and taken off on exit.

Part of the memory tools for any ``nn.Module`` (``torch_ref.module_memory``, the public API):
the plan the measurements of ``module_activations`` and ``module_peak`` run under. Errors about
the model or the plan are ``ModelError`` (a ``jaxmem.config.ConfigError``), one line naming the
value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from jaxmem.config import ConfigError
from torch_ref.compat import selective_checkpoint_contexts

Mode = Literal["none", "full", "selective"]
MODES: tuple[str, ...] = ("none", "full", "selective")
Unit = str | type[nn.Module]

# What ``selective`` saves by default, as torchtitan's activation checkpointing does: every
# matmul, and every output of PyTorch's fused attention kernels (flash, memory-efficient, cuDNN,
# the CPU flash kernel). ``aten.linear`` is listed for the builds where it reaches dispatch
# (here it decomposes into ``mm``/``addmm``). Names are ``namespace.op``, globs allowed.
DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.linear",
    "aten._scaled_dot_product_*",
)


class ModelError(ConfigError):
    """The model, its inputs or a plan do not fit together (a pattern matches no submodule, the
    forward rejects the inputs). The message is one line naming the value."""


# ------------------------------------------------------------------------------------ the plan
def op_name(op: Any) -> str:
    """``torch.ops.aten.mm.default`` -> ``"aten.mm"``: the name ``CheckpointPlan.save_ops``
    and ``SavedActivations.by_op`` use."""
    return f"{op.namespace}.{op.overloadpacket.__name__}"


@functools.cache
def _registered_op_names() -> frozenset[str]:
    # every operator the dispatcher knows, as namespace.op (a private listing: the one place
    # that tells whether a name or glob in save_ops means anything)
    return frozenset(
        name.split(".")[0].replace("::", ".") for name in torch._C._dispatch_get_all_op_names()
    )


def _check_save_op(pattern: str) -> None:
    if not isinstance(pattern, str):
        raise ConfigError(f"save_ops entry {pattern!r} must be an op name such as 'aten.mm'")
    if not any(fnmatch.fnmatchcase(name, pattern) for name in _registered_op_names()):
        raise ConfigError(
            f"save_ops entry {pattern!r} names no PyTorch op; write namespace.op, e.g. "
            "'aten.mm' or 'aten._scaled_dot_product_*'"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """Activation checkpointing for a model, as data.

    Attributes:
      mode: ``"none"`` (autograd saves what it saves), ``"full"`` (each unit runs under
        ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: only its inputs are kept,
        its forward runs again in the backward pass) or ``"selective"`` (the same, with
        ``create_selective_checkpoint_contexts``: the outputs of ``save_ops`` are kept, the
        other ops are recomputed).
      units: the checkpoint units: a module class (every instance), or a glob on qualified
        names (``named_modules()``; the model itself has none), or a tuple of them. In a glob
        ``*`` and ``?`` stay within one name part (``"model.layers.*"`` is every decoder layer,
        not their submodules; ``"*"`` every child of an ``nn.Sequential``) and ``**`` crosses
        dots. A unit inside another unit is dropped (already checkpointed).
        Required unless ``mode`` is ``"none"``.
      save_ops: ops whose outputs ``selective`` keeps, as ``namespace.op`` names or globs
        (``"aten.mm"``, ``"aten._scaled_dot_product_*"``); ``selective`` only.
    """

    mode: Mode = "none"
    units: Unit | tuple[Unit, ...] = ()
    save_ops: tuple[str, ...] = DEFAULT_SAVE_OPS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of {', '.join(MODES)}")
        units = self.units if isinstance(self.units, tuple) else (self.units,)
        object.__setattr__(self, "units", units)
        for unit in units:
            if not (isinstance(unit, str) or _is_module_class(unit)):
                raise ConfigError(
                    f"units entry {unit!r} must be a glob on module names such as "
                    "'model.layers.*' or an nn.Module subclass"
                )
        if self.mode != "none" and not units:
            raise ConfigError(
                f"mode={self.mode!r} needs units: the submodules to checkpoint, e.g. "
                "units='model.layers.*'"
            )
        object.__setattr__(self, "save_ops", tuple(self.save_ops))
        if self.mode != "selective" and self.save_ops != DEFAULT_SAVE_OPS:
            raise ConfigError(f"save_ops applies to mode='selective' only (mode={self.mode!r})")
        for pattern in self.save_ops:
            _check_save_op(pattern)

    def describe(self) -> str:
        """One line: the mode, the units and (selective) the saved ops."""
        if self.mode == "none":
            return "none (no checkpointing)"
        units = ", ".join(u if isinstance(u, str) else u.__name__ for u in self.units)
        text = f"{self.mode} checkpointing of {units} (torch.utils.checkpoint, non-reentrant)"
        if self.mode == "selective":
            text += f", saving the outputs of {', '.join(self.save_ops)}"
        return text

    def saves(self, op: Any) -> bool:
        """Whether ``selective`` keeps the output of ``op`` (an ``OpOverload``)."""
        return _matches_any(op_name(op), self.save_ops)


@functools.cache
def _matches_any(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _is_module_class(unit: object) -> bool:
    return isinstance(unit, type) and issubclass(unit, nn.Module)


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """``*`` and ``?`` within one part of a dotted name, ``**`` across parts."""
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    table = {"**": ".*", "*": r"[^.]*", "?": r"[^.]"}
    return re.compile("".join(table.get(p, re.escape(p)) for p in parts))


def _no_match(model: nn.Module, unit: Unit) -> ModelError:
    names = [name for name, _ in model.named_modules() if name]
    if isinstance(unit, str):
        depth = unit.count(".")
        nearby = [n for n in names if n.count(".") == depth] or names
        what = f"units pattern {unit!r} matches no submodule"
    else:
        classes = dict.fromkeys(type(m).__name__ for m in model.modules())
        nearby = list(classes)
        what = f"units class {unit.__name__} has no instance"
    more = f" (and {len(nearby) - 5} more)" if len(nearby) > 5 else ""
    return ModelError(f"{what} in {type(model).__name__}; it has: {', '.join(nearby[:5])}{more}")


def unit_modules(model: nn.Module, plan: CheckpointPlan) -> list[tuple[str, nn.Module]]:
    """The checkpoint units ``plan`` selects in ``model`` (qualified name, module), outermost
    only, in ``named_modules()`` order. Raises ``ModelError`` for an entry matching nothing."""
    if plan.mode == "none":
        return []
    modules = list(model.named_modules())
    chosen: dict[str, nn.Module] = {}
    for unit in plan.units:
        if isinstance(unit, str):
            regex = _glob_regex(unit)
            hits = [(n, m) for n, m in modules if n and regex.fullmatch(n)]  # not the root
        else:
            hits = [(n, m) for n, m in modules if isinstance(m, unit)]
        if not hits:
            raise _no_match(model, unit)
        chosen.update(hits)

    def inside_another(name: str) -> bool:
        return any(name.startswith(f"{other}.") or other == "" for other in chosen if other != name)

    return [(n, m) for n, m in chosen.items() if not inside_another(n)]


KeepFn = Callable[[torch.Tensor], None]


def _selective_context(plan: CheckpointPlan, keep: KeepFn | None) -> Callable[[], Any]:
    """``context_fn`` for ``checkpoint``: stock selective checkpointing saving ``save_ops``."""

    def saved(output: Any) -> None:  # the cache holds every tensor the op returns
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor):
                keep(t)

    def decide(op: Any, *args: Any, **kwargs: Any) -> tuple[CheckpointPolicy, Any]:
        if not plan.saves(op):
            return CheckpointPolicy.PREFER_RECOMPUTE, None
        return CheckpointPolicy.MUST_SAVE, saved if keep is not None else None

    return functools.partial(selective_checkpoint_contexts, decide)


def _checkpointed(
    forward: Callable[..., Any], plan: CheckpointPlan, keep: KeepFn | None
) -> Callable[..., Any]:
    context_fn = _selective_context(plan, keep) if plan.mode == "selective" else None

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if keep is not None:  # checkpoint holds its arguments (kwargs too) until the backward
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    keep(t)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    run.checkpoint_plan = plan  # marks a wrapped forward
    return run


@contextlib.contextmanager
def _applied(
    model: nn.Module, plan: CheckpointPlan, keep: KeepFn | None = None
) -> Iterator[tuple[str, ...]]:
    units = unit_modules(model, plan)
    for name, module in units:
        if hasattr(module.__dict__.get("forward"), "checkpoint_plan"):
            raise ModelError(f"module {name!r} already runs under a CheckpointPlan")
    replaced: list[tuple[nn.Module, Any]] = []
    try:
        for _, module in units:
            replaced.append((module, module.__dict__.get("forward")))
            module.forward = _checkpointed(module.forward, plan, keep)
        yield tuple(name for name, _ in units)
    finally:
        for module, previous in replaced:
            if previous is None:
                del module.forward
            else:
                module.forward = previous


@contextlib.contextmanager
def applied(model: nn.Module, plan: CheckpointPlan | None) -> Iterator[tuple[str, ...]]:
    """Run ``model`` under ``plan`` inside the ``with`` block; yields the units' qualified names.

    Each unit's ``forward`` is replaced on the instance by one that calls the original through
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (``selective``: with
    ``create_selective_checkpoint_contexts``); the class, the state dict and module hooks are
    untouched, and the original ``forward`` comes back on exit. Train (forward and backward)
    inside the block: the backward recomputes through the wrapped units."""
    with _applied(model, plan or CheckpointPlan()) as names:
        yield names

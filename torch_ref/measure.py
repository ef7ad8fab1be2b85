"""jaxmem's memory figures for any ``nn.Module``: your own model, a Hugging Face model, not only
torch_ref's decoder.

Three calls, each on a model you do not edit:

- ``CheckpointPlan``: a checkpoint policy as data (which submodules are checkpoint units, by
  class or by a glob on qualified names such as ``"model.layers.*"``; ``none``, ``full`` or
  ``selective``); ``applied(model, plan)`` runs the model under it with stock PyTorch
  (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, selective checkpointing through
  ``create_selective_checkpoint_contexts``) and restores the model on exit.
- ``saved_activations(model, inputs, policy=...)``: what one forward (and loss) leaves for the
  backward pass, by op and by module, on fake tensors by default (``FakeTensorMode``: shapes
  only, no memory), so a GPU-scale batch is measured on a laptop; and the matmul FLOPs of
  forward + backward (``FlopCounterMode``), recompute included.
- ``step_peak(model, inputs, optimizer_factory=...)``: the peak bytes of real training steps
  (forward, backward, optimizer step): the CUDA caching allocator's peak on a GPU, live-tensor
  accounting on CPU.

Every figure says how it was obtained (the ``*source`` fields). Errors about the model or the
plan are ``ModelError`` (a ``jaxmem.config.ConfigError``), one line naming the value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import gc
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
)
from torch.utils.flop_counter import FlopCounterMode

import torch_ref.flops  # noqa: F401  (FlopCounterMode formulas for the CPU attention kernels)
from jaxmem.config import ConfigError
from torch_ref.compat import selective_checkpoint_contexts
from torch_ref.memory import storage_key  # a storage's identity, also on fake and meta tensors

__all__ = [
    "DEFAULT_SAVE_OPS",
    "MODES",
    "CheckpointPlan",
    "ModelError",
    "SavedActivations",
    "StepPeak",
    "applied",
    "default_loss",
    "op_name",
    "saved_activations",
    "step_peak",
    "unit_modules",
]

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

ROOT, LOSS = "<model>", "<loss>"
SAVED_SOURCE = (
    "saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks), plus the unit inputs "
    "non-reentrant checkpoint holds and the op outputs selective checkpointing caches (hooks "
    "see neither); storages counted once, labelled by a TorchDispatchMode and module hooks"
)
FLOPS_SOURCE = "torch.utils.flop_counter.FlopCounterMode: matmul and attention FLOPs"
CUDA_PEAK = "runtime peak, CUDA caching allocator (torch.cuda.max_memory_allocated)"
CPU_PEAK = (
    "live-tensor accounting on CPU (parameters, buffers, gradients, inputs and optimizer state, "
    "plus every storage an op allocates, minus frees: TorchDispatchMode and weakref finalizers; "
    "scratch memory a kernel frees before it returns is not seen)"
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


# ------------------------------------------------------------------------ running the model
Inputs = torch.Tensor | tuple[Any, ...] | list[Any] | Mapping[str, Any]
LossFn = Callable[[Any], torch.Tensor]


def _call_arguments(inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A tensor is the one positional argument, a tuple or list the positional arguments, a
    mapping the keyword arguments."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    raise ModelError(
        f"inputs of type {type(inputs).__name__} are not a tensor, a tuple of arguments or a "
        "dict of keyword arguments"
    )


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"Tensor{list(v.shape)} {str(v.dtype).removeprefix('torch.')} on {v.device}"
        return type(v).__name__

    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= 200 else line[:197] + "..."


def default_loss(output: Any) -> torch.Tensor:
    """The loss when none is given: the output's ``loss`` (a Hugging Face model given
    ``labels``), else the sum of the output tensor (a stand-in whose backward reads nothing)."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.sum()
    raise ModelError(
        f"the model returned {type(output).__name__} without a 'loss' tensor: pass "
        "loss_fn=lambda output: ... returning a scalar tensor"
    )


def _fake_hint(error: BaseException) -> str:
    if isinstance(error, DataDependentOutputException | DynamicOutputShapeException):
        return " (the forward reads tensor values, which fake tensors do not have: use fake=False)"
    return ""


def _loss_of(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn | None
) -> torch.Tensor:
    """One forward and the loss; only the loss stays referenced (the output is dropped, so
    what remains alive is what the backward holds)."""
    try:
        output = model(*args, **kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ModelError(
            f"{type(model).__name__}({_describe(args, kwargs)}) raised "
            f"{type(e).__name__}: {_first_line(e)}{_fake_hint(e)}"
        ) from e
    try:
        loss = (loss_fn or default_loss)(output)
    except ConfigError:
        raise
    except Exception as e:
        raise ModelError(f"loss_fn raised {type(e).__name__}: {_first_line(e)}") from e
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"Tensor{list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ModelError(f"loss_fn returned {got}, not a scalar tensor")
    if not loss.requires_grad:
        raise ModelError("the loss does not require grad: no parameter or input reaches it")
    return loss


def _tensors(model: nn.Module, *more: Any) -> list[torch.Tensor]:
    """Parameters, buffers and the tensors among ``more``."""
    found = [*model.parameters(), *model.buffers()]
    return found + [t for t in tree_leaves(more) if isinstance(t, torch.Tensor)]


_FRESH = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def new_storages(
    func: Any, args: Any, kwargs: Any, out: Any, fake_mode: FakeTensorMode | None = None
) -> list[torch.Tensor]:
    """The tensors among ``out`` whose storage ``func`` allocated: not views of an argument
    (a transpose, ``detach``, an in-place op's result). ``torch.tensor(...)`` allocates outside
    the dispatcher and enters it through ``lift_fresh``, which returns that very tensor on real
    tensors (and a new fake one under ``FakeTensorMode``): new memory either way. Under
    ``fake_mode`` a real argument (a tensor the loss function closes over) is converted to a
    fake one on first use: its views share that fake tensor's storage."""
    inputs = set()
    if func not in _FRESH:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                real = fake_mode is not None and not isinstance(t, FakeTensor)
                inputs.add(storage_key(fake_mode.from_tensor(t) if real else t))
    return [
        t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and storage_key(t) not in inputs
    ]


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# --------------------------------------------------------------------------------- fake tensors
@contextlib.contextmanager
def _fake_model(model: nn.Module, mode: FakeTensorMode) -> Iterator[str]:
    """Swap every parameter and buffer of ``model`` for a fake tensor of the same shape, dtype
    and ``requires_grad`` (tied ones stay tied), restore on exit; yields the device the fake
    step runs on: the parameters' own, CPU for a model on the ``meta`` device."""
    first = next(iter(_tensors(model)), None)
    device = "cpu" if first is None or first.is_meta else str(first.device)
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            fakes[id(t)] = _to_fake(t, mode, device)
        return fakes[id(t)]

    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is not None:
                        swapped.append((table, name, t))
                        table[name] = fake(t)
        yield device
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def _to_fake(t: torch.Tensor, mode: FakeTensorMode, device: str) -> torch.Tensor:
    """A fake copy of ``t`` (views keep sharing storage); a meta tensor becomes a fake tensor on
    ``device``."""
    if not t.is_meta:
        return mode.from_tensor(t)
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake.requires_grad_(t.requires_grad)


def _check_real(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    meta = [t for t in _tensors(model, args, kwargs) if t.is_meta]
    if meta:
        raise ModelError(
            f"{type(model).__name__} or its inputs are on the meta device (no data): measure "
            "with fake=True, or build the model on a real device"
        )


# ------------------------------------------------------------------------- saved activations
@dataclasses.dataclass(frozen=True)
class SavedActivations:
    """What one forward (and loss) leaves for the backward pass, and the step's FLOPs.

    Attributes:
      activation_bytes: bytes of the storages the forward made that the backward reads:
        what autograd saved, the inputs each checkpoint unit holds, the outputs selective
        checkpointing caches. Views share their storage and count once.
      by_op: ``activation_bytes`` by the op that made each storage (``"aten.mm"``), largest
        first.
      by_module: ``activation_bytes`` by the qualified name of the innermost module whose
        forward made it (``"<model>"``: the model's own forward outside any submodule,
        ``"<loss>"``: the loss function), largest first.
      by_device: ``activation_bytes`` by device type.
      kept_by_checkpoint_bytes: the part of ``activation_bytes`` that the checkpoint wrappers
        hold (unit inputs, selective checkpointing's cache) and that saved-tensor hooks alone
        do not see as saved.
      argument_bytes: parameters, buffers, inputs and other tensors that existed before the
        forward and that the backward reads: memory that exists anyway, reported apart.
      forward_live_bytes: everything the forward allocated and still alive when it ends (the
        loss excluded). Above ``activation_bytes`` when something else holds tensors (a KV
        cache, a module that stores its output).
      n_storages: storages counted in ``activation_bytes``.
      forward_flops, flops: matmul FLOPs of the forward and of forward + backward, recompute
        included (``FlopCounterMode``).
      units: the qualified names of the checkpoint units.
      policy: the plan, in words.
      fake: whether it ran on fake tensors (shapes only: no memory, no arithmetic).
      source, flops_source: how the figures were obtained.
    """

    activation_bytes: int
    by_op: dict[str, int]
    by_module: dict[str, int]
    by_device: dict[str, int]
    kept_by_checkpoint_bytes: int
    argument_bytes: int
    forward_live_bytes: int
    n_storages: int
    forward_flops: int
    flops: int
    units: tuple[str, ...]
    policy: str
    fake: bool
    source: str
    flops_source: str

    def top_ops(self, n: int = 5) -> list[tuple[str, int]]:
        """The ``n`` ops whose outputs take the most saved bytes."""
        return list(self.by_op.items())[:n]


@dataclasses.dataclass
class _Made:
    nbytes: int
    device: str
    op: str
    module: str


class _Recorder(TorchDispatchMode):
    """Labels every storage the forward allocates with its op and innermost module, forgets it
    when it is freed, and collects what the backward will read (``keep``, the pack hook)."""

    def __init__(self, model: nn.Module, fake_mode: FakeTensorMode | None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.made: dict[int, _Made] = {}
        self.kept: dict[int, tuple[int, str]] = {}  # held by checkpoint / its selective cache
        self.saved: dict[int, tuple[int, str]] = {}  # seen by the saved-tensor pack hook
        self.modules: list[str] = [LOSS]
        self.handles = []
        for name, module in model.named_modules():
            qualified = name or ROOT
            self.handles.append(module.register_forward_pre_hook(self._enter(qualified)))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.modules.append(name)

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.modules.pop()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in new_storages(func, args, kwargs, out, self.fake_mode):
            self._made(t, op_name(func))
        return out

    def _made(self, t: torch.Tensor, op: str) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.made:
            return
        self.made[key] = _Made(storage.nbytes(), t.device.type, op, self.modules[-1])
        weakref.finalize(storage, self.made.pop, key, None)

    @staticmethod
    def _entry(t: torch.Tensor) -> tuple[int, tuple[int, str]]:
        return storage_key(t), (t.untyped_storage().nbytes(), t.device.type)

    def keep(self, t: torch.Tensor) -> None:
        key, entry = self._entry(t)
        self.kept[key] = entry

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key, entry = self._entry(t)
        self.saved[key] = entry
        return t


def _sorted(table: dict[str, int]) -> dict[str, int]:
    return dict(sorted(table.items(), key=lambda kv: (-kv[1], kv[0])))


def _tally(recorder: _Recorder, loss: torch.Tensor) -> dict[str, Any]:
    """The byte figures of ``SavedActivations`` from what the recorder saw."""
    read = {**recorder.kept, **recorder.saved}
    by_op: dict[str, int] = {}
    by_module: dict[str, int] = {}
    by_device: dict[str, int] = {}
    activations = arguments = kept_only = n = 0
    for key, (nbytes, device) in read.items():
        if not nbytes:  # an empty placeholder some backward formulas save (torch 2.11)
            continue
        made = recorder.made.get(key)
        if made is None:  # existed before the forward: a parameter, buffer or input
            arguments += nbytes
            continue
        n += 1
        activations += nbytes
        kept_only += nbytes if key not in recorder.saved else 0
        by_op[made.op] = by_op.get(made.op, 0) + nbytes
        by_module[made.module] = by_module.get(made.module, 0) + nbytes
        by_device[device] = by_device.get(device, 0) + nbytes
    live = sum(m.nbytes for k, m in recorder.made.items() if k != storage_key(loss))
    return {
        "activation_bytes": activations,
        "by_op": _sorted(by_op),
        "by_module": _sorted(by_module),
        "by_device": _sorted(by_device),
        "kept_by_checkpoint_bytes": kept_only,
        "argument_bytes": arguments,
        "forward_live_bytes": live,
        "n_storages": n,
    }


def _gradient_leaves(model: nn.Module, args: Any, kwargs: Any) -> list[torch.Tensor]:
    leaves = [t for t in _tensors(model, args, kwargs) if t.requires_grad and t.is_leaf]
    if not leaves:
        raise ModelError(
            f"no parameter or input of {type(model).__name__} requires grad: nothing to train"
        )
    return list({id(t): t for t in leaves}.values())


def saved_activations(
    model: nn.Module,
    inputs: Inputs,
    *,
    policy: CheckpointPlan | None = None,
    loss_fn: LossFn | None = None,
    fake: bool = True,
) -> SavedActivations:
    """Measure what one forward of ``model(inputs)`` and its loss leave for the backward pass,
    under ``policy`` (default: no checkpointing), and the FLOPs of forward + backward.

    ``inputs``: a tensor (the one argument), a tuple of positional arguments or a dict of
    keyword arguments. ``loss_fn(output)`` returns the scalar loss (default: ``default_loss``).

    ``fake=True`` (default): parameters, buffers and inputs are replaced by fake tensors
    (``FakeTensorMode``) for the measurement and put back after, so nothing is allocated and
    any batch can be asked about. The model may live on the ``meta`` device (build it under
    ``with torch.device("meta"):``) and the inputs may be ``meta`` tensors (shapes only); the
    step then runs as a CPU step, choosing CPU kernels. A forward that reads tensor values
    (``.item()``, data-dependent shapes) cannot run on fake tensors: use ``fake=False``.

    ``fake=False`` runs the real tensors. Either way the backward is run once with
    ``torch.autograd.grad`` (for the FLOPs): ``.grad`` of the model is not touched.
    """
    plan = policy or CheckpointPlan()
    args, kwargs = _call_arguments(inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    with contextlib.ExitStack() as stack:
        if mode is not None:
            device = stack.enter_context(_fake_model(model, mode))
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: _to_fake(t, mode, device), (args, kwargs)
            )
            stack.enter_context(mode)
        else:
            _check_real(model, args, kwargs)
        recorder = _Recorder(model, mode)
        stack.callback(recorder.close)
        units = stack.enter_context(_applied(model, plan, keep=recorder.keep))
        leaves = _gradient_leaves(model, args, kwargs)
        counter = stack.enter_context(FlopCounterMode(display=False))
        with recorder, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            loss = _loss_of(model, args, kwargs, loss_fn)
        gc.collect()  # storages in reference cycles are free, not live: let their finalizers run
        figures = _tally(recorder, loss)
        forward_flops = counter.get_total_flops()
        torch.autograd.grad(loss, leaves, allow_unused=True)
        flops = counter.get_total_flops()
    return SavedActivations(
        **figures,
        forward_flops=forward_flops,
        flops=flops,
        units=units,
        policy=plan.describe(),
        fake=fake,
        source=SAVED_SOURCE
        + ("; run on fake tensors (FakeTensorMode: shapes only)" if fake else ""),
        flops_source=FLOPS_SOURCE,
    )


# ------------------------------------------------------------------------------ the step peak
@dataclasses.dataclass(frozen=True)
class StepPeak:
    """The peak memory of real training steps.

    Attributes:
      peak_bytes: the larger of the two step peaks below.
      first_step_peak_bytes: peak of the first step, which creates the optimizer state.
      steady_step_peak_bytes: peak of the second step, the optimizer state resident throughout
        (every later step looks like it).
      parameter_bytes, gradient_bytes, optimizer_state_bytes: counted from the tensors after
        the second step (storages counted once).
      device: where the step ran.
      policy: the checkpoint plan, in words.
      source: how the peaks were obtained (``CUDA_PEAK`` or ``CPU_PEAK``).
    """

    peak_bytes: int
    first_step_peak_bytes: int
    steady_step_peak_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    device: str
    policy: str
    source: str


class _LiveStorages(TorchDispatchMode):
    """Bytes of the storages alive now and their peak: the ones registered with ``add`` and
    every storage an op allocates while the mode is active, each dropped when it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self.live or nbytes == 0:
            return
        self.live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def add_all(self, tensors: Iterable[torch.Tensor]) -> None:
        """Register tensors alive now, keeping no reference to them (a gradient freed by
        ``zero_grad`` must leave the count)."""
        for t in tensors:
            self.add(t)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in new_storages(func, args, kwargs, out):
            self.add(t)
        return out


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def _train_step(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer,
) -> None:
    optimizer.zero_grad(set_to_none=True)
    _loss_of(model, args, kwargs, loss_fn).backward()
    optimizer.step()


def _cuda_peaks(step: Callable[[], None], device: torch.device) -> list[int]:
    peaks = []
    for _ in range(2):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device))
    return peaks


def _cpu_peaks(step: Callable[[], None], resident: Callable[[], list[torch.Tensor]]) -> list[int]:
    tracker = _LiveStorages()
    tracker.add_all(resident())
    peaks = []
    with tracker:
        for _ in range(2):
            tracker.peak = tracker.current
            step()
            peaks.append(tracker.peak)
    return peaks


def step_peak(
    model: nn.Module,
    inputs: Inputs,
    *,
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = torch.optim.AdamW,
    loss_fn: LossFn | None = None,
    policy: CheckpointPlan | None = None,
) -> StepPeak:
    """Run two real training steps of ``model`` on ``inputs`` (each: ``zero_grad(set_to_none=
    True)``, forward, loss, backward, ``optimizer.step()``) under ``policy`` and report the peak
    bytes of each. The optimizer is ``optimizer_factory(trainable parameters)``; its state is
    created by the first step.

    The model must hold real tensors on one device with its inputs. On CUDA the peak is the
    caching allocator's (``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``: every tensor of the process on that device); on CPU it is
    counted from the tensors (``CPU_PEAK``). The steps train the model: its parameters and
    ``.grad`` change (pass a copy if they matter)."""
    plan = policy or CheckpointPlan()
    args, kwargs = _call_arguments(inputs)
    _check_real(model, args, kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ModelError(f"no parameter of {type(model).__name__} requires grad: nothing to train")
    device = params[0].device
    optimizer = optimizer_factory(params)
    with _applied(model, plan):
        step = functools.partial(_train_step, model, args, kwargs, loss_fn, optimizer)
        if device.type == "cuda":
            peaks, source = _cuda_peaks(step, device), CUDA_PEAK
        else:

            def resident() -> list[torch.Tensor]:
                grads = [p.grad for p in params if p.grad is not None]
                return _tensors(model, args, kwargs) + grads

            peaks, source = _cpu_peaks(step, resident), CPU_PEAK
    return StepPeak(
        peak_bytes=max(peaks),
        first_step_peak_bytes=peaks[0],
        steady_step_peak_bytes=peaks[1],
        parameter_bytes=_unique_bytes(model.parameters()),
        gradient_bytes=_unique_bytes(p.grad for p in params if p.grad is not None),
        optimizer_state_bytes=_unique_bytes(_optimizer_tensors(optimizer)),
        device=str(device),
        policy=plan.describe(),
        source=source,
    )

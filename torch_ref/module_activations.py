"""What one forward (and loss) of any ``nn.Module`` leaves for the backward pass, by op and by
module, and the matmul FLOPs of forward + backward (``saved_activations``), on fake tensors by
default (``FakeTensorMode``: shapes only, no memory), so a GPU-scale batch is measured on a
laptop; and the helpers that run a user's model on its inputs (``module_peak`` runs them too).

Part of the memory tools for any ``nn.Module`` (``torch_ref.module_memory``, the public API).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

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
from torch.utils.flop_counter import FlopCounterMode

import torch_ref.flops  # noqa: F401  (FlopCounterMode formulas for the CPU attention kernels)
from jaxmem.config import ConfigError
from torch_ref.checkpoint_plan import CheckpointPlan, ModelError, _applied, op_name
from torch_ref.forward_memory import storage_key  # a storage's identity, also on fake tensors

ROOT, LOSS = "<model>", "<loss>"
SAVED_SOURCE = (
    "saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks), plus the unit inputs "
    "non-reentrant checkpoint holds and the op outputs selective checkpointing caches (hooks "
    "see neither); storages counted once, labelled by a TorchDispatchMode and module hooks"
)
FLOPS_SOURCE = "torch.utils.flop_counter.FlopCounterMode: matmul and attention FLOPs"

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

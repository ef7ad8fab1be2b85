"""Memory measurement for torch_ref, mirroring ``jaxmem.memory``.

``forward_live_bytes`` counts what a forward pass leaves alive for the backward pass: every tensor
storage created during the forward and still referenced when it ends (activations autograd
saved, checkpoint inputs, tensors a selective policy kept, host copies of offloaded ones),
de-duplicated by storage and split by device, and (given the model's block stack) grouped by the
jaxmem tag of the op that made each storage, so the two frameworks can be compared tensor by
tensor.

``saved_tensor_bytes`` is the other, narrower figure: what autograd's saved-tensor hooks see
(storages de-duplicated, parameters and inputs apart). It sees what autograd saves, including a
non-reentrant checkpoint's inputs, and is blind to what a selective policy keeps itself (held by
its dispatch mode, not by autograd). A test checks both figures agree under ``none`` and
``full`` and differ by exactly the kept tensors under ``selective``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from jaxmem.config import ModelConfig
from torch_ref.context import inside_ring
from torch_ref.loss import forming_loss_gradients


def physical(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes on this rank: a DTensor's local shard (a
    DTensor is a wrapper whose own storage has the *global* shape's size: counting it would
    count every rank's shards, e.g. a column-parallel output at its whole width), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage, shared by its views: the address of the ``StorageImpl``
    (a DTensor's: its local shard's). Not ``data_ptr()``, which is 0 for every storage of a
    meta or fake tensor (the accounting also runs under ``FakeTensorMode``, where no memory
    exists)."""
    return physical(t).untyped_storage()._cdata


@dataclasses.dataclass(frozen=True)
class LiveBytes:
    device_bytes: int  # on the compute device (on a CPU-only run: not offloaded)
    host_bytes: int  # offloaded to host memory (cpu tensors while computing on an accelerator,
    # or tensors a policy explicitly moved to host on a CPU-only run)
    n_storages: int
    # compute-dtype copies of parameters (autocast's casts, cached for the backward): new memory,
    # reported apart from activations, as jaxmem.memory.residuals does; not in device/host bytes
    parameter_copy_bytes: int = 0
    # device + host bytes by the jaxmem tag of the op that made each storage (see _BlockScope);
    # empty when no block stack was given
    by_name: dict[str, int] = dataclasses.field(default_factory=dict)


LAYER_INPUT, STACK_OUTPUT = "<layer input>", "<stack output>"  # the names jaxmem.memory uses
PARAMETER_COPY = "<parameter copy>"
_CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)


def _is_parameter(t: Any) -> bool:
    """A leaf that requires grad, or a view of one (the head's transposed embedding table): a
    parameter (also under FakeTensorMode, where the fake copy of an ``nn.Parameter`` may not keep
    its class)."""
    if not isinstance(t, torch.Tensor):
        return False
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def layout_copies(cfg: ModelConfig) -> dict[tuple[str, int], tuple[str, ...]]:
    """The contiguous copies ``torch.einsum`` makes of q, k, v (heads layout) and of the context
    (merging heads), in the order of the op stream (torch 2.13): autograd saves these copies
    instead of the tensors they copy, so they carry those tensors' names in the listing (the
    rotated q and k under RoPE)."""
    q, k = ("query_rope", "key_rope") if cfg.positions == "rope" else ("query_proj", "key_proj")
    names = (q, k, "value_proj", "attn_context")
    return {("clone", i): (name,) for i, name in enumerate(names)}


class _BlockScope:
    """Names the storages a forward allocates the way ``jaxmem.memory`` names residuals.

    Forward hooks on every block of the stack say which block runs; inside one, an op's output
    gets the tag(s) ``torch_ref.remat.block_ops`` gives its (op kind, occurrence), q/k/v joined
    by ``/`` (one fused matmul). A block's input is ``<layer input>``, the last block's output
    ``<stack output>``; other outputs are ``<kind in block>`` or ``<kind outside the stack>``.
    """

    def __init__(self, stack: torch.nn.Module, cfg: ModelConfig):
        from torch_ref.remat import _op_kind, block_ops

        self.op_kind, self.ops, self.copies = _op_kind, block_ops(cfg), layout_copies(cfg)
        self.depth = 0
        self.counts: dict[str, int] = {}
        self.inputs: set[int] = set()
        self.last_output = 0
        self.handles = []
        for block in stack.layers:
            self.handles.append(block.register_forward_pre_hook(self._enter))
            self.handles.append(block.register_forward_hook(self._leave))

    def _enter(self, module, args) -> None:
        self.depth += 1
        self.counts = {}
        # while it lives: a storage freed later (an inner segment's input) may leave its
        # address to a new one
        storage = args[0].untyped_storage()
        self.inputs.add(storage._cdata)
        weakref.finalize(storage, self.inputs.discard, storage._cdata)

    def _leave(self, module, args, out) -> None:
        self.depth -= 1
        storage = out.untyped_storage()
        self.last_output = storage._cdata
        weakref.finalize(storage, self._forget_output, storage._cdata)

    def _forget_output(self, key: int) -> None:
        if self.last_output == key:  # freed (e.g. recomputed later): its address may be reused
            self.last_output = 0

    def label(self, func: Any) -> str:
        kind = self.op_kind(func)
        if forming_loss_gradients():
            return "<loss gradients>"  # LossPolicy.chunks: formed in the forward
        if self.depth == 0:
            return f"<{kind} outside the stack>"
        if inside_ring():  # one function (its ops would shift the block's op names)
            return "<ring attention>"
        index = self.counts.get(kind, 0)
        self.counts[kind] = index + 1
        names = self.ops.get((kind, index)) or self.copies.get((kind, index))
        return "/".join(names) if names else f"<{kind} in block>"

    def final_label(self, key: int, label: str) -> str:
        if key == self.last_output:
            return STACK_OUTPUT
        return LAYER_INPUT if key in self.inputs else label

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _TrackAllocations(TorchDispatchMode):
    def __init__(self, scope: _BlockScope | None = None) -> None:
        super().__init__()
        self.scope = scope
        self.live: dict[int, tuple[int, str, str]] = {}

    def _track(self, t: torch.Tensor, label: str) -> None:
        t = physical(t)
        storage = t.untyped_storage()
        key = storage._cdata  # = storage_key(t)
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = (storage.nbytes(), t.device.type, label)
        weakref.finalize(storage, self.live.pop, key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.lift_fresh.default:
            # a constant made outside the dispatcher (``torch.tensor(...)``) entering it: not
            # an allocation of the step (FakeTensorMode gives it a storage of its own)
            return out
        label = self.scope.label(func) if self.scope else ""
        if func in _CASTS and args and isinstance(args[0], torch.Tensor):
            source = self.live.get(storage_key(args[0]))
            if _is_parameter(args[0]) or (source is not None and source[2] == PARAMETER_COPY):
                label = PARAMETER_COPY  # a cast of a parameter, or of such a cast
        # Views (e.g. a parameter's transpose) share their input's storage: not an allocation.
        inputs = {
            storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and storage_key(t) not in inputs:
                self._track(t, label)
        return out


def forward_live_bytes(
    forward: Callable[[], Any],
    *,
    host_storages: Callable[[], set[int]] | None = None,
    stack: torch.nn.Module | None = None,
    kept_names: Callable[[], dict[int, str]] | None = None,
) -> tuple[Any, LiveBytes]:
    """Run ``forward()`` and count the storages it allocated that are alive at its end, minus
    the returned tensors' own. ``host_storages()`` names storages to count as host memory (the
    copies an offloading policy made; on a CPU-only machine they are not told apart by device).
    With ``stack`` (a ``torch_ref.BlockStack``) the bytes are also grouped by tag
    (``LiveBytes.by_name``); ``kept_names()`` names the copies a policy made (storage -> tag).
    """
    scope = _BlockScope(stack, stack.cfg) if stack is not None else None
    mode = _TrackAllocations(scope)
    try:
        with mode:
            out = forward()
    finally:
        if scope is not None:
            scope.close()
    returned = {storage_key(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    host = host_storages() if host_storages else set()
    named = kept_names() if kept_names else {}
    device_bytes = host_bytes = copies = n = 0
    by_name: dict[str, int] = {}
    compute = next((t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)), "cpu")
    for key, (nbytes, device, label) in list(mode.live.items()):
        if key in returned:
            continue
        n += 1
        if label == PARAMETER_COPY:
            copies += nbytes
            continue
        if key in host or (device == "cpu" and compute != "cpu"):
            host_bytes += nbytes
        else:
            device_bytes += nbytes
        if scope is not None:
            name = named.get(key) or scope.final_label(key, label)
            by_name[name] = by_name.get(name, 0) + nbytes
    return out, LiveBytes(
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        n_storages=n,
        parameter_copy_bytes=copies,
        by_name=by_name,
    )


@dataclasses.dataclass(frozen=True)
class SavedBytes:
    """What autograd's saved-tensor hooks saw during one forward (storages counted once)."""

    activation_bytes_device: int
    activation_bytes_host: int  # saved tensors living in cpu memory while computing elsewhere
    argument_bytes: int  # parameters and batch tensors (and views of them) the backward keeps
    # anyway: memory that exists whether or not it is saved
    n_storages: int


def saved_tensor_bytes(forward: Callable[[], Any], arguments: Any = ()) -> tuple[Any, SavedBytes]:
    """Run ``forward()`` under ``torch.autograd.graph.saved_tensors_hooks`` and count the saved
    storages, de-duplicated; storages of ``arguments`` (parameters, inputs) are reported apart.
    Blind to tensors a selective policy keeps itself (see the module docstring)."""
    params = {storage_key(p) for p in arguments}
    seen: dict[int, tuple[int, str]] = {}
    compute: list[str] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = physical(t).untyped_storage()
        seen.setdefault(storage._cdata, (storage.nbytes(), t.device.type))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    compute = [t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    device = compute[0] if compute else "cpu"
    act_dev = act_host = par = 0
    for key, (nbytes, dev) in seen.items():
        if key in params:
            par += nbytes
        elif dev == "cpu" and device != "cpu":
            act_host += nbytes
        else:
            act_dev += nbytes
    return out, SavedBytes(
        activation_bytes_device=act_dev,
        activation_bytes_host=act_host,
        argument_bytes=par,
        n_storages=len(seen),
    )


def measure_lm_step(
    model: torch.nn.Module,
    runner: Any,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    precision: Any,
) -> tuple[LiveBytes, SavedBytes, int]:
    """One forward + backward of the mean LM loss (autocast for mixed precision).

    Returns, from the one forward, the bytes it leaves for the backward (live-tensor accounting,
    by tag; the host copies of ``runner``, a ``torch_ref.remat.PolicyLayers``, counted as host)
    and what the saved-tensor hooks saw; and the matmul FLOPs executed (``FlopCounterMode``,
    recompute included). Gradients stay in ``.grad``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from torch_ref.train import lm_loss_sum

    def forward():
        loss_sum, n = lm_loss_sum(model, {"inputs": inputs, "targets": targets}, precision)
        return loss_sum / n

    with FlopCounterMode(display=False) as counter:
        (loss, saved), live = forward_live_bytes(
            lambda: saved_tensor_bytes(forward, [*model.parameters(), inputs, targets]),
            host_storages=runner.host_storages,
            stack=model.blocks,
            kept_names=runner.kept_names,
        )
        loss.backward()
    return live, saved, counter.get_total_flops()

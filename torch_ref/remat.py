"""jaxmem's ``MemoryPolicy`` translated to PyTorch (the other translation is ``jaxmem.remat``).

``apply_memory_policy(stack, policy)`` sets the block stack's ``layers_fn``; the model and its
state dict do not change. The translations:

- ``none``: the plain loop.
- ``full``: ``torch.utils.checkpoint.checkpoint`` per selected block, ``use_reentrant`` taken
  from the policy (both modes work; never left to PyTorch's default).
- ``nested``: ⌈√L⌉-block segments, each checkpointed, each block inside checkpointed again (the
  two-level form of ``checkpoint_sequential``; non-reentrant only).
- names (``selective``, ``mlp``, ``dots``, ``offload``, custom): non-reentrant checkpoint with a
  ``context_fn`` that keeps chosen op outputs in device memory, moves others to host memory and
  recomputes the rest. PyTorch's own selective checkpointing
  (``create_selective_checkpoint_contexts``) decides per op but cannot offload, so the two small
  dispatch modes here do the same job with the third choice (host memory) added.

PyTorch ops carry no names, so ``BLOCK_OPS`` maps each tag of ``jaxmem.model.CHECKPOINT_NAMES`` to
the op that produces it in ``torch_ref.model.Block`` (by op kind and occurrence within a block);
a test records the real op stream and checks every entry's shape against the JAX tag.

Also here, for PyTorch users: ``save_on_cpu_layers_fn`` (PyTorch's built-in saved-tensor-hook
offload of every saved tensor) and ``OffloadCheckpoint``, a correct, general version of the
seeds' ``OffloadFunction`` (input kept in host memory, the real block recomputed in backward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from jaxmem.config import ConfigError, ModelConfig
from jaxmem.model import CHECKPOINT_NAMES
from jaxmem.remat import LayerSelection, MemoryPolicy, nested_segment_size
from torch_ref.model import BlockStack, run_layers

LINEAR_OPS = ("addmm", "mm")  # nn.Linear with / without bias


def _op_kind(func: Any) -> str:
    name = func.overloadpacket.__name__
    return "linear" if name in LINEAR_OPS else name


def block_ops(cfg: ModelConfig) -> dict[tuple[str, int], tuple[str, ...]]:
    """``(op kind, occurrence within one block) -> tag names`` for ``torch_ref.model.Block``.

    The occurrence numbers are the same for pre- and post-norm blocks. q, k and v come out of
    one fused matmul, so they share one entry.
    """
    scores = ("masked_fill", 0) if cfg.causal else ("div", 0)
    act = "relu" if cfg.activation == "relu" else "gelu"
    return {
        ("native_layer_norm", 0): ("norm1_out",),
        ("linear", 0): ("query_proj", "key_proj", "value_proj"),
        scores: ("attn_scores",),
        ("_softmax", 0): ("attn_probs",),
        ("bmm", 1): ("attn_context",),
        ("linear", 1): ("attn_out",),
        ("add", 0): ("attn_residual",),
        ("native_layer_norm", 1): ("norm2_out",),
        ("linear", 2): ("mlp_up",),
        (act, 0): ("mlp_act",),
        ("linear", 3): ("mlp_down",),
        ("add", 1): ("mlp_residual",),
    }


def unread_by_backward(cfg: ModelConfig, policy: MemoryPolicy | None = None) -> frozenset[str]:
    """Tags a rematerialised block need not keep under ``policy``: no backward op reads them
    (they only feed additions, softmax, or leave the block) and, unless the policy stores them
    while leaving a read tag computed from them unstored, keeping them would only cost memory.
    JAX's partial evaluation drops the same ones (``jaxmem.analytic.kept_tags``; a test checks
    both frameworks agree). Without ``policy``: the tags no backward op reads."""
    from jaxmem.analytic import backward_reads, kept_tags

    reads = backward_reads(cfg) | {"block_input"}
    unread = frozenset(CHECKPOINT_NAMES) - reads
    if policy is None:
        return unread
    return unread - kept_tags(cfg, policy)


# The block's matmul outputs that feed only an addition: (matmul tag, the addition's tag).
_FEEDS = {"attn_out": "attn_residual", "mlp_down": "mlp_residual"}


def skippable_in_recompute(cfg: ModelConfig, policy: MemoryPolicy) -> frozenset[str]:
    """Matmul tags a recompute need not compute: not kept, and their one consumer (a residual
    addition) is either kept — its value comes back from storage — or read by no backward op.
    Their inputs are still saved by autograd when the op is replayed; only the product is
    skipped. Without this, non-reentrant replay re-runs out_proj / mlp_down (+2.5 % FLOPs under
    selective on ``small``) that JAX never recomputes."""
    from jaxmem.analytic import backward_reads, kept_tags

    kept, reads = kept_tags(cfg, policy), backward_reads(cfg)
    return frozenset(
        tag
        for tag, consumer in _FEEDS.items()
        if tag not in kept and (consumer in kept or consumer not in reads)
    )


@dataclasses.dataclass(frozen=True)
class KeptTensor:
    """One op output a policy kept for the backward pass (for tests and memory reports)."""

    layer: int
    names: tuple[str, ...]  # tag names, or ("<linear>",) for an untagged matmul under dots
    memory: str  # "device" or "host" (offloaded; on a CPU-only machine both are host RAM)
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    storage: int  # data_ptr of the kept copy's storage (for memory accounting)


class _Decider:
    """Counts ops per kind within one block and returns the policy's choice for each."""

    def __init__(self, policy: MemoryPolicy, cfg: ModelConfig):
        self.policy = policy
        self.ops = block_ops(cfg)
        self.unread = unread_by_backward(cfg, policy)
        self.skip = skippable_in_recompute(cfg, policy)
        self.counts: dict[tuple[bool, str], int] = {}

    def __call__(self, func: Any, recompute: bool) -> tuple[str, tuple[str, ...]]:
        kind = _op_kind(func)
        key = (recompute, kind)
        index = self.counts.get(key, 0)
        self.counts[key] = index + 1
        names = self.ops.get((kind, index), ())
        if self.policy.save_dots and kind == "linear":
            return "device", names or ("<linear>",)
        if recompute and kind == "linear" and names and names[0] in self.skip:
            return "skip", names
        if not names or names[0] in self.unread:
            return "recompute", names
        return self.policy.choice(names[0]), names


class _KeepMode(TorchDispatchMode):
    """Forward pass of a checkpointed block: keep (or offload) the chosen op outputs."""

    def __init__(self, decide: _Decider, storage: list, kept: list, layer: int):
        super().__init__()
        self.decide, self.storage, self.kept, self.layer = decide, storage, kept, layer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        choice, names = self.decide(func, recompute=False)
        if choice == "recompute":
            return out
        if choice == "offload":
            pin = torch.cuda.is_available()

            def move(t: torch.Tensor) -> torch.Tensor:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                return host.copy_(t.detach(), non_blocking=pin)

            stored = tree_map_only(torch.Tensor, move, out)
        else:
            stored = tree_map_only(torch.Tensor, lambda t: t.detach(), out)
        self.storage.append((func, stored))
        outs = [out] if isinstance(out, torch.Tensor) else out
        kept = [stored] if isinstance(stored, torch.Tensor) else stored
        for t, copy in zip(outs, kept, strict=True):
            if isinstance(t, torch.Tensor):
                device = torch.device("cpu") if choice == "offload" else t.device
                self.kept.append(
                    KeptTensor(
                        layer=self.layer,
                        names=names,
                        memory="host" if choice == "offload" else "device",
                        shape=tuple(t.shape),
                        dtype=t.dtype,
                        device=device,
                        nbytes=t.numel() * t.element_size(),
                        storage=copy.untyped_storage().data_ptr(),
                    )
                )
        return out


class _ReplayMode(TorchDispatchMode):
    """Recompute pass: hand back kept outputs (from host memory if offloaded), run the rest."""

    def __init__(self, decide: _Decider, storage: list):
        super().__init__()
        self.decide, self.storage, self.next = decide, storage, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        choice, _ = self.decide(func, recompute=True)
        if choice == "recompute":
            return func(*args, **(kwargs or {}))
        if choice == "skip":
            # Autograd has already saved this matmul's inputs (all its backward needs); its
            # output is read by nothing the backward uses, so its FLOPs are not spent again.
            # (JAX's partial evaluation skips the same matmuls.)
            mat1, mat2 = args[-2], args[-1]  # addmm(bias, mat1, mat2) / mm(mat1, mat2)
            return torch.empty((mat1.shape[0], mat2.shape[1]), dtype=mat1.dtype, device=mat1.device)
        stored_func, stored = self.storage[self.next]
        self.next += 1
        if stored_func is not func:
            raise RuntimeError(f"recompute diverged from the forward: {func} vs {stored_func}")
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), stored)


def validate_for_torch(policy: MemoryPolicy) -> None:
    """Raise for what the policy asks that torch_ref cannot express."""
    qkv = {policy.choice(n) for n in ("query_proj", "key_proj", "value_proj")}
    if len(qkv) > 1:
        raise ConfigError(
            "torch_ref computes query_proj, key_proj and value_proj with one fused matmul: give "
            f"them the same choice (got {sorted(qkv)})"
        )
    if "block_input" in policy.offload:
        raise ConfigError(
            "offloading block_input is not expressible in torch_ref (checkpoint keeps its input "
            "itself); use OffloadCheckpoint for that"
        )
    named = policy.save or policy.offload or policy.save_dots
    if policy.use_reentrant and (named or policy.nested):
        raise ConfigError(
            f"policy {policy.name!r} needs use_reentrant=False: reentrant checkpoint supports "
            "neither selective context_fn nor nesting"
        )


class PolicyLayers:
    """A ``layers_fn`` for ``torch_ref.BlockStack`` running ``policy``. ``kept`` lists what the
    last forward kept for the backward pass (named-op policies only)."""

    def __init__(self, policy: MemoryPolicy, cfg: ModelConfig):
        validate_for_torch(policy)
        self.policy, self.cfg = policy, cfg
        self.selected = set(policy.layers.indices(cfg.n_layers))
        self.kept: list[KeptTensor] = []

    def _checkpointed(self, i: int, layer: nn.Module, x: torch.Tensor, mask: Any) -> torch.Tensor:
        policy = self.policy
        if policy.use_reentrant:
            if not x.requires_grad:
                # Reentrant checkpoint only back-propagates to parameters when an input
                # requires grad (the classic pitfall with a frozen first input).
                x = x.detach().requires_grad_(True)
            return checkpoint(layer, x, mask, use_reentrant=True)
        if not (policy.save or policy.offload or policy.save_dots):
            return checkpoint(layer, x, mask, use_reentrant=False)

        def contexts():
            decide, storage = _Decider(policy, self.cfg), []
            return _KeepMode(decide, storage, self.kept, i), _ReplayMode(decide, storage)

        return checkpoint(layer, x, mask, use_reentrant=False, context_fn=contexts)

    def host_storages(self) -> set[int]:
        """Storages of the copies the last forward moved to host memory (for accounting)."""
        return {k.storage for k in self.kept if k.memory == "host"}

    def kept_names(self) -> dict[int, str]:
        """Storage of each copy the last forward kept -> its tag(s), ``/``-joined."""
        return {k.storage: "/".join(k.names) for k in self.kept}

    def __call__(self, layers: nn.ModuleList, x: torch.Tensor, mask: Any) -> torch.Tensor:
        self.kept = []
        if not self.policy.remat:
            return run_layers(layers, x, mask)
        if self.policy.nested:
            return self._nested(layers, x, mask)
        for i, layer in enumerate(layers):
            x = self._checkpointed(i, layer, x, mask) if i in self.selected else layer(x, mask)
        return x

    def _nested(self, layers: nn.ModuleList, x: torch.Tensor, mask: Any) -> torch.Tensor:
        k = nested_segment_size(len(layers))

        def segment(x: torch.Tensor, start: int) -> torch.Tensor:
            for layer in layers[start : start + k]:
                x = checkpoint(layer, x, mask, use_reentrant=False)
            return x

        for start in range(0, len(layers), k):
            x = checkpoint(segment, x, start, use_reentrant=False)
        return x


def apply_memory_policy(stack: BlockStack, policy: MemoryPolicy) -> PolicyLayers:
    """Run ``stack`` (a ``torch_ref.BlockStack``, e.g. ``decoder.blocks``) under ``policy``."""
    runner = PolicyLayers(policy, stack.cfg)
    stack.layers_fn = runner
    return runner


def save_on_cpu_layers_fn(selection: LayerSelection, n_layers: int) -> Callable[..., Any]:
    """Every tensor the selected blocks save for backward goes to host memory
    (``torch.autograd.graph.save_on_cpu``; pinned when CUDA is present). No recompute."""
    selected = set(selection.indices(n_layers))
    pin = torch.cuda.is_available()

    def layers_fn(layers: nn.ModuleList, x: torch.Tensor, mask: Any) -> torch.Tensor:
        for i, layer in enumerate(layers):
            if i in selected:
                with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                    x = layer(x, mask)
            else:
                x = layer(x, mask)
        return x

    return layers_fn


class OffloadCheckpoint(torch.autograd.Function):
    """The seeds' ``OffloadFunction``, made correct and general.

    Forward runs ``fn(*args)`` without building a graph and keeps only the tensor arguments, in
    host memory. Backward brings them back, re-runs the real ``fn`` with grad enabled and
    back-propagates through it, so parameters inside ``fn`` receive their gradients and every
    tensor argument gets its own. (The seed's version recomputed a placeholder ``input * 2`` and
    dropped parameter gradients.) ``fn`` must be deterministic: no RNG state is replayed.

    Use: ``y = OffloadCheckpoint.apply(block, x, mask)``.
    """

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.non_tensors = [None if t else a for t, a in zip(ctx.is_tensor, args, strict=True)]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.devices = [t.device for t in tensors]
        ctx.requires = [t.requires_grad for t in tensors]
        pin = torch.cuda.is_available()
        host = []
        for t in tensors:
            copy = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            host.append(copy.copy_(t.detach(), non_blocking=pin))
        ctx.save_for_backward(*host)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, grad_out):
        tensors = [
            t.to(d, non_blocking=True).requires_grad_(r)
            for t, d, r in zip(ctx.saved_tensors, ctx.devices, ctx.requires, strict=True)
        ]
        it = iter(tensors)
        args = [
            next(it) if is_t else a for is_t, a in zip(ctx.is_tensor, ctx.non_tensors, strict=True)
        ]
        with torch.enable_grad():
            out = ctx.fn(*args)
        torch.autograd.backward(out, grad_out)
        grads = iter(t.grad if t.requires_grad else None for t in tensors)
        return (None, *[next(grads) if is_t else None for is_t in ctx.is_tensor])


def offload_checkpoint_layers_fn(selection: LayerSelection, n_layers: int) -> Callable[..., Any]:
    """Selected blocks run through ``OffloadCheckpoint``: only their input is kept, on host."""
    selected = set(selection.indices(n_layers))

    def layers_fn(layers: nn.ModuleList, x: torch.Tensor, mask: Any) -> torch.Tensor:
        for i, layer in enumerate(layers):
            x = OffloadCheckpoint.apply(layer, x, mask) if i in selected else layer(x, mask)
        return x

    return layers_fn

"""What moved between the PyTorch versions torch_ref supports, in one place.

torch_ref supports torch 2.11 through 2.14 (``pyproject.toml``; ``constraints*.txt`` are the
exact sets the suite runs on; ``jaxmem.compat`` is JAX's side). Two things differ:

- **Selective checkpointing's policy function** sees the op's output (``ctx.op_output``) from
  torch 2.12, and is called only in the forward. In 2.11 it is called before the op runs, and
  again for every op of the recompute, where it must answer as in the forward.
  ``selective_checkpoint_contexts`` gives both versions one interface: a policy returns its
  decision and, optionally, a function to call with the outputs the forward saves (torch_ref
  counts them); on 2.11 the recompute is answered with the forward's decisions, in order (a
  policy that counts ops to name them, as torch_ref's does, would otherwise count on).
- **FlopCounterMode's attention formulas** take grouped-query attention (fewer key/value heads
  than query heads) from torch 2.12; 2.11's refuse the shapes. ``torch_ref.flops`` registers
  2.12's formulas on 2.11 (``FLOPS_KNOW_GQA``).

When a new version moves something else, add it here with the versions that need each
spelling, and test it under every exact set (``make test-versions``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from jaxmem.compat import version

TORCH = version("torch")
HAS_OP_OUTPUT = TORCH >= (2, 12)  # SelectiveCheckpointContext.op_output
FLOPS_KNOW_GQA = TORCH >= (2, 12)  # flop_counter.sdpa_flop_count with fewer key/value heads

_SAVING = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
# decide(op, *args, **kwargs) -> (policy, saved): saved(outputs) is called once with the outputs
# the forward saves (None: nothing to call)
Decide = Callable[..., tuple[CheckpointPolicy, Callable[[Any], None] | None]]


class _Slot(list):
    """One op's cache entries (torch 2.11): each entry the forward appends is handed to the
    callback the policy queued for it."""

    def __init__(self, queued: collections.deque) -> None:
        super().__init__()
        self._queued = queued

    def append(self, item: Any) -> None:
        super().append(item)
        if self._queued:  # a torch.compile trace caches recomputed ops too: nothing queued
            self._queued.popleft()(tree_map(lambda w: getattr(w, "val", w), item))


class _Storage(dict):
    def __init__(self, queued: dict[Any, collections.deque]) -> None:
        super().__init__()
        self._queued = queued

    def __missing__(self, op: Any) -> _Slot:
        slot = self[op] = _Slot(self._queued[op])
        return slot


def selective_checkpoint_contexts(decide: Decide) -> tuple[Any, Any]:
    """``create_selective_checkpoint_contexts`` for ``decide`` (see ``Decide``), on every
    supported torch."""
    if HAS_OP_OUTPUT:

        def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            policy, saved = decide(op, *args, **kwargs)
            if saved is not None and policy in _SAVING and not ctx.is_recompute:
                saved(ctx.op_output)
            return policy

        return create_selective_checkpoint_contexts(policy_fn)

    queued: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
    decided: collections.deque = collections.deque()

    def policy_before_op(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.is_recompute:  # the same ops in the same order: the forward's answers
            return decided.popleft() if decided else CheckpointPolicy.PREFER_RECOMPUTE
        policy, saved = decide(op, *args, **kwargs)
        decided.append(policy)
        if saved is not None and policy in _SAVING:
            queued[op].append(saved)
        return policy

    caching, cached = create_selective_checkpoint_contexts(policy_before_op)
    # the two modes share one cache (a dict of lists by op); this one calls the queued
    # callbacks as the forward fills it, in the order the policy saw the ops
    storage = _Storage(queued)
    caching.storage = cached.storage = storage
    return caching, cached

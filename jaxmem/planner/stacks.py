"""The memory policies ``jaxmem plan`` searches for the stack (``searched_stacks``), one axis of
the lattice ``jaxmem.planner.space`` prices and orders: the presets, the per-tag policies of the
FLOP/bytes frontier, mixes, and on GPU targets their variants (the embedding replayed, unrolled,
the block inputs in host memory), the MLP in sequence tiles and the loss in chunks or tiles.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

from jaxmem.planner import tags
from jaxmem.planner.host import OFFLOADED_INPUTS
from jaxmem.policy import (
    POLICIES,
    EmbeddingReplay,
    LossPolicy,
    MemoryPolicy,
    can_replay_embedding,
    mixed_policy,
)
from jaxmem.precision import Precision


class FlopCounts(Protocol):
    """What the lattice asks of a FLOP model (``jaxmem.planner.predict.FlopModel``)."""

    def per_row(self, policy: MemoryPolicy, precision: Precision) -> int:
        """Matmul FLOPs of one row's gradient under ``policy``, recompute included."""
        ...

    def tag_frontier(self, precision: Precision) -> list[tags.TagPoint]:
        """The per-tag policies of one block on the bytes/FLOPs Pareto frontier."""
        ...


def searched_stacks(
    problem: Any, space: Any, flops: FlopCounts, precision: Precision
) -> list[MemoryPolicy]:
    """The stacks searched at ``precision``: the presets, the per-tag policies of the frontier
    that keep what no preset keeps, the presets mixed in pairs and the hull's neighbours mixed,
    each at every split; then (GPU targets) each with the embedding replayed and each unrolled,
    ``full`` with its inputs on host, ``full`` and that with the MLP in sequence tiles, and each
    with the loss in chunks or tiles, as asked; each stack once. ``problem`` and ``space``: a
    ``jaxmem.planner.space`` ``Problem`` and ``PlanSpace`` (this module sits below it)."""
    n_layers = problem.cfg.n_layers
    host = problem.target.is_gpu  # XLA:CPU erases host placements: the local lattice has none
    frontier = flops.tag_frontier(precision) if space.tags else []
    hull = [t.policy for t in tags.hull(frontier)] if space.tag_mixes else []
    stacks = [POLICIES[p] for p in space.policies if host or not POLICIES[p].offloads]
    # per-tag policies that keep what no searched preset keeps (a frontier point may be one)
    kept = {(p.head.remat, frozenset(p.head.save)) for p in stacks if not p.nested}
    stacks += [
        t.policy
        for t in frontier
        if (t.policy.head.remat, frozenset(t.policy.head.save)) not in kept
    ]
    mix = [p for p in space.mix if host or not POLICIES[p].offloads]
    for i, a in enumerate(mix):
        for b in mix[i + 1 :]:
            for k in range(1, n_layers):
                stacks.append(mixed_policy(a, k, b))
    # per-tag mixes: neighbours on the hull (fewest bytes first), the one keeping more first
    for lean, rich in itertools.pairwise(hull):
        for k in range(1, n_layers):
            stacks.append(mixed_policy(rich, k, lean))
    if host and space.replay_embedding:  # a GPU target (XLA:CPU: see PlanSpace)
        replay = EmbeddingReplay(True)
        stacks += [p.replace(embedding=replay) for p in stacks if can_replay_embedding(p)]
    if host and space.unroll:  # a GPU target: each stack unrolled too (nested scans)
        stacks += [p.replace(unroll=True) for p in stacks if not p.nested]
    if host and space.offload_inputs:
        stacks.append(OFFLOADED_INPUTS)
    seq = problem.seq_len
    tiles = [t for t in space.mlp_tiles if seq % t == 0 and t < seq]
    whole = [p for p in stacks if p in (POLICIES["full"], OFFLOADED_INPUTS)]
    stacks += [p.replace(mlp_tile_tokens=t) for p in whole for t in tiles]
    chunks = {chunk_count(space.loss_chunks, seq)} - {0}
    if chunks:  # and tiles of a token count, where they cut the sequence finer
        chunks |= {seq // t for t in space.loss_tiles if seq % t == 0 and seq // t > max(chunks)}
    if precision.loss_scale != "dynamic":  # jaxmem.job.check_loss_chunks
        stacks += [p.replace(loss=LossPolicy(k)) for k in sorted(chunks) for p in stacks]
    return list(dict.fromkeys(stacks))  # full-host searched as a preset and as the offload


def chunk_count(most: int, seq_len: int) -> int:
    """The largest number of loss chunks at most ``most`` that divides ``seq_len`` (0: none)."""
    return max((k for k in range(1, most + 1) if seq_len % k == 0), default=0)

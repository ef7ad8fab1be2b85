"""Per-tag memory policies, searched exactly over one block's tag graph (Checkmate's idea at the
granularity of the model's tags).

A rematerialised block keeps its input and the tags its policy stores; what its backward reads
and is not stored is recomputed, and the matmuls on the way are executed again. Which tags can
spare a matmul when stored is a fact of the architecture (``jaxmem.policy.backward_reads``,
``recomputed_from``): the fused q/k/v projection's outputs (one unit: one matmul makes them, and
torch_ref's ``in_proj`` is one tensor), the attention core's outputs (naive: the probabilities,
sparing q·kᵀ, and the context, sparing probs·v; fused: the kernel's output and log-sum-exp
together), the attention output projection's result (the residual addition's source), the MLP's
up (and gate) projection and, post-norm, its down projection. Storing anything else (a norm's
output, the activation) spares elementwise work only: more bytes at the same matmul FLOPs.

``frontier`` takes every subset of those units (at most 2⁶ here), each a
``MemoryPolicy.custom``; its bytes per block from ``jaxmem.memory.analytic`` (the residual model
the tests check against JAX and PyTorch) and its matmul FLOPs counted from the gradient's
jaxpr, recompute included (exact: what the step executes), and keeps the Pareto-optimal ones:
no other subset keeps fewer bytes at no more FLOPs. ``jaxmem plan`` searches them beside the
presets; written by hand because the search is over jaxmem's own tags (PyTorch's min-cut
partitioner, ``activation_memory_budget``, searches single tensors of one compiled graph and is
its peer in the benchmarks).
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxmem.config import ModelConfig
from jaxmem.memory import analytic
from jaxmem.policy import POLICIES, QKV, MemoryPolicy
from jaxmem.precision import Precision


def units(cfg: ModelConfig) -> tuple[tuple[str, ...], ...]:
    """The groups of tags whose storing can spare a matmul in ``cfg``'s block, each stored
    whole (module docstring)."""
    core = (
        (("attn_context", "attn_lse"),)
        if cfg.attention == "fused"
        else (
            ("attn_probs",),
            ("attn_context",),
        )
    )
    mlp = (("mlp_gate",), ("mlp_up",)) if cfg.mlp == "gated" else (("mlp_up",),)
    down = (("mlp_down",),) if cfg.norm == "post" else ()
    return (QKV, *core, ("attn_out",), *mlp, *down)


@dataclasses.dataclass(frozen=True)
class TagPoint:
    """One per-tag policy with its cost per block and row of ``seq_len`` tokens."""

    policy: MemoryPolicy
    bytes_per_block: int  # kept for the backward (analytic, device + host)
    flops_per_block: int  # matmul FLOPs per row of one block's forward, recompute and backward

    @property
    def saves(self) -> tuple[str, ...]:
        return self.policy.head.save


def tag_policy(save: tuple[str, ...]) -> MemoryPolicy:
    """The custom policy storing ``save`` on the device (named by what it keeps)."""
    return MemoryPolicy.custom({n: "device" for n in save}, name="custom")


def block_bytes(cfg: ModelConfig, policy: MemoryPolicy, seq_len: int, p: Precision) -> int:
    """Bytes one block keeps for the backward per row under ``policy`` (analytic)."""
    one = cfg.replace(n_layers=1)
    est = analytic.saved_activation_bytes(one, policy, 1, seq_len, p)
    return est.device_bytes + est.host_bytes


def measure(cfg: ModelConfig, precision: Precision, seq_len: int, flops_per_row) -> list[TagPoint]:
    """Every subset of ``units(cfg)`` as a per-tag policy with its bytes and FLOPs per block and
    row. ``flops_per_row(cfg, policy, precision, seq_len)``: the matmul FLOPs of one row's
    gradient (``predict._flops_per_row``); each subset is traced on a one-block model (whose
    head and embeddings cost the same under every policy), ``none``'s block FLOPs from a
    two-block trace less the one-block one."""
    one = cfg.replace(n_layers=1)
    base = flops_per_row(one, POLICIES["none"], precision, seq_len)
    block_none = flops_per_row(cfg.replace(n_layers=2), POLICIES["none"], precision, seq_len) - base
    out = []
    groups = units(cfg)
    for r in range(len(groups) + 1):
        for chosen in itertools.combinations(groups, r):
            policy = tag_policy(tuple(n for g in chosen for n in g))
            extra = flops_per_row(one, policy, precision, seq_len) - base
            nbytes = block_bytes(cfg, policy, seq_len, precision)
            out.append(TagPoint(policy, nbytes, block_none + extra))
    return out


def pareto(points: list[TagPoint]) -> list[TagPoint]:
    """The points no other keeps fewer bytes at no more FLOPs than, fewest bytes first."""
    out: list[TagPoint] = []
    for p in sorted(points, key=lambda t: (t.bytes_per_block, t.flops_per_block)):
        if not out or p.flops_per_block < out[-1].flops_per_block:
            out.append(p)
    return out


def frontier(cfg: ModelConfig, precision: Precision, seq_len: int, flops_per_row) -> list[TagPoint]:
    """The Pareto-optimal per-tag policies of ``cfg``'s block (``measure``, ``pareto``)."""
    return pareto(measure(cfg, precision, seq_len, flops_per_row))


def hull(points: list[TagPoint]) -> list[TagPoint]:
    """The Pareto points on the lower convex hull of ``points`` in (bytes, FLOPs), those on
    its segments included, fewest bytes first:
    a stack mixing two of them block by block (the first k blocks under one, the rest under the
    other) lies on the segment between them, so mixes of neighbours on this hull are the
    cheapest stacks at every byte count between their ends (a linear relaxation of the exact
    per-block assignment; the compile of each candidate is the proof of its bytes)."""
    out: list[TagPoint] = []
    for p in pareto(points):
        while len(out) >= 2:
            (b0, f0), (b1, f1) = (
                (q.bytes_per_block, q.flops_per_block) for q in (out[-2], out[-1])
            )
            # drop the middle point when it lies above the segment from out[-2] to p (points on
            # it stay: with few blocks, a mix of near neighbours fills a budget a mix of the
            # segment's ends cannot)
            if (f1 - f0) * (p.bytes_per_block - b0) > (p.flops_per_block - f0) * (b1 - b0):
                out.pop()
            else:
                break
        out.append(p)
    return out

"""Context parallelism for torch_ref: each row's sequence split over ranks, keys and values
all-gathered for attention, in the layout jaxmem's JAX side runs (``jaxmem.step.context``).

An extension, labelled as such: PyTorch's own API, ``torch.distributed.tensor.experimental.
context_parallel`` (a ring over SDPA), would be the stock path on CUDA (not wired in here: no GPU
to test it), but in the installed PyTorch (2.13, CPU build) it does not run on CPU: under it,
``F.scaled_dot_product_attention`` on two gloo ranks fails with ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered`` (torchrun, 2 ranks, float64 q/k/v [1, 2, 16, 8], causal), and under the math
backend with ``aten.add.Tensor got mixed torch.Tensor and DTensor`` (its causal mask stays a
plain tensor); ``parity_tests/test_context_parallel.py`` checks both. So the CPU tests run this
module: Llama 3's all-gather of keys and values, which works with any attention
kernel and grouped-query attention.

Layout: the sequence in ``2 cp`` chunks, rank ``i`` of the context group holding chunks ``i`` and
``2 cp - 1 - i`` (``jaxmem.parallel.balanced_order``); ``local_batch`` permutes and slices a
batch's token fields once, the model's ``BlockStack.positions`` carries the rank's positions (RoPE
and position embeddings follow them), and each ``SelfAttention.core`` gathers keys and values
over the rank's context group (``gather_sequence``: ``dist.all_gather_into_tensor`` forward,
``dist.reduce_scatter_tensor`` backward, summing the keys' and values' gradients back to their
ranks), puts them in position order and attends causally by position. The loss is a sum over
tokens: each rank's share, summed by the data-parallel wrapper's gradient reduction (DDP or
FSDP2 over every rank), as over rows. The context group is every rank, or beside a data axis
(``--mesh fsdp=2,cp=2``: ranks ``data x context``) ``torch_ref.distributed.context_group``.

``gather_sequence`` is written here because the stock differentiable
``torch.distributed.nn.functional.all_gather`` cannot run on a subgroup over gloo: its backward
emulates the reduce-scatter by ``dist.scatter(..., src=i, group=group)`` with ``i`` a rank
*of the group* where ``src`` is a global rank (PyTorch 2.13): the ranks of the second group wait
on a scatter from ranks outside it and the step hangs.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from jaxmem.parallel import balanced_order
from torch_ref.model import fp32_einsum

TOKEN_FIELDS = ("inputs", "targets", "mask")


def rank_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """``[S / cp]``: the positions context rank ``rank`` holds, in its order."""
    order = balanced_order(seq_len, cp)
    n = seq_len // cp
    return torch.tensor(order[rank * n : (rank + 1) * n])


def local_batch(batch: dict[str, torch.Tensor], cp: int, rank: int) -> dict[str, torch.Tensor]:
    """This context rank's columns of a batch's ``[B, S]`` token fields."""
    out = dict(batch)
    for k in TOKEN_FIELDS:
        if k in batch:
            at = rank_positions(batch[k].shape[1], cp, rank).to(batch[k].device)
            out[k] = batch[k][:, at]
    return out


class _GatherSequence(torch.autograd.Function):
    """Every rank's ``[B, S/cp, ...]`` of ``group``, concatenated on the sequence axis; the
    backward sums each rank's gradient back to it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        local = x.transpose(0, 1).contiguous()  # the gathered axis first
        out = local.new_empty((n * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=group)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        n = dist.get_world_size(ctx.group)
        whole = grad.transpose(0, 1).contiguous()
        mine = whole.new_empty((whole.shape[0] // n, *whole.shape[1:]))
        dist.reduce_scatter_tensor(mine, whole, group=ctx.group)
        return mine.transpose(0, 1), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``[B, S, ...]``: ``x`` (``[B, S/cp, ...]``) of every rank of ``group`` (None: all),
    in rank order, differentiable."""
    return _GatherSequence.apply(x, group)


def gathered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    restore: torch.Tensor,
    fused: bool,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``[B, S/cp, D]``: this rank's queries (``[B, S/cp, H, K]``) against every rank's keys
    and values (``[B, S/cp, Hkv, K]`` each, gathered), causal by position."""
    k = gather_sequence(k, group)[:, restore]
    v = gather_sequence(v, group)[:, restore]
    b, s, h, hd = q.shape
    kv = k.shape[2]
    mask = q_pos[:, None].to(q.device) >= torch.arange(k.shape[1], device=q.device)[None]
    if fused:
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=kv < h)
        return out.transpose(1, 2).reshape(b, s, -1)
    qg = q.reshape(b, s, kv, h // kv, hd)
    scores = fp32_einsum("bqhgk,bshk->bhgqs", qg, k) / math.sqrt(hd)  # [B, Hkv, G, Sq, S]
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bhgqs,bshk->bqhgk", probs, v).reshape(b, s, -1)


def apply_context_parallel(
    model: nn.Module, *, seq_len: int, cp: int, rank: int, group: dist.ProcessGroup | None = None
) -> None:
    """Run ``model`` (a ``torch_ref.Decoder``) on context rank ``rank``'s share of ``seq_len``
    positions (its batches from ``local_batch``), attention gathered over ``group``."""
    q_pos = rank_positions(seq_len, cp, rank)
    restore = torch.argsort(torch.tensor(balanced_order(seq_len, cp)))
    model.blocks.positions = q_pos
    fused = model.cfg.attention == "fused"
    core = functools.partial(
        gathered_attention, q_pos=q_pos, restore=restore, fused=fused, group=group
    )
    for layer in model.blocks.layers:
        layer.self_attn.core = core


def apply_to_rank(model: nn.Module, parallel, launch, seq_len: int) -> None:
    """``apply_context_parallel`` for this torchrun rank of ``parallel``'s ``data x context``
    ranks (``launch``): its context rank, keys gathered over its context group."""
    from torch_ref.distributed import context_group

    group = context_group(parallel, launch)
    rank = launch.rank % parallel.cp
    apply_context_parallel(model, seq_len=seq_len, cp=parallel.cp, rank=rank, group=group)


def rank_batch(batch: dict[str, torch.Tensor], parallel, launch) -> dict[str, torch.Tensor]:
    """``local_batch`` for this torchrun rank (``launch``) of ``parallel``'s context axis: its
    columns of its data rank's rows."""
    return local_batch(batch, parallel.cp, launch.rank % parallel.cp)


@contextlib.contextmanager
def whole_sequence(model: nn.Module) -> Iterator[None]:
    """``model`` (under ``apply_context_parallel``, or not) runs whole sequences in order on
    this rank while the block is open (validation, sampling: every rank computes the same)."""
    blocks = model.blocks
    saved = blocks.positions, [layer.self_attn.core for layer in blocks.layers]
    blocks.positions = None
    for layer in blocks.layers:
        layer.self_attn.core = None
    try:
        yield
    finally:
        blocks.positions = saved[0]
        for layer, core in zip(blocks.layers, saved[1], strict=True):
            layer.self_attn.core = core

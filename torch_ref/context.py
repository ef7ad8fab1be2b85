"""Context parallelism for torch_ref: each row's sequence split over ranks, keys and values
all-gathered for attention or (``--cp-attention ring``) passed round the ranks by PyTorch's own
ring, in the layout jaxmem's JAX side runs (``jaxmem.step.context``, ``jaxmem.step.ring``).

An extension, labelled as such. PyTorch's public API, ``torch.distributed.tensor.experimental.
context_parallel`` (SDPA patched to a ring over DTensors), does not run on CPU in the installed
PyTorch (2.13; 2.14.1 the same): under it ``F.scaled_dot_product_attention`` on two gloo ranks
fails with ``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.
default does not have a sharding strategy registered`` (torchrun, 2 ranks, float64 q/k/v
[1, 2, 16, 8], causal), and under the math backend with ``aten.add.Tensor got mixed
torch.Tensor and DTensor`` (its causal mask stays a plain tensor);
``parity_tests/test_context_parallel.py`` checks both. So this module sets the layout itself
and runs one of two attention forms over the rank's context group.

Layout: the sequence in ``2 cp`` chunks, rank ``i`` of the context group holding chunks ``i`` and
``2 cp - 1 - i`` (``jaxmem.parallel.balanced_order``); ``local_batch`` permutes and slices a
batch's token fields once, the model's ``BlockStack.positions`` carries the rank's positions (RoPE
and position embeddings follow them), and each ``SelfAttention.core`` is set from outside. The
loss is a sum over tokens: each rank's share, summed by the gradient reduction over the data and
context ranks (DDP or FSDP2 over every rank; beside a tensor axis FSDP2 over the data and context
ranks), as over rows. The context group (``torch_ref.distributed.context_group``) is every rank,
or the rank's context axis of a ``data x context`` or ``data x context x tensor`` mesh (beside a
tensor axis each rank's attention holds its own heads).

Gathered (``gathered_attention``, the default; Llama 3's form, any attention kernel, grouped-query
keys as they are): keys and values gathered over the context group (``gather_sequence``:
``dist.all_gather_into_tensor`` forward, ``dist.reduce_scatter_tensor`` backward, summing the
keys' and values' gradients back to their ranks), put in position order, attended causally by
position.

Ring (``ring_attention``, ``--cp-attention ring``, fused attention only): PyTorch's, the
forward and backward that ``context_parallel`` dispatches SDPA to
(``torch.distributed.tensor.experimental._context_parallel._attention``'s
``_templated_ring_attention`` and ``_templated_ring_attention_backward``: causal load balance on
the same ``2 cp``-chunk layout, each step's partial softmax merged by its log-sum-exp, the keys'
and values' gradients passed back round the ring), called on this rank's local tensors with the
rotation set to ``"alltoall"`` (each step passes one rank's keys and values to the next; the
stock default, ``"allgather"``, gathers them whole once, which is the gather form). What torch_ref
adds, the labelled part: the CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward, which take grouped-query keys as they are) as the ring's per-step kernel, which
the stock dispatcher has no entry for, and an autograd function around the pair (the dispatcher
reaches the backward through DTensor; here the tensors are plain). The merge accumulates in
fp32 (PyTorch's ``convert_to_f32``), in float64 for float64 inputs (PyTorch's option would round
them to fp32). On CUDA the ring's kernel is the one the stock dispatcher pairs with it (flash for
bf16/fp16, memory-efficient for fp32, keys repeated to the query heads for it; its log-sum-exp
cut to the queries' rows for the merge: shapes checked on meta tensors), not run here (no GPU;
``tests/test_context_parallel.py``'s GPU tests step and merge them on one). To a
memory policy the ring is one function (``inside_ring``): a policy keeping attention's output is
refused with it (``jaxmem.job.torch_ring_policy_refusal``).

``gather_sequence`` is written here because the stock differentiable
``torch.distributed.nn.functional.all_gather`` cannot run on a subgroup over gloo: its backward
emulates the reduce-scatter by ``dist.scatter(..., src=i, group=group)`` with ``i`` a rank
*of the group* where ``src`` is a global rank (PyTorch 2.13): the ranks of the second group wait
on a scatter from ranks outside it and the step hangs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator

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


@dataclasses.dataclass(frozen=True)
class RingKernel:
    """The per-step attention kernel of PyTorch's ring: an aten forward returning ``(out,
    logsumexp, *rest)`` and its backward, with the keyword arguments each takes (``rest``: what
    the forward's extra outputs are called in the backward's)."""

    forward: Callable[..., tuple[torch.Tensor, ...]]
    backward: Callable[..., tuple[torch.Tensor, ...]]
    grad_out_name: str
    forward_kwargs: dict
    backward_kwargs: dict
    rest: tuple[str, ...] = ()
    repeat_kv: bool = False  # the kernel takes as many key/value heads as query heads only


# the memory-efficient kernel pads its log-sum-exp to a multiple of this many rows
_EFFICIENT_LSE_ROWS = 32


def _efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object):
    """The memory-efficient forward with its log-sum-exp cut to the queries' rows (the ring's
    merge adds it to the output's rows; PyTorch's own dispatcher leaves it padded and fails to
    merge unless each half of a rank's share is a multiple of 32 positions)."""
    out, lse, *rest = torch.ops.aten._scaled_dot_product_efficient_attention.default(q, k, v, **kw)
    return (out, lse[..., : q.shape[2]], *rest)


def _efficient_backward(*, logsumexp: torch.Tensor, **kw: object):
    """The memory-efficient backward given its log-sum-exp padded back as its forward made it."""
    pad = -logsumexp.shape[-1] % _EFFICIENT_LSE_ROWS
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward.default(
        logsumexp=F.pad(logsumexp, (0, pad)), **kw
    )


def ring_kernel(device: torch.device, dtype: torch.dtype) -> RingKernel:
    """The kernel the ring runs at each step on ``device`` for ``dtype`` inputs: the CPU flash
    kernel (torch_ref's addition), or on CUDA the stock dispatcher's pairing (flash for
    bf16/fp16, memory-efficient otherwise, wrapped as ``_efficient_forward`` and
    ``_efficient_backward`` say)."""
    aten = torch.ops.aten
    if device.type == "cpu":
        kw = {"dropout_p": 0.0, "scale": None}
        return RingKernel(
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            "grad_out",
            kw,
            kw,
        )
    if dtype in (torch.bfloat16, torch.float16):
        return RingKernel(
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_backward.default,
            "grad_out",
            {"dropout_p": 0.0, "return_debug_mask": False, "scale": None},
            {"dropout_p": 0.0, "scale": None},
            ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset"),
        )
    return RingKernel(
        _efficient_forward,
        _efficient_backward,
        "grad_out_",
        {"attn_bias": None, "compute_log_sumexp": True, "dropout_p": 0.0, "scale": None},
        {
            "attn_bias": None,
            "dropout_p": 0.0,
            "grad_input_mask": (True, True, True, False),
            "scale": None,
        },
        ("philox_seed", "philox_offset"),
        repeat_kv=True,
    )


# > 0 while PyTorch's ring runs: torch_ref.remat's op namer takes it as one function, not ops
_ring_depth = 0


def inside_ring() -> bool:
    """Whether the op being dispatched is one of the ring's own (``ring_attention``)."""
    return _ring_depth > 0


@contextlib.contextmanager
def _as_one_function() -> Iterator[None]:
    global _ring_depth
    _ring_depth += 1
    try:
        yield
    finally:
        _ring_depth -= 1


@contextlib.contextmanager
def _ring_options(dtype: torch.dtype) -> Iterator[None]:
    """PyTorch's ring options for one call: ``"alltoall"`` rotation (a ring), causal load
    balance, the merge in fp32 (float64 for float64 inputs); restored after."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    options = cp._cp_options
    saved = options.rotate_method, options.enable_load_balance, options.convert_to_f32
    options.rotate_method = cp._RotateMethod.ALL_TO_ALL
    options.enable_load_balance = True
    options.convert_to_f32 = dtype != torch.float64
    try:
        yield
    finally:
        options.rotate_method, options.enable_load_balance, options.convert_to_f32 = saved


class _RingAttention(torch.autograd.Function):
    """PyTorch's ring attention over ``group`` on plain local ``[B, H, S/cp, K]`` tensors:
    its templated forward, and its templated backward as this function's backward."""

    @staticmethod
    def forward(ctx, q, k, v, group, kernel: RingKernel) -> torch.Tensor:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        group = group if group is not None else dist.group.WORLD
        with _ring_options(q.dtype):
            out, lse, *rest = cp._templated_ring_attention(
                group, 2, kernel.forward, q, k, v, is_causal=True, **kernel.forward_kwargs
            )
        ctx.group, ctx.kernel = group, kernel
        ctx.rest = dict(zip(kernel.rest, rest, strict=False))
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        q, k, v, out, lse = ctx.saved_tensors
        kernel = ctx.kernel
        with _ring_options(q.dtype):
            dq, dk, dv, *_ = cp._templated_ring_attention_backward(
                ctx.group,
                2,
                kernel.backward,
                grad.contiguous(),
                kernel.grad_out_name,
                q,
                k,
                v,
                out,
                lse,
                is_causal=True,
                **kernel.backward_kwargs,
                **ctx.rest,
            )
        return dq, dk, dv, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``[B, S/cp, D]``: this rank's queries (``[B, S/cp, H, K]``, its two chunks of the
    balanced layout) against every rank's keys and values (``[B, S/cp, Hkv, K]`` each), passed
    round ``group`` (None: every rank) by PyTorch's ring, causal. Its ops are one function to
    a memory policy's op names (``inside_ring``): the block's other ops keep their places, and
    its output is not a tag selective checkpointing can keep
    (``jaxmem.job.torch_ring_policy_refusal``)."""
    b, s, h, _ = q.shape
    kernel = ring_kernel(q.device, q.dtype)
    with _as_one_function():
        if kernel.repeat_kv and k.shape[2] < h:
            k, v = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (k, v))
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out = _RingAttention.apply(qh, kh, vh, group, kernel)
        return out.transpose(1, 2).reshape(b, s, -1)


def apply_context_parallel(
    model: nn.Module,
    *,
    seq_len: int,
    cp: int,
    rank: int,
    group: dist.ProcessGroup | None = None,
    attention: str = "gather",
) -> None:
    """Run ``model`` (a ``torch_ref.Decoder``) on context rank ``rank``'s share of ``seq_len``
    positions (its batches from ``local_batch``), attention over ``group``: keys and values
    gathered (``"gather"``) or passed round a ring (``"ring"``: fused attention only)."""
    q_pos = rank_positions(seq_len, cp, rank)
    model.blocks.positions = q_pos
    fused = model.cfg.attention == "fused"
    if attention == "ring":
        if not fused:
            raise ValueError(
                f"the ring merges each step's partial softmax, which the fused attention does; "
                f"the model's attention is {model.cfg.attention!r}"
            )
        core = functools.partial(ring_attention, group=group)
    else:
        restore = torch.argsort(torch.tensor(balanced_order(seq_len, cp)))
        core = functools.partial(
            gathered_attention, q_pos=q_pos, restore=restore, fused=fused, group=group
        )
    for layer in model.blocks.layers:
        layer.self_attn.core = core


def apply_to_rank(model: nn.Module, parallel, launch, seq_len: int) -> None:
    """``apply_context_parallel`` for this torchrun rank (``launch``) of ``parallel``'s mesh:
    its context rank (``torch_ref.distributed.context_index``), keys gathered over (or passed
    round) its context group as ``parallel.cp_attention`` says."""
    from torch_ref.distributed import context_group, context_index

    group = context_group(parallel, launch)
    rank = context_index(parallel, launch)
    apply_context_parallel(
        model,
        seq_len=seq_len,
        cp=parallel.cp,
        rank=rank,
        group=group,
        attention=parallel.cp_attention,
    )


def rank_batch(batch: dict[str, torch.Tensor], parallel, launch) -> dict[str, torch.Tensor]:
    """``local_batch`` for this torchrun rank (``launch``) of ``parallel``'s context axis: its
    columns of its data rank's rows."""
    from torch_ref.distributed import context_index

    return local_batch(batch, parallel.cp, context_index(parallel, launch))


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

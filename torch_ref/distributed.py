"""torch_ref beyond one device: jaxmem's data-parallel strategies (``jaxmem.parallel``) in the
PyTorch a PyTorch user writes, on ``torch.distributed``, one process per device, launched by
``torchrun`` (gloo on CPU, nccl on CUDA).

- ``dp``: ``DistributedDataParallel``: everything replicated, gradients all-reduced.
- ``zero1``: FSDP2 ``fully_shard(reshard_after_forward=False)`` on every block and the root.
  PyTorch has no FSDP2 form of ZeRO stage 1; this is its ZeRO-2-like mode: optimizer state
  *and gradients* sharded, parameters sharded between steps and whole from each block's
  forward to its backward. It holds fewer gradient bytes than jaxmem's ``zero1`` (which keeps
  them replicated) and as many parameter bytes during the step; records say which ran.
- ``fsdp``: FSDP2 ``fully_shard`` (``reshard_after_forward=True``) on every block and the root:
  ZeRO-3, each block's parameters all-gathered for its forward and again for its backward.

Tensor parallelism (``--mesh tp=T``, ``zero1|fsdp=N,tp=T``): a ``data x tensor`` device mesh;
Megatron's layout on the blocks with stock ``torch.distributed.tensor.parallel`` styles as
torchtitan's Llama plan writes them, sequence parallelism included (``parallelize``), the fused
q/k/v split head-aligned by torch_ref's ``HeadAlignedColwise`` extension; then FSDP2 over the
data axis (and a context axis beside it). ``dp`` over a tensor axis is refused
(``jaxmem.job.torch_mesh_refusal``).

Context parallelism (``--mesh cp=C``, ``fsdp=D,cp=C``): each rank holds its columns of its data
rank's rows (``torch_ref.context``, an extension), keys and values gathered over (or passed
round) its context group (``context_group``: a ``data x context`` device mesh beside a data
axis), DDP or FSDP2 over every rank. Beside a tensor axis (``fsdp=D,cp=C,tp=T``) the mesh is
``data x context x tensor``: the blocks split over the tensor axis as above (each rank's
attention runs its heads over its context group), then FSDP2 over the data and context ranks
together (one flattened axis, as torchtitan shards over ``dp_shard x cp``). Under torchrun a
rank lost mid-run ends the run in one line: the survivors' failures are reported by the first of
them (``first_to_say``).

Streaming (``optimizer.stream``, jaxmem's ``--stream``): FSDP2 ``fully_shard`` with
``CPUOffloadPolicy`` on every block and the root, on one process (a process group of one) or
over ``--mesh zero1|fsdp=N``: parameters, gradients and optimizer state live in host memory
(pinned on CUDA); each block's parameters are copied to the device for its forward and backward,
its gradients go back to host memory, and the optimizer steps on the CPU. PyTorch's stock peer
of ``jaxmem.step.stream``, which keeps the embeddings and head on the device and updates on it.

The memory policy is applied first (``torch_ref.remat`` sets the stack's ``layers_fn``; a
checkpointed block's recompute all-gathers its parameters again, as in torchtitan), then the
sharding, from outside: the model does not change. Each data rank trains on its rows of every
batch; the loss is divided by the *global* valid-token count, so the gradient is the whole
batch's (``local_token_divisor``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from jaxmem.config import ConfigError
from jaxmem.parallel import ParallelConfig

# torchrun's environment (https://pytorch.org/docs/stable/elastic/run.html)
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

RESHARD_AFTER_FORWARD = {"zero1": False, "fsdp": True}
DESCRIPTION = {
    "dp": "DistributedDataParallel (replicated; gradients all-reduced)",
    "zero1": "FSDP2 fully_shard(reshard_after_forward=False) per block + root (ZeRO-2-like: "
    "PyTorch has no FSDP2 ZeRO-1; gradients sharded too)",
    "fsdp": "FSDP2 fully_shard per block + root (ZeRO-3: reshard after forward)",
}


def describe(parallel: ParallelConfig) -> str:
    """What runs ``parallel``'s mesh, in words (records, the run's console)."""
    context = ""
    if parallel.context_parallel:
        how = (
            "keys and values passed round them by PyTorch's ring attention"
            if parallel.cp_attention == "ring"
            else "keys and values all-gathered over them"
        )
        context = (
            f"each sequence split over cp={parallel.cp} ranks ({how}: torch_ref.context, an "
            "extension)"
        )
    if not parallel.tensor_parallel:
        if not context:
            return DESCRIPTION[parallel.strategy]
        ranks = "every rank" if parallel.data == 1 else f"{parallel.data} x {parallel.cp} ranks"
        return f"{DESCRIPTION[parallel.strategy]} over {ranks}, {context}"
    sp = " + SequenceParallel norms" if parallel.sequence_parallel else ""
    text = (
        f"DTensor tensor parallelism over tp={parallel.tp} (ColwiseParallel, RowwiseParallel"
        f"{sp}; fused q/k/v rows head-aligned: torch_ref's HeadAlignedColwise extension)"
    )
    if context:
        text += f", {context}"
    if parallel.data * parallel.cp > 1:
        ranks = (
            f"{parallel.data} x {parallel.cp} data and context ranks"
            if parallel.context_parallel
            else f"{parallel.data} data ranks"
        )
        text += f", then {DESCRIPTION[parallel.strategy]} over {ranks}"
    return text


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process among torchrun's: its rank, how many there are, its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def primary(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> str:
        return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"

    def rows(self, batch_size: int, inner: int = 1) -> slice | None:
        """This rank's rows of a global batch (None: one data rank reads them all). Ranks are
        laid out ``data x tensor``, ``data x context`` or ``data x context x tensor``
        (``device_mesh``, ``context_group``): the ``inner`` tensor and context ranks of one
        data rank read the same rows."""
        data = self.world_size // inner
        if data == 1:
            return None
        n, index = batch_size // data, self.rank // inner
        return slice(index * n, (index + 1) * n)


def from_environment() -> Launch:
    """This process's place among torchrun's (a lone process: rank 0 of 1)."""
    if "WORLD_SIZE" not in os.environ:
        return Launch()
    try:
        rank, world, local = (int(os.environ.get(k, "0")) for k in ENV)
    except ValueError:
        raise ConfigError(
            f"torchrun's environment {', '.join(f'{k}={os.environ.get(k)!r}' for k in ENV)} "
            "is not integers; launch with torchrun"
        ) from None
    return Launch(rank=rank, world_size=world, local_rank=local)


def check_launch(parallel: ParallelConfig, launch: Launch, command: str) -> None:
    """One process per device: a torch run over ``--mesh S=N`` must be N torchrun processes."""
    if parallel.devices == launch.world_size:
        return
    mesh = f"--mesh {parallel.mesh_text()}"
    if launch.world_size == 1:
        raise ConfigError(
            f"{mesh} with --framework torch runs one process per device: launch it with "
            f"torchrun --standalone --nproc_per_node={parallel.devices} --no-python {command}"
        )
    if parallel.tensor_parallel:
        other = f"a --mesh of {launch.world_size} devices"
    else:
        other = f"--mesh {parallel.strategy}={launch.world_size}"
    raise ConfigError(
        f"torchrun started {launch.world_size} processes but the run's mesh is "
        f"{parallel.mesh_text()} ({parallel.devices} device(s)): use --nproc_per_node="
        f"{parallel.devices} or {other}"
    )


# whether this process joined a process group (it stays True after ``shutdown``): such a
# process ends through ``end_worker``
_joined = False


def initialize(launch: Launch, *, group_of_one: bool = False) -> None:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA); a lone process does nothing,
    or with ``group_of_one`` (FSDP2 needs a group) makes a group of itself, in memory."""
    if dist.is_initialized() or (launch.world_size == 1 and not group_of_one):
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if launch.world_size == 1 and "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    global _joined
    _joined = True


def shard(
    model: nn.Module, parallel: ParallelConfig, launch: Launch, *, stream: bool = False
) -> nn.Module:
    """``model`` (on this rank's device, memory policy applied) under ``parallel.strategy``;
    returns the module to call (DDP wraps it; FSDP2 changes it in place). ``stream``: FSDP2
    with ``CPUOffloadPolicy`` (module docstring), on one process too. With ``parallel.tp > 1``
    the blocks are split over the mesh's tensor axis first (``parallelize``), then FSDP2 shards
    over its data axis, and its context axis beside it (``zero1``, ``fsdp``; ``dp`` over a
    tensor axis is refused upstream, ``jaxmem.job.torch_tensor_parallel_refusal``)."""
    if not parallel.sharded and not stream:
        return model
    data_mesh = None
    if parallel.tensor_parallel:
        mesh = device_mesh(parallel, launch)
        parallelize(model, mesh["tensor"], sequence_parallel=parallel.sequence_parallel)
        if parallel.data * parallel.cp == 1:
            return model
        data_mesh = _shard_mesh(parallel, launch)
    elif parallel.strategy == "dp" and not stream:
        device_ids = [launch.local_rank] if torch.cuda.is_available() else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # one process: nothing to reshard (fsdp's default); dp has no FSDP2 form (refused upstream)
    reshard = RESHARD_AFTER_FORWARD.get(parallel.strategy, True) if parallel.sharded else True
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if stream else OffloadPolicy()
    for block in model.blocks.layers:
        fully_shard(block, mesh=data_mesh, reshard_after_forward=reshard, offload_policy=policy)
    fully_shard(model, mesh=data_mesh, reshard_after_forward=reshard, offload_policy=policy)
    # Decoder returns its logits from an einsum, a view; FSDP2 warns that an in-place op on a
    # returned view would skip its pre-backward hook. Nothing here modifies logits in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


@functools.cache
def _mesh(device_type: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape, mesh_dim_names=axes)


def device_mesh(parallel: ParallelConfig, launch: Launch) -> DeviceMesh:
    """The run's device mesh: ``data`` x ``context`` (with a context axis) x ``tensor`` (with a
    tensor axis), the last axis fastest (``data x tensor``: rank = data index x tp + tensor
    index; ``data x context x tensor``: rank = (data index x cp + context index) x tp + tensor
    index), as ``Launch.rows`` reads them; made once per process (a collective: every rank asks
    for it at the same point)."""
    sizes = (("data", parallel.data), ("context", parallel.cp), ("tensor", parallel.tp))
    axes = [(name, n) for name, n in sizes if name == "data" or n > 1]
    names, shape = zip(*axes, strict=True)
    return _mesh(launch.device.split(":")[0], shape, names)


@functools.cache
def _shard_mesh(parallel: ParallelConfig, launch: Launch) -> DeviceMesh:
    """The ranks FSDP2 shards over beside a tensor axis: the data axis, or the data and context
    axes flattened into one (each holds distinct tokens)."""
    mesh = device_mesh(parallel, launch)
    if not parallel.context_parallel:
        return mesh["data"]
    return mesh["data", "context"]._flatten("data_context")


def context_index(parallel: ParallelConfig, launch: Launch) -> int:
    """This rank's place on its context axis (``device_mesh``'s layout)."""
    return (launch.rank // parallel.tp) % parallel.cp


def context_group(parallel: ParallelConfig, launch: Launch) -> dist.ProcessGroup | None:
    """The ranks of this rank's context axis of ``device_mesh`` (None: every rank, when no data
    or tensor axis is beside it)."""
    if not parallel.context_parallel or parallel.data * parallel.tp == 1:
        return None
    return device_mesh(parallel, launch)["context"].get_group()


def head_aligned_rows(d_model: int, kv_dim: int, tp: int) -> torch.Tensor:
    """The order of the fused ``in_proj`` rows (q ``[0, D)``, k ``[D, D + Hkv K)``, v after)
    in which a contiguous ``Shard(0)`` over ``tp`` ranks gives each rank its heads' q rows, then
    its key/value heads' k rows, then their v rows: rank-major, q/k/v within a rank."""
    q = torch.arange(d_model).reshape(tp, -1)
    k = (d_model + torch.arange(kv_dim)).reshape(tp, -1)
    v = (d_model + kv_dim + torch.arange(kv_dim)).reshape(tp, -1)
    return torch.cat((q, k, v), dim=1).reshape(-1)


# head_aligned_rows of each SelfAttention a HeadAlignedColwise split (full_state's conversions)
_ROWS: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


class HeadAlignedColwise(ColwiseParallel):
    """torch_ref's extension, not stock PyTorch: ``ColwiseParallel`` for the fused q/k/v
    projection that ``SelfAttention`` holds as a parameter (``in_proj_weight``, rows
    ``[q | k | v]``, ``nn.MultiheadAttention``'s name), not as an ``nn.Linear``.

    Its rows are reordered head-aligned (``head_aligned_rows``) and then ``Shard(0)`` over the
    tensor axis, so rank r holds its q heads' rows, then its key/value heads' k and v rows (a
    plain ``Shard(0)`` would give rank 0 the first q rows of every kind). During the module's
    forward the parameters are this rank's local rows (``to_local``: their gradients come back
    as the DTensor's ``Shard(0)``), and the input is all-gathered (its sequence shards, under
    sequence parallelism) and handed over as the whole ``[B, S, D]`` whose gradient is a
    ``Partial`` sum, reduced back over the tensor axis: Megatron's ``f``. The attention runs on
    plain local tensors and infers its local head counts from their shapes. The global tensor
    is the reordered one: ``full_state`` and ``load_full_state`` put the rows back in
    ``[q | k | v]`` order, so checkpoints equal a one-device run's.
    """

    PARAMS = ("in_proj_weight", "in_proj_bias")

    def __init__(self, *, d_model: int, kv_dim: int, input_layout: Placement) -> None:
        super().__init__(input_layouts=input_layout)
        self.d_model, self.kv_dim = d_model, kv_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rows = head_aligned_rows(self.d_model, self.kv_dim, device_mesh.size())
        for name in self.PARAMS:
            param = getattr(module, name)
            if param is None:
                continue
            whole = param.detach()[rows.to(param.device)]
            placed = distribute_tensor(whole, device_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(placed, param.requires_grad))
        _ROWS[module] = rows
        held: list[dict[str, Any]] = []

        def enter(mod: nn.Module, args: tuple) -> tuple:
            x = self._prepare_input_fn(
                self.input_layouts, self.desired_input_layouts, mod, args, device_mesh
            )
            # every rank's heads read the whole input: its gradient is their sum
            x = x.to_local(grad_placements=(Partial(),))
            # FSDP2 may have set the parameters (its unsharded ones): put back what was there
            held.append({n: mod._parameters[n] for n in self.PARAMS if n in mod._parameters})
            for n, p in held[-1].items():
                if p is not None:
                    mod._parameters[n] = p.to_local()
            return (x, *args[1:])

        def leave(mod: nn.Module, args: tuple, out: Any) -> Any:
            mod._parameters.update(held.pop())
            return out

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return module


def parallelize(model: nn.Module, tensor_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Megatron's tensor parallelism on ``model``'s blocks over ``tensor_mesh``, in place, as
    torchtitan's Llama plan writes it with ``torch.distributed.tensor.parallel``: q/k/v (the
    fused ``in_proj``: ``HeadAlignedColwise``), the MLP's up and gate column-parallel, the
    attention's out projection and the MLP's down row-parallel. With ``sequence_parallel`` the
    residual stream between them is split by sequence (``Shard(1)``): the stack's input is cut
    into sequence shards, each norm runs on its shard (``SequenceParallel``), the attention and
    MLP all-gather their input (``PrepareModuleInput``) and the row-parallel outputs are
    reduce-scattered back to shards; the stack's output is all-gathered whole. Without it the
    residual stream and norms are replicated and the row-parallel outputs all-reduced.
    Embeddings, the final norm and the LM head stay whole on every tensor rank (as in
    ``jaxmem.sharding``), so every tensor rank computes the same loss."""
    cfg = model.cfg
    stream = Shard(1) if sequence_parallel else Replicate()
    mlp = ("gate", "up", "down") if cfg.mlp == "gated" else ("0", None, "2")
    for block in model.blocks.layers:
        plan: dict[str, Any] = {
            "self_attn": HeadAlignedColwise(
                d_model=cfg.d_model, kv_dim=cfg.kv_dim, input_layout=stream
            ),
            "self_attn.out_proj": RowwiseParallel(
                output_layouts=stream, use_local_output=not sequence_parallel
            ),
            f"ffn.{mlp[0]}": ColwiseParallel(),
            f"ffn.{mlp[2]}": RowwiseParallel(
                output_layouts=stream, use_local_output=not sequence_parallel
            ),
        }
        if mlp[1] is not None:
            plan[f"ffn.{mlp[1]}"] = ColwiseParallel()
        if sequence_parallel:
            plan["norm1"] = SequenceParallel()
            plan["norm2"] = SequenceParallel()
            plan["ffn"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        parallelize_module(block, tensor_mesh, plan)
    if sequence_parallel:
        parallelize_module(
            model.blocks,
            tensor_mesh,
            PrepareModuleInputOutput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Shard(1),),
                use_local_input=False,
                output_layouts=(Shard(1),),
                desired_output_layouts=(Replicate(),),
                use_local_output=True,
            ),
        )


def unwrap(model: nn.Module) -> nn.Module:
    """The ``torch_ref.Decoder`` inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters, gradients, optimizer state); a plain
    tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of ``tensors`` (its shards)."""
    return sum(local(t).numel() * t.element_size() for t in tensors)


def all_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of ``t`` over every rank of ``group`` (default: all of them; ``t`` itself on a lone
    process)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def data_group(parallel: ParallelConfig, launch: Launch) -> dist.ProcessGroup | None:
    """The ranks holding distinct tokens: this rank's data axis, with its context axis beside a
    tensor axis (None: every rank, when there is no tensor axis)."""
    if not parallel.tensor_parallel:
        return None
    return _shard_mesh(parallel, launch).get_group()


def data_sum(t: torch.Tensor, parallel: ParallelConfig, launch: Launch) -> torch.Tensor:
    """Sum of ``t`` over the data (and context) axes: the whole batch's, once (the tensor ranks
    of one data rank hold the same tokens' losses and counts)."""
    return all_sum(t, data_group(parallel, launch))


def local_token_divisor(
    n_local: torch.Tensor, world_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """What each rank divides its summed loss by so that DDP's and FSDP2's gradient *average*
    over the data ranks (``world_size`` of them, in ``group``) is the whole batch's mean-loss
    gradient: the global token count / data ranks (for a power of two an exact float
    scaling)."""
    return all_sum(n_local, group) / world_size


def token_divisor(
    parallel: ParallelConfig, launch: Launch
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``accumulate_grads``'s ``divisor`` for this rank (None: one device, the plain count)."""
    if not parallel.sharded:
        return None
    return functools.partial(
        local_token_divisor,
        world_size=launch.world_size // parallel.tp,
        group=data_group(parallel, launch),
    )


@torch.no_grad()
def reduce_partial_grads(params: Iterable[nn.Parameter]) -> None:
    """Sum gradients left as ``Partial`` sums over the tensor axis into their parameter's
    placement: the norms' weights (and a row-parallel layer's bias) under sequence
    parallelism, whose every rank saw its sequence shard only (Megatron's all-reduce of the
    sequence-parallel gradients). Call it after the backward, before the norm and the update
    (an optimizer would otherwise reduce them inside every op that reads them)."""
    for p in params:
        g = p.grad
        if g is not None and any(pl.is_partial() for pl in getattr(g, "placements", ())):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def _copies(g: torch.Tensor, world_size: int) -> int:
    """How many ranks hold each element of gradient ``g``: a plain tensor is on every rank; a
    DTensor's shards are distinct along its mesh's ``Shard`` dimensions only (replicated along
    the others and on ranks outside its mesh, e.g. the tensor ranks of FSDP2's data mesh)."""
    if not hasattr(g, "placements"):
        return world_size
    distinct = 1
    for size, placement in zip(g.device_mesh.shape, g.placements, strict=True):
        if placement.is_partial():
            raise ValueError(f"a gradient is still a Partial sum ({g.placements}): reduce it")
        if not placement.is_replicate():  # Shard, or FSDP2's _StridedShard over a tensor axis
            distinct *= size
    return world_size // distinct


def grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """The L2 norm of the whole gradient, in fp32, on every rank. FSDP2 shards every gradient
    it manages (``Shard(0)``, padded), so the squares of this rank's shards summed over ranks
    are the global sum; replicated gradients (one process, DDP) are taken as they are. Over a
    tensor axis some gradients are shards and some replicated: each rank's squares are divided
    by how many ranks hold the same elements (``_copies``) before the sum, so nothing counts
    twice."""
    grads = [p.grad for p in params if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1 or not any(hasattr(g, "to_local") for g in grads):
        # whole gradients (one process, DDP, or FSDP2 on a group of one: its shard is the
        # whole): the same arithmetic as an unsharded run
        return torch.linalg.vector_norm(torch.stack([local(g).float().norm() for g in grads]))
    squares = torch.stack([local(g).float().pow(2).sum() / _copies(g, world) for g in grads]).sum()
    return all_sum(squares).sqrt()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (small, picklable state such as a GradScaler's)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state, gathered whole on rank 0 in CPU memory (other ranks get
    empty dicts): ``torch.distributed.checkpoint.state_dict`` with ``full_state_dict``; keys are
    parameter names, for DDP and FSDP2 alike. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # FSDP2 over a tensor axis gathers a 2-D shard in two all-gathers; DTensor logs a
    # performance warning for each such parameter on every checkpoint
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    state = {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
    }
    return _reorder_rows(model, state, inverse=True)


def _reorder_rows(model: nn.Module, state: dict, *, inverse: bool) -> dict:
    """``state`` (full state dicts: model, optimizer) with the fused ``in_proj`` rows of every
    ``HeadAlignedColwise`` attention, and their optimizer moments, put back in ``[q | k | v]``
    order (``inverse``) or into its head-aligned order (copies: ``state`` stays as it is)."""
    state = {**state, "model": dict(state.get("model", {}))}
    optimizer = {**state.get("optimizer", {})}
    optimizer["state"] = {k: dict(v) for k, v in optimizer.get("state", {}).items()}
    if "optimizer" in state:
        state["optimizer"] = optimizer
    model_state, optim_state = state["model"], optimizer["state"]
    for name, module in unwrap(model).named_modules():
        rows = _ROWS.get(module)
        if rows is None:
            continue
        order = torch.argsort(rows) if inverse else rows
        for param in HeadAlignedColwise.PARAMS:
            key = f"{name}.{param}"
            if key in model_state:
                model_state[key] = model_state[key][order]
            moments = optim_state.get(key, {})
            for k, t in moments.items():
                if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == rows.numel():
                    moments[k] = t[order]
    return state


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Inverse of ``full_state``: rank 0 passes the loaded dicts and broadcasts them, every
    rank keeps its shards. A collective."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    state = _reorder_rows(model, state, inverse=False)
    set_model_state_dict(model, state.get("model", {}), options=options)
    set_optimizer_state_dict(model, optimizer, state.get("optimizer", {}), options=options)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        # Every rank reaches teardown before any destroys its group (a rank tearing gloo down
        # while a peer's last collective was in flight can abort); the group is then freed
        # only when the process ends: see ``end_worker``.
        dist.barrier()
        dist.destroy_process_group()


def joined() -> bool:
    """Whether this process joined torchrun's process group (before or after ``shutdown``)."""
    return _joined


def first_to_say(event: str) -> bool:
    """Whether this process is the first of its torchrun run to report ``event`` (a once-a-run
    failure such as a lost rank, which every survivor sees): the others then stay quiet and the
    run ends in one line. Asked of the store torchrun's agent hosts (``TORCHELASTIC_USE_AGENT_
    STORE``: it outlives every worker) with an atomic ``add``; True when there is no such store
    or it cannot be reached (every rank then reports: more lines, never none).

    Written by hand: neither torchrun nor ``torch.distributed`` elects one reporter among the
    survivors of a failed collective."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return True
    from datetime import timedelta

    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=5),
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return store.add(f"jaxmem/{event}/{attempt}", 1) == 1
    except (KeyError, ValueError, RuntimeError, OSError):  # dist's store errors are these
        return True


def end_worker(code: int) -> None:
    """End a torchrun worker that joined a process group with ``code``, once its results are
    written and ``shutdown`` has run, without the interpreter's teardown; a process that joined
    none returns (it ends as usual).

    Written by hand because torch has no call that frees a process group: FSDP2's device
    meshes, the model's DTensors and their hooks keep gloo's groups alive past
    ``destroy_process_group``, and the interpreter's teardown then frees them while gloo's
    threads run, which aborts the process ("terminate called without an active exception",
    no Python frame on the stack: 1 of 23 torchrun runs of 4 ranks on 2 cores, after the
    records were written; pytorch/pytorch#179291 tried an atexit fix and was abandoned).
    Output buffers and logging handlers are flushed first; files the run wrote were closed
    by their ``with`` blocks.
    """
    if not _joined:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to keep
            pass
    os._exit(code)

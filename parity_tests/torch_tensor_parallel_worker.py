"""Run by ``parity_tests/test_sharded_parity.py`` under ``torchrun`` (gloo), with a mesh with a
tensor axis (``tp=2`` on 2 ranks, ``fsdp=2,tp=2`` on 4) and the presets to train: torch_ref's
tensor parallelism (``torch_ref.distributed.parallelize``) against one device.

Per preset, every rank first trains the one-device baseline by itself (a plain model on the
whole batch, no collectives), then the same initial weights over the mesh on the same batches
(``full`` checkpointing, 2 microbatches, AdamW), reducing the sequence-parallel gradients and
taking the gradient norm as the job does. Rank 0 prints one JSON line:
``{preset: {"one_device": {"losses", "grad_norms"}, "mesh": {...}, "ranks": [per rank]}}``,
where a rank's entry holds its local element counts of the split weights and their AdamW
moments beside the whole weights', whether the initial state gathered on rank 0 (``full_state``)
equals the one-device model's bit for bit, and ``torch_ref.mesh_memory.measure``'s record; and
the op kinds a name-based policy counts as a block runs, on one device and over the mesh.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import torch_ref
import torch_ref.distributed as tdist
from jaxmem.config import PRESETS, OptimizerConfig
from jaxmem.parallel import ParallelConfig, parse_mesh
from jaxmem.policy import get_policy
from jaxmem.precision import PRECISIONS
from torch_ref.mesh_memory import measure
from torch_ref.remat import _op_kind, apply_memory_policy, block_ops
from torch_ref.train import accumulate_grads, make_optimizer

# run as a script: its own directory is on the path
from torch_parallel_worker import finish  # isort: skip

FP32 = PRECISIONS["fp32"]
POLICY = get_policy("full")
BATCH, SEQ, STEPS, ACCUM = 8, 32, 6, 2
# the parameters tensor parallelism splits, by the end of their names: the fused q/k/v, the
# attention's out projection, the MLP's up, gate and down, and the column-parallel biases
SPLIT = ("self_attn.in_proj_weight", "out_proj.weight", "ffn.0.weight", "ffn.2.weight")
SPLIT += ("ffn.up.weight", "ffn.gate.weight", "ffn.down.weight")
SPLIT += ("self_attn.in_proj_bias", "ffn.0.bias", "ffn.up.bias", "ffn.gate.bias")


def batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


def train(
    model: torch.nn.Module, parallel: ParallelConfig, launch: tdist.Launch
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    apply_memory_policy(model.blocks, POLICY)
    model = tdist.shard(model, parallel, launch)
    opt = make_optimizer(model, OptimizerConfig())
    rows = launch.rows(BATCH, parallel.tp) if parallel.sharded else None
    divisor = tdist.token_divisor(parallel, launch)
    losses, norms = [], []
    for batch in batches(model.cfg.vocab_size):
        local = {k: v[rows] for k, v in batch.items()} if rows is not None else batch
        opt.zero_grad(set_to_none=True)
        loss_sum, n = accumulate_grads(
            model, local, precision=FP32, accum_steps=ACCUM, divisor=divisor
        )
        if parallel.sharded:
            loss_sum = tdist.data_sum(loss_sum, parallel, launch)
            n = tdist.data_sum(n, parallel, launch)
            tdist.reduce_partial_grads(model.parameters())
        norms.append(float(tdist.grad_norm(model.parameters())))
        opt.step()
        losses.append(float(loss_sum / n))
    return model, opt, {"losses": losses, "grad_norms": norms}


def holdings(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Per split parameter: [whole elements, this rank's, this rank's of each AdamW moment]."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(SPLIT):
            moments = [tdist.local(opt.state[p][k]).numel() for k in ("exp_avg", "exp_avg_sq")]
            out[name] = [p.numel(), tdist.local(p).numel(), *moments]
    return out


class _OpKinds(TorchDispatchMode):
    """The kinds (``torch_ref.remat``'s names) of the ops a block runs, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.kinds.append(_op_kind(func))
        return func(*args, **(kwargs or {}))


def counted_ops(model: torch.nn.Module) -> list[str]:
    """The op kinds ``torch_ref.remat.block_ops`` counts, as the first block's forward runs
    them (what a name-based policy's table names ops by)."""
    counted = {kind for kind, _ in block_ops(model.cfg)}
    record = _OpKinds()
    block = model.blocks.layers[0]

    def start(*_) -> None:  # a hook returns None: it changes nothing
        record.__enter__()

    def stop(*_) -> None:
        record.__exit__(None, None, None)

    enter = block.register_forward_pre_hook(start)
    leave = block.register_forward_hook(stop)
    with torch.no_grad():
        model(batches(model.cfg.vocab_size)[0]["inputs"])
    enter.remove()
    leave.remove()
    return [kind for kind in record.kinds if kind in counted]


def main() -> None:
    torch.set_num_threads(1)
    mesh, presets = sys.argv[1], sys.argv[2:]
    launch = tdist.from_environment()
    tdist.initialize(launch)
    parallel = parse_mesh(mesh)
    out: dict = {}
    for preset in presets:
        cfg = PRESETS[preset]
        torch.manual_seed(0)
        initial = torch_ref.Decoder(cfg)
        _, _, one = train(copy.deepcopy(initial), ParallelConfig(), launch)
        # the gathered state of the split model, before any step: the one-device order
        fresh = tdist.shard(copy.deepcopy(initial), parallel, launch)
        state = tdist.full_state(fresh, make_optimizer(fresh, OptimizerConfig()))["model"]
        whole = initial.state_dict()  # full_state gathers on rank 0 only
        same = state.keys() == whole.keys() and all(torch.equal(state[k], whole[k]) for k in whole)
        ops = {"one_device": counted_ops(initial), "mesh": counted_ops(fresh)}
        model, opt, run = train(copy.deepcopy(initial), parallel, launch)
        record = measure(cfg, POLICY, FP32, OptimizerConfig(), BATCH, SEQ, parallel, launch)
        rank = {
            "rank": launch.rank,
            "holdings": holdings(model, opt),
            "state_in_qkv_order": same if launch.primary else None,
            "record": record,
        }
        ranks = [None] * launch.world_size
        dist.all_gather_object(ranks, rank)
        one_record = measure(
            cfg, POLICY, FP32, OptimizerConfig(), BATCH, SEQ, ParallelConfig(), launch
        )
        out[preset] = {
            "one_device": one,
            "mesh": run,
            "ranks": ranks,
            "one_record": one_record,
            "counted_ops": ops,
        }
    finish(out, launch)


if __name__ == "__main__":
    main()

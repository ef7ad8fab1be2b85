"""Run by ``parity_tests/test_sharded_parity.py`` under ``torchrun --nproc_per_node=2`` (gloo):
torch_ref's data-parallel strategies (``torch_ref.distributed``) against one device.

Every rank first trains the one-device baseline by itself (a plain model on the whole batch, no
collectives), then each strategy over the two ranks from the same initial weights on the same
batches; then ``torch_ref.mesh_memory.measure`` per strategy. Rank 0 prints one JSON line:
``{"one_device": [losses], "<strategy>": {"losses": [...], "ranks": [record per rank]}}``, and
one device and fsdp clipped to ``CLIP`` (``{"losses", "grad_norms"}``).
"""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist

import torch_ref
import torch_ref.distributed as tdist
from jaxmem.config import PRESETS, OptimizerConfig
from jaxmem.parallel import ParallelConfig
from jaxmem.policy import get_policy
from jaxmem.precision import PRECISIONS
from torch_ref.mesh_memory import measure
from torch_ref.remat import apply_memory_policy
from torch_ref.train import accumulate_grads, clip_grads, make_optimizer

CFG = PRESETS["tiny"]
FP32 = PRECISIONS["fp32"]
BATCH, SEQ, STEPS, ACCUM = 8, 32, 10, 2
CLIP = 0.05  # below every step's gradient norm here: clipping is active throughout


def batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=gen)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


def train(
    model: torch.nn.Module,
    parallel: ParallelConfig,
    launch: tdist.Launch,
    opt_cfg: OptimizerConfig | None = None,
    norms: list[float] | None = None,
) -> list[float]:
    """The losses of ``STEPS`` steps; with a clipping ``opt_cfg``, each step's gradient norm
    (before clipping) appended to ``norms`` and the gradient clipped as the trainer does."""
    apply_memory_policy(model.blocks, get_policy("full"))
    model = tdist.shard(model, parallel, launch)
    opt_cfg = opt_cfg or OptimizerConfig()
    opt = make_optimizer(model, opt_cfg)
    rows = launch.rows(BATCH) if parallel.sharded else None
    divisor = tdist.token_divisor(parallel, launch)
    losses = []
    for batch in batches():
        local = {k: v[rows] for k, v in batch.items()} if rows is not None else batch
        opt.zero_grad(set_to_none=True)
        loss_sum, n = accumulate_grads(
            model, local, precision=FP32, accum_steps=ACCUM, divisor=divisor
        )
        if norms is not None:  # as jaxmem.compare.torch_run's trainer: the norm over ranks
            norm = tdist.grad_norm(model.parameters())
            clip_grads(model.parameters(), opt_cfg, norm if parallel.sharded else None)
            norms.append(float(norm))
        opt.step()
        if parallel.sharded:
            loss_sum, n = tdist.all_sum(loss_sum), tdist.all_sum(n)
        losses.append(float(loss_sum / n))
    return losses


def main() -> None:
    torch.set_num_threads(1)
    launch = tdist.from_environment()
    tdist.initialize(launch)
    torch.manual_seed(0)
    initial = torch_ref.Decoder(CFG)
    out: dict = {"one_device": train(copy.deepcopy(initial), ParallelConfig(), launch)}
    for strategy in ("dp", "zero1", "fsdp"):
        parallel = ParallelConfig(strategy=strategy, devices=launch.world_size)
        losses = train(copy.deepcopy(initial), parallel, launch)
        rec = measure(
            CFG, get_policy("full"), FP32, OptimizerConfig(), BATCH, SEQ, parallel, launch
        )
        ranks = [None] * launch.world_size
        dist.all_gather_object(ranks, rec)
        out[strategy] = {"losses": losses, "ranks": ranks}
    # clipped to below every step's gradient norm: one device (clip_grad_norm_) and fsdp
    # (scaled by the norm reduced over the ranks)
    clipped = OptimizerConfig(clip_norm=CLIP)
    for name, parallel in (
        ("one_device_clipped", ParallelConfig()),
        ("fsdp_clipped", ParallelConfig(strategy="fsdp", devices=launch.world_size)),
    ):
        norms: list[float] = []
        losses = train(copy.deepcopy(initial), parallel, launch, clipped, norms)
        out[name] = {"losses": losses, "grad_norms": norms}
    # one device on the rows each rank reads: the peaks then differ by what the strategy adds
    rows = BATCH // launch.world_size
    out["one_device_record"] = measure(
        CFG, get_policy("full"), FP32, OptimizerConfig(), rows, SEQ, ParallelConfig(), launch
    )
    finish(out, launch)


def finish(out: dict, launch: tdist.Launch) -> None:
    """Rank 0 prints ``out`` as one JSON line; every rank leaves its group and ends."""
    if launch.primary:
        print(json.dumps(out))
    tdist.shutdown()
    tdist.end_worker(0)  # flushes stdout; skips the teardown that can abort gloo's threads


if __name__ == "__main__":
    main()

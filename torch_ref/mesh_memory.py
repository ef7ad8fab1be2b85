"""Per-rank memory of one torch_ref training step over a mesh (DDP or FSDP2, with or without a
tensor axis or a context axis: ``torch_ref.distributed``, ``torch_ref.context``), measured at
run time: the PyTorch column beside
``jaxmem memory --mesh`` (compiled plans, per device).

Run under torchrun, one process per device::

    torchrun --standalone --nproc_per_node=2 -m torch_ref.mesh_memory \\
        --preset small --policy full --mesh fsdp=2 --batch-size 8 --seq-len 128 --json out.json

Each rank runs one untracked step (so the measured one holds AdamW's state), then one step under
PyTorch's tracker: ``FSDPMemTracker`` for FSDP2 (``zero1``, ``fsdp``), ``MemTracker`` for DDP
(``dp``) and a tensor axis alone, with the optimizer's state tracked. Rank 0 writes one record
per rank: this rank's parameter, gradient and optimizer-state bytes (its shards), and the
tracker's peak (on CUDA:
``max_memory_allocated``). DDP's gradient buckets are communication buffers the trackers see as
tensors of the process; FSDP2's all-gathered parameters appear while a block runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
from typing import Any

import torch
import torch.distributed as dist

import torch_ref
import torch_ref.distributed as tdist
from jaxmem.config import PRESETS, ConfigError, ModelConfig, OptimizerConfig
from jaxmem.job import torch_mesh_refusal, torch_ring_policy_refusal
from jaxmem.parallel import CP_ATTENTIONS, ParallelConfig, parse_mesh
from jaxmem.policy import MemoryPolicy
from jaxmem.policy_config import parse_policy
from jaxmem.precision import PRECISIONS, Precision
from torch_ref.context import apply_to_rank, rank_batch
from torch_ref.remat import apply_loss_policy, apply_memory_policy
from torch_ref.train import TORCH_DTYPES, accumulate_grads, make_optimizer


def measure(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    precision: Precision,
    opt_cfg: OptimizerConfig,
    batch: int,
    seq_len: int,
    parallel: ParallelConfig,
    launch: tdist.Launch,
    seed: int = 0,
) -> dict[str, Any]:
    """This rank's record of one steady training step of the global ``batch`` (its rows)."""
    parallel.check_batch(batch)
    tdist.initialize(launch)
    device = launch.device
    torch.manual_seed(seed)
    model = torch_ref.Decoder(cfg).to(device, TORCH_DTYPES[precision.param_dtype])
    context = parallel.sharded and parallel.context_parallel
    if context:  # this rank's columns of its data rank's rows, keys gathered over its group
        apply_to_rank(model, parallel, launch, seq_len)
    runner = apply_memory_policy(model.blocks, policy)
    apply_loss_policy(model, policy)
    model = tdist.shard(model, parallel, launch)
    opt = make_optimizer(model, opt_cfg)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
    # a mesh's ranks read their data rank's rows; an unsharded record the whole batch (also
    # when measured inside a torchrun world, beside the mesh's)
    inner = parallel.tp * parallel.cp
    rows = (launch.rows(batch, inner) if parallel.sharded else None) or slice(None)
    data = {"inputs": tokens[rows, :-1].to(device), "targets": tokens[rows, 1:].to(device)}
    if context:
        data = rank_batch(data, parallel, launch)
    divisor = tdist.token_divisor(parallel, launch)

    def step() -> int:
        """One training step; returns this rank's gradient bytes before the update."""
        opt.zero_grad(set_to_none=True)
        accumulate_grads(model, data, precision=precision, divisor=divisor)
        tdist.reduce_partial_grads(model.parameters())
        grads = tdist.local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        opt.step()
        return grads

    step()  # AdamW's state exists from here on
    saved = _saved_activations(model, runner, data, precision)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        tracker, kind = None, "max_memory_allocated"
    elif parallel.sharded and parallel.strategy in tdist.RESHARD_AFTER_FORWARD:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker, kind = FSDPMemTracker(model, opt), "torch FSDPMemTracker"
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker, kind = MemTracker(), "torch MemTracker"
        tracker.track_external(model, opt)
    with tracker or contextlib.nullcontext():
        grads = step()
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    how = f"per rank of {parallel.mesh_text()}" if parallel.sharded else "one process"
    return {
        "framework": "torch",
        "rank": launch.rank,
        "mesh": parallel.mesh_text() if parallel.sharded else None,
        "strategy": tdist.describe(parallel) if parallel.sharded else "one device",
        "policy": policy.name,
        "translation": runner.description,
        "optimizer": opt_cfg.name,
        "attention": cfg.attention,
        "precision": precision.name,
        "batch": batch,
        "seq_len": seq_len,
        "params_bytes": tdist.local_bytes(model.parameters()),
        "grads_bytes": grads,
        "opt_state_bytes": tdist.local_bytes(state),
        "state_source": f"counted (this rank's tensors, {how}; after the step)",
        "saved_activation_bytes_device": saved.device_bytes,
        "saved_activation_bytes_host": saved.host_bytes,
        "saved_by_name": saved.by_name,
        "saved_source": "live after the forward (torch_ref.forward_memory.forward_live_bytes; "
        f"this rank's storages, a DTensor's local shard; {how})",
        "peak_bytes": peak,
        "peak_source": f"runtime peak ({kind}, {device.split(':')[0]}; a second step: "
        f"optimizer state included; {how})",
    }


def _saved_activations(
    model: torch.nn.Module, runner: Any, data: dict[str, torch.Tensor], precision: Precision
) -> Any:
    """What one forward of this rank's rows leaves alive for the backward
    (``torch_ref.forward_memory.forward_live_bytes``, grouped by jaxmem tag over the block
    stack); the backward then runs and its gradients are dropped."""
    from torch_ref.forward_memory import forward_live_bytes
    from torch_ref.train import lm_loss_sum

    def forward() -> torch.Tensor:
        loss_sum, n = lm_loss_sum(model, data, precision)
        # collectives still in flight hold buffers that their completion frees: let them
        # finish (and what they released go) before the live storages are read
        tdist.barrier()
        gc.collect()
        return loss_sum / n

    loss, live = forward_live_bytes(
        forward,
        host_storages=getattr(runner, "host_storages", None),
        stack=tdist.unwrap(model).blocks,
        kept_names=getattr(runner, "kept_names", None),
    )
    loss.backward()
    model.zero_grad(set_to_none=True)
    return live


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_ref.mesh_memory", description=__doc__)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--policy", default="none")
    p.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS))
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd", "adafactor"))
    p.add_argument("--attention", default=None, choices=("naive", "fused"))
    p.add_argument("--mesh", default=None, help="STRATEGY=N (default: one process, no mesh)")
    p.add_argument(
        "--sequence-parallel",
        default="true",
        choices=("true", "false"),
        help="with a tensor axis: split the residual stream by sequence (default true)",
    )
    p.add_argument(
        "--cp-attention",
        default="gather",
        choices=tuple(CP_ATTENTIONS),
        help="with a context axis: gather keys and values, or pass them round a ring",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--json", required=True, help="where rank 0 writes the per-rank records")
    args = p.parse_args(argv)
    launch = tdist.from_environment()
    try:
        parallel = parse_mesh(args.mesh) if args.mesh else ParallelConfig()
        parallel = dataclasses.replace(
            parallel,
            sequence_parallel=args.sequence_parallel == "true",
            cp_attention=args.cp_attention,
        )
        tdist.check_launch(parallel, launch, "python -m torch_ref.mesh_memory ...")
        policy = parse_policy(args.policy)
    except ConfigError as e:
        print(f"torch_ref.mesh_memory: error: {e}", file=sys.stderr)
        return 2
    cfg = PRESETS[args.preset]
    if args.attention is not None:
        cfg = cfg.replace(attention=args.attention)
    try:
        parallel.check_model(cfg, args.seq_len)
        refusal = torch_mesh_refusal(parallel, cfg) or torch_ring_policy_refusal(parallel, policy)
        if refusal is not None:
            raise ConfigError(refusal)
    except ConfigError as e:
        print(f"torch_ref.mesh_memory: error: {e}", file=sys.stderr)
        return 2
    rec = measure(
        cfg,
        policy,
        PRECISIONS[args.precision],
        OptimizerConfig(name=args.optimizer),
        args.batch_size,
        args.seq_len,
        parallel,
        launch,
    )
    records = [rec]
    if dist.is_initialized():
        records = [None] * launch.world_size
        dist.all_gather_object(records, rec)
    if launch.primary:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    tdist.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    tdist.end_worker(code)  # a torchrun worker ends here, past its records
    sys.exit(code)

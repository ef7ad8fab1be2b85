"""PyTorch's own budgeted activation checkpointing, as the peer of ``jaxmem plan``.

``torch._functorch.config.activation_memory_budget`` (0..1: the fraction of the activations
saving everything would keep) makes ``min_cut_rematerialization_partition`` solve a knapsack
over what the backward saves versus recomputes, inside ``torch.compile``, for one program. Here
torch_ref's decoder runs under ``torch.compile`` with AOTAutograd and that partitioner, and the
forward and backward graphs run eagerly (no Inductor: no C++ toolchain needed, and every aten op
stays visible): saved bytes from autograd's saved-tensor hooks (storages once, parameters and
batch apart) and FLOPs from ``FlopCounterMode`` around each graph's execution (recompute
included). A benchmark row, not a dependency of jaxmem.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

import torch_ref
from jaxmem.config import ModelConfig
from jaxmem.planner.records import lm_step_batch
from torch_ref.forward_memory import saved_tensor_bytes
from torch_ref.loss import cross_entropy_sum


@dataclasses.dataclass(frozen=True)
class BudgetedStep:
    budget: float  # activation_memory_budget
    saved_activation_bytes: int  # what autograd's hooks saw, parameters and batch apart
    flops: int  # matmul FLOPs of forward + backward (recompute included), FlopCounterMode
    source: str = (
        "torch.compile (AOTAutograd, min_cut_rematerialization_partition, graphs run eagerly) "
        "of torch_ref's decoder, fp32; saved: autograd saved-tensor hooks; FLOPs: "
        "FlopCounterMode around each graph"
    )


def budgeted_steps(
    cfg: ModelConfig, batch: int, seq_len: int, budgets: tuple[float, ...], seed: int = 0
) -> list[BudgetedStep]:
    """One fp32 forward + backward of the mean LM loss per budget (each compiled afresh)."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(seed)
    model = torch_ref.Decoder(cfg)
    data = lm_step_batch(cfg, batch, seq_len, abstract=False)
    x = torch.from_numpy(np.array(data["inputs"])).long()
    y = torch.from_numpy(np.array(data["targets"])).long()
    flops = [0]

    def counting(gm: torch.fx.GraphModule, _: Any) -> Any:
        def run(args: list) -> Any:  # AOTAutograd's boxed calling convention
            with FlopCounterMode(display=False) as counter:
                out = gm(*args)
            flops[0] += counter.get_total_flops()
            return out

        run._boxed_call = True
        return run

    backend = aot_autograd(
        fw_compiler=counting, bw_compiler=counting, partition_fn=min_cut_rematerialization_partition
    )
    out = []
    for budget in budgets:
        torch._dynamo.reset()
        with functorch_config.patch(activation_memory_budget=budget):
            compiled = torch.compile(model, backend=backend)

            def forward(compiled=compiled) -> torch.Tensor:
                loss_sum, n = cross_entropy_sum(compiled(x), y)
                return loss_sum / n

            forward().backward()  # compiles
            model.zero_grad(set_to_none=True)
            flops[0] = 0
            loss, saved = saved_tensor_bytes(forward, [*model.parameters(), x, y])
            loss.backward()
            model.zero_grad(set_to_none=True)
        out.append(BudgetedStep(budget, saved.activation_bytes_device, flops[0]))
    torch._dynamo.reset()
    return out

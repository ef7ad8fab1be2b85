"""Data-parallel strategies as data, like memory policies (``jaxmem.policy``): what each device
holds when a step runs on N devices. Pure data (no JAX, no PyTorch); ``jaxmem.sharding`` turns a
``ParallelConfig`` into JAX shardings, applied to the step from outside (the model never
changes).

- ``dp``: every device holds the parameters, gradients and optimizer state; the batch is split
  and gradients are all-reduced (PyTorch DDP; FSDP2 with ``NO_SHARD``-like replication).
- ``zero1``: as ``dp`` but the optimizer state is sharded (ZeRO stage 1): each device updates
  its shard and the new parameters are all-gathered.
- ``fsdp``: parameters, gradients and optimizer state sharded (ZeRO stage 3, PyTorch FSDP2's
  ``fully_shard``): each scanned block's weights are all-gathered for its forward and backward
  and its gradients reduce-scattered.

On the command line a strategy and its device count are one mesh axis: ``--mesh fsdp=4``.
"""

from __future__ import annotations

import dataclasses
import os

from jaxmem.config import ConfigError, require

STRATEGIES: dict[str, str] = {
    "dp": "parameters, gradients and optimizer state replicated; gradients all-reduced",
    "zero1": "optimizer state sharded (ZeRO-1); parameters and gradients replicated",
    "fsdp": "parameters, gradients and optimizer state sharded (ZeRO-3, FSDP)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How a step is spread over devices.

    Attributes:
      strategy: one of ``STRATEGIES``.
      devices: how many devices the data-parallel mesh axis spans (1: a single device, no
        sharding at all, whatever the strategy).
    """

    strategy: str = "dp"
    devices: int = 1

    def __post_init__(self) -> None:
        require(
            self.strategy in STRATEGIES,
            f"parallel strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}",
        )
        require(
            isinstance(self.devices, int)
            and not isinstance(self.devices, bool)
            and self.devices > 0,
            f"parallel devices={self.devices!r} must be a positive integer",
        )

    @property
    def sharded(self) -> bool:
        """Runs on more than one device."""
        return self.devices > 1

    @property
    def shards_params(self) -> bool:
        return self.sharded and self.strategy == "fsdp"

    @property
    def shards_opt_state(self) -> bool:
        return self.sharded and self.strategy in ("zero1", "fsdp")

    def mesh_text(self) -> str:
        return f"{self.strategy}={self.devices}"

    def check_batch(self, batch_size: int, accum_steps: int = 1) -> None:
        """Every microbatch must split evenly over the devices."""
        micro = batch_size // accum_steps
        require(
            micro % self.devices == 0,
            f"microbatch size {micro} (batch {batch_size} / accum {accum_steps}) does not split "
            f"over --mesh {self.mesh_text()}: use a batch size that is a multiple of "
            f"{self.devices * accum_steps}",
        )


def max_local_devices() -> int:
    """The most CPU devices (JAX) or processes (torchrun) one command starts on this machine:
    4 per usable core, at least 8. Each costs threads and memory; thousands make the machine
    unusable and measure nothing a GPU mesh would show."""
    return max(8, 4 * len(os.sched_getaffinity(0)))


def check_cpu_mesh(devices: int, what: str = "CPU devices") -> None:
    """Refuse a mesh of more local CPU devices (or processes) than ``max_local_devices``."""
    limit = max_local_devices()
    require(
        devices <= limit,
        f"--mesh asks for {devices} {what} on this machine ({len(os.sched_getaffinity(0))} "
        f"cores): use at most {limit}, or plan a GPU mesh from shapes with --target h100",
    )


def parse_mesh(text: str) -> ParallelConfig:
    """``"fsdp=4"`` -> ``ParallelConfig(strategy="fsdp", devices=4)``; one axis (data-parallel
    strategies only)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if len(parts) != 1 or "=" not in parts[0]:
        raise ConfigError(
            f"--mesh {text!r} must be one STRATEGY=DEVICES axis, e.g. fsdp=4 (strategies: "
            f"{', '.join(STRATEGIES)})"
        )
    name, _, count = parts[0].partition("=")
    try:
        devices = int(count)
    except ValueError:
        raise ConfigError(f"--mesh {text!r}: {count!r} is not a device count") from None
    return ParallelConfig(strategy=name.strip(), devices=devices)


def shard_dim(shape: tuple[int, ...], n: int, stacked: bool = False) -> int | None:
    """The dimension a sharded array is split on over ``n`` devices: its largest one divisible
    by ``n`` (the later on a tie), never the stacked layer axis (dimension 0 of the blocks'
    parameters: ``lax.scan`` takes one layer per iteration); None: it is replicated."""
    first = 1 if stacked and len(shape) > 1 else 0
    dims = [d for d in range(first, len(shape)) if shape[d] >= n and shape[d] % n == 0]
    return max(dims, key=lambda d: (shape[d], d)) if dims else None


def shard_elements(shape: tuple[int, ...], n: int, stacked: bool = False) -> int:
    """Elements of one device's shard of a sharded array of ``shape`` over ``n`` devices."""
    total = 1
    for d in shape:
        total *= d
    return total // n if shard_dim(shape, n, stacked) is not None else total

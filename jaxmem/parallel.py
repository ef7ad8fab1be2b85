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
    """How a step is spread over devices: a data-parallel axis (``strategy``) and, optionally, a
    tensor-parallel one (``tp``: Megatron's layout, ``jaxmem.sharding.TENSOR``).

    Attributes:
      strategy: one of ``STRATEGIES`` (the data-parallel axis).
      devices: how many devices the whole mesh spans (1: a single device, no sharding at all,
        whatever the strategy); the data-parallel axis has ``devices // tp`` of them.
      tp: the tensor-parallel axis: each block's attention heads and MLP columns split over
        ``tp`` devices (q/k/v/gate/up column-parallel, out/down row-parallel); 1: none.
      sequence_parallel: with ``tp > 1``, the residual stream, norms and the blocks' inputs and
        outputs are split by sequence over the ``tp`` devices between the attention and MLP
        regions (Korthikanti et al., 2022) instead of replicated on each.
    """

    strategy: str = "dp"
    devices: int = 1
    tp: int = 1
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        require(
            self.strategy in STRATEGIES,
            f"parallel strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}",
        )
        for name in ("devices", "tp"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"parallel {name}={value!r} must be a positive integer",
            )
        require(
            self.devices % self.tp == 0,
            f"parallel devices={self.devices} is not a multiple of tp={self.tp}: the mesh is "
            "data x tensor devices",
        )
        require(
            isinstance(self.sequence_parallel, bool),
            f"parallel sequence_parallel={self.sequence_parallel!r} must be true or false",
        )

    @property
    def data(self) -> int:
        """Devices on the data-parallel axis (the batch splits over these)."""
        return self.devices // self.tp

    @property
    def sharded(self) -> bool:
        """Runs on more than one device."""
        return self.devices > 1

    @property
    def tensor_parallel(self) -> bool:
        return self.tp > 1

    @property
    def shards_params(self) -> bool:
        return self.data > 1 and self.strategy == "fsdp"

    @property
    def shards_opt_state(self) -> bool:
        return self.data > 1 and self.strategy in ("zero1", "fsdp")

    def mesh_text(self) -> str:
        if self.tp == 1:
            return f"{self.strategy}={self.devices}"
        data = f"{self.strategy}={self.data}," if self.data > 1 else ""
        return f"{data}tp={self.tp}"

    def check_batch(self, batch_size: int, accum_steps: int = 1) -> None:
        """Every microbatch must split evenly over the data-parallel devices."""
        micro = batch_size // accum_steps
        require(
            micro % self.data == 0,
            f"microbatch size {micro} (batch {batch_size} / accum {accum_steps}) does not split "
            f"over --mesh {self.mesh_text()}: use a batch size that is a multiple of "
            f"{self.data * accum_steps}",
        )

    def check_model(self, n_heads: int, kv_heads: int, d_ff: int, seq_len: int) -> None:
        """Tensor parallelism splits whole query heads and MLP columns (and, with sequence
        parallelism, the sequence) evenly over ``tp`` devices."""
        if self.tp == 1:
            return
        for what, n in (("query heads", n_heads), ("MLP width d_ff", d_ff)):
            require(
                n % self.tp == 0,
                f"--mesh {self.mesh_text()}: the model's {n} {what} do not split over tp="
                f"{self.tp}; use a tp that divides {n}",
            )
        require(
            kv_heads % self.tp == 0 or self.tp % kv_heads == 0,
            f"--mesh {self.mesh_text()}: the model's {kv_heads} key/value heads neither split "
            f"over tp={self.tp} nor divide it; use a tp that divides {kv_heads} or a multiple",
        )
        require(
            not self.sequence_parallel or seq_len % self.tp == 0,
            f"--mesh {self.mesh_text()}: sequence parallelism splits the {seq_len} positions "
            f"over tp={self.tp}; use a --seq-len that is a multiple of {self.tp} or set "
            "parallel.sequence_parallel=false",
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
    """``"fsdp=4"`` -> ``ParallelConfig(strategy="fsdp", devices=4)``; ``"fsdp=2,tp=2"`` ->
    ``ParallelConfig(strategy="fsdp", devices=4, tp=2)`` (a 2 x 2 mesh); ``"tp=2"``: tensor
    parallelism alone. At most one data-parallel axis and one ``tp``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    usage = (
        f"--mesh {text!r} must be STRATEGY=N, tp=N, or both (e.g. fsdp=4, tp=2, fsdp=2,tp=2; "
        f"strategies: {', '.join(STRATEGIES)})"
    )
    if not parts or len(parts) > 2 or any("=" not in p for p in parts):
        raise ConfigError(usage)
    axes: dict[str, int] = {}
    for part in parts:
        name, _, count = part.partition("=")
        name = name.strip()
        try:
            value = int(count)
        except ValueError:
            raise ConfigError(f"--mesh {text!r}: {count!r} is not a device count") from None
        if name in axes or (name != "tp" and any(a != "tp" for a in axes)):
            raise ConfigError(usage)
        axes[name] = value
    tp = axes.pop("tp", 1)
    strategy, data = next(iter(axes.items()), ("dp", 1))
    for name, value in (("tp", tp), (strategy, data)):
        if value < 1:
            raise ConfigError(f"--mesh {text!r}: {name}={value} must be a positive device count")
    return ParallelConfig(strategy=strategy, devices=data * tp, tp=tp)


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

"""An estimated step time, priced from what the step's kernels do (``jaxmem.memory.work``) at a
target's rates, with every assumption named; and the MFU it implies. An **estimate**, never a
measurement: ``benchmarks/gpu_check.py`` measures the same steps on a GPU to calibrate it.

The model, per kernel (a roofline), then the transfers around the compute:

- **a matmul** takes ``max(FLOPs / (peak · efficiency), bytes / (HBM · hbm_efficiency))``, at
  the target's dense rate for its operands' type (fp32 as TF32, XLA's default on GPU). Its
  efficiency is ``matmul_efficiency · waves · depth``: ``waves``, NVIDIA's tile and wave
  quantization (the result is cut into ``tile x tile`` tiles, one per multiprocessor per wave;
  a last partial wave, or fewer tiles than multiprocessors, leaves some idle); ``depth``,
  ``k / (k + k_half)`` (a product of depth k spends about ``k_half`` of it filling and
  draining the pipeline). A small microbatch therefore runs its matmuls below peak.
- **a fused attention kernel** (cuDNN) the same, with its FLOPs from its shapes;
- **a memory-bound kernel** (norms, softmax, elementwise work, the recompute ``selective``
  does, casts, the optimizer update) ``bytes / (HBM · hbm_efficiency)`` plus a fixed
  ``launch`` time per kernel;
- **transfers**: host-link bytes (offloaded activations, optimizer state in host memory,
  streamed parameters) at the link's rate; collectives at the interconnect's; a host update's
  bytes at the host memory's assumed rate. Each is hidden under the compute up to an assumed
  fraction (``Overlap``): ``step = compute + Σ max(0, t - overlap · compute)``.

MFU is model FLOPs (the training step's matmuls without any recompute, 3 x the forward: PaLM's
definition, as torchtitan and Megatron report it) over the step time and the peak rate of the
compute type; HFU counts the FLOPs the program executes (recompute included).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxmem.memory.targets import Rates, Target, rates_for
from jaxmem.memory.work import Matmul, Work


@dataclasses.dataclass(frozen=True, kw_only=True)
class Overlap:
    """The fraction of each transfer's time hidden under the step's compute (0: none, it adds;
    1: up to the compute's length). Assumptions, stated with every estimate."""

    # XLA's latency-hiding scheduler runs a data-parallel step's gradient reduce-scatter or
    # all-reduce during the backward, and FSDP's all-gathers ahead of the blocks that need them
    data_parallel: float = 1.0
    # Megatron-SP's all-gathers and reduce-scatters sit between a block's matmuls: exposed
    tensor_parallel: float = 0.0
    # a context axis's keys and values (and their gradients), gathered or passed round a ring
    # just before the attention that needs them: assumed exposed (a ring's next pass could
    # hide under the current chunk's products where its collective runs asynchronously)
    context_parallel: float = 0.0
    # offloaded activations (projections, or block inputs: each [B, S, D] out in the forward and
    # back in the backward): XLA issues each copy as soon as its value exists (copy-start) and
    # waits only where the backward needs it back
    activation_offload: float = 1.0
    # optimizer state in host memory and the streamed stack's parameters, gradients and state:
    # fetched and written back around the update and the blocks that need them (assumed
    # exposed: a block's fetch comes before its compute in the scan)
    state_transfers: float = 0.0
    # a host update runs after the backward, while the device waits
    host_update: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise ValueError(f"overlap {f.name}={v!r} must be a fraction in [0, 1]")

    def text(self) -> str:
        return ", ".join(f"{f.name.replace('_', ' ')} {getattr(self, f.name):g}" for f in
                         dataclasses.fields(self))  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimeModel:
    """The estimate's assumptions (defaults: round figures, to be calibrated on a GPU by
    ``benchmarks/gpu_check.py``; each stated with every estimate)."""

    # of the dense peak, for a large product: large bf16 GEMMs on an H100 reach about 800 of
    # its 989 TFLOP/s
    matmul_efficiency: float = 0.8
    tile: int = 128  # output tile per multiprocessor and wave (cuBLAS/Triton's common 128x128)
    k_half: int = 64  # contraction depth at which a product runs at half its efficiency
    # of the datasheet HBM bandwidth that streaming kernels reach (a device-to-device copy on
    # an H100 moves about 3.0 of its 3.35 TB/s)
    hbm_efficiency: float = 0.9
    launch_seconds: float = 3e-6  # per memory-bound kernel: launch and tail (no CUDA graphs)
    overlap: Overlap = dataclasses.field(default_factory=Overlap)

    def __post_init__(self) -> None:
        for name in ("matmul_efficiency", "hbm_efficiency"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name}={v!r} must be a fraction in (0, 1]")
        if self.tile < 1 or self.k_half < 0 or self.launch_seconds < 0:
            raise ValueError(
                f"tile={self.tile}, k_half={self.k_half}, launch_seconds={self.launch_seconds}: "
                "need tile >= 1 and k_half, launch_seconds >= 0"
            )

    def text(self) -> str:
        return (
            f"matmuls at {self.matmul_efficiency:.0%} of peak x wave quantization "
            f"({self.tile}x{self.tile} tiles) x k/(k+{self.k_half}); memory-bound work at "
            f"{self.hbm_efficiency:.0%} of HBM bandwidth + {self.launch_seconds * 1e6:g} us per "
            f"kernel; overlap with compute: {self.overlap.text()}"
        )


DEFAULT = TimeModel()


@dataclasses.dataclass(frozen=True)
class Device:
    """What the estimate needs of a GPU: its rates, multiprocessors and HBM bandwidth."""

    name: str
    rates: Rates
    multiprocessors: int
    hbm_bytes_per_s: float

    @classmethod
    def of(cls, target: Target) -> Device | None:
        """The target's, or None for the local backend (no estimate: its rates are not a
        GPU's)."""
        if not target.is_gpu or not target.multiprocessors or not target.memory_bandwidth:
            return None
        return cls(target.name, rates_for(target), target.multiprocessors,
                   float(target.memory_bandwidth))  # fmt: skip

    def peak(self, dtype: str) -> float:
        return self.rates.matmul_flops.get(dtype, self.rates.matmul_flops["float32"])


def matmul_efficiency(m: Matmul, device: Device, model: TimeModel = DEFAULT) -> float:
    """The fraction of the peak rate ``m`` runs at (before the memory roofline)."""
    tiles = m.batch * math.ceil(m.m / model.tile) * math.ceil(m.n / model.tile)
    waves = math.ceil(tiles / device.multiprocessors)
    wave_use = tiles / (waves * device.multiprocessors)
    depth = m.k / (m.k + model.k_half) if model.k_half else 1.0
    return model.matmul_efficiency * wave_use * depth


def matmul_seconds(m: Matmul, device: Device, model: TimeModel = DEFAULT) -> float:
    compute = m.flops / (device.peak(m.dtype) * matmul_efficiency(m, device, model))
    memory = m.bytes / (device.hbm_bytes_per_s * model.hbm_efficiency)
    return max(compute, memory)


@dataclasses.dataclass(frozen=True)
class Transfers:
    """Bytes a step moves beyond its kernels, by kind (from shapes or from the program), per
    device."""

    activation_offload: int = 0  # to host and back
    state: int = 0  # optimizer state / streamed stack over the host link
    data_parallel: int = 0  # collectives over the data axis
    tensor_parallel: int = 0  # collectives over the tensor axis
    host_update: int = 0  # host memory read and written by an update on the host
    context_parallel: int = 0  # keys and values over the context axis (from shapes)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """An estimated step time and what it is made of (seconds, per device)."""

    matmul: float
    attention: float
    memory_bound: float
    launches: float
    activation_offload: float
    state: float
    data_parallel: float
    tensor_parallel: float
    host_update: float
    seconds: float  # the step, overlap applied
    executed_flops: int
    model_flops: int
    peak_flops: float  # the compute type's dense peak
    matmul_efficiency: float  # FLOP-weighted mean over the matmuls
    assumptions: str
    source: str
    context_parallel: float = 0.0  # keys and values over a context axis

    @property
    def compute(self) -> float:
        return self.matmul + self.attention + self.memory_bound + self.launches

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.seconds * self.peak_flops) if self.seconds else 0.0

    @property
    def hfu(self) -> float:
        return self.executed_flops / (self.seconds * self.peak_flops) if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(compute=self.compute, mfu=self.mfu, hfu=self.hfu)
        return out

    def line(self) -> str:
        """One line: the estimate, its parts and the MFU."""
        parts = [
            ("matmuls", self.matmul + self.attention),
            ("memory-bound", self.memory_bound + self.launches),
            ("host link", self.activation_offload + self.state),
            ("collectives", self.data_parallel + self.tensor_parallel + self.context_parallel),
            ("host update", self.host_update),
        ]
        shown = ", ".join(f"{n} {_ms(t)}" for n, t in parts if t > 0)
        return (
            f"est. {_ms(self.seconds)} per step ({shown}; overlap applied), MFU "
            f"{self.mfu:.1%} (HFU {self.hfu:.1%}, matmuls at {self.matmul_efficiency:.0%} of "
            "peak)"
        )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.0f} us"


def collective_transfers(work: Work, *, data: int, tp: int) -> tuple[int, int]:
    """(data-parallel, tensor-parallel) collective bytes of a program over a data x tensor
    mesh: with a tensor axis, the collectives among neighbouring devices are its
    (``jaxmem.sharding.mesh``), the rest the data axis's; without one, all are data-parallel."""
    dp = tp_bytes = 0
    for kind, b in work.collective_bytes:
        if tp > 1 and (data == 1 or kind.endswith("(neighbours)")):
            tp_bytes += b
        else:
            dp += b
    return dp, tp_bytes


def compute_dtype_of(work: Work) -> str:
    """The type most of the matmul FLOPs run in."""
    by: dict[str, int] = {}
    for m, n in work.matmuls:
        by[m.dtype] = by.get(m.dtype, 0) + m.flops * n
    return max(by, key=by.get) if by else "bfloat16"


def estimate(
    work: Work,
    device: Device,
    *,
    model_flops: int,
    transfers: Transfers = Transfers(),
    compute_dtype: str | None = None,
    model: TimeModel = DEFAULT,
    source: str = "",
) -> StepTime:
    """The step time of ``work`` on ``device`` (see the module docstring). ``work``'s kernels
    and host copies are priced from it; collectives and what a program cannot show (optimizer
    state a deviceless plan keeps on the device, a streamed stack's traffic) come in
    ``transfers`` (``collective_transfers`` splits a program's own collectives by axis)."""
    mm = sum(matmul_seconds(m, device, model) * n for m, n in work.matmuls)
    flops = work.matmul_flops
    eff = (
        sum(matmul_efficiency(m, device, model) * m.flops * n for m, n in work.matmuls) / flops
        if flops
        else 0.0
    )
    hbm = device.hbm_bytes_per_s * model.hbm_efficiency
    attention = 0.0
    if work.attention_flops:
        attention = max(
            work.attention_flops / (device.peak(work.attention_dtype) * model.matmul_efficiency),
            work.attention_bytes / hbm,
        )
    memory = work.memory_bytes / hbm
    launches = work.memory_kernels * model.launch_seconds
    rates = device.rates
    offload = (work.to_host_bytes + work.from_host_bytes + transfers.activation_offload) / (
        rates.host_link
    )
    state = transfers.state / rates.host_link
    dp = transfers.data_parallel / rates.interconnect
    tp = transfers.tensor_parallel / rates.interconnect
    cp = transfers.context_parallel / rates.interconnect
    host_update = (
        (transfers.host_update + work.host_compute_bytes) / rates.host_memory
        if rates.host_memory
        else 0.0
    )
    compute = mm + attention + memory + launches
    o = model.overlap
    seconds = compute + sum(
        max(0.0, t - share * compute)
        for t, share in (
            (offload, o.activation_offload),
            (state, o.state_transfers),
            (dp, o.data_parallel),
            (tp, o.tensor_parallel),
            (cp, o.context_parallel),
            (host_update, o.host_update),
        )
    )
    dtype = compute_dtype or compute_dtype_of(work)
    return StepTime(
        matmul=mm,
        attention=attention,
        memory_bound=memory,
        launches=launches,
        activation_offload=offload,
        state=state,
        data_parallel=dp,
        tensor_parallel=tp,
        host_update=host_update,
        context_parallel=cp,
        seconds=seconds,
        executed_flops=work.flops,
        model_flops=model_flops,
        peak_flops=device.peak(dtype),
        matmul_efficiency=eff,
        assumptions=f"{model.text()}; rates: {rates.source}; HBM "
        f"{device.hbm_bytes_per_s / 1e12:.2f} TB/s, {device.multiprocessors} multiprocessors "
        f"(target config)",
        source=f"estimate: {source or work.source}",
    )


def of_plan(
    work: Work | None,
    target: Target,
    cfg: Any,
    precision: Any,
    batch: int,
    seq_len: int,
    parallel: Any = None,
    *,
    state_link_bytes: int = 0,
    host_update_bytes: int = 0,
    program_host_copies: bool = True,
    adapters: Any = None,
    context_bytes: int = 0,
) -> dict[str, Any] | None:
    """The estimated step time of a program compiled for a GPU ``target`` whose kernels are
    ``work`` (``work_of_hlo`` of it; None, or the local backend: None), per device, with the MFU
    it implies and every assumption: the program's kernels, host copies and collectives priced
    from its HLO, plus what a deviceless plan cannot show, from shapes: ``state_link_bytes``
    over the host link (optimizer state in host memory, a streamed stack;
    ``program_host_copies=False`` where those shapes replace the program's own copies and host
    computations) and ``host_update_bytes`` of host memory an update on the host reads and
    writes. ``adapters`` (a LoRA job's ``AdapterConfig``): the MFU counts what a frozen base
    computes. ``context_bytes``: the bytes of the program's collectives that are a context
    axis's keys and values (from shapes: its collectives do not name their axis, and the
    context axis's groups are not neighbours), priced as ``Overlap.context_parallel`` says
    rather than as the data axis's. A dict (``StepTime.as_dict`` and its ``line``)."""
    from jaxmem.memory import analytic

    device = Device.of(target)
    if device is None or work is None:
        return None
    if not program_host_copies:  # shapes' figures replace the program's own host traffic
        work = dataclasses.replace(work, to_host_bytes=0, from_host_bytes=0, host_compute_bytes=0)
    sharded = parallel is not None and parallel.sharded
    data, tp, cp = (parallel.data, parallel.tp, parallel.cp) if sharded else (1, 1, 1)
    dp_bytes, tp_bytes = collective_transfers(work, data=data, tp=tp)
    cp_bytes = min(context_bytes, dp_bytes) if cp > 1 else 0  # among the non-neighbours'
    dp_bytes -= cp_bytes
    est = estimate(
        work,
        device,
        # one device's share: its rows' model FLOPs over the tensor and context devices
        model_flops=analytic.mfu_flops(cfg, batch // data, seq_len, adapters) // (tp * cp),
        transfers=Transfers(
            state=state_link_bytes,
            data_parallel=dp_bytes,
            tensor_parallel=tp_bytes,
            context_parallel=cp_bytes,
            host_update=host_update_bytes,
        ),
        compute_dtype=precision.compute_dtype,
        source=f"{work.source}, priced at {target.description}'s rates",
    )
    return {**est.as_dict(), "line": est.line()}

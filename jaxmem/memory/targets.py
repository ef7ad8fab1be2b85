"""Compile targets for memory plans (pure: no JAX).

``cpu`` is the local backend (XLA:CPU; the default). The GPU targets are XLA ``GpuTargetConfig``
text protos shipped in ``jaxmem/memory/target_configs/``: with JAX's CUDA plugin installed
(``jaxmem[gpu-plan]``) XLA compiles the real GPU program for them on a machine without a GPU
(``jaxmem.memory.gpu_plan``). A target can also be a ``.txtpb`` file captured on a real GPU
(``jaxmem capture-target``), for GPUs not shipped here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from importlib import resources
from typing import Any

from jaxmem.config import ConfigError

# name -> (file in jaxmem/memory/target_configs/, what it is)
SHIPPED: dict[str, tuple[str, str]] = {
    "h100": ("h100_sxm.txtpb", "NVIDIA H100 SXM5 80 GB"),
    "a100-40gb": ("a100_sxm_40.txtpb", "NVIDIA A100 SXM4 40 GB"),
    "a100-80gb": ("a100_sxm_80.txtpb", "NVIDIA A100 SXM4 80 GB"),
    "v100-32gb": ("v100_sxm_32.txtpb", "NVIDIA Tesla V100 SXM2 32 GB"),
    "a10-24gb": ("a10_24.txtpb", "NVIDIA A10 24 GB"),
    "l40s-48gb": ("l40s_48.txtpb", "NVIDIA L40S 48 GB"),
    "rtx4090-24gb": ("rtx4090_24.txtpb", "NVIDIA GeForce RTX 4090 24 GB"),
}
TARGET_NAMES = ("cpu", *SHIPPED)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a plan is compiled for. ``config_text`` is the ``GpuTargetConfig`` proto (None for
    the local backend); ``device_memory_bytes`` what the device has (None: the local backend's
    memory is not a fixed budget)."""

    name: str
    platform: str  # "cpu" (the local backend, whatever it is) or "cuda"
    description: str
    device_memory_bytes: int | None = None
    config_text: str | None = None
    source: str = ""  # the file it came from
    multiprocessors: int | None = None  # gpu_device_info.core_count (streaming multiprocessors)
    memory_bandwidth: int | None = None  # gpu_device_info.memory_bandwidth, bytes/s (datasheet)

    @property
    def is_gpu(self) -> bool:
        return self.platform == "cuda"

    def compiler(self) -> str:
        """Which compiler and target produced a plan, for every record's ``*_source``."""
        if not self.is_gpu:
            return "XLA for the local backend"
        return f"XLA:CUDA deviceless compile for {self.description} (target {self.name})"


LOCAL = Target(name="cpu", platform="cpu", description="the local backend")

_FIELD = {
    "device_memory_size": re.compile(r"\bdevice_memory_size\s*:\s*([^\s{}#]+)"),
    "platform_name": re.compile(r'\bplatform_name\s*:\s*"([^"]*)"'),
    "device_description_str": re.compile(r'\bdevice_description_str\s*:\s*"([^"]*)"'),
}

# read where present: the step-time estimate's multiprocessor count and HBM bandwidth
_OPTIONAL = {
    "core_count": re.compile(r"\bcore_count\s*:\s*(\d+)"),
    "memory_bandwidth": re.compile(r"\bmemory_bandwidth\s*:\s*(\d+)"),
}


def parse_target(name: str, text: str, source: str) -> Target:
    """The fields jaxmem reads from a target-config text (XLA parses the whole of it when it
    compiles); a text without them is refused, naming the file and the missing field."""
    found = {k: p.search(text) for k, p in _FIELD.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise ConfigError(
            f"target file {source} has no {missing[0]}: give a GpuTargetConfig text proto "
            "(capture one on the GPU with `jaxmem capture-target --out FILE`)"
        )
    if found["platform_name"].group(1).upper() != "CUDA":
        raise ConfigError(
            f"target file {source} is for platform {found['platform_name'].group(1)!r}; "
            "jaxmem plans CUDA targets only"
        )
    memory = found["device_memory_size"].group(1)
    if not memory.isdigit() or int(memory) == 0:
        raise ConfigError(
            f"target file {source}: device_memory_size {memory} is not a size: give the GPU's "
            "memory in bytes (e.g. 84942979072 for an H100 80 GB)"
        )
    optional = {k: p.search(text) for k, p in _OPTIONAL.items()}
    return Target(
        name=name,
        platform="cuda",
        description=found["device_description_str"].group(1),
        device_memory_bytes=int(memory),
        config_text=text,
        source=source,
        multiprocessors=int(optional["core_count"].group(1)) if optional["core_count"] else None,
        memory_bandwidth=int(optional["memory_bandwidth"].group(1))
        if optional["memory_bandwidth"]
        else None,
    )


def get_target(name: str) -> Target:
    """``cpu``, a shipped GPU target by name, or a path to a ``.txtpb`` target file."""
    if name == "cpu":
        return LOCAL
    if name in SHIPPED:
        file = resources.files("jaxmem.memory") / "target_configs" / SHIPPED[name][0]
        return parse_target(
            name, file.read_text(), f"jaxmem/memory/target_configs/{SHIPPED[name][0]}"
        )
    if name.endswith((".txtpb", ".pbtxt", ".textproto")) or os.sep in name:
        if not os.path.isfile(name):
            raise ConfigError(f"--target {name}: no such file")
        with open(name) as f:
            text = f.read()
        return parse_target(os.path.splitext(os.path.basename(name))[0], text, name)
    raise ConfigError(
        f"unknown target {name!r}; valid: {', '.join(TARGET_NAMES)}, or a .txtpb file captured "
        "with `jaxmem capture-target`"
    )


# ------------------------------------------------------------------- the targets' rates
@dataclasses.dataclass(frozen=True)
class Rates:
    """A target's nominal speeds (datasheet figures, dense): the cost model's denominators."""

    matmul_flops: dict[str, float]  # per second, by compute dtype
    host_link: float  # bytes/s each way, device <-> host
    interconnect: float  # bytes/s per device, device <-> device
    source: str
    # bytes/s of host memory an optimizer update in host memory reads and writes: an assumption,
    # not a datasheet figure (HOST_MEMORY_RULE)
    host_memory: float = 0.0
    host_source: str = ""


# The host update's rate is assumed, from the reference server's DRAM: a third of its theoretical
# bandwidth (channels x transfer rate x 8 bytes). An update streams its arrays once (AdamW reads
# parameters, gradient and two moments, writes three), so it is bandwidth-bound, and it shares
# the host with the link's DMA and the input pipeline; the third is a round figure, not measured.
HOST_MEMORY_RULE = "a third of the reference host's theoretical DRAM bandwidth (an assumption)"


def _host(gb_per_s: float, host: str) -> dict[str, Any]:
    return {
        "host_memory": gb_per_s / 3 * 1e9,
        "host_source": f"{host}: {gb_per_s:.1f} GB/s theoretical; {HOST_MEMORY_RULE}",
    }


RATES: dict[str, Rates] = {
    "h100": Rates(
        {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12},
        64e9,
        450e9,
        "H100 SXM5 datasheet: 989 TFLOP/s bf16/fp16 dense, fp32 matmuls as TF32 (XLA's default "
        "precision on GPU) 494.5; PCIe Gen5 x16 64 GB/s; NVLink 4 450 GB/s each way",
        **_host(614.4, "DGX H100 host, 2 sockets x 8 channels DDR5-4800"),
    ),
    "a100-40gb": Rates(
        {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
        32e9,
        300e9,
        "A100 SXM4 datasheet: 312 TFLOP/s bf16/fp16 dense, TF32 156; PCIe Gen4 x16 32 GB/s; "
        "NVLink 3 300 GB/s each way",
        **_host(409.6, "DGX A100 host, 2 sockets x 8 channels DDR4-3200"),
    ),
}
RATES["a100-80gb"] = RATES["a100-40gb"]
RATES["v100-32gb"] = Rates(
    {"bfloat16": 15.7e12, "float16": 125e12, "float32": 15.7e12},
    16e9,
    150e9,
    "V100 SXM2 datasheet: 125 TFLOP/s fp16 tensor cores, 15.7 fp32; no bf16 tensor cores "
    "(bf16 matmuls counted at the fp32 rate); PCIe Gen3 x16 16 GB/s; NVLink 2 150 GB/s each way",
    **_host(153.6, "DGX-1 V100 host, 2 sockets x 4 channels DDR4-2400"),
)


def _pcie_card(bf16: float, tf32: float, sheet: str, host_gb_per_s: float, host: str) -> Rates:
    """A one-card PCIe Gen4 x16 GPU without NVLink (32 GB/s each way; collectives over PCIe):
    ``bf16`` the dense bf16/fp16 rate, ``tf32`` the fp32 matmuls' (as TF32, XLA's default)."""
    return Rates(
        {"bfloat16": bf16, "float16": bf16, "float32": tf32},
        32e9,
        32e9,
        f"{sheet}: {bf16 / 1e12:g} TFLOP/s bf16/fp16 dense, TF32 {tf32 / 1e12:g}; PCIe Gen4 x16 "
        "32 GB/s, no NVLink (collectives over PCIe)",
        **_host(host_gb_per_s, host),
    )


RATES["a10-24gb"] = _pcie_card(
    125e12, 62.5e12, "A10 datasheet", 204.8, "a one-socket server, 8 channels DDR4-3200"
)
RATES["l40s-48gb"] = _pcie_card(
    362.05e12, 183e12, "L40S datasheet", 307.2, "a one-socket server, 8 channels DDR5-4800"
)
# GeForce tensor cores run bf16/fp16 with fp32 accumulation (XLA's) at half their fp16-accumulate
# rate (330.3)
RATES["rtx4090-24gb"] = _pcie_card(
    165.2e12,
    82.6e12,
    "Ada GPU architecture whitepaper, RTX 4090 (fp32 accumulation)",
    89.6,
    "a desktop, 2 channels DDR5-5600",
)
# The local backend: nominal rates (the estimate then ranks by FLOPs, host and collective bytes
# weighed as on an H100's links); its plans have no host offload to weigh.
NOMINAL = Rates(
    {"bfloat16": 1e12, "float16": 1e12, "float32": 1e12},
    64e9,
    450e9,
    "nominal (the local backend has no datasheet: FLOPs at 1 TFLOP/s)",
    **_host(192.0, "nominal: the local backend plans no host update"),
)


# a captured target's GPU by its description (H200: an H100's compute; its own HBM bandwidth
# comes from its target config)
_BY_DESCRIPTION = (("H100", "h100"), ("H200", "h100"), ("A100", "a100-80gb"),
                   ("V100", "v100-32gb"), ("A10", "a10-24gb"), ("L40S", "l40s-48gb"),
                   ("RTX 4090", "rtx4090-24gb"))  # fmt: skip


def rates_for(target: Target) -> Rates:
    """The target's rates: a shipped target's, a captured one's by the GPU its description
    names, the H100's for any other GPU, nominal ones for the local backend."""
    if target.name in RATES:
        return RATES[target.name]
    if not target.is_gpu:
        return NOMINAL
    for word, name in _BY_DESCRIPTION:
        if word in target.description:
            return RATES[name]
    return RATES["h100"]

"""Compile a jitted program for a GPU target on a machine without a GPU (a deviceless compile).

JAX's CUDA plugin (``jaxmem[gpu-plan]``) describes a GPU from a ``GpuTargetConfig`` text
(``jaxmem.memory.targets``); ``jax.experimental.topologies`` turns it into a one-device mesh, and a
program lowered with ``jax.ShapeDtypeStruct`` arguments placed on that mesh compiles with the real
XLA:CUDA pipeline (fusion, scheduling, buffer assignment, host offload) into a plan whose
``memory_analysis()`` is the GPU's. This is the path of JAX's own
``tests/aot_test.py::test_deviceless_aot_compile``.

What such a plan cannot show, and jaxmem says so where it matters:
- memory kinds on the jitted function's *arguments* (optimizer state or parameters kept in
  ``pinned_host``) are dropped in a deviceless compile: count those analytically;
- a deviceless compile never fails for lack of memory (fitting is jaxmem's check, against the
  target's ``device_memory_bytes``), and runs no autotuning, so GEMM workspaces may differ slightly
  from a compile on the GPU itself.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxmem.backend import cuda_plugin_installed, quiet_native_stderr
from jaxmem.config import ConfigError
from jaxmem.memory.targets import Target

GPU_PLAN_EXTRA = "pip install 'jaxmem[gpu-plan]'"


def require_gpu_plan(target: Target) -> None:
    """A one-line error naming the extra when the plugin or ptxas is missing."""
    import importlib.util

    if not cuda_plugin_installed():
        raise ConfigError(
            f"--target {target.name} compiles for a GPU without one and needs JAX's CUDA plugin, "
            f"which is not installed: {GPU_PLAN_EXTRA}"
        )
    from jaxmem.backend import nvidia_driver_present

    try:
        nvcc = importlib.util.find_spec("nvidia.cuda_nvcc") is not None
    except (ImportError, ValueError):
        nvcc = False
    # on a GPU machine the CUDA backend's own toolkit compiles (a GPU image's CUDA 13 plugin
    # brings no nvidia-cuda-nvcc-cu12)
    if not nvcc and not nvidia_driver_present():
        raise ConfigError(
            f"--target {target.name} needs ptxas and libdevice (nvidia-cuda-nvcc-cu12), which "
            f"are not installed: {GPU_PLAN_EXTRA}"
        )
    _parsed(target)


def _parsed(target: Target) -> None:
    """XLA reads the target file (cheap, once per file and process): a file this jaxlib's
    ``GpuTargetConfigProto`` does not parse is refused in one line, before any trace or compile,
    with the line and field XLA names (``_parse_error``)."""
    assert target.config_text is not None, target
    try:
        _sharding(target.config_text)
    except jax.errors.JaxRuntimeError as e:
        if "GpuTargetConfigProto" not in str(e):
            raise
        from importlib.metadata import version

        raise ConfigError(
            f"--target {target.source or target.name}: the installed jaxlib {version('jaxlib')} "
            f"cannot read it, {_parse_error(target.config_text)} (a newer XLA's?): remove that "
            "line, or capture the target again with this jaxlib"
        ) from None


_PARSE_ERROR = re.compile(r"GpuTargetConfigProto: (\d+):\d+: (.*?)\.?$", re.MULTILINE)


def _parse_error(config_text: str) -> str:
    """What XLA's text-format parser says of ``config_text`` ("line 29: Message type ... has no
    field named ..."). Its parser logs that line at ERROR level, which the CLI keeps off the
    terminal (``backend.quiet_xla_warnings``): a child process parses the file again with
    logging on and the line is read from its stderr."""
    import os
    import subprocess
    import sys

    child = (
        "import sys\n"
        "from jaxmem.backend import contain_cuda_plugin\n"
        "contain_cuda_plugin()\n"
        "from jax.experimental import topologies\n"
        "topologies.get_topology_desc(platform='cuda', target_config=sys.stdin.read(), "
        "topology='1x1x1')\n"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0", "JAX_PLATFORMS": "cpu"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", child],
            input=config_text,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "XLA failed to parse its GpuTargetConfigProto"
    found = _PARSE_ERROR.search(proc.stderr)
    if found is None:
        return "XLA failed to parse its GpuTargetConfigProto"
    said = re.sub(r'Message type "(?:\w+\.)*(\w+)"', r"\1", found.group(2))
    return f"line {found.group(1)}: {said}"


@functools.cache
def _sharding(config_text: str) -> NamedSharding:
    from jax.experimental import topologies

    try:
        with quiet_native_stderr():
            topo = topologies.get_topology_desc(
                platform="cuda", target_config=config_text, topology="1x1x1"
            )
    except NotImplementedError:
        # the plugin failed its CUDA check when JAX started (no driver) and never registered
        raise ConfigError(
            "JAX's CUDA plugin did not start (no NVIDIA driver) because JAX started its backend "
            "without JAX_PLATFORMS=cpu: import jaxmem.memory.tools before JAX starts one (it "
            "sets that up), or set JAX_PLATFORMS=cpu before importing JAX"
        ) from None
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    return NamedSharding(mesh, PartitionSpec())


@functools.cache
def _devices(config_text: str, n: int) -> tuple[Any, ...]:
    from jax.experimental import topologies

    with quiet_native_stderr():
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=config_text, topology=f"1x1x{n}"
        )
    return tuple(topo.devices)


def target_devices(target: Target, n: int) -> list[Any]:
    """``n`` devices of the target (one host of ``n`` GPUs, as an 8-GPU node), to build a mesh
    for a sharded plan; nothing needs to exist."""
    assert target.is_gpu and target.config_text is not None, target
    require_gpu_plan(target)
    _sharding(target.config_text)  # the same check that the plugin started, with its message
    return list(_devices(target.config_text, n))


def compile_placed(jitted: Any, args: tuple) -> Any:
    """``jitted`` compiled from ``args`` already placed on a target's devices (shape structs
    with shardings, e.g. over ``target_devices``)."""
    return compile_lowered(lower_placed(jitted, args))


def lower_placed(jitted: Any, args: tuple) -> Any:
    """``jitted`` lowered from ``args`` placed on a target's devices (``compile_lowered``
    compiles it)."""
    with quiet_native_stderr():
        return jitted.lower(*args)


def compile_lowered(lowered: Any) -> Any:
    """A program lowered for a target's devices, compiled deviceless."""
    import warnings

    with warnings.catch_warnings(), quiet_native_stderr():
        # with JAX's persistent compilation cache on, a deviceless executable is written to it
        # but cannot be read back ("PjRtCompiler must be constructed with a Client"): JAX warns
        # and compiles again, which is what a plan needs anyway
        warnings.filterwarnings("ignore", "Error reading persistent compilation cache entry")
        return lowered.compile()


def plan_key(target: Target, devices: int = 1) -> str:
    """What a deviceless plan is compiled for, for ``residuals.plan_of_lowered``: the target's
    configuration and the device count."""
    import hashlib

    assert target.config_text is not None, target
    digest = hashlib.sha256(target.config_text.encode()).hexdigest()[:16]
    return f"{target.name}:{digest}:{devices}"


def target_sharding(target: Target) -> NamedSharding:
    """A replicated sharding over the target's one device (slices x hosts x devices = 1x1x1)."""
    assert target.is_gpu and target.config_text is not None, target
    require_gpu_plan(target)
    return _sharding(target.config_text)


def on_target(tree: Any, target: Target) -> Any:
    """``tree``'s leaves (arrays or shape structs) as shape structs on the target's device."""
    sharding = target_sharding(target)

    def place(x):
        if x is None:
            return None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map(place, tree)


def compile_for(jitted: Any, args: tuple, target: Target) -> Any:
    """``jitted`` compiled for ``target`` from ``args`` (arrays or shape structs)."""
    return compile_lowered(lower_placed(jitted, on_target(args, target)))


def capture_target_config() -> str:
    """The exact target config of this machine's first GPU (run where CUDA works): the text
    ``--target FILE`` takes, for GPUs jaxmem does not ship."""
    from jax._src.lib import xla_client  # the only public route to it (see the README)

    devices = [d for d in jax.devices() if d.platform == "gpu"]
    if not devices:
        raise ConfigError(
            "capture-target needs a CUDA GPU visible to JAX (jax.devices() has none here); run it "
            "on the GPU machine with 'jaxmem[cuda]' installed"
        )
    config = xla_client.get_topology_for_devices(devices[:1]).target_config
    # not verified on a GPU by this project's CI (it has none): text expected, as the plugin's
    # topology API takes; anything else is refused rather than written as a broken file
    if not isinstance(config, str):
        raise ConfigError(
            f"this jaxlib returns the target config as {type(config).__name__}, not text; "
            "capture-target cannot write it"
        )
    return config

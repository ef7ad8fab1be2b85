"""What moved between the JAX versions jaxmem supports, in one place (imports no JAX).

jaxmem supports jax/jaxlib 0.10.2 through 0.12.x, flax 0.12.8 through 0.12.x and torch 2.11
through 2.14 (``pyproject.toml``; ``constraints*.txt`` are the exact sets the suite runs on).
Everything that differs between those versions is read through this module, so the rest of the
code is written once:

- **A scan equation's operand counts** (``scan_operand_counts``). Up to jax 0.10 a ``scan``
  equation's parameters name them (``num_consts``, ``num_carry``) and its body is a
  ``ClosedJaxpr``. From jax 0.11 they are a flat tree of the operands, ``ft_in`` = (consts,
  carry, xs), beside ``ft_out`` = (carry, ys), and the body an open ``Jaxpr``. jaxmem reads
  jaxprs to find which residuals a policy saves (``jaxmem.memory.residuals``): this is the only
  primitive parameter it reads whose spelling changed.

- **What a scan keeps for its backward.** Up to jax 0.10 a scanned function whose backward
  reads one forward value twice (an activation that both the next matmul's backward and its own
  derivative need) keeps it twice, as two stacked residuals; from 0.11 once
  (``SCAN_KEEPS_SHARED_RESIDUAL_ONCE``). Residual accounting reports what each version keeps.
- **A computation on the host** (``compute_on("device_host")``): up to jax 0.10 a decorator
  taking the compute type; from 0.11 it also takes the outputs' memory spaces. The spelling
  needs JAX, so it lives beside its one user (``jaxmem.step.stream.host_computation``), keyed on
  ``JAX`` here: this module imports no framework, for ``torch_ref`` reads it too.
- **Deviceless XLA:CUDA compiles** pick their PTX compiler differently
  (``deviceless_toolchain``), and JAX's CUDA plugin is one of two modules (``CUDA_PLUGINS``).
- **Two JAX-internal names** a quiet library start reads (``jax_backends_started``,
  ``jax_plugin_loader``: ``jax._src.xla_bridge``'s ``_backends`` and
  ``_discover_and_register_pjrt_plugins``), not JAX's API: where a version moves them, each
  says "unknown" and jaxmem starts as before, only not as quietly; importing jaxmem never fails.

When a new version moves something else, add it here with the versions that need each spelling,
and test it under every exact set (``make test-versions``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from typing import Any


def version(package: str) -> tuple[int, ...]:
    """An installed package's release as integers (``(0, 12, 0, 1)``), without importing it;
    ``()`` when it is not installed."""
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ()
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


JAX = version("jax")
SCAN_KEEPS_SHARED_RESIDUAL_ONCE = JAX >= (0, 11)


def scan_operand_counts(eqn: Any) -> tuple[int, int]:
    """(constants, carries) among a ``scan`` equation's operands: its operands are the
    constants, then the carries, then the scanned inputs; its outputs the carries, then the
    stacked outputs."""
    params = eqn.params
    if "num_carry" in params:  # jax <= 0.10
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()  # jax >= 0.11: a flat tree of the operands
    return len(consts), len(carry)


# ------------------------------------------------------------------ deviceless GPU compiles
# JAX's CUDA plugin, by the CUDA it is built for: jax-cuda12-plugin (jaxmem's gpu-plan extra and
# every jax since 0.4) and jax-cuda13-plugin (jax >= 0.8; what GPU images with CUDA 13 ship)
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
NVJITLINK_OFF = "--xla_gpu_enable_libnvjitlink=false"


def deviceless_toolchain(environ: dict[str, str], ptxas_dir: str | None) -> dict[str, str]:
    """The environment changes a deviceless XLA:CUDA compile on a machine without an NVIDIA
    driver needs before JAX starts (``{}``: none), given ``ptxas_dir``, the ``bin`` folder of
    ``nvidia-cuda-nvcc-cu12`` (the gpu-plan extra), if installed (it comes first on ``PATH``,
    its ``nvcc`` too, for this process and its children).

    jax-cuda12-plugin 0.10 finds that package's ptxas first. From 0.11 it links PTX with
    libnvjitlink whenever one loads, and otherwise takes the first ptxas on ``PATH``: on a
    machine with PyTorch's CUDA 13 wheels (which install ``nvidia-nvjitlink`` 13) or a CUDA 13
    toolkit, that is CUDA 13's, which has no compute capability 7.0, and a plan for a V100
    fails ("unsupported architecture (compute_70)") or crashes XLA. So jaxmem's deviceless
    compiles use the CUDA 12 ptxas of the gpu-plan extra ahead of ``PATH``, with nvJitLink
    off (every version since 0.10.2 has the flag; a user's own ``XLA_FLAGS`` entry for it is
    kept). The compiled plan does not depend on which of the two turns PTX into machine code.
    """
    changes: dict[str, str] = {}
    flags = environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_libnvjitlink" not in flags:
        changes["XLA_FLAGS"] = f"{flags} {NVJITLINK_OFF}".strip()
    path = environ.get("PATH") or os.defpath
    if ptxas_dir and path.split(os.pathsep)[:1] != [ptxas_dir]:
        changes["PATH"] = f"{ptxas_dir}{os.pathsep}{path}"
    return changes


# ------------------------------------------------------------------- JAX's backend internals
def _xla_bridge() -> Any | None:
    """``jax._src.xla_bridge`` (imports JAX), or None where this JAX has moved it."""
    try:
        return importlib.import_module("jax._src.xla_bridge")
    except (ImportError, AttributeError):
        return None


def jax_backends_started() -> bool | None:
    """Whether JAX has started a backend (its platforms are then chosen); None: unknown."""
    bridge = _xla_bridge()
    if bridge is None or not hasattr(bridge, "_backends"):
        return None
    return bool(bridge._backends)


def jax_plugin_loader() -> Any | None:
    """JAX's function that loads its PJRT plugins (the CUDA plugin's start-up check runs in it)
    without starting a backend; None where this JAX has none by that name."""
    return getattr(_xla_bridge(), "_discover_and_register_pjrt_plugins", None)

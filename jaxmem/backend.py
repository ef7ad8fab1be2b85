"""Keeping JAX's CUDA plugin in its place on machines without a GPU (imports no JAX).

``jaxmem[gpu-plan]`` installs JAX's CUDA plugin so that XLA can compile for a GPU target on a
CPU-only machine. Installed, the plugin joins every JAX process: without an NVIDIA driver its
start-up check prints a traceback before JAX falls back to the CPU, and loading its library
prints absl lines ("Could not find cuda drivers on your machine") straight to file descriptor 2.
``contain_cuda_plugin`` (called before JAX starts) asks for the CPU backend in that case, and
``quiet_native_stderr`` drops those known lines from a block that loads the plugin, passing every
other byte through. ``quiet_library_start`` does both for a program that imports jaxmem's tools.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator

from jaxmem import compat
from jaxmem.compat import CUDA_PLUGINS, deviceless_toolchain

# lines the plugin's native code prints on a machine without a driver: information, not errors
_NOISE = (
    "Could not find cuda drivers on your machine",
    "All log messages before absl::InitializeLog() is called are written to STDERR",
)


def quiet_xla_warnings() -> None:
    """Before JAX loads: keep XLA's own log lines off the terminal: INFO, WARNING and ERROR
    (e.g. the rematerialization pass's "Can't reduce memory use below ..." and the GPU
    scheduler's "byte size of input/output arguments exceeds the base limit" for a plan over
    the target's memory, which the command reports itself as "fits: no"); FATAL lines still
    show, and a failed compile still ends the command with its error. ``TF_CPP_MIN_LOG_LEVEL``
    unset or 1 (the level importing JAX sets, so a process started by one that imported JAX
    has it) becomes 3; a user's 0 (everything) or 2 is kept."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") in ("", "1"):
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"


def cuda_plugin_installed() -> bool:
    """JAX's CUDA plugin, for CUDA 12 (``jax-cuda12-plugin``: the gpu-plan extra) or 13 (as
    GPU images ship it: ``jax_plugins.xla_cuda13``)."""
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _gpu_plan_ptxas_dir() -> str | None:
    """The ``bin`` folder of ``nvidia-cuda-nvcc-cu12`` (the gpu-plan extra's ptxas), if
    installed."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(root, "bin", "ptxas")):
            return os.path.join(root, "bin")
    return None


def nvidia_driver_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/version")


def contain_cuda_plugin() -> None:
    """Before JAX starts: with the plugin installed and no driver, import JAX with the plugin's
    start-up lines dropped (``import jax`` itself loads the plugin's native modules) and, unless
    the user chose ``JAX_PLATFORMS``, run on the CPU (what JAX falls back to anyway) without the
    plugin's traceback, and with the gpu-plan extra's CUDA 12 ptxas for deviceless compiles
    (``jaxmem.compat.deviceless_toolchain``). Without the plugin, or with a driver, nothing
    happens (JAX stays unloaded until a command needs it)."""
    if not cuda_plugin_installed() or nvidia_driver_present():
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.update(deviceless_toolchain(dict(os.environ), _gpu_plan_ptxas_dir()))
    with quiet_native_stderr():
        # the backend is not started here: `jaxmem bench --threads` must set the CPU affinity
        # before XLA:CPU sizes its pool; the CLI starts it quietly in need_jax_backend
        import jax  # noqa: F401


def quiet_library_start() -> None:
    """For jaxmem as a library (``jaxmem.memory.tools`` calls this as it is imported): with the
    plugin installed and no driver, JAX runs on the CPU and the program prints none of the
    plugin's lines or its traceback, as the CLI's runs do. It works where the program imported
    JAX first too, as long as no backend has started (after that the platforms are chosen), and
    it keeps a platform the program chose. JAX's plugins are loaded here, inside the filter, so
    the program's first array prints nothing either; no backend is started. Without the plugin,
    or with a driver, nothing happens. Two names it reads are JAX's own, not its API, read
    through ``jaxmem.compat`` (``jax_backends_started``, ``jax_plugin_loader``): where a
    version lacks them, the program runs as before, only not as quietly."""
    if not cuda_plugin_installed() or nvidia_driver_present():
        return
    jax = sys.modules.get("jax")
    if jax is not None:  # imported before jaxmem: JAX_PLATFORMS is read already
        if compat.jax_backends_started() is not False:  # started, or not known: leave it
            return
        if not getattr(jax.config, "jax_platforms", None):
            jax.config.update("jax_platforms", "cpu")
    contain_cuda_plugin()
    register = compat.jax_plugin_loader()
    if register is not None:  # the plugin's start-up check and lines happen here, filtered
        with quiet_native_stderr():
            register()


# The filter: reads the block's stderr to its end, drops the noise, writes the rest to the
# terminal's stderr unless the block's last bytes are the drop trailer. A block that native code
# ended (XLA exits on an unknown XLA_FLAGS entry) writes no trailer: its lines still come out.
_TRAILER = b"\0jaxmem-quiet-stderr:"
_FILTER = f"""
import os, sys
data = sys.stdin.buffer.read()
body, sep, verdict = data.rpartition({_TRAILER!r})
if not sep:
    body, verdict = data, b"keep"
if verdict != b"drop":
    noise = [n.encode() for n in sys.argv[1:]]
    kept = [line for line in body.splitlines(True) if not any(n in line for n in noise)]
    os.write(2, b"".join(kept))
"""


@contextlib.contextmanager
def quiet_native_stderr(*, drop_on_error: bool = False) -> Iterator[None]:
    """Run a block with file descriptor 2 sent through a filter process that writes back every
    line but the plugin's known start-up noise (none at all when the block raises and
    ``drop_on_error``: the caller reports the error in its own words). Written by hand: the
    lines come from C++ before absl logging is set up, so neither Python logging nor absl flags
    reach them. A process, not a temporary file: native code that ends this process inside the
    block (XLA on a flag it does not know) would take a temporary file's lines with it."""
    if not cuda_plugin_installed():
        yield
        return
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    # -S: the standard library only, no site packages: starts in milliseconds
    filt = subprocess.Popen([sys.executable, "-S", "-c", _FILTER, *_NOISE], stdin=read_end)
    os.close(read_end)
    saved = os.dup(2)
    os.dup2(write_end, 2)
    os.close(write_end)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        sys.stderr.flush()
        os.write(2, _TRAILER + (b"drop" if failed and drop_on_error else b"keep"))
        os.dup2(saved, 2)  # closes the pipe's last write end: the filter reads to its end
        os.close(saved)
        filt.wait()

"""Host memory a training step needs, and the limit it must fit (``--host-memory``).

A step keeps bytes in host memory for three reasons: activations its policy offloads
(``BlockPolicy.offload``: the block inputs under ``full-host``, the segments' under
``nested-host``, the projections under ``offload``), optimizer state kept there
(``--state-memory pinned_host``), and a streamed stack's parameters and state (``--stream``).
This module counts them from shapes (analytic, before any compile) and refuses, in one line, a
step whose count exceeds the limit; ``jaxmem plan`` skips such candidates, ``jaxmem memory`` and
``jaxmem train`` refuse them. The compiled plan's ``host_temp_bytes`` is the figure after a
compile (offloaded activations; a deviceless compile drops argument memory kinds, so
host-resident state is counted from shapes either way).

The limit is one host's memory, shared by the mesh's devices on that host: a step's bytes per
device count ``host_share`` times (every device of the mesh, up to ``HOST_DEVICES``: an 8-GPU
node; a larger mesh spans hosts of that size). The default limit is this machine's RAM, read
from the OS (``os.sysconf``): for a GPU target that is the machine planning it, not the GPU's
host, so the message names which was used.
Written by hand: no library counts a JAX step's host-resident bytes.
"""

from __future__ import annotations

import os
from typing import Any

from jaxmem.config import ConfigError, ModelConfig
from jaxmem.memory import analytic
from jaxmem.policy import POLICIES, MemoryPolicy
from jaxmem.precision import Precision
from jaxmem.step.spec import StepSpec

GIB = 2**30
# ``full`` with each block's input kept in host memory instead of on the device (the leanest
# stack where host memory exists: nothing of the stack's activations stays on the device)
OFFLOADED_INPUTS = POLICIES["full-host"]


# devices of one host (an HGX/DGX node of 8 GPUs): the devices of a mesh up to this many share
# one host's memory
HOST_DEVICES = 8


def host_share(devices: int) -> int:
    """How many devices of a ``devices``-device mesh share one host's memory (each holding its
    own host bytes there)."""
    return max(1, min(devices, HOST_DEVICES))


def spec_host_share(spec: StepSpec) -> int:
    """``host_share`` of ``spec``'s mesh (1: one device)."""
    return host_share(spec.parallel.devices if spec.sharded else 1)


def machine_bytes() -> int:
    """This machine's physical memory, from the OS."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_limit(given: int | None) -> tuple[int, str]:
    """The host-memory limit (``--host-memory``'s bytes, else this machine's RAM) and where it
    came from, said with every figure checked against it."""
    if given is None:
        return machine_bytes(), "this machine's RAM (os.sysconf; --host-memory overrides)"
    return given, "--host-memory"


def offloaded_activation_bytes(
    cfg: ModelConfig, policy: MemoryPolicy, rows: int, seq_len: int, precision: Precision,
    tp: int = 1,
) -> int:  # fmt: skip
    """Bytes per device the policy keeps in host memory at the end of the forward (analytic,
    from shapes: ``analytic.saved_activation_bytes``' host bytes, the offloaded block or segment
    inputs included), ``rows`` x ``seq_len``, one tensor device's share."""
    return analytic.saved_activation_bytes(cfg, policy, rows, seq_len, precision).host_bytes // tp


def spec_host_bytes(spec: StepSpec) -> dict[str, int]:
    """Host bytes of ``spec``'s step by reason, per device (analytic, from shapes)."""
    rows = spec.batch // spec.accum.steps // (spec.parallel.data if spec.sharded else 1)
    tp = spec.parallel.tp if spec.sharded else 1
    local = spec.seq_len // spec.parallel.cp  # a context axis holds S / cp positions per device
    out = {
        "offloaded activations": offloaded_activation_bytes(
            spec.model, spec.policy, rows, local, spec.precision, tp
        )
    }
    state = analytic.model_state_bytes(
        spec.model, spec.optimizer, spec.precision, spec.parallel, spec.adapters
    )
    if spec.streamed:  # the stack's parameters and state live in host memory
        out["streamed parameters and optimizer state"] = state["params"] + state["opt_state"]
    elif spec.optimizer.state_memory == "pinned_host":
        out["optimizer state"] = state["opt_state"]
    return {k: v for k, v in out.items() if v}


def host_need(spec: StepSpec) -> int:
    """Bytes of one host ``spec``'s step needs: each device's (``spec_host_bytes``) times the
    devices sharing the host (``spec_host_share``); analytic, from shapes."""
    return spec_host_share(spec) * sum(spec_host_bytes(spec).values())


def size_text(n: int) -> str:
    """``n`` bytes in GiB, MiB or KiB, whichever shows it."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n / 2**10:,.2f} KiB"


def refusal(parts: dict[str, int], share: int, limit: int, source: str, how: str) -> str | None:
    """One line when ``share`` devices' host bytes (each ``parts``, ``how`` obtained) exceed
    one host's ``limit``."""
    need = share * sum(parts.values())
    if need <= limit:
        return None
    what = " + ".join(f"{k} {size_text(v)}" for k, v in parts.items()) or "none"
    if share > 1:
        what = f"{share} devices on the host, each {what}"
    return (
        f"the step needs {size_text(need)} of host memory ({how}: {what}) but "
        f"{size_text(limit)} is allowed ({source}): raise --host-memory if the host has "
        "it, or keep less in host memory (a shorter --seq-len, fewer offloaded tags, the "
        "optimizer state on the device)"
    )


def check_spec(spec: StepSpec, given: int | None) -> None:
    """Refuse ``spec`` (``ConfigError``, one line) when its analytic host bytes, times the
    devices sharing a host, exceed the limit; before anything compiles."""
    limit, source = host_limit(given)
    parts = spec_host_bytes(spec)
    line = refusal(parts, spec_host_share(spec), limit, source, "analytic, from shapes")
    if line is not None:
        raise ConfigError(line)


def check_job(job: Any, given: int | None, target: Any = None) -> None:
    """``check_spec`` for a job that keeps anything in host memory (its optimizer state, a
    streamed stack, offloaded tags); a job that keeps nothing there is not checked."""
    opt = job.optimizer
    if opt.state_memory == "pinned_host" or opt.stream or job.memory.offloads:
        check_spec(StepSpec.of_job(job, *([target] if target else [])), given)

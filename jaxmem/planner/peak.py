"""What is live at the peak of a compiled train step's memory plan, and what made it.

XLA's dump of the compiled step is read by ``jaxmem.memory.xla_dump`` (how and why: there). This
module compiles jaxmem's own train step (``plans.plan_step``) in a child process with
``--xla_dump_to`` set, so the dump is of the step the planner plans, with every flag the planner
sets; ``jaxmem.memory.tools.peak`` does the same for a user's own function, in process.

``python -m jaxmem.planner.peak SPEC.json`` is the child (``jaxmem peak`` the command).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from jaxmem.memory.xla_dump import KIND_HELP, KINDS, LiveValue, PeakReport, parse_dump
from jaxmem.step.spec import StepSpec

__all__ = ["KINDS", "KIND_HELP", "LiveValue", "PeakReport", "explain_peak", "parse_dump"]
CHILD_TIMEOUT_S = 1800


# ------------------------------------------------------------------------ compiling, in a child
def explain_peak(spec: StepSpec) -> PeakReport:
    """Compile the train step ``plans.plan_step`` plans for ``spec`` (one device, or per device
    over its mesh) in a child process that dumps XLA's buffer assignment, and report what is
    live at its peak."""
    local = not spec.target.is_gpu
    with tempfile.TemporaryDirectory(prefix="jaxmem-peak-") as tmp:
        spec_file = os.path.join(tmp, "spec.json")
        with open(spec_file, "w") as f:
            json.dump(spec.to_dict(), f)
        dump = os.path.join(tmp, "xla")
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_module_re=jit_step"
        ).strip()
        # a step read from JAX's persistent compilation cache is not compiled, so not dumped
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        if local:
            env.setdefault("JAX_PLATFORMS", "cpu")
        done = subprocess.run(
            [sys.executable, "-m", "jaxmem.planner.peak", spec_file],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            if not tail:  # the child died without a word (the OOM killer's SIGKILL)
                code = done.returncode
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                flags = env["XLA_FLAGS"]
                tail = [f"the child ended with {how} and printed nothing (XLA_FLAGS {flags!r})"]
            raise RuntimeError("compiling the step failed:\n" + "\n".join(tail))
        result = json.loads(done.stdout.strip().splitlines()[-1])
        parsed = parse_dump(dump)
    report = PeakReport.of(result["compiler"], result["planned_peak_bytes"], parsed)
    return dataclasses.replace(report, step_time=result.get("step_time"))


def _child(argv: Sequence[str]) -> None:
    from jaxmem.backend import contain_cuda_plugin

    contain_cuda_plugin()
    from jaxmem.planner.plans import plan_step

    with open(argv[0]) as f:
        spec = StepSpec.from_dict(json.load(f))
    if spec.sharded and not spec.target.is_gpu:
        from jaxmem.sharding import ensure_cpu_devices

        ensure_cpu_devices(spec.parallel.devices)  # before JAX starts its CPU backend
    plan = plan_step(spec)
    keys = ("compiler", "planned_peak_bytes", "step_time")
    print(json.dumps({k: plan.get(k) for k in keys}))


if __name__ == "__main__":
    _child(sys.argv[1:])

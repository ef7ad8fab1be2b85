# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""On a machine with an NVIDIA GPU: the deviceless plan against the plan compiled on the GPU and
the peak measured while the step runs, per model and policy. Run it where CUDA works
(``pip install -e '.[cuda,gpu-plan]'``); it refuses to run elsewhere.

    python benchmarks/gpu_check.py --presets small,gpt2-124m --out benchmarks/results/gpu_check

For each (preset, policy): (1) the target config of this GPU is captured
(``jaxmem capture-target``'s route) and the train step compiled for it without touching the
device (``jax_record(target=...)``); (2) in a fresh process (the device's peak is a high-water
mark that never goes down within one) the same step is compiled on the GPU and run once
(``jax_record()``: the on-device plan and ``memory_stats()["peak_bytes_in_use"]``). Writes JSON
and Markdown with the ratios, each figure labelled with how it was obtained. Not run by CI (it has
no GPU); the GPU-only test in ``tests/test_gpu_plan.py`` checks the same on ``small``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

from jaxmem.backend import contain_cuda_plugin, quiet_native_stderr

contain_cuda_plugin()
import jax

from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.gpu_plan import capture_target_config
from jaxmem.memory.targets import get_target
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES
from jaxmem.precision import get_precision

GB = 1e9
ON_DEVICE = """
import json, sys
from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.planner.records import jax_record
from jaxmem.policy import POLICIES
from jaxmem.precision import get_precision
preset, policy, precision, batch, seq = sys.argv[1:6]
r = jax_record(get_preset(preset), POLICIES[policy], get_precision(precision), OptimizerConfig(),
               int(batch), int(seq))
keys = ("compiler", "compiled_plan", "planned_peak_bytes", "peak_bytes", "peak_source")
print(json.dumps({k: r[k] for k in keys}))
"""


def on_device(preset: str, policy: str, precision: str, batch: int, seq: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", ON_DEVICE, preset, policy, precision, str(batch), str(seq)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,gpt2-124m")
    parser.add_argument("--policies", default="none,full,selective,offload,nested")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/gpu_check")
    args = parser.parse_args()
    with quiet_native_stderr(drop_on_error=True):  # the plugin's notes on a driverless machine
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        sys.exit("gpu_check.py needs a CUDA GPU visible to JAX (jax.devices() has none here)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "this_gpu.txtpb")
        with open(path, "w") as f:
            f.write(capture_target_config())
        target = get_target(path)
        rows = []
        for preset in args.presets.split(","):
            cfg = get_preset(preset)
            seq = min(args.seq_len, cfg.max_seq_len)
            for policy in args.policies.split(","):
                plan = jax_record(
                    cfg,
                    POLICIES[policy],
                    get_precision(args.precision),
                    OptimizerConfig(),
                    args.batch_size,
                    seq,
                    target=target,
                )
                dev = on_device(preset, policy, args.precision, args.batch_size, seq)
                row = {
                    "preset": preset,
                    "policy": policy,
                    "batch": args.batch_size,
                    "seq_len": seq,
                    "deviceless_temp_bytes": plan["compiled_temp_bytes"],
                    "deviceless_planned_peak_bytes": plan["planned_peak_bytes"],
                    "deviceless_compiler": plan["compiler"],
                    **{f"device_{k}": v for k, v in dev.items()},
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "gpu": gpus[0].device_kind,
        "jax": jax.__version__,
        "precision": args.precision,
    }
    os.makedirs(args.out, exist_ok=True)
    write_json_atomic(os.path.join(args.out, "gpu_check.json"), {"meta": meta, "rows": rows})
    lines = [
        f"Deviceless plan vs the plan compiled on {meta['gpu']} vs the runtime peak "
        f"({meta['precision']}, AdamW; {meta['date']}, jax {meta['jax']}). Deviceless and "
        "on-device temp: `memory_analysis()` of each compiled plan; runtime peak: "
        "`memory_stats()['peak_bytes_in_use']` after one step, in a fresh process.",
        "",
        "| model | policy | deviceless temp GB | on-device temp GB | ratio | deviceless peak GB "
        "| runtime peak GB | runtime / planned |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "device_error" in r:
            lines.append(f"| {r['preset']} | {r['policy']} | failed: {r['device_error']} |")
            continue
        temp = r["device_compiled_plan"]["temp_bytes"]
        lines.append(
            f"| {r['preset']} | {r['policy']} | {r['deviceless_temp_bytes'] / GB:.2f} | "
            f"{temp / GB:.2f} | {r['deviceless_temp_bytes'] / temp:.3f} | "
            f"{r['deviceless_planned_peak_bytes'] / GB:.2f} | {r['device_peak_bytes'] / GB:.2f} "
            f"| {r['device_peak_bytes'] / r['deviceless_planned_peak_bytes']:.3f} |"
        )
    write_atomic(os.path.join(args.out, "gpu_check.md"), "\n".join(lines) + "\n")
    print(f"wrote {args.out}/gpu_check.json and .md")


if __name__ == "__main__":
    main()

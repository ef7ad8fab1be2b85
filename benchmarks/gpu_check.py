# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""One prepared check on a GPU: the deviceless plan against the plan compiled on the GPU and the
runtime peak, torch_ref's CUDA peak beside them, and measured step times against jaxmem's
estimates, for jaxmem and torch_ref (eager and torch.compile), in one command that fits a short
GPU slot.

    python benchmarks/gpu_check.py --quick --out DIR     # on one GPU
    python benchmarks/gpu_check.py --dry-run --out DIR   # the same code on the CPU, tiny sizes

On a GPU image that already has JAX (with its CUDA plugin), PyTorch and Flax, and no network:
``pip install --no-deps --no-build-isolation -e .``, then the command. Expected time of
``--quick`` on one H100 (an estimate, not yet measured: two gpt2-124m compiles per case at about
10 s each on a 16-core host, start-up 5 s, 23 steps; torch.compile about 60 s a model): about 6
minutes; ``--budget-s`` (default 420) is a hard limit: a part that would start past it is
skipped and said so, and each part's process is stopped at the budget.

Parts, in this order (results are written after each, so a stopped run leaves what it did):
1. the environment: GPU, driver, versions;
2. calibration: bf16 matmuls at the shapes the cases run, a device copy's bandwidth, a tiny
   kernel's time, beside what ``jaxmem.memory.step_time``'s model assumes for them;
3. the GPU-only tests (``pytest -m gpu tests/test_gpu_plan.py tests/test_context_parallel.py``:
   the captured target, torch_ref's CUDA ring kernels);
4. per case (model, policy, options), in a fresh process (a device's peak never goes down within
   one): the plan compiled without the device for this GPU's captured target, the plan compiled
   on it, the runtime peak (``memory_stats``), the median step time of 20 steps after 3 warm-up
   steps, and the estimated step time of each plan;
5. torch_ref per model, in one process (``torch.cuda.reset_peak_memory_stats`` between
   policies): each policy's CUDA peak and eager step time, and torch.compile's step time for
   the model without remat.

Writes at most four files into ``--out``: ``gpu_check.json`` (everything, with how each figure
was obtained), ``gpu_check.md``, ``gpu_check.png`` and ``gpu_tests.txt``. ``--dry-run`` runs
every part on the CPU at tiny sizes (the deviceless plans for the shipped H100 target, no
runtime peak, torch.compile with the ``aot_eager`` backend): it checks the code, not the GPU,
and is part of the test suite so the script cannot rot between GPU runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

# the benchmark's own processes and the tests it starts: JAX allocates as it goes (by default it
# takes 75 % of the GPU's memory at start, which would leave torch_ref's process little)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from jaxmem.backend import contain_cuda_plugin
from jaxmem.policy import LossPolicy

contain_cuda_plugin()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30
FILES = ("gpu_check.json", "gpu_check.md", "gpu_check.png", "gpu_tests.txt")


# ------------------------------------------------------------------------------- the cases
@dataclasses.dataclass(frozen=True)
class Case:
    """One jaxmem train step to plan, run and time (bf16 compute, fp32 master weights, AdamW)."""

    name: str
    preset: str
    policy: str
    batch: int
    seq_len: int
    n_layers: int | None = None  # depth reduced to fit the time (None: the preset's)
    fused: bool = False  # fused attention (cuDNN on an NVIDIA GPU)
    stream: bool = False  # optimizer.stream: the stack through host memory
    loss_chunks: int = 0

    def model(self) -> Any:
        from jaxmem.config import get_preset

        cfg = get_preset(self.preset)
        if self.n_layers is not None:
            cfg = cfg.replace(n_layers=self.n_layers)
        return cfg.replace(attention="fused") if self.fused else cfg

    def memory_policy(self) -> Any:
        from jaxmem.policy import POLICIES

        policy = POLICIES[self.policy]
        return policy.replace(loss=LossPolicy(self.loss_chunks)) if self.loss_chunks else policy

    def optimizer(self) -> Any:
        from jaxmem.config import OptimizerConfig

        return OptimizerConfig(stream=self.stream)


def _cases(gpt: str, llama: str, batch: int, seq: int, llama_batch: int, llama_seq: int,
           layers: int | None) -> list[Case]:  # fmt: skip
    g = dict(preset=gpt, batch=batch, seq_len=seq)
    return [
        Case(f"{gpt} none", policy="none", **g),
        Case(f"{gpt} selective", policy="selective", **g),
        Case(f"{gpt} full", policy="full", **g),
        Case(f"{gpt} offload", policy="offload", **g),
        Case(f"{gpt} full, streamed", policy="full", stream=True, **g),
        Case(f"{gpt} full, loss in 8 chunks", policy="full", loss_chunks=8, **g),
        Case(f"{gpt} none, fused attention", policy="none", fused=True, **g),
        Case(
            f"{llama}" + (f" ({layers} layers)" if layers else "") + " selective, fused attention",
            preset=llama,
            policy="selective",
            batch=llama_batch,
            seq_len=llama_seq,
            n_layers=layers,
            fused=True,
        ),
    ]


QUICK = _cases("gpt2-124m", "llama-3.2-1b", 8, 1024, 4, 2048, 4)
# the dry run: one case of each code path (an ordinary step, a streamed one, fused attention
# with torch_ref beside it), at tiny sizes
DRY = [c for c in _cases("tiny", "tiny-llama", 2, 32, 2, 32, None) if c.policy == "none"
       and not c.fused or c.stream or c.preset == "tiny-llama"]  # fmt: skip
# torch_ref per model: policies for peaks and eager times, and the one torch.compile times
TORCH_POLICIES = ("none", "selective", "full", "offload")


# ------------------------------------------------------------------------- small helpers
def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax",
                 "torch", "transformers", "numpy"):  # fmt: skip
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _nvidia_smi() -> dict[str, str] | None:
    query = "name,driver_version,memory.total,clocks.max.sm"
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    values = [v.strip() for v in proc.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(query.split(","), values, strict=False))


def _timed(fn: Any, warmup: int, repeats: int) -> dict[str, float]:
    """Wall time of ``fn()`` (which blocks until its work is done): median and mean over
    ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times),
            "min_s": min(times), "repeats": repeats}  # fmt: skip


def _child(part: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one part in a fresh process (``--part``), its result read from the JSON it writes."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part,
           "--payload", json.dumps(payload), "--result", result_path]  # fmt: skip
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return {"error": f"stopped at the budget after {timeout:.0f} s"}
    finally:
        elapsed = time.perf_counter() - started
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        result = {"error": lines[-1] if lines else f"exit code {proc.returncode}"}
    finally:
        if os.path.exists(result_path):
            os.remove(result_path)
    result["process_s"] = elapsed
    return result


# ----------------------------------------------------------------------- parts (children)
def part_environment(payload: dict[str, Any]) -> dict[str, Any]:
    """The GPU (or CPU) JAX sees and this GPU's target config, written for the case parts."""
    import jax

    from jaxmem.memory.gpu_plan import capture_target_config

    devices = jax.devices()
    out: dict[str, Any] = {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
    }
    if payload["dry_run"] or devices[0].platform != "gpu":
        out["target"] = "h100"  # the shipped config: no GPU here to capture
        return out
    path = os.path.join(payload["work_dir"], "this_gpu.txtpb")
    try:
        text = capture_target_config()
    except Exception as e:  # noqa: BLE001  (the shipped H100 config instead, and said so)
        out["target"] = "h100"
        out["capture_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        return out
    with open(path, "w") as f:
        f.write(text)
    out["target"] = path
    out["target_config"] = text
    return out


def part_calibration(payload: dict[str, Any]) -> dict[str, Any]:
    """Measured rates of the kernels the step-time model prices, beside its assumptions."""
    import jax
    import jax.numpy as jnp

    from jaxmem.memory import step_time as st
    from jaxmem.memory.targets import get_target
    from jaxmem.memory.work import Matmul

    target = get_target(payload["target"])
    device = st.Device.of(target)
    dry = payload["dry_run"]
    shapes = [(256, 256, 256)] if dry else [
        (8192, 8192, 8192),  # the large product the efficiency figure is quoted for
        (8192, 768, 768), (8192, 3072, 768), (8192, 768, 3072),  # gpt2-124m, 8 x 1024 tokens
        (8192, 50304, 768),  # its LM head
        (8192, 2048, 2048), (8192, 8192, 2048),  # llama-3.2-1b, 4 x 2048 tokens
        (1024, 768, 768),  # one small microbatch
    ]  # fmt: skip
    key = jax.random.key(0)
    rows = []
    for m, n, k in shapes:
        a = jax.random.normal(key, (m, k), jnp.bfloat16)
        b = jax.random.normal(key, (k, n), jnp.bfloat16)
        f = jax.jit(lambda x, y: x @ y)
        t = _timed(lambda a=a, b=b, f=f: f(a, b).block_until_ready(), 3, 5 if dry else 20)
        mm = Matmul(1, m, n, k, "bfloat16", 2 * (m * k + k * n + m * n))
        row = {"m": m, "n": n, "k": k, "measured_s": t["median_s"],
               "measured_tflops": mm.flops / t["median_s"] / 1e12}  # fmt: skip
        if device is not None:
            row["model_s"] = st.matmul_seconds(mm, device)
            row["model_efficiency"] = st.matmul_efficiency(mm, device)
            row["measured_efficiency"] = mm.flops / t["median_s"] / device.peak("bfloat16")
        rows.append(row)
    n = (1 << 20) if dry else (1 << 28)  # 2 MiB / 512 MiB of bf16
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda v: v * 2)
    t_copy = _timed(lambda: copy(x).block_until_ready(), 3, 10)
    tiny = jnp.ones((8,), jnp.float32)
    bump = jax.jit(lambda v: v + 1)
    t_tiny = _timed(lambda: bump(tiny).block_until_ready(), 10, 50)
    out = {
        "matmuls": rows,
        "copy_bytes": 4 * n,
        "copy_gb_per_s": 4 * n / t_copy["median_s"] / 1e9,  # read and written
        "tiny_kernel_s": t_tiny["median_s"],
        "source": "runtime: median wall time of jitted calls (block_until_ready), after warm-up",
        "model": st.DEFAULT.text(),
    }
    if device is not None:
        out["hbm_efficiency_measured"] = out["copy_gb_per_s"] * 1e9 / device.hbm_bytes_per_s
    return out


def part_jax_case(payload: dict[str, Any]) -> dict[str, Any]:
    """Plan one case without the device, compile it on the device, run and time it."""
    import jax

    from jaxmem.memory import analytic
    from jaxmem.memory.residuals import Plan, compiled_plan, device_peak_bytes
    from jaxmem.memory.residuals import planned_peak as peak_of_plan
    from jaxmem.memory.targets import get_target, rates_for
    from jaxmem.memory.work import work_of_hlo
    from jaxmem.planner import plans, records
    from jaxmem.precision import get_precision
    from jaxmem.step.spec import StepSpec

    case = Case(**payload["case"])
    cfg, policy, opt = case.model(), case.memory_policy(), case.optimizer()
    precision = get_precision("bf16")
    target = get_target(payload["target"])
    out: dict[str, Any] = {"case": dataclasses.asdict(case)}
    spec = StepSpec(model=cfg, policy=policy, precision=precision, optimizer=opt,
                    batch=case.batch, seq_len=case.seq_len)  # fmt: skip
    # 1. deviceless, for this GPU's captured target (the shipped H100's in a dry run)
    try:
        planned = plans.plan_step(spec.replace(target=target))
        out["deviceless"] = {
            "planned_peak_bytes": planned["planned_peak_bytes"],
            "compiled_plan": dict(planned["compiled_plan"]),
            "compiler": planned["compiler"],
            "step_time": planned.get("step_time"),
        }
    except Exception as e:  # noqa: BLE001  (reported; the on-device part still runs)
        out["deviceless"] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    # 2. on the device: compiled, run, timed
    step, args = records.runnable_step(
        StepSpec(
            model=cfg,
            policy=policy,
            precision=precision,
            optimizer=opt,
            batch=case.batch,
            seq_len=case.seq_len,
        )
    )
    started = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - started
    plan = Plan(compiled_plan(compiled))
    on_gpu = jax.devices()[0].platform == "gpu"
    if on_gpu:
        plan.work = work_of_hlo(compiled.as_text(), "per-kernel count of the plan compiled on "
                                "the GPU")  # fmt: skip
    state = list(args)

    def one_step() -> None:
        state[0], state[1], state[2], metrics = compiled(*state)
        jax.block_until_ready(metrics["loss"])

    warmup, repeats = (1, 3) if payload["dry_run"] else (3, 20)
    timing = _timed(one_step, warmup, repeats)
    tokens = case.batch * case.seq_len
    model_flops = analytic.mfu_flops(cfg, case.batch, case.seq_len)
    peak_rate = rates_for(target).matmul_flops["bfloat16"]
    estimate = (
        plans.step_time(plan, target, cfg, precision, case.batch, case.seq_len) if on_gpu else None
    )
    out["device"] = {
        "platform": jax.devices()[0].platform,
        "compile_s": compile_s,
        "compiled_plan": dict(plan),
        "planned_peak_bytes": peak_of_plan(plan),
        "runtime_peak_bytes": device_peak_bytes(),
        "runtime_peak_source": "device.memory_stats()['peak_bytes_in_use'] after the timed steps "
        "(this process only); None where the backend reports none (CPU)",
        "step": timing,
        "tokens_per_s": tokens / timing["median_s"],
        "mfu": model_flops / timing["median_s"] / peak_rate,
        "mfu_source": "model FLOPs (analytic.mfu_flops) / median step time / the target's bf16 "
        "dense peak",
        "step_time": estimate,
    }
    return out


def part_torch_model(payload: dict[str, Any]) -> dict[str, Any]:
    """torch_ref on CUDA (the CPU in a dry run): each policy's peak and eager step time, then
    torch.compile's step time without remat."""
    import torch

    import torch_ref
    from jaxmem.memory import analytic
    from jaxmem.memory.targets import get_target, rates_for
    from jaxmem.policy import POLICIES
    from jaxmem.precision import get_precision
    from torch_ref.remat import apply_loss_policy, apply_memory_policy
    from torch_ref.train import lm_loss_sum

    case = Case(**payload["case"])
    cfg = case.model()
    precision = get_precision("bf16")
    cuda = torch.cuda.is_available() and not payload["dry_run"]
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (case.batch, case.seq_len), device=device)
    y = torch.randint(0, cfg.vocab_size, (case.batch, case.seq_len), device=device)
    warmup, repeats = (1, 3) if payload["dry_run"] else (3, 20)
    peak_rate = rates_for(get_target(payload["target"])).matmul_flops["bfloat16"]
    model_flops = analytic.mfu_flops(cfg, case.batch, case.seq_len)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def measure(policy_name: str, compile_backend: str | None) -> dict[str, Any]:
        model = torch_ref.Decoder(cfg).to(device)  # fp32 master weights, bf16 under autocast
        runner = apply_memory_policy(model.blocks, POLICIES[policy_name])
        apply_loss_policy(model, POLICIES[policy_name])
        # stock AdamW as a PyTorch user writes it (foreach on CUDA)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        run = torch.compile(model, backend=compile_backend) if compile_backend else model

        def one_step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_sum, n = lm_loss_sum(run, {"inputs": x, "targets": y}, precision)
            (loss_sum / n).backward()
            opt.step()
            sync()

        started = time.perf_counter()
        one_step()  # the first step (torch.compile compiles here)
        first_s = time.perf_counter() - started
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        timing = _timed(one_step, warmup, repeats)
        row = {
            "policy": policy_name,
            "translation": runner.description,
            "compile_backend": compile_backend,
            "first_step_s": first_s,
            "step": timing,
            "tokens_per_s": case.batch * case.seq_len / timing["median_s"],
            "mfu": model_flops / timing["median_s"] / peak_rate,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        }
        return row

    def measured(policy_name: str, compile_backend: str | None) -> dict[str, Any]:
        row = measure(policy_name, compile_backend)  # its model and optimizer freed on return
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        return row

    rows = [measured(p, None) for p in payload["policies"]]
    backend = "aot_eager" if payload["dry_run"] else "inductor"
    rows.append(measured(payload["compile_policy"], backend))
    return {
        "case": dataclasses.asdict(case),
        "device": device,
        "rows": rows,
        "peak_source": "torch.cuda.max_memory_allocated after the timed steps (reset after the "
        "first); the caching allocator's reserve beside it",
    }


PARTS = {
    "environment": part_environment,
    "calibration": part_calibration,
    "jax_case": part_jax_case,
    "torch_model": part_torch_model,
}


# -------------------------------------------------------------------------- the parent
def run_tests(out_dir: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "tests/test_gpu_plan.py", "tests/test_context_parallel.py"]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(timeout, 1))  # fmt: skip
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, code = f"stopped at the budget after {timeout:.0f} s\n{e.stdout or ''}", None
    with open(os.path.join(out_dir, "gpu_tests.txt"), "w") as f:
        f.write(text)
    summary = [line for line in text.strip().splitlines() if " passed" in line or " skipped"
               in line or " failed" in line or " error" in line]  # fmt: skip
    return {"command": " ".join(cmd[1:]), "exit_code": code,
            "summary": summary[-1] if summary else text.strip().splitlines()[-1:]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )  # fmt: skip
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the short GPU slot's set (default)")
    mode.add_argument("--dry-run", action="store_true", help="the same code on the CPU, tiny")
    parser.add_argument("--out", default="benchmarks/results/gpu_check")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stop starting parts past this many seconds (default 420)",
    )
    parser.add_argument("--skip", default="", help="parts to leave out: "
                        "calibration,tests,jax,torch")  # fmt: skip
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:  # a child: one part, its result as JSON
        result = PARTS[args.part](json.loads(args.payload))
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0
    return run(args)


def run(args: argparse.Namespace) -> int:
    import tempfile

    from jaxmem.files import write_json_atomic

    started = time.perf_counter()
    skip = {s for s in args.skip.split(",") if s}
    os.makedirs(args.out, exist_ok=True)
    cases = DRY if args.dry_run else QUICK

    def left() -> float:
        return args.budget_s - (time.perf_counter() - started)

    report: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "mode": "dry-run (CPU, tiny sizes: checks the code, not a GPU)"
            if args.dry_run
            else "quick",
            "host": platform.node(),
            "versions": _versions(),
            "nvidia_smi": _nvidia_smi(),
            "budget_s": args.budget_s,
            "precision": "bf16 compute, fp32 master weights and AdamW state",
        },
        "skipped": [],
    }

    def save() -> None:
        report["meta"]["seconds"] = time.perf_counter() - started
        write_json_atomic(os.path.join(args.out, "gpu_check.json"), report)
        write_markdown(report, os.path.join(args.out, "gpu_check.md"))

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {text}", flush=True)

    with tempfile.TemporaryDirectory() as work_dir:
        base = {"dry_run": args.dry_run, "work_dir": work_dir}
        env = _child("environment", base, left())
        report["environment"] = env
        log(f"environment: {env.get('device_kind', env.get('error'))}")
        if "error" in env:
            save()
            print(f"gpu_check: the environment part failed: {env['error']}", file=sys.stderr)
            return 1
        base["target"] = env["target"]
        if "calibration" not in skip:
            report["calibration"] = _child("calibration", base, min(left(), 90))
            log("calibration")
            save()
        if "tests" not in skip:
            report["tests"] = run_tests(args.out, min(left(), 150))
            log(f"GPU-only tests: {report['tests']['summary']}")
            save()
        report["cases"] = []
        for case in cases if "jax" not in skip else ():
            if left() < 20:
                report["skipped"].append(f"jax case {case.name}: budget spent")
                continue
            result = _child("jax_case", {**base, "case": dataclasses.asdict(case)}, left())
            result.setdefault("case", dataclasses.asdict(case))
            report["cases"].append(result)
            log(f"jax {case.name}: " + (result.get("error") or _case_line(result)))
            save()
        report["torch"] = []
        torch_models = [c for c in cases if c.fused]  # SDPA beside cuDNN
        for case in torch_models if "torch" not in skip else ():
            if left() < 30:
                report["skipped"].append(f"torch_ref {case.name}: budget spent")
                continue
            payload = {**base, "case": dataclasses.asdict(case),
                       "policies": list(TORCH_POLICIES), "compile_policy": "none"}  # fmt: skip
            result = _child("torch_model", payload, left())
            result.setdefault("case", dataclasses.asdict(case))
            report["torch"].append(result)
            log(f"torch_ref {case.preset}: {result.get('error') or 'done'}")
            save()
    save()
    try:
        plot(report, os.path.join(args.out, "gpu_check.png"))
    except Exception as e:  # noqa: BLE001  (the figures are in the JSON and Markdown anyway)
        report["skipped"].append(f"plot: {type(e).__name__}: {e}")
        save()
    log(f"wrote {', '.join(f for f in FILES if os.path.exists(os.path.join(args.out, f)))} "
        f"in {args.out}")  # fmt: skip
    return 0


# ------------------------------------------------------------------------- the report
def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


UNIT = {"GiB": GIB, "MiB": 2**20}


def _gib(nbytes: float | None, unit: str = "GiB") -> str:
    return "-" if nbytes is None else f"{nbytes / UNIT[unit]:,.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def _case_line(r: dict[str, Any]) -> str:
    d = r.get("device", {})
    est = (d.get("step_time") or {}).get("seconds")
    return (f"{_ms(d.get('step', {}).get('median_s'))} ms measured, {_ms(est)} ms estimated, "
            f"peak {_gib(d.get('runtime_peak_bytes'))} GiB")  # fmt: skip


def write_markdown(report: dict[str, Any], path: str) -> None:
    from jaxmem.files import write_atomic

    meta = report["meta"]
    env = report.get("environment", {})
    smi = meta.get("nvidia_smi") or {}
    v = meta["versions"]
    lines = [
        "# GPU check",
        "",
        f"{meta['date']}, {meta['mode']}; {env.get('device_kind', '?')} "
        f"({smi.get('name', 'no nvidia-smi')}, driver {smi.get('driver_version', '-')}); "
        f"jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, torch {v.get('torch')}, flax "
        f"{v.get('flax')}, Python {v.get('python')}; {meta['precision']}; "
        f"{meta.get('seconds', 0):.0f} s in all.",
        "",
    ]
    if env.get("capture_error"):
        lines += [f"This GPU's target config could not be captured ({env['capture_error']}): "
                  "the deviceless plans are the shipped H100 config's.", ""]  # fmt: skip
    if report.get("tests"):
        t = report["tests"]
        lines += [f"GPU-only tests (`{t['command']}`): {t['summary']} (exit {t['exit_code']}; "
                  "output in gpu_tests.txt).", ""]  # fmt: skip
    cases = report.get("cases", [])
    on_gpu = env.get("platform") == "gpu"
    sizes = [r.get("device", {}).get("planned_peak_bytes") or 0 for r in cases]
    unit = "GiB" if max(sizes, default=0) >= GIB else "MiB"
    here = "the GPU" if on_gpu else f"this backend ({env.get('platform')})"
    target = (
        "this GPU's captured target"
        if on_gpu and not env.get("capture_error")
        else f"the shipped {env.get('target')} target"
        + ("" if on_gpu else " (no GPU here to capture)")
    )
    if cases:
        lines += [
            f"## Plans and peaks ({unit} per device)",
            "",
            f"Deviceless: the step compiled without the device for {target} "
            f"(`memory_analysis()`: arguments + outputs - aliased + temporaries); on {here}: "
            "the same step compiled there; runtime peak: `memory_stats()['peak_bytes_in_use']` "
            "after the timed steps, in a fresh process (none on a CPU).",
            "",
            f"| case | deviceless plan | plan on {here} | deviceless / {here} | runtime peak | "
            "runtime / plan |",
            "|---|---|---|---|---|---|",
        ]
        for r in cases:
            dl, d = r.get("deviceless", {}), r.get("device", {})
            name = r["case"]["name"]
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error']} | | | | |")
                continue
            a, b = dl.get("planned_peak_bytes"), d.get("planned_peak_bytes")
            peak = d.get("runtime_peak_bytes")
            lines.append(f"| {name} | {_gib(a, unit) if a else dl.get('error', '-')} | "
                         f"{_gib(b, unit)} | {_ratio(a, b)} | {_gib(peak, unit)} | "
                         f"{_ratio(peak, b)} |")  # fmt: skip
        lines += [
            "",
            "## Step time: estimated and measured",
            "",
            f"Measured on {here}: the median of the timed steps after warm-up (wall clock, "
            "`block_until_ready`). Estimated: `jaxmem.memory.step_time` priced from each plan's "
            "kernels (its assumptions below). MFU: model FLOPs (no recompute) over the step "
            "time and the GPU's bf16 dense peak"
            + ("." if on_gpu else "; on a CPU neither MFU nor the ratio means anything."),
            "",
            "| case | measured ms | tokens/s | MFU | est. ms (deviceless plan) | est. ms (plan "
            f"on {here}) | est. / measured |",
            "|---|---|---|---|---|---|---|",
        ]
        assumptions = None
        for r in cases:
            if "error" in r:
                continue
            d = r["device"]
            est_dl = (r.get("deviceless", {}).get("step_time") or {}).get("seconds")
            est = (d.get("step_time") or {}).get("seconds")
            measured = d["step"]["median_s"]
            assumptions = assumptions or (d.get("step_time") or r.get("deviceless", {}).get(
                "step_time") or {}).get("assumptions")  # fmt: skip
            mfu = f"{d['mfu']:.1%}" if on_gpu else "-"
            ratio = _ratio(est or est_dl, measured) if on_gpu else "-"
            lines.append(
                f"| {r['case']['name']} | {_ms(measured)} | {d['tokens_per_s']:,.0f} | {mfu} | "
                f"{_ms(est_dl)} | {_ms(est)} | {ratio} |"
            )
        if assumptions:
            lines += ["", f"Estimate's assumptions: {assumptions}."]
    torch_rows = report.get("torch", [])
    if torch_rows:
        lines += [
            "",
            "## torch_ref beside jaxmem",
            "",
            "torch_ref: the same model, fp32 weights under bf16 autocast, stock AdamW; peaks "
            "`torch.cuda.max_memory_allocated` after the timed steps. jaxmem: the case of the "
            "same model and policy above.",
            "",
            f"| model | policy | torch | torch ms | tokens/s | MFU | torch peak {unit} | jaxmem "
            f"ms | jaxmem runtime peak {unit} |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for t in torch_rows:
            if "error" in t:
                lines.append(f"| {t['case']['name']} | failed: {t['error']} | | | | | | | |")
                continue
            for row in t["rows"]:
                jax_row = _jax_for(cases, t["case"], row["policy"])
                how = row["compile_backend"] and f"torch.compile ({row['compile_backend']})"
                mfu = f"{row['mfu']:.1%}" if t["device"] == "cuda" else "-"
                lines.append(
                    f"| {t['case']['preset']} | {row['policy']} | {how or 'eager'} | "
                    f"{_ms(row['step']['median_s'])} | {row['tokens_per_s']:,.0f} | {mfu} | "
                    f"{_gib(row['peak_allocated_bytes'], unit)} | "
                    f"{_ms(jax_row and jax_row['device']['step']['median_s'])} | "
                    f"{_gib(jax_row and jax_row['device']['runtime_peak_bytes'], unit)} |"
                )
    cal = report.get("calibration")
    if cal and "error" not in cal:
        lines += ["", "## Calibration", "",
                  f"A device copy moved {cal['copy_gb_per_s']:,.0f} GB/s (read + written); a tiny "
                  f"kernel took {cal['tiny_kernel_s'] * 1e6:,.0f} us (dispatch included).", "",
                  "| m | n | k | measured TFLOP/s | measured / peak | model's efficiency |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for m in cal["matmuls"]:
            lines.append(f"| {m['m']} | {m['n']} | {m['k']} | {m['measured_tflops']:,.1f} | "
                         f"{m.get('measured_efficiency', 0):.2f} | "
                         f"{m.get('model_efficiency', 0):.2f} |")  # fmt: skip
    if report.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(report["skipped"]) + "."]
    write_atomic(path, "\n".join(lines) + "\n")


def _jax_for(cases: list[dict[str, Any]], model_case: dict[str, Any], policy: str) -> Any:
    for r in cases:
        c = r["case"]
        if ("error" not in r and c["preset"] == model_case["preset"] and c["policy"] == policy
                and c["fused"] == model_case["fused"] and not c["stream"]
                and not c["loss_chunks"] and c["n_layers"] == model_case["n_layers"]):  # fmt: skip
            return r
    return None


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [r for r in report.get("cases", []) if "error" not in r]
    if not cases:
        return
    names = [r["case"]["name"] for r in cases]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.5 * len(names) + 2.5))
    y = range(len(names))
    series = [
        ("deviceless plan", [r.get("deviceless", {}).get("planned_peak_bytes") for r in cases]),
        ("plan on the GPU", [r["device"]["planned_peak_bytes"] for r in cases]),
        ("runtime peak", [r["device"]["runtime_peak_bytes"] for r in cases]),
    ]
    for i, (label, values) in enumerate(series):
        left.barh([v + (i - 1) * 0.27 for v in y], [(x or 0) / GIB for x in values],
                  height=0.27, label=label)  # fmt: skip
    left.set_yticks(list(y), names)
    left.set_xlabel("GiB per device")
    left.legend(fontsize=8)
    left.invert_yaxis()
    measured = [r["device"]["step"]["median_s"] * 1e3 for r in cases]
    est = [((r["device"].get("step_time") or r.get("deviceless", {}).get("step_time") or {})
            .get("seconds") or 0) * 1e3 for r in cases]  # fmt: skip
    right.barh([v - 0.2 for v in y], measured, height=0.4, label="measured")
    right.barh([v + 0.2 for v in y], est, height=0.4, label="estimated (jaxmem)")
    right.set_yticks(list(y), [""] * len(names))
    right.set_xlabel("ms per step")
    right.legend(fontsize=8)
    right.invert_yaxis()
    fig.suptitle(f"{report.get('environment', {}).get('device_kind', '?')}: "
                 f"{report['meta']['mode']}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

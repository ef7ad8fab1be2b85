# ruff: noqa: E402  (JAX is imported after contain_cuda_plugin, on purpose)
"""The longest sequence at batch 1 for Llama-3-8B-class models on one H100, planned without it:
full fine-tuning and QLoRA, each answer two compiled plans (fits at N, over at N + step), with
device and host bytes, the estimated step time and, where a goal is not met, what holds the peak
(needs ``jaxmem[gpu-plan]``; cuDNN's library for the fused attention kernel).

    python benchmarks/long_context.py --out benchmarks/results/long_context

The search is ``jaxmem plan --longest``'s (``jaxmem.planner.longest``): at each length the
leanest point of the long-sequence space (every block rematerialised, its input offloaded to
host memory within the host limit, the loss in tiles, a full fine-tune's AdamW state in host
memory), compiled for the target. Resumable: every compiled plan is written to the JSON as it
is made, and a rerun measures only what is missing (``--budget-s`` stops it between compiles);
``--render`` rewrites the Markdown from the JSON. A row is keyed by model, method, devices and
the space it searched (``space``), so rows with MLP tiles or a context-parallel mesh are rows of
their own beside these.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import time
from typing import Any

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()  # before JAX starts: CPU backend, no plugin start-up noise
import jax
import jaxlib

from jaxmem.adapters import AdapterConfig
from jaxmem.config import OptimizerConfig, get_preset
from jaxmem.files import write_atomic, write_json_atomic
from jaxmem.memory.targets import get_target
from jaxmem.model.flash import KERNEL_NAMES, cudnn_installed, fused_kernel
from jaxmem.parallel import ParallelConfig
from jaxmem.planner import host, longest
from jaxmem.policy import POLICIES
from jaxmem.precision import get_precision
from jaxmem.step.spec import StepSpec

GIB = 2**30
TARGET = "h100"
PRECISION = "pure-bf16"
STEP = 1024  # tokens: the search's granularity
CAP = 1 << 23
# host memory the plans may use: an assumption (a DGX H100 host has 2 TiB for its 8 GPUs; one
# GPU's job given half of it)
HOST_MEMORY = 1 << 40
# PEFT's LoraConfig with the attention projections targeted, on an nf4 base (QLoRA), as the
# adapters benchmark
QLORA = AdapterConfig(rank=16, alpha=16.0, targets=("q", "k", "v", "o"), base="nf4")
METHODS = {"full": AdapterConfig(), "qlora": QLORA}
SPACE = "offloaded inputs + loss tiles"
STREAMED = SPACE + " + streamed stack"
TILED = "offloaded inputs + MLP tiles + loss tiles"
TILED_STREAMED = TILED + " + streamed stack"
# (preset, method, space, first length compiled): a full fine-tune with its stack's parameters,
# gradients and state streamed through host memory (optimizer.stream). Rows of SPACE/STREAMED
# were compiled before the MLP was tiled (kept: they show the untiled MLP's limit); each search
# starts near its expected answer
# Two context-parallel rows: 8 H100s, --mesh fsdp=1,cp=8 (parameters, gradients and AdamW state
# sharded over the 8 context devices, on the device: the stack cannot stream under cp), the
# attention jaxmem's blockwise kernel (not cuDNN's: under cp it runs whatever the model's) on
# all-gathered keys and values, or round a ring of the 8 (--cp-attention ring: jaxmem.step.ring)
CP = 8
SHARE = f"{TILED} of each device's share + state sharded over 8"
CP_SPACE = f"cp={CP} (all-gathered K/V) + {SHARE}"
CP_RING_SPACE = f"cp={CP} (K/V round a ring) + {SHARE}"
CP_SPACES = {CP_SPACE: "gather", CP_RING_SPACE: "ring"}  # ParallelConfig.cp_attention
ROWS = (("llama-3.1-8b", "full", TILED_STREAMED, 1048576),
        ("llama-3.1-8b", "qlora", TILED, 524288),
        ("llama-3.1-8b", "full", CP_SPACE, 4194304),
        ("llama-3.1-8b", "full", CP_RING_SPACE, 4194304))  # fmt: skip
# the goals (tokens at batch 1 on one H100) and the anchors beside them
GOALS = {"full": 1_000_000, "qlora": 342_733, "full-cp": 4_000_000}
ANCHOR = {"full": "ALST 500K (1 H100)", "qlora": "Unsloth 342,733 (80 GB)",
          "full-cp": "ALST 3.7M (8 H100s); torchtitan 262,144 (8 GPUs)"}  # fmt: skip
# a DGX H100 host's 2 TiB, shared by its 8 GPUs (``jaxmem.planner.host.host_share``): what the
# context-parallel row's devices may keep there together (an assumption, as HOST_MEMORY)
CP_HOST_MEMORY = 2 << 40
# measured without offloaded inputs (full remat + loss chunks of 1,024 tokens), the adapters
# benchmark's compiled plans: the baseline this table's space moves from
BEFORE = {
    "qlora": "195,584 ([adapters.md](../adapters/adapters.md))",
    "full": "46,080 with the state on the device ([adapters.md](../adapters/adapters.md))",
    "full-cp": "-",
}
ANCHORS = (
    "ALST (Bekman et al., 2025; DeepSpeed + Hugging Face): Llama-8B full fine-tuning at 500K "
    "tokens on one H100, 3.7M on one 8 x H100 node",
    "Unsloth (offloaded gradient checkpointing): Llama-3.1-8B QLoRA at 342,733 tokens on 80 GB",
    "torchtitan context parallelism: Llama-3.1-8B at 262,144 tokens on 8 GPUs",
)


NOTES = (
    'Rows without "MLP tiles" in their space were compiled before the MLP was tiled over '
    "the sequence (kept: they show the untiled MLP's limit, four [S, 14336] intermediates). "
    "Llama-3-8B and Llama-3.1-8B have the same shapes (Llama 3.1's RoPE scaling changes no "
    "buffer): their plans agreed byte for byte at every length compiled, so only Llama-3.1-8B's "
    "rows are kept. Whether a length fits is not monotone at a step of 1,024 tokens: the MLP and "
    "loss tiles follow the length's divisors, and the compiled peak of the QLoRA row jumps by "
    "11.9 GiB between 777,216 and 778,240 tokens; each answer is the pair compiled (fits at N, "
    "over at N + step). The context-parallel rows' attention is jaxmem's own blockwise kernel, "
    "not cuDNN's (a ring needs each chunk product's log-sum-exp in fp32, which JAX's API "
    "returns from cuDNN in bf16): on all-gathered keys and values "
    "(jaxmem.model.flash.flash_attention_at, every "
    "key block computed, masked ones included: S/cp x S scores per device) or round a ring "
    "(jaxmem.step.ring: cp - 1 collective-permutes per attention, 2 cp + 1 of the gathered "
    "form's 4 cp chunk products); their estimated step times price the context axis's K/V "
    "passes (from shapes: forward, recompute and gradients back; the ring's in fp32) over "
    "NVLink, exposed, the program's other collectives (the state's over the 8 devices) "
    "overlapped with compute (an assumption), and the fp32 elementwise passes over the score "
    "blocks set them; "
    "their MLP and loss tiles loop over each device's own share. XLA:CUDA's "
    "rematerialization pass logs, at these lengths, that it cannot bring its own memory count "
    "under its limit "
    "(e.g. 206 GiB at 468K tokens, about the plan's device bytes plus the inputs held in host "
    "memory); the device figures here are the compiled plans' own."
)


def base_spec(preset: str, method: str, space: str = SPACE) -> StepSpec:
    """The row's step at its preset's length: fused attention, pure bf16, AdamW (a full
    fine-tune's state in host memory, or its stack streamed; an adapter step keeps its small
    state on the device)."""
    adapters = METHODS[method]
    streamed = space.endswith("streamed stack")
    place = "device" if adapters.enabled or streamed or space in CP_SPACES else "pinned_host"
    mesh = {}
    if space in CP_SPACES:
        how = CP_SPACES[space]
        mesh["parallel"] = ParallelConfig(strategy="fsdp", devices=CP, cp=CP, cp_attention=how)
    return StepSpec(
        model=get_preset(preset).replace(attention="fused"),
        policy=POLICIES["full"],
        precision=get_precision(PRECISION),
        optimizer=dataclasses.replace(OptimizerConfig(), state_memory=place, stream=streamed),
        batch=1,
        seq_len=2048,
        target=get_target(TARGET),
        adapters=adapters,
        **mesh,
    )


def goal_key(method: str, devices: int) -> str:
    """The row's goal and anchor: a method's on one H100, or on 8 with a context axis."""
    return f"{method}-cp" if devices > 1 else method


def row_spec(base: StepSpec, space: str, n: int, budget: int, offload: bool) -> StepSpec:
    """``longest.lean_spec`` at ``n`` tokens; a space without MLP tiles keeps the MLP whole (the
    rows compiled before the MLP was tiled)."""
    spec = longest.lean_spec(base, n, budget, offload=offload)
    if "MLP tiles" in space:
        return spec
    return spec.replace(policy=spec.policy.replace(mlp_tile_tokens=0))


class Bench:
    """The rows and every plan compiled, kept in ``path`` (JSON) after each compile."""

    def __init__(self, path: str, budget_s: float):
        self.path, self.deadline = path, time.monotonic() + budget_s
        self.data: dict[str, Any] = {"rows": {}, "plans": {}, "meta": {}}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)

    def save(self) -> None:
        self.data["meta"]["date"] = datetime.datetime.now(datetime.UTC).isoformat(
            timespec="seconds"
        )
        write_json_atomic(self.path, self.data)

    def measure(self, name: str, base: StepSpec, budget: int, n: int) -> tuple[bool, int] | None:
        """Row ``name``'s plan at ``n`` tokens (compiled once, kept); None when out of time."""
        key = f"{name}|{n}"
        plans = self.data["plans"]
        if key not in plans:
            if time.monotonic() > self.deadline:
                return None
            start = time.perf_counter()
            space = self.data["rows"].get(name, {}).get("space") or name.split("|")[3]
            spec = row_spec(base, space, n, budget, offload=False)
            with_inputs = row_spec(base, space, n, budget, offload=True)
            allowed = CP_HOST_MEMORY if space in CP_SPACES else HOST_MEMORY
            if host.host_need(with_inputs) <= allowed:
                spec = with_inputs
            p = longest.probe(spec, budget, allowed)
            plans[key] = p.as_dict() | {"compile_s": round(time.perf_counter() - start, 1)}
            self.save()
            print(f"{key}: {p.device_bytes / GIB:.2f} GiB, fits {p.fits} "
                  f"({plans[key]['compile_s']} s)", flush=True)  # fmt: skip
        return plans[key]["fits"], plans[key]["device_bytes"]

    def row(self, preset: str, method: str, space: str, start: int) -> None:
        cp = space in CP_SPACES
        devices = CP if cp else 1
        name = f"{preset}|{method}|{devices}x{TARGET}|{space}"
        rows = self.data["rows"]
        if rows.get(name, {}).get("done"):
            return
        base = base_spec(preset, method, space)
        budget = get_target(TARGET).device_memory_bytes
        step = 2 * CP * STEP if cp else STEP  # the context axis cuts 2 cp equal chunks
        lo, hi, seen = longest.search_lengths(
            lambda n: self.measure(name, base, budget, n), step, start, CAP, aim=budget
        )
        done = hi is not None or lo == CAP
        rows[name] = {
            "preset": preset, "method": method, "devices": devices, "space": space,
            "longest": lo, "over_at": hi, "done": done, "compiled": len(seen),
            "budget_bytes": budget, "step": step,
            "host_memory_bytes": CP_HOST_MEMORY if cp else HOST_MEMORY,
        }  # fmt: skip
        self.save()
        if done and lo < GOALS[goal_key(method, devices)] and lo:
            self.explain(name, base, budget, lo)

    def explain(self, name: str, base: StepSpec, budget: int, n: int) -> None:
        """What holds the peak of the row's plan at its longest length (``jaxmem peak``)."""
        row = self.data["rows"][name]
        if "peak" in row or time.monotonic() > self.deadline:
            return
        from jaxmem.planner.peak import explain_peak

        plan = self.data["plans"][f"{name}|{n}"]
        # the block inputs on the host: full-host (earlier rows: a custom policy's offload)
        offload = plan["policy"]["policy"] == "full-host" or bool(plan["policy"].get("offload"))
        spec = row_spec(base, self.data["rows"][name]["space"], n, budget, offload)
        report = explain_peak(longest.compiled_as(spec))
        top = sorted(report.values, key=lambda v: -v.bytes)[:6]
        row["peak"] = {
            "seq_len": n,
            "planned_peak_bytes": report.planned_peak_bytes,
            "by_kind_bytes": report.by_kind(),
            "largest": [{"shape": v.shape, "bytes": v.bytes, "kind": v.kind} for v in top],
            "source": "compiled plan: XLA's buffer assignment (jaxmem.planner.peak.explain_peak)"
            + ("; optimizer state compiled on the device" if plan["state_memory"] != "device"
               else ""),
        }  # fmt: skip
        self.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/long_context")
    parser.add_argument("--budget-s", type=float, default=3600.0, help="stop compiling after")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "long_context.json")
    bench = Bench(path, 0 if args.render else args.budget_s)
    kernel = fused_kernel(128, "bfloat16", "gpu", cudnn_installed())
    bench.data["meta"] |= {
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, no GPU: deviceless plans)",
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "command": "python benchmarks/long_context.py --out benchmarks/results/long_context",
        "target": get_target(TARGET).description,
        "precision": PRECISION,
        "attention": f"fused: {KERNEL_NAMES.get(kernel, kernel)}",
        "optimizer": "AdamW (jaxmem's default OptimizerConfig); full fine-tuning: state in "
        "host memory (pinned_host); QLoRA: on the device",
        "host_memory": f"{HOST_MEMORY / GIB:,.0f} GiB allowed (an assumption: half a DGX H100 "
        "host's 2 TiB)",
        "granularity": f"sequence in multiples of {STEP}, from each row's first length "
        "(131,072 for the rows without MLP tiles; near the expected answer for the others)",
    }
    if not args.render:
        started = time.perf_counter()
        for preset, method, space, start in ROWS:
            bench.row(preset, method, space, start)
        bench.data["meta"]["seconds_last_run"] = round(time.perf_counter() - started)
        bench.save()
    write_atomic(os.path.join(args.out, "long_context.md"), to_markdown(bench.data))
    print(f"wrote {path} and long_context.md")


def _plan_text(p: dict | None) -> str:
    if p is None:
        return "-"
    st = (p.get("step_time") or {}).get("seconds")
    host = sum(p["host_bytes"].values())
    timing = f", est. {st:.1f} s/step" if st else ""
    return f"{p['device_bytes'] / GIB:.2f} GiB device, {host / GIB:.1f} GiB host{timing}"


def _streamed_host(name: str, r: dict, plan: dict) -> str:
    """A streamed row's host bytes: the compiled plan's host temporaries (they hold the stack's
    in-step copies beside the offloaded inputs) and, from shapes, what lives there."""
    base = base_spec(r["preset"], r["method"], r["space"])
    spec = row_spec(base, r["space"], r["longest"], r["budget_bytes"], True)
    parts = host.spec_host_bytes(spec)
    shapes = " + ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
    compiled = sum(plan["host_bytes"].values())
    return (
        f"- {r['preset']} {r['method']}, stack streamed, at {r['longest']:,} tokens: host bytes "
        f"{compiled / GIB:.1f} GiB in the table are the streamed plan's host temporaries "
        f"(compiled plan; they hold the stack's in-step copies beside the offloaded inputs); "
        f"from shapes, host memory holds {shapes} GiB = {sum(parts.values()) / GIB:.1f} GiB."
    )


def to_markdown(data: dict) -> str:
    m = data["meta"]
    lines = [
        "# Longest sequence at batch 1, planned for one H100 and for 8 without them",
        "",
        f"{m.get('date')}, jax {m.get('jax')}, jaxlib {m.get('jaxlib')}, on {m.get('host')}; "
        f"`{m.get('command')}`. Target: {m.get('target')}; every figure of a row is a compiled "
        f"plan (XLA:CUDA deviceless compile) unless labelled. Precision `{m.get('precision')}`; "
        f"attention {m.get('attention')}; {m.get('optimizer')}. Policy at each length "
        "(`jaxmem.planner.longest.lean_spec`): every block rematerialised, its input offloaded "
        "to host memory (`full-host`), the MLP in tiles (rows with MLP tiles), the loss in tiles "
        f"of 1,024-16,384 tokens. Host memory: {m.get('host_memory')}. Search: "
        f"{m.get('granularity')}, doubling then interpolation/bisection; each answer shown by "
        "two compiled plans (fits at N, over at N + step). Device budget: the H100's whole "
        "79.11 GiB per device (as the adapters benchmark). The 8-device rows: `--mesh "
        f"fsdp=1,cp={CP}` (`ParallelConfig(strategy='fsdp', devices={CP}, cp={CP})`, "
        "`cp_attention` 'gather' or 'ring' as the space says), the "
        "sequence split over the context axis in steps of 2 x cp x 1,024 tokens, parameters, "
        f"gradients and AdamW state sharded over the {CP} devices on the device (the stack "
        "does not stream under a context axis), figures per device, host memory "
        f"{CP_HOST_MEMORY / GIB:,.0f} GiB per host shared by its {CP} devices (a DGX H100's). "
        "Step times are "
        "estimates "
        "(`jaxmem.memory.step_time`: the compiled plan's kernels at datasheet rates, offloaded "
        "activations' link time overlapped with compute), not measurements.",
        "",
        "| model | method | devices | space | longest tokens (fits at N) | over at N + step | "
        "goal | met | anchor | before (inputs on the device) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, r in data["rows"].items():
        fits = data["plans"].get(f"{name}|{r['longest']}")
        over = data["plans"].get(f"{name}|{r['over_at']}")
        key = goal_key(r["method"], r["devices"])
        goal = GOALS[key]
        met = "yes" if r["longest"] >= goal else ("gap" if r["done"] else "not finished")
        lines.append(
            f"| {r['preset']} | {r['method']} | {r['devices']} | {r['space']} | "
            f"{r['longest']:,} ({_plan_text(fits)}) | "
            f"{'-' if r['over_at'] is None else format(r['over_at'], ',')} ({_plan_text(over)}) "
            f"| {goal:,} | {met} | {ANCHOR[key]} | {BEFORE[key]} |"
        )
        if "peak" in r:
            pk = r["peak"]
            kinds = ", ".join(f"{k} {v / GIB:.2f}" for k, v in pk["by_kind_bytes"].items())
            big = "; ".join(f"{v['shape']} {v['bytes'] / GIB:.2f} GiB ({v['kind']})"
                            for v in pk["largest"])  # fmt: skip
            state = data["plans"][f"{name}|{pk['seq_len']}"]["host_bytes"].get("optimizer state")
            with_state = (
                f", the optimizer state's {state / GIB:.2f} GiB included: compiled on the "
                "device, the row's figure takes it off"
                if state
                else ""
            )
            if r["space"].endswith("streamed stack"):
                with_state = (
                    ", device bytes of the streamed plan; its buffer assignment's arguments "
                    "include the stack a deviceless compile receives on the device"
                )
            notes.append(
                f"- {r['preset']} {r['method']} at {pk['seq_len']:,} tokens: the peak "
                f"({pk['planned_peak_bytes'] / GIB:.2f} GiB planned{with_state}) holds, by "
                "kind (GiB): "
                f"{kinds}; its largest buffers: {big} ({pk['source']})."
            )
    for name, r in data["rows"].items():
        if r["space"].endswith("streamed stack") and r["longest"]:
            notes.append(_streamed_host(name, r, data["plans"][f"{name}|{r['longest']}"]))
    lines += ["", "What holds the peak where a goal is not met (`jaxmem peak` of that plan):", ""]
    lines += notes or ["- not measured yet"]
    lines += ["", "Anchors (published, not measured here):", ""]
    lines += [f"- {a}" for a in ANCHORS]
    lines += ["", "Every length compiled (device GiB / host GiB, est. step s, compile s):", ""]
    for name in data["rows"]:
        tried = sorted(
            (p for k, p in data["plans"].items() if k.rsplit("|", 1)[0] == name),
            key=lambda p: p["seq_len"],
        )
        shown = "; ".join(
            f"{p['seq_len']:,}: {p['device_bytes'] / GIB:.2f} / "
            f"{sum(p['host_bytes'].values()) / GIB:.1f}, "
            f"{(p.get('step_time') or {}).get('seconds', 0):.1f} s, {p['compile_s']} s"
            for p in tried
        )
        lines.append(f"- {name.replace('|', ', ')}: {shown}")
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

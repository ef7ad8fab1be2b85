"""``jaxmem memory``: one training step's memory per policy and framework, each figure labelled
with how it was obtained (rendered by ``jaxmem.cli.render``)."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import jaxmem.cli.common as common
import jaxmem.cli.own_step as own_step
import jaxmem.cli.presets as presets
import jaxmem.cli.render as render
from jaxmem.cli.common import (
    EXIT_RUN_FAILED,
    TORCH_EXTRA,
    UsageError,
    check_writable,
    need_gpu_plan,
    need_jax_backend,
    need_torch,
    usage_errors,
)
from jaxmem.cli.common import names as parse_names
from jaxmem.cli.flags import STEP_FLAGS, add_flags, host_memory, job_from_args, not_streamed
from jaxmem.config import PRESETS, ModelConfig
from jaxmem.figures import format_bytes
from jaxmem.files import write_json_atomic
from jaxmem.job import torch_mesh_refusal, torch_ring_policy_refusal
from jaxmem.policy import EmbeddingReplay, can_replay_embedding
from jaxmem.policy_config import parse_policy

FRAMEWORKS = ("jax", "torch", "torch-lean")
NAMES = (
    *STEP_FLAGS,
    "accum",
    "unroll",
    "loss_chunks",
    "loss_tile_tokens",
    "mlp_tile_tokens",
    "replay_embedding",
    "mesh",
    "cp_attention",
)
DEFAULTS = {"preset": "tiny", "run": {"batch_size": 8}}
DEFAULT_POLICIES = "none,full,selective,offload"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "memory",
        help="the memory of one training step per policy, JAX and PyTorch, each figure "
        "labelled with how it was obtained",
        description="For each policy and framework: parameter, gradient and optimizer-state "
        "bytes, saved activations (device / host), the analytic model, the compiled plan (JAX), "
        "FLOPs and a peak. Planning presets are compiled from shapes (no weights allocated) and "
        "torch_ref's step runs on fake tensors; --target compiles the plan for a GPU without "
        "one (XLA:CPU's plan is far from a GPU's). The table shows the essential columns; "
        "--wide or --json gives them all.",
    )
    p.add_argument(
        "--policies",
        default=None,
        help="comma-separated policies (presets or HEAD:K+REST) (default "
        f"{DEFAULT_POLICIES}; with --config, the config's policy)",
    )
    p.add_argument(
        "--frameworks",
        default=None,
        help="jax, torch (stock PyTorch) and torch-lean (torch_ref's extension, where it differs "
        "from stock), comma-separated (default all three; jax alone without PyTorch)",
    )
    shown = {"seq_len": "64; max_seq_len for planning presets", "target": "cpu"}
    add_flags(p, NAMES, DEFAULTS, shown=shown)
    add_flags(p, ("target", "wide", "json", "host_memory"), shown=shown, title="the report")
    own_step.add_fn_flag(p, "--policies")
    p.set_defaults(func=run)


@dataclasses.dataclass
class Setup:
    """What the command measures, decided from the flags before anything runs."""

    policies: list
    frameworks: list[str]
    target: object
    planning: bool
    notes: list[str]


def run(args: argparse.Namespace) -> int:
    from jaxmem.memory.targets import get_target

    if args.fn is not None:
        return own_step.memory(args, NAMES)
    with usage_errors():
        target = get_target(args.target or "cpu")

    def seq_default(preset: str, model: ModelConfig) -> int:
        return model.max_seq_len if presets.planning_only(preset, model) or target.is_gpu else 64

    # --replay-embedding goes to the --policies that can replay (``_policies``), not to the
    # job's own policy
    step_flags = [n for n in NAMES if n != "replay_embedding"]
    job = job_from_args(args, step_flags, DEFAULTS, seq_len_default=seq_default)
    not_streamed(job, "memory")
    if job.adapters.enabled:  # what an adapter step refuses, before anything is measured
        from jaxmem.step.frozen import check_composes
        from jaxmem.step.spec import StepSpec

        with usage_errors():
            check_composes(StepSpec.of_job(job, target))
    setup = _setup(args, job, target)
    from jaxmem.planner.host import check_job

    with usage_errors():  # each policy's host bytes (analytic), before anything compiles
        for policy in setup.policies:
            check_job(dataclasses.replace(job, memory=policy), host_memory(args), target)
    check_writable(args.json)
    if "jax" in setup.frameworks:
        _check_jax(job, setup)
    console = render.console()
    for note in setup.notes:
        console.print(f"[yellow]{note}[/]")
    records, ranks = _measure(job, setup, console)
    adapters = _adapter_state(job)
    if adapters is not None:
        records = [r | {"adapter_state": adapters} for r in records]
    if records:
        render.memory_report(console, records, job, setup.planning, target, wide=args.wide)
        _trainable_note(console, records)
    if adapters is not None:
        render.adapter_state_table(console, adapters, job)
    if ranks:
        render.rank_table(console, ranks, job)
    if args.json:
        write_json_atomic(args.json, records + ranks)
        console.print(f"wrote {len(records) + len(ranks)} records to {args.json}")
    return 0


def _adapter_state(job) -> dict | None:
    """A LoRA job's parameters, gradients and optimizer state (analytic), or None without
    adapters."""
    if not job.adapters.enabled:
        return None
    from jaxmem.memory.analytic import adapter_state

    return adapter_state(job.model, job.adapters, job.optimizer, job.precision).as_record()


def _trainable_note(console, records: list[dict]) -> None:
    """With adapters, each framework's step split into frozen and trainable parameters, its
    gradients, optimizer state and saved activations, each counted from its own arrays."""
    split = [
        r
        for r in records
        if r.get("trainable_params_bytes", r["params_bytes"]) != r["params_bytes"]
    ]
    if split:
        console.print(
            f"{split[0]['adapters']}: frozen base (no gradient or optimizer state), counted from "
            "each step's arrays (jax: the compiled step's parameter, gradient and state trees; "
            "torch: its tensors); saved activations as the table above obtained them:"
        )
    for r in split:
        frozen = r["params_bytes"] - r["trainable_params_bytes"]
        saved = r["saved_activation_bytes_device"] + r["saved_activation_bytes_host"]
        console.print(
            f"  {r['framework']} {r['policy']}: parameters {format_bytes(r['params_bytes'])} "
            f"(frozen {format_bytes(frozen)}, trainable "
            f"{format_bytes(r['trainable_params_bytes'])}); grads "
            f"{format_bytes(r['grads_bytes'])}; opt state {format_bytes(r['opt_state_bytes'])}; "
            f"saved activations {format_bytes(saved)}"
        )


def _policies(args: argparse.Namespace, job) -> list:
    """``--policies``, or the config's own policy when a --config gives one."""
    if args.policies is None and args.config:
        replay = getattr(args, "replay_embedding", None)
        return [job.memory.replace(embedding=EmbeddingReplay(True)) if replay else job.memory]
    with usage_errors():
        given = list(
            dict.fromkeys(n.strip() for n in (args.policies or DEFAULT_POLICIES).split(","))
        )
        policies = [parse_policy(n) for n in given if n]
    if not policies:
        raise UsageError(f"--policies {args.policies!r}: give at least one policy")
    unroll = bool(job.memory.unroll)
    if unroll and any(p.nested for p in policies):
        raise UsageError(
            "--unroll cannot apply to nested (it runs its segments under scan: that is how "
            "it keeps about √L block inputs); drop nested from --policies or drop --unroll"
        )
    if unroll:
        policies = [p.replace(unroll=True) for p in policies]
    if job.memory.loss.chunks or job.memory.loss.tile_tokens:
        policies = [p.replace(loss=job.memory.loss) for p in policies]
    if job.memory.mlp_tile_tokens:
        policies = [p.replace(mlp_tile_tokens=job.memory.mlp_tile_tokens) for p in policies]
    if getattr(args, "replay_embedding", None):
        # to every policy that rematerialises its first block (none and nested keep its input)
        replays = [can_replay_embedding(p) for p in policies]
        if not any(replays):
            raise UsageError(
                f"--replay-embedding: none of --policies {','.join(p.name for p in policies)} "
                "rematerialises its first block (none and nested keep its input); add one that "
                "does (e.g. full, selective) or drop --replay-embedding"
            )
        policies = [
            p.replace(embedding=EmbeddingReplay(True)) if r else p
            for p, r in zip(policies, replays, strict=True)
        ]
    from jaxmem.policy import check_policy

    with usage_errors():
        for p in policies:
            p.layer_blocks(job.model.n_layers)
            check_policy(job.model, p)
    return policies


def _frameworks(args: argparse.Namespace, job, notes: list[str]) -> list[str]:
    parallel = job.parallel
    if parallel.sharded and args.frameworks is None:
        torch_too = (  # not where torch_ref cannot run the mesh
            f"; add --frameworks jax,torch for torch_ref's per-rank figures (its step run on "
            f"{parallel.devices} torchrun CPU processes)"
            if torch_mesh_refusal(parallel, job.model) is None
            else ""
        )
        mesh = parallel.mesh_text()
        notes.append(f"--mesh {mesh}: JAX plans, every figure per device{torch_too}")
        return ["jax"]
    if args.frameworks is None and not common.torch_available():
        notes.append(f"PyTorch is not installed: JAX only ({TORCH_EXTRA} adds the torch rows)")
        return ["jax"]
    frameworks = parse_names(args.frameworks or ",".join(FRAMEWORKS), FRAMEWORKS, "frameworks")
    if job.optimizer.state_memory != "device":
        if args.frameworks is None:
            notes.append(
                "--state-memory pinned_host is jaxmem's (torch_ref has no such offload): JAX only"
            )
            return ["jax"]
        if frameworks != ["jax"]:
            raise UsageError(
                f"--state-memory {job.optimizer.state_memory} is jaxmem's optimizer-state "
                "offload, which torch_ref does not implement: use --frameworks jax"
            )
    if job.adapters.base != "compute" and frameworks != ["jax"]:
        # torch_ref's records build its step on fake tensors, which cannot be packed
        why = f"--quantize-base {job.adapters.base}: torch_ref's memory rows hold a compute base"
        if args.frameworks is None:
            notes.append(f"{why}: JAX only")
            return ["jax"]
        raise UsageError(f"{why}; use --frameworks jax (jaxmem train --framework torch trains it)")
    if any(f.startswith("torch") for f in frameworks):
        need_torch("jaxmem memory --frameworks torch")
        refusal = torch_mesh_refusal(parallel, job.model) if parallel.sharded else None
        if refusal is not None:  # before anything compiles
            raise UsageError(refusal)
    return frameworks


def _setup(args: argparse.Namespace, job, target) -> Setup:
    notes: list[str] = []
    frameworks = _frameworks(args, job, notes)
    policies = _policies(args, job)
    parallel = job.parallel
    if parallel.sharded and "torch-lean" in frameworks:
        raise UsageError(
            f"--mesh {parallel.mesh_text()}: torch_ref's per-rank runs are stock PyTorch "
            "(DDP, FSDP2): use --frameworks jax,torch"
        )
    if parallel.sharded and "torch" in frameworks:
        held = PRESETS.get(job.preset)  # the per-rank runs take the preset and its attention
        if (
            presets.planning_only(job.preset, job.model)
            or target.is_gpu
            or held is None
            or job.model != held.replace(attention=job.model.attention)
        ):
            raise UsageError(
                f"--mesh {parallel.mesh_text()} --frameworks torch runs torch_ref's step on "
                f"{parallel.devices} CPU processes of this machine: use a preset it holds "
                "(tiny, small) as it is (--attention aside), without --target, or --frameworks "
                "jax to plan"
            )
        from jaxmem.parallel import check_cpu_mesh

        with usage_errors():
            check_cpu_mesh(parallel.devices, "torchrun processes")
    if frameworks == ["torch-lean"]:
        _check_lean_rows(policies)
    if job.memory.unroll and not target.is_gpu:
        notes.append(
            "--unroll on XLA:CPU: its compiler drops remat in an unrolled stack, so the plan "
            "shows no policy's savings (only none's); plan for a GPU --target"
        )
    if job.model.attention == "fused":
        notes.append(
            "attention: fused (JAX: jaxmem's blockwise kernel; PyTorch: "
            "F.scaled_dot_product_attention): no [B, H, S, S] tensor is kept or materialised"
        )
    if target.is_gpu:
        with usage_errors():
            job.check_gpu_plan()
    planning = presets.planning_only(job.preset, job.model) or target.is_gpu or parallel.sharded
    return Setup(policies, frameworks, target, planning, notes)


def _check_lean_rows(policies: list) -> None:
    """``--frameworks torch-lean`` alone: at least one policy has a row of the extension's own."""
    from jaxmem.compare.bench import lean_left_out

    why = [lean_left_out(p) for p in policies]
    if all(why):
        names = ",".join(p.name for p in policies)
        raise UsageError(
            f"--frameworks torch-lean --policies {names}: no row to measure "
            f"({'; '.join(dict.fromkeys(why))}); add a "
            "policy with named remat (selective, mlp, nested) or --frameworks torch"
        )


def _check_jax(job, setup: Setup) -> None:
    """Before JAX starts: a mesh's CPU devices; then the backend, and what it can run."""
    if not setup.target.is_gpu and job.parallel.sharded:
        from jaxmem.parallel import check_cpu_mesh
        from jaxmem.sharding import ensure_cpu_devices

        with usage_errors():
            check_cpu_mesh(job.parallel.devices)
        ensure_cpu_devices(job.parallel.devices)
    need_jax_backend()
    if setup.target.is_gpu:
        need_gpu_plan(setup.target)  # a GPU target has host memory: offload plans there
        return
    from jaxmem.memory.remat import check_backend

    with usage_errors():
        for policy in setup.policies:
            check_backend(policy)


def _measure(job, setup: Setup, console) -> tuple[list[dict], list[dict]]:
    records: list[dict] = []
    ranks: list[dict] = []
    left_out: dict[str, list[str]] = {}  # why torch-lean has no row -> those policies
    for policy in setup.policies:
        for fw in setup.frameworks:
            if fw == "torch" and job.parallel.sharded:
                why = torch_ring_policy_refusal(job.parallel, policy)
                if why is not None:
                    console.print(f"no torch row for {policy.name}: {why}", style="dim")
                    continue
                ranks += _torch_ranks(job, policy, console)
                continue
            if fw == "torch-lean":
                from jaxmem.compare.bench import lean_left_out

                why = lean_left_out(policy)
                if why is not None:
                    left_out.setdefault(why, []).append(policy.name)
                    continue
            console.print(f"measuring {fw} {policy.name}{_how(fw, setup)}...", style="dim")
            rec = _record(job, policy, fw, setup)
            records.append(rec | {"preset": job.preset, "attention": job.model.attention})
    if left_out:
        reasons = "; ".join(f"{', '.join(names)}: {why}" for why, names in left_out.items())
        console.print(f"no torch-lean row for {reasons}", style="dim")
    return records, ranks


def _how(fw: str, setup: Setup) -> str:
    if setup.planning and fw != "jax":
        return " (running the step on fake tensors: shapes only)"
    if setup.target.is_gpu:
        return f" (compiling the train step from shapes for {setup.target.description})"
    return " (compiling the train step from shapes)" if setup.planning else ""


def _record(job, policy, fw: str, setup: Setup) -> dict:
    r = job.run
    if fw == "jax":
        from jaxmem.planner.records import jax_record
        from jaxmem.step.spec import StepSpec

        with usage_errors():
            spec = StepSpec.of_job(job, setup.target).replace(policy=policy)
            return jax_record(spec, abstract=setup.planning)
    from jaxmem.compare.records import torch_record

    return torch_record(
        job.model,
        policy,
        job.precision,
        job.optimizer,
        r.batch_size,
        r.seq_len,
        translation="lean" if fw == "torch-lean" else "stock",
        fake=setup.planning,
        accum=job.accum.steps,
        adapters=job.adapters,
    )


def _torch_ranks(job, policy, console) -> list[dict]:
    from jaxmem.compare.records import torch_rank_records

    n = job.parallel.devices
    console.print(
        f"measuring torch {policy.name} (running the step on {n} torchrun CPU processes)...",
        style="dim",
    )
    try:
        return torch_rank_records(
            job.preset,
            policy.name,
            job.parallel,
            precision=job.precision.name,
            optimizer=job.optimizer.name,
            attention=job.model.attention,
            batch=job.run.batch_size,
            seq_len=job.run.seq_len,
        )
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"jaxmem memory: torch_ref's per-rank run failed: {e}", file=sys.stderr)
        raise SystemExit(EXIT_RUN_FAILED) from None

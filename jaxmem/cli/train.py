"""``jaxmem train``: train a preset with jaxmem (JAX) or torch_ref (PyTorch) under a memory
policy, with checkpoints, metrics, plots and a sample; ``--resume`` continues a run exactly."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from jaxmem.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_RUN_FAILED,
    UsageError,
    check_budget,
    need_gpu_plan,
    need_jax_backend,
    need_torch,
    parse_bytes,
    positive_int,
    search_progress,
    usage_errors,
)
from jaxmem.cli.flags import (
    FLAGS,
    RUN_FLAGS,
    SCHEDULE_FLAGS,
    STEP_FLAGS,
    TARGETS_HELP,
    add_flags,
    host_memory,
    job_from_args,
)
from jaxmem.config import ConfigError, OptimizerConfig
from jaxmem.hf.config import check_model_dir
from jaxmem.job import RunConfig
from jaxmem.policy import CHECKPOINT_NAMES, POLICIES, policy_label
from jaxmem.precision import PRECISIONS

_run = RunConfig()
NAMES = (
    *STEP_FLAGS,
    "policy",
    "save",
    "offload",
    "unroll",
    "loss_chunks",
    "loss_tile_tokens",
    "mlp_tile_tokens",
    "replay_embedding",
    "lr",
    "weight_decay",
    *SCHEDULE_FLAGS,
    "accum",
    "accum_mode",
    "seed",
    "mesh",
    "cp_attention",
    *RUN_FLAGS,
)
DEFAULTS: dict = {"preset": "small"}


def add_parser(sub) -> None:
    opt = OptimizerConfig()
    p = sub.add_parser(
        "train",
        help="train a preset (JAX or torch_ref) with checkpoints, metrics, plots and a sample",
        description="Train a decoder on the embedded corpus (the Python standard library's "
        "sources, byte tokens) or your --data, under a memory policy, precision and "
        "accumulation; checkpoints every --checkpoint-every steps and --resume continues a run "
        "exactly. Settings: the defaults < the preset < --config < flags < --set. Bad input "
        "exits with code 2 before anything is written; a run stopped by a non-finite loss, out "
        "of memory or a full disk exits with 1; Ctrl-C or SIGTERM saves the step and exits "
        "with 130.",
        epilog=f"policies: {', '.join(POLICIES)}, HEAD:K+REST, custom; precisions: "
        f"{', '.join(PRECISIONS)}; tags for --save/--offload: {', '.join(CHECKPOINT_NAMES)}",
    )
    p.add_argument(
        "--out",
        default=None,
        help="run directory: config.yaml, metrics.jsonl, loss.png, summary.json, sample.txt, "
        "checkpoints/ (default: nothing written)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    shown = {
        "policy": "none; auto: jaxmem plan chooses under --memory-budget",
        "lr": str(opt.lr),
        "weight_decay": str(opt.weight_decay),
        **{"schedule": opt.schedule, "warmup_steps": "0", "min_lr": "0.0", "clip_norm": "off"},
        "optimizer": opt.name,
        "precision": "fp32",
        "accum": "1",
        **{n: str(getattr(_run, FLAGS[n].path.split(".")[1])) for n in RUN_FLAGS[2:]},
        "framework": "jax",
        "batch_size": str(_run.batch_size),
        "seq_len": f"{_run.seq_len}, at most the model's max_seq_len",
        "data": "the embedded stdlib corpus",
        "init_from": "none: the preset's random init from --seed",
    }
    add_flags(p, NAMES, DEFAULTS, shown=shown)
    add_flags(p, ("host_memory",), title="host memory")
    g = p.add_argument_group("planning and processes")
    g.add_argument(
        "--memory-budget", default=None, help="with --policy auto: bytes per device, e.g. 2GiB"
    )
    g.add_argument(
        "--target",
        default=None,
        help=f"also plan this very step for a GPU ({TARGETS_HELP}) beside this machine's plan",
    )
    g.add_argument(
        "--coordinator", default=None, help="multi-process (JAX): HOST:PORT of process 0"
    )
    g.add_argument(
        "--num-processes",
        type=positive_int,
        default=None,
        help="multi-process (JAX): processes in this job; --mesh spans all their devices",
    )
    g.add_argument(
        "--process-id", type=int, default=None, help="multi-process (JAX): this process's index"
    )
    g.add_argument(
        "--join-timeout",
        type=positive_int,
        default=300,
        help="multi-process (JAX): seconds a process waits for the others to join before it "
        "gives up (default 300)",
    )
    g.add_argument(
        "--peer-timeout",
        type=positive_int,
        default=30,
        help="multi-process (JAX): seconds without word from another process (its heartbeat) "
        "before this one takes it for lost and exits, naming it and the checkpoint to resume "
        "from (default 30)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxmem.distributed import JoinFailed, PeerWatch, initialize, process_group, supervise

    with usage_errors():
        group = process_group(args.coordinator, args.num_processes, args.process_id)
    devices = _ask_for_cpu_devices(args, group.num_processes)
    if devices is not None:  # before joining the other processes: a bad layout fails fast
        _check_processes(devices, group.num_processes, args.mesh or f"{devices} device(s)")
    if group.multi:
        # a lost coordinator ends this process in a native abort no Python code sees: the work
        # runs in a child, and this process reports how it ended
        supervise(_native_end(group, args))
        # before anything starts JAX's backends (reading a checkpoint does); said at once, so a
        # process waiting for the others is not silent
        print(
            f"jaxmem train: process {group.process_id} of {group.num_processes}: joining the "
            f"run's processes at {group.coordinator} (up to {args.join_timeout} s, "
            "--join-timeout)",
            file=sys.stderr,
            flush=True,
        )
        try:
            initialize(group, timeout_s=args.join_timeout)
        except JoinFailed as e:
            print(f"jaxmem train: {e}", file=sys.stderr)
            return EXIT_RUN_FAILED
        watch = PeerWatch(group, args.peer_timeout, _lost(group, args)).start()
        code = EXIT_RUN_FAILED
        try:
            code = _run_joined(args, group, devices, watch)
        finally:
            watch.stop(finished=code == 0)
        return code
    return _run_joined(args, group, devices)


def _lost_line(group, args: argparse.Namespace, process: int | None, detail: str) -> str:
    """One line: which process this one lost (None: it ended itself, in a native abort), why,
    and the checkpoint to resume from."""
    from jaxmem.train.run_dir import last_verified

    me = f"process {group.process_id} of {group.num_processes}"
    if process is None:
        what = f"{me} ended in XLA's native abort ({detail})"
    else:
        who = f"process {process}" + (" (the coordinator)" if process == 0 else "")
        what = f"{me} lost {who}: {detail}"
    good = last_verified(args.out, every_process=True) if args.out else "none (no --out)"
    return f"jaxmem train: {what}; last verified checkpoint: {good}"


def _lost(group, args: argparse.Namespace):
    """What a process does when another is lost (``PeerWatch``): one line naming it and the
    checkpoint to resume from, then exit at once (the step it waits in would never end, and
    exiting normally would wait on the lost process again)."""

    def on_lost(process: int, seconds: float) -> None:
        detail = f"no word from it for {seconds:.0f} s (--peer-timeout {args.peer_timeout})"
        print(_lost_line(group, args, process, detail), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_RUN_FAILED)

    return on_lost


def _native_end(group, args: argparse.Namespace):
    """The line a supervising parent prints when its child ended in a native abort
    (``jaxmem.distributed.supervise``): XLA's client ends a process that way when the
    coordination service (process 0) goes or declares a process dead."""
    from jaxmem.distributed import lost_process

    def report(reason: str) -> str:
        process = lost_process(reason, group.process_id)
        if process == 0 and group.process_id != 0:
            detail = "its coordination service stopped answering"
        elif process is not None:
            detail = "the coordination service found it dead (its heartbeats stopped)"
        else:
            detail = reason.strip().split(". ")[0][:160]
        return _lost_line(group, args, process, detail)

    return report


def _run_joined(args: argparse.Namespace, group, devices: int | None, watch=None) -> int:
    auto = _auto_requested(args)
    if devices is not None:  # the CPU device count is settled: start JAX now, quietly (reading
        need_jax_backend()  # a checkpoint would start it, and the CUDA plugin's lines with it)
    job = resolve(args)
    if auto:
        job = _auto_policy(job, args.memory_budget)
    target = _gpu_target(args, job)
    from jaxmem.planner.host import check_job

    with usage_errors():  # the host bytes the step keeps (analytic), before anything compiles
        check_job(job, host_memory(args))
    return _train(args, job, group, target, watch)


def resolve(args: argparse.Namespace):
    """The job: defaults < the checkpoint's saved config < the run's config.yaml (both with
    --resume) < --config < flags < --set; one line for a bad value."""
    from jaxmem.data import DataError
    from jaxmem.run_layout import CheckpointError

    saved = None
    if args.resume and args.out:
        from jaxmem.backend import quiet_native_stderr
        from jaxmem.job import merge
        from jaxmem.train.checkpoint import latest_checkpoint
        from jaxmem.train.run_dir import resumed_settings

        with usage_errors(CheckpointError), quiet_native_stderr():
            _, saved, _ = latest_checkpoint(args.out)  # either framework's layout
            edited = resumed_settings(args.out, saved) if os.path.isdir(args.out) else None
        if edited is not None:  # the run's settings, as its file says them
            saved = merge(dict(saved or {}), edited)
    if args.init_from is not None:
        with usage_errors():
            check_model_dir(args.init_from, "--init-from")
    # a run started from a model directory takes its model from there unless --preset (or a
    # --config's preset) names one; then the two must agree (jaxmem.train.prepare.prepare_job)
    defaults = {**DEFAULTS, "preset": args.init_from} if args.init_from else DEFAULTS
    return job_from_args(args, NAMES, defaults, saved=saved, errors=(DataError, CheckpointError))


def _auto_requested(args: argparse.Namespace) -> bool:
    if args.policy != "auto":
        if args.memory_budget is not None:
            raise UsageError("--memory-budget goes with --policy auto")
        return False
    if args.memory_budget is None:
        raise UsageError("--policy auto needs --memory-budget (e.g. 2GiB): the bytes to fit")
    if args.resume:
        raise UsageError(
            "--policy auto chooses a policy when a run starts; --resume continues with the one "
            "in the run's config.yaml: drop --policy auto"
        )
    if args.save or args.offload or args.accum is not None:
        raise UsageError(
            "--policy auto chooses the policy and the microbatch count itself: drop "
            "--save/--offload/--accum (or choose them yourself without auto)"
        )
    args.policy = None
    return True


def _ask_for_cpu_devices(args: argparse.Namespace, processes: int = 1) -> int | None:
    """JAX fixes its CPU device count when its backends start, and reading a checkpoint starts
    them: ask for a mesh's devices first, from --mesh or the run's config.yaml (resuming).
    Returns the mesh's device count, or None when a config file or --set may still set it."""
    import yaml

    from jaxmem.parallel import check_cpu_mesh, parse_mesh
    from jaxmem.sharding import ensure_cpu_devices

    mesh_elsewhere = args.config or any(a.startswith("parallel.") for a in args.set or ())
    devices = None if mesh_elsewhere else 1
    if args.mesh is not None:
        try:
            devices = parse_mesh(args.mesh).devices
        except ConfigError:
            return None  # resolving the job reports it
    elif args.resume and args.out:
        try:
            with open(os.path.join(args.out, "config.yaml")) as f:
                devices = int(((yaml.safe_load(f) or {}).get("parallel") or {}).get("devices", 1))
        except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
            return None  # no readable config: resolving reads the checkpoint's and says
    if devices is not None and devices > 1 and args.framework != "torch":
        with usage_errors():
            check_cpu_mesh(max(1, devices // processes))
        ensure_cpu_devices(max(1, devices // processes))  # this process's share of the mesh
    return devices


def _check_processes(devices: int, processes: int, mesh_text: str) -> None:
    if processes > 1 and devices % processes:
        raise UsageError(
            f"--num-processes {processes} needs a --mesh spanning every process's devices (got "
            f"{mesh_text}): e.g. --mesh fsdp={2 * processes}"
        )


def _auto_policy(job, budget_text: str):
    """``jaxmem plan`` on this machine's backend at ``budget_text``: the job with the chosen
    policy and microbatch count (the run's config.yaml then records them)."""
    if job.run.framework != "jax":
        raise UsageError("--policy auto plans jaxmem's step: use --framework jax")
    if job.accum.mode != "scan":
        raise UsageError("--policy auto plans the scanned accumulation: drop --accum-mode")
    refusal = _adapters_refusal(job)  # before any trace: the plan compiles this job's adapters
    if refusal is not None:
        raise UsageError(refusal)
    need_jax_backend()
    import jaxmem.cli.render as render
    from jaxmem.memory.targets import LOCAL
    from jaxmem.planner.search import search, smallest_plan
    from jaxmem.planner.space import PlanSpace, Problem

    with usage_errors():
        budget = parse_bytes(budget_text, "--memory-budget")
    par = job.parallel
    n = par.devices
    space = PlanSpace(  # the run's own mesh: its strategy, tensor and context axes as given
        policies=("none", "selective", "mlp", "full", "nested"),
        mix=("none", "selective", "full"),
        accum=tuple(m for m in (1, 2, 4, 8) if job.run.batch_size % (m * par.data) == 0),
        state_memory=("device",),
        strategies=(par.strategy,),
        tensor=(par.tp,),
        context=(par.cp,),
        cp_attention=par.cp_attention,
        sequence_parallel=par.sequence_parallel,
        precisions=(job.precision.name,),
    )
    problem = Problem(
        job.model, job.run.batch_size, job.run.seq_len, LOCAL, budget, job.optimizer, n,
        adapters=job.adapters,
    )  # fmt: skip
    check_budget(problem, space, budget_text, "--memory-budget", "--mesh fsdp=N")
    console = render.console()
    console.print(f"--policy auto: planning on this backend under {budget_text} ...", style="dim")
    result = search(problem, space, progress=search_progress(console))
    if result.chosen is None:
        smallest = smallest_plan(result)
        found = (
            f"{smallest.candidate.describe()} at {smallest.compiled / 2**20:,.1f} MiB"
            if smallest is not None
            else "nothing compiled"
        )
        raise UsageError(
            f"--policy auto: no configuration fits --memory-budget {budget_text} on this "
            f"backend; the smallest plan found is {found} ({result.compiler})"
        )
    chosen = result.chosen.candidate
    console.print(
        f"--policy auto chose policy {policy_label(chosen.policy)} with {chosen.accum} "
        "microbatch(es): "
        f"{result.chosen.compiled / 2**20:,.1f} MiB planned ({result.compiler}), cheapest of "
        f"{len(result.outcomes)} on the lattice by estimated cost; written to config.yaml",
    )
    accum = dataclasses.replace(job.accum, steps=chosen.accum)
    return dataclasses.replace(job, memory=chosen.policy, accum=accum)


def _gpu_target(args: argparse.Namespace, job):
    """``--target``: the GPU this very step is also planned for (None: this machine only)."""
    if args.target in (None, "cpu"):
        return None
    from jaxmem.memory.targets import get_target

    with usage_errors():
        job.check_gpu_plan()
        if job.optimizer.state_memory != "device":
            raise ConfigError(
                f"--target {args.target}: a deviceless compile drops host memory kinds on the "
                "step's arguments; see host-resident optimizer state with jaxmem memory "
                "--target ... --state-memory pinned_host (counted analytically there)"
            )
        target = get_target(args.target)
    need_gpu_plan(target)
    return target


def _framework(job, group):
    """The framework module that trains ``job``, and whether this process is the primary."""
    primary = group.primary
    if job.run.framework == "torch":
        need_torch("jaxmem train --framework torch")
        need_jax_backend()  # jaxmem makes the initial weights both frameworks start from
        from jaxmem.compare import torch_run as framework

        with usage_errors():  # one torchrun process per device of the mesh
            primary = framework.launch_for(job).primary
        return framework, primary
    if job.parallel.sharded:  # a mesh given in a --config file: ask before JAX starts
        from jaxmem.parallel import check_cpu_mesh
        from jaxmem.sharding import ensure_cpu_devices

        with usage_errors():
            check_cpu_mesh(max(1, job.parallel.devices // group.num_processes))
        ensure_cpu_devices(max(1, job.parallel.devices // group.num_processes))
    need_jax_backend()
    from jaxmem.train import run as framework

    return framework, primary


def _adapters_refusal(job) -> str | None:
    """Why ``job``'s adapters cannot train (one line, before any data is read), or None."""
    if not job.adapters.enabled:
        return None
    if job.run.framework != "jax":
        from jaxmem.compare.torch_run import torch_adapter_refusal

        return torch_adapter_refusal(job)
    from jaxmem.step.frozen import refusal
    from jaxmem.step.spec import StepSpec

    return refusal(StepSpec.of_job(job))


def _train(args: argparse.Namespace, job, group, target, watch=None) -> int:
    from jaxmem.data import DataError
    from jaxmem.job import torch_tensor_parallel_refusal
    from jaxmem.run_layout import CheckpointError
    from jaxmem.train.loop import RunFailed, RunInterrupted

    refusal = torch_tensor_parallel_refusal(job) if job.run.framework == "torch" else None
    if refusal is None:
        refusal = _adapters_refusal(job)
    if refusal is not None:
        raise UsageError(refusal)
    framework, primary = _framework(job, group)
    if group.multi and job.run.framework != "jax":
        raise UsageError(
            "--num-processes > 1 runs JAX's multi-process runtime: use --framework jax"
        )
    _check_processes(job.parallel.devices, group.num_processes, job.parallel.mesh_text())
    try:
        with usage_errors(DataError, CheckpointError):
            prepared = framework.prepare(job, args.out, resume=args.resume, primary=primary)
        if group.multi or (job.parallel.sharded and job.run.framework == "torch"):
            from rich.console import Console

            # process 0 owns the run directory and the console; the others train beside it
            framework.run_training(prepared, console=Console(quiet=not primary))
        elif target is not None:
            framework.run_training(prepared, target=target)
        else:
            framework.run_training(prepared)
    except (ConfigError, DataError, CheckpointError) as e:
        raise UsageError(str(e)) from None
    except RunFailed as e:
        if job.run.framework == "jax":
            from jaxmem.train.checkpoint import silence_background_errors

            silence_background_errors()  # orbax's threads would repeat a failed save at exit
        if e.said:
            print(f"jaxmem train: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except RunInterrupted as e:
        print(f"jaxmem train: {e}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("jaxmem train: interrupted; nothing saved since the last checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if watch is not None and any(word in str(e) for word in ("Gloo", "NCCL", "collective")):
            # a collective failed (gloo reports a peer's closed connection at once): when a
            # peer is gone, name it and exit (PeerWatch.confirm); else the error stands
            watch.confirm()
        raise
    return 0

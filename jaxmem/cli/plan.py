"""``jaxmem plan``: the cheapest configuration that fits a memory budget, proved by compiling it
for the target; prints the ``jaxmem train`` commands that run it, complete."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from typing import Any

import jaxmem.cli.presets as presets
import jaxmem.cli.render as render
from jaxmem.cli.common import (
    UsageError,
    check_budget,
    check_writable,
    int_list,
    mib,
    need_gpu_plan,
    need_jax_backend,
    non_negative_int,
    parse_bytes,
    positive_float,
    positive_int,
    search_progress,
    usage_errors,
)
from jaxmem.cli.common import names as parse_names
from jaxmem.cli.flags import (
    ADAPTER_FLAGS,
    MODEL_FLAGS,
    add_flags,
    flag_settings,
    host_memory,
    job_argv,
    max_seq_len,
    not_streamed,
)
from jaxmem.files import write_json_atomic
from jaxmem.job import (
    torch_host_memory_refusal,
    torch_mesh_refusal,
    torch_tensor_parallel_refusal,
)
from jaxmem.parallel import STRATEGIES, ParallelConfig
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS

# what lets more of a step's arguments leave the device, said when a budget is under them
LEAVE = "--mesh fsdp=N, --precisions, --state-offload on a GPU target"
NAMES = (
    *MODEL_FLAGS,
    "precision",
    "optimizer",
    "batch_size",
    "seq_len",
    "mesh",
    "cp_attention",
    *ADAPTER_FLAGS,
)
DEFAULTS = {"preset": "small", "run": {"batch_size": 8}}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="the cheapest training configuration that fits a memory budget, proved by "
        "compiling it for the target",
        description="Searches the stack's memory policy (presets, per-tag policies on one "
        "block's bytes/FLOPs frontier, and the first K blocks under one preset with the rest "
        "under another: HEAD:K+REST), the microbatch count, "
        "optimizer-state offload (GPU targets), the data-parallel strategy and the tensor and "
        "context sizes (with --mesh) and, when allowed, the precision; predicts each "
        "candidate's bytes from a few compiles, then "
        "compiles candidates for --target in order of estimated cost until one fits --budget, "
        "and prints the jaxmem train commands that run it. Exit 2 when nothing fits, naming "
        "the smallest plan found.",
    )
    shown = {"seq_len": "the model's max_seq_len", "target": "cpu"}
    add_flags(p, NAMES, DEFAULTS, shown=shown)
    add_flags(p, ("target", "wide", "json", "host_memory"), shown=shown, title="the plan")
    g = p.add_argument_group("the search")
    g.add_argument(
        "--budget",
        default=None,
        help="bytes per device, e.g. 70GiB or 200MiB (default for a GPU target: 90%% of its "
        "memory; required for cpu)",
    )
    g.add_argument("--strategies", default="dp,zero1,fsdp", help="with --mesh (default all)")
    g.add_argument(
        "--tp",
        default=None,
        help="with --mesh: tensor-parallel sizes to search, comma-separated (default: every "
        "size that divides the mesh's devices and the model's heads, MLP and sequence; 1: "
        "none; a --mesh with tp=T: T alone)",
    )
    g.add_argument(
        "--cp",
        default=None,
        help="with --mesh: context-parallel sizes to search, comma-separated (the sequence "
        "split over devices; default: every size that divides the mesh's devices and cuts the "
        "sequence into 2 x cp equal chunks; 1: none; a --mesh with cp=C: C alone). Attention "
        "over it runs as --cp-attention says, by default round a ring under --attention fused",
    )
    _lattice_flags(g)
    g.add_argument(
        "--slack",
        type=positive_float,
        default=0.20,
        help="compile a candidate predicted over the budget by at most this fraction (default "
        "0.20: the memory model's measured error on mixed stacks)",
    )
    g.add_argument("--max-compiles", type=positive_int, default=40, help="default 40")
    g.add_argument(
        "--confirm",
        type=non_negative_int,
        default=None,
        help="GPU targets: once a candidate fits, compile up to this many more that the "
        "estimate before compiling rates faster than its compiled plan; one that fits and is "
        "more than 2%% faster by its compiled plan's estimate is chosen instead (default 2; "
        "0: the first fit)",
    )
    g.add_argument("--top", type=positive_int, default=15, help="rows shown (default 15)")
    g = p.add_argument_group("the longest sequence")
    g.add_argument(
        "--longest",
        action="store_true",
        help="instead: the longest sequence the model trains at batch 1 (full remat, block "
        "inputs offloaded to host memory on a GPU target within --host-memory, the loss in "
        "tiles, with --state-offload the stack streamed or the state in host memory), each "
        "answer shown by two "
        "compiled plans (fits at N, over at N + --seq-step)",
    )
    g.add_argument(
        "--seq-cap",
        type=positive_int,
        default=1 << 24,
        help="with --longest: the longest sequence tried, in tokens (default 16,777,216)",
    )
    g.add_argument(
        "--seq-step",
        type=positive_int,
        default=1024,
        help="with --longest: the search's granularity in tokens (default 1024)",
    )
    p.set_defaults(func=run)


def _lattice_flags(g) -> None:
    """What the search may choose among (beside --budget, --strategies and --tp)."""
    g.add_argument(
        "--policies",
        default="none,selective,mlp,offload,full,nested",
        help="presets searched (default all; offload only on GPU targets: XLA:CPU erases it)",
    )
    g.add_argument(
        "--no-mix",
        dest="mix",
        action="store_false",
        help="only whole stacks (default: also HEAD:K+REST stacks, of two presets or two "
        "per-tag policies)",
    )
    g.add_argument(
        "--no-tags",
        dest="tags",
        action="store_false",
        help="only presets and their mixes (default: also per-tag policies, the Pareto frontier "
        "of one block's tags by bytes and FLOPs, each over the whole stack, and mixes of two "
        "neighbours on its lower convex hull)",
    )
    g.add_argument(
        "--no-unroll",
        dest="unroll_search",
        action="store_false",
        help="only scanned stacks (default on GPU targets: each stack also unrolled, the same "
        "FLOPs in another plan, chosen where the scanned one does not fit)",
    )
    g.add_argument(
        "--loss-chunks-search",
        dest="loss_chunks_search",
        action="store_true",
        help="also each stack with the LM head and loss in up to 8 chunks and in tiles of "
        "1,024-16,384 tokens that cut the sequence finer (--loss-chunks: the same FLOPs, no "
        "logits kept; chosen where the whole loss does not fit). Default: the whole loss only",
    )
    g.add_argument(
        "--mlp-tiles-search",
        dest="mlp_tiles_search",
        action="store_true",
        help="also full (and full with its inputs on host) with each block's MLP in sequence "
        "tiles of 1,024-16,384 tokens (--mlp-tile-tokens: the same FLOPs, one tile's "
        "intermediates at a time; chosen where the whole MLP does not fit). Default: not "
        "searched",
    )
    g.add_argument(
        "--replay-embedding-search",
        dest="replay_embedding_search",
        action="store_true",
        help="also each stack whose first block is rematerialised with the embedding lookup "
        "replayed in its backward (--replay-embedding: the same FLOPs, one block input fewer; "
        "GPU targets). Default: not searched (its twins compile fits of their own)",
    )
    g.add_argument(
        "--no-offload-inputs",
        dest="offload_inputs",
        action="store_false",
        help="not full with every block's input in host memory (default on GPU targets: "
        "searched where --host-memory holds the inputs)",
    )
    g.add_argument("--accum", default="1,2,4,8", help="microbatch counts (default 1,2,4,8)")
    g.add_argument(
        "--state-offload",
        action="store_true",
        help="also search host memory (GPU targets): optimizer state in pinned_host (counted as "
        "the plan minus the state: a deviceless compile drops argument memory kinds) and the "
        "stack streamed through host memory (--stream), updated on the device or in host "
        "memory (--stream-update host), weighed by estimated link and host-memory time",
    )
    g.add_argument(
        "--precisions",
        default=None,
        help=f"precisions the search may choose ({', '.join(PRECISIONS)}; default: --precision "
        "only, since precision changes the numbers)",
    )


def run(args: argparse.Namespace) -> int:
    from jaxmem.memory.targets import get_target
    from jaxmem.planner.host import host_limit
    from jaxmem.planner.search import default_budget
    from jaxmem.planner.space import Problem

    job, batch, form = template_job(args)
    not_streamed(job, "plan")
    _check_adapters(job)
    with usage_errors():
        target = get_target(args.target or "cpu")
        if args.budget is not None:
            budget, budget_source = parse_bytes(args.budget, "--budget"), "--budget"
        else:
            budget, budget_source = default_budget(target)
        space = _space(args, job, form)
        host_allowed, host_source = host_limit(host_memory(args))
    presets.check("plan", job.preset, job.model)
    check_writable(args.json)
    problem = Problem(
        job.model,
        batch,
        job.run.seq_len,
        target,
        budget,
        job.optimizer,
        job.parallel.devices,
        slack=args.slack,
        adapters=job.adapters,
        host_memory_bytes=host_allowed,
    )
    if not args.longest:
        _check_layouts(problem, space)
    elsewhere = "plan for a GPU's memory with --target (h100, ..., or a captured .txtpb)"
    check_budget(problem, space, args.budget, "--budget", LEAVE, elsewhere)
    if args.longest:
        from jaxmem.cli.plan_longest import longest

        sources = (budget_source, host_source)
        return longest(args, job, problem, sources, _start_backend, shell_lines)
    _start_backend(job, target)
    return _search_and_report(args, job, problem, space, budget_source)


def _check_layouts(problem, space) -> None:
    """One line, before anything compiles, when no mesh layout searched can run the step: none
    the model and sequence allow, or none whose data axis splits the batch."""
    from jaxmem.planner.space import mesh_layouts

    n, batch = problem.devices, problem.batch
    layouts = mesh_layouts(problem, space)
    searched = f"tp {_sizes(space.tensor)} x cp {_sizes(space.context)}"
    if not layouts:
        raise UsageError(
            f"no layout of the mesh's {n} device(s) searched ({searched}) splits this model and "
            f"its {problem.seq_len} positions (whole heads over tp, 2 x cp equal chunks over "
            "cp): give --tp and --cp sizes that do"
        )

    def splits(layout):
        return batch % (n // (layout[0] * layout[1])) == 0

    adapters = problem.adapters
    dropout = adapters.dropout if adapters.enabled else 0.0
    if dropout and not any(splits(lay) for lay in layouts if lay[1] == 1):
        if any(splits(lay) for lay in layouts):  # only a context axis splits it
            raise UsageError(
                f"batch {batch} splits over the mesh's {n} device(s) only with a context axis, "
                f"which adapter dropout {dropout} does not run with (its masks are drawn per row "
                "in position order): set the adapters' dropout to 0, or use a batch a data axis "
                "splits"
            )
    if not any(splits(lay) for lay in layouts):
        data = sorted({n // (tp * cp) for tp, cp in layouts})
        raise UsageError(
            f"batch {batch} does not split over the data axis of any layout searched ({searched}"
            f" on {n} device(s): data axes of {_sizes(data)}): use a batch one of them "
            "divides, or let a tensor or context axis take the devices (--tp, --cp)"
        )


def _sizes(sizes) -> str:
    return ",".join(map(str, sizes))


def template_job(args: argparse.Namespace) -> tuple[Any, int, str | None]:
    """The command's job, the batch it plans and the context-parallel attention it names for a
    searched context axis (None: not named). The mesh gives the devices (and fixes an axis it
    names as tp=T or cp=C); the search chooses the layout and the microbatches, so a batch
    that does not split over the mesh's own data axis (batch 1 over ``--mesh fsdp=8``, where
    only a context or tensor axis can take the devices) is planned: the job is then a template
    at ``batch x devices x accum`` rows and each candidate's job carries the planned batch
    (``candidate_job``); and ``--cp-attention`` over a mesh without a context axis says how a
    searched one runs. Any other bad value: the job's own one line."""
    from jaxmem.config import ConfigError
    from jaxmem.job import JobConfig, layered_config

    def resolve(raw):
        return JobConfig.from_dict(raw, seq_len_default=max_seq_len)

    with usage_errors():
        layered = layered_config(
            defaults=DEFAULTS, config_file=getattr(args, "config", None),
            flags=flag_settings(args, NAMES), assignments=getattr(args, "set", None) or (),
        )  # fmt: skip
        mesh = dict(layered.get("parallel") or {})
        held = None
        if not args.longest and mesh.get("cp", 1) == 1 and "cp_attention" in mesh:
            held = mesh.pop("cp_attention")  # for the searched context axis
            layered = {**layered, "parallel": mesh}
        try:
            job = resolve(layered)
            batch = job.run.batch_size
        except ConfigError as first:
            devices = mesh.get("devices", 1)
            if not mesh or args.longest or not isinstance(devices, int) or devices < 1:
                raise
            # the job on one device: any other bad value says so
            alone = resolve({k: v for k, v in layered.items() if k != "parallel"})
            rows = alone.run.batch_size * alone.accum.steps * devices
            try:
                run = {**(layered.get("run") or {}), "batch_size": rows}
                job = resolve({**layered, "run": run})
            except ConfigError:
                raise first from None
            batch = alone.run.batch_size
        if held is not None:  # its name checked as a mesh with a context axis checks it
            ParallelConfig(devices=2, cp=2, cp_attention=held)
            if held == "ring" and job.model.attention != "fused":
                raise UsageError(
                    "--cp-attention ring merges each device's partial softmax, which the fused "
                    f"attention does; the model's attention is {job.model.attention!r}: add "
                    "--attention fused"
                )
    return job, batch, held


def _check_adapters(job) -> None:
    """An adapter job's options the search cannot vary away, refused in one line before any
    trace (``jaxmem.step.frozen.refusal``: streaming, an accumulation mode; the mesh's strategy
    is searched, so only what the mesh itself fixes is checked here)."""
    if not job.adapters.enabled:
        return
    from jaxmem.step.frozen import refusal
    from jaxmem.step.spec import StepSpec

    spec = StepSpec.of_job(job)
    if spec.parallel.sharded:  # the strategy is searched (--strategies): judge the mesh by dp
        spec = spec.replace(parallel=dataclasses.replace(spec.parallel, strategy="dp"))
    line = refusal(spec)
    if line is not None:
        raise UsageError(f"jaxmem plan: {line}")


def _space(args: argparse.Namespace, job, form: str | None = None):
    from jaxmem.cli.plan_longest import planned_cp_attention
    from jaxmem.planner.longest import TILE_TOKENS
    from jaxmem.planner.space import PlanSpace

    policies = tuple(parse_names(args.policies, list(POLICIES), "policies"))
    return PlanSpace(
        policies=policies,
        mix=tuple(p for p in ("none", "selective", "offload", "full") if p in policies)
        if args.mix
        else (),
        accum=int_list(args.accum, "--accum"),
        tags=args.tags,
        tag_mixes=args.mix,
        unroll=args.unroll_search,
        loss_chunks=8 if args.loss_chunks_search else 0,
        loss_tiles=TILE_TOKENS if args.loss_chunks_search else (),
        mlp_tiles=TILE_TOKENS if args.mlp_tiles_search else (),
        replay_embedding=args.replay_embedding_search,
        offload_inputs=args.offload_inputs,
        state_memory=("device", "pinned_host", "stream", "stream-host")
        if args.state_offload
        else ("device",),
        strategies=tuple(parse_names(args.strategies, list(STRATEGIES), "strategies")),
        tensor=_tensor_sizes(args, job),
        context=_context_sizes(args, job),
        cp_attention=form or planned_cp_attention(args, job),
        sequence_parallel=job.parallel.sequence_parallel,
        precisions=tuple(
            parse_names(args.precisions or job.precision.name, list(PRECISIONS), "precisions")
        ),
    )


def _tensor_sizes(args: argparse.Namespace, job) -> tuple[int, ...]:
    if job.parallel.context_parallel and args.longest:  # --longest plans the axis as given
        return (1,)
    return _axis_sizes(args.tp, "--tp", job.parallel.devices, job.parallel.tp)


def _context_sizes(args: argparse.Namespace, job) -> tuple[int, ...]:
    if args.longest:  # --longest plans the mesh's context axis as given
        return (job.parallel.cp,)
    return _axis_sizes(args.cp, "--cp", job.parallel.devices, job.parallel.cp)


def _axis_sizes(text: str | None, flag: str, n: int, given: int) -> tuple[int, ...]:
    """The sizes of one mesh axis the search tries: ``flag``'s list (each dividing the ``n``
    devices), else the mesh's own size where it names the axis, else every divisor of ``n``
    (``space.mesh_layouts`` keeps those the model, the sequence and the other axis allow)."""
    if text is not None:
        sizes = int_list(text, flag)
        bad = [t for t in sizes if n % t]
        if bad:
            raise UsageError(f"{flag} {text}: {bad} do not divide the mesh's {n} device(s)")
        return sizes
    if given > 1:
        return (given,)
    return tuple(t for t in range(1, n + 1) if n % t == 0)


def _start_backend(job, target) -> None:
    """Start JAX for the plan: a GPU target's deviceless compiler, or this backend with the
    mesh's CPU devices (asked for before JAX starts: it cannot add them after)."""
    if not target.is_gpu and job.parallel.sharded:
        from jaxmem.parallel import check_cpu_mesh
        from jaxmem.sharding import ensure_cpu_devices

        with usage_errors():
            check_cpu_mesh(job.parallel.devices)
        ensure_cpu_devices(job.parallel.devices)
    need_jax_backend()
    if target.is_gpu:
        need_gpu_plan(target)


def _search_and_report(args, job, problem, space, budget_source: str) -> int:
    from jaxmem.planner.search import search

    out = render.console()
    where = (
        f"{problem.devices} x {problem.target.name}" if problem.devices > 1 else problem.target.name
    )
    lora = f", {job.adapters.label()}" if job.adapters.enabled else ""
    out.print(
        f"planning {job.preset}{lora}, batch {problem.batch} x seq {job.run.seq_len}, "
        f"{job.optimizer.name}, on {where}: budget {mib(problem.budget_bytes)} MiB per device "
        f"({budget_source})",
        style="dim",
    )
    result = search(
        problem,
        space,
        max_compiles=args.max_compiles,
        **({} if args.confirm is None else {"confirm": args.confirm}),
        progress=search_progress(out),
    )
    if job.adapters.enabled and args.state_offload:
        out.print(
            "--state-offload: an adapter job keeps its (small) optimizer state on the device; "
            "host placements and streaming are not searched for it",
            style="dim",
        )
    if result.chosen is None:
        _nothing_fits(args, result, where)
    title = (
        f"jaxmem plan: {job.preset}{lora}, batch {problem.batch} x {job.run.seq_len} on "
        f"{where}, budget {mib(problem.budget_bytes)} MiB per device"
    )
    render.plan_table(out, result, title, args.top, args.wide)
    commands = _commands(job, result)
    _summary(out, args, job, result, commands)
    if args.json:
        write_json_atomic(args.json, _json(job, problem, result, budget_source, commands))
        out.print(f"wrote the plan to {args.json}")
    return 0


def _nothing_fits(args, result, where: str) -> None:
    from jaxmem.planner.search import smallest_plan

    budget = result.problem.budget_bytes
    if result.stopped:
        raise UsageError(
            f"the search stopped after --max-compiles {args.max_compiles} compiles with no "
            f"candidate under {mib(budget)} MiB per device; raise --max-compiles"
        )
    smallest = smallest_plan(result)
    found = (
        f"the smallest plan found is {smallest.candidate.describe()} at "
        f"{mib(smallest.compiled)} MiB ({result.compiler})"
        if smallest is not None
        else "no candidate was compiled"
    )
    reached = sum(o.status != "not reached" for o in result.outcomes)
    raise UsageError(
        f"no configuration of the {reached} tried fits {mib(budget)} MiB per device on "
        f"{where}: {found}; raise --budget, {_what_else(args, result.problem)}"
    )


def _what_else(args, problem) -> str:
    """What else may fit: more devices, or more of the lattice (only what the job can use: an
    adapter job keeps its state on the device, and a packed base is not sharded)."""
    from jaxmem.planner.longest import TILE_TOKENS

    adapters = problem.adapters
    more = ["--accum", "--precisions"]
    if not adapters.enabled:
        more.append("--state-offload")
    if not args.loss_chunks_search:
        more.append("--loss-chunks-search")
    # MLP tiles where one divides the sequence and full (or its inputs on host) is searched
    seq, names = problem.seq_len, [p.strip() for p in args.policies.split(",")]
    whole = {"full", "full-host"} & set(names) or getattr(args, "offload_inputs", False)
    tiles = whole and any(seq % t == 0 and t < seq for t in TILE_TOKENS)
    if tiles and not args.mlp_tiles_search:
        more.append("--mlp-tiles-search")
    devices = "" if adapters.base != "compute" else "add devices (--mesh fsdp=N) or "
    return f"{devices}allow more ({', '.join(more)})"


def _commands(job, result) -> dict[str, str | None]:
    """The chosen configuration as commands that run it, each complete (tested by running)."""
    from jaxmem.planner.space import candidate_job

    problem = result.problem
    chosen = candidate_job(job, result.chosen.candidate, problem.devices, problem.batch)
    argv = job_argv(chosen)
    jax_cmd = shlex.join(["jaxmem", "train", *argv])
    refusal = (
        torch_mesh_refusal(chosen.parallel, chosen.model)
        or torch_tensor_parallel_refusal(chosen)
        or torch_host_memory_refusal(chosen)
    )
    if refusal is None and chosen.adapters.enabled:
        from jaxmem.compare.torch_run import torch_adapter_refusal

        refusal = torch_adapter_refusal(chosen)
    if refusal is not None:
        return {"jax": jax_cmd, "torch": None, "torch_note": refusal}
    torch = ["jaxmem", "train", "--framework", "torch", *argv]
    if chosen.parallel.sharded:
        n = chosen.parallel.devices
        torch = ["torchrun", "--standalone", f"--nproc_per_node={n}", "--no-python", *torch]
    return {"jax": jax_cmd, "torch": shlex.join(torch), "torch_note": None}


def _torch_apis(cand) -> str:
    """What torch_ref runs ``cand`` with, in words: stock APIs, its extensions named."""
    extensions = [
        what
        for what, on in (
            ("its context axis (torch_ref.context)", cand.cp > 1),
            ("its fused q/k/v split (HeadAlignedColwise)", cand.tp > 1),
        )
        if on
    ]
    if not extensions:
        return "torch_ref, stock APIs"
    return f"torch_ref, stock APIs; extensions: {' and '.join(extensions)}"


def shell_lines(command: str, width: int = render.DEFAULT_WIDTH) -> str:
    """``command`` as shell lines of at most ``width`` columns, continued with `` \\``, a flag
    and its value kept together: copied into a shell, it runs as one command."""
    words = shlex.split(command)
    groups: list[str] = []
    for word in words:
        quoted = shlex.quote(word)
        if groups and groups[-1].startswith("-") and " " not in groups[-1] and word[:1] != "-":
            groups[-1] += " " + quoted
        else:
            groups.append(quoted)
    lines, line = [], ""
    for group in groups:
        if line and len(line) + 1 + len(group) + 2 > width:
            lines.append(line + " \\")
            line = "    " + group
        else:
            line = f"{line} {group}" if line else group
    return "\n".join([*lines, line])


def _summary(out, args, job, result, commands: dict) -> None:
    from jaxmem.memory.targets import rates_for

    problem, chosen = result.problem, result.chosen.candidate
    error = result.max_fit_error()
    skipped = sum(o.status == "over (predicted)" for o in result.outcomes)
    floored = sum(o.status.startswith("over (family floor") for o in result.outcomes)
    timing = (
        f"nominal cost {chosen.seconds:.4f} (an order, not a time)"
        if chosen.estimate is None
        else chosen.estimate.line()
    )
    out.print(
        f"chosen: [bold]{chosen.describe()}[/]: {mib(result.chosen.compiled)} MiB per device "
        f"(compiled plan: {result.compiler}), {chosen.flops / 1e12:,.3f} TFLOP per device and "
        f"step, {timing}"
    )
    if result.chosen.plan_time:
        out.print(f"  its compiled plan prices at {result.chosen.plan_time['line']}", style="dim")
    slower = [o for o in result.outcomes if o.status == "fits (compiled estimate not faster)"]
    if slower:
        runners = ", ".join(
            f"{o.candidate.describe()} {o.plan_time['seconds']:.3g} s" for o in slower
        )
        out.print(
            f"  also fit, not faster by their compiled plans' estimates (within 2 %: a tie, the "
            f"first fit kept): {runners}",
            style="dim",
        )
    checked = (
        f"erred by at most {error:.1%} on the compiled candidates"
        if error is not None
        else "was not checked (nothing predicted was compiled)"
    )
    if error is not None and error > args.slack:
        checked += f" [yellow](more than --slack {args.slack:.0%}: a skipped one may fit)[/]"
    model = (
        f"no memory model (it is fitted at two depths of at least 2 blocks): a model of "
        f"{job.model.n_layers} layer{'s' if job.model.n_layers > 1 else ''} is compiled whole, "
        "each candidate at its own depth"
        if problem.compiled_whole
        else f"the memory model ({result.fit_compiles} compiles at depths "
        f"{problem.fit_depths[0]} and {problem.fit_depths[1]}) {checked}"
    )
    out.print(
        f"{len(result.outcomes)} candidates; {result.candidate_compiles} compiled at depth "
        f"{job.model.n_layers}, {skipped} skipped as predicted over the budget, {floored} "
        f"because their family's leanest stack (full/offload) compiled over it; {model}",
        style="dim",
    )
    out.print("run it:", style="bold")
    out.print(shell_lines(commands["jax"]), soft_wrap=True, highlight=False, markup=False)
    if commands["torch"]:
        out.print(f"the same in PyTorch ({_torch_apis(result.chosen.candidate)}):", style="bold")
        out.print(shell_lines(commands["torch"]), soft_wrap=True, highlight=False, markup=False)
    else:
        out.print(f"PyTorch: not in torch_ref: {commands['torch_note']}")
    rates = rates_for(problem.target)
    host = (
        f"; a host update's bytes at {rates.host_memory / 1e9:.0f} GB/s: {rates.host_source}"
        if result.chosen.candidate.stream == "host"
        else ""
    )
    if chosen.estimate is not None:
        out.print(
            f"cost: an estimated step time, not a measurement: {chosen.estimate.assumptions}{host}",
            style="dim",
        )
    else:
        out.print(
            "cost: the local backend's order (matmul FLOPs at a nominal rate, bytes over nominal "
            f"links): {rates.source}{host}",
            style="dim",
        )


def cost_assumptions(target) -> str:
    """The step-time model's assumptions for ``target`` (a GPU's)."""
    from jaxmem.memory.step_time import DEFAULT, Device

    device = Device.of(target)
    return f"{DEFAULT.text()}; rates: {device.rates.source}" if device else ""


def _json(job, problem, result, budget_source: str, commands: dict) -> dict:
    from jaxmem.memory.targets import rates_for

    return {
        "preset": job.preset,
        "batch": problem.batch,
        "seq_len": job.run.seq_len,
        "adapters": job.to_dict()["adapters"] if job.adapters.enabled else None,
        "target": problem.target.name,
        "devices": problem.devices,
        "budget_bytes": problem.budget_bytes,
        "budget_source": budget_source,
        "compiler": result.compiler,
        "chosen": result.chosen.as_dict(),
        "commands": commands,
        "candidates": [o.as_dict() for o in result.outcomes if o.status != "not reached"],
        "lattice_size": len(result.outcomes),
        "fit_compiles": result.fit_compiles,
        "candidate_compiles": result.candidate_compiles,
        "max_fit_error": result.max_fit_error(),
        "cost_source": (
            "the local backend's order, not a time: " + rates_for(problem.target).source
            if not problem.target.is_gpu
            else "estimate: " + cost_assumptions(problem.target)
        ),
        "host_update_source": "estimate: " + rates_for(problem.target).host_source,
        "memory_source": "compiled plan (arguments + outputs - aliased + temporaries), per "
        + (
            "device; none predicted: the model is compiled whole, candidate by candidate"
            if problem.compiled_whole
            else f"device; predicted: affine fit in depth from compiles at depths "
            f"{problem.fit_depths}"
        ),
    }

"""Tables and notes the commands print, apart from what computes them. Default tables hold the
essential columns and fit a 100-column terminal; ``--wide`` (or the JSON) has every column.
Numbers never wrap: a column that does not fit is left out of the default view instead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxmem.cli.common import mib
from jaxmem.figures import format_bytes

DEFAULT_WIDTH = 100


def console(**kwargs: Any):
    """A rich console of the terminal's width (``COLUMNS``), 100 columns when not a terminal."""
    import os

    from rich.console import Console

    width = None if os.environ.get("COLUMNS") else DEFAULT_WIDTH
    c = Console(**kwargs)
    return c if c.is_terminal or width is None else Console(width=width, **kwargs)


def table(title: str, columns: Sequence[str], left: Sequence[str] = (), wrap: Sequence[str] = ()):
    """A table whose cells never wrap but in the ``wrap`` columns (``left``: left-justified)."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right", no_wrap=col not in wrap)
    return t


def print_wide(out, renderable) -> None:
    """Print a wide table without wrapping a cell: the console grows to the table's width."""
    from rich.console import Console
    from rich.measure import Measurement

    width = Measurement.get(out, out.options.update_width(10_000), renderable).maximum
    Console(file=out.file, width=max(out.width, width), no_color=out.no_color).print(renderable)


# --------------------------------------------------------------------------------- memory
def _peaks(r: dict) -> tuple[str, str]:
    """(planned peak, runtime peak) of a record: two kinds of figure, two columns."""
    if r["peak_bytes"] is None:
        return "-", "-"
    if r["peak_source"].startswith("compiled plan"):
        return format_bytes(r["peak_bytes"]), "-"
    return "-", format_bytes(r["peak_bytes"])


def _fits(r: dict) -> str:
    if r.get("fits") is None:  # torch rows have no plan: nothing to fit
        return "-"
    offload = r.get("state_offload")
    if offload and not r["fits"] and offload["fits_lower"]:
        return "if streamed"
    return "yes" if r["fits"] else "no"


def _gflop(flops: float) -> str:
    g = flops / 1e9
    return f"{g:,.3f}" if g < 10 else f"{g:,.1f}"


def memory_columns(target, wide: bool) -> list[str]:
    cols = ["framework", "policy", "saved device", "saved host"]
    if wide:
        cols += ["weight copies", "analytic (stack)", "compiled temp", "opt state"]
    cols += ["GFLOP hw / model" if wide else "GFLOP", "planned peak", "runtime peak"]
    if target.is_gpu:
        cols += (["plan host", "est. step", "MFU"] if wide else []) + ["fits"]
    return cols


def memory_row(r: dict, target, wide: bool) -> list[str]:
    row = [
        r["framework"],
        r["policy"],
        format_bytes(r["saved_activation_bytes_device"]),
        format_bytes(r["saved_activation_bytes_host"]),
    ]
    if wide:
        temp = r["compiled_temp_bytes"]
        row += [
            format_bytes(r["saved_parameter_copy_bytes"]),
            format_bytes(r["analytic_activation_bytes"]),
            "-" if temp is None else format_bytes(temp),
            format_bytes(r["opt_state_bytes"]),
        ]
    gflop = _gflop(r["flops"])
    row += [f"{gflop} / {_gflop(r['model_flops'])}" if wide else gflop, *_peaks(r)]
    if target.is_gpu:
        planned = r.get("fits") is not None
        if wide:
            row.append(format_bytes(r["plan_host_bytes"]) if planned else "-")
            est = r.get("step_time")
            row += [step_ms(est["seconds"]), f"{est['mfu']:.1%}"] if est else ["-", "-"]
        row.append(_fits(r))
    return row


def step_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.0f} us"


def estimate_note(out, estimate: dict, what: str = "est. step") -> None:
    """How an estimated step time was obtained (dim), under the table that shows it."""
    source = estimate["source"].removeprefix("estimate: ")
    out.print(
        f"  {what} = an estimate, not a measurement ({source}): "
        f"{estimate['assumptions']}; MFU = model FLOPs (no recompute) / (step x the compute "
        "type's dense peak)",
        style="dim",
    )


def memory_report(out, records: list[dict], job, planning: bool, target, wide: bool) -> None:
    """The memory table, how each figure was obtained, and the per-tensor differences."""
    kind = "planned from shapes" if planning else "measured"
    if target.is_gpu:
        kind += f", plans compiled for {target.description}"
    if records[0].get("mesh"):
        kind += f", per device of {records[0]['mesh']}"
    r0, tiles = job.run, job.memory.mlp_tile_tokens
    loss = job.memory.loss.brief
    t = table(
        f"one training step: {job.preset}, batch {r0.batch_size} x {r0.seq_len}, "
        f"{records[0]['precision']}{f', MLP in tiles of {tiles} tokens' if tiles else ''}"
        f"{f', {loss}' if loss else ''} ({kind})",
        memory_columns(target, wide),
        left=("framework", "policy"),
    )
    for r in records:
        t.add_row(*memory_row(r, target, wide))
    (print_wide if wide else lambda o, x: o.print(x))(out, t)
    timed = [r for r in records if r.get("step_time")]
    if timed and not wide:  # the table's columns with --wide
        out.print(
            f"est. step on {target.name}: "
            + ", ".join(
                f"{r['policy']} {step_ms(r['step_time']['seconds'])} "
                f"(MFU {r['step_time']['mfu']:.1%})"
                for r in timed
            )
        )
    if not wide:
        out.print("  all columns: --wide or --json", style="dim")
    memory_sources(out, records, planning, target)
    differences(out, records)


def adapter_state_table(out, state: dict, job) -> None:
    """A LoRA job's parameters (frozen by storage, trainable), gradients and optimizer state:
    ``jaxmem.memory.analytic.AdapterState.as_record``, every row analytic."""
    cfg, dtype, base = job.model, job.precision.param_dtype, job.adapters.base
    t = table(
        f"adapter state (analytic): {job.adapters.label()}, {job.precision.name}, "
        f"{job.optimizer.name}",
        ("what", "parameters", "bytes", "obtained"),
        left=("what", "obtained"),
    )
    rest = ["embeddings"] + ([] if cfg.tie_embeddings else ["head"])
    rest += [] if state["norm_params"] else ["norms"]
    rest += ["biases"] if any(cfg.has_bias(p) for p in ("qkv", "out", "mlp", "norm")) else []
    per = state["trainable_bytes"] // max(1, state["trainable_params"])  # one dtype
    rows = [
        (f"frozen: {dtype if base == 'compute' else base} block projections", "quantized"),
        (f"frozen: {', '.join(rest)} ({dtype})", "other_frozen"),
        ("trainable: LoRA A, B", "adapter"),
        ("trainable: norms", "norm"),
    ]
    for what, key in rows:
        count = state[f"{key}_params"]
        if count or key != "norm":
            nbytes = state.get(f"{key}_bytes", count * per)
            t.add_row(what, f"{count:,}", format_bytes(nbytes), "analytic")
    t.add_row("gradients (trainable only)", "-", format_bytes(state["grads_bytes"]), "analytic")
    opt = f"{job.optimizer.name} state (trainable only)"
    t.add_row(opt, "-", format_bytes(state["opt_state_bytes"]), "analytic")
    total = state["params_bytes"] + state["grads_bytes"] + state["opt_state_bytes"]
    count = f"{state['frozen_params'] + state['trainable_params']:,}"
    t.add_row("total", count, format_bytes(total), "analytic")
    out.print(t)
    out.print(f"  {state['source']}", style="dim")


def memory_sources(out, records: list[dict], planning: bool, target) -> None:
    """How each figure was obtained, and what ran."""
    out.print("How each figure was obtained:")
    for fw, saved, flops, peak in sorted(
        {(r["framework"], r["saved_source"], r["flops_source"], r["peak_source"]) for r in records}
    ):
        out.print(f"  {fw}: saved = {saved}; GFLOP = {flops}; peak = {peak}")
    out.print(
        "  planned peak = a compiled plan (arguments + outputs - aliased + temporaries); runtime "
        "peak = measured while the step ran: two kinds of figure, two columns"
    )
    out.print("What ran (torch = stock PyTorch; torch-lean = torch_ref's extension):")
    for fw, policy, how in sorted(
        {(r["framework"], r["policy"], r["translation"]) for r in records}
    ):
        out.print(f"  {fw} {policy}: {how}")
    for r in records:
        hooks = r.get("hook_saved_bytes_device", 0) + r.get("hook_saved_bytes_host", 0)
        saved = r["saved_activation_bytes_device"] + r["saved_activation_bytes_host"]
        if r["framework"].startswith("torch") and hooks != saved:
            out.print(
                f"  {r['framework']} {r['policy']}: saved-tensor hooks see {format_bytes(hooks)} "
                "(blind to what selective checkpointing or the extension keeps itself)"
            )
        offload = r.get("state_offload")
        if offload:
            out.print(
                f"  {r['framework']} {r['policy']}: optimizer state in pinned_host, counted "
                f"analytically: {format_bytes(offload['host_bytes'])} in host memory; device "
                f"peak between {format_bytes(offload['device_peak_lower_bytes'])} (streamed "
                f"leaf by leaf) and {format_bytes(offload['device_peak_upper_bytes'])} (whole "
                "state brought in; a deviceless compile drops argument memory kinds)"
            )
    if planning and any(r["framework"].startswith("torch") for r in records):
        only = f", so the {target.name} plan columns are JAX's only" if target.is_gpu else ""
        out.print(
            "  torch rows: torch_ref's step run under FakeTensorMode (no memory, no arithmetic): "
            f"what it keeps and its FLOPs are any device's; no plan, no runtime peak{only}"
        )
    if target.is_gpu:
        out.print(
            f"  fits = planned peak <= {target.name}'s {format_bytes(target.device_memory_bytes)} "
            "(jaxmem's check: a deviceless compile never fails for lack of memory)"
        )
        estimated = next((r["step_time"] for r in records if r.get("step_time")), None)
        if estimated:
            estimate_note(out, estimated)
    rss = max(r["process_max_rss_bytes"] for r in records)
    out.print(f"  process max RSS {format_bytes(rss)} (getrusage: this whole process, host)")


def differences(out, records: list[dict]) -> None:
    """Per-tensor differences between JAX and each PyTorch translation, per policy (never
    hidden in a total)."""
    from jaxmem.compare.records import name_differences

    by_policy: dict[str, dict[str, dict]] = {}
    for r in records:
        by_policy.setdefault(r["policy"], {})[r["framework"]] = r
    compared = False
    for policy, group in by_policy.items():
        for fw in sorted(f for f in group if f != "jax" and "jax" in group):
            compared = True
            rows = name_differences(group["jax"]["saved_by_name"], group[fw]["saved_by_name"])
            if not rows:
                out.print(f"{policy}: jaxmem and {fw} save the same bytes for every tensor")
                continue
            t = table(
                f"{policy}: saved tensors that differ (jaxmem vs {fw})",
                ("tensor", "jaxmem", fw, f"{fw} - jax"),
                left=("tensor",),
            )
            for row in rows:
                diff = row["torch_bytes"] - row["jax_bytes"]
                sign = "+" if diff > 0 else "-"
                t.add_row(
                    row["name"],
                    format_bytes(row["jax_bytes"]),
                    format_bytes(row["torch_bytes"]),
                    sign + format_bytes(abs(diff)),
                )
            out.print(t)
    if compared:
        out.print(
            "  <untagged>: what jaxmem keeps outside tagged tensors (embedding, final norm, "
            "loss); <op in block / outside the stack>: torch_ref's untagged saved outputs"
        )


def rank_table(out, records: list[dict], job) -> None:
    """torch_ref's per-rank records of a run over a mesh: runtime figures, not plans."""
    first = records[0]
    t = table(
        f"torch_ref per rank: {job.preset}, batch {job.run.batch_size} x {job.run.seq_len} "
        f"({first['mesh']}, CPU processes, {first['precision']})",
        ("framework", "policy", "rank", "params", "grads", "opt state", "saved", "runtime peak"),
        left=("framework", "policy"),
    )
    for r in records:
        t.add_row(
            r["framework"],
            r["policy"],
            str(r["rank"]),
            *(
                format_bytes(r[k])
                for k in (
                    "params_bytes",
                    "grads_bytes",
                    "opt_state_bytes",
                    "saved_activation_bytes_device",
                    "peak_bytes",
                )
            ),
        )
    out.print(t)
    out.print(f"  what ran: {first['strategy']}")
    for state, saved, peak in sorted(
        {(r["state_source"], r["saved_source"], r["peak_source"]) for r in records}
    ):
        out.print(
            f"  params, grads, opt state = {state}; saved = activations {saved}; "
            f"runtime peak = {peak}"
        )
    out.print(
        "  a runtime peak of torch_ref's step, not a compiled plan: compare each framework "
        "with its own one-device figure"
    )


# ----------------------------------------------------------------------------------- plan
def _significant(x: float) -> str:
    """A positive figure to about four significant digits, never wider than eight characters
    (``0.02164``, ``2.244``, ``2,095``)."""
    if x >= 1000:
        return f"{x:,.0f}"
    return f"{x:.4g}"


# every status in at most 12 characters: the default table's cells are never cut
STATUS_SHORT = {
    "over (predicted)": "over (model)",
    "over (compiled)": "over (plan)",
    "over (family floor compiled over)": "over (floor)",
    "fits (compiled estimate not faster)": "fits, slower",
    "over (whole loss compiled over by more than the logits)": "over (twin)",
    "over (whole-loss floor over by more than the logits)": "over (twin)",
    "over (whole loss predicted over by more than the logits)": "over (twin)",
    "over (family floor in the most chunks over by more than a chunk's logits)": "over (twin)",
    "over (fewer chunks compiled over by more than one of their chunks' logits)": "over (twin)",
}


def plan_table(out, result, title: str, top: int, wide: bool) -> None:
    """The candidates the search reached, cheapest first. At 100 columns no cell is cut: the
    configuration wraps within its row (a row may take two lines), the figures never do;
    ``--wide`` adds the host and collective bytes and the MFU."""
    shown = [o for o in result.outcomes if o.status != "not reached"][-top:]
    # bytes in GiB for a GPU-sized budget, else MiB: every figure fits its column
    gib = result.problem.budget_bytes >= 16 * 2**30
    unit, scale = ("GiB", 2**30) if gib else ("MiB", 2**20)
    timed = result.problem.target.is_gpu  # the local backend is ordered by nominal rates
    cols = ["configuration", "TFLOP", "est. s"]
    cols += ["MFU", "plan s"] if timed and wide else ["plan s"] if timed else []
    cols += ["predicted", "compiled", "status"]
    if wide:
        cols[2:2] = ["host GB (est.)", "collective GB (est.)"]
    t = table(
        f"{title} (bytes in {unit})",
        cols,
        left=("configuration", "status"),
        wrap=("configuration",),
    )
    t.columns[0].overflow = "fold"  # a stack's name longer than the column breaks, never cut
    for o in shown:
        c = o.candidate
        row = [c.describe(), _significant(c.flops / 1e12), _significant(c.seconds)]
        if timed and wide:
            row.append(f"{c.estimate.mfu:.1%}" if c.estimate is not None else "-")
        if timed:
            row.append(_significant(o.plan_time["seconds"]) if o.plan_time else "-")
        status = STATUS_SHORT.get(o.status, o.status)
        if wide:
            row[2:2] = [f"{c.host_bytes / 1e9:,.2f}", f"{c.collective_bytes / 1e9:,.2f}"]
        row += [
            "-" if o.predicted is None else f"{o.predicted / scale:,.{2 if gib else 1}f}",
            "-" if o.compiled is None else f"{o.compiled / scale:,.{2 if gib else 1}f}",
            status,
        ]
        t.add_row(*row, style="bold green" if o is result.chosen else None)
    (print_wide if wide else lambda o, x: o.print(x))(out, t)
    est = (
        "est. s: the estimated step time the search orders by (matmuls at an efficiency of "
        "their shape, memory-bound work at the HBM's rate, transfers overlapped: below), from "
        "the gradient's jaxpr before compiling; plan s: the same model priced from the compiled "
        "plan's kernels"
        if timed
        else "est. s: the order on the local backend (FLOPs at a nominal 1 TFLOP/s, bytes over "
        "nominal links; not a time)"
    )
    out.print(
        f"  TFLOP: matmul FLOPs per device and step (gradient's jaxpr); {est}; "
        "predicted: the memory model; "
        "compiled: the plan; over (model): predicted over the budget, not compiled; over "
        "(plan): compiled over it; over (floor): its family's leanest stack compiled over it"
        + (
            "; over (twin): its whole-loss twin, its family's leanest stack in the most chunks "
            "or itself in fewer over by more than chunks can save"
            if any(STATUS_SHORT.get(o.status) == "over (twin)" for o in shown)
            else ""
        )
        + (
            "; fits, slower: fits, its compiled plan no faster than the choice's"
            if any(o.status.startswith("fits") for o in shown)
            else ""
        )
        + ("" if wide else "; host and collective bytes" + (", MFU" if timed else "") + ": --wide"),
        style="dim",
    )


# ----------------------------------------------------------------------------------- peak
def peak_tables(out, report, top: int) -> None:
    from jaxmem.memory.xla_dump import KIND_HELP, KINDS

    kinds = table(
        "live at the peak, by kind", ("kind", "MiB", "what"), left=("kind", "what"), wrap=("what",)
    )
    totals = report.by_kind()
    for kind in KINDS:
        kinds.add_row(kind, mib(totals[kind]), KIND_HELP[kind])
    out.print(kinds)
    groups: dict[tuple[str, str, str], list] = {}
    for v in report.values:
        if v.kind != "argument":  # the table above has them, by kind
            groups.setdefault((v.kind, v.op_name, v.shape), []).append(v)
    ranked = sorted(groups.items(), key=lambda kv: -sum(v.bytes for v in kv[1]))
    values = table(
        f"the {min(top, len(ranked))} largest groups of buffers live at the peak, arguments "
        "aside (one JAX operation and shape; live: positions made .. last read)",
        ("MiB", "n", "kind", "shape", "live", "made by (JAX operation)"),
        left=("kind", "shape", "made by (JAX operation)"),
        wrap=("shape", "made by (JAX operation)"),
    )
    for (kind, op_name, shape), vs in ranked[:top]:
        values.add_row(
            mib(sum(v.bytes for v in vs)),
            str(len(vs)),
            kind,
            shape,
            f"{min(v.start for v in vs)}-{max(v.end for v in vs)}",
            op_name,
        )
    out.print(values)


# -------------------------------------------------------------------------------- presets
def block_text(cfg) -> str:
    """A block in a few words: norm (placement when post), MLP, positions (``LN GELU``,
    ``RMS SwiGLU RoPE``, ``post-LN ReLU``)."""
    norm = ("post-" if cfg.norm == "post" else "") + ("RMS" if cfg.norm_type == "rmsnorm" else "LN")
    act = {"gelu": "GELU", "gelu_tanh": "GELU", "relu": "ReLU", "silu": "SiLU"}[cfg.activation]
    mlp = {"GELU": "GeGLU", "ReLU": "ReGLU", "SiLU": "SwiGLU"}[act] if cfg.mlp == "gated" else act
    return " ".join([norm, mlp] + (["RoPE"] if cfg.positions == "rope" else []))


def _params(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def presets_table(out, rows: list[tuple[str, Any, str]]) -> None:
    t = table(
        "model presets (parameter counts are analytic; H/kv: query/key-value heads)",
        ("preset", "params", "L", "d", "H/kv", "seq", "block", "commands"),
        left=("preset", "block", "commands"),
        wrap=("commands",),
    )
    for name, cfg, use in rows:
        t.add_row(
            name,
            _params(cfg.n_params),
            str(cfg.n_layers),
            str(cfg.d_model),
            f"{cfg.n_heads}/{cfg.kv_heads}",
            str(cfg.max_seq_len),
            block_text(cfg),
            use,
        )
    out.print(t)

"""What the command line promises, checked on the real commands: every step command resolves the
same job from the same flags; its default tables fit 100 columns; a command it prints runs as
printed; bad input is one line and exit 2; nothing but jaxmem's own lines reaches the terminal."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

from jaxmem import cli
from jaxmem.adapters import AdapterConfig
from jaxmem.cli import flags as cli_flags
from jaxmem.cli import presets as cli_presets
from jaxmem.config import PRESETS, AccumConfig, OptimizerConfig
from jaxmem.figures import format_bytes
from jaxmem.job import JobConfig
from jaxmem.memory.analytic import model_state_bytes
from jaxmem.parallel import ParallelConfig
from jaxmem.planner.space import policy_text
from jaxmem.policy import POLICIES, EmbeddingReplay, MemoryPolicy, mixed_policy
from jaxmem.policy_config import parse_policy
from jaxmem.precision import PRECISIONS

# lines that are not jaxmem's: the CUDA plugin's start-up, XLA's own logging, Python warnings
STRAY = (
    "absl::InitializeLog",
    "cudart_stub",
    "Could not find cuda drivers",
    "hlo_rematerialization",
    "gpu_hlo_schedule",
    "Warning:",
    "UserWarning",
)


def run_cli(*args: str, columns: int = 100, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": str(columns)},
    )


def assert_no_stray_lines(text: str) -> None:
    stray = [line for line in text.splitlines() if any(s in line for s in STRAY)]
    assert not stray, stray


def test_help_starts_a_new_user_with_the_readmes_first_two_commands():
    from tests.test_readme import readme_commands

    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100
    start = proc.stdout.split("start here:", 1)[1]
    commands = [" ".join(c.split()) for c in re.sub(r"\\\n\s*", " ", start).splitlines()[1:]]
    assert len(commands) == 2 and commands[0].startswith("jaxmem train")
    assert commands[1].startswith("jaxmem memory")
    assert set(commands) <= set(readme_commands()), commands


# ------------------------------------------------------------------ one job, every command
def test_every_step_flag_names_a_setting_of_the_job():
    """A flag either overrides one setting of ``JobConfig`` or is read by its command alone;
    none points at a setting that does not exist."""
    # a custom policy has every memory key (loss_chunks, rest, rest_save/rest_offload and
    # replay_embedding are written where they are set: a run written before they existed
    # resumes without a conflict)
    custom = {
        "policy": "custom",
        "save": ["mlp_up"],
        "loss_chunks": 2,
        "layers_first": 1,
        "rest": "custom",
        "rest_save": ["attn_out"],
        "replay_embedding": True,
        "mlp_tile_tokens": 2,
    }
    settings = JobConfig.from_dict({"preset": "tiny", "memory": custom}).to_dict()
    # the loss's chunks by count or by token count: one is written at a time
    by_tokens = {**custom, "loss_chunks": 0, "loss_tile_tokens": 4}
    settings["memory"] |= JobConfig.from_dict({"preset": "tiny", "memory": by_tokens}).to_dict()[
        "memory"
    ]
    for name, flag in cli_flags.FLAGS.items():
        if flag.path is None:
            continue
        section, _, key = flag.path.partition(".")
        assert section in settings, name
        if key:
            assert key in settings[section], name


JOBS = [
    JobConfig.from_dict({"preset": "tiny"}),
    dataclasses.replace(
        JobConfig.from_dict({"preset": "small", "run": {"batch_size": 8, "seq_len": 128}}),
        memory=parse_policy("none:2+selective"),
        precision=PRECISIONS["bf16"],
        accum=AccumConfig(steps=2, inplace=False),
        optimizer=OptimizerConfig(name="sgd", lr=0.05, momentum=0.8, state_memory="pinned_host"),
        parallel=ParallelConfig(strategy="fsdp", devices=4),
    ),
    dataclasses.replace(
        JobConfig.from_dict(
            {"preset": "tiny", "model": {"n_layers": 4, "attention": "fused", "norm": "post"}}
        ),
        memory=MemoryPolicy.custom(
            {"query_proj": "device", "mlp_up": "offload"}, unroll=True
        ).replace(name="custom"),
    ),
    dataclasses.replace(
        JobConfig.from_dict({"preset": "small", "run": {"seed": 7}}),
        memory=POLICIES["full"].replace(use_reentrant=True),
        accum=AccumConfig(steps=4, mode="multisteps"),
    ),
    dataclasses.replace(
        JobConfig.from_dict({"preset": "small"}),
        memory=mixed_policy(
            MemoryPolicy.custom({n: "device" for n in ("query_proj", "key_proj", "value_proj")}),
            3,
            MemoryPolicy.custom({"attn_out": "device", "mlp_up": "device"}),
        ).replace(embedding=EmbeddingReplay(True)),
    ),
    dataclasses.replace(
        JobConfig.from_dict({"preset": "small"}),
        memory=mixed_policy("selective", 1, MemoryPolicy.custom({"mlp_up": "device"})),
    ),
    dataclasses.replace(
        JobConfig.from_dict({"preset": "tiny"}),
        optimizer=OptimizerConfig(
            schedule="linear", warmup_steps=3, decay_steps=50, min_lr=1e-5, clip_norm=0.5
        ),
    ),
    dataclasses.replace(
        JobConfig.from_dict({"preset": "tiny-llama"}),
        adapters=AdapterConfig(
            rank=8, alpha=16.0, rslora=True, targets=("q", "k", "gate"), train=("norm",)
        ),
    ),
    dataclasses.replace(
        JobConfig.from_dict({"preset": "tiny-llama", "model": {"attention": "fused"}}),
        parallel=ParallelConfig(strategy="fsdp", devices=4, cp=2, cp_attention="ring"),
    ),
]


@pytest.mark.parametrize(
    "job",
    JOBS,
    ids=[
        "defaults",
        "mixed-bf16-fsdp",
        "custom-fused",
        "full",
        "tag-mix-replay",
        "preset+tags",
        "schedule+clip",
        "adapters",
        "ring-over-cp",
    ],
)
def test_a_job_printed_as_flags_resolves_to_the_same_job(job):
    argv = cli_flags.job_argv(job)
    args = cli.build_parser().parse_args(["train", *argv])
    resolved = cli_flags.job_from_args(args, list(cli_flags.FLAGS))
    for section in ("model", "memory", "optimizer", "accum", "parallel", "adapters"):
        assert getattr(resolved, section) == getattr(job, section), section
    assert resolved.precision == job.precision and resolved.preset == job.preset
    for key in ("batch_size", "seq_len", "seed"):
        assert getattr(resolved.run, key) == getattr(job.run, key), key


@pytest.mark.parametrize(
    ("command", "extra"),
    [("memory", []), ("peak", []), ("plan", ["--budget", "1GiB"]), ("train", [])],
)
def test_every_step_command_reads_a_config_file_and_set_the_same_way(command, extra, tmp_path):
    """A run's config file plans as it trains: the same resolution, the same one-line errors
    for a value that breaks a rule across fields (here a batch the microbatches cannot split)."""
    config = tmp_path / "job.toml"
    config.write_text('preset = "small"\n[run]\nbatch_size = 6\n[accum]\nsteps = 4\n')
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--config", str(config), *extra])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--preset", "small", "--set", "accum.steps=4", "--batch-size", "6"])
    assert exc.value.code == 2


def test_the_preset_listing_and_the_commands_apply_one_rule(capsys):
    """`jaxmem presets` names the commands that take each preset; each command it leaves out
    refuses that preset in one line."""
    for name, cfg in PRESETS.items():
        listed = cli_presets.preset_commands(name)
        for command in cli_presets.COMMANDS:
            refused = cli_presets.refusal(command, name, cfg) is not None
            assert (command not in listed) == refused
    assert cli_presets.preset_use("seed") == "seed-example, parity"
    assert cli_presets.preset_use("tiny") == "all"
    assert cli_presets.preset_use("llama-3-8b") == "from shapes*"
    for command in ("memory", "peak", "plan", "train", "bench"):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--preset", "seed"])
        assert exc.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "has no causal mask" in line


# ----------------------------------------------------------------------- tables that fit
@pytest.mark.slow
def test_the_memory_table_fits_100_columns_and_wide_shows_every_column():
    args = ["memory", "--preset", "tiny", "--batch-size", "2", "--seq-len", "16"]
    args += ["--policies", "none,selective", "--target", "h100"]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in lines if line[:1] == "│"]
    rows = [cells for cells in rows if cells[1] in ("none", "selective")]
    # jax and torch for both policies, torch-lean for selective; every cell whole (a number
    # and its unit on one line): no row wraps onto a second line
    assert [cells[0] for cells in rows] == ["jax", "torch", "jax", "torch", "torch-lean"]
    assert all(cells[-1] in ("yes", "no", "-") for cells in rows)
    # no torch-lean row for none, and one line says why (nothing claims to measure it)
    assert "measuring torch-lean none" not in proc.stdout
    assert "no torch-lean row for none: no remat or whole-block remat" in proc.stdout
    wide = run_cli(*args, "--wide", "--frameworks", "jax")
    assert wide.returncode == 0, wide.stderr
    assert "compiled temp" in wide.stdout and "plan host" in wide.stdout
    assert_no_stray_lines(proc.stderr + wide.stderr)


@pytest.mark.skipif(not cli.common.torch_available(), reason="needs PyTorch")
def test_torch_lean_alone_with_no_policy_it_measures_is_one_line_and_exit_2(capsys):
    """Refused before anything runs (in-process: the same check as the command's, without a
    second interpreter importing PyTorch)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["memory", "--frameworks", "torch-lean", "--policies", "none,full,offload"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert out == "" and "--policies none,full,offload: no row to measure (no remat or" in line
    assert "stock PyTorch has no offload by name" in line and "--frameworks torch" in line


@pytest.fixture(scope="module")
def plan_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    args = ["plan", "--preset", "small", "--budget", "100MiB", "--batch-size", "8"]
    proc = run_cli(*args, "--seq-len", "128", "--accum", "1,2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_the_plan_table_fits_100_columns_one_row_per_candidate(plan_run):
    proc, plan = plan_run
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100  # the commands too: continued with "\\"
    assert "…" not in proc.stdout  # no figure cut: a long configuration wraps in its row
    # a row's first line has its status; a wrapped configuration's next lines have none
    rows = [line for line in lines if line.startswith("│ ") and line.split("│")[-2].strip()]
    assert len(rows) == len(plan["candidates"])
    assert_no_stray_lines(proc.stderr)


@pytest.mark.slow
def test_the_commands_plan_prints_run_as_printed(plan_run, tmp_path):
    """The printed command is complete (preset, batch, sequence, policy in the one notation):
    run as printed (with a short run length), it trains the chosen configuration."""
    proc, plan = plan_run
    chosen = plan["chosen"]
    printed = re.sub(r" \\\n\s*", " ", proc.stdout)  # a long command goes on after " \\"
    for framework in ("jax", "torch"):
        assert plan["commands"][framework] in printed
        argv = shlex.split(plan["commands"][framework])
        assert argv[:2] == ["jaxmem", "train"]
        out = tmp_path / framework
        ran = run_cli(*argv[1:], "--steps", "2", "--sample-tokens", "0", "--out", str(out))
        assert ran.returncode == 0, ran.stderr
        assert_no_stray_lines(ran.stderr)
        job = JobConfig.from_dict(json.loads((out / "summary.json").read_text())["config"])
        # the stack as the plan names it (a per-tag policy by what it keeps) and what it saves
        assert policy_text(job.memory) == chosen["policy"] and job.accum.steps == chosen["accum"]
        assert list(job.memory.head.save) == chosen["save"]
        assert (job.preset, job.run.batch_size, job.run.seq_len) == ("small", 8, 128)
        assert job.run.framework == framework


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["memory", "--preset", "tiny", "--mesh", "fsdp=3", "--batch-size", "8"],
            "microbatch size 8 (batch 8 / accum 1) does not split over --mesh fsdp=3",
        ),
        (["peak", "--preset", "tiny", "--policy", "none:99+full"], "first=99 exceeds n_layers=2"),
        (["train", "--policy", "none:two+full"], "neither a preset nor HEAD:K+REST"),
        (
            ["memory", "--mesh", "fsdp=4096", "--batch-size", "4096", "--frameworks", "jax"],
            "--mesh asks for 4096 CPU devices on this machine",
        ),
        (
            ["train", "--preset", "tiny", "--seq-len", "32", "--loss-chunks", "5"],
            "loss_chunks=5 does not divide seq_len=32",
        ),
        (
            ["train", "--preset", "tiny", "--policy", "none", "--replay-embedding"],
            "replay_embedding needs the first block rematerialised (policy 'none'",
        ),
        (
            ["memory", "--preset", "tiny", "--policies", "none,nested", "--replay-embedding"],
            "--replay-embedding: none of --policies none,nested rematerialises its first block",
        ),
        (
            ["train", "--preset", "tiny", "--precision", "fp16", "--loss-chunks", "2"],
            "before fp16's dynamic loss scale",
        ),
        (["peak", "--preset", "tiny", "--loss-chunks", "-1"], "loss_chunks=-1 must be 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"jaxmem {args[0]}: error: ") and message in line


def test_a_model_whose_state_cannot_fit_is_refused_before_compiling(monkeypatch, capsys):
    """Parameters, gradients and AdamW state are resident whatever the policy: a host that
    cannot hold them is told so (not "out of memory, try --policy mlp" after compiling)."""
    import jaxmem.train.run as run

    monkeypatch.setattr(run, "host_available_bytes", lambda: 24 * 2**30)
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--preset", "gpt3-6.7b", "--steps", "1"])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    state = sum(
        model_state_bytes(
            PRESETS["gpt3-6.7b"], OptimizerConfig(), PRECISIONS["fp32"], ParallelConfig()
        ).values()
    )
    assert state == 16 * PRESETS["gpt3-6.7b"].n_params  # fp32 weights and grads, AdamW moments
    assert (
        f"gpt3-6.7b's parameters, gradients and adamw state alone need {format_bytes(state)} "
        "(analytic, fp32), more than the 24.00 GiB this host has available: no memory policy "
        "can make it fit"
    ) in line


def test_plotting_a_run_with_no_finite_loss_is_one_line(tmp_path):
    run = tmp_path / "diverged"
    run.mkdir()
    records = [{"step": s, "loss": math.nan, "tokens": s} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = run_cli("plot", str(run), "--out", str(tmp_path / "p.png"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"jaxmem plot: error: {run}: none of its 2 logged losses is finite (the run diverged "
        "from its first step): nothing to plot"
    ]
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(("preset", "code"), [("seed", 0), ("tiny", cli.EXIT_PARITY_FAILED)])
def test_parity_where_only_fp32_differs_is_decided_by_float64_for_a_relu_model(
    preset, code, monkeypatch, capsys
):
    """fp32 of the seeds' ReLU layer can differ beyond its tolerance (on this machine: batch 32
    x 64, LLVM at its default level) when rounding that differs between the frameworks flips
    ReLUs at their kink; float64 decides there. A GELU model's fp32 difference is a failure."""
    import jaxmem.compare.parity as parity

    def run_parity(cfg, *, batch, seq_len, seed, dtype):
        passed = dtype == "float64"
        return {
            "dtype": dtype,
            "passed": passed,
            "loss_jax": 5.65,
            "loss_torch": 5.65,
            "max_abs_grad_diff": 1e-17 if passed else 8e-6,
            "max_rel_grad_diff": 1e-15 if passed else 1.5e-2,
            "n_grad_leaves": 15,
            "failed_grad_leaves": [] if passed else ["blocks.layers.0.ffn.0.bias"],
            "tolerances": {"grads": {"rtol": 1e-5, "atol": 1e-6}},
        }

    monkeypatch.setattr(parity, "run_parity", run_parity)
    assert cli.main(["parity", "--preset", preset]) == code
    out = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in out) <= 100  # one row per dtype, every digit kept
    assert out[1].split() == ["dtype", "result", "loss", "jax", "loss", "torch", "max", "|grad",
                              "diff|", "max", "normwise", "rel", "rtol", "atol"]  # fmt: skip
    assert out[2].split() == ["float64", "PASSED", "5.650000000", "5.650000000", "1.000e-17",
                              "1.000e-15", "1e-05", "1e-06"]  # fmt: skip
    if preset == "seed":
        assert out[0].startswith("parity PASSED (seed, batch 4, seq 32)")
        assert out[3].split()[:2] == ["float32", "DIFFERS"]
        explained = " ".join(out[4:])
        assert explained.startswith("float64, the exactness check, decides: fp32 differs")
        assert explained.endswith("fp32 is not an exactness check for a ReLU model")
    else:
        assert out[0].startswith("parity FAILED (tiny, batch 4, seq 32)")
        assert out[3].split()[:2] == ["float32", "FAILED"] and len(out) == 4


# ---------------------------------------------------------------------------- stray lines
@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "batch"), [("gpt2-124m", "96"), ("llama-3-8b", "1")], ids=["remat", "schedule"]
)
def test_a_plan_over_the_targets_memory_prints_no_xla_log_lines(preset, batch):
    """XLA's rematerialization pass warns, and its GPU scheduler logs an error, when a plan
    exceeds the target's memory; the table already says so ("fits: no")."""
    args = ["memory", "--preset", preset, "--target", "h100", "--policies", "none"]
    proc = run_cli(*args, "--batch-size", batch, "--frameworks", "jax", "--precision", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert_no_stray_lines(proc.stdout + proc.stderr)
    assert "│  no │" in proc.stdout or "│   no │" in proc.stdout


@pytest.mark.slow
def test_resuming_and_torch_runs_print_only_jaxmem_lines(tmp_path):
    base = ["train", "--preset", "tiny", "--batch-size", "4", "--seq-len", "16"]
    base += ["--sample-tokens", "0", "--checkpoint-every", "1"]
    first = run_cli(*base, "--steps", "1", "--out", str(tmp_path / "jax"))
    assert first.returncode == 0, first.stderr
    resumed = run_cli(*base, "--steps", "2", "--out", str(tmp_path / "jax"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    torch = run_cli(*base, "--steps", "1", "--framework", "torch")
    assert torch.returncode == 0, torch.stderr
    for proc in (first, resumed, torch):
        assert_no_stray_lines(proc.stdout + proc.stderr)

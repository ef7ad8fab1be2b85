"""Data-parallel strategies (``jaxmem.parallel``, ``jaxmem.sharding``) on 4 CPU devices: the
same losses as one device for every strategy, each device holding 1/N of what the strategy
shards, host-resident optimizer state staying on the host, ``jaxmem memory --mesh`` records
per device, and ``jaxmem train --mesh`` over two processes training as one device does and
resuming bit-identically. Multi-device runs need a process of their own (JAX fixes its CPU
device count when it starts): ``tests/parallel_worker.py`` and the CLI, as subprocesses."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxmem import cli
from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS, ConfigError, OptimizerConfig
from jaxmem.job import JobConfig
from jaxmem.memory import analytic
from jaxmem.parallel import STREAM_TAGS, ParallelConfig, parse_mesh
from jaxmem.planner.records import jax_record
from jaxmem.policy import get_policy
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

N = 4
FP32 = PRECISIONS["fp32"]
WORKER = os.path.join(os.path.dirname(__file__), "parallel_worker.py")
CASES = [
    {"policy": "full", "precision": "fp32", "accum": 2, "steps": 10},
    {
        "policy": "selective",
        "precision": "bf16",
        "accum": 2,
        "state_memory": "pinned_host",
        "steps": 5,
        "strategies": ["fsdp"],
    },
    {  # the stack streamed through host memory (jaxmem.step.stream), over each strategy
        "policy": "offload",
        "precision": "bf16",
        "accum": 2,
        "stream": True,
        "one_device": False,  # compared with the unstreamed fsdp step
        "steps": 3,
        "strategies": ["fsdp"],
    },
    {  # Megatron's tensor (and sequence) parallelism: tp=2 alone, and fsdp/zero1 x tp=2
        "policy": "selective",
        "precision": "fp32",
        "accum": 2,
        "steps": 4,
        "tp": 2,
        "tp_alone": True,
        "strategies": ["fsdp", "zero1"],
    },
    {  # the Llama block (RoPE, grouped-query attention, SwiGLU) over fsdp x tp, its head and
        # loss in chunks (MemoryPolicy.loss: LossPolicy)
        "preset": "tiny-llama",
        "policy": "full",
        "precision": "bf16",
        "loss_chunks": 4,
        "steps": 3,
        "tp": 2,
        "strategies": ["fsdp"],
    },
    {  # the head and loss in chunks, streamed over fsdp
        "policy": "offload",
        "precision": "bf16",
        "accum": 2,
        "loss_chunks": 4,
        "stream": True,
        "one_device": False,
        "steps": 3,
        "strategies": ["fsdp"],
    },
]
DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


@pytest.fixture(scope="module")
def runs():
    proc = subprocess.run(
        [sys.executable, WORKER, json.dumps(CASES)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_strategy_trains_as_one_device(runs):
    """Every strategy, with and without tensor parallelism, for a GPT and a Llama block: the
    one-device losses within the data-parallel tolerance (the collectives add partial sums in
    their own order)."""
    seen = []
    for row in runs:
        if "one_device" not in row:  # the streamed case compares with the unstreamed fsdp step
            continue
        tol = tolerance(DTYPE[row["case"]["precision"]], "data_parallel_loss")
        base = row["one_device"]["losses"]
        tp = row["case"].get("tp", 1)
        names = list(row["case"].get("strategies", ("dp", "zero1", "fsdp")))
        for name in names + (["tp"] if "tp" in row else []):
            np.testing.assert_allclose(row[name]["losses"], base, **tol.kwargs())
            seen.append((row["case"].get("preset", "tiny"), name if tp == 1 else f"{name},tp"))
    assert {("tiny", s) for s in ("dp", "zero1", "fsdp", "tp,tp", "fsdp,tp")} <= set(seen)
    assert ("tiny-llama", "fsdp,tp") in seen


@pytest.mark.slow
def test_tensor_parallelism_splits_the_blocks_columns_and_rows_over_tp(runs):
    """Megatron's layout: each tensor device holds half of every column-parallel (q/k/v, up,
    gate) and row-parallel (out, down) weight and of its optimizer state; norms, row-parallel
    biases and the embeddings stay whole on it (fsdp then halves what it can on the data
    axis)."""
    from flax import nnx

    from jaxmem.model import make_model

    row = runs[3]
    one, tp = row["one_device"], row["tp"]
    _, params = nnx.split(nnx.eval_shape(lambda: make_model(PRESETS["tiny"], FP32)), nnx.Param)
    split = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        keys = [k.key for k in path if hasattr(k, "key")]
        if "blocks" in keys and (
            keys[-2] in ("in_proj", "up", "gate")
            or (keys[-2] in ("out_proj", "down") and keys[-1] == "kernel")
        ):
            split += x.size * x.dtype.itemsize
    assert split > 0
    assert tp["params_bytes"] == one["params_bytes"] - split // 2
    # AdamW's two moments follow the parameters; its step counter is the few bytes beyond
    assert 0 <= tp["opt_state_bytes"] - 2 * tp["params_bytes"] <= 16


@pytest.mark.slow
def test_each_device_holds_its_share(runs):
    """fsdp: parameters and optimizer state within 5 % of 1/N per device (what cannot be split,
    a scalar step count, is replicated); zero1: the state only; dp: everything replicated."""
    row = runs[0]
    one = row["one_device"]
    for strategy, params_share, state_share in (
        ("dp", 1, 1),
        ("zero1", 1, 1 / N),
        ("fsdp", 1 / N, 1 / N),
    ):
        got = row[strategy]
        assert got["params_bytes"] == pytest.approx(one["params_bytes"] * params_share, rel=0.05)
        assert got["opt_state_bytes"] == pytest.approx(
            one["opt_state_bytes"] * state_share, rel=0.05
        )
        # the analytic model's sharded terms (ZeRO's accounting, what cannot be split kept
        # whole) equal what each device holds; AdamW's step counter is the few bytes beyond
        parallel = ParallelConfig(strategy=strategy, devices=N)
        model = analytic.model_state_bytes(PRESETS["tiny"], OptimizerConfig(), FP32, parallel)
        assert got["params_bytes"] == model["params"]
        assert 0 <= got["opt_state_bytes"] - model["opt_state"] <= 16


@pytest.mark.slow
def test_host_resident_optimizer_state_stays_on_the_host_when_sharded(runs):
    row = runs[1]
    assert row["one_device"]["opt_state_memory_kinds"] == ["pinned_host"]
    assert row["fsdp"]["opt_state_memory_kinds"] == ["pinned_host"]
    assert row["fsdp"]["opt_state_bytes"] == pytest.approx(
        row["one_device"]["opt_state_bytes"] / N, rel=0.05
    )


@pytest.mark.slow
def test_a_streamed_step_over_a_mesh_computes_the_unstreamed_steps_numbers(runs):
    """Streaming composes with fsdp: the streamed step's losses are the unstreamed fsdp step's,
    bit for bit (the same arithmetic, moved), the stack and its state stay in host memory, and
    each device keeps 1/N of them (what cannot be split, AdamW's step count, is whole)."""
    for row in (runs[2], runs[5]):  # the second with the head and loss in chunks
        plain, streamed = row["fsdp"], row["fsdp+stream"]
        assert streamed["losses"] == plain["losses"]
        assert streamed["stack_memory_kinds"] == ["pinned_host"]
        assert 0 <= streamed["stack_bytes"] - streamed["stack_whole_bytes"] / N <= 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(out, *args, processes: int = 1, new_session: bool = False) -> list[subprocess.Popen]:
    """``jaxmem train --out OUT ARGS`` as one process, or as ``processes`` processes of one
    run on JAX's multi-process runtime (each with its share of the mesh's CPU devices);
    ``new_session``: each in a process group of its own, as a terminal would start it."""
    cmd = [sys.executable, "-m", "jaxmem.cli", "train", "--out", str(out), *args]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if processes == 1:
        return [subprocess.Popen(cmd, **pipes, start_new_session=new_session)]
    group = ["--coordinator", f"localhost:{_free_port()}", "--num-processes", str(processes)]
    return [
        subprocess.Popen(
            [*cmd, *group, "--process-id", str(i)], **pipes, start_new_session=new_session
        )
        for i in range(processes)
    ]


def _train(out, *args, processes: int = 1) -> None:
    procs = _launch(out, *args, processes=processes)
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]


def _losses(run) -> list[float]:
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


SHAPE = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--policy", "full"]
# fsdp x tp over the two processes: each process's 2 CPU devices are one tensor group (the
# tensor axis within a host, as on a GPU node) and the data axis spans the processes
TWO = [*SHAPE, "--mesh", "fsdp=2,tp=2", "--checkpoint-every", "2", "--eval-every", "4"]
TWO += ["--sample-tokens", "8", "--steps", "8"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """An uninterrupted ``--mesh fsdp=2,tp=2`` run over 2 processes of 2 CPU devices each
    (``jax.distributed``, gloo), 8 steps: the reference the tests below compare with."""
    out = tmp_path_factory.mktemp("two") / "run"
    _train(out, *TWO, processes=2)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_as_one(two_processes, tmp_path):
    """The same losses as one device (within the data-parallel tolerance: the reduce-scatter
    adds the partial sums in its own order); only process 0 writes the run's files (how a
    resumed run restores each process's shards: the SIGKILL test below)."""
    # the one-device run in this process (the 4-device one in a process of 4 CPU devices is
    # what test_every_strategy_trains_as_one_device checks)
    assert cli.main(["train", *SHAPE, "--steps", "8", "--out", str(tmp_path / "one")]) == 0
    one, two = _losses(tmp_path / "one"), _losses(two_processes)
    assert len(one) == 8
    np.testing.assert_allclose(two, one, **tolerance("float32", "data_parallel_loss").kwargs())
    files = sorted(p.name for p in two_processes.iterdir() if not p.name.startswith("."))
    assert files == [
        "checkpoints",
        "config.yaml",
        "loss.png",
        "metrics.jsonl",
        "sample.txt",
        "summary.json",
    ]
    assert sorted(p.name for p in (two_processes / "checkpoints").iterdir()) == ["6", "8"]


@pytest.mark.slow
def test_memory_command_plans_per_device_records(tmp_path):
    """``jaxmem memory --mesh``: one process of N CPU devices; the records are per device (the
    one-device record is planned here, in this one-device process)."""
    args = ["--preset", "tiny", "--policies", "full", "--batch-size", "8", "--seq-len", "32"]
    cmd = [sys.executable, "-m", "jaxmem.cli", "memory", *args, "--mesh", f"fsdp={N}"]
    out = tmp_path / "m.json"
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = json.loads(out.read_text())
    one = jax_record(
        StepSpec(
            model=PRESETS["tiny"],
            policy=get_policy("full"),
            precision=FP32,
            optimizer=OptimizerConfig(),
            batch=8,
            seq_len=32,
        ),
        abstract=True,
    )
    assert rec["per_device"] is True and rec["mesh"] == f"fsdp={N}" and not one["per_device"]
    for key in ("params_bytes", "grads_bytes", "opt_state_bytes"):
        assert rec[key] == pytest.approx(one[key] / N, rel=0.05), key
    # each device runs its rows of the batch: a quarter of the activations and FLOPs
    assert rec["saved_activation_bytes_device"] < one["saved_activation_bytes_device"] / 2
    assert rec["flops"] == one["flops"] // N
    assert rec["planned_peak_bytes"] < one["planned_peak_bytes"]
    assert "per device of fsdp=4" in rec["compiler"]


@pytest.mark.slow
def test_memory_command_plans_a_tensor_parallel_step_per_device(tmp_path):
    """``jaxmem memory --mesh tp=2``: residual accounting counts each tensor device's share of
    every tagged activation, equal to the analytic model's (both Megatron's layout); sequence
    parallelism splits the residual stream too, and the compiled plans agree that it saves
    memory; the blocks' FLOPs split over tp, the LM head's not."""
    args = ["--preset", "tiny", "--policies", "none,full", "--batch-size", "8", "--seq-len", "32"]
    records = {}
    for sp in ("true", "false"):
        out = tmp_path / f"{sp}.json"
        cmd = [sys.executable, "-m", "jaxmem.cli", "memory", *args, "--frameworks", "jax"]
        cmd += ["--mesh", "tp=2", "--set", f"parallel.sequence_parallel={sp}"]
        proc = subprocess.run(
            [*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        records[sp] = {r["policy"]: r for r in json.loads(out.read_text())}
    cfg = PRESETS["tiny"]
    for sp, by_policy in records.items():
        for policy, rec in by_policy.items():
            one = jax_record(
                StepSpec(
                    model=cfg,
                    policy=get_policy(policy),
                    precision=FP32,
                    optimizer=OptimizerConfig(),
                    batch=8,
                    seq_len=32,
                ),
                abstract=True,
            )
            tagged = {n: b for n, b in rec["saved_by_name"].items() if n in one["saved_by_name"]}
            blocks = sum(b for n, b in tagged.items() if n not in ("<untagged>", "<stack output>"))
            assert blocks == rec["analytic_activation_bytes"], (sp, policy)
            whole = {"<untagged>"} | (set(STREAM_TAGS) if sp == "false" else set())
            for name, b in tagged.items():  # a share of 1/2 where the layout splits
                kept = one["saved_by_name"][name]
                assert b == (kept if name in whole else kept // 2), (sp, policy, name)
            head = 6 * 8 * 32 * cfg.d_model * cfg.vocab_size
            assert rec["flops"] == head + (one["flops"] - head) // 2
    # sequence parallelism: the stream's tags split, and the plans are smaller
    none_sp, none_full = records["true"]["none"], records["false"]["none"]
    assert none_sp["saved_by_name"]["norm1_out"] * 2 == none_full["saved_by_name"]["norm1_out"]
    assert none_sp["saved_by_name"]["mlp_up"] == none_full["saved_by_name"]["mlp_up"]
    for policy in ("none", "full"):
        assert (
            records["true"][policy]["planned_peak_bytes"]
            < (records["false"][policy]["planned_peak_bytes"])
        )


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: parse_mesh("fsdp"), "must be STRATEGY=N, tp=N, or both"),
        (lambda: parse_mesh("fsdp=2,zero1=2"), "must be STRATEGY=N, tp=N, or both"),
        (lambda: parse_mesh("tp=2,tp=2"), "must be STRATEGY=N, tp=N, or both"),
        (lambda: parse_mesh("fsdp=2,tp=0"), "tp=0 must be a positive device count"),
        (lambda: ParallelConfig(devices=6, tp=4), "devices=6 is not a multiple of tp=4"),
        (
            lambda: JobConfig.from_dict({"preset": "tiny", "parallel": {"devices": 3, "tp": 3}}),
            "the model's 4 query heads do not split over tp=3; use a tp that divides 4",
        ),
        (
            lambda: JobConfig.from_dict(
                {"preset": "tiny", "run": {"seq_len": 30}, "parallel": {"devices": 4, "tp": 4}}
            ),
            "sequence parallelism splits the 30 positions over tp=4",
        ),
        (lambda: parse_mesh("fsdp=four"), "'four' is not a device count"),
        (lambda: parse_mesh("zero3=4"), "strategy='zero3' is not one of dp, zero1, fsdp"),
        (lambda: ParallelConfig(devices=0), "devices=0 must be a positive integer"),
        (
            lambda: JobConfig.from_dict(
                {"preset": "tiny", "parallel": {"strategy": "fsdp", "devices": 3}}
            ),
            "does not split over --mesh fsdp=3: use a batch size that is a multiple of 3",
        ),
        (
            lambda: JobConfig.from_dict(
                {
                    "preset": "tiny",
                    "accum": {"steps": 2, "mode": "multisteps"},
                    "parallel": {"strategy": "fsdp", "devices": 2},
                }
            ),
            "accum mode 'multisteps' is single-device only: use accum mode 'scan'",
        ),
    ],
)
def test_bad_meshes_are_refused_naming_the_value(make, fragment):
    with pytest.raises(ConfigError) as exc:
        make()
    assert fragment in str(exc.value)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def processes_running(fragment: str) -> list[str]:
    """Command lines of this machine's processes that mention ``fragment`` (a run directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fragment in cmd:
            found.append(cmd)
    return found


def _lose_one(
    run, victim: int, *, worker: bool, args: tuple = tuple(TWO)
) -> tuple[subprocess.Popen, str, float]:
    """Start the 2-process run ``args`` (TWO) in ``run``; once a checkpoint verifies, stop process
    ``victim`` where it is and SIGKILL it (``worker``: the child doing its work, as the OS's
    OOM killer would; else the process the user started). Returns the survivor, its stderr and
    the seconds it took to exit after the kill."""
    import signal

    from jaxmem.run_layout import verify

    procs = _launch(run, *args, processes=2)
    try:
        deadline = time.time() + 300
        saved: list[str] = []
        while not saved and time.time() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.02)
            ckpts = run / "checkpoints"
            names = sorted(os.listdir(ckpts)) if ckpts.is_dir() else []
            saved = [n for n in names if n.isdigit() and verify(str(ckpts / n)) is None]
        target = procs[victim].pid
        if worker:
            (target,) = _children(target)
        os.kill(target, signal.SIGSTOP)  # frozen mid-run: the kill below cannot race the end
        assert saved and all(p.poll() is None for p in procs), "the run ended before the kill"
        os.kill(target, signal.SIGKILL)
        start = time.monotonic()
        survivor = procs[1 - victim]
        _, err = survivor.communicate(timeout=120)
        took = time.monotonic() - start
        procs[victim].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    return survivor, err, took


def _lost_line(err: str, me: int, lost: str, run) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("jaxmem train:")]
    assert len(lines) == 2, err[-3000:]  # "joining ..." and the one line
    line = lines[-1]
    assert line.startswith(f"jaxmem train: process {me} of 2 lost {lost}: "), line
    assert "last verified checkpoint: step " in line and f"in {run}/checkpoints" in line
    assert f"(continue with: jaxmem train --out {run} --resume, on every process" in line
    return line


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_lost_process_ends_the_survivor_in_one_line_and_the_run_resumes_bit_identically(
    two_processes, tmp_path
):
    """Process 1's worker SIGKILLed mid-run (after a checkpoint verified): process 0 exits 1
    within seconds in one line naming process 1 and the checkpoint to resume from (not gloo's
    traceback, not XLA's abort after its heartbeat timeout), leaves no process behind, and
    --resume logs exactly what an uninterrupted run logs: nothing half-written was taken as
    good."""
    run = tmp_path / "lost"
    survivor, err, took = _lose_one(run, 1, worker=True)
    assert survivor.returncode == 1, err[-3000:]
    assert took < 30, took  # gloo reports the closed connection; the heartbeats confirm it
    _lost_line(err, 0, "process 1", run)
    assert "Traceback" not in err and "Check failure" not in err
    assert not processes_running(str(run))
    _train(run, "--resume", "--steps", "8", processes=2)
    assert _losses(run) == _losses(two_processes)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_losing_the_coordinator_ends_the_other_process_in_one_line(tmp_path):
    """Process 0 (it runs the coordination service) SIGKILLed: XLA's client ends the other
    process's work at once in a native abort; the process the user started reports it in one
    line naming process 0 and the checkpoint, exits 1, and leaves no process behind."""
    run = tmp_path / "lost"
    survivor, err, took = _lose_one(run, 0, worker=False)
    assert survivor.returncode == 1, err[-3000:]
    assert took < 30, took
    line = _lost_line(err, 1, "process 0 (the coordinator)", run)
    assert "its coordination service stopped answering" in line
    assert "Check failure" not in err and "@ 0x" not in err  # no C++ stack dump
    assert not processes_running(str(run))


@pytest.mark.multiprocess
def test_a_process_whose_coordinator_never_answers_says_so_and_exits(tmp_path):
    """Process 1 of 2 started without process 0: it says at once what it waits for, and after
    --join-timeout exits 1 with one line naming the address and the fix (not XLA's native
    abort), having written nothing."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxmem.cli", "train", "--preset", "tiny", "--mesh", "fsdp=2"]
    cmd += ["--batch-size", "4", "--seq-len", "32", "--coordinator", f"localhost:{_free_port()}"]
    cmd += ["--num-processes", "2", "--process-id", "1", "--join-timeout", "2", "--out", str(out)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("jaxmem train:")]
    assert "joining the run's processes at localhost:" in lines[0]
    assert "nothing answers at localhost:" in lines[1] and "--process-id 0" in lines[1]
    assert time.monotonic() - start < 60
    assert not out.exists()


def test_a_mesh_with_a_tensor_axis_reads_and_prints_back():
    for text, (strategy, devices, tp, data) in {
        "fsdp=2,tp=2": ("fsdp", 4, 2, 2),
        "tp=2,zero1=4": ("zero1", 8, 2, 4),
        "tp=4": ("dp", 4, 4, 1),
        "dp=8": ("dp", 8, 1, 8),
    }.items():
        p = parse_mesh(text)
        assert (p.strategy, p.devices, p.tp, p.data) == (strategy, devices, tp, data)
        assert parse_mesh(p.mesh_text()) == p
    assert parse_mesh("fsdp=2,tp=2").shards_params and not parse_mesh("fsdp=1,tp=2").shards_params


def test_tagged_activations_take_megatrons_layout_over_the_tensor_axis():
    """Heads and MLP columns split over the tensor axis; the residual stream split by sequence
    with sequence parallelism, replicated without; the batch on the data axis throughout; what
    does not divide stays whole."""
    from jax.sharding import PartitionSpec as P

    from jaxmem.sharding import AXIS, TENSOR, tag_spec

    assert tag_spec("query_proj", (8, 32, 4, 16), 2, True) == P(AXIS, None, TENSOR, None)
    assert tag_spec("query_proj", (8, 32, 2, 2, 16), 4, True) == P(AXIS, None, None, None, None)
    assert tag_spec("query_proj", (8, 32, 2, 4, 16), 4, True) == P(AXIS, None, None, TENSOR, None)
    assert tag_spec("attn_probs", (8, 4, 32, 32), 2, True) == P(AXIS, TENSOR, None, None)
    assert tag_spec("mlp_up", (8, 32, 256), 2, True) == P(AXIS, None, TENSOR)
    assert tag_spec("attn_context", (8, 32, 64), 2, False) == P(AXIS, None, TENSOR)
    assert tag_spec("norm1_out", (8, 32, 64), 2, True) == P(AXIS, TENSOR, None)
    assert tag_spec("mlp_residual", (8, 32, 64), 2, False) == P(AXIS, None, None)
    assert tag_spec("something_else", (8, 32, 64), 2, True) is None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_train_runs_tensor_parallelism_from_the_command_line(tmp_path):
    """``--mesh tp=2`` without sequence parallelism: the run's config says so, its command
    resumes it, and it logs the one-device run's losses (within the data-parallel tolerance)."""
    import yaml

    args = [*SHAPE, "--steps", "3", "--sample-tokens", "0"]
    _train(tmp_path / "tp", *args, "--mesh", "tp=2", "--set", "parallel.sequence_parallel=false")
    saved = yaml.safe_load((tmp_path / "tp" / "config.yaml").read_text())["parallel"]
    assert (saved["devices"], saved["tp"], saved["sequence_parallel"]) == (2, 2, False)
    assert cli.main(["train", *args, "--out", str(tmp_path / "one")]) == 0
    np.testing.assert_allclose(
        _losses(tmp_path / "tp"),
        _losses(tmp_path / "one"),
        **tolerance("float32", "data_parallel_loss").kwargs(),
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_stops_every_process_after_the_step_and_saves_it(tmp_path):
    """A terminal's Ctrl-C (SIGINT to each process's whole process group) reaches each run's
    work once, through the process the user started: both stop after the same step, save it,
    and exit 130 (twice would abort without saving)."""
    import signal

    run = tmp_path / "run"
    args = [*SHAPE, "--mesh", f"fsdp={N}", "--steps", "100000", "--checkpoint-every", "1000"]
    procs = _launch(run, *args, "--sample-tokens", "0", processes=2, new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and all(p.poll() is None for p in procs):
            if (run / "metrics.jsonl").exists() and len(_losses(run)) >= 2:
                break
            time.sleep(0.1)
        for p in procs:
            os.killpg(p.pid, signal.SIGINT)
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [130, 130], errs
    steps = {re.search(r"SIGINT at step (\d+): saved checkpoint", e).group(1) for e in errs}
    (step,) = steps
    assert sorted(os.listdir(run / "checkpoints")) == [step]

"""torch_ref over several processes (``torch_ref.distributed``: DDP, FSDP2) against one device and
against jaxmem's sharded step: torchrun launches with gloo, as subprocesses with timeouts.

- every strategy trains as one device does (within the data-parallel tolerance), and each rank
  holds its share of parameters, gradients and optimizer state;
- ``jaxmem train --framework torch --mesh fsdp=2`` under torchrun logs the losses of ``jaxmem
  train --mesh fsdp=2`` (JAX) over 10 steps, and only rank 0 writes the run's files; streamed
  (``--stream``) it logs the same numbers; a rank SIGKILLed mid-run ends the other in one line
  naming the checkpoint to resume from, and the resumed run logs the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from jaxmem.compare.tolerances import tolerance
from tests.test_parallel import processes_running

N = 2
HERE = os.path.dirname(__file__)
BIN = os.path.dirname(sys.executable)
TIMEOUT = 300


def _env() -> dict[str, str]:
    # one thread per rank: two ranks on a 2-core machine, no oversubscription
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", f"--nproc_per_node={N}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def strategies():
    proc = torchrun(os.path.join(HERE, "torch_parallel_worker.py"))
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_torch_strategy_trains_as_one_device(strategies):
    tol = tolerance("float32", "data_parallel_loss")
    for strategy in ("dp", "zero1", "fsdp"):
        np.testing.assert_allclose(
            strategies[strategy]["losses"], strategies["one_device"], **tol.kwargs()
        )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_rank_holds_its_share(strategies):
    """FSDP2 (``fsdp``, and ``zero1``'s ZeRO-2-like mode) keeps 1/N of the parameters,
    gradients and AdamW state per rank between steps (dimension 0 padded to N: within 5 %); DDP
    replicates them and holds more at its peak than one device (its gradient buckets)."""
    one = strategies["one_device_record"]
    for strategy, share in (("dp", 1), ("zero1", 1 / N), ("fsdp", 1 / N)):
        ranks = strategies[strategy]["ranks"]
        assert [r["rank"] for r in ranks] == list(range(N))
        for r in ranks:
            for key in ("params_bytes", "grads_bytes", "opt_state_bytes"):
                assert r[key] == pytest.approx(one[key] * share, rel=0.05), (strategy, key)
            assert f"per rank of {strategy}={N}" in r["peak_source"]
    dp_peak = strategies["dp"]["ranks"][0]["peak_bytes"]
    assert dp_peak > one["peak_bytes"]
    assert strategies["fsdp"]["ranks"][0]["peak_bytes"] < one["peak_bytes"]


def _jaxmem(*args: str) -> list[str]:
    return [os.path.join(BIN, "jaxmem"), *args]


def _metrics(run) -> list[dict]:
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_trains_as_jax_fsdp_and_resumes_bit_identically(tmp_path):
    common = ["--preset", "tiny", "--mesh", f"fsdp={N}", "--batch-size", "8", "--seq-len", "32"]
    common += ["--policy", "full", "--steps", "10", "--checkpoint-every", "5"]
    common += ["--eval-every", "5", "--sample-tokens", "8"]
    jax_run, torch_run = tmp_path / "jax", tmp_path / "torch"
    proc = subprocess.run(
        _jaxmem("train", *common, "--out", str(jax_run)),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torchrun(
        "--no-python", *_jaxmem("train", "--framework", "torch", *common, "--out", str(torch_run))
    )
    assert out.stdout.count("jaxmem train (torch)") == 1  # rank 0's console only
    j, t = _metrics(jax_run), _metrics(torch_run)
    assert [r["step"] for r in t] == list(range(1, 11))
    np.testing.assert_allclose(
        [r["loss"] for r in t],
        [r["loss"] for r in j],
        **tolerance("float32", "adamw_loss").kwargs(),
    )
    files = sorted(p.name for p in torch_run.iterdir() if not p.name.startswith("."))
    assert files == [
        "checkpoints",
        "config.yaml",
        "loss.png",
        "metrics.jsonl",
        "sample.txt",
        "summary.json",
    ]
    assert sorted(p.name for p in (torch_run / "checkpoints").iterdir()) == ["10", "5"]
    # streamed through host memory (FSDP2's CPUOffloadPolicy on both ranks): the same numbers
    streamed = tmp_path / "streamed"
    torchrun(
        "--no-python",
        *_jaxmem("train", "--framework", "torch", *common, "--stream", "--out", str(streamed)),
    )
    assert [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in _metrics(streamed)] == [
        (r["loss"], r["grad_norm"], r.get("val_loss")) for r in t
    ]
    # rank 1 lost mid-run (SIGKILL once checkpoint 5 verifies): rank 0 ends in one line naming
    # the checkpoint, torchrun ends the run, nothing is left running, and the resumed run logs
    # the uninterrupted run's numbers
    lost = tmp_path / "lost"
    agent, err, took = _lose_rank(lost, common, 1)
    assert agent.returncode != 0 and took < 60, (took, err[-3000:])
    lines = [ln for ln in err.splitlines() if ln.startswith("jaxmem train:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("jaxmem train: rank 0 of 2: another rank is gone"), lines[0]
    assert f"last verified checkpoint: step 5 in {lost}/checkpoints" in lines[0]
    resume = f"torchrun --standalone --nproc_per_node={N} --no-python jaxmem train --out {lost}"
    assert f"(continue with: {resume} --resume)" in lines[0]
    assert "[rank0]: Traceback" not in err  # torchrun's own report follows, as torchrun's
    assert not processes_running(str(lost))
    torchrun("--no-python", *_jaxmem("train", "--out", str(lost), "--resume", "--steps", "10"))
    resumed = _metrics(lost)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in t
    ]


def _lose_rank(run, common: list[str], victim: int) -> tuple[subprocess.Popen, str, float]:
    """torchrun the torch run; once checkpoint 5 verifies, stop rank ``victim`` where it is and
    SIGKILL it. Returns torchrun, its stderr and the seconds it took to end after the kill."""
    import signal
    import time

    from jaxmem.train.layout import verify

    cmd = [os.path.join(BIN, "torchrun"), "--standalone", f"--nproc_per_node={N}", "--no-python"]
    cmd += _jaxmem("train", "--framework", "torch", *common, "--out", str(run))
    agent = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    try:
        deadline = time.time() + TIMEOUT
        while time.time() < deadline and agent.poll() is None:
            time.sleep(0.02)
            if verify(str(run / "checkpoints" / "5")) is None:
                break
        ranks = {}
        with open(f"/proc/{agent.pid}/task/{agent.pid}/children") as f:
            for pid in f.read().split():
                with open(f"/proc/{pid}/environ", "rb") as env:
                    values = dict(e.split(b"=", 1) for e in env.read().split(b"\0") if b"=" in e)
                ranks[int(values[b"RANK"])] = int(pid)
        os.kill(ranks[victim], signal.SIGSTOP)  # frozen mid-run: the kill cannot race the end
        assert agent.poll() is None and len(ranks) == N, "the run ended before the kill"
        os.kill(ranks[victim], signal.SIGKILL)
        start = time.monotonic()
        _, err = agent.communicate(timeout=120)
        return agent, err, time.monotonic() - start
    finally:
        agent.kill()


@pytest.mark.parametrize(
    ("world", "fragment"),
    [
        (1, "runs one process per device: launch it with torchrun --standalone --nproc_per_node=4"),
        (2, "torchrun started 2 processes but the run's mesh is fsdp=4 (4 device(s))"),
    ],
)
def test_a_torch_mesh_without_its_processes_is_refused_naming_the_launch(world, fragment):
    from jaxmem.config import ConfigError
    from jaxmem.parallel import ParallelConfig
    from torch_ref.distributed import Launch, check_launch

    with pytest.raises(ConfigError) as exc:
        check_launch(ParallelConfig(strategy="fsdp", devices=4), Launch(world_size=world), "x")
    assert fragment in str(exc.value)


def test_torch_mesh_outside_torchrun_exits_2_before_writing(tmp_path, capsys, monkeypatch):
    from jaxmem import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--framework", "torch", "--mesh", "fsdp=2", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--nproc_per_node=2 --no-python jaxmem train --framework torch" in err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_memory_command_reports_torch_ranks(tmp_path):
    """``jaxmem memory --mesh fsdp=2 --frameworks torch``: torch_ref's step run on 2 torchrun
    processes, one record per rank, each holding half the parameters and AdamW state of the
    analytic model's ZeRO-3 terms (jaxmem's sharding, exact for JAX; within 5 % here: FSDP2
    pads dimension 0 where jaxmem splits a leaf's largest divisible dimension)."""
    from jaxmem.config import PRESETS, OptimizerConfig
    from jaxmem.memory.analytic import model_state_bytes
    from jaxmem.parallel import ParallelConfig
    from jaxmem.precision import PRECISIONS

    out = tmp_path / "m.json"
    args = ["memory", "--preset", "tiny", "--policies", "full", "--batch-size", "8"]
    args += ["--seq-len", "32", "--mesh", f"fsdp={N}", "--frameworks", "torch"]
    proc = subprocess.run(
        _jaxmem(*args, "--json", str(out)),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch_ref per rank" in proc.stdout
    ranks = json.loads(out.read_text())
    assert [(r["framework"], r["rank"]) for r in ranks] == [("torch", i) for i in range(N)]
    model = model_state_bytes(
        PRESETS["tiny"],
        OptimizerConfig(),
        PRECISIONS["fp32"],
        ParallelConfig(strategy="fsdp", devices=N),
    )
    for r in ranks:
        assert r["mesh"] == f"fsdp={N}" and "FSDPMemTracker" in r["peak_source"]
        assert r["params_bytes"] == pytest.approx(model["params"], rel=0.05)
        assert r["opt_state_bytes"] == pytest.approx(model["opt_state"], rel=0.05)


WORKER_END = """
import sys
import torch
import torch_ref
from torch_ref import distributed as tdist
from jaxmem.config import PRESETS
from jaxmem.parallel import ParallelConfig

launch = tdist.from_environment()
tdist.initialize(launch)
model = tdist.shard(
    torch_ref.Decoder(PRESETS["tiny"]), ParallelConfig(strategy="fsdp", devices=2), launch
)
model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
# torchrun sets PYTHONUNBUFFERED; a launcher that does not leaves stdout block-buffered
sys.stdout = open(1, "w", buffering=8192, closefd=False)
print(f"rank {launch.rank} done")  # still in the buffer: end_worker must flush it
tdist.shutdown()
tdist.end_worker(int(sys.argv[1]))
raise SystemExit("end_worker returned in a worker that joined a group")
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("code", [0, 3])
def test_a_worker_that_joined_a_group_ends_with_its_code_and_its_output(tmp_path, code):
    """``end_worker`` ends an FSDP2 rank (whose groups outlive ``destroy_process_group``)
    without the interpreter's teardown, with the code it was given and its output flushed."""
    from torch_ref import distributed as tdist

    tdist.end_worker(5)  # this process joined no group: it returns
    script = tmp_path / "worker.py"
    script.write_text(WORKER_END)
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", f"--nproc_per_node={N}"]
    proc = subprocess.run(
        [*cmd, str(script), str(code)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
    )
    # both ranks write to one pipe: their lines may interleave
    assert sorted(re.findall(r"rank \d done", proc.stdout)) == [f"rank {r} done" for r in range(N)]
    if code == 0:
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert proc.returncode != 0 and f"exitcode  : {code}" in proc.stderr, proc.stderr

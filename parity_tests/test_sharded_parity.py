"""torch_ref over several processes (``torch_ref.distributed``: DDP, FSDP2) against one device and
against jaxmem's sharded step: torchrun launches with gloo, as subprocesses with timeouts.

- every strategy trains as one device does (within the data-parallel tolerance), and each rank
  holds its share of parameters, gradients and optimizer state;
- ``jaxmem train --framework torch --mesh fsdp=2`` under torchrun logs the losses of ``jaxmem
  train --mesh fsdp=2`` (JAX) over 10 steps, and only rank 0 writes the run's files; streamed
  (``--stream``) it logs the same numbers; a rank SIGKILLed mid-run ends the other in one line
  naming the checkpoint to resume from, and the resumed run logs the uninterrupted run's;
- tensor parallelism (``tp=2`` on 2 ranks, ``fsdp=2,tp=2`` on 4) trains as one device, each
  rank holding its share of the split weights and their AdamW moments, and ``jaxmem train
  --framework torch --mesh tp=2`` logs the losses of ``jaxmem train --mesh tp=2`` (JAX) and
  resumes to the uninterrupted run's numbers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS
from tests.test_parallel import processes_running

N = 2
HERE = os.path.dirname(__file__)
BIN = os.path.dirname(sys.executable)
TIMEOUT = 300


def _env() -> dict[str, str]:
    # one thread per rank: two ranks on a 2-core machine, no oversubscription
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(*args: str, nproc: int = N) -> subprocess.CompletedProcess:
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def strategies():
    proc = torchrun(os.path.join(HERE, "torch_parallel_worker.py"))
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_clips_by_the_global_norm_as_one_device_does(strategies):
    """Clipping over 2 FSDP2 ranks scales each shard by the norm reduced over the ranks: with
    every step's norm above the clip, the losses are one device's (clip_grad_norm_)."""
    one, fsdp = strategies["one_device_clipped"], strategies["fsdp_clipped"]
    for run in (one, fsdp):  # the worker's CLIP, 0.05: active at every step
        assert min(run["grad_norms"]) > 0.05, run["grad_norms"]
    tol = tolerance("float32", "data_parallel_loss").kwargs()
    np.testing.assert_allclose(fsdp["losses"], one["losses"], **tol)
    assert fsdp["losses"] != strategies["fsdp"]["losses"]  # the clip changed the run


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
    replicates them and holds more at its peak than one device on a rank's rows (its gradient
    buckets)."""
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


def _worker(nproc: int, mesh: str, *presets: str) -> dict:
    proc = torchrun(
        os.path.join(HERE, "torch_tensor_parallel_worker.py"), mesh, *presets, nproc=nproc
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# mesh -> (ranks, presets): tp alone on the GPT and the Llama preset, fsdp x tp on the Llama
# one (grouped key/value heads split over the tensor axis)
TENSOR_MESHES = {"tp=2": (2, ("tiny", "tiny-llama")), "fsdp=2,tp=2": (4, ("tiny-llama",))}
SHARE = {"tp=2": 2, "fsdp=2,tp=2": 4}  # of a split weight, per rank
WORKER_ROWS, WORKER_SEQ = 8, 32  # torch_tensor_parallel_worker's batch


@pytest.fixture(scope="module")
def tensor_parallel():
    return {mesh: _worker(n, mesh, *presets) for mesh, (n, presets) in TENSOR_MESHES.items()}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torch_tensor_parallelism_trains_as_one_device(tensor_parallel):
    """Losses and gradient norms (sequence-parallel norms' gradients reduced, nothing counted
    twice) of 6 AdamW steps over ``tp=2`` and ``fsdp=2,tp=2`` equal one device's; the state
    gathered for a checkpoint is the one-device state bit for bit (the fused q/k/v rows back in
    [q | k | v] order)."""
    tol = tolerance("float32", "data_parallel_loss")
    for mesh, runs in tensor_parallel.items():
        for preset, run in runs.items():
            for key in ("losses", "grad_norms"):
                np.testing.assert_allclose(
                    run["mesh"][key], run["one_device"][key], **tol.kwargs(), err_msg=mesh
                )
            assert run["ranks"][0]["state_in_qkv_order"] is True, (mesh, preset)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_name_based_policies_name_the_same_ops_over_a_tensor_axis(tensor_parallel):
    """A block's stream of the op kinds ``torch_ref.remat.block_ops`` counts is the one-device
    stream over the mesh (the collectives and layout ops DTensor and FSDP2 add are of other
    kinds), so a selective policy's table names the same ops."""
    for mesh, runs in tensor_parallel.items():
        for preset, run in runs.items():
            ops = run["counted_ops"]
            assert ops["mesh"] == ops["one_device"] and ops["mesh"], (mesh, preset)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_tensor_rank_holds_its_share_of_the_split_weights(tensor_parallel):
    """Each rank holds exactly 1/tp (1/4 over fsdp=2 x tp=2) of the fused q/k/v, the out
    projection, the MLP's matrices and the column-parallel biases, and of their AdamW moments;
    over ``tp=2`` alone every other parameter is whole, so a rank's parameter, gradient and
    AdamW bytes are one device's less the halves it does not hold, and its saved activations
    one device's less half of every block's input."""
    for mesh, runs in tensor_parallel.items():
        for preset, run in runs.items():
            one = run["one_record"]
            for r in run["ranks"]:
                held = r["holdings"]
                assert held, (mesh, preset)
                for name, (whole, mine, *moments) in held.items():
                    assert mine * SHARE[mesh] == whole and moments == [mine, mine], (mesh, name)
                rec = r["record"]
                assert f"per rank of {mesh}" in rec["peak_source"]
                if mesh == "tp=2":
                    missing = 4 * sum(whole - mine for whole, mine, *_ in held.values())  # fp32
                    assert rec["params_bytes"] == one["params_bytes"] - missing
                    assert rec["grads_bytes"] == one["grads_bytes"] - missing
                    assert rec["opt_state_bytes"] == one["opt_state_bytes"] - 2 * missing
                    # full remat with sequence parallelism: each rank keeps its half of every
                    # block's input (a DTensor counted at its local shard), the rest as one
                    # device does
                    cfg = PRESETS[preset]
                    halves = cfg.n_layers * WORKER_ROWS * WORKER_SEQ * cfg.d_model * 4 // 2
                    saved = "saved_activation_bytes_device"
                    assert one[saved] - rec[saved] == halves, (preset, one[saved], rec[saved])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("preset", "resume"), [("tiny", False), ("tiny-llama", True)])
def test_torch_tensor_parallel_job_logs_jax_losses_and_resumes(tmp_path, preset, resume):
    """``jaxmem train --framework torch --mesh tp=2`` (2 torchrun ranks, sequence parallelism)
    logs the losses of ``jaxmem train --mesh tp=2``; the run cut back to its step-5 checkpoint
    and resumed logs the uninterrupted run's losses and gradient norms (one preset: each run
    is a torchrun launch)."""
    common = ["--preset", preset, "--mesh", "tp=2", "--batch-size", "8", "--seq-len", "32"]
    common += ["--policy", "full", "--steps", "10", "--checkpoint-every", "5"]
    common += ["--eval-every", "5", "--sample-tokens", "8"]
    torch_run = tmp_path / "torch"
    out, t = _torch_logs_jax_losses(tmp_path, common)
    assert "DTensor tensor parallelism over tp=2" in out.stdout
    if not resume:
        return
    resumed = tmp_path / "resumed"
    shutil.copytree(torch_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "10")
    torchrun("--no-python", *_jaxmem("train", "--out", str(resumed), "--resume"))
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in _metrics(resumed)] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in t
    ]


def test_key_value_heads_that_do_not_split_over_tp_are_refused_for_torch():
    """Fused attention runs grouped heads whole in JAX; torch_ref splits whole key/value heads
    (``HeadAlignedColwise``), so 2 of them over tp=4 is refused in one line."""
    from jaxmem.config import PRESETS
    from jaxmem.job import torch_mesh_refusal
    from jaxmem.parallel import parse_mesh

    cfg = PRESETS["tiny-llama"].replace(attention="fused")
    parse_mesh("tp=4").check_model(cfg, 32)  # JAX runs it
    text = torch_mesh_refusal(parse_mesh("tp=4"), cfg)
    assert text == (
        "--mesh tp=4: torch_ref splits whole key/value heads over the tensor axis; the model's "
        "2 key/value heads do not split over tp=4: use a tp that divides 2, or --framework jax"
    )
    assert torch_mesh_refusal(parse_mesh("tp=2"), cfg) is None
    assert torch_mesh_refusal(parse_mesh("fsdp=2,tp=2"), cfg) is None


def _jaxmem(*args: str) -> list[str]:
    return [os.path.join(BIN, "jaxmem"), *args]


def _metrics(run) -> list[dict]:
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _torch_logs_jax_losses(
    tmp_path, common: list[str], nproc: int = N
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``jaxmem train *common`` in JAX (``tmp_path/jax``) and under torchrun with ``--framework
    torch`` (``tmp_path/torch``): the torch run logs steps 1..10 with JAX's losses (bound
    ``adamw_loss``). Returns torchrun's process and the torch run's metrics."""
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
        "--no-python",
        *_jaxmem("train", "--framework", "torch", *common, "--out", str(torch_run)),
        nproc=nproc,
    )
    j, t = _metrics(jax_run), _metrics(torch_run)
    assert [r["step"] for r in t] == list(range(1, 11))
    np.testing.assert_allclose(
        [r["loss"] for r in t],
        [r["loss"] for r in j],
        **tolerance("float32", "adamw_loss").kwargs(),
    )
    return out, t


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_trains_as_jax_fsdp_and_resumes_bit_identically(tmp_path):
    common = ["--preset", "tiny", "--mesh", f"fsdp={N}", "--batch-size", "8", "--seq-len", "32"]
    common += ["--policy", "full", "--steps", "10", "--checkpoint-every", "5"]
    common += ["--eval-every", "5", "--sample-tokens", "8"]
    torch_run = tmp_path / "torch"
    out, t = _torch_logs_jax_losses(tmp_path, common)
    assert out.stdout.count("jaxmem train (torch)") == 1  # rank 0's console only
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


def _lose_rank(
    run, common: list[str], victim: int, nproc: int = N
) -> tuple[subprocess.Popen, str, float]:
    """torchrun the torch run (``nproc`` ranks); once checkpoint 5 verifies, stop rank
    ``victim`` where it is and SIGKILL it. Returns torchrun, its stderr and the seconds it took
    to end after the kill."""
    import signal
    import time

    from jaxmem.run_layout import verify

    cmd = [os.path.join(BIN, "torchrun"), "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["--no-python"]
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
        assert agent.poll() is None and len(ranks) == nproc, "the run ended before the kill"
        os.kill(ranks[victim], signal.SIGKILL)
        start = time.monotonic()
        _, err = agent.communicate(timeout=120)
        return agent, err, time.monotonic() - start
    finally:
        agent.kill()


@pytest.mark.parametrize(
    ("mesh", "world", "fragment"),
    [
        (
            "fsdp=4",
            1,
            "runs one process per device: launch it with torchrun --standalone --nproc_per_node=4",
        ),
        ("fsdp=4", 2, "torchrun started 2 processes but the run's mesh is fsdp=4 (4 device(s))"),
        (
            "fsdp=2,tp=2",
            2,
            "the run's mesh is fsdp=2,tp=2 (4 device(s)): use --nproc_per_node=4 or a --mesh of "
            "2 devices",
        ),
    ],
)
def test_a_torch_mesh_without_its_processes_is_refused_naming_the_launch(mesh, world, fragment):
    from jaxmem.config import ConfigError
    from jaxmem.parallel import parse_mesh
    from torch_ref.distributed import Launch, check_launch

    with pytest.raises(ConfigError) as exc:
        check_launch(parse_mesh(mesh), Launch(world_size=world), "x")
    assert fragment in str(exc.value)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_head_aligned_rows_give_each_rank_whole_heads_of_the_fused_projection(preset):
    """``HeadAlignedColwise``'s order: the fused q/k/v rows cut into ``tp`` contiguous parts
    are each rank's heads' q, k and v rows, and the same ``SelfAttention.forward`` run on one
    part (with its out projection's columns) gives that rank's heads' share: the parts' outputs
    sum to the whole layer's (float64), as the row-parallel reduction sums them."""
    import torch

    import torch_ref
    from jaxmem.config import PRESETS
    from torch_ref.distributed import head_aligned_rows

    cfg = PRESETS[preset]
    tp = 2
    torch.manual_seed(0)
    attn = torch_ref.model.Block(cfg).self_attn.double()
    x = torch.randn(2, 16, cfg.d_model, dtype=torch.float64)
    mask = torch_ref.model.causal_mask(cfg, 16, x.device)
    rope = torch_ref.model.rope_tables(cfg, 16, x.device, torch.float64)
    whole = attn(x, mask, rope)
    rows = head_aligned_rows(cfg.d_model, cfg.kv_dim, tp).reshape(tp, -1)
    columns = torch.arange(cfg.d_model).reshape(tp, -1)  # the context's heads, in rank order
    total = torch.zeros_like(whole)
    for r in range(tp):
        part = torch_ref.model.SelfAttention(cfg).double()
        with torch.no_grad():
            part.in_proj_weight = torch.nn.Parameter(attn.in_proj_weight[rows[r]])
            if attn.in_proj_bias is not None:
                part.in_proj_bias = torch.nn.Parameter(attn.in_proj_bias[rows[r]])
            part.out_proj.weight = torch.nn.Parameter(attn.out_proj.weight[:, columns[r]])
            part.out_proj.bias = None  # added once, after the sum
        total += part(x, mask, rope)
    if attn.out_proj.bias is not None:
        total += attn.out_proj.bias
    np.testing.assert_allclose(
        total.detach().numpy(),
        whole.detach().numpy(),
        **tolerance("float64", "block_output").kwargs(),
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--mesh", "fsdp=2"], "--nproc_per_node=2 --no-python jaxmem train --framework torch"),
        (
            ["--mesh", "dp=2,tp=2"],
            "--mesh dp=2,tp=2: torch_ref has no dp over a tensor axis (PyTorch's DDP does not "
            "take DTensor parameters); use --mesh zero1=2,tp=2 or fsdp=2,tp=2 (FSDP2), or "
            "--framework jax",
        ),
        (
            ["--mesh", "tp=2", "--precision", "fp16"],
            "--mesh tp=2 with precision 'fp16': PyTorch's GradScaler cannot unscale tensor "
            "parallelism's split (DTensor) gradients beside the whole ones",
        ),
    ],
)
def test_torch_mesh_it_cannot_launch_exits_2_before_writing(
    tmp_path, capsys, monkeypatch, args, fragment
):
    """Outside torchrun a mesh names its torchrun command; dp over a tensor axis names the
    FSDP2 meshes that run it, fp16 over a tensor axis alone bf16 or a data axis (before any
    process starts)."""
    from jaxmem import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--framework", "torch", *args, "--out", str(out)])
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err
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

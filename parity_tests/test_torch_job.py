"""``jaxmem train --framework torch``: the same job, the same step loop and run files, in
torch_ref; its losses against a JAX run of the same job, its resume, its non-finite stop, and
its state in host memory (streamed, or the hybrid optimizer's)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxmem import cli
from jaxmem.compare.tolerances import tolerance
from jaxmem.run_layout import verify
from tests.test_schedule import SCHEDULE
from tests.test_train import TINY, check_non_finite_stop, metrics, train


def test_non_finite_loss_stops_the_torch_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    check_non_finite_stop(tmp_path, capsys, "torch")


@pytest.mark.slow
def test_torch_framework_trains_the_same_job_to_the_same_losses(tmp_path):
    jax_run, torch_run = tmp_path / "jax", tmp_path / "torch"
    common = ["--steps", "12", "--checkpoint-every", "12", "--eval-every", "6"]
    assert train(*common, "--out", str(jax_run)) == 0
    assert train(*common, "--framework", "torch", "--out", str(torch_run)) == 0
    j, t = metrics(jax_run), metrics(torch_run)
    assert [r["step"] for r in t] == list(range(1, 13))
    tol = tolerance("float32", "adamw_loss")
    np.testing.assert_allclose(
        [r["loss"] for r in j], [r["loss"] for r in t], rtol=tol.rtol, atol=tol.atol
    )
    assert sorted(os.listdir(torch_run / "checkpoints")) == ["12"]
    # both curves on one plot
    assert cli.main(["plot", str(jax_run), str(torch_run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0


def _train_process(*args: str) -> int:
    """``jaxmem train`` (the tests' tiny job) as a process of its own; its exit code."""
    cmd = [sys.executable, "-m", "jaxmem.cli", "train", *TINY, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.returncode


@pytest.fixture(scope="module")
def unstreamed(tmp_path_factory):
    """The reference: 6 steps of a bf16 selective torch run in 2 microbatches, state on the
    device."""
    out = tmp_path_factory.mktemp("unstreamed") / "run"
    assert train(*HOST_RUN, "--steps", "6", "--framework", "torch", "--out", str(out)) == 0
    return metrics(out)


HOST_RUN = ["--precision", "bf16", "--policy", "selective", "--accum", "2", "--eval-every", "3"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "host",
    [
        ["--stream"],  # FSDP2's CPUOffloadPolicy on a process group of one
        ["--set", "optimizer.state_memory=pinned_host"],  # Megatron's hybrid optimizer
    ],
    ids=["stream", "hybrid"],
)
def test_torch_state_in_host_memory_trains_and_resumes_to_the_device_resident_losses(
    unstreamed, host, tmp_path
):
    """torch_ref's host-memory strategies move tensors, not arithmetic: killed after its
    checkpoint at step 3 and resumed to 6, each logs the device-resident run's losses, validation
    losses and gradient norms bit for bit."""
    out = tmp_path / "run"
    common = [*HOST_RUN, "--framework", "torch", *host, "--checkpoint-every", "3"]
    # a streamed run joins a process group (of one: FSDP2 needs one) and so ends its process
    # past its records (torch_ref.distributed.end_worker): it runs in a process of its own
    run = train if "--stream" not in host else _train_process
    assert run(*common, "--steps", "3", "--out", str(out)) == 0
    assert run("--resume", "--steps", "6", "--out", str(out)) == 0
    got = metrics(out)
    keys = ("step", "loss", "grad_norm", "val_loss")
    assert [[r.get(k) for k in keys] for r in got] == [[r.get(k) for k in keys] for r in unstreamed]


@pytest.mark.slow
def test_torch_streams_the_jax_streamed_runs_losses(unstreamed, tmp_path):
    """``--stream`` in both frameworks: the same losses within the table's bf16 entry."""
    out = tmp_path / "jax"
    assert train(*HOST_RUN, "--steps", "6", "--stream", "--out", str(out)) == 0
    tol = tolerance("bfloat16", "loss")
    np.testing.assert_allclose(
        [r["loss"] for r in metrics(out)], [r["loss"] for r in unstreamed], **tol.kwargs()
    )


@pytest.mark.slow
def test_torch_loss_chunks_train_to_the_whole_losses(unstreamed, tmp_path):
    """``--loss-chunks`` in torch_ref (its chunked loss, an extension, inside the decoder's
    forward): the whole loss's losses within the chunking entry of the table."""
    out = tmp_path / "chunked"
    args = [*HOST_RUN, "--steps", "6", "--loss-chunks", "4", "--framework", "torch"]
    assert train(*args, "--out", str(out)) == 0
    tol = tolerance("bfloat16", "loss_chunks_loss")
    np.testing.assert_allclose(
        [r["loss"] for r in metrics(out)], [r["loss"] for r in unstreamed], **tol.kwargs()
    )


@pytest.mark.slow
def test_torch_trains_a_per_tag_mix_with_the_embedding_replayed(unstreamed, tmp_path):
    """A per-tag mixed stack (``--set memory.rest=custom``) with ``--replay-embedding`` under
    torch_ref's stock checkpointing: the losses of the run under selective, bit for bit (a
    replay in eager PyTorch runs the same kernels on the same inputs)."""
    out = tmp_path / "mixed"
    policy = ["--policy", "custom", "--save", "query_proj,key_proj,value_proj,mlp_up"]
    policy += ["--set", "memory.layers_first=1", "--set", "memory.rest=custom"]
    policy += ["--set", 'memory.rest_save=["attn_out", "mlp_up"]', "--replay-embedding"]
    args = [*HOST_RUN[:2], *policy, *HOST_RUN[4:], "--steps", "6", "--framework", "torch"]
    assert train(*args, "--out", str(out)) == 0
    assert "keep(qkv+mlp_up):1+keep(attn_out+mlp_up)" in (out / "config.yaml").read_text()
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in unstreamed]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--set", "optimizer.params_memory=pinned_host"], "only by streaming them (--stream"),
        (["--stream", "--stream-update", "device"], "whose optimizer steps on the CPU"),
        (
            ["--set", "optimizer.state_memory=pinned_host", "--precision", "fp16"],
            "host optimizer runs without GradScaler",
        ),
    ],
)
def test_what_torch_keeps_in_host_memory_only_otherwise_is_one_line_exit_2(
    extra, message, tmp_path, capsys
):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        train("--framework", "torch", *extra, "--out", str(out))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_torch_run_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "torch"
    common = ["--framework", "torch", "--checkpoint-every", "3", "--out", str(out)]
    assert train("--steps", "6", *common) == 0
    first = metrics(out)
    assert train("--steps", "9", "--resume", *common) == 0
    resumed = metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, 10))
    assert resumed[:6] == first


def test_a_corrupt_torch_checkpoint_is_skipped_and_kept_aside(tmp_path, capsys, monkeypatch):
    """The same integrity rule as JAX runs: flip bytes in the newest ``state.pt`` and --resume
    names it, moves it to quarantine, and resumes from the newest checkpoint that verifies,
    training exactly what the first run trained."""
    out = tmp_path / "torch"
    common = ["--framework", "torch", "--checkpoint-every", "2", "--out", str(out)]
    assert train("--steps", "4", *common) == 0
    first = metrics(out)
    state = out / "checkpoints" / "4" / "state.pt"
    data = bytearray(state.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 3] = bytes(b ^ 0xFF for b in data[middle : middle + 3])
    state.write_bytes(bytes(data))
    assert verify(str(out / "checkpoints" / "4")) == (
        "file state.pt changed since it was saved (checksum mismatch)"
    )
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "400")  # one message per line
    assert train("--steps", "5", "--resume", *common) == 0
    printed = capsys.readouterr().out
    assert "skipped checkpoint 4: file state.pt changed since it was saved" in printed
    assert "resumed from step 2" in printed
    assert (out / "quarantine" / "checkpoint-4" / "state.pt").read_bytes() == bytes(data)
    resumed = metrics(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    trained = [(r["step"], r["loss"], r["grad_norm"]) for r in resumed[:4]]
    assert trained == [(r["step"], r["loss"], r["grad_norm"]) for r in first]  # bit for bit
    assert sorted(os.listdir(out / "checkpoints")) == ["4", "5"]  # --keep 2 (the default)
    assert all(verify(str(out / "checkpoints" / s)) is None for s in ("4", "5"))


@pytest.mark.parametrize("peer_gone", [True, False])
def test_torchruns_sigterm_during_a_lost_peers_failure_keeps_the_one_line(
    peer_gone, tmp_path, monkeypatch
):
    """torchrun's agent SIGTERMs the surviving ranks as soon as it sees the lost one; landing
    while the survivor's failure unwinds (outside the loop's signal handling), it must not kill
    the rank before its one line. Any other SIGTERM still ends the process as its default."""
    import signal

    import torch.distributed as dist

    from jaxmem.compare import torch_run
    from jaxmem.train.loop import RunFailed

    error = "Connection closed by peer" if peer_gone else "something else"
    killed, real_kill = [], os.kill

    def run_job(*args, **kwargs):
        try:
            raise RuntimeError(f"[gloo] {error}")
        finally:  # the agent's SIGTERM arrives while the failure unwinds
            real_kill(os.getpid(), signal.SIGTERM)

    def kill(pid, number):  # the default's stand-in: the signal would end the process
        assert signal.getsignal(number) is signal.SIG_DFL
        killed.append(number)

    monkeypatch.setattr(torch_run, "run_job", run_job)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(torch_run.tdist, "shutdown", lambda: None)
    prepared = type("Prepared", (), {"out_dir": str(tmp_path)})()
    before = signal.getsignal(signal.SIGTERM)
    try:
        if peer_gone:
            with pytest.raises(RunFailed, match="rank 0 of 2: another rank is gone"):
                torch_run.run_training(prepared)
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # the report comes first
        else:
            monkeypatch.setattr(torch_run.os, "kill", kill)
            with pytest.raises(torch_run._Terminated):
                torch_run.run_training(prepared)
            assert killed == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_scheduled_clipped_torch_run_resumes_bit_for_bit_and_matches_jax(tmp_path):
    """torch_ref's LambdaLR and clip_grad_norm_ under the job: 4 steps (2 of warmup, cosine,
    clipped) equal 2 steps and a resume to 4, bit for bit, and the JAX run of the same job
    within the tolerance table."""
    runs = {name: tmp_path / name for name in ("jax", "torch", "resumed")}
    job = ["--decay-steps", "4", *SCHEDULE]
    assert train("--steps", "4", *job, "--out", str(runs["jax"])) == 0
    assert train("--steps", "4", *job, "--framework", "torch", "--out", str(runs["torch"])) == 0
    first = ["--steps", "2", "--checkpoint-every", "2", "--framework", "torch"]
    assert train(*first, *job, "--out", str(runs["resumed"])) == 0
    assert train("--steps", "4", "--out", str(runs["resumed"]), "--resume") == 0
    j, t, r = (metrics(runs[name]) for name in ("jax", "torch", "resumed"))
    keys = ("step", "loss", "lr", "grad_norm")
    assert [[x[k] for k in keys] for x in r] == [[x[k] for k in keys] for x in t]
    for key, tol in (("lr", "learning_rate"), ("loss", "adamw_loss")):
        np.testing.assert_allclose(
            [x[key] for x in t], [x[key] for x in j], **tolerance("float32", tol).kwargs()
        )

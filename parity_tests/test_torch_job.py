"""``jaxmem train --framework torch``: the same job, the same step loop and run files, in
torch_ref; its losses against a JAX run of the same job, its resume, its non-finite stop."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxmem import cli
from jaxmem.compare.tolerances import tolerance
from jaxmem.train.layout import verify
from tests.test_train import check_non_finite_stop, metrics, train


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


def test_host_resident_optimizer_state_is_refused_not_ignored_by_torch(tmp_path, capsys):
    """torch_ref's job keeps optimizer state on the device; asking for pinned_host exits 2 in
    one line before anything is written, rather than training with the state on the device."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        train(
            "--framework", "torch", "--set", "optimizer.state_memory=pinned_host", "--out", str(out)
        )
    assert exc.value.code == 2
    assert "torch_ref's training job keeps them on the device" in capsys.readouterr().err
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

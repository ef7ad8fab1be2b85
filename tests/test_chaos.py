"""The training job under abuse: corrupt checkpoints, two runs on one directory, a full disk,
Ctrl-C and SIGTERM, a half-written metrics line, and every user mistake, each answered in one
line rather than a traceback. Each test runs the real command (in a subprocess where the process
itself is the subject: signals, locks, disks, environment)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from jaxmem import cli
from jaxmem.run_layout import MANIFEST, verify
from jaxmem.train.loop import INITIAL_FIELDS, progress_bar
from tests.test_train import metrics, snapshot

BASE = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "0"]
RUN = [*BASE, "--checkpoint-every", "2", "--eval-every", "2", "--keep", "3"]


def jaxmem(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "400", **(env or {})},
        **kw,
    )


def popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxmem.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
    )


def wait_for(condition, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def steps_logged(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


# ----------------------------------------------------------------------- corrupt checkpoints
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 6-step run checkpointed (and evaluated) at 2, 4 and 6."""
    base = tmp_path_factory.mktemp("runs") / "base"
    proc = jaxmem("train", *RUN, "--steps", "6", "--out", str(base))
    assert proc.returncode == 0, proc.stderr
    return base


def _largest_file(directory) -> str:
    files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
    return max(files, key=os.path.getsize)


def flip_bytes(step_dir) -> str:
    path = _largest_file(step_dir / "params")
    data = bytearray(open(path, "rb").read())
    for i in (100, 200, 300):
        data[i] ^= 0xFF
    open(path, "wb").write(data)
    return "changed since it was saved (checksum mismatch)"


def garbage_config(step_dir) -> str:
    (step_dir / "run_config" / "metadata").write_text("{garbage")
    return "file run_config/metadata has"


def missing_meta(step_dir) -> str:
    os.remove(step_dir / "meta" / "metadata")
    return "file meta/metadata is missing"


def truncated_array(step_dir) -> str:
    path = _largest_file(step_dir / "params")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return "(truncated?)"


def no_manifest(step_dir) -> str:  # a save killed after orbax's rename, before the manifest
    os.remove(step_dir / MANIFEST)
    return "no integrity manifest"


@pytest.mark.slow
@pytest.mark.parametrize(
    "corrupt", [flip_bytes, garbage_config, missing_meta, truncated_array, no_manifest]
)
def test_every_kind_of_damage_fails_verification_with_its_reason(runs, tmp_path, corrupt):
    step_dir = tmp_path / "6"
    shutil.copytree(runs / "checkpoints" / "6", step_dir)
    assert verify(str(step_dir)) is None
    reason = corrupt(step_dir)
    assert reason in verify(str(step_dir))


@pytest.mark.slow
def test_resume_takes_the_newest_checkpoint_that_verifies(runs, tmp_path, capsys, monkeypatch):
    """Checkpoint 6 damaged (the same code path for every kind of damage: a step counts only
    once its manifest verifies) and the last metrics line cut by a kill: --resume says so in one
    line, moves 6 aside (never deletes it), resumes from 4 and rewrites exactly what the first
    run wrote, and keeps 2 (rotation counts only checkpoints that verify)."""
    run = tmp_path / "A"
    shutil.copytree(runs, run)
    reason = flip_bytes(run / "checkpoints" / "6")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 4.9')  # a kill mid-write
    assert cli.main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert "skipped 1 unreadable line(s)" in capsys.readouterr().err
    monkeypatch.setenv("COLUMNS", "400")  # one message per line
    assert cli.main(["train", *RUN, "--steps", "6", "--out", str(run), "--resume"]) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("skipped checkpoint")]
    assert len(skipped) == 1 and reason in skipped[0], out
    assert f"moved it to {run}/quarantine/checkpoint-6" in skipped[0]
    assert "resumed from step 4" in out
    assert verify(str(run / "quarantine" / "checkpoint-6")) is not None  # kept, as it was
    # keep 3: the bad 6 did not count, so 2 survives beside 4 and the new 6
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "4", "6"]
    assert verify(str(run / "checkpoints" / "6")) is None
    # the half-written line is gone and steps 5-6 are what the first run trained, bit for bit
    assert metrics(run) == metrics(runs)


@pytest.mark.slow
def test_resume_with_no_checkpoint_that_verifies_names_each_and_writes_nothing(
    runs, tmp_path, capsys
):
    run = tmp_path / "A"
    shutil.copytree(runs, run)
    for step, corrupt in zip((2, 4, 6), (flip_bytes, missing_meta, no_manifest), strict=True):
        corrupt(run / "checkpoints" / str(step))
    before = snapshot(run)
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", *RUN, "--steps", "8", "--out", str(run), "--resume"])
    assert exc.value.code == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert f"--resume: {run} holds no checkpoint that verifies (6: no integrity" in err
    assert "4: file meta/metadata is missing; 2: file params/" in err
    assert "start a new run in another directory" in err
    assert snapshot(run) == before


@pytest.mark.slow
def test_every_checkpoint_carries_a_manifest_that_catches_any_change(runs):
    base = runs
    for step in ("4", "6"):
        step_dir = base / "checkpoints" / step
        manifest = json.loads((step_dir / MANIFEST).read_text())
        on_disk = {
            os.path.relpath(os.path.join(r, f), step_dir)
            for r, _, fs in os.walk(step_dir)
            for f in fs
        } - {MANIFEST}
        assert set(manifest["files"]) == on_disk and manifest["step"] == int(step)
        assert verify(str(step_dir)) is None


# ----------------------------------------------------------------------------------- the lock
def test_an_abandoned_lock_removes_only_what_acquiring_made(tmp_path):
    """The lock file and the directories made for it go (the file while the lock is still
    held); a directory something else was written into keeps everything, the lock file too."""
    from jaxmem.train.run_dir import LOCK_FILE, RunLock

    run = tmp_path / "a" / "b" / "run"
    lock = RunLock(str(run))
    lock.acquire()
    assert lock.created_dirs == [str(run), str(run.parent), str(tmp_path / "a")]
    lock.abandon()
    assert list(tmp_path.iterdir()) == []
    lock = RunLock(str(run))
    lock.acquire()
    (run / "config.yaml").write_text("kept")
    lock.abandon()
    assert sorted(os.listdir(run)) == [LOCK_FILE, "config.yaml"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_owner(tmp_path):
    out = tmp_path / "A"
    first = popen(
        "train",
        *BASE,
        "--steps",
        "100000",  # still running when the test ends (it is killed)
        "--checkpoint-every",
        "100000",
        "--set",
        "run.log_every=1",
        "--out",
        str(out),
    )
    try:
        wait_for(lambda: steps_logged(out) >= 2)
        config = (out / "config.yaml").read_text()
        for extra in ([], ["--resume"]):
            second = jaxmem(
                "train", *BASE, "--steps", "3", "--seed", "7", "--out", str(out), *extra
            )
            assert second.returncode == 2
            assert second.stderr.strip().splitlines() == [
                f"jaxmem train: error: run directory {out} is in use by process {first.pid}; "
                "wait for it to finish or choose another --out"
            ]
            assert (out / "config.yaml").read_text() == config  # the first run's, untouched
        assert first.poll() is None  # and the first run goes on
    finally:
        first.kill()
        first.wait()
    # killed: the OS released the lock; a resume now finds no checkpoint (none was saved)
    again = jaxmem("train", *BASE, "--steps", "3", "--out", str(out), "--resume")
    assert again.returncode == 2 and "holds no checkpoint that verifies" in again.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_runs_started_at_once_on_one_directory_never_mix(tmp_path):
    out = tmp_path / "A"
    procs = {
        seed: popen("train", *BASE, "--steps", "3", "--seed", seed, "--out", str(out))
        for seed in ("1", "2")
    }
    codes = {seed: p.wait(timeout=300) for seed, p in procs.items()}
    assert sorted(codes.values()) == [0, 2], codes
    winner = next(seed for seed, code in codes.items() if code == 0)
    loser = procs[next(seed for seed, code in codes.items() if code == 2)]
    err = loser.stderr.read().strip().splitlines()
    assert len(err) == 1 and (
        "is in use by process" in err[0] or "exists and is not empty" in err[0]
    ), err
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    config = (out / "config.yaml").read_text()
    assert f"seed: {winner}\n" in config


# ---------------------------------------------------------------------------------- full disk
def _small_disk(path) -> bool:
    """A 3 MB tmpfs at ``path`` (root only); False where mounting is not allowed."""
    path.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3000k", "tmpfs", str(path)], capture_output=True
    )
    return proc.returncode == 0


@pytest.mark.slow
def test_a_full_disk_is_reported_as_a_full_disk_in_one_line(tmp_path):
    """A real ENOSPC (a small tmpfs) where this user may mount one, else a real EFBIG (a file
    size limit): either way an OS write error, reported as one, never as out of memory."""
    disk = tmp_path / "disk"
    mounted = _small_disk(disk)  # room for about two checkpoints of tiny
    out = disk / "run"
    try:
        limit = None
        if not mounted:

            def limit():  # runs in the child before exec
                import resource

                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000))

        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxmem.cli",
                "train",
                *BASE,
                "--steps",
                "20",
                "--checkpoint-every",
                "1",
                "--keep",
                "5",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=limit,
            env={**os.environ, "COLUMNS": "400"},
        )
        assert proc.returncode == 1, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        (err,) = proc.stderr.strip().splitlines()
        what = "No space left on device" if mounted else "File too large"
        assert err.startswith("jaxmem train: could not write checkpoint ") and what in err, err
        assert "out of memory" not in err
        good = [
            s
            for s in os.listdir(out / "checkpoints")
            if s.isdigit() and verify(str(out / "checkpoints" / s)) is None
        ]
        if mounted:  # the disk held some checkpoints before it filled up
            last = int(err.split("last verified checkpoint: step ")[1].split()[0])
            assert good and max(map(int, good)) == last
        else:  # a file size limit refuses the very first array file
            assert "last verified checkpoint: none" in err and not good
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def test_out_of_memory_advice_is_only_for_real_out_of_memory():
    from jaxmem.train.prepare import is_out_of_memory
    from jaxmem.train.run_dir import disk_error

    enospc = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "x": Failed to write 207 bytes to file 27: No space '
        "left on device [os_error_code='28']"
    )
    assert disk_error(enospc).errno == 28 and not is_out_of_memory(enospc)
    xla = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.1GiB")
    assert is_out_of_memory(xla) and disk_error(xla) is None


# ------------------------------------------------------------------------- Ctrl-C and SIGTERM
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_after_the_step_saves_it_and_exits_130(tmp_path, sig):
    out = tmp_path / "A"
    proc = popen(
        "train",
        *BASE,
        "--steps",
        "100000",  # still running when the signal comes
        "--checkpoint-every",
        "1000",
        "--set",
        "run.log_every=1",
        "--out",
        str(out),
    )
    wait_for(lambda: steps_logged(out) >= 3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    last = metrics(out)[-1]["step"]
    assert err.strip().splitlines() == [
        f"jaxmem train: {sig.name} at step {last}: saved checkpoint {last} in {out}/checkpoints; "
        f"continue with: jaxmem train --out {out} --resume"
    ]
    assert os.listdir(out / "checkpoints") == [str(last)]
    assert verify(str(out / "checkpoints" / str(last))) is None
    if sig != signal.SIGINT:
        return  # the checkpoint is the same whichever signal asked for it: resume it once
    resumed = jaxmem("train", *BASE, "--steps", str(last + 2), "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in metrics(out)] == list(range(1, last + 3))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_signal_aborts_without_saving_though_both_came_during_one_step(tmp_path):
    """Two SIGINTs 50 ms apart, both while a step runs in native code: Python runs the handler
    once for both, and the handler counts deliveries (the wakeup fd) to see the second. The run
    aborts without saving that step, and its one line names the newest checkpoint that verifies.
    (Two signals sent at the same instant are one: the kernel merges a pending signal.)"""
    out = tmp_path / "A"
    step = ["--preset", "small", "--batch-size", "16", "--seq-len", "256"]  # a step of ~0.3 s
    proc = popen(
        "train",
        *step,
        "--sample-tokens",
        "0",
        "--steps",
        "100000",
        "--checkpoint-every",
        "4",
        "--set",
        "run.log_every=1",
        "--out",
        str(out),
    )
    wait_for(lambda: steps_logged(out) >= 6)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    (line,) = err.strip().splitlines()
    good = sorted(int(n) for n in os.listdir(out / "checkpoints") if n.isdigit())
    good = [s for s in good if verify(str(out / "checkpoints" / str(s))) is None]
    assert good and good[-1] % 4 == 0  # only the cadence's checkpoints: the signals saved none
    assert line == (
        f"jaxmem train: a second SIGINT aborted the run without saving; last verified "
        f"checkpoint: step {good[-1]} in {out}/checkpoints (continue with: jaxmem train --out "
        f"{out} --resume)"
    )


# ----------------------------------------------------------------------- what a user sees
def test_a_run_says_what_it_is_doing_and_what_it_keeps(capsys):
    assert (
        cli.main(
            [
                "train",
                "--preset",
                "tiny",
                "--batch-size",
                "4",
                "--seq-len",
                "32",
                "--steps",
                "2",
                "--sample-tokens",
                "5000",
            ]
        )
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert out.index("compiling the train step") < out.index("jaxmem train (jax) preset tiny")
    assert "no --out: nothing of this run is kept" in out
    assert "sample cut to fit max_seq_len=64" in out and "asked for 5000" in out


def test_the_progress_bar_starts_without_a_made_up_loss():
    console = Console(record=True, width=160, force_terminal=False)
    with progress_bar(console) as progress:
        progress.add_task("train", total=10, completed=0, mem="", **INITIAL_FIELDS)
    text = console.export_text()
    assert "loss - " in text and "- tok/s" in text and "nan" not in text


@pytest.mark.slow
def test_plot_names_the_file_it_wrote(runs, tmp_path, capsys):
    assert cli.main(["plot", str(runs), "--out", str(tmp_path / "mydocs")]) == 0
    assert f"wrote {tmp_path / 'mydocs.png'}:" in capsys.readouterr().out
    assert (tmp_path / "mydocs.png").stat().st_size > 0


def test_prepared_data_is_readable_by_others_and_version_is_printed(tmp_path, capsys):
    src = tmp_path / "src.txt"
    src.write_text("def f(x):\n    return x\n" * 300)
    assert cli.main(["prepare", str(src), "--out", str(tmp_path / "bin")]) == 0
    umask = os.umask(0)
    os.umask(umask)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert os.stat(tmp_path / "bin" / name).st_mode & 0o777 == 0o666 & ~umask
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("jaxmem 0.")


def test_memory_rows_are_not_repeated(tmp_path, capsys):
    out = tmp_path / "m.json"
    args = ["--frameworks", "jax", "--policies", "full,,full", "--batch-size", "2"]
    assert cli.main(["memory", *args, "--seq-len", "16", "--json", str(out)]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())] == ["full"]
    assert capsys.readouterr().out.count("measuring jax full") == 1

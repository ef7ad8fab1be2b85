from __future__ import annotations

import numpy as np

from jaxmem import data


def test_byte_tokenizer_round_trips():
    text = "déjà vu — ∑ x\n"
    assert data.decode(data.encode(text)) == text
    assert data.encode("A").tolist() == [65]


def test_stdlib_corpus_is_deterministic():
    a, b = data.stdlib_corpus(max_bytes=50_000), data.stdlib_corpus(max_bytes=50_000)
    np.testing.assert_array_equal(a, b)
    assert a.size == 50_000 and a.max() < data.VOCAB_SIZE


# ------------------------------------------------------------------------------ jaxmem train job
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from jaxmem import cli  # noqa: E402
from jaxmem.cli import train as train_command  # noqa: E402
from jaxmem.cli.presets import preset_use  # noqa: E402
from jaxmem.compare.tolerances import tolerance  # noqa: E402
from jaxmem.config import PRESETS, ConfigError  # noqa: E402
from jaxmem.job import JobConfig, read_config_file, write_config  # noqa: E402

TINY = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "0"]


def train(*args: str) -> int:
    return cli.main(["train", *TINY, *args])


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def snapshot(path) -> dict[str, int]:
    """Every file under ``path`` with its size (to prove a failed command touched nothing)."""
    if not os.path.exists(path):
        return {}
    return {
        os.path.relpath(os.path.join(d, f), path): os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(path)
        for f in files
    }


@pytest.mark.slow
def test_tiny_run_lowers_the_loss_and_leaves_metrics_plot_config_sample_checkpoints(tmp_path):
    out = tmp_path / "run"
    code = cli.main(
        [
            "train",
            "--preset",
            "tiny",
            "--steps",
            "40",
            "--batch-size",
            "8",
            "--lr",
            "3e-3",
            "--eval-every",
            "20",
            "--checkpoint-every",
            "10",
            "--keep",
            "2",
            "--sample-tokens",
            "20",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    recs = metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 41))
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0
    assert [r["step"] for r in recs if "val_loss" in r] == [20, 40]
    assert sorted(os.listdir(out / "checkpoints")) == ["30", "40"]  # keep the last 2
    assert (out / "loss.png").stat().st_size > 0
    sample = (out / "sample.txt").read_text()
    assert sample.startswith("def ") and len(sample.encode()) >= 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] == recs[-1]["loss"] and summary["tokens_per_s"] > 0
    # the resolved config reads back to the same job and repeats the run
    job = JobConfig.from_dict(read_config_file(str(out / "config.yaml")))
    assert job.to_dict() == summary["config"]
    assert job.run.steps == 40 and job.model.n_layers == 2 and job.optimizer.lr == 3e-3


def test_config_round_trips_through_yaml_toml_and_flags(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        'preset = "tiny"\nprecision = "bf16"\n[model]\nn_layers = 3\n'
        '[memory]\npolicy = "custom"\nsave = ["mlp_up", "norm1_out"]\noffload = ["mlp_act"]\n'
        "[optimizer]\nlr = 3e-4\n[accum]\nsteps = 2\n[run]\nsteps = 7\nbatch_size = 4\n"
    )
    job = JobConfig.from_dict(read_config_file(str(toml)))
    assert job.model.n_layers == 3 and job.precision.name == "bf16" and job.run.steps == 7
    # objects, not names: the config holds the Precision and the MemoryPolicy themselves
    assert job.precision.compute_dtype == "bfloat16"
    block = job.memory.head
    assert set(block.save) == {"norm1_out", "mlp_up"} and block.offload == ("mlp_act",)
    assert job.run.seq_len == 64  # default 128 capped at tiny's max_seq_len
    path = tmp_path / "config.yaml"
    write_config(job, str(path))
    assert JobConfig.from_dict(read_config_file(str(path))) == job
    # flags override the file; --set reaches any setting
    args = cli.build_parser().parse_args(
        [
            "train",
            "--config",
            str(toml),
            "--steps",
            "9",
            "--set",
            "optimizer.b2=0.95",
            "--set",
            "model.norm=post",
        ]
    )
    resolved = train_command.resolve(args)
    assert resolved.run.steps == 9 and resolved.optimizer.b2 == 0.95
    assert resolved.model.norm == "post" and resolved.model.n_layers == 3


@pytest.mark.parametrize("preset", sorted(n for n, c in PRESETS.items() if c.causal))
def test_every_causal_preset_validates_and_round_trips(preset):
    job = JobConfig.from_dict({"preset": preset})
    assert JobConfig.from_dict(job.to_dict()) == job


def test_a_preset_without_a_causal_mask_is_refused_for_what_it_is():
    """The seeds' layer attends both ways: trained as a language model it would see the token
    it predicts. The rule is about the model, not the machine, and `jaxmem presets` says so."""
    with pytest.raises(ConfigError, match="'seed' has no causal mask"):
        JobConfig.from_dict({"preset": "seed"})
    with pytest.raises(ConfigError, match="no causal mask"):
        JobConfig.from_dict({"preset": "tiny", "model": {"causal": False}})
    assert preset_use("seed") == "seed-example, parity"
    assert preset_use("gpt2-124m") == "from shapes*"


def _bin_with_wrong_dtype(tmp_path):
    d = tmp_path / "data32"
    d.mkdir()
    (d / "train.bin").write_bytes(b"\x01" * 4001)  # odd size: not uint16
    return str(d / "train.bin")


def _text(tmp_path, text):
    p = tmp_path / "corpus.txt"
    p.write_text(text)
    return str(p)


BAD_INPUT = [
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--policy", "most"], "unknown memory policy 'most'"),
    (["--optimizer", "lion"], "optimizer='lion' is not one of"),
    (["--precision", "fp8"], "unknown precision 'fp8'"),
    (["--save", "mlp_upp"], "unknown tag name(s) ['mlp_upp']"),
    (["--save", "mlp_up", "--offload", "mlp_up"], "['mlp_up'] are both saved and offloaded"),
    (["--batch-size", "6", "--accum", "4"], "batch size 6 is not divisible by accum steps 4"),
    (["--seq-len", "65"], "seq_len=65 exceeds the model's max_seq_len=64"),
    (["--steps", "0"], "0 must be a positive integer"),
    (["--lr", "-1"], "-1.0 must be positive"),
    (["--set", "optimizer.lr=0"], "lr=0.0 must be a positive, finite float"),
    (["--lr", "inf"], "inf must be positive and finite"),
    (["--set", "optimizer.lr=.inf"], "lr=inf must be a positive, finite float"),
    (["--seed", str(2**63)], f"{2**63} is not a seed: use 0 .. {2**32 - 1}"),
    (["--set", f"run.seed={2**40}"], "seed=1099511627776 is too large"),
    (["--set", "run.steps=-3"], "steps=-3 must be a positive integer"),
    (["--set", "model.colour=blue"], "unknown setting(s) ['colour'] in [model]"),
    (["--data", "/nonexistent/corpus"], "data path /nonexistent/corpus does not exist"),
    ("EMPTY_DATA", "contains no text"),
    ("SHORT_DATA", "needs at least 34 tokens"),
    ("BAD_BIN", "is 4001 bytes, not a multiple of 2, so it is not raw uint16 tokens"),
    (["--config", "/nonexistent/job.toml"], "config file /nonexistent/job.toml does not exist"),
    (["--out", "/proc/jaxmem-run"], "is not writable"),
    # config files a user gets wrong (written by the test into its tmp_path)
    (("run.yaml", "run: 5\n"), "section [run] must be a table of settings, got 5"),
    (("p.yaml", "precision: [fp32]\n"), "precision=['fp32'] must be a name"),
    (("empty.yaml", ""), "is empty; give at least one setting"),
    (("empty.toml", "\n"), "is empty; give at least one setting"),
    (("dup.yaml", "run:\n  steps: 3\n  steps: 4\n"), "key 'steps' is given twice (line 3)"),
    (("dup.json", '{"run": {"steps": 3, "steps": 4}}'), "key(s) ['steps'] given twice"),
    (("a_dir", None), "is a directory; give a TOML/YAML/JSON file"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, message, tmp_path, capsys):
    if args == "EMPTY_DATA":
        (tmp_path / "empty").mkdir()
        args = ["--data", str(tmp_path / "empty")]
    elif args == "SHORT_DATA":
        args = ["--data", _text(tmp_path, "x = 1\n" * 30)]  # 180 bytes: val split of 9 tokens
    elif args == "BAD_BIN":
        args = ["--data", _bin_with_wrong_dtype(tmp_path)]
    elif isinstance(args, tuple):  # a config file with this text (None: a directory)
        name, text = args
        path = tmp_path / name
        path.mkdir() if text is None else path.write_text(text)
        args = ["--config", str(path)]
    out = tmp_path / "run"
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exc:
        train(*args, *([] if "--out" in args else ["--out", str(out)]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert snapshot(tmp_path) == before and not out.exists()


def test_backend_without_pinned_host_or_fp16_is_refused(tmp_path, monkeypatch, capsys):
    import jaxmem.memory.remat as remat
    import jaxmem.step.train_step as step

    monkeypatch.setattr(remat, "backend_memory_kinds", lambda device=None: ("device",))
    with pytest.raises(SystemExit) as exc:
        train("--policy", "offload", "--out", str(tmp_path / "a"))
    assert exc.value.code == 2
    assert "only has memory kinds ['device']" in capsys.readouterr().err

    class NoFloat16(RuntimeError):
        pass

    def dot(*_):
        raise NoFloat16("UNIMPLEMENTED: f16 dot")

    monkeypatch.setattr(step.jnp, "dot", dot)
    with pytest.raises(SystemExit) as exc:
        train("--precision", "fp16", "--out", str(tmp_path / "b"))
    assert exc.value.code == 2
    assert "precision 'fp16' needs float16, which this cpu backend rejects" in (
        capsys.readouterr().err
    )
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_resume_refuses_a_contradicting_config_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert train("--steps", "4", "--checkpoint-every", "2", "--out", str(out)) == 0
    capsys.readouterr()
    before = snapshot(out)
    for args, message in (
        (["--lr", "0.01"], "optimizer.lr: checkpoint 0.001, now 0.01"),
        (["--policy", "full"], "memory.policy: checkpoint none, now full"),
        (["--framework", "torch"], "run.framework: checkpoint jax, now torch"),
    ):
        with pytest.raises(SystemExit) as exc:
            train("--steps", "8", "--out", str(out), "--resume", *args)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train("--out", str(out))  # a non-empty run directory without --resume
    assert "add --resume to continue it" in capsys.readouterr().err
    assert snapshot(out) == before


def _train_cmd(out, *extra):
    return [
        sys.executable,
        "-m",
        "jaxmem.cli",
        "train",
        *TINY,
        "--steps",
        "60",
        "--checkpoint-every",
        "5",
        "--eval-every",
        "30",
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_run_killed_with_sigkill_resumes_to_the_same_losses_step_for_step(tmp_path):
    reference = tmp_path / "reference"
    subprocess.run(_train_cmd(reference), check=True, capture_output=True, timeout=300)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (killed / "checkpoints" / "10").is_dir():
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    steps_on_disk = sorted(int(s) for s in os.listdir(killed / "checkpoints") if s.isdigit())
    assert steps_on_disk and steps_on_disk[-1] < 60
    subprocess.run(_train_cmd(killed, "--resume"), check=True, capture_output=True, timeout=300)
    ref, res = metrics(reference), metrics(killed)
    assert [r["step"] for r in res] == list(range(1, 61))
    assert [r["loss"] for r in res] == [r["loss"] for r in ref]  # bit-identical
    assert [r.get("val_loss") for r in res] == [r.get("val_loss") for r in ref]


def check_non_finite_stop(tmp_path, capsys, framework: str) -> None:
    """An absurd learning rate: AdamW moves every weight by ~1e30 and the next loss is not
    finite; the run stops before checkpointing it and names the last good checkpoint."""
    out = tmp_path / "run"
    code = train(
        "--framework",
        framework,
        "--steps",
        "20",
        "--checkpoint-every",
        "1",
        "--set",
        "optimizer.lr=1e30",
        "--out",
        str(out),
    )
    assert code == cli.EXIT_RUN_FAILED
    err = capsys.readouterr().err
    assert "loss became nan at step 2" in err or "loss became inf at step 2" in err
    assert "last good checkpoint: step 1" in err
    assert os.listdir(out / "checkpoints") == ["1"]
    assert [r["step"] for r in metrics(out)] == [1]


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    """(The same for ``--framework torch``: parity_tests/test_torch_job.py.)"""
    check_non_finite_stop(tmp_path, capsys, "jax")


def test_out_of_memory_reports_the_plan_and_a_cheaper_policy(tmp_path, monkeypatch, capsys):
    import jaxmem.step.build as build
    from jaxmem.train.prepare import out_of_memory_message

    job = JobConfig.from_dict({"preset": "tiny", "memory": {"policy": "selective"}})
    message = out_of_memory_message(job, 3 << 30, "while training", can_offload=True)
    assert "the step plans 3.00 GiB (compiled plan)" in message
    assert "--policy offload" in message and "--precision bf16" in message

    class FakeXlaError(RuntimeError):
        pass

    class Exhausted:
        def lower(self, *args):
            return self

        def compile(self):
            raise FakeXlaError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB")

    monkeypatch.setattr(build, "make_train_step", lambda *a, **k: Exhausted())
    assert train("--policy", "selective") == cli.EXIT_RUN_FAILED
    err = capsys.readouterr().err
    assert "out of memory while compiling with policy 'selective'" in err
    assert "try --policy offload" in err


def test_prepare_writes_bin_files_that_train_reads(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f(x):\n    return x + 1\n" * 200)
    data_dir = tmp_path / "bin"
    assert cli.main(["prepare", str(src), "--out", str(data_dir)]) == 0
    assert "train.bin" in capsys.readouterr().out
    out = tmp_path / "run"
    assert train("--steps", "3", "--data", str(data_dir), "--out", str(out)) == 0
    assert f"data: nanoGPT .bin in {data_dir}" in " ".join(capsys.readouterr().out.split())
    assert read_config_file(str(out / "config.yaml"))["data"]["path"] == str(data_dir)
    with pytest.raises(SystemExit) as exc:
        cli.main(["prepare", str(src), "--out", str(data_dir)])  # never overwrites
    assert exc.value.code == 2


@pytest.mark.slow
def test_fp16_and_multisteps_runs_checkpoint_and_resume(tmp_path, capsys):
    fp16 = tmp_path / "fp16"
    common = ["--checkpoint-every", "2", "--out", str(fp16), "--precision", "fp16"]
    assert train("--steps", "2", *common) == 0
    assert train("--steps", "4", "--resume", *common) == 0  # the loss scale is restored too
    recs = metrics(fp16)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(isinstance(r["skipped"], bool) for r in recs)  # overflow steps are counted
    summary = json.loads((fp16 / "summary.json").read_text())
    assert summary["skipped_steps"] == sum(r["skipped"] for r in recs)
    multi = tmp_path / "multi"
    args = ["--accum", "2", "--accum-mode", "multisteps", "--steps", "3", "--out", str(multi)]
    assert train(*args) == 0
    scan = tmp_path / "scan"
    assert train("--accum", "2", "--steps", "3", "--out", str(scan)) == 0
    tol = tolerance("float32", "adamw_loss")
    np.testing.assert_allclose(
        [r["loss"] for r in metrics(multi)],
        [r["loss"] for r in metrics(scan)],
        rtol=tol.rtol,
        atol=tol.atol,
    )
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        train("--precision", "fp16", "--accum", "2", "--accum-mode", "multisteps")
    assert exc.value.code == 2
    assert "accum mode 'multisteps' has no loss scaling" in capsys.readouterr().err


@pytest.mark.slow
def test_optimizer_state_and_params_in_host_memory_train_and_resume_the_same(tmp_path):
    host, dev = tmp_path / "host", tmp_path / "device"
    placement = [
        "--set",
        "optimizer.state_memory=pinned_host",
        "--set",
        "optimizer.params_memory=pinned_host",
    ]
    common = ["--checkpoint-every", "3", "--eval-every", "3"]
    assert train("--steps", "3", *common, *placement, "--out", str(host)) == 0
    assert train("--steps", "6", *common, *placement, "--out", str(host), "--resume") == 0
    assert train("--steps", "6", *common, "--out", str(dev)) == 0
    # placement moves bytes, not arithmetic
    assert [r["loss"] for r in metrics(host)] == [r["loss"] for r in metrics(dev)]
    assert [r.get("val_loss") for r in metrics(host)] == [r.get("val_loss") for r in metrics(dev)]


@pytest.mark.slow
def test_loss_chunks_train_and_resume_to_the_whole_losses(tmp_path, capsys):
    """The head and loss in 4 chunks (each chunk's gradients formed in the forward), composed
    with a policy, bf16 and accumulation: the whole loss's losses (the head's gradient adds chunk
    partials in another order). A resume reads the chunks from the run's config; one asking for
    other chunks contradicts it and is refused, changing nothing."""
    chunked, whole = tmp_path / "chunked", tmp_path / "whole"
    step = ["--precision", "bf16", "--policy", "selective", "--accum", "2"]
    common = [*step, "--checkpoint-every", "3", "--eval-every", "3"]
    assert train("--steps", "3", *common, "--loss-chunks", "4", "--out", str(chunked)) == 0
    assert train("--steps", "6", *common, "--out", str(chunked), "--resume") == 0
    assert train("--steps", "6", *common, "--out", str(whole)) == 0
    tol = tolerance("bfloat16", "loss_chunks_loss")
    c, w = metrics(chunked), metrics(whole)
    assert [r["step"] for r in c] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in c], [r["loss"] for r in w], **tol.kwargs())
    assert "loss_chunks: 4" in (chunked / "config.yaml").read_text()
    before = snapshot(chunked)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        train("--steps", "7", *common, "--loss-chunks", "2", "--out", str(chunked), "--resume")
    assert exc.value.code == 2 and "loss_chunks" in capsys.readouterr().err
    assert snapshot(chunked) == before


# A run directory's config.yaml as ``jaxmem train`` wrote it before a memory policy was made of
# parts (a per-tag mix, the loss in 2 chunks, the embedding replayed): its policy line and its
# [memory] section, verbatim.
OLD_POLICY_LINE = (
    "# memory policy 'keep(qkv+mlp_up):1+keep(attn_out+mlp_up)' keeps on device ['block_input', "
    "'query_proj', 'key_proj', 'value_proj', 'mlp_up'], offloads - (what the backward needs of "
    "what it stores); recomputes the rest; the LM head and loss in 2 chunks (no logits kept)"
)
OLD_MEMORY_SECTION = """\
memory:
  policy: custom
  save:
  - query_proj
  - key_proj
  - value_proj
  - mlp_up
  offload: []
  layers_every: null
  layers_first: 1
  layers: null
  use_reentrant: false
  unroll: false
  rest: custom
  rest_save:
  - attn_out
  - mlp_up
  rest_offload: []
  replay_embedding: true
  loss_chunks: 2
"""
OLD_MIX = [
    *("--precision", "bf16", "--policy", "custom"),
    *("--save", "query_proj,key_proj,value_proj,mlp_up"),
    *("--set", "memory.layers_first=1", "--set", "memory.rest=custom"),
    *("--set", 'memory.rest_save=["attn_out", "mlp_up"]', "--set", "memory.rest_offload=[]"),
    *("--replay-embedding", "--loss-chunks", "2", "--checkpoint-every", "2", "--eval-every", "2"),
]


def test_a_run_written_before_policies_had_parts_reads_back_and_resumes(tmp_path):
    """The [memory] section of a run written before reads back to the policy built from parts
    (and is written back key for key); ``jaxmem train --resume`` continues such a run."""
    from jaxmem.policy import EmbeddingReplay, LossPolicy, MemoryPolicy, mixed_policy
    from jaxmem.policy_config import policy_from_dict, policy_to_dict

    qkv_up = MemoryPolicy.custom(
        {n: "device" for n in ("query_proj", "key_proj", "value_proj", "mlp_up")}
    )
    out_up = MemoryPolicy.custom({"attn_out": "device", "mlp_up": "device"})
    built = mixed_policy(qkv_up, 1, out_up).replace(
        loss=LossPolicy(2), embedding=EmbeddingReplay(True)
    )
    (tmp_path / "old.yaml").write_text(OLD_MEMORY_SECTION)
    section = read_config_file(str(tmp_path / "old.yaml"))["memory"]
    assert policy_from_dict(section) == built and policy_to_dict(built) == section
    out = tmp_path / "run"
    assert train("--steps", "2", *OLD_MIX, "--out", str(out)) == 0
    config = out / "config.yaml"
    text = config.read_text()
    assert OLD_POLICY_LINE in text.splitlines() and text.endswith(OLD_MEMORY_SECTION)
    head, _, _ = text.partition("memory:\n")
    config.write_text(head + OLD_MEMORY_SECTION)  # the section exactly as the old code wrote it
    assert train("--steps", "4", *OLD_MIX, "--out", str(out), "--resume") == 0
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


# ------------------------------------------------- a run's directory, the real command on it
from tests.test_cli_contract import run_cli  # noqa: E402

RUN = [*TINY, "--checkpoint-every", "2", "--eval-every", "2"]
# a per-tag policy: the run says its tags, not only "custom"
TAGS = ["--policy", "custom", "--save", "query_proj,key_proj,value_proj,mlp_up"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A 2-step run of tiny (checkpoint at step 2), written once for this module's tests, and
    its command's output."""
    out = tmp_path_factory.mktemp("two-steps") / "run"
    proc = run_cli("train", *RUN, *TAGS, "--steps", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def _copy(run_dir, tmp_path):
    import shutil

    return shutil.copytree(run_dir, tmp_path / "run")


def files_of(path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes (to prove a refused command changed nothing)."""
    return {
        os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
        for d, _, files in os.walk(path)
        for f in files
    }


@pytest.mark.slow
def test_the_run_says_a_per_tag_policys_tags(two_steps):
    text = " ".join(two_steps[1].split())
    assert "compiling the train step (0.12 M params, policy custom keep(qkv+mlp_up)," in text
    assert "policy custom keep(qkv+mlp_up), precision fp32" in text


@pytest.mark.slow
def test_the_end_of_run_memory_table_fits_100_columns_with_every_digit(two_steps):
    out, stdout = two_steps
    lines = stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 100, max(lines, key=len)
    summary = json.loads((out / "summary.json").read_text())
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == len(summary["memory"])
    legend = " ".join(stdout.partition("how obtained:")[2].split())
    for figure, row in zip(summary["memory"], rows, strict=True):
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[:2] == [figure["quantity"], f"{figure['nbytes']:,}"], cells
        assert f"{cells[3]} {figure['source']}" in legend  # "[2] counted (arrays)"


@pytest.mark.slow
def test_a_resumed_run_takes_config_yaml_as_its_settings_and_leaves_the_file_alone(
    two_steps, tmp_path
):
    """config.yaml is the run's settings: a longer run written into it is honoured, and the
    file (the user's, a comment added) is not rewritten when the run's settings equal it. The
    summary's losses and time are this command's steps, and it says so."""
    run = _copy(two_steps[0], tmp_path)
    config = run / "config.yaml"
    edited = config.read_text().replace("\n  steps: 2\n", "\n  steps: 4\n") + "# mine\n"
    config.write_text(edited)
    proc = run_cli("train", "--out", str(run), "--resume")
    assert proc.returncode == 0, proc.stderr
    recs = metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert config.read_text() == edited
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["first_step"], summary["final_step"]) == (3, 4)
    assert (summary["first_loss"], summary["final_loss"]) == (recs[2]["loss"], recs[3]["loss"])
    text = " ".join(proc.stdout.split())
    assert (
        f"steps 3..4 (this command's; resumed from step 2): loss {recs[2]['loss']:.4f} -> "
        f"{recs[3]['loss']:.4f}" in text
    )
    # a flag over the file: the file is rewritten, and the run says what changed
    proc = run_cli("train", "--out", str(run), "--resume", "--steps", "5")
    assert proc.returncode == 0, proc.stderr
    assert f"updated {config} to this run's settings: run.steps: file 4, now 5" in " ".join(
        proc.stdout.split()
    )
    assert read_config_file(str(config))["run"]["steps"] == 5


RUN_CONFIG_EDITS = {
    "a changed learning rate": (
        lambda text: text.replace("lr: 0.001", "lr: 0.005"),
        "config.yaml changes what the checkpoint's steps computed: optimizer.lr: checkpoint "
        "0.001, file 0.005",
    ),
    "appended garbage": (
        lambda text: text + "garbage }{\n",
        "config.yaml cannot be parsed: line {line}: could not find expected ':'",
    ),
    "an appended section": (
        lambda text: text + "colour: blue\n",
        "config.yaml: unknown config section(s) ['colour']",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("edit", sorted(RUN_CONFIG_EDITS))
def test_resume_refuses_a_config_yaml_it_cannot_honour_and_writes_nothing(
    edit, two_steps, tmp_path
):
    change, message = RUN_CONFIG_EDITS[edit]
    run = _copy(two_steps[0], tmp_path)
    config = run / "config.yaml"
    text = config.read_text()
    config.write_text(change(text))
    before = files_of(run)
    proc = run_cli("train", "--out", str(run), "--resume", "--steps", "4")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert message.format(line=text.count("\n") + 1) in line, line
    assert str(config) in line
    assert files_of(run) == before


def test_resume_on_an_empty_directory_says_there_is_no_run_yet(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("train", *TINY, "--steps", "2", "--out", str(empty), "--resume")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"jaxmem train: error: --resume: {empty} has no run yet (it is empty); the same command "
        "without --resume starts one there"
    ]
    assert os.listdir(empty) == []


def test_policy_auto_says_the_chosen_policys_tags(monkeypatch, capsys):
    """What ``--policy auto`` chose is said with its tags, as the run's lines say it (the search
    itself, minutes on a CPU, is ``tests/test_plan.py``'s; here it returns a per-tag policy)."""
    from types import SimpleNamespace

    import jaxmem.planner.search as search
    from jaxmem.policy import MemoryPolicy

    policy = MemoryPolicy.custom({"mlp_up": "device", "attn_out": "device"})
    chosen = SimpleNamespace(candidate=SimpleNamespace(policy=policy, accum=2), compiled=3 << 20)
    result = SimpleNamespace(chosen=chosen, compiler="XLA:CPU", outcomes=[chosen])

    def fake_search(problem, space, progress):
        progress("compile 1/1: the search's own line")
        return result

    monkeypatch.setattr(search, "search", fake_search)
    job = JobConfig.from_dict({"preset": "tiny", "model": {"n_layers": 4}})
    job = train_command._auto_policy(job, "1GiB")
    assert job.memory == policy and job.accum.steps == 2
    text = " ".join(capsys.readouterr().out.split())
    assert "compile 1/1: the search's own line" in text  # its progress lines are printed
    assert "--policy auto chose policy custom keep(attn_out+mlp_up) with 2 microbatch(es)" in text

"""``jaxmem plan --longest``: the longest sequence at batch 1, found by a search over the length
whose answer is two compiled plans (fits at N, over at N + step), printed with its host bytes,
estimated step time, what holds its peak and the command that runs it."""

from __future__ import annotations

import json

import pytest

from jaxmem.config import PRESETS
from jaxmem.planner.host import OFFLOADED_INPUTS, offloaded_activation_bytes
from jaxmem.planner.longest import TILE_TOKENS, loss_tiles, search_lengths
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS
from tests.test_cli_contract import run_cli


def affine(limit: int, calls: list[int]):
    """A stand-in for a compile: the peak grows 3 bytes a token; ``limit`` tokens fit."""

    def measure(n: int) -> tuple[bool, int]:
        calls.append(n)
        return n <= limit, 1000 + 3 * n

    return measure


@pytest.mark.parametrize("aim", [None, 1000 + 3 * 50_000])
def test_the_length_search_ends_at_a_fit_and_an_over_one_step_apart(aim):
    calls: list[int] = []
    lo, hi, seen = search_lengths(affine(50_000, calls), 1024, 4096, 1 << 20, aim=aim)
    assert (lo, hi) == (49_152, 50_176)  # the largest multiple of the step that fits
    assert seen[lo][0] and not seen[hi][0]  # both ends measured: the answer's two compiles
    assert len(calls) == len(set(calls)) <= 12


def test_the_length_search_stops_at_its_cap_and_says_when_nothing_fits():
    calls: list[int] = []
    assert search_lengths(affine(1 << 30, calls), 1024, 4096, 32_768)[:2] == (32_768, None)
    assert calls == [4096, 8192, 16_384, 32_768]
    assert search_lengths(affine(100, []), 1024, 4096, 32_768)[:2] == (0, 1024)


def test_the_loss_runs_in_tiles_of_a_token_count_that_divide_the_sequence():
    vocab, big = 128_256, 2**40
    assert loss_tiles(1 << 20, vocab, big) == (1 << 20) // TILE_TOKENS[0]  # room: the largest
    assert loss_tiles(1 << 20, vocab, 80 * 2**30) == 1024  # 1,024-token tiles under 80 GiB
    assert loss_tiles(3 * 1024, vocab, big) == 3  # the largest tile that divides
    assert loss_tiles(2560, vocab, big) == 8  # no tile divides: at most 8 chunks, as before


def test_offloaded_block_inputs_are_counted_on_the_host_and_over_the_link():
    from jaxmem.planner import cost

    cfg, prec = PRESETS["tiny-llama"], PRECISIONS["pure-bf16"]
    host = offloaded_activation_bytes(cfg, OFFLOADED_INPUTS, 1, 1024, prec)
    assert host == cfg.n_layers * 1024 * cfg.d_model * 2  # every block's [S, D] input, bf16
    link = cost.activation_offload_bytes(cfg, prec, OFFLOADED_INPUTS, rows=1, seq_len=1024, tp=1)
    assert link == 2 * host  # out in the forward, back in the backward
    nested = POLICIES["nested-host"]  # one input per segment, not per block
    cfg8 = cfg.replace(n_layers=8)
    segments = offloaded_activation_bytes(cfg8, nested, 1, 1024, prec)
    assert segments < cfg8.n_layers * 1024 * cfg.d_model * 2
    link = cost.activation_offload_bytes(cfg8, prec, nested, rows=1, seq_len=1024, tp=1)
    assert link == 2 * segments


@pytest.fixture(scope="module")
def answer(tmp_path_factory):
    """tiny-llama on an H100 under 100 MiB, steps of 1,024 up to 2,048 tokens: 2,048 does not
    fit (XLA attention is O(S^2)), 1,024 does: two compiles and the peak's."""
    out = tmp_path_factory.mktemp("longest") / "longest.json"
    done = run_cli(
        "plan", "--preset", "tiny-llama", "--target", "h100", "--budget", "100MiB",
        "--precision", "pure-bf16", "--state-offload", "--longest", "--seq-step", "1024",
        "--seq-cap", "2048", "--host-memory", "1GiB", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_the_longest_sequence_is_two_compiled_plans_with_what_it_needs(answer):
    text, data = answer
    assert data["longest"] == 1024 and data["over"]["seq_len"] == 2048
    assert data["fits"]["fits"] and not data["over"]["fits"]
    assert data["fits"]["device_bytes"] <= data["budget_bytes"] < data["over"]["device_bytes"]
    cfg = PRESETS["tiny-llama"]
    # --state-offload with AdamW: the stack streamed (its parameters and state in host memory),
    # and the block inputs there too: the compiled plan's host bytes hold every block's input
    hosted = data["fits"]["host_bytes"]
    assert hosted["streamed parameters and optimizer state"] > 0
    assert hosted["offloaded activations"] == cfg.n_layers * 1024 * cfg.d_model * 2
    assert data["fits"]["step_time"]["seconds"] > 0 and data["peak"]["largest"]
    for flag in ("--policy full-host", "--stream", "--seq-len 1024"):
        assert flag in data["command"]
    for words in ("longest: 1,024 tokens", "an estimate", "what limits it", "jaxmem train"):
        assert words in text


def test_a_host_limit_under_the_state_is_refused_before_any_compile():
    done = run_cli(
        "plan", "--preset", "tiny-llama", "--target", "h100", "--longest", "--state-offload",
        "--host-memory", "1KiB",
    )  # fmt: skip
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert "optimizer state" in line and "1.00 KiB is allowed (--host-memory)" in line
    assert "compile" not in done.stdout


@pytest.mark.slow
def test_a_context_axis_splits_the_longest_sequence_over_its_devices(tmp_path):
    """tiny-llama (fused attention) over --mesh cp=2 up to 2,048 tokens: one compiled plan per
    device, each device's offloaded block inputs half the sequence's, the keys and values round
    a ring (the leaner form) in the command that runs it."""
    out = tmp_path / "longest.json"
    done = run_cli(
        "plan", "--preset", "tiny-llama", "--attention", "fused", "--target", "h100",
        "--budget", "128MiB", "--precision", "pure-bf16", "--mesh", "cp=2", "--longest",
        "--seq-step", "1024",
        "--seq-cap", "2048", "--host-memory", "1GiB", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["longest"] == 2048 and data["capped"]
    assert "per device of cp=2" in data["fits"]["compiler"]
    cfg = PRESETS["tiny-llama"]
    assert (
        data["fits"]["host_bytes"]["offloaded activations"] == cfg.n_layers * 1024 * cfg.d_model * 2
    )
    assert "--mesh cp=2 --cp-attention ring" in data["command"]  # the leaner (fused attention)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--mesh", "cp=2", "--seq-step", "1022"), "--seq-step 1022: the context axis cp=2"),
        (("--mesh", "fsdp=2,cp=2", "--seq-step", "1024"), "use --mesh cp=N"),
    ],
)
def test_a_context_axis_the_search_cannot_step_over_is_refused(flags, words):
    done = run_cli("plan", "--preset", "tiny-llama", "--target", "h100", "--longest", *flags)
    assert done.returncode == 2
    assert words in done.stderr.strip().splitlines()[-1]
    assert "compile" not in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("how", ["gather", "ring"])
def test_a_context_parallel_plan_builds_no_mask_of_every_key_block(how):
    """tiny-llama's fused attention over cp=2 at 16,384 tokens, keys and values all-gathered or
    round a ring, planned for an H100: under ``full`` remat the kernel's masks are made block by
    block, never ``[S/cp, S]`` per head."""
    from jaxmem.config import OptimizerConfig
    from jaxmem.memory.targets import get_target
    from jaxmem.parallel import ParallelConfig
    from jaxmem.planner.longest import lean_spec, probe
    from jaxmem.policy import POLICIES
    from jaxmem.step.spec import StepSpec

    cfg = PRESETS["tiny-llama"].replace(attention="fused")
    base = StepSpec(
        model=cfg, policy=POLICIES["full"], precision=PRECISIONS["pure-bf16"],
        optimizer=OptimizerConfig(), batch=1, seq_len=256, target=get_target("h100"),
        parallel=ParallelConfig(strategy="fsdp", devices=2, cp=2, cp_attention=how),
    )  # fmt: skip
    n = 16384
    p = probe(lean_spec(base, n, 80 << 30, offload=True), 80 << 30, 1 << 40)
    assert p.device_bytes < (n // 2) * n * cfg.n_heads // 4  # a quarter of one bool mask


def test_longest_keeps_a_context_attention_the_command_names(tmp_path):
    """--longest takes the ring over a context axis unless the command names the form: by
    --cp-attention, --set parallel.cp_attention=... or a --config file's parallel section."""
    import argparse

    from jaxmem.cli.plan_longest import asked_cp_attention

    def args(**kw):
        return argparse.Namespace(**{"cp_attention": None, "set": None, "config": None, **kw})

    config = tmp_path / "job.yaml"
    config.write_text("parallel:\n  cp_attention: gather\n")
    other = tmp_path / "other.yaml"
    other.write_text("parallel:\n  cp: 2\n")
    assert not asked_cp_attention(args())
    assert not asked_cp_attention(args(set=["run.seed=1"], config=str(other)))
    assert asked_cp_attention(args(cp_attention="gather"))
    assert asked_cp_attention(args(set=["parallel.cp_attention=gather"]))
    assert asked_cp_attention(args(config=str(config)))

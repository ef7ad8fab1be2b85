from __future__ import annotations

import json

import numpy as np
from rich.console import Console

from jaxmem import data
from jaxmem.config import PRESETS, OptimizerConfig
from jaxmem.run import run_training


def test_byte_tokenizer_round_trips():
    text = "déjà vu — ∑ x\n"
    assert data.decode(data.encode(text)) == text
    assert data.encode("A").tolist() == [65]


def test_stdlib_corpus_is_deterministic():
    a, b = data.stdlib_corpus(max_bytes=50_000), data.stdlib_corpus(max_bytes=50_000)
    np.testing.assert_array_equal(a, b)
    assert a.size == 50_000 and a.max() < data.VOCAB_SIZE


def test_tiny_training_run_lowers_the_loss_and_writes_its_outputs(tmp_path):
    out = tmp_path / "run"
    summary = run_training(
        PRESETS["tiny"],
        OptimizerConfig(lr=3e-3, weight_decay=0.1),
        preset_name="tiny",
        steps=30,
        batch_size=8,
        seq_len=64,
        seed=0,
        eval_every=30,
        out_dir=str(out),
        console=Console(file=open(tmp_path / "log.txt", "w")),
    )
    assert summary["final_loss"] < summary["first_loss"] - 1.0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 31))
    assert (out / "model.safetensors").stat().st_size > 4 * PRESETS["tiny"].n_params
    figures = {f["quantity"]: f for f in summary["memory"]}
    assert figures["parameters"]["nbytes"] == 4 * PRESETS["tiny"].n_params
    assert figures["optimizer state"]["nbytes"] >= 8 * PRESETS["tiny"].n_params
    assert all(f["source"] for f in summary["memory"])


def test_training_with_a_policy_precision_and_accumulation(tmp_path):
    from jaxmem.config import AccumConfig
    from jaxmem.precision import PRECISIONS
    from jaxmem.remat import POLICIES

    summary = run_training(
        PRESETS["tiny"],
        OptimizerConfig(lr=3e-3),
        policy=POLICIES["offload"],
        precision=PRECISIONS["bf16"],
        accum=AccumConfig(steps=2),
        preset_name="tiny",
        steps=20,
        batch_size=8,
        seq_len=64,
        seed=0,
        eval_every=20,
        out_dir=None,
        console=Console(file=open(tmp_path / "log.txt", "w")),
    )
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    figures = {f["quantity"]: f["nbytes"] for f in summary["memory"]}
    assert figures["saved activations, host memory (offloaded)"] > 0

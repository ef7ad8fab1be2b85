"""Hugging Face model directories without ``transformers``: ``config.json`` to a ``ModelConfig`` and
back, the key-and-shape map both ways (single files, shards, bfloat16, GPT-2's two key styles),
one-line refusals of what jaxmem cannot represent, ``--preset DIR``, and text tokenized by a
directory's ``tokenizer.json``. ``parity_tests/test_hf_checkpoints.py`` compares with
``transformers`` itself."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxmem.config import PRESETS, ConfigError, ModelConfig
from jaxmem.hf.config import (
    disagreements,
    hf_config_from_model,
    hf_model_type,
    model_config_from_dir,
    model_config_from_hf,
    resolve_preset,
)
from jaxmem.hf.files import read_params, write_safetensors
from jaxmem.hf.keys import hf_tensors, key_map, param_shapes
from tests.test_cli_contract import run_cli

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
}
TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 300, "n_embd": 64, "n_layer": 2, "n_head": 4}
TINY_GPT2 |= {"n_positions": 64}


def random_params(cfg: ModelConfig, seed: int = 0, dtype=np.float32) -> dict:
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(s).astype(dtype) for p, s in param_shapes(cfg).items()}


def write_model_dir(directory, config_json: dict, *, seed: int = 0, edit=None) -> str:
    """A model directory as save_pretrained writes one, with random weights; ``edit(tensors)``
    changes the tensors before they are written."""
    os.makedirs(directory, exist_ok=True)
    (open(os.path.join(directory, "config.json"), "w")).write(json.dumps(config_json))
    cfg = model_config_from_hf(config_json)
    tensors = hf_tensors(random_params(cfg, seed), cfg)
    if edit is not None:
        edit(tensors)
    write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
    return str(directory)


# --------------------------------------------------------------------------------- config.json
def test_each_architecture_reads_as_its_model_config():
    llama = model_config_from_hf(TINY_LLAMA)
    assert (llama.norm_type, llama.positions, llama.mlp, llama.activation) == (
        "rmsnorm",
        "rope",
        "gated",
        "silu",
    )
    assert (llama.n_kv_heads, llama.d_ff, llama.layer_norm_eps, llama.tie_embeddings) == (
        2,
        160,
        1e-6,
        False,
    )
    assert not any(llama.has_bias(p) for p in ("qkv", "out", "mlp", "norm"))
    # transformers 4's spelling of the same RoPE (rope_theta + rope_scaling with "type")
    scaling = {"type": "llama3", "factor": 32, "low_freq_factor": 1, "high_freq_factor": 4}
    scaling["original_max_position_embeddings"] = 8192
    old = {k: v for k, v in TINY_LLAMA.items() if k != "rope_parameters"}
    old |= {"rope_theta": 500000.0, "rope_scaling": scaling}
    scaled = model_config_from_hf(old)
    assert (scaled.rope_theta, scaled.rope_scaling, scaled.rope_factor) == (5e5, "llama3", 32.0)
    assert scaled.rope_original_max_len == 8192
    gpt2 = model_config_from_hf(TINY_GPT2)  # the rest from transformers' GPT2Config defaults
    assert (gpt2.activation, gpt2.d_ff, gpt2.tie_embeddings, gpt2.positions) == (
        "gelu_tanh",
        256,
        True,
        "learned",
    )
    assert all(gpt2.has_bias(p) for p in ("qkv", "out", "mlp", "norm"))
    qwen2 = model_config_from_hf({**TINY_LLAMA, "model_type": "qwen2"})
    assert [qwen2.has_bias(p) for p in ("qkv", "out", "mlp")] == [True, False, False]
    mistral = model_config_from_hf({**TINY_LLAMA, "model_type": "mistral", "sliding_window": None})
    assert disagreements(mistral, llama) == []


LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0}
LLAMA3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
REFUSED = [
    ({"model_type": "bert"}, 'model_type="bert" is not one jaxmem reads'),
    (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
        'rope_parameters.rope_type="yarn" is not a RoPE scaling jaxmem has',
    ),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, 'rope_type="linear"'),
    ({"head_dim": 32}, "head_dim=32 differs from hidden_size / num_attention_heads = 64 / 4"),
    ({"hidden_act": "gelu_fast"}, 'hidden_act="gelu_fast" is not an activation'),
    ({"model_type": "mistral", "sliding_window": 16}, "sliding_window=16 limits attention"),
    # transformers' default window, shorter than the sequence
    ({"model_type": "mistral", "max_position_embeddings": 8192}, "sliding_window=4096 limits"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=true gives"),
    ({"num_key_value_heads": 3}, "n_kv_heads=3 does not divide n_heads=4"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 rotates part of each head"),
    # sizes: positive integers int32 token ids, positions and indices reach; finite numbers
    ({"vocab_size": 2**31}, "vocab_size=2147483648 is above 2,147,483,647 (2^31 - 1)"),
    ({"max_position_embeddings": 10**12}, "max_position_embeddings=1000000000000 is above"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
    ({"intermediate_size": 160.0}, "intermediate_size=160.0 must be a positive integer"),
    ({"rms_norm_eps": 10**400}, "rms_norm_eps=10000000000000000000... (401 characters) must"),
    (
        {"rope_parameters": {**LLAMA3, "original_max_position_embeddings": math.inf}},
        "rope_parameters.original_max_position_embeddings=Infinity must be a positive integer",
    ),
    ({"rope_parameters": {"rope_theta": math.nan}}, "rope_theta=NaN must be a finite number"),
]


@pytest.mark.parametrize(("change", "message"), REFUSED, ids=[m[:24] for _, m in REFUSED])
def test_what_jaxmem_cannot_represent_is_one_line_naming_field_value_and_fix(change, message):
    raw = {
        k: v
        for k, v in TINY_LLAMA.items()
        if not (k == "rope_parameters" and "rope_scaling" in change)
    }
    with pytest.raises(ConfigError) as e:
        model_config_from_hf({**raw, **change}, where="DIR/config.json")
    text = str(e.value)
    assert message in text and text.startswith("DIR/config.json") and "\n" not in text


def test_gpt2_variants_jaxmem_does_not_compute_are_refused():
    for change in ({"scale_attn_by_inverse_layer_idx": True}, {"scale_attn_weights": False}):
        with pytest.raises(ConfigError, match=next(iter(change))):
            model_config_from_hf({**TINY_GPT2, **change})
    with pytest.raises(ConfigError, match="activation_function"):
        model_config_from_hf({**TINY_GPT2, "activation_function": "silu"})


QWEN2_LIKE = PRESETS["tiny-llama"].replace(qkv_bias=True)


@pytest.mark.parametrize(
    "cfg",
    [
        PRESETS["tiny"],
        PRESETS["tiny-llama"],
        PRESETS["gpt2-124m"],
        PRESETS["llama-3.2-1b"],
        QWEN2_LIKE,
    ],
    ids=["tiny", "tiny-llama", "gpt2-124m", "llama-3.2-1b", "qwen2-like"],
)
def test_a_model_config_exports_as_config_json_and_reads_back(cfg):
    raw = json.loads(json.dumps(hf_config_from_model(cfg)))
    assert raw["model_type"] == {"tiny": "gpt2", "gpt2-124m": "gpt2"}.get(
        next((n for n, c in PRESETS.items() if c == cfg), ""), raw["model_type"]
    )
    assert disagreements(model_config_from_hf(raw), cfg) == []
    assert model_config_from_hf(raw).init_std == cfg.init_std


def test_a_model_no_hugging_face_architecture_computes_does_not_export():
    with pytest.raises(ConfigError, match="causal pre-norm"):
        hf_model_type(PRESETS["seed"])
    with pytest.raises(ConfigError, match="exports as neither"):
        hf_model_type(PRESETS["tiny"].replace(positions="rope"))
    with pytest.raises(ConfigError, match="every bias"):
        hf_model_type(PRESETS["tiny"].replace(bias=False))


# ---------------------------------------------------------------------------------- the tensors
@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "qwen2-like"])
def test_the_key_map_is_the_models_parameter_tree_and_reads_back_exactly(name, tmp_path):
    from flax import nnx

    from jaxmem.model import make_model

    cfg = QWEN2_LIKE if name == "qwen2-like" else PRESETS[name]
    _, state = nnx.split(make_model(cfg), nnx.Param)
    actual = {tuple(map(str, p)): tuple(v[...].shape) for p, v in nnx.to_flat_state(state)}
    assert actual == param_shapes(cfg)
    keys = [e.key for e in key_map(cfg, "hf")]
    assert len(keys) == len(set(keys))
    params = random_params(cfg)
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config_from_model(cfg)))
    write_safetensors(str(directory / "model.safetensors"), hf_tensors(params, cfg))
    back = read_params(str(directory), cfg, np.float32)
    assert back.keys() == params.keys()
    assert all(np.array_equal(back[p], params[p]) for p in params)


def test_bfloat16_shards_and_gpt2s_unprefixed_keys_read_back(tmp_path):
    import ml_dtypes

    cfg = model_config_from_hf(TINY_GPT2)
    params = random_params(cfg)
    tensors = hf_tensors(params, cfg)
    # GPT-2 as the original checkpoints: no "transformer." prefix, causal-mask buffers beside
    plain = {
        k.removeprefix("transformer."): v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()
    }
    plain["h.0.attn.bias"] = np.ones((1, 1, 64, 64), np.float32)
    plain["h.1.attn.masked_bias"] = np.zeros((), np.float32)
    names = sorted(plain)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        write_safetensors(str(tmp_path / file), {k: plain[k] for k in keys})
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
    back = read_params(str(tmp_path), cfg, np.float32)
    for path, value in params.items():
        np.testing.assert_array_equal(
            back[path], value.astype(ml_dtypes.bfloat16).astype(np.float32)
        )
    # the same tensor with and without the prefix: present twice, refused
    write_safetensors(
        str(tmp_path / "b.safetensors"),
        {
            **{k: plain[k] for k in shards["b.safetensors"]},
            "transformer.wte.weight": tensors["transformer.wte.weight"],
        },
    )
    with pytest.raises(ConfigError, match="stored more than once: transformer.wte.weight"):
        read_params(str(tmp_path), cfg, np.float32)


def test_a_preset_directory_resolves_and_names_win(tmp_path, monkeypatch):
    directory = write_model_dir(tmp_path / "m", TINY_LLAMA)
    assert resolve_preset(directory) == model_config_from_dir(directory)
    monkeypatch.chdir(tmp_path)
    os.makedirs("tiny")
    assert resolve_preset("tiny") == PRESETS["tiny"]
    with pytest.raises(ConfigError, match="a directory holding a Hugging Face config.json"):
        resolve_preset("no-such-preset")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_preset("./missing/model")


def test_a_job_on_a_directory_reads_back_without_it(tmp_path):
    """A run's saved config names every model field: resolving it again does not need the
    directory its preset names."""
    import shutil

    from jaxmem.job import JobConfig

    directory = write_model_dir(tmp_path / "m", TINY_LLAMA)
    job = JobConfig.from_dict({"preset": directory, "run": {"seq_len": 32}})
    assert job.model == model_config_from_dir(directory) and job.preset == directory
    saved = job.to_dict()
    shutil.rmtree(directory)
    assert JobConfig.from_dict(saved) == job


# ------------------------------------------------------------------------------ tokenizers
def word_tokenizer(directory, words: list[str]) -> str:
    """A WordLevel tokenizer.json over ``words`` (id 0 unknown, 1 end of text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1} | {w: i + 2 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    return str(directory)


TEXT = "the cat sat on the mat and the dog sat on the log\n" * 40


@pytest.mark.parametrize(("extra_words", "dtype"), [(0, "uint16"), (70_000, "uint32")])
def test_prepare_with_a_tokenizer_writes_the_dtype_its_vocabulary_needs(
    tmp_path, extra_words, dtype
):
    from jaxmem import data
    from jaxmem.cli import main
    from jaxmem.hf.tokenizer import HFTokenizer

    words = "the cat sat on mat and dog log".split() + [f"w{i}" for i in range(extra_words)]
    model = word_tokenizer(tmp_path / "model", words)
    (tmp_path / "text.txt").write_text(TEXT)
    assert (
        main(
            [
                "prepare",
                str(tmp_path / "text.txt"),
                "--out",
                str(tmp_path / "d"),
                "--tokenizer",
                model,
                "--seq-len",
                "16",
            ]
        )
        == 0
    )
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    tok = HFTokenizer(model)
    assert meta["dtype"] == dtype and meta["vocab_size"] == tok.vocab_size
    assert meta["tokenizer"] == tok.name and tok.name.startswith("tokenizer.json sha256:")
    ids = tok.encode(TEXT)
    ds = data.load_dataset(str(tmp_path / "d"), vocab_size=tok.vocab_size, tokenizer=tok)
    assert ds.train.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.concatenate([ds.train, ds.val]), ids)
    assert tok.decode(ids[:6]) == "the cat sat on the mat"
    # the same data under another tokenizer (bytes) is refused, naming both
    with pytest.raises(data.DataError, match="comes? from tokenizer.json sha256:.*byte tokenizer"):
        data.load_dataset(str(tmp_path / "d"), vocab_size=1 << 20)


# ------------------------------------------------------------------ bad directories, real command
def _jaxmem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxmem.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "400"},  # one line per line
    )


def _without(key):
    return lambda tensors: tensors.pop(key)


def _reshaped(key):
    return lambda tensors: tensors.__setitem__(key, tensors[key][:-1])


def _plus(key):
    return lambda tensors: tensors.__setitem__(key, np.zeros(3, np.float32))


def _config(raw: dict):
    def write(directory: str) -> None:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(raw, f)

    return write


def _pickled(directory: str) -> None:
    os.rename(
        os.path.join(directory, "model.safetensors"), os.path.join(directory, "pytorch_model.bin")
    )


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
K_PROJ = "model.layers.0.self_attn.k_proj.weight"
BAD_DIRS = {
    "unknown-model-type": (
        TINY_LLAMA, None, _config({**TINY_LLAMA, "model_type": "falcon"}), 'model_type="falcon"'
    ),
    "missing-tensor": (
        TINY_LLAMA,
        _without("model.layers.1.mlp.up_proj.weight"),
        None,
        "lacks tensor(s) model.layers.1.mlp.up_proj.weight",
    ),
    "wrong-shape": (
        TINY_LLAMA, _reshaped(K_PROJ), None, f"{K_PROJ} is [31, 64], expected [32, 64]"
    ),
    "extra-tensor": (
        TINY_LLAMA,
        _plus("model.layers.0.self_attn.q_norm.weight"),
        None,
        "does not have: model.layers.0.self_attn.q_norm.weight",
    ),
    "pickle": (TINY_LLAMA, None, _pickled, "pickled weights are never loaded: convert with"),
    "rope-type": (
        TINY_LLAMA, None, _config({**TINY_LLAMA, "rope_parameters": DYNAMIC}), 'rope_type="dynamic"'
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_DIRS))
def test_a_bad_model_directory_is_one_line_exit_2_and_nothing_written(case, tmp_path):
    raw, edit, after, message = BAD_DIRS[case]
    directory = write_model_dir(tmp_path / "model", raw, edit=edit)
    if after is not None:
        after(directory)
    out = tmp_path / "run"
    proc = _jaxmem(
        "train",
        "--init-from",
        directory,
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--out",
        str(out),
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxmem train: error: "), lines
    assert message in lines[0]
    assert not out.exists()
    if case in ("unknown-model-type", "rope-type"):  # the config alone: --preset DIR says so too
        proc = _jaxmem("memory", "--preset", directory, "--frameworks", "jax")
        assert proc.returncode == 2 and message in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_a_directory_whose_vocabulary_overflows_int32_is_one_line_naming_it(tmp_path):
    """Every command that takes a model directory reads its sizes through one check: a
    vocabulary beyond JAX's int32 indexing is refused in one line naming the field, exit 2,
    nothing written, and so is the same size given as a setting."""
    (tmp_path / "model").mkdir()
    big = {**TINY_LLAMA, "vocab_size": 2**31}
    (tmp_path / "model" / "config.json").write_text(json.dumps(big))
    proc = run_cli("memory", "--preset", str(tmp_path / "model"), "--frameworks", "jax")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "config.json: vocab_size=2147483648 is above 2,147,483,647 (2^31 - 1)" in lines[0]
    with pytest.raises(ConfigError, match="vocab_size=2147483648 is above 2,147,483,647"):
        dataclasses.replace(PRESETS["tiny"], vocab_size=2**31)
    assert sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.slow
def test_memory_takes_a_model_directory_as_its_preset(tmp_path):
    directory = write_model_dir(tmp_path / "model", TINY_LLAMA)
    proc = _jaxmem("memory", "--preset", directory, "--frameworks", "jax", "--policies", "none")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # the table's title wraps at the terminal's width
    assert f"one training step: {directory}, batch 8 x 64" in text
    presets = _jaxmem("presets")
    assert directory not in presets.stdout and "tiny-llama" in presets.stdout


@pytest.mark.slow
def test_training_from_a_directory_tokenizes_with_its_tokenizer_and_samples_with_it(tmp_path):
    words = "the cat sat on mat and dog log".split()
    directory = word_tokenizer(tmp_path / "model", words)
    config = {**TINY_LLAMA, "vocab_size": 10, "eos_token_id": 1, "bos_token_id": None}
    write_model_dir(directory, config)
    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "run"
    proc = _jaxmem(
        "train", "--init-from", directory, "--data", str(tmp_path / "text.txt"), "--steps", "2",
        "--batch-size", "2", "--seq-len", "16", "--sample-tokens", "6", "--prompt", "the cat",
        "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "(494 train / 26 val tokens)" in proc.stdout  # words, not bytes
    sample = (out / "sample.txt").read_text().split()
    assert sample[:2] == ["the", "cat"] and len(sample) == 8
    assert set(sample) <= {*words, "[UNK]", "<eos>"}


# ------------------------------------------------------------------------------- jaxmem export
@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> str:
    """A run of the tiny preset, 2 steps on bytes (no tokenizer anywhere)."""
    from jaxmem.cli import main

    run = tmp_path_factory.mktemp("export") / "run"
    args = ["--preset", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "16"]
    assert main(["train", *args, "--sample-tokens", "0", "--out", str(run)]) == 0
    return str(run)


@pytest.mark.slow
def test_export_makes_the_parents_of_out_and_says_a_byte_run_has_no_tokenizer(byte_run, tmp_path):
    out = tmp_path / "x" / "y" / "z"
    proc = run_cli("export", byte_run, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    text = " ".join(proc.stdout.split())
    assert f"no tokenizer in {out}/: the run read raw bytes (its model is a named preset)" in text
    assert "its ids are the UTF-8 bytes of the text (0-255; 256, 257, 258: BOS, EOS, PAD)" in text
    assert "encode with list(text.encode())" in text


@pytest.mark.slow
def test_export_merge_of_a_run_without_adapters_is_one_line(byte_run, tmp_path, capsys):
    from tests.test_lora import _refused

    capsys.readouterr()
    line = _refused(capsys, ["export", byte_run, "--merge", "--out", str(tmp_path / "hf")])
    assert "--merge: " in line and "trained no adapters" in line and "drop --merge" in line
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "meta, says",
    [
        ({"tokenizer": "gpt2"}, "was tokenized with gpt2 (its meta.json): encode with that"),
        (None, "was tokenized outside jaxmem (no meta.json names a tokenizer)"),
        ({"tokenizer": "bytes"}, "the run read raw bytes (its model is a named preset)"),
    ],
)
def test_export_says_raw_bytes_only_where_the_runs_data_was_bytes(meta, says, tmp_path):
    """A named preset (gpt2-124m) trained on a .bin: the note follows the data's meta.json
    (a tokenizer it names, none, or the byte tokenizer); no run needed, the note reads the
    run's config."""
    from jaxmem.cli.export import no_tokenizer_note
    from jaxmem.job import JobConfig

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(bytes(64))
    if meta is not None:
        (data / "meta.json").write_text(json.dumps(meta))
    job = JobConfig.from_dict({"preset": "gpt2-124m", "data": {"path": str(data)}})
    note = " ".join(no_tokenizer_note("hf", job, None).split())
    assert says in note
    assert ("UTF-8 bytes" in note) == (meta == {"tokenizer": "bytes"})


def test_export_where_out_cannot_be_made_is_one_line_and_writes_nothing(tmp_path, capsys):
    from jaxmem.cli import main

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # refused before a checkpoint is read
    (tmp_path / "file").write_text("")
    for out, says in (
        ("/proc/jaxmem-export/hf", "--out /proc/jaxmem-export/hf: /proc is not writable"),
        (str(tmp_path / "file" / "hf"), f"{tmp_path / 'file'} is a file, not a directory"),
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit, match="2"):
            main(["export", str(tmp_path / "run"), "--out", out])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["file", "run"]


def test_a_model_directory_that_fails_to_write_leaves_no_parent_behind(tmp_path, monkeypatch):
    import jaxmem.hf.files as hf_files

    def disk_full(path, tensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_files, "write_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        hf_files.save_model_dir(str(tmp_path / "a" / "b" / "hf"), {}, {})
    assert os.listdir(tmp_path) == []


# ------------------------------------------------- --init-from refusals, before anything runs
def _nan_in_k_proj(tensors) -> None:
    tensors[K_PROJ] = tensors[K_PROJ].copy()
    tensors[K_PROJ][3, 5] = np.nan


def _init_from_case(case: str, tmp_path) -> tuple[list[str], str]:
    """The arguments of one refused ``--init-from`` and the words its line must hold."""
    model = tmp_path / "model"
    if case == "missing directory":
        return ["--init-from", str(tmp_path / "nowhere")], (
            f"--init-from {tmp_path / 'nowhere'}: the directory does not exist"
        )
    if case == "a file in the directory":
        write_model_dir(model, TINY_LLAMA)
        return ["--init-from", str(model / "config.json")], (
            f"--init-from {model / 'config.json'} is a file; give the directory that holds it "
            f"({model})"
        )
    if case == "non-finite weights":
        write_model_dir(model, TINY_LLAMA, edit=_nan_in_k_proj)
        return ["--init-from", str(model)], (
            f"tensor {K_PROJ} in {model / 'model.safetensors'} holds 1 non-finite value(s)"
        )
    assert case == "a tokenizer larger than the vocabulary"
    word_tokenizer(model, [f"w{i}" for i in range(400)])  # 402 ids, vocab_size 300
    write_model_dir(model, TINY_LLAMA)
    return ["--init-from", str(model)], (
        f"tokenizer.json of {model} has 402 token ids but the model's vocab_size is 300"
    )


@pytest.mark.parametrize(
    "case",
    [
        "missing directory",
        "a file in the directory",
        pytest.param("non-finite weights", marks=pytest.mark.slow),  # loads them
        "a tokenizer larger than the vocabulary",
    ],
)
def test_a_refused_init_from_is_one_line_naming_what_is_wrong_and_writes_nothing(case, tmp_path):
    from tests.test_cli_contract import run_cli

    args, message = _init_from_case(case, tmp_path)
    (tmp_path / "text.txt").write_text(TEXT)  # a small corpus: the refusal is what costs
    before = sorted(os.listdir(tmp_path))
    out = tmp_path / "runs" / "run"
    args += ["--data", str(tmp_path / "text.txt"), "--steps", "2", "--batch-size", "2"]
    proc = run_cli("train", *args, "--seq-len", "16", "--out", str(out), columns=400)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("jaxmem train: error: ") and message in line, line
    assert sorted(os.listdir(tmp_path)) == before  # not even runs/

"""``jaxmem export`` of a run that trained LoRA adapters: a PEFT adapter directory that
``peft.PeftModel.from_pretrained`` loads onto the base and that computes jaxmem's logits, with
PEFT's own config keys and tensor keys; ``--merge``: the base with each adapter merged in, a delta
of rank at most r on each targeted projection and nothing elsewhere; GPT-2's fused ``c_attn``
refused for an adapter directory in one line, and a torch run exports merged only."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from jaxmem.adapters import TARGETS, AdapterConfig
from jaxmem.compare.tolerances import tolerance
from jaxmem.hf.adapters import peft_config
from jaxmem.hf.config import model_config_from_dir
from jaxmem.model import make_model
from jaxmem.model.hf import all_arrays, read_hf_weights
from jaxmem.train.checkpoint import restore_params
from tests.test_hub import TINY_LLAMA, write_model_dir
from tests.test_lora import RUN_FLAGS, _refused

ADAPTERS = AdapterConfig(rank=4, alpha=16.0, targets=TARGETS, train=("norm",))
FLAGS = ("--lora-rank", "4", "--lora-alpha", "16", "--lora-targets", ",".join(TARGETS))
FLAGS += ("--lora-train", "norm", *RUN_FLAGS, "--steps", "2")


def _scaled(tensors: dict) -> None:
    """Weights of standard deviation 1/8 (1/sqrt(hidden_size)), norms at their ones: O(1)
    logits, the scale the float32 logits tolerance is measured at (unit weights give logits
    near 35, where transformers and jaxmem differ by 2e-4 on the base alone)."""
    for key, value in tensors.items():
        tensors[key] = np.ones_like(value) if "norm" in key else value / 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """tiny-llama from a random Hugging Face directory, every projection adapted and the norms
    trained, 2 steps (B nonzero), exported as an adapter directory and merged."""
    from jaxmem.cli import main

    root = tmp_path_factory.mktemp("lora-export")
    model = write_model_dir(root / "model", TINY_LLAMA, edit=_scaled)
    assert main(["train", "--init-from", model, *FLAGS, "--out", str(root / "run")]) == 0
    assert main(["export", str(root / "run"), "--out", str(root / "adapter")]) == 0
    assert main(["export", str(root / "run"), "--merge", "--out", str(root / "merged")]) == 0
    cfg = model_config_from_dir(model)
    like = nnx.split(make_model(cfg, adapters=ADAPTERS), nnx.Param)[1]
    params = restore_params(root / "run" / "checkpoints", 2, like)
    return root, model, cfg, params


@pytest.mark.slow
def test_peft_loads_the_adapter_directory_and_computes_jaxmems_logits(run):
    peft = pytest.importorskip(
        "peft",
        reason="peft: the adapters and dev extras (make test installs it)",
    )
    import torch
    from safetensors.numpy import load_file
    from transformers import LlamaForCausalLM

    root, model, cfg, params = run
    adapter = root / "adapter"
    config = peft.PeftConfig.from_pretrained(str(adapter))
    assert (config.r, config.lora_alpha, config.base_model_name_or_path) == (4, 16.0, model)
    assert sorted(config.target_modules) == sorted(f"{t}_proj" for t in TARGETS)
    theirs = peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM").to_dict()
    written = json.loads((adapter / "adapter_config.json").read_text())
    assert set(written) == set(theirs) - {"peft_version"}
    base = LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(base, str(adapter))
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    peft_keys = set(peft.get_peft_model_state_dict(wrapped))  # PEFT's keys, its prefix on
    assert set(saved) == peft_keys and all(v.dtype == np.float32 for v in saved.values())
    b = saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert b.shape == (cfg.d_model, 4) and np.abs(b).max() > 0  # trained
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        logits = wrapped(torch.from_numpy(tokens)).logits.numpy()
    ours = make_model(cfg, adapters=ADAPTERS)
    nnx.update(ours, params)
    np.testing.assert_allclose(
        logits, np.asarray(ours(tokens)), **tolerance("float32", "logits").kwargs()
    )


@pytest.mark.slow
def test_the_merged_export_adds_scale_b_a_to_each_targeted_projection_only(run):
    root, model, cfg, params = run
    _check_merged(root / "merged", cfg, all_arrays(params), read_hf_weights(model, cfg, "float32"))


def _check_merged(merged_dir, cfg, arrays: dict, start: dict) -> None:
    """The model directory ``merged_dir`` holds ``start``'s kernels plus scale·A·B of the
    adapters in ``arrays`` (a delta of rank <= 4 per layer and part), exactly as float64 sums
    rounded once; every other tensor is ``arrays``' (norms trained) or ``start``'s."""
    from jaxmem.hf.files import read_params

    merged = read_params(str(merged_dir), cfg, np.float32)
    kernels = {"o": ("self_attn", "out_proj"), "gate": ("ffn", "gate"), "up": ("ffn", "up")}
    kernels |= {"down": ("ffn", "down")}
    d, kv = cfg.d_model, cfg.kv_dim
    columns = {"q": (0, d), "k": (d, d + kv), "v": (d + kv, d + 2 * kv)}
    touched = set()
    for t in TARGETS:
        path = ("blocks", "layers", *kernels.get(t, ("self_attn", "in_proj")), "kernel")
        touched.add(path)
        lo, hi = columns.get(t, (0, merged[path].shape[-1]))
        group = "ffn" if t in ("gate", "up", "down") else "self_attn"
        a = np.asarray(arrays[("blocks", "layers", group, f"lora_{t}", "lora_a")], np.float64)
        b = np.asarray(arrays[("blocks", "layers", group, f"lora_{t}", "lora_b")], np.float64)
        base = np.asarray(start[path][..., lo:hi], np.float64)
        want = (base + ADAPTERS.scale * (a @ b)).astype(np.float32)
        assert np.array_equal(merged[path][..., lo:hi], want), t
        for i in range(cfg.n_layers):
            # the float32 rounding of the sum moves each element by at most eps/2 of it, so
            # the singular values past r stay below eps/2 * ||merged||_F
            delta = merged[path][i, :, lo:hi].astype(np.float64) - base[i]
            bound = np.finfo(np.float32).eps / 2 * np.linalg.norm(merged[path][i, :, lo:hi])
            assert np.abs(delta).max() > 0, (t, i)
            assert np.linalg.matrix_rank(delta, tol=bound) <= 4, (t, i)
    for path, value in merged.items():  # the norms trained: the merged export holds them
        if path not in touched:
            assert np.array_equal(value, arrays[path]), path
            if "norm" not in "".join(path):
                assert np.array_equal(value, start[path]), path


def test_the_adapter_config_has_peft_loraconfigs_keys_without_peft():
    config = peft_config(AdapterConfig(rank=8, alpha=16.0, rslora=True), "base")
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["use_rslora"]
    assert (config["peft_type"], config["task_type"], config["bias"]) == (
        "LORA",
        "CAUSAL_LM",
        "none",
    )
    assert config["modules_to_save"] is None and config["base_model_name_or_path"] == "base"


@pytest.mark.slow
def test_a_gpt2_adapter_directory_is_refused_in_one_line_and_merge_writes_one(tmp_path, capsys):
    from jaxmem.cli import main

    args = ["--preset", "tiny", "--lora-rank", "4", "--steps", "1", "--batch-size", "2"]
    assert (
        main(
            [
                "train",
                *args,
                "--seq-len",
                "16",
                "--sample-tokens",
                "0",
                "--out",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    line = _refused(capsys, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    assert "fuses q, k and v into one c_attn Conv1D" in line and "--merge" in line
    assert not (tmp_path / "hf").exists()
    assert main(["export", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


@pytest.mark.slow
def test_a_torch_adapter_run_exports_merged_only(run, tmp_path, capsys):
    """A ``--framework torch`` run's checkpoint restores merged: ``--merge`` writes it (only the
    targeted projections differ from the base), an adapter directory is refused in one line."""
    pytest.importorskip(
        "peft",
        reason="peft: the adapters and dev extras (make test installs it)",
    )
    from jaxmem.cli import main
    from jaxmem.hf.files import read_params

    root, model, cfg, _ = run
    args = ["train", "--framework", "torch", "--init-from", model, "--lora-rank", "4"]
    args += [*RUN_FLAGS, "--steps", "2", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    capsys.readouterr()
    line = _refused(capsys, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    assert "--framework torch adapter run" in line and "--merge" in line
    assert main(["export", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "hf")]) == 0
    merged = read_params(str(tmp_path / "hf"), cfg, np.float32)
    start = read_hf_weights(model, cfg, "float32")
    changed = {p for p in merged if not np.array_equal(merged[p], start[p])}
    in_proj = ("blocks", "layers", "self_attn", "in_proj", "kernel")
    assert changed == {in_proj}  # the default targets, q and v
    k = slice(cfg.d_model, cfg.d_model + cfg.kv_dim)  # k's columns: untargeted
    assert np.array_equal(merged[in_proj][..., k], start[in_proj][..., k])


# ------------------------------------------------- a run on a packed (--quantize-base nf4) base
@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """The ``run`` fixture's job on an nf4 base (MLP 128: blocks of 64 divide it), exported as
    an adapter directory and merged, and the checkpoint's parameters (the packed base's
    arrays among them)."""
    from jaxmem.cli import main
    from jaxmem.model.qbase import quantize_base

    root = tmp_path_factory.mktemp("qlora-export")
    model = write_model_dir(root / "model", TINY_LLAMA | {"intermediate_size": 128}, edit=_scaled)
    args = ["train", "--init-from", model, *FLAGS, "--quantize-base", "nf4"]
    assert main([*args, "--out", str(root / "run")]) == 0
    assert main(["export", str(root / "run"), "--out", str(root / "adapter")]) == 0
    assert main(["export", str(root / "run"), "--merge", "--out", str(root / "merged")]) == 0
    cfg = model_config_from_dir(model)
    like = nnx.split(quantize_base(make_model(cfg, adapters=QADAPTERS), "nf4"), nnx.Param)[1]
    params = restore_params(root / "run" / "checkpoints", 2, like)
    return root, model, cfg, params


QADAPTERS = dataclasses.replace(ADAPTERS, base="nf4")


def _dequantized_start(model: str, cfg, arrays: dict) -> dict:
    """``model``'s weights with every block kernel replaced by the nf4 base's dequantized
    values (``jaxmem.model.quant.dequantize`` of the checkpoint's packed arrays, layer by
    layer, q, k and v side by side): the base the run trained on."""
    from jaxmem.model.qbase import FIELDS
    from jaxmem.model.quant import as_jax, dequantize
    from jaxmem.quant import QuantizedWeight

    d, kv, f = cfg.d_model, cfg.kv_dim, cfg.d_ff
    parts = {("self_attn", "in_proj"): {"q": (d, d), "k": (kv, d), "v": (kv, d)}}
    parts |= {("self_attn", "out_proj"): {"w": (d, d)}, ("ffn", "down"): {"w": (d, f)}}
    parts |= {("ffn", "gate"): {"w": (f, d)}, ("ffn", "up"): {"w": (f, d)}}
    start = read_hf_weights(model, cfg, "float32")
    for where, shapes in parts.items():
        columns = []
        for part, shape in shapes.items():
            prefix = ("blocks", "layers", *where, part)
            fields = {n: arrays[(*prefix, n)] for n in FIELDS if (*prefix, n) in arrays}
            layers = [
                QuantizedWeight("nf4", shape, **{n: a[i] for n, a in fields.items()})
                for i in range(cfg.n_layers)
            ]
            columns.append(np.stack([np.asarray(dequantize(as_jax(q))).T for q in layers]))
        start[("blocks", "layers", *where, "kernel")] = np.concatenate(columns, axis=-1)
    return start


@pytest.mark.slow
def test_the_merged_export_of_an_nf4_run_adds_scale_b_a_to_the_dequantized_base(qlora_run):
    root, model, cfg, params = qlora_run
    arrays = all_arrays(params)
    _check_merged(root / "merged", cfg, arrays, _dequantized_start(model, cfg, arrays))


@pytest.mark.slow
def test_peft_loads_an_nf4_runs_adapters_onto_the_dequantized_base_with_jaxmems_logits(
    qlora_run,
):
    """The adapter directory names the --init-from directory as its base; on that base with
    its projections set to the nf4 values the run trained on, PEFT computes jaxmem's logits."""
    peft = pytest.importorskip(
        "peft",
        reason="peft: the adapters and dev extras (make test installs it)",
    )
    import torch
    from transformers import LlamaForCausalLM

    from jaxmem.hf.keys import hf_tensors
    from jaxmem.model.qbase import quantize_base

    root, model, cfg, params = qlora_run
    config = peft.PeftConfig.from_pretrained(str(root / "adapter"))
    assert (config.r, config.base_model_name_or_path) == (4, model)
    base = LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    dense = _dequantized_start(model, cfg, all_arrays(params))
    state = {
        k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_tensors(dense, cfg).items()
    }
    assert not base.load_state_dict(state, strict=False).unexpected_keys
    wrapped = peft.PeftModel.from_pretrained(base, str(root / "adapter"))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        logits = wrapped(torch.from_numpy(tokens)).logits.numpy()
    ours = quantize_base(make_model(cfg, adapters=QADAPTERS), "nf4")
    nnx.update(ours, params)
    np.testing.assert_allclose(
        logits, np.asarray(ours(tokens)), **tolerance("float32", "logits").kwargs()
    )

"""LoRA in torch_ref (``torch_ref.lora``: PEFT's LoRA layers, one adapter per part of the fused
q/k/v projection) against stock PEFT (``get_peft_model``) on ``transformers``' own
``LlamaForCausalLM``: the same base and adapter weights give the same logits and adapter
gradients in float64, the base gets no gradient, and the merged weights equal PEFT's
``merge_and_unload`` bit for bit."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

from jaxmem.adapters import TARGETS, AdapterConfig
from jaxmem.compare.parity import dtype_context, precision_of, torch_model_from
from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from parity_tests.hf_models import float64_internals, load_hf, save_hf_model

pytest.importorskip(
    "peft",
    reason="peft: the adapters and dev extras (make test installs it)",
)
pytest.importorskip(
    "transformers", reason="transformers is in the dev extra (make test installs it)"
)

import torch_ref  # noqa: E402
from torch_ref.lora import (  # noqa: E402  (after the importorskip)
    adapter_state_dict,
    add_adapters,
    hf_adapter_key,
    hf_target_modules,
    lora_config,
    merged_state_dict,
)

ADAPTERS = AdapterConfig(rank=4, alpha=12.0, targets=TARGETS, rslora=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """transformers' Llama (grouped-query attention: q, k, v of different widths) with stock
    PEFT, and torch_ref's decoder holding its weights with ``torch_ref.lora``'s adapters, both
    float64, every adapter's A and B set to the same random, nonzero values."""
    from peft import get_peft_model

    from jaxmem.hf.config import model_config_from_dir
    from jaxmem.model import make_model
    from jaxmem.model.hf import load_hf_weights

    directory = save_hf_model("llama-gqa-untied", os.fspath(tmp_path_factory.mktemp("hf")))
    cfg = model_config_from_dir(directory)
    with dtype_context("float64"):
        initial = make_model(cfg, precision_of("float64"))
        load_hf_weights(initial, directory)
        ours = add_adapters(torch_model_from(initial), ADAPTERS)
    hf = get_peft_model(
        load_hf(directory, "float64"), lora_config(ADAPTERS, hf_target_modules(ADAPTERS))
    )
    theirs = dict(hf.named_parameters())
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for key, p in adapter_state_dict(ours).items():
            p.copy_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
            theirs[_peft_param(hf_adapter_key(key))].copy_(p)
    return ours, hf


def _peft_param(key: str) -> str:
    """A PEFT adapter file's key as the parameter's name on the ``PeftModel``."""
    return re.sub(r"\.lora_([AB])\.weight$", r".lora_\1.default.weight", f"base_model.model.{key}")


def _batch(seed: int = 5, batch: int = 2, seq_len: int = 24):
    tokens = np.random.default_rng(seed).integers(0, 300, (batch, seq_len + 1))
    return torch.from_numpy(tokens[:, :-1]), torch.from_numpy(tokens[:, 1:])


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_torch_ref_adapters_give_peft_logits_and_adapter_gradients_in_float64(models):
    ours, hf = models
    inputs, targets = _batch()
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    logits = ours(inputs)
    _loss(logits, targets).backward()
    with float64_internals():
        logits_hf = hf(inputs).logits
        _loss(logits_hf, targets).backward()
    tol = tolerance("float64", "logits")
    np.testing.assert_allclose(logits.detach(), logits_hf.detach(), rtol=tol.rtol, atol=tol.atol)
    theirs = {k: p.grad.numpy() for k, p in hf.named_parameters() if p.grad is not None}
    grads = {
        _peft_param(hf_adapter_key(k)): p.grad.numpy()
        for k, p in ours.named_parameters()
        if p.grad is not None
    }
    assert {k for k, p in ours.named_parameters() if p.requires_grad} == set(
        adapter_state_dict(ours)
    )  # the base is frozen: only the adapters train
    assert len(grads) == 2 * 7 * ours.cfg.n_layers
    diff = compare_state_dicts(grads, theirs, tolerance("float64", "grads"))
    assert diff.passed, diff
    assert all(np.abs(g).max() > 1e-6 for g in theirs.values())  # every adapter has signal


def test_merged_weights_equal_peft_merge_and_unload_bit_for_bit(models):
    ours, hf = models
    merged = merged_state_dict(ours)
    theirs = {k: v.detach() for k, v in hf.merge_and_unload(progressbar=False).state_dict().items()}
    hf_state = _as_hf(merged, ours.cfg)
    assert set(hf_state) <= set(theirs)
    for key, value in hf_state.items():
        assert torch.equal(value, theirs[key]), key


def _as_hf(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """torch_ref's block weights under transformers' Llama names (q, k, v: the fused rows)."""
    out = {}
    sizes = [cfg.d_model, cfg.kv_dim, cfg.kv_dim]
    for i in range(cfg.n_layers):
        src, dst = f"blocks.layers.{i}.", f"model.layers.{i}."
        qkv = state[f"{src}self_attn.in_proj_weight"].split(sizes)
        for name, w in zip(("q", "k", "v"), qkv, strict=True):
            out[f"{dst}self_attn.{name}_proj.weight"] = w
        out[f"{dst}self_attn.o_proj.weight"] = state[f"{src}self_attn.out_proj.weight"]
        for name in ("gate", "up", "down"):
            out[f"{dst}mlp.{name}_proj.weight"] = state[f"{src}ffn.{name}.weight"]
    return out


# ------------------------------------------------------------------ training (--framework torch)
LORA_RUN = [
    "--sample-tokens",
    "0",
    "--preset",
    "tiny-llama",
    "--framework",
    "torch",
    "--set",
    "adapters.rank=4",
    "--set",
    'adapters.targets=["q","k","v","o","gate","up","down"]',
    "--set",
    'adapters.train=["norm"]',
]


def test_a_lora_torch_run_trains_its_adapters_only_and_resumes_bit_for_bit(tmp_path):
    """4 steps equal 2 steps and a resume to 4 exactly; the checkpoint holds the base under
    torch_ref's own names (what ``jaxmem.compare.weights`` maps), the adapters apart, and
    optimizer state for the adapters and norms only."""
    from jaxmem import cli
    from tests.test_train import metrics

    def train(*args: str) -> int:
        return cli.main(["train", "--batch-size", "4", "--seq-len", "32", *args])

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert train("--steps", "4", *LORA_RUN, "--out", str(whole)) == 0
    first = ["--steps", "2", "--checkpoint-every", "2", *LORA_RUN, "--out", str(resumed)]
    assert train(*first) == 0
    assert train("--steps", "4", "--resume", "--out", str(resumed)) == 0
    keys = ("step", "loss", "grad_norm")
    assert [[r[k] for k in keys] for r in metrics(resumed)] == [
        [r[k] for k in keys] for r in metrics(whole)
    ]
    state = torch.load(resumed / "checkpoints" / "4" / "state.pt", weights_only=True)
    from jaxmem.config import PRESETS

    cfg = PRESETS["tiny-llama"]
    assert set(state["model"]) == set(torch_ref.Decoder(cfg).state_dict())
    n_adapters = 2 * 7 * cfg.n_layers
    assert len(state["adapters"]) == n_adapters
    norms = 2 * cfg.n_layers + 1
    assert len(state["optimizer"]["state"]) == n_adapters + norms
    _check_merged_restore(resumed, state, cfg)


def _check_merged_restore(run_dir, state: dict, cfg) -> None:
    """``restored_model`` (what ``jaxmem export`` reads of a torch run) merges the adapters:
    each targeted projection moves by a delta of rank <= r (per q/k/v part), every other
    weight (the trained norms included) is the checkpoint's."""
    import json

    from jaxmem.compare.torch_run import restored_model
    from jaxmem.compare.weights import to_torch_state_dict
    from jaxmem.job import JobConfig

    run_config = json.loads((run_dir / "checkpoints" / "4" / "run_config.json").read_text())
    merged = to_torch_state_dict(restored_model(str(run_dir), 4, JobConfig.from_dict(run_config)))
    sizes = [cfg.d_model, cfg.kv_dim, cfg.kv_dim]
    for key, base in state["model"].items():
        delta = torch.from_numpy(np.asarray(merged[key])) - base
        if key.endswith(("in_proj_weight", "out_proj.weight", "gate.weight", "up.weight",
                         "down.weight")):  # fmt: skip
            parts = delta.split(sizes) if key.endswith("in_proj_weight") else [delta]
            # float32 weights: W + delta rounds, so the difference is delta plus rounding noise
            # ~1e-9 (singular values ~1e-8, the adapters' ~1e-3): rank counted above 1e-4 of
            # the largest
            ranks = [int(torch.linalg.matrix_rank(p.double(), rtol=1e-4)) for p in parts]
            assert all(0 < r <= 4 for r in ranks), (key, ranks)
        else:
            assert not delta.any(), key


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"adapters": {"base": "int8"}, "parallel": {"devices": 2}},
            "--quantize-base int8 with --framework torch and --mesh dp=2: ",
        ),
        ({"parallel": {"devices": 2, "tp": 2}}, "not split the q/k/v adapters over a tensor"),
    ],
)
def test_what_torch_ref_cannot_train_with_adapters_is_refused_in_one_line(sections, message):
    """Refused by the torch backend's check (``jaxmem train`` runs it before any model, data or
    process is made), in one line."""
    from jaxmem.compare.torch_run import check_torch_backend
    from jaxmem.config import ConfigError
    from jaxmem.job import JobConfig

    adapters = {"rank": 4, **sections.pop("adapters", {})}
    raw = {"preset": "tiny-llama", "precision": "bf16", "adapters": adapters, **sections}
    with pytest.raises(ConfigError) as e:
        check_torch_backend(JobConfig.from_dict(raw))
    assert message in str(e.value) and "\n" not in str(e.value), e.value


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_torch_qlora_step_saves_the_packed_base_never_a_dequantized_weight(kind):
    """torch_ref's decoder packed (``torch_ref.quant.quantize_base``) under PEFT's adapters: the
    tensors autograd saves for the backward hold each projection's packed bytes and no
    float tensor of a projection weight's shape; the adapters, and only they, get gradients."""
    from jaxmem.config import PRESETS
    from torch_ref.quant import QuantizedLinear, quantize_base

    cfg = PRESETS["tiny-llama"]
    model = quantize_base(torch_ref.Decoder(cfg), kind)
    add_adapters(model, AdapterConfig(rank=4, targets=TARGETS, base=kind))
    tokens = torch.randint(0, cfg.vocab_size, (1, 25), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # 24 rows: no activation has a weight's shape
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _loss(model(inputs), targets).backward()
    d, kv, f = cfg.d_model, cfg.kv_dim, cfg.d_ff
    weights = {(d, d), (kv, d), (f, d), (d, f)}
    weights |= {(i, o) for o, i in weights}
    full = [t.shape for t in saved if t.is_floating_point() and tuple(t.shape) in weights]
    assert not full, full
    packed = {t.data_ptr() for t in saved if t.dtype in (torch.uint8, torch.int8)}
    buffers = {
        getattr(m, n).data_ptr(): n
        for m in model.modules()
        if isinstance(m, QuantizedLinear)
        for n in m.names
        if not getattr(m, n).is_floating_point()
    }
    # every projection but the first block's q, k, v (their input, the frozen embedding's
    # output, needs no gradient) saves its integer arrays, the packed bytes among them
    assert packed <= set(buffers)
    assert sum(buffers[p] == "packed" for p in packed) == 7 * cfg.n_layers - 3
    grads = {k for k, p in model.named_parameters() if p.grad is not None}
    assert grads == set(adapter_state_dict(model))


def test_torch_memory_rows_of_a_packed_base_are_refused_in_one_line(capsys):
    """``jaxmem memory`` builds torch_ref's step on fake tensors, which cannot be packed: asked
    for torch rows of a ``--quantize-base`` job it says so in one line (before anything runs)."""
    from tests.test_lora import _refused

    args = ["memory", "--preset", "tiny-llama", "--lora-rank", "4", "--quantize-base", "int8"]
    line = _refused(capsys, [*args, "--frameworks", "jax,torch"])
    assert "--quantize-base int8: torch_ref's memory rows hold a compute base" in line
    assert "--frameworks jax" in line


def test_the_memory_record_counts_gradients_and_optimizer_state_for_the_adapters_only():
    """``jaxmem memory --frameworks torch`` with adapters: parameters whole, the trainable part
    apart, gradients and AdamW's two moments (and a step count each) for the adapters only;
    the same from a real step and from one on fake tensors (how planning presets run)."""
    from jaxmem.compare.records import torch_record
    from jaxmem.config import PRESETS, OptimizerConfig
    from jaxmem.policy import POLICIES
    from jaxmem.precision import PRECISIONS
    from torch_ref.module_memory import step_peak

    cfg = PRESETS["tiny-llama"]
    adapters = AdapterConfig(rank=4, targets=("q", "k", "v", "down"))
    model = add_adapters(torch_ref.Decoder(cfg), adapters)
    lora = list(adapter_state_dict(model).values())
    lora_bytes = sum(t.numel() * 4 for t in lora)
    every = sum(t.numel() * 4 for t in model.state_dict().values())
    for fake in (False, True):
        rec = torch_record(
            cfg, POLICIES["none"], PRECISIONS["fp32"], OptimizerConfig(), 2, 16,
            fake=fake, adapters=adapters,
        )  # fmt: skip
        assert rec["params_bytes"] == every, fake
        assert rec["trainable_params_bytes"] == rec["grads_bytes"] == lora_bytes, fake
        assert rec["opt_state_bytes"] == 2 * lora_bytes + 4 * len(lora), fake
        assert rec["adapters"] == "LoRA r4 a8 q,k,v,down"
    peak = step_peak(model, torch.zeros(2, 16, dtype=torch.long))  # the module-level API
    assert (peak.parameter_bytes, peak.trainable_parameter_bytes) == (every, lora_bytes)
    assert peak.gradient_bytes == lora_bytes


# ------------------------------------- jaxmem vs torch_ref from a Hugging Face directory (CLI)
# tiny dims that nf4's blocks of 64 divide (hidden 64, MLP 128); every projection adapted
LORA_FROM_DIR = ("--lora-rank", "4", "--lora-targets", ",".join(TARGETS))
LORA_FROM_DIR += ("--batch-size", "2", "--seq-len", "16", "--sample-tokens", "0")
LORA_FROM_DIR += ("--eval-every", "100", "--checkpoint-every", "2")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """``runs(framework, base, steps=4, resume=False)``: the run directory of ``jaxmem train
    --init-from DIR`` with LoRA on the base ``base`` (``compute`` or ``nf4``, through
    ``--quantize-base``), made once per module; DIR a random tiny Hugging Face Llama."""
    from jaxmem import cli
    from tests.test_hub import TINY_LLAMA, write_model_dir
    from tests.test_lora_export import _scaled

    root = tmp_path_factory.mktemp("lora-runs")
    model = write_model_dir(root / "model", TINY_LLAMA | {"intermediate_size": 128}, edit=_scaled)
    made: dict[tuple, object] = {}

    def runs(framework: str, base: str, steps: int = 4, resume: bool = False):
        key = (framework, base, steps, resume)
        if key not in made:
            out = root / "-".join(map(str, key))
            args = ["train", "--init-from", model, "--framework", framework, *LORA_FROM_DIR]
            args += ["--quantize-base", base] if base != "compute" else []
            if resume:  # the 2-step run, resumed to `steps`
                assert cli.main([*args, "--steps", "2", "--out", str(out)]) == 0
                args.append("--resume")
            assert cli.main([*args, "--steps", str(steps), "--out", str(out)]) == 0
            made[key] = out
        return made[key]

    return runs


@pytest.mark.slow
@pytest.mark.parametrize("base", ["compute", "nf4"])
def test_lora_from_a_hf_directory_logs_jaxmems_losses_in_torch_ref(lora_runs, base):
    """The same HF Llama, the same adapters (jaxmem's draw, mapped by
    ``jaxmem.compare.weights``), on the same packed bytes for nf4: the same 4 losses."""
    from tests.test_train import metrics

    losses = {fw: [r["loss"] for r in metrics(lora_runs(fw, base))] for fw in ("jax", "torch")}
    assert len(losses["jax"]) == 4 and np.isfinite(losses["jax"]).all()
    tol = tolerance("float32", "adamw_loss")
    np.testing.assert_allclose(losses["torch"], losses["jax"], rtol=tol.rtol, atol=tol.atol)


@pytest.mark.slow
def test_a_torch_qlora_run_resumes_2_plus_2_as_4_bit_for_bit(lora_runs):
    """The checkpoint holds the packed base (buffers) and the adapters apart; a resume
    reloads both and continues exactly."""
    from tests.test_train import metrics

    keys = ("step", "loss", "grad_norm")
    whole = [[r[k] for k in keys] for r in metrics(lora_runs("torch", "nf4"))]
    resumed_dir = lora_runs("torch", "nf4", resume=True)
    assert [[r[k] for k in keys] for r in metrics(resumed_dir)] == whole
    state = torch.load(resumed_dir / "checkpoints" / "4" / "state.pt", weights_only=True)
    packed = [k for k in state["model"] if k.endswith(".packed")]
    assert packed and all(state["model"][k].dtype == torch.uint8 for k in packed)
    assert not any(k.endswith("in_proj_weight") for k in state["model"])


@pytest.mark.parametrize(
    "preset, adapters",
    [
        ("tiny-llama", ADAPTERS),
        ("tiny", AdapterConfig(rank=4, targets=("q", "v", "o", "up", "down"))),
    ],
)
def test_adapters_cross_between_the_frameworks_through_the_weight_map(preset, adapters):
    """jaxmem's ``lora_a`` ``[L, in, r]`` / ``lora_b`` ``[L, r, out]`` land on torch_ref's PEFT
    keys transposed, and come back the same; the map covers every adapter of both (a gated MLP's
    ``ffn.{gate,up,down}``, a standard one's ``ffn.0``/``ffn.2``)."""
    from jaxmem.compare.weights import (
        WeightMapError,
        load_torch_adapter_state_dict,
        to_torch_adapter_state_dict,
    )
    from jaxmem.config import PRESETS
    from jaxmem.model import make_model

    cfg = PRESETS[preset]
    ours = make_model(cfg, seed=1, adapters=adapters)
    state = to_torch_adapter_state_dict(ours)
    theirs = adapter_state_dict(add_adapters(torch_ref.Decoder(cfg), adapters))
    shapes = {k: tuple(v.shape) for k, v in theirs.items()}
    assert {k: v.shape for k, v in state.items()} == shapes
    a = np.asarray(ours.blocks.layers.self_attn.lora_v.lora_a[...])  # [L, D, r]
    np.testing.assert_array_equal(
        state["blocks.layers.1.self_attn.in_proj.lora_A.default.v.weight"], a[1].T
    )
    other = make_model(cfg, seed=2, adapters=adapters)
    load_torch_adapter_state_dict(other, state)
    assert to_torch_adapter_state_dict(other).keys() == state.keys()
    assert all(np.array_equal(v, state[k]) for k, v in to_torch_adapter_state_dict(other).items())
    with pytest.raises(WeightMapError, match="missing"):
        load_torch_adapter_state_dict(other, dict(list(state.items())[1:]))

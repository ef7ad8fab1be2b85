"""The analytic memory of a LoRA / QLoRA job (``jaxmem.memory.analytic.adapter_state``): trainable
counts equal PEFT's on a Hugging Face Llama, a quantized matrix's bytes equal bitsandbytes' own
packed weights and statistics, the frozen base has no gradient and no optimizer state, and
``jaxmem memory`` reports the split, each figure labelled analytic."""

from __future__ import annotations

import json
import math

import pytest

from jaxmem import cli
from jaxmem.adapters import TARGETS, AdapterConfig
from jaxmem.config import PRESETS, OptimizerConfig
from jaxmem.figures import format_bytes
from jaxmem.memory import analytic
from jaxmem.parallel import ParallelConfig
from jaxmem.precision import PRECISIONS

ADAMW = OptimizerConfig()
BF16 = PRECISIONS["bf16"]  # fp32 parameters (and so adapters, gradients, moments)
PURE_BF16 = PRECISIONS["pure-bf16"]  # a bf16 checkpoint as QLoRA loads it

# Llama 3 8B's published shapes (config.json): hidden 4096, MLP 14336, 32 layers, 8 key/value
# heads of 128, vocabulary 128,256, untied head
D, F, KV, LAYERS, VOCAB = 4096, 14336, 1024, 32, 128256
PROJECTIONS_8B = {"q": (D, D), "k": (D, KV), "v": (D, KV), "o": (D, D), "gate": (D, F),
                  "up": (D, F), "down": (F, D)}  # fmt: skip


def lora_count(rank: int, targets, shapes=PROJECTIONS_8B, layers=LAYERS) -> int:
    """r·(in + out) per targeted projection per layer: A [in, r] and B [r, out]."""
    return layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def test_lora_on_llama_3_8b_trains_what_peft_prints():
    """PEFT's print_trainable_parameters for Llama-3-8B with its default targets (q_proj,
    v_proj) at r=8: 3,407,872 trainable; r=16: twice that; every projection at r=16: 41.9 M."""
    cfg = PRESETS["llama-3-8b"]
    state = analytic.adapter_state(cfg, AdapterConfig(rank=8), ADAMW, BF16)
    assert state.trainable_params == lora_count(8, ("q", "v")) == 3_407_872
    assert state.frozen_params == cfg.n_params == 8_030_261_248
    every = analytic.adapter_state(cfg, AdapterConfig(rank=16, targets=TARGETS), ADAMW, BF16)
    assert every.trainable_params == lora_count(16, TARGETS) == 41_943_040


def test_the_frozen_base_has_no_gradient_and_no_optimizer_state():
    """Gradients and AdamW's two moments for the adapters (and unfrozen norms) only, in the
    parameter dtype; ``model_state_bytes`` gives the same, divided by N where FSDP shards."""
    cfg = PRESETS["llama-3-8b"]
    lora = AdapterConfig(rank=16, base="nf4", train=("norm",))
    state = analytic.adapter_state(cfg, lora, ADAMW, BF16)
    norms = (2 * LAYERS + 1) * D  # RMSNorm: a scale per block norm and the final one
    assert state.norm_params == norms
    assert state.trainable_params == lora_count(16, ("q", "v")) + norms
    assert state.grads_bytes == state.trainable_bytes == 4 * state.trainable_params
    assert state.opt_state_bytes == 2 * 4 * state.trainable_params
    assert state.frozen_params == cfg.n_params - norms
    one = analytic.model_state_bytes(cfg, ADAMW, BF16, ParallelConfig(), adapters=lora)
    assert one == {
        "params": state.params_bytes,
        "grads": state.grads_bytes,
        "opt_state": state.opt_state_bytes,
    }
    fsdp8 = ParallelConfig(strategy="fsdp", devices=8)
    fsdp = analytic.model_state_bytes(cfg, ADAMW, BF16, fsdp8, adapters=lora)
    assert fsdp == {k: math.ceil(v / 8) for k, v in one.items()}
    full = analytic.model_state_bytes(cfg, ADAMW, BF16, ParallelConfig())
    assert full == analytic.model_state_bytes(
        cfg, ADAMW, BF16, ParallelConfig(), adapters=AdapterConfig()
    )


def nf4_matrix_bytes(n_in: int, n_out: int) -> int:
    """QLoRA's storage of one matrix, written out: 4 bits a weight, an 8-bit absmax per 64
    weights, an fp32 scale per 256 absmax values, an fp32 offset."""
    blocks = n_in * n_out // 64
    return n_in * n_out // 2 + blocks + 4 * math.ceil(blocks / 256) + 4


def test_a_qlora_llama_3_8b_base_is_its_published_5_7_gb():
    """nf4 block projections (6.98 B weights, 3.60 GB with their statistics) and bf16
    embeddings, head and norms (2.10 GB): 5.7 GB, the figure QLoRA guides give for an 8B base."""
    cfg = PRESETS["llama-3-8b"]
    state = analytic.adapter_state(cfg, AdapterConfig(rank=16, base="nf4"), ADAMW, PURE_BF16)
    quantized = LAYERS * sum(nf4_matrix_bytes(i, o) for i, o in PROJECTIONS_8B.values())
    other = 2 * (2 * VOCAB * D + (2 * LAYERS + 1) * D)
    assert (state.quantized_bytes, state.other_frozen_bytes) == (quantized, other)
    assert f"{(quantized + other) / 1e9:.1f}" == "5.7"
    int8 = analytic.adapter_state(cfg, AdapterConfig(rank=16, base="int8"), ADAMW, PURE_BF16)
    rows = LAYERS * sum(o for _, o in PROJECTIONS_8B.values())  # one fp32 absmax per row
    assert int8.quantized_bytes == state.quantized_params + 4 * rows


@pytest.mark.parametrize(("n_out", "n_in"), [(96, 128), (256, 128)])
def test_a_quantized_matrix_is_bitsandbytes_packed_weights_and_statistics(n_out, n_in):
    """bitsandbytes on a torch Linear's [out, in] weight: nf4 with double quantization (192 and
    512 blocks: one and two second-level scales) and row-wise int8."""
    pytest.importorskip(
        "bitsandbytes",
        reason="bitsandbytes: the adapters and dev extras (make test installs it)",
    )
    import bitsandbytes.functional as bnbf
    import torch

    weight = torch.randn(n_out, n_in, dtype=torch.bfloat16)
    packed, qs = bnbf.quantize_4bit(
        weight, blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    stats = qs.absmax.nbytes + qs.state2.absmax.nbytes + qs.offset.nbytes
    expected = analytic.frozen_matrix_bytes(n_in, n_out, "nf4", 2)
    assert packed.nbytes + stats == expected == nf4_matrix_bytes(n_in, n_out)
    # the two lookup tables each QuantState carries (NF4's 16 levels, the 8-bit map of the
    # absmax) are constants jaxmem keeps once: not in a matrix's bytes
    assert (qs.code.numel(), qs.state2.code.numel()) == (16, 256)
    rows, row_stats, _ = bnbf.int8_vectorwise_quant(weight.float())
    assert rows.nbytes + row_stats.nbytes == analytic.frozen_matrix_bytes(n_in, n_out, "int8", 2)


# jaxmem's tiny-llama as a Hugging Face config: the same shapes
TINY = PRESETS["tiny-llama"]
PEFT_CASES = [("q", "v"), ("q", "k", "v", "o"), TARGETS, ("gate", "down")]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_counts_are_pefts_on_a_tiny_hugging_face_llama():
    """transformers' LlamaForCausalLM with tiny-llama's shapes under ``get_peft_model``: the
    trainable and frozen parameters PEFT counts for several target sets (all seven included),
    and with the norms unfrozen; the matrices quantized are the linear layers Hugging Face's
    bitsandbytes integration converts (every one but the LM head)."""
    peft = pytest.importorskip(
        "peft",
        reason="peft: the adapters and dev extras (make test installs it)",
    )
    transformers = pytest.importorskip(
        "transformers", reason="transformers is in the dev extra (make test installs it)"
    )
    from transformers.quantizers.base import get_keys_to_not_convert

    def hf_llama():
        config = transformers.LlamaConfig(
            vocab_size=TINY.vocab_size,
            hidden_size=TINY.d_model,
            intermediate_size=TINY.d_ff,
            num_attention_heads=TINY.n_heads,
            num_key_value_heads=TINY.kv_heads,
            num_hidden_layers=TINY.n_layers,
            max_position_embeddings=TINY.max_seq_len,
            tie_word_embeddings=False,
        )
        return transformers.LlamaForCausalLM(config)

    base = hf_llama()
    skipped = get_keys_to_not_convert(base)
    linear = [m for n, m in base.named_modules() if type(m).__name__ == "Linear"]
    converted = [m for n, m in base.named_modules() if type(m).__name__ == "Linear"
                 and n not in skipped]  # fmt: skip
    assert skipped == ["lm_head"] and len(converted) == len(linear) - 1
    state = analytic.adapter_state(TINY, AdapterConfig(rank=4, base="nf4"), ADAMW, BF16)
    assert state.quantized_params == sum(m.weight.numel() for m in converted)
    for targets, train in [*((t, ()) for t in PEFT_CASES), (("q", "v"), ("norm",))]:
        lora = AdapterConfig(rank=4, alpha=8, targets=targets, train=train)
        model = peft.get_peft_model(
            hf_llama(),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=[f"{t}_proj" for t in targets]),
        )
        for name, param in model.named_parameters():
            if train and "norm" in name:
                param.requires_grad_(True)
        trainable, total = model.get_nb_trainable_parameters()
        state = analytic.adapter_state(TINY, lora, ADAMW, BF16)
        assert (state.trainable_params, state.frozen_params) == (trainable, total - trainable)


@pytest.mark.slow
def test_memory_reports_frozen_and_trainable_state_labelled_analytic(tmp_path, capsys, monkeypatch):
    """``jaxmem memory --set adapters.rank=...``: a table of the frozen base by storage, the
    trainable parameters, their gradients and optimizer state, each labelled analytic, and the
    same figures in every JSON record (tiny-llama with an MLP nf4's blocks divide)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    out = tmp_path / "m.json"
    args = ["memory", "--preset", "tiny-llama", "--d-ff", "192", "--policies", "none"]
    args += ["--frameworks", "jax", "--batch-size", "1", "--seq-len", "16", "--json", str(out)]
    lora = ["--set", "adapters.rank=4", "--set", "adapters.base=nf4"]
    assert cli.main([*args, *lora, "--set", "adapters.train=[norm]"]) == 0
    text = capsys.readouterr().out
    lora = AdapterConfig(rank=4, base="nf4", train=("norm",))
    state = analytic.adapter_state(TINY.replace(d_ff=192), lora, ADAMW, PRECISIONS["fp32"])
    (record,) = json.loads(out.read_text())
    got = record["adapter_state"]
    assert got["source"] == analytic.ADAPTER_SOURCE
    assert (got["frozen_params"], got["trainable_params"]) == (
        state.frozen_params,
        state.trainable_params,
    )
    assert (got["grads_bytes"], got["opt_state_bytes"]) == (
        state.grads_bytes,
        state.opt_state_bytes,
    )
    assert "adapter state (analytic): LoRA r4 a8 q,v, nf4 base, fp32, adamw" in text
    rows = {
        "frozen: nf4 block projections": state.quantized_params,
        "frozen: embeddings, head (float32)": state.other_frozen_params,
        "trainable: LoRA A, B": state.adapter_params,
        "trainable: norms": state.norm_params,
        "gradients (trainable only)": "-",
        "adamw state (trainable only)": "-",
    }
    for row, count in rows.items():
        cells = next(x for x in text.splitlines() if row in x).strip("│ ").split("│")
        assert cells[1].strip() == (count if count == "-" else f"{count:,}")
        assert cells[-1].strip() == "analytic"
    assert all(len(x) <= 100 for x in text.splitlines())


def test_train_weighs_a_lora_jobs_frozen_base_before_compiling(monkeypatch, capsys):
    """The resident check counts a LoRA job's state as stored (an nf4 base, gradients and AdamW
    state for the adapters only): the refusal names those bytes."""
    import jaxmem.train.run as run

    monkeypatch.setattr(run, "host_available_bytes", lambda: 2 * 2**30)
    lora = AdapterConfig(rank=16, base="nf4")
    args = ["train", "--preset", "gpt3-6.7b", "--steps", "1", "--set", "adapters.rank=16"]
    with pytest.raises(SystemExit) as exc:
        cli.main([*args, "--set", "adapters.base=nf4"])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    cfg, fp32 = PRESETS["gpt3-6.7b"], PRECISIONS["fp32"]
    state = analytic.adapter_state(cfg, lora, ADAMW, fp32)
    total = state.params_bytes + state.grads_bytes + state.opt_state_bytes
    assert f"alone need {format_bytes(total)} (analytic, fp32)" in line

"""How much activation memory does a Hugging Face Llama need for one training step, under each
checkpointing policy, at a GPU-scale batch? Measured on this machine, on fake tensors.

The model is built from a config on the ``meta`` device (random init, no download, no memory);
``torch_ref.module_memory.saved_activations`` runs one forward and loss on fake tensors
(``FakeTensorMode``) and reports what the backward will read, by op, and the matmul FLOPs of
forward + backward. The checkpoint units are the decoder layers, ``model.layers.*``, wrapped
from outside with stock ``torch.utils.checkpoint``.

On fake tensors Hugging Face takes the path it takes when tracing (``is_tracing``: it cannot
read the positions to rule out packed sequences), building a ``[B, 1, S, S]`` causal mask and
repeating k and v for grouped-query attention. An unpadded training batch in eager PyTorch
does neither: SDPA runs with ``is_causal=True`` and ``enable_gqa=True``. ``UNPADDED_SDPA``
registers that path under its own name, so the figures are those of the eager run.

    python examples/hf_torch_memory.py            # Llama 3.2 1B's shape, batch 8 x 4096, bf16
    python examples/hf_torch_memory.py --small    # a tiny shape: seconds
"""

from __future__ import annotations

import argparse

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from torch_ref.module_memory import MODES, CheckpointPlan, SavedActivations, saved_activations

# Llama 3.2 1B's shape (about 1.2 B parameters, tied embeddings)
LLAMA_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
}
SMALL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


# Hugging Face's SDPA attention with no mask: the causal mask is SDPA's own (is_causal), as in
# an eager step on an unpadded batch
UNPADDED_SDPA = "sdpa_unpadded"
AttentionInterface.register(UNPADDED_SDPA, sdpa_attention_forward)
AttentionMaskInterface.register(UNPADDED_SDPA, lambda *args, **kwargs: None)


def build_model(shape: dict, seq_len: int, dtype: torch.dtype) -> torch.nn.Module:
    """The model on the meta device: shapes and dtypes, no storage."""
    config = LlamaConfig(
        **shape,
        max_position_embeddings=seq_len,
        attn_implementation=UNPADDED_SDPA,
        use_cache=False,  # training keeps no KV cache (a checkpointed layer would replay it)
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(dtype)


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError


def flops(n: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f}"


def print_table(results: dict[str, SavedActivations]) -> None:
    none = results["none"]
    print(f"{'policy':<10} {'saved for backward':>18} {'fwd+bwd FLOPs':>14} {'recompute':>10}")
    print("-" * 55)
    for mode, r in results.items():
        recompute = flops(r.flops - none.flops)
        print(f"{mode:<10} {size(r.activation_bytes):>18} {flops(r.flops):>14} {recompute:>10}")
    print("\ntop ops by saved bytes")
    for mode, r in results.items():
        print(f"  {mode:<10} " + ", ".join(f"{op} {size(n)}" for op, n in r.top_ops(3)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny shape, batch 2 x 64")
    parser.add_argument("--batch", type=int, help="sequences per step (default 8; --small 2)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (4096; --small 64)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    batch = args.batch or (2 if args.small else 8)
    seq_len = args.seq_len or (64 if args.small else 4096)
    model = build_model(SMALL if args.small else LLAMA_1B, seq_len, getattr(torch, args.dtype))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"LlamaForCausalLM, {n_params / 1e6:.1f} M parameters in {args.dtype}, ", end="")
    print(f"batch {batch} x {seq_len}, on fake tensors\n")

    tokens = torch.empty(batch, seq_len, dtype=torch.long, device="meta")  # shapes only
    inputs = {"input_ids": tokens, "labels": tokens}  # the model returns its LM loss
    results = {}
    for mode in MODES:
        units = "model.layers.*" if mode != "none" else ()
        results[mode] = saved_activations(
            model, inputs, policy=CheckpointPlan(mode=mode, units=units)
        )
    print_table(results)
    print(f"\nsaved: {results['none'].source}\nFLOPs: {results['none'].flops_source}")


if __name__ == "__main__":
    main()

"""Text sampling from a torch_ref ``Decoder``: the same fixed-buffer sampling as
``jaxmem.model.generate`` (no KV cache)."""

from __future__ import annotations

import numpy as np
import torch

from jaxmem.data import PAD


def generate(
    model: torch.nn.Module, prompt: np.ndarray, n_new: int, *, temperature: float, seed: int
) -> np.ndarray:
    """``prompt`` followed by up to ``n_new`` sampled tokens (greedy at temperature 0), within the
    model's ``max_seq_len``."""
    cfg = model.cfg
    prompt = np.asarray(prompt, dtype=np.int64)[-(cfg.max_seq_len - 1) :]
    total = min(prompt.size + n_new, cfg.max_seq_len)
    device = next(model.parameters()).device
    buf = torch.full((1, total), PAD, dtype=torch.long, device=device)
    buf[0, : prompt.size] = torch.from_numpy(prompt)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for i in range(prompt.size, total):
            logits_v = model(buf)[0, i - 1].float()
            if temperature == 0.0:
                token = logits_v.argmax()
            else:
                probs = torch.softmax(logits_v / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=gen)[0]
            buf[0, i] = token
    return buf[0].cpu().numpy()

"""The seeds' PyTorch ``DecoderLayer``, verbatim but for formatting
(shared/seeds/000 and 003: one post-norm ReLU layer over ``nn.MultiheadAttention``).

Kept here as the outside reference torch_ref must match: its state dict must load into
``torch_ref.Block`` and ``jaxmem.model.Block`` and give the same outputs.
"""

from torch import nn


class DecoderLayer(nn.Module):
    def __init__(self, d_model=512, nhead=8):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead)
        self.ffn = nn.Sequential(
            nn.Linear(d_model, d_model * 4), nn.ReLU(), nn.Linear(d_model * 4, d_model)
        )
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x):
        x_attn = x.transpose(0, 1)
        attn_output, _ = self.self_attn(x_attn, x_attn, x_attn)
        attn_output = attn_output.transpose(0, 1)
        x = self.norm1(x + attn_output)
        ffn_output = self.ffn(x)
        x = self.norm2(x + ffn_output)
        return x

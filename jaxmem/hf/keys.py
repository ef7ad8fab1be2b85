"""The one key-and-shape map between jaxmem's parameter tree and the PyTorch names of the same
tensors (pure: numpy, no JAX, no PyTorch, no ``transformers``).

jaxmem's side is computed once, by ``param_shapes(cfg)``: every parameter of
``nnx.split(make_model(cfg), nnx.Param)``, its path and shape (block parameters stacked on a
leading layer axis). A naming then says what each parameter is called on the PyTorch side, in
the order its state dict lists it:

- ``"torch_ref"``: ``torch_ref.Decoder`` / ``BlockStack`` / ``Block`` (the keys of the seeds'
  ``DecoderLayer``: a fused ``self_attn.in_proj_weight``, ``ffn.0`` / ``ffn.2``), used by the
  comparison wing (``jaxmem.compare.weights``);
- ``"hf"``: Hugging Face's ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (Qwen2 and Mistral use
  Llama's names; ``jaxmem.hf.config.hf_model_type`` chooses), used by ``jaxmem.hf.files`` and
  ``jaxmem.model.hf``.

Each entry (``KeyMapEntry``) names the PyTorch key and shape, the jaxmem path, the index on the
stacked layer axis, whether it is transposed (PyTorch ``nn.Linear`` weights are ``[out, in]``,
Flax kernels and GPT-2's ``Conv1D`` weights ``[in, out]``) and which columns of the fused
``in_proj`` it fills (Llama's separate q, k, v projections, in that order). A row whose
parameter this config does not have (a bias) is left out, so the shapes and the presence of every
tensor come from ``param_shapes`` alone. RoPE uses Hugging Face's rotate-half layout, so Llama's
q/k weights map without permutation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from jaxmem.config import ModelConfig, require
from jaxmem.hf.config import hf_model_type

Path = tuple[str, ...]
NAMINGS = ("torch_ref", "hf")
SCOPES = ("decoder", "stack", "block")
_BLOCKS: Path = ("blocks", "layers")  # where a Decoder's stacked block parameters live


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyMapEntry:
    """One PyTorch tensor and where it lives in jaxmem's parameter tree."""

    key: str
    shape: tuple[int, ...]  # PyTorch's
    path: Path  # in jaxmem's parameter tree
    layer: int | None  # index on the stacked layer axis (None: not a stacked parameter)
    transpose: bool  # [out, in] (nn.Linear) into an [in, out] kernel
    columns: tuple[int, int] | None = None  # a slice of the parameter's last axis

    @property
    def param_shape(self) -> tuple[int, ...]:
        """The shape of this entry's part of the jaxmem parameter (layer axis removed)."""
        return tuple(reversed(self.shape)) if self.transpose else self.shape


def param_shapes(cfg: ModelConfig) -> dict[Path, tuple[int, ...]]:
    """Every parameter of jaxmem's model of ``cfg`` and its shape (block parameters with the
    leading layer axis)."""
    d, f, v, n = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    qkv = d + 2 * cfg.kv_dim
    block: dict[Path, tuple[int, ...]] = {
        ("self_attn", "in_proj", "kernel"): (d, qkv),
        ("self_attn", "out_proj", "kernel"): (d, d),
        ("ffn", "up", "kernel"): (d, f),
        ("ffn", "down", "kernel"): (f, d),
        ("norm1", "norm", "scale"): (d,),
        ("norm2", "norm", "scale"): (d,),
    }
    if cfg.mlp == "gated":
        block[("ffn", "gate", "kernel")] = (d, f)
    if cfg.has_bias("qkv"):
        block[("self_attn", "in_proj", "bias")] = (qkv,)
    if cfg.has_bias("out"):
        block[("self_attn", "out_proj", "bias")] = (d,)
    if cfg.has_bias("mlp"):
        block |= {("ffn", "up", "bias"): (f,), ("ffn", "down", "bias"): (d,)}
        if cfg.mlp == "gated":
            block[("ffn", "gate", "bias")] = (f,)
    if cfg.has_bias("norm"):
        block |= {("norm1", "norm", "bias"): (d,), ("norm2", "norm", "bias"): (d,)}
    out: dict[Path, tuple[int, ...]] = {("wte", "embedding"): (v, d)}
    if cfg.learned_positions:
        out[("wpe", "embedding")] = (cfg.max_seq_len, d)
    out |= {(*_BLOCKS, *p): (n, *s) for p, s in block.items()}
    if cfg.final_norm:
        out[("norm_f", "norm", "scale")] = (d,)
        if cfg.has_bias("norm"):
            out[("norm_f", "norm", "bias")] = (d,)
    if not cfg.tie_embeddings:
        out[("lm_head", "kernel")] = (d, v)
    return out


# ------------------------------------------------------------------------------------ namings
# (jaxmem path, PyTorch key, transposed, columns of the fused in_proj)
Row = tuple[Path, str, bool, "tuple[int, int] | None"]


@dataclasses.dataclass(frozen=True)
class _Naming:
    """One PyTorch model's names: the tensors before the blocks, one block's (keys relative to
    ``layer_prefix``), the tensors after the blocks, each list in the state dict's order."""

    before: list[Row]
    block: list[Row]
    after: list[Row]
    layer_prefix: str  # "blocks.layers.{i}." (format with i)


def _linear(path: Path, key: str, transpose: bool = True) -> list[Row]:
    """A linear layer's kernel and bias (``key.weight``, ``key.bias``)."""
    return [
        ((*path, "kernel"), f"{key}.weight", transpose, None),
        ((*path, "bias"), f"{key}.bias", False, None),
    ]


def _norm(name: str, key: str) -> list[Row]:
    """A norm's scale (``weight`` in PyTorch) and LayerNorm's bias."""
    return [
        ((name, "norm", "scale"), f"{key}.weight", False, None),
        ((name, "norm", "bias"), f"{key}.bias", False, None),
    ]


def _torch_ref(cfg: ModelConfig) -> _Naming:
    """torch_ref's names: the seeds' ``DecoderLayer`` for a block (the fused input projection
    stacks q, k and v rows in that order, as ``nn.MultiheadAttention``'s ``in_proj_weight``;
    the standard MLP is the seeds' ``nn.Sequential``, ``ffn.0`` up and ``ffn.2`` down)."""
    in_proj = ("self_attn", "in_proj")
    attn: list[Row] = [
        ((*in_proj, "kernel"), "self_attn.in_proj_weight", True, None),
        ((*in_proj, "bias"), "self_attn.in_proj_bias", False, None),
        *_linear(("self_attn", "out_proj"), "self_attn.out_proj"),
    ]
    if cfg.mlp == "gated":
        mlp = (("gate", "ffn.gate"), ("up", "ffn.up"), ("down", "ffn.down"))
    else:
        mlp = (("up", "ffn.0"), ("down", "ffn.2"))
    block = attn + [row for ours, key in mlp for row in _linear(("ffn", ours), key)]
    block += _norm("norm1", "norm1") + _norm("norm2", "norm2")
    after: list[Row] = [
        (("wte", "embedding"), "wte.weight", False, None),
        (("wpe", "embedding"), "wpe.weight", False, None),
        *_norm("norm_f", "norm_f"),
        (("lm_head", "kernel"), "lm_head.weight", True, None),
    ]
    return _Naming([], block, after, "blocks.layers.{i}.")


def _hf_gpt2() -> _Naming:
    """``GPT2LMHeadModel``: ``Conv1D`` weights are ``[in, out]`` already, like Flax kernels."""
    block = _norm("norm1", "ln_1") + _norm("norm2", "ln_2")
    for ours, key in (
        (("self_attn", "in_proj"), "attn.c_attn"),
        (("self_attn", "out_proj"), "attn.c_proj"),
        (("ffn", "up"), "mlp.c_fc"),
        (("ffn", "down"), "mlp.c_proj"),
    ):
        block += _linear(ours, key, transpose=False)
    before: list[Row] = [
        (("wte", "embedding"), "transformer.wte.weight", False, None),
        (("wpe", "embedding"), "transformer.wpe.weight", False, None),
    ]
    after = _norm("norm_f", "transformer.ln_f") + [
        (("lm_head", "kernel"), "lm_head.weight", True, None)
    ]
    return _Naming(before, block, after, "transformer.h.{i}.")


def _hf_llama(cfg: ModelConfig) -> _Naming:
    """``LlamaForCausalLM`` (and Qwen2's, Mistral's): q, k and v are separate projections,
    each a slice of the columns of jaxmem's fused ``in_proj``."""
    d, kv = cfg.d_model, cfg.kv_dim
    in_proj = ("self_attn", "in_proj")
    block: list[Row] = []
    for name, width, start in (("q", d, 0), ("k", kv, d), ("v", kv, d + kv)):
        cols = (start, start + width)
        block.append(((*in_proj, "kernel"), f"self_attn.{name}_proj.weight", True, cols))
        block.append(((*in_proj, "bias"), f"self_attn.{name}_proj.bias", False, cols))
    block += _linear(("self_attn", "out_proj"), "self_attn.o_proj")
    for name in ("gate", "up", "down"):
        block += _linear(("ffn", name), f"mlp.{name}_proj")
    block += [
        (("norm1", "norm", "scale"), "input_layernorm.weight", False, None),
        (("norm2", "norm", "scale"), "post_attention_layernorm.weight", False, None),
    ]
    before: list[Row] = [(("wte", "embedding"), "model.embed_tokens.weight", False, None)]
    after: list[Row] = [
        (("norm_f", "norm", "scale"), "model.norm.weight", False, None),
        (("lm_head", "kernel"), "lm_head.weight", True, None),
    ]
    return _Naming(before, block, after, "model.layers.{i}.")


def _naming(cfg: ModelConfig, names: str) -> _Naming:
    if names == "torch_ref":
        return _torch_ref(cfg)
    require(names == "hf", f"names={names!r} is not one of {', '.join(NAMINGS)}")
    return _hf_gpt2() if hf_model_type(cfg) == "gpt2" else _hf_llama(cfg)


# ------------------------------------------------------------------------------------ the map
def _entry(
    row: Row, shape: tuple[int, ...], *, key: str, path: Path, layer: int | None
) -> KeyMapEntry:
    """``row``'s entry for a parameter part of ``shape`` (layer axis removed)."""
    _, _, transpose, columns = row
    if columns is not None:
        shape = (*shape[:-1], columns[1] - columns[0])
    return KeyMapEntry(
        key=key,
        shape=tuple(reversed(shape)) if transpose else tuple(shape),
        path=path,
        layer=layer,
        transpose=transpose,
        columns=columns,
    )


def key_map(cfg: ModelConfig, names: str, scope: str = "decoder") -> list[KeyMapEntry]:
    """Every tensor of ``cfg``'s model under ``names`` (``"torch_ref"`` or ``"hf"``), in the
    PyTorch state dict's order.

    ``scope``: ``"decoder"`` (the whole model), ``"stack"`` (a ``BlockStack``: jaxmem paths
    ``layers.…``, keys ``layers.{i}.…``) or ``"block"`` (one unstacked ``Block``: no layer
    index, keys as in the seeds' ``DecoderLayer``); Hugging Face's names exist for the decoder
    only."""
    require(scope in SCOPES, f"scope={scope!r} is not one of {', '.join(map(repr, SCOPES))}")
    require(names == "torch_ref" or scope == "decoder", f"names={names!r} has no {scope} scope")
    naming = _naming(cfg, names)
    shapes = param_shapes(cfg)

    def top(rows: list[Row]) -> list[KeyMapEntry]:
        return [
            _entry(r, shapes[r[0]], key=r[1], path=r[0], layer=None) for r in rows if r[0] in shapes
        ]

    # one block's rows and the shape of each parameter in one layer
    block = [
        (r, shapes[(*_BLOCKS, *r[0])][1:]) for r in naming.block if (*_BLOCKS, *r[0]) in shapes
    ]
    if scope == "block":
        return [_entry(r, s, key=r[1], path=r[0], layer=None) for r, s in block]
    ours, prefix = (
        (_BLOCKS, naming.layer_prefix) if scope == "decoder" else (("layers",), "layers.{i}.")
    )
    layers = [
        _entry(r, s, key=prefix.format(i=i) + r[1], path=(*ours, *r[0]), layer=i)
        for i in range(cfg.n_layers)
        for r, s in block
    ]
    if scope == "stack":
        return layers
    return top(naming.before) + layers + top(naming.after)


def hf_tensors(params: Mapping[Path, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Hugging Face's tensors (key -> array, Hugging Face's layout) of a jaxmem parameter tree
    (flat: path -> array), every parameter mapped: the inverse of
    ``jaxmem.hf.files.read_params``."""
    shapes = param_shapes(cfg)
    given = {tuple(p): tuple(np.shape(v)) for p, v in params.items()}
    require(
        given == shapes,
        "the parameters are not this config's model: "
        + "; ".join(
            f"{'.'.join(p)} {given.get(p, 'absent')} vs {shapes.get(p, 'absent')}"
            for p in sorted(set(given) | set(shapes), key=str)
            if given.get(p) != shapes.get(p)
        )[:400],
    )
    out = {}
    for e in key_map(cfg, "hf"):
        value = np.asarray(params[e.path])
        value = value[e.layer] if e.layer is not None else value
        if e.columns is not None:
            value = value[..., slice(*e.columns)]
        value = value.T if e.transpose else value
        assert value.shape == e.shape, (e.key, value.shape, e.shape)
        out[e.key] = np.ascontiguousarray(value)
    return out

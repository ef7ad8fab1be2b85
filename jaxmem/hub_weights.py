"""Hugging Face checkpoints' tensors both ways, through one explicit key-and-shape map (pure:
numpy, no JAX, no PyTorch, no ``transformers``).

``key_map(cfg)`` names every Hugging Face tensor of a model: its key, its shape and where it
goes in jaxmem's parameter tree (``nnx.split(make_model(cfg), nnx.Param)``): the path, the
index on the stacked layer axis, whether it is transposed (PyTorch ``nn.Linear`` weights are
``[out, in]``, Flax kernels and GPT-2's ``Conv1D`` weights ``[in, out]``) and which columns of
the fused ``in_proj`` it fills (Llama's separate q, k, v projections: q, k, v in that order).
RoPE uses Hugging Face's rotate-half layout, so Llama's q/k weights load without permutation.

Reading (``inventory``, ``read_params``) asserts that every expected tensor is present exactly
once, with its shape, and refuses unexpected tensors by name; the non-parameter buffers older
checkpoints carry (GPT-2's ``attn.bias`` / ``attn.masked_bias`` masks, Llama's
``rotary_emb.inv_freq``) are ignored. Only safetensors files are read (``model.safetensors``
or the shards a ``model.safetensors.index.json`` lists); pickled ``.bin`` / ``.pt`` weights are
refused, never loaded. The safetensors format is read and written here (an 8-byte header
length, a JSON header, the raw little-endian tensors) so bfloat16 tensors need no framework.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from jaxmem.config import ConfigError, ModelConfig, require
from jaxmem.hub import hf_model_type

Path = tuple[str, ...]
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONVERT_HINT = (
    'convert with: python -c "from transformers import AutoModelForCausalLM as M; '
    "M.from_pretrained('DIR').save_pretrained('NEW_DIR')\" (writes model.safetensors)"
)
# buffers, not parameters: GPT-2's causal masks, Llama's RoPE frequencies (older checkpoints)
IGNORED = re.compile(
    r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$"
    r"|^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"
)
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "bfloat16"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HfTensor:
    """One Hugging Face tensor and where it lives in jaxmem's parameter tree."""

    key: str
    shape: tuple[int, ...]  # Hugging Face's
    path: Path  # in jaxmem's parameter tree
    layer: int | None  # index on the stacked layer axis (None: not a block parameter)
    transpose: bool  # [out, in] (nn.Linear) into an [in, out] kernel
    columns: tuple[int, int] | None = None  # a slice of the parameter's last axis


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
    out |= {("blocks", "layers", *p): (n, *s) for p, s in block.items()}
    if cfg.final_norm:
        out[("norm_f", "norm", "scale")] = (d,)
        if cfg.has_bias("norm"):
            out[("norm_f", "norm", "bias")] = (d,)
    if not cfg.tie_embeddings:
        out[("lm_head", "kernel")] = (d, v)
    return out


def key_map(cfg: ModelConfig) -> list[HfTensor]:
    """Every Hugging Face tensor of ``cfg``'s model (``hub.hf_model_type``: GPT-2's or
    Llama's key names; Qwen2 and Mistral use Llama's), in checkpoint order."""
    model_type = hf_model_type(cfg)
    gpt2 = model_type == "gpt2"
    d, f, kv = cfg.d_model, cfg.d_ff, cfg.kv_dim
    entries: list[HfTensor] = []

    def add(key, shape, path, layer=None, transpose=False, columns=None) -> None:
        entries.append(
            HfTensor(
                key=key,
                shape=tuple(shape),
                path=tuple(path),
                layer=layer,
                transpose=transpose,
                columns=columns,
            )
        )

    add(
        "transformer.wte.weight" if gpt2 else "model.embed_tokens.weight",
        (cfg.vocab_size, d),
        ("wte", "embedding"),
    )
    if gpt2:
        add("transformer.wpe.weight", (cfg.max_seq_len, d), ("wpe", "embedding"))
    for i in range(cfg.n_layers):
        blk = ("blocks", "layers")
        if gpt2:
            h = f"transformer.h.{i}"
            for name, path in (("ln_1", "norm1"), ("ln_2", "norm2")):
                add(f"{h}.{name}.weight", (d,), (*blk, path, "norm", "scale"), i)
                add(f"{h}.{name}.bias", (d,), (*blk, path, "norm", "bias"), i)
            # Conv1D weights are [in, out] already, like Flax kernels
            add(f"{h}.attn.c_attn.weight", (d, 3 * d), (*blk, "self_attn", "in_proj", "kernel"), i)
            add(f"{h}.attn.c_attn.bias", (3 * d,), (*blk, "self_attn", "in_proj", "bias"), i)
            add(f"{h}.attn.c_proj.weight", (d, d), (*blk, "self_attn", "out_proj", "kernel"), i)
            add(f"{h}.attn.c_proj.bias", (d,), (*blk, "self_attn", "out_proj", "bias"), i)
            add(f"{h}.mlp.c_fc.weight", (d, f), (*blk, "ffn", "up", "kernel"), i)
            add(f"{h}.mlp.c_fc.bias", (f,), (*blk, "ffn", "up", "bias"), i)
            add(f"{h}.mlp.c_proj.weight", (f, d), (*blk, "ffn", "down", "kernel"), i)
            add(f"{h}.mlp.c_proj.bias", (d,), (*blk, "ffn", "down", "bias"), i)
            continue
        h = f"model.layers.{i}"
        in_proj = (*blk, "self_attn", "in_proj")
        for name, width, start in (("q", d, 0), ("k", kv, d), ("v", kv, d + kv)):
            cols = (start, start + width)
            add(
                f"{h}.self_attn.{name}_proj.weight", (width, d), (*in_proj, "kernel"), i, True, cols
            )
            if cfg.has_bias("qkv"):
                add(f"{h}.self_attn.{name}_proj.bias", (width,), (*in_proj, "bias"), i, False, cols)
        add(
            f"{h}.self_attn.o_proj.weight",
            (d, d),
            (*blk, "self_attn", "out_proj", "kernel"),
            i,
            True,
        )
        if cfg.has_bias("out"):
            add(f"{h}.self_attn.o_proj.bias", (d,), (*blk, "self_attn", "out_proj", "bias"), i)
        for name, shape, ours in (
            ("gate", (f, d), "gate"),
            ("up", (f, d), "up"),
            ("down", (d, f), "down"),
        ):
            add(f"{h}.mlp.{name}_proj.weight", shape, (*blk, "ffn", ours, "kernel"), i, True)
            if cfg.has_bias("mlp"):
                add(f"{h}.mlp.{name}_proj.bias", shape[:1], (*blk, "ffn", ours, "bias"), i)
        add(f"{h}.input_layernorm.weight", (d,), (*blk, "norm1", "norm", "scale"), i)
        add(f"{h}.post_attention_layernorm.weight", (d,), (*blk, "norm2", "norm", "scale"), i)
    if gpt2:
        add("transformer.ln_f.weight", (d,), ("norm_f", "norm", "scale"))
        add("transformer.ln_f.bias", (d,), ("norm_f", "norm", "bias"))
    else:
        add("model.norm.weight", (d,), ("norm_f", "norm", "scale"))
    if not cfg.tie_embeddings:
        add("lm_head.weight", (cfg.vocab_size, d), ("lm_head", "kernel"), transpose=True)
    return entries


# ------------------------------------------------------------------------- safetensors files
@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor in a safetensors file: where its bytes are, and what they are."""

    file: str
    key: str  # as written in the file
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def read_header(path: str) -> dict[str, Stored]:
    """The tensors of safetensors file ``path`` (without reading their data), checked: every
    tensor's bytes lie inside the file and match its dtype and shape."""
    bad = f"{path} is not a valid safetensors file"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            require(len(head) == 8, f"{bad} (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", head)
            require(8 + length <= size, f"{bad} (its header runs past the end of the file)")
            header = json.loads(fh.read(length).decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"{bad} (its header is not JSON)") from None
    require(isinstance(header, dict), f"{bad} (its header is not a JSON object)")
    data_start, data_len = 8 + length, size - 8 - length
    out: dict[str, Stored] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape = info["dtype"], tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{bad} (tensor {key}'s entry is malformed)") from None
        require(0 <= begin <= end <= data_len, f"{bad} (tensor {key} lies outside the file)")
        itemsize = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(dtype)
        if itemsize is not None:
            require(
                end - begin == math.prod(shape) * itemsize,
                f"{bad} (tensor {key}: {end - begin} bytes for shape {list(shape)} {dtype})",
            )
        out[key] = Stored(path, key, dtype, shape, data_start + begin, end - begin)
    return out


def read_tensor(stored: Stored, dtype: Any) -> np.ndarray:
    """``stored``'s data as a numpy array of ``dtype`` (float64, float32, float16 or bfloat16;
    read through a memory map)."""
    if stored.dtype not in _DTYPES:
        raise ConfigError(
            f"tensor {stored.key} in {stored.file} has dtype {stored.dtype}; jaxmem loads float "
            f"weights ({', '.join(_DTYPES)}), not quantized ones: use an unquantized checkpoint"
        )
    source = np.dtype(_numpy_dtype(stored.dtype))
    if stored.nbytes == 0:
        return np.zeros(stored.shape, dtype)
    data = np.memmap(stored.file, dtype=source, mode="r", offset=stored.offset, shape=stored.shape)
    return np.asarray(data).astype(dtype)


def _numpy_dtype(name: str) -> Any:
    if name == "BF16":
        import ml_dtypes  # JAX's own dependency: numpy's bfloat16

        return ml_dtypes.bfloat16
    return _DTYPES[name]


def _safetensors_dtype(dtype: np.dtype) -> str:
    names = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
    require(dtype.name in names, f"dtype {dtype.name} cannot be written as a float tensor")
    return names[dtype.name]


def write_safetensors(
    path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` as a safetensors file at ``path`` (keys sorted, data little-endian
    and contiguous, the header padded to 8 bytes as the format asks)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = {}
    for key in sorted(tensors):
        array = np.ascontiguousarray(tensors[key])
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        header[key] = {
            "dtype": _safetensors_dtype(array.dtype),
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        arrays[key] = array
        offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for key in sorted(arrays):
            fh.write(arrays[key].tobytes())
        fh.flush()
        os.fsync(fh.fileno())


# ------------------------------------------------------------------------ checkpoint directory
def weight_files(directory: str) -> list[str]:
    """The safetensors files holding ``directory``'s weights: ``model.safetensors``, else the
    shards ``model.safetensors.index.json`` lists. Pickled weights are refused, never read."""
    single, index = os.path.join(directory, SINGLE_FILE), os.path.join(directory, INDEX_FILE)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
            files = sorted({str(v) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(
                f"{index} is not a safetensors index (a JSON object with a weight_map); fix or "
                "replace it"
            ) from None
        missing = [f for f in files if not os.path.isfile(os.path.join(directory, f))]
        require(not missing, f"{index} lists shard(s) {missing} that are not in {directory}")
        return [os.path.join(directory, f) for f in files]
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    require(
        not pickles,
        f"{directory} holds pickled weights ({', '.join(pickles)}): pickled weights are never "
        f"loaded: {CONVERT_HINT}",
    )
    raise ConfigError(
        f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}; give a directory save_pretrained "
        "wrote (safetensors weights)"
    )


def _shown(keys: Iterable[str], limit: int = 4) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def inventory(directory: str, cfg: ModelConfig) -> dict[str, Stored]:
    """``directory``'s tensors by the key map's names, every expected one present exactly once
    with its shape and nothing unexpected; otherwise a one-line ``ConfigError`` naming them."""
    entries = {e.key: e for e in key_map(cfg)}
    gpt2 = hf_model_type(cfg) == "gpt2"
    found: dict[str, list[Stored]] = {}
    for path in weight_files(directory):
        for key, stored in read_header(path).items():
            if IGNORED.match(key):
                continue
            # GPT-2 checkpoints are saved with or without the "transformer." prefix
            name = key
            if gpt2 and not key.startswith(("transformer.", "lm_head.")):
                name = "transformer." + key
            found.setdefault(name, []).append(stored)
    twice = {k: v for k, v in found.items() if len(v) > 1}
    require(
        not twice,
        f"{directory}: tensor(s) stored more than once: "
        + "; ".join(
            f"{k} as {' and '.join(f'{s.key} in {os.path.basename(s.file)}' for s in v)}"
            for k, v in sorted(twice.items())[:3]
        ),
    )
    unexpected = set(found) - set(entries)
    if "lm_head.weight" in unexpected and cfg.tie_embeddings:
        raise ConfigError(
            f"{directory} has lm_head.weight but its config.json ties the head to the embeddings "
            "(tie_word_embeddings=true); set it to false if the head is a matrix of its own"
        )
    require(
        not unexpected,
        f"{directory} has tensor(s) this model does not have: {_shown(unexpected)}; its "
        "config.json describes another architecture, or the checkpoint holds more than a "
        "causal LM",
    )
    missing = set(entries) - set(found)
    require(
        not missing, f"{directory} lacks tensor(s) {_shown(missing)} that its config.json needs"
    )
    wrong = [
        f"{k} is {list(found[k][0].shape)}, expected {list(e.shape)}"
        for k, e in entries.items()
        if found[k][0].shape != e.shape
    ]
    require(
        not wrong,
        f"{directory}: tensor shape(s) do not match config.json: {'; '.join(wrong[:3])}"
        + (f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""),
    )
    for (stored,) in found.values():
        if stored.dtype not in _DTYPES:
            read_tensor(stored, np.float32)  # raises, naming the dtype
    return {k: v[0] for k, v in found.items()}


def read_params(directory: str, cfg: ModelConfig, dtype: Any) -> dict[Path, np.ndarray]:
    """jaxmem's parameter tree (flat: path -> array of ``param_shapes(cfg)``) from the
    checkpoint in ``directory``, in ``dtype`` (the run's parameter dtype)."""
    stored = inventory(directory, cfg)
    shapes = param_shapes(cfg)
    out = {path: np.empty(shape, dtype) for path, shape in shapes.items()}
    filled = {path: np.zeros(shape, bool) for path, shape in shapes.items()}
    for e in key_map(cfg):
        value = read_tensor(stored[e.key], dtype)
        value = value.T if e.transpose else value
        where: tuple[Any, ...] = () if e.layer is None else (e.layer,)
        if e.columns is not None:
            where += (Ellipsis, slice(*e.columns))
        out[e.path][where] = value
        filled[e.path][where] = True
    gaps = [".".join(p) for p, f in filled.items() if not f.all()]
    assert not gaps, f"the key map leaves parameters unfilled: {gaps}"  # a bug in key_map
    return out


def hf_tensors(params: Mapping[Path, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Hugging Face's tensors (key -> array, Hugging Face's layout) of a jaxmem parameter tree
    (flat: path -> array), every parameter mapped: the inverse of ``read_params``."""
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
    for e in key_map(cfg):
        value = np.asarray(params[e.path])
        value = value[e.layer] if e.layer is not None else value
        if e.columns is not None:
            value = value[..., slice(*e.columns)]
        value = value.T if e.transpose else value
        assert value.shape == e.shape, (e.key, value.shape, e.shape)
        out[e.key] = np.ascontiguousarray(value)
    return out


# ----------------------------------------------------------------------------- a new directory
def check_new_dir(out_dir: str, flag: str = "--out") -> None:
    """``out_dir`` may receive a model directory: absent or empty, its parent writable."""
    require(
        not (os.path.exists(out_dir) and not os.path.isdir(out_dir)),
        f"{flag} {out_dir} is a file; give a new directory",
    )
    require(
        not (os.path.isdir(out_dir) and os.listdir(out_dir)),
        f"{flag} {out_dir} exists and is not empty; give a new directory",
    )
    parent = os.path.dirname(os.path.abspath(out_dir))
    require(os.path.isdir(parent), f"{flag} {out_dir}: directory {parent} does not exist")
    require(os.access(parent, os.W_OK), f"{flag} {out_dir}: directory {parent} is not writable")


def save_model_dir(
    out_dir: str,
    config_json: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    copy_from: str | None = None,
    files: Iterable[str] = (),
) -> list[str]:
    """Write a Hugging Face model directory: ``config.json``, ``model.safetensors`` and the
    ``files`` of ``copy_from`` that exist there (the tokenizer's). Everything is written into
    a temporary directory beside ``out_dir`` and renamed into place, so an error leaves
    nothing half-written. Returns the file names written."""
    import shutil
    import tempfile

    check_new_dir(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.", dir=parent)
    try:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(dict(config_json), fh, indent=2, sort_keys=True)
            fh.write("\n")
        write_safetensors(os.path.join(tmp, SINGLE_FILE), tensors)
        written = ["config.json", SINGLE_FILE]
        for name in files if copy_from else ():
            src = os.path.join(copy_from, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(tmp, name))
                written.append(name)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; a model is shared like a file
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked): rename cannot replace it on every system
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

"""Hugging Face checkpoints' files: a model directory's safetensors weights read into jaxmem's
parameter tree and written back, and a new model directory written whole or not at all (pure:
numpy, ``safetensors`` and, for bfloat16, ``ml_dtypes``; no JAX, no PyTorch, no
``transformers``).

Reading (``inventory``, ``read_params``) goes through the one key-and-shape map
(``jaxmem.hf.keys.key_map(cfg, "hf")``) and asserts that every expected tensor is present exactly
once, with its shape (``read_params``: and every value finite), and refuses unexpected tensors by
name; the non-parameter buffers older
checkpoints carry (GPT-2's ``attn.bias`` / ``attn.masked_bias`` masks, Llama's
``rotary_emb.inv_freq``) are ignored. Only safetensors files are read (``model.safetensors``
or the shards a ``model.safetensors.index.json`` lists); pickled ``.bin`` / ``.pt`` weights are
refused, never loaded. The files are read and written by the ``safetensors`` library
(``safe_open(framework="np")``, ``safetensors.numpy.save_file``), which checks a file's header
(offsets inside the file, byte counts matching dtype and shape) before any tensor is read;
bfloat16 arrays are numpy's through ``ml_dtypes`` (JAX's own dependency), imported when a
checkpoint holds one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from jaxmem.config import ConfigError, ModelConfig, require
from jaxmem.files import check_can_create, made_dirs
from jaxmem.hf.config import hf_model_type
from jaxmem.hf.keys import Path, key_map, param_shapes

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
# the float dtypes jaxmem loads, by safetensors' name and numpy's
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


# ------------------------------------------------------------------------- safetensors files
@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor in a safetensors file, as its header describes it."""

    file: str
    key: str  # as written in the file
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]


def _safe_open(path: str) -> Any:
    """``path`` opened by ``safetensors.safe_open`` (numpy arrays), its header checked; a
    one-line ``ConfigError`` when it cannot be read or is not a safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="np")
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except SafetensorError as e:
        raise ConfigError(f"{path} is not a valid safetensors file ({_first_line(e)})") from None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def read_header(path: str) -> dict[str, Stored]:
    """The tensors of safetensors file ``path`` (without reading their data), checked by
    ``safetensors``: every tensor's bytes lie inside the file and match its dtype and shape."""
    with _safe_open(path) as f:
        out = {}
        for key in f.keys():
            info = f.get_slice(key)
            out[key] = Stored(path, key, info.get_dtype(), tuple(info.get_shape()))
    return out


def _check_float(stored: Stored) -> None:
    if stored.dtype not in FLOAT_DTYPES:
        raise ConfigError(
            f"tensor {stored.key} in {stored.file} has dtype {stored.dtype}; jaxmem loads float "
            f"weights ({', '.join(FLOAT_DTYPES)}), not quantized ones: use an unquantized "
            "checkpoint"
        )
    if stored.dtype == "BF16":
        import ml_dtypes  # noqa: F401  (numpy's bfloat16, which safetensors' numpy arrays use)


def read_tensor(stored: Stored, dtype: Any) -> np.ndarray:
    """``stored``'s data as a numpy array of ``dtype`` (float64, float32, float16 or bfloat16).
    The file is opened (memory-mapped) for this tensor alone: a file held open while every tensor
    is read keeps all its pages resident, about one file size more peak memory."""
    _check_float(stored)
    with _safe_open(stored.file) as f:
        return f.get_tensor(stored.key).astype(dtype, copy=False)


def write_safetensors(
    path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (float arrays) as a safetensors file at ``path`` with
    ``safetensors.numpy.save_file``, flushed to disk before it returns."""
    from safetensors.numpy import save_file

    arrays = {}
    for key, value in tensors.items():
        array = np.ascontiguousarray(value)
        require(
            array.dtype.name in FLOAT_DTYPES.values(),
            f"dtype {array.dtype.name} cannot be written as a float tensor",
        )
        arrays[key] = array
    save_file(arrays, path, metadata=dict(metadata or {"format": "pt"}))
    with open(path, "rb") as fh:
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
    entries = {e.key: e for e in key_map(cfg, "hf")}
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
        _check_float(stored)  # raises, naming the dtype
    return {k: v[0] for k, v in found.items()}


def read_params(directory: str, cfg: ModelConfig, dtype: Any) -> dict[Path, np.ndarray]:
    """jaxmem's parameter tree (flat: path -> array of ``param_shapes(cfg)``) from the
    checkpoint in ``directory``, in ``dtype`` (the run's parameter dtype)."""
    stored = inventory(directory, cfg)
    shapes = param_shapes(cfg)
    out = {path: np.empty(shape, dtype) for path, shape in shapes.items()}
    filled = {path: np.zeros(shape, bool) for path, shape in shapes.items()}
    for e in key_map(cfg, "hf"):
        value = read_tensor(stored[e.key], dtype)
        _check_finite(stored[e.key], value)
        value = value.T if e.transpose else value
        where: tuple[Any, ...] = () if e.layer is None else (e.layer,)
        if e.columns is not None:
            where += (Ellipsis, slice(*e.columns))
        out[e.path][where] = value
        filled[e.path][where] = True
    gaps = [".".join(p) for p, f in filled.items() if not f.all()]
    assert not gaps, f"the key map leaves parameters unfilled: {gaps}"  # a bug in key_map
    return out


def _check_finite(stored: Stored, value: np.ndarray) -> None:
    """Refuse a tensor holding nan or inf (as stored, or once converted to the run's dtype): a
    model started from it computes nan at its first step."""
    finite = np.isfinite(value)
    if finite.all():
        return
    bad = value.size - int(np.count_nonzero(finite))
    raise ConfigError(
        f"tensor {stored.key} in {stored.file} holds {bad:,} non-finite value(s) (nan or inf, "
        f"as {value.dtype.name}) of {value.size:,}: a model started from it computes nan; use a "
        "checkpoint whose weights are finite"
    )


# ----------------------------------------------------------------------------- a new directory
def check_new_dir(out_dir: str, flag: str = "--out") -> None:
    """``out_dir`` may receive a model directory: absent or empty, and makeable where it is
    (the directories missing above it are made when it is written)."""
    require(
        not (os.path.isdir(out_dir) and os.listdir(out_dir)),
        f"{flag} {out_dir} exists and is not empty; give a new directory",
    )
    check_can_create(out_dir, flag)


def save_model_dir(
    out_dir: str,
    config_json: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    copy_from: str | None = None,
    files: Iterable[str] = (),
    names: tuple[str, str] = ("config.json", SINGLE_FILE),
) -> list[str]:
    """Write a Hugging Face model directory: ``config.json``, ``model.safetensors`` (or the
    two ``names``: a PEFT adapter's) and the ``files`` of ``copy_from`` that exist there (the
    tokenizer's). Everything is written into
    a temporary directory beside ``out_dir`` and renamed into place, so an error leaves
    nothing half-written. Returns the file names written."""
    import shutil
    import tempfile

    check_new_dir(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    with made_dirs(parent):  # the directories missing above out_dir: removed again on failure
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.", dir=parent)
        try:
            with open(os.path.join(tmp, names[0]), "w", encoding="utf-8") as fh:
                json.dump(dict(config_json), fh, indent=2, sort_keys=True)
                fh.write("\n")
            write_safetensors(os.path.join(tmp, names[1]), tensors)
            written = list(names)
            for name in files if copy_from else ():
                src = os.path.join(copy_from, name)
                if os.path.isfile(src):
                    shutil.copyfile(src, os.path.join(tmp, name))
                    written.append(name)
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; shared like a file
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

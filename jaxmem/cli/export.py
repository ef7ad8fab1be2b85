"""``jaxmem export RUN_DIR --out HF_DIR``: the newest verified checkpoint of a training run as a
Hugging Face model directory (``config.json`` + ``model.safetensors``) that
``transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)`` loads; the tokenizer files come
along when the run started from a model directory that had them. A run that trained LoRA
adapters gives a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``), or with ``--merge`` the base with the adapters merged in."""

from __future__ import annotations

import argparse
import os

from jaxmem.cli.common import UsageError, need_jax_backend, need_torch, usage_errors


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="a run's newest verified checkpoint as a Hugging Face model directory",
        description="Write the newest checkpoint of RUN_DIR that verifies (either framework's) "
        "as a Hugging Face model directory: config.json (gpt2, llama or qwen2, whichever "
        "computes the run's model) and model.safetensors in the run's parameter dtype, plus "
        "the tokenizer files of the model directory the run started from (--init-from or "
        "--preset DIR), if it had them (a run on raw bytes has none: the output says how to "
        "encode). --out must be new or empty, its missing parents are made; it is written whole "
        "or not at all. A run that trained LoRA adapters (--lora-rank) gives a PEFT adapter "
        "directory instead (adapter_config.json, adapter_model.safetensors), or with --merge "
        "its merged weights (W + scale·B·A) as a model directory; a run on a packed base "
        "(--quantize-base) merges onto the dequantized base. Bad input exits with code 2 "
        "and writes nothing.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (jaxmem train --out)")
    p.add_argument("--out", required=True, metavar="HF_DIR", help="the new model directory")
    p.add_argument(
        "--merge",
        action="store_true",
        help="an adapter run: write the base with its adapters merged in (W + scale·B·A) as a "
        "model directory, not a PEFT adapter directory",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxmem.hf.config import hf_model_type
    from jaxmem.hf.files import check_new_dir
    from jaxmem.hf.tokenizer import has_tokenizer
    from jaxmem.job import JobConfig
    from jaxmem.run_layout import CHECKPOINT_DIR, CheckpointError

    run_dir = args.run_dir
    if not os.path.isdir(os.path.join(run_dir, CHECKPOINT_DIR)):
        raise UsageError(
            f"{run_dir} is not a run directory with checkpoints (no {CHECKPOINT_DIR}/); give "
            "the --out of a jaxmem train run"
        )
    with usage_errors():
        check_new_dir(args.out)
    need_jax_backend()
    from jaxmem.backend import quiet_native_stderr
    from jaxmem.train.checkpoint import latest_checkpoint

    with usage_errors(CheckpointError), quiet_native_stderr():
        step, saved, skipped = latest_checkpoint(run_dir)
    if step is None or saved is None:
        why = "; ".join(f"{s}: {r}" for s, r in skipped)
        raise UsageError(
            f"{run_dir} holds no checkpoint that verifies" + (f" ({why})" if why else "")
        )
    with usage_errors():
        job = JobConfig.from_dict(saved)
        model_type = hf_model_type(job.model)
    if args.merge and not job.adapters.enabled:
        raise UsageError(
            f"--merge: {run_dir} trained no adapters (full fine-tuning): there is nothing to "
            "merge, its export is the full weights; drop --merge"
        )
    if job.adapters.enabled and not args.merge:
        return _export_adapters(args, run_dir, step, job)
    params = _params(run_dir, step, job, dense=True)
    if job.adapters.enabled and job.run.framework == "jax":  # torch's come merged
        import numpy as np

        from jaxmem.hf.adapters import merged_params

        arrays = _flat(params)
        dtype = arrays[("wte", "embedding")].dtype  # the base's (packed kernels: float32)
        params = merged_params(arrays, job.model, job.adapters, dtype)
        # a packed base's untargeted kernels: float32 dequantized values, rounded once
        params = {p: np.asarray(v).astype(dtype, copy=False) for p, v in params.items()}
    from jaxmem.model.hf import export_hf
    from jaxmem.train.prepare import model_dir

    source = model_dir(job)
    note = ""
    if source is not None and not os.path.isdir(source):
        note = f"; {source}, where the run started, is gone: no tokenizer files copied"
        source = None
    with usage_errors():
        written = export_hf(params, job.model, args.out, tokenizer_from=source)
    skipped_text = f" (skipped newer: {', '.join(str(s) for s, _ in skipped)})" if skipped else ""
    print(
        f"wrote {args.out}/: {', '.join(written)} ({model_type}, step {step} of {run_dir}"
        f"{skipped_text}, {job.run.framework} run{note}{_packed_note(job)}); load it with "
        f"transformers.AutoModelForCausalLM.from_pretrained({args.out!r})"
    )
    if not note and not has_tokenizer(source):
        print(no_tokenizer_note(args.out, job, source))
    return 0


def _export_adapters(args: argparse.Namespace, run_dir: str, step: int, job) -> int:
    """The adapters of a JAX LoRA run as a PEFT adapter directory."""
    from jaxmem.hf.adapters import (
        ADAPTER_CONFIG,
        ADAPTER_FILE,
        check_exportable,
        peft_config,
        peft_tensors,
    )
    from jaxmem.hf.files import save_model_dir
    from jaxmem.train.prepare import model_dir

    with usage_errors():
        check_exportable(job.model)
    if job.run.framework == "torch":
        raise UsageError(
            f"{run_dir} is a --framework torch adapter run: its adapters export merged only "
            "(jaxmem export --merge); a PEFT adapter directory comes from a jax run"
        )
    arrays = _flat(_params(run_dir, step, job))
    dtype = arrays[("wte", "embedding")].dtype  # the base's
    tensors = {k: v.astype(dtype) for k, v in peft_tensors(arrays, job.model, job.adapters).items()}
    base = model_dir(job)
    config = peft_config(job.adapters, base)
    with usage_errors():
        written = save_model_dir(args.out, config, tensors, names=(ADAPTER_CONFIG, ADAPTER_FILE))
    base_text = repr(base) if base is not None else "a model directory of the base (jaxmem export)"
    print(
        f"wrote {args.out}/: {', '.join(written)} (PEFT LoRA, {job.adapters.label()}, "
        f"{dtype.name}, step {step} of {run_dir}); load it with peft.PeftModel.from_pretrained("
        f"transformers.AutoModelForCausalLM.from_pretrained({base_text}), {args.out!r})"
    )
    if job.adapters.base != "compute":
        print(
            f"trained on the {job.adapters.base}-packed base: on the unpacked base the logits "
            "differ by the quantization error; load the base quantized as bitsandbytes packs "
            f"{job.adapters.base} ({_BNB[job.adapters.base]}) to compute as trained"
        )
    return 0


def no_tokenizer_note(out: str, job, source: str | None) -> str:
    """What a user loading an export without tokenizer files must know: how the run's ids were
    made. Raw bytes only where its data says so (text, the embedded corpus, or a ``.bin`` whose
    ``meta.json`` names the byte tokenizer); otherwise the tokenizer the data names, or none."""
    from jaxmem.data import BOS, EOS, PAD, data_tokenizer

    why = "its model is a named preset" if source is None else f"{source} has no tokenizer.json"
    made_with = data_tokenizer(job.data.path)
    if made_with == "bytes":
        return (
            f"no tokenizer in {out}/: the run read raw bytes ({why}), so AutoTokenizer finds "
            f"none; its ids are the UTF-8 bytes of the text (0-255; {BOS}, {EOS}, {PAD}: BOS, "
            "EOS, PAD): encode with list(text.encode()), decode with "
            "bytes(i for i in ids if i < 256).decode()"
        )
    data = f"its data {job.data.path}"
    if made_with is not None:
        how = f"{data} was tokenized with {made_with} (its meta.json): encode with that tokenizer"
    elif not os.path.exists(job.data.path):
        how = f"{data} is gone, so how its ids were made is not known here"
    else:
        how = (
            f"{data} was tokenized outside jaxmem (no meta.json names a tokenizer): encode "
            "with the tokenizer that made it"
        )
    return f"no tokenizer copied to {out}/ ({why}, so there was none to copy); {how}"


_BNB = {
    "nf4": "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
    "bnb_4bit_use_double_quant=True)",
    "int8": "BitsAndBytesConfig(load_in_8bit=True)",
}


def _packed_note(job) -> str:
    """What the merged export of a packed-base run is (empty for any other export)."""
    if not job.adapters.enabled or job.adapters.base == "compute":
        return ""
    return (
        f"; merged onto the dequantized {job.adapters.base} base, W + scale·B·A with W the "
        "packed weights' values: they differ from the original base by the quantization error"
    )


def _flat(params) -> dict:
    """``path -> numpy array`` of ``_params``'s answer (an ``nnx.State`` or that already)."""
    from jaxmem.model.hf import all_arrays

    return params if isinstance(params, dict) else all_arrays(params)


def _params(run_dir: str, step: int, job, *, dense: bool = False):
    """The checkpoint's parameters as an ``nnx.State`` of the run's model; a jax run's packed
    base (``--quantize-base``) stays packed, or with ``dense`` comes as ``path -> array`` with
    each packed projection's dequantized kernel (``jaxmem.model.qbase.dense_arrays``)."""
    from jaxmem.config import ConfigError
    from jaxmem.run_layout import CheckpointError

    if job.run.framework == "torch":
        need_torch("jaxmem export of a --framework torch run")
        from jaxmem.compare.torch_run import restored_model

        with usage_errors(CheckpointError):
            return restored_model(run_dir, step, job)
    from flax import nnx

    from jaxmem.model import make_model
    from jaxmem.run_layout import CHECKPOINT_DIR
    from jaxmem.train.checkpoint import restore_params

    packed = job.adapters.base != "compute"
    if packed:  # the checkpoint holds the packed arrays: their shapes, nothing quantized
        from jaxmem.model.qbase import dense_arrays, quantize_base

        model = nnx.eval_shape(lambda: make_model(job.model, job.precision, adapters=job.adapters))
        quantize_base(model, job.adapters.base)
    else:
        model = make_model(job.model, job.precision, adapters=job.adapters)
    like = nnx.split(model, nnx.Param)[1]
    try:
        params = restore_params(os.path.join(run_dir, CHECKPOINT_DIR), step, like)
    except (CheckpointError, ConfigError) as e:
        raise UsageError(str(e)) from None
    if not (packed and dense):
        return params
    nnx.update(model, params)
    return dense_arrays(model)

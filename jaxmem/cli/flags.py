"""The flags that describe a training step, declared once, and the one way every command turns
them into a ``JobConfig`` (``jaxmem.job.resolve_job``: the command's defaults < the preset <
``--config`` < flags < ``--set``).

Each step flag names the setting it overrides (a dotted path of ``JobConfig.to_dict()``); a
flag not given is ``None`` and leaves the layers below it alone. A command lists the flags it
takes and its own defaults; its ``--help`` shows them."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxmem.adapters import BASES, TRAINABLE_GROUPS
from jaxmem.adapters import TARGETS as ADAPTER_TARGETS
from jaxmem.cli.common import (
    non_negative_int,
    positive_float,
    positive_int,
    seed,
    usage_errors,
)
from jaxmem.config import ATTENTIONS, MEMORY_KINDS, OPTIMIZERS, PRESETS, SCHEDULES, ModelConfig
from jaxmem.memory.targets import SHIPPED
from jaxmem.parallel import CP_ATTENTIONS, ParallelConfig
from jaxmem.policy import POLICIES
from jaxmem.precision import PRECISIONS


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag: where its value goes in the job config, and its help."""

    option: str
    path: str | None  # dotted path in JobConfig.to_dict(); None: read by the command itself
    help: str
    type: Callable[[str], Any] | None = None
    action: str | None = None
    metavar: str | None = None


TARGETS_HELP = (
    f"cpu (this machine's backend), {', '.join(SHIPPED)} (compiled without a GPU; needs "
    "jaxmem[gpu-plan]) or a captured .txtpb target file"
)

FLAGS: dict[str, Flag] = {
    f.option.lstrip("-").replace("-", "_"): f
    for f in (
        Flag(
            "--preset",
            "preset",
            f"model preset: {', '.join(PRESETS)} (jaxmem presets), or a Hugging Face model "
            "directory (its config.json)",
        ),
        Flag(
            "--config",
            None,
            "TOML, YAML or JSON file of settings, sections as in a run's config.yaml",
            metavar="FILE",
        ),
        Flag(
            "--set",
            None,
            "any setting, e.g. --set model.norm=post --set optimizer.b2=0.95 (repeatable)",
            action="append",
            metavar="SECTION.KEY=VALUE",
        ),
        Flag("--n-layers", "model.n_layers", "the preset's layer count, overridden", positive_int),
        Flag("--d-model", "model.d_model", "the preset's width, overridden", positive_int),
        Flag("--n-heads", "model.n_heads", "the preset's heads, overridden", positive_int),
        Flag("--d-ff", "model.d_ff", "the preset's MLP width, overridden", positive_int),
        Flag(
            "--attention",
            "model.attention",
            f"the attention core: {' or '.join(ATTENTIONS)} (FlashAttention's algorithm)",
        ),
        Flag(
            "--policy",
            "memory.policy",
            f"memory policy: a preset ({', '.join(POLICIES)}), HEAD:K+REST (e.g. "
            "none:2+selective: the first K blocks under HEAD, the rest under REST) or custom "
            "(with --save/--offload)",
        ),
        Flag("--save", "memory.save", "custom policy: tags kept on the device, comma-separated"),
        Flag("--offload", "memory.offload", "custom policy: tags sent to host, comma-separated"),
        Flag(
            "--unroll",
            "memory.unroll",
            "run the blocks unrolled instead of under one scan (JAX; frees each block's "
            "residuals after its backward; compiles slower; XLA:CPU drops remat when unrolled)",
            action="store_const",
        ),
        Flag(
            "--replay-embedding",
            "memory.replay_embedding",
            "the first block keeps no input: its backward replays the embedding lookup (a "
            "gather, no matmul) instead; needs the first block rematerialised",
            action="store_const",
        ),
        Flag(
            "--loss-chunks",
            "memory.loss_chunks",
            "run the LM head and loss over N sequence chunks, each chunk's gradients formed in "
            "the forward: no [B, S, vocab] logits kept for the backward, no FLOP recomputed "
            "(0: the whole logits, kept; default)",
            int,
            metavar="N",
        ),
        Flag(
            "--loss-tile-tokens",
            "memory.loss_tile_tokens",
            "--loss-chunks by token count: the LM head and loss over chunks of T tokens "
            "(seq_len / T chunks; T divides --seq-len)",
            int,
            metavar="T",
        ),
        Flag(
            "--mlp-tile-tokens",
            "memory.mlp_tile_tokens",
            "run each block's MLP over sequence tiles of T tokens, each in its own checkpoint: "
            "one tile's [B, T, d_ff] intermediates at a time, same FLOPs (T divides --seq-len; "
            "0: untiled, default)",
            int,
            metavar="T",
        ),
        Flag("--precision", "precision", f"one of {', '.join(PRECISIONS)}"),
        Flag("--optimizer", "optimizer.name", f"one of {', '.join(OPTIMIZERS)}"),
        Flag("--lr", "optimizer.lr", "learning rate", positive_float),
        Flag("--weight-decay", "optimizer.weight_decay", "AdamW/SGD weight decay", float),
        Flag(
            "--schedule",
            "optimizer.schedule",
            f"learning rate after the warmup: {', '.join(SCHEDULES)} (decay to --min-lr at "
            "--decay-steps)",
        ),
        Flag(
            "--warmup-steps",
            "optimizer.warmup_steps",
            "steps of linear warmup from 0 to --lr",
            non_negative_int,
            metavar="N",
        ),
        Flag(
            "--decay-steps",
            "optimizer.decay_steps",
            "the schedule's length, warmup included (default: --steps, kept in the run's "
            "config for --resume)",
            positive_int,
            metavar="N",
        ),
        Flag("--min-lr", "optimizer.min_lr", "the decay's final learning rate", float),
        Flag(
            "--clip-norm",
            "optimizer.clip_norm",
            "clip the gradient to this global L2 norm before the update (0: off)",
            float,
            metavar="NORM",
        ),
        Flag(
            "--state-memory",
            "optimizer.state_memory",
            f"where the optimizer state lives between steps: {' or '.join(MEMORY_KINDS)}",
        ),
        Flag(
            "--stream",
            "optimizer.stream",
            "keep the block stack's parameters and optimizer state in host memory and stream "
            "them through the step block by block (adamw or sgd; torch: FSDP2's "
            "CPUOffloadPolicy)",
            action="store_const",
        ),
        Flag(
            "--stream-update",
            "optimizer.stream_update",
            "with --stream, where the stack's update runs: device (block by block; JAX's "
            "default) or host (in host memory: only parameters and gradients cross the link)",
        ),
        Flag("--accum", "accum.steps", "microbatches per step", positive_int),
        Flag("--accum-mode", "accum.mode", "accumulation: scan or multisteps (optax.MultiSteps)"),
        Flag("--batch-size", "run.batch_size", "rows per step (the global batch)", positive_int),
        Flag("--seq-len", "run.seq_len", "tokens per row", positive_int),
        Flag("--seed", "run.seed", "weights and data order", seed),
        Flag(
            "--mesh",
            "parallel",
            "devices, STRATEGY=N[,tp=M|cp=M]: dp=4 (replicated), zero1=4 (optimizer state "
            "sharded), fsdp=4 (parameters, gradients and state sharded), and tp=M Megatron tensor "
            "parallelism on a second axis (fsdp=2,tp=2: 4 devices; tp=2 alone) or cp=M context "
            "parallelism (each sequence split over M devices; fsdp=2,cp=2, cp=2 alone)",
        ),
        Flag(
            "--cp-attention",
            "parallel.cp_attention",
            "with a cp axis, how attention meets the other devices' keys: "
            + "; ".join(f"{k} ({v})" for k, v in CP_ATTENTIONS.items()),
        ),
        Flag("--target", None, f"plan the step for: {TARGETS_HELP}"),
        Flag("--wide", None, "every column (default: the essential ones)", action="store_true"),
        Flag("--json", None, "write the results as JSON", metavar="OUT.json"),
        Flag(
            "--host-memory",
            None,
            "host memory one host gives the step (offloaded activations, host-resident "
            "optimizer state, a streamed stack), shared by the mesh's devices on it (up to 8), "
            "e.g. 512GiB (default: this machine's RAM, from the OS)",
            metavar="SIZE",
        ),
        # the run around the step (jaxmem train)
        Flag("--framework", "run.framework", "jax or torch (torch_ref, the PyTorch mirror)"),
        Flag(
            "--data",
            "data.path",
            "text file, directory of text, or nanoGPT .bin / directory with train.bin",
        ),
        Flag("--steps", "run.steps", "optimizer steps in total", positive_int),
        Flag("--eval-every", "run.eval_every", "validation every so many steps", positive_int),
        Flag("--checkpoint-every", "run.checkpoint_every", "checkpoint cadence", positive_int),
        Flag("--keep", "run.keep_checkpoints", "checkpoints kept", positive_int),
        Flag("--sample-tokens", "run.sample_tokens", "text sample at the end (0: none)", int),
        Flag("--prompt", "run.prompt", "the sample's prompt"),
        Flag(
            "--init-from",
            "run.init_from",
            "start from a Hugging Face model directory's weights (safetensors), loaded before "
            "step 1; its config.json is the model unless --preset says otherwise and agrees; its "
            "tokenizer.json, if any, tokenizes text --data and the sample",
            metavar="DIR",
        ),
        # adapters on a frozen base (docs/adapters.md)
        Flag(
            "--lora-rank",
            "adapters.rank",
            "train LoRA adapters of this rank on a frozen base (0: every parameter trains)",
            non_negative_int,
            metavar="R",
        ),
        Flag(
            "--lora-alpha",
            "adapters.alpha",
            "the adapters' alpha: their product is scaled by alpha / rank",
            positive_float,
            metavar="A",
        ),
        Flag(
            "--lora-targets",
            "adapters.targets",
            f"projections given adapters, comma-separated from {','.join(ADAPTER_TARGETS)}",
            metavar="LIST",
        ),
        Flag(
            "--lora-dropout",
            "adapters.dropout",
            "dropout on the adapters' input",
            float,
            metavar="P",
        ),
        Flag(
            "--lora-rslora",
            "adapters.rslora",
            "scale the adapters by alpha / sqrt(rank) (rsLoRA)",
            action="store_const",
        ),
        Flag(
            "--quantize-base",
            "adapters.base",
            f"the frozen base's storage: {' or '.join(BASES)}",
        ),
        Flag(
            "--lora-train",
            "adapters.train",
            f"parameter groups trained beside the adapters: {','.join(TRAINABLE_GROUPS)}",
            metavar="LIST",
        ),
    )
}

# What most step commands take (train adds its run flags).
MODEL_FLAGS = ("preset", "config", "set", "n_layers", "d_model", "n_heads", "d_ff", "attention")
# LoRA adapters on a frozen base (every step command builds them through ``StepSpec``)
ADAPTER_FLAGS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "lora_rslora")
ADAPTER_FLAGS += ("quantize_base", "lora_train")
STEP_FLAGS = (
    *MODEL_FLAGS,
    *ADAPTER_FLAGS,
    "precision",
    "optimizer",
    "state_memory",
    "stream",
    "stream_update",
    "batch_size",
    "seq_len",
)
# the learning rate over the steps and gradient clipping (jaxmem train)
SCHEDULE_FLAGS = ("schedule", "warmup_steps", "decay_steps", "min_lr", "clip_norm")
RUN_FLAGS = ("framework", "data", "steps", "eval_every", "checkpoint_every", "keep")
RUN_FLAGS += ("sample_tokens", "prompt", "init_from")


def max_seq_len(preset: str, model: ModelConfig) -> int:
    """A ``seq_len_default``: the model's whole position table (planning a preset as trained)."""
    return model.max_seq_len


def _at(tree: Mapping[str, Any], path: str) -> Any:
    for key in path.split("."):
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def add_flags(
    parser: argparse.ArgumentParser,
    names: Sequence[str],
    defaults: Mapping[str, Any] | None = None,
    *,
    shown: Mapping[str, str] | None = None,
    title: str = "the step",
) -> None:
    """Add ``names`` (keys of ``FLAGS``) to ``parser`` in one group; their help shows the
    command's ``defaults`` (nested job data) or the ``shown`` text."""
    group = parser.add_argument_group(title)
    for name in names:
        flag = FLAGS[name]
        default = (shown or {}).get(name)
        if default is None and flag.path is not None:
            value = _at(defaults or {}, flag.path)
            default = None if value is None else str(value)
        text = flag.help + (f" (default {default})" if default is not None else "")
        kwargs: dict[str, Any] = {"default": None, "help": text.replace("%", "%%")}
        if flag.action == "store_const":
            kwargs.update(action="store_const", const=True)
        elif flag.action:
            kwargs["action"] = flag.action
        if flag.type is not None:
            kwargs["type"] = flag.type
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
        group.add_argument(flag.option, **kwargs)


def flag_settings(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The step flags given on the command line, as nested job data."""
    from jaxmem.parallel import parse_mesh

    out: dict[str, Any] = {}
    for name in names:
        flag, value = FLAGS[name], getattr(args, name, None)
        if value is None or flag.path is None:
            continue
        if name in ("save", "offload", "lora_targets", "lora_train"):
            value = [n.strip() for n in value.split(",") if n.strip()]
        if name == "mesh":
            parallel = parse_mesh(value)
            value = {"strategy": parallel.strategy, "devices": parallel.devices, "tp": parallel.tp}
            value |= {"cp": parallel.cp} if parallel.cp > 1 else {}
        section, _, key = flag.path.partition(".")
        if key:
            out.setdefault(section, {})[key] = value
        elif isinstance(value, dict):  # --mesh: the section, beside --cp-attention's key
            out.setdefault(section, {}).update(value)
        else:
            out[section] = value
    if (getattr(args, "save", None) or getattr(args, "offload", None)) and not getattr(
        args, "policy", None
    ):
        out.setdefault("memory", {})["policy"] = "custom"
    return out


def job_from_args(
    args: argparse.Namespace,
    names: Sequence[str],
    defaults: Mapping[str, Any] | None = None,
    *,
    saved: Mapping[str, Any] | None = None,
    seq_len_default: Callable[[str, ModelConfig], int] | None = None,
    errors: tuple[type[Exception], ...] = (),
):
    """The command's ``JobConfig``: ``defaults`` < ``saved`` < ``--config`` < flags < ``--set``;
    a bad value is a usage error (one line, exit 2)."""
    from jaxmem.job import resolve_job

    with usage_errors(*errors):
        return resolve_job(
            defaults=defaults,
            saved=saved,
            config_file=getattr(args, "config", None),
            flags=flag_settings(args, names),
            assignments=getattr(args, "set", None) or (),
            seq_len_default=seq_len_default,
        )


# ------------------------------------------------------------------ a job as a command line
def _yaml(value: Any) -> str:
    """A ``--set`` value that parses back (as YAML) to ``value``."""
    import json

    return json.dumps(list(value) if isinstance(value, tuple) else value)


def job_argv(job) -> list[str]:
    """``jaxmem train`` flags that resolve to ``job``'s step (its model, policy, precision,
    optimizer, accumulation, batch, sequence, mesh and seed): what a command prints for the user
    to run. ``job_from_args`` of them gives ``job`` back (tested)."""
    from jaxmem.adapters import AdapterConfig
    from jaxmem.config import AccumConfig, OptimizerConfig
    from jaxmem.hf.config import resolve_preset
    from jaxmem.job import RunConfig
    from jaxmem.policy_config import LAYER_FIELDS, policy_to_dict

    argv = ["--preset", job.preset]
    direct = {"n_layers": "--n-layers", "d_model": "--d-model", "n_heads": "--n-heads"}
    direct |= {"d_ff": "--d-ff", "attention": "--attention"}
    preset = resolve_preset(job.preset)
    for f in dataclasses.fields(ModelConfig):
        value = getattr(job.model, f.name)
        if value != getattr(preset, f.name):
            argv += (
                [direct[f.name], str(value)]
                if f.name in direct
                else ["--set", f"model.{f.name}={_yaml(value)}"]
            )
    memory = policy_to_dict(job.memory)
    rest = memory.get("rest")
    # two presets mixed read as HEAD:K+REST; a per-tag part needs its tags and the split
    mixed = rest not in (None, "custom") and memory["policy"] != "custom"
    argv += ["--policy", job.memory.name if mixed else memory["policy"]]
    if memory["policy"] == "custom":
        argv += ["--save", ",".join(memory["save"])] if memory["save"] else []
        argv += ["--offload", ",".join(memory["offload"])] if memory["offload"] else []
    for key in LAYER_FIELDS:
        if memory[key] is not None and not mixed:
            argv += ["--set", f"memory.{key}={_yaml(memory[key])}"]
    argv += ["--unroll"] if job.memory.unroll else []
    argv += ["--replay-embedding"] if job.memory.embedding.replay else []
    if rest is not None and not mixed:
        argv += ["--set", f"memory.rest={rest}"]
    if rest == "custom":
        argv += ["--set", f"memory.rest_save={_yaml(memory['rest_save'])}"]
        if memory["rest_offload"]:
            argv += ["--set", f"memory.rest_offload={_yaml(memory['rest_offload'])}"]
    chunks = job.memory.loss.chunks
    argv += ["--loss-chunks", str(chunks)] if chunks else []
    tiles = job.memory.loss.tile_tokens
    argv += ["--loss-tile-tokens", str(tiles)] if tiles else []
    tiles = job.memory.mlp_tile_tokens
    argv += ["--mlp-tile-tokens", str(tiles)] if tiles else []
    if job.memory.use_reentrant:
        argv += ["--set", "memory.use_reentrant=true"]
    argv += ["--precision", job.precision.name, "--optimizer", job.optimizer.name]
    argv += _changed("optimizer", job.optimizer, OptimizerConfig(name=job.optimizer.name))
    argv += _changed("accum", job.accum, AccumConfig())
    argv += _changed("adapters", job.adapters, AdapterConfig())
    argv += ["--batch-size", str(job.run.batch_size), "--seq-len", str(job.run.seq_len)]
    if job.run.seed != RunConfig().seed:
        argv += ["--seed", str(job.run.seed)]
    if job.parallel.sharded:
        argv += ["--mesh", job.parallel.mesh_text()]
    if job.parallel.tensor_parallel and not job.parallel.sequence_parallel:
        argv += ["--set", "parallel.sequence_parallel=false"]
    if job.parallel.cp_attention != ParallelConfig().cp_attention:
        argv += ["--cp-attention", job.parallel.cp_attention]
    return argv


STREAM_COMMANDS = "jaxmem train --stream, and jaxmem peak --stream for its GPU plan"


def host_memory(args: argparse.Namespace) -> int | None:
    """``--host-memory``'s bytes (None: not given, this machine's RAM applies)."""
    from jaxmem.cli.common import parse_bytes

    given = getattr(args, "host_memory", None)
    with usage_errors():
        return None if given is None else parse_bytes(given, "--host-memory")


def not_streamed(job: Any, command: str) -> None:
    """A usage error for a command that does not measure a streamed step yet."""
    from jaxmem.cli.common import UsageError

    if job.optimizer.stream:
        raise UsageError(
            f"jaxmem {command} does not measure a streamed step (--stream) yet; use "
            f"{STREAM_COMMANDS}"
        )


def not_tensor_parallel(job: Any, command: str) -> None:
    """A usage error for a command that does not measure a tensor-parallel step yet."""
    from jaxmem.cli.common import UsageError

    if job.parallel.tensor_parallel:
        raise UsageError(
            f"jaxmem {command} does not measure a tensor-parallel step (--mesh "
            f"{job.parallel.mesh_text()}) yet; jaxmem memory --mesh measures one per device and "
            "jaxmem train runs it (JAX or torch_ref)"
        )


def _changed(section: str, obj: Any, default: Any) -> list[str]:
    """Flags (or ``--set``) for the fields of ``obj`` that differ from ``default``."""
    by_path = {f.path: f for f in FLAGS.values() if f.path}
    out: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name == "name" or value == getattr(default, f.name):
            continue
        flag = by_path.get(f"{section}.{f.name}")
        if flag is not None and flag.action == "store_const":
            out += [flag.option] if value is True else ["--set", f"{section}.{f.name}=false"]
        elif flag is not None:
            out += [flag.option, ",".join(value) if isinstance(value, tuple) else str(value)]
        else:
            out += ["--set", f"{section}.{f.name}={_yaml(value)}"]
    return out

"""The configuration of a training step and the job around it: one frozen object per concern,
resolved in layers.

Pure data (no JAX, no PyTorch): the same object drives jaxmem and torch_ref
(``run.framework``), and every command that builds a step (``train``, ``memory``, ``plan``,
``peak``, ``bench``) resolves it the same way (``resolve_job``), lowest priority first: the
command's defaults, the model preset, a config file (TOML, YAML or JSON, the same sections as
``JobConfig.to_dict()``), the command line's flags and ``--set section.key=value``. The rules
across fields live in ``JobConfig``'s validation, so a library user gets the errors the
command line prints. A run's resolved config is written to its directory as ``config.yaml`` and
reads back to an equal object (``--config RUN/config.yaml`` repeats a run, or plans it).
``JobConfig`` holds objects (``ModelConfig``, ``MemoryPolicy``, ``Precision``, ...); names exist
only in files and on the command line. Sections::

    preset = "small"
    precision = "bf16"  # fp32 | bf16 | fp16 | pure-bf16
    [model]      # any ModelConfig field, overriding the preset's
    [memory]     # policy = "selective" (a preset), "none:2+selective" (HEAD:K+REST), or
                 # "custom" with save / offload tag lists; optionally layers_every /
                 # layers_first / layers, unroll, use_reentrant
    [optimizer]  # OptimizerConfig fields (name, lr, weight_decay, schedule, warmup_steps,
                 # decay_steps (unset: run.steps, then saved), min_lr, clip_norm, ...)
    [accum]      # steps, mode ("scan" | "multisteps"), inplace (scan: add into the sum in place)
    [data]       # path (a text file, a directory of text, or nanoGPT .bin files; empty: the
                 # embedded Python-stdlib corpus), val_fraction
    [run]        # RunConfig fields (framework, steps, batch_size, seq_len, seed, ...)
    [parallel]   # strategy (dp | zero1 | fsdp), devices (the command line: --mesh fsdp=4)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jaxmem.adapters import AdapterConfig
from jaxmem.config import (
    PRESETS,
    AccumConfig,
    ConfigError,
    ModelConfig,
    OptimizerConfig,
    require,
)
from jaxmem.hf.config import resolve_preset
from jaxmem.parallel import ParallelConfig, context_refusal
from jaxmem.policy import POLICIES, MemoryPolicy, check_policy, describe_kept
from jaxmem.policy_config import policy_from_dict, policy_to_dict
from jaxmem.precision import PRECISIONS, Precision, get_precision

FRAMEWORKS: tuple[str, ...] = ("jax", "torch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokens come from. ``path=None``: the embedded corpus (the Python standard
    library's sources, byte tokens); otherwise a text file, a directory of text files, a
    nanoGPT ``.bin`` file or a directory holding ``train.bin``/``val.bin``
    (``jaxmem prepare`` writes those)."""

    path: str | None = None
    val_fraction: float = 0.05

    def __post_init__(self) -> None:
        require(
            self.path is None or (isinstance(self.path, str) and self.path != ""),
            f"data path={self.path!r} must be a non-empty path (or unset for the embedded corpus)",
        )
        require(
            isinstance(self.val_fraction, float) and 0.0 < self.val_fraction < 0.5,
            f"val_fraction={self.val_fraction!r} must be in (0, 0.5)",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run itself.

    Attributes:
      framework: ``"jax"`` (jaxmem) or ``"torch"`` (torch_ref, the same model and data).
      steps: optimizer steps in total (a resumed run continues up to this number).
      batch_size, seq_len: tokens per step = batch_size * seq_len (seq_len defaults to 128, or
        the model's max_seq_len if that is shorter).
      seed: weights and data order (batch ``i`` is a pure function of ``(seed, i)``).
      eval_every / eval_batches: validation loss every so many steps, over so many batches.
      log_every: progress refresh and host sync interval in steps (0: about 50 per run).
      checkpoint_every / keep_checkpoints: save every so many steps, keep the last so many.
      sample_tokens / prompt / temperature: the text sample at the end (0 tokens: none).
      prefetch: batches prepared ahead on a background thread.
      init_from: a Hugging Face model directory whose weights the run starts from (loaded
        before step 1; its config.json is the model unless the preset says otherwise and
        agrees; its tokenizer.json, if any, tokenizes text data and the sample). None: the
        preset's random init from ``seed``.
    """

    framework: str = "jax"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 0
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    sample_tokens: int = 200
    prompt: str = "def "
    temperature: float = 0.8
    prefetch: int = 2
    init_from: str | None = None

    def __post_init__(self) -> None:
        require(
            self.init_from is None or (isinstance(self.init_from, str) and self.init_from != ""),
            f"init_from={self.init_from!r} must be a model directory (or unset)",
        )
        require(
            self.framework in FRAMEWORKS,
            f"framework={self.framework!r} is not one of {FRAMEWORKS}",
        )
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "keep_checkpoints",
            "prefetch",
        ):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"{name}={value!r} must be a positive integer",
            )
        for name in ("seed", "log_every", "sample_tokens"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                f"{name}={value!r} must be a non-negative integer",
            )
        require(
            self.seed < 2**32,
            f"seed={self.seed} is too large: JAX and numpy take seeds below 2**32 "
            f"({2**32}); use a smaller one",
        )
        require(
            isinstance(self.temperature, float)
            and math.isfinite(self.temperature)
            and self.temperature >= 0.0,
            f"temperature={self.temperature!r} must be >= 0 (0: greedy)",
        )
        require(isinstance(self.prompt, str), f"prompt={self.prompt!r} must be text")

    @property
    def refresh_every(self) -> int:
        return self.log_every or max(1, self.steps // 50)


# Sections read onto a dataclass's defaults (the model onto its preset's values).
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "optimizer": OptimizerConfig,
    "accum": AccumConfig,
    "data": DataConfig,
    "run": RunConfig,
    "parallel": ParallelConfig,
    "adapters": AdapterConfig,
}
# What a resumed run may change: how long to train and what is reported or written, not the
# arithmetic of a step. Dotted paths of ``JobConfig.to_dict()`` (the one list: the resume check
# and ``config_conflicts`` both use it). ``run.init_from`` is not among them: a resumed run
# continues from its checkpoint and never reads the directory's weights again, but where the
# run started is part of what it is (like its seed), so another directory contradicts it.
RESUMABLE_CHANGES: tuple[str, ...] = (
    "run.steps",
    "run.eval_every",
    "run.eval_batches",
    "run.log_every",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.sample_tokens",
    "run.prompt",
    "run.temperature",
    "run.prefetch",
)
# Settings added after runs were already written, with the value such a run had: a saved
# config without one resumes as that value without a conflict.
SCHEDULE_FIELDS = ("schedule", "warmup_steps", "decay_steps", "min_lr", "clip_norm")
ADDED_SETTINGS: dict[str, Any] = {
    **{f"optimizer.{name}": getattr(OptimizerConfig(), name) for name in SCHEDULE_FIELDS},
    # a run written before adapters existed trained every parameter
    **{
        f"adapters.{key}": value
        for key, value in json.loads(json.dumps(dataclasses.asdict(AdapterConfig()))).items()
    },
}


def check_stream(
    policy: MemoryPolicy,
    precision: Precision,
    accum: AccumConfig,
) -> None:
    """``ConfigError`` naming what a streamed step (``optimizer.stream``) does not compose with
    yet."""
    require(
        accum.steps == 1 or accum.mode == "scan",
        f"optimizer.stream sums microbatches in its own scan: accum mode {accum.mode!r} "
        "updates once per microbatch; use accum mode 'scan'",
    )
    require(
        not (
            policy.unroll
            or len(policy.parts) > 1
            or policy.selects
            or policy.nested
            or policy.embedding.replay
        ),
        f"optimizer.stream runs the stack as one scan: policy {policy.name!r} unrolls, selects "
        "layers, nests, mixes or replays the embedding; use a preset over every layer (none, "
        "full, selective, mlp, offload, or custom names) without --replay-embedding",
    )


def check_loss_chunks(
    policy: MemoryPolicy, precision: Precision, seq_len: int, cp: int = 1
) -> None:
    """``ConfigError`` when ``policy.loss``'s chunks or the MLP's tiles cannot split this
    step's sequences: each device's share of them, over a context axis of ``cp``."""
    share = seq_len // cp  # a context axis tiles each device's positions on their own
    where = f"seq_len={seq_len}" if cp == 1 else f"a device's {share} positions (cp={cp})"
    tiles = {"mlp_tile_tokens": policy.mlp_tile_tokens, "loss_tile_tokens": policy.loss.tile_tokens}
    for key, tokens in tiles.items():
        require(
            not tokens or share % tokens == 0,
            f"{key}={tokens} does not divide {where}: use one of "
            f"{', '.join(map(str, divisors(share)))}",
        )
    chunks = policy.loss.chunks_for(seq_len)
    if not chunks:
        return
    require(
        seq_len % chunks == 0 and chunks % cp == 0,
        f"loss_chunks={chunks} does not divide {where}: use a divisor of {seq_len}"
        + (f" that is a multiple of cp={cp}" if cp > 1 else ""),
    )
    require(
        precision.loss_scale != "dynamic",
        f"loss_chunks={chunks} forms the loss's gradients in the forward, before fp16's dynamic "
        f"loss scale multiplies them (what underflowed unscaled stays lost); precision "
        f"{precision.name!r}: use bf16, or loss_chunks=0",
    )


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def torch_tensor_parallel_refusal(job: JobConfig) -> str | None:
    """Why torch_ref's job cannot run ``job``'s tensor-parallel mesh (None: it can)."""
    parallel = job.parallel
    if (
        parallel.tensor_parallel
        and parallel.data * parallel.cp == 1
        and job.precision.loss_scale == "dynamic"
    ):
        return (
            f"--mesh {parallel.mesh_text()} with precision {job.precision.name!r}: PyTorch's "
            "GradScaler cannot unscale tensor parallelism's split (DTensor) gradients beside "
            "the whole ones of the embeddings and head in one step; use bf16 or fp32, a data "
            f"axis (--mesh fsdp=2,tp={parallel.tp}: FSDP2 makes every gradient a DTensor), or "
            "--framework jax"
        )
    return torch_mesh_refusal(parallel, job.model) or torch_ring_policy_refusal(
        parallel, job.memory
    )


# what attention outputs a policy may keep by name: under torch_ref's ring none (it is one
# autograd function, torch_ref.context.ring_attention)
ATTENTION_OUTPUTS = ("attn_context", "attn_lse")


def torch_ring_policy_refusal(parallel: ParallelConfig, policy: MemoryPolicy) -> str | None:
    """Why torch_ref cannot run ``policy`` under ``parallel``'s ring (None: it can): selective
    checkpointing keeps op outputs, and the ring's output is an autograd function's, so a
    policy keeping attention's output would recompute it where JAX keeps it."""
    if not (parallel.context_parallel and parallel.cp_attention == "ring"):
        return None
    named = [n for n in ATTENTION_OUTPUTS if any(b.remat and n in b.save + b.offload
                                                 for b in policy.blocks)]  # fmt: skip
    if not named:
        return None
    return (
        f"--policy {policy.name} keeps {', '.join(named)} under --cp-attention ring: "
        "torch_ref's ring attention is one autograd function (PyTorch's ring), whose output "
        "selective checkpointing cannot keep; use a policy that keeps neither, --cp-attention "
        "gather, or --framework jax"
    )


def torch_mesh_refusal(parallel: ParallelConfig, model: ModelConfig) -> str | None:
    """Why torch_ref cannot split ``model`` over ``parallel``'s tensor axis (None: it can:
    ``torch_ref.distributed.parallelize``, then FSDP2 over the data and context axes)."""
    if not parallel.tensor_parallel:
        return None
    mesh = f"--mesh {parallel.mesh_text()}"
    if parallel.strategy == "dp" and parallel.data * parallel.cp > 1:
        axes = f"{parallel.data}" + (f",cp={parallel.cp}" if parallel.context_parallel else "")
        implicit = "" if "dp=" in mesh else " (the strategy of a mesh naming none)"
        return (
            f"{mesh}: torch_ref has no dp{implicit} over a tensor axis (PyTorch's DDP does not "
            f"take DTensor parameters); use --mesh zero1={axes},tp={parallel.tp} or "
            f"fsdp={axes},tp={parallel.tp} (FSDP2), or --framework jax"
        )
    if model.kv_heads % parallel.tp:
        return (
            f"{mesh}: torch_ref splits whole key/value heads over the tensor axis; the model's "
            f"{model.kv_heads} key/value heads do not split over tp={parallel.tp}: use a tp "
            f"that divides {model.kv_heads}, or --framework jax"
        )
    return None


def torch_host_memory_refusal(job: JobConfig) -> str | None:
    """Why torch_ref's job cannot keep ``job``'s state in host memory as asked (None: it can:
    ``--stream`` through FSDP2's CPUOffloadPolicy, optimizer state through Megatron's hybrid
    optimizer)."""
    opt, parallel = job.optimizer, job.parallel
    if opt.params_memory != "device":
        return (
            f"optimizer.params_memory={opt.params_memory!r}: torch_ref keeps parameters between "
            "steps in host memory only by streaming them (--stream, FSDP2's CPUOffloadPolicy); "
            "use --stream or --framework jax"
        )
    if opt.state_memory != "device" and parallel.sharded:
        return (
            f"optimizer.state_memory={opt.state_memory!r} with --mesh {parallel.mesh_text()}: "
            "torch_ref's host optimizer (Megatron's hybrid) runs on one process; over a mesh "
            "use --stream (FSDP2's CPUOffloadPolicy)"
        )
    if opt.state_memory != "device" and job.precision.loss_scale == "dynamic":
        return (
            f"optimizer.state_memory={opt.state_memory!r} with precision "
            f"{job.precision.name!r}: torch_ref's host optimizer runs without GradScaler; use "
            "bf16 or fp32"
        )
    if opt.stream and opt.stream_update == "device":
        return (
            "--stream-update device: torch_ref streams with FSDP2's CPUOffloadPolicy, whose "
            "optimizer steps on the CPU; drop --stream-update (or use host, or --framework jax)"
        )
    if opt.stream and parallel.sharded and parallel.strategy == "dp":
        return (
            "--stream with --mesh dp: torch_ref streams with FSDP2's CPUOffloadPolicy, which "
            "shards; use --mesh fsdp or zero1 (or --framework jax)"
        )
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
    preset: str
    model: ModelConfig
    memory: MemoryPolicy = POLICIES["none"]
    precision: Precision = Precision(name="fp32")
    optimizer: OptimizerConfig = OptimizerConfig()
    accum: AccumConfig = AccumConfig()
    data: DataConfig = DataConfig()
    run: RunConfig = RunConfig()
    parallel: ParallelConfig = ParallelConfig()
    adapters: AdapterConfig = AdapterConfig()

    def __post_init__(self) -> None:
        require(
            self.model.causal,
            f"preset {self.preset!r} has no causal mask (model.causal=False): it is not a "
            "language model (trained as one it would see the token it predicts); use a causal "
            "preset (tiny, small, gpt2-*) or set model.causal=true (the seeds' layer runs in "
            "`jaxmem seed-example`)",
        )
        require(
            isinstance(self.memory, MemoryPolicy),
            f"memory={self.memory!r} must be a MemoryPolicy (names belong in config files)",
        )
        require(
            isinstance(self.precision, Precision),
            f"precision={self.precision!r} must be a Precision (names belong in config files)",
        )
        require(
            PRECISIONS.get(self.precision.name) == self.precision,
            f"precision {self.precision.name!r} is not one of the named precisions "
            f"({', '.join(PRECISIONS)}): a run config names its precision",
        )
        self.adapters.check_model(self.model)  # its targets exist in this model
        self.memory.layer_blocks(self.model.n_layers)  # its layers exist in this model
        check_policy(self.model, self.memory)  # its tags exist under this model's attention
        require(
            self.precision.loss_scale == "none" or self.accum.mode == "scan",
            f"accum mode {self.accum.mode!r} has no loss scaling; precision "
            f"{self.precision.name!r} needs it: use accum mode 'scan' or precision bf16",
        )
        host_kept = {self.optimizer.state_memory, self.optimizer.params_memory} != {"device"}
        require(
            not (host_kept and self.accum.mode == "multisteps"),
            "optimizer state/params in pinned_host need accum mode 'scan' (MultiSteps updates "
            "them once per microbatch on the device)",
        )
        if self.optimizer.stream:
            check_stream(self.memory, self.precision, self.accum)
        check_loss_chunks(self.memory, self.precision, self.run.seq_len, self.parallel.cp)
        self.accum.check_batch(self.run.batch_size)
        self.parallel.check_batch(self.run.batch_size, self.accum.steps)
        self.parallel.check_model(self.model, self.run.seq_len)
        if self.parallel.tensor_parallel:
            require(
                not (self.optimizer.stream or self.memory.unroll or self.memory.nested),
                f"--mesh {self.parallel.mesh_text()} (tensor parallelism) runs a scanned stack "
                "with its state on the device: drop --stream, --unroll or the nested policy",
            )
            require(
                not self.memory.mlp_tile_tokens,
                f"--mesh {self.parallel.mesh_text()} (tensor parallelism) lays out each block's "
                "tagged activations, not those inside sequence tiles: drop --mlp-tile-tokens",
            )
        dropout = self.adapters.dropout if self.adapters.enabled else 0.0
        line = context_refusal(self.parallel, stream=self.optimizer.stream, adapter_dropout=dropout)
        require(line is None, line or "")
        if self.parallel.sharded:
            require(
                self.accum.mode == "scan",
                f"--mesh {self.parallel.mesh_text()} runs scan accumulation; accum mode "
                f"{self.accum.mode!r} is single-device only: use accum mode 'scan'",
            )
        require(
            self.run.seq_len <= self.model.max_seq_len,
            f"seq_len={self.run.seq_len} exceeds the model's max_seq_len="
            f"{self.model.max_seq_len}; use at most {self.model.max_seq_len} or raise "
            "model.max_seq_len",
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain nested data (lists, not tuples) for YAML/JSON; ``from_dict`` inverts it."""

        def plain(value: Any) -> Any:
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            return value

        out: dict[str, Any] = {"preset": self.preset, "precision": self.precision.name}
        for section in ("model", "optimizer", "accum", "data", "run", "parallel", "adapters"):
            obj = getattr(self, section)
            out[section] = {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        out["memory"] = policy_to_dict(self.memory)
        return out

    def check_gpu_plan(self) -> None:
        """Raise ``ConfigError`` unless this step can be compiled for a GPU target without the
        GPU (``--target``): the scanned step with its state on the device, in jaxmem."""
        require(
            self.run.framework == "jax",
            "a GPU --target plans jaxmem's compiled step; torch_ref has no compiled plan (see "
            "its accounting with jaxmem memory --target)",
        )
        require(
            self.accum.mode == "scan",
            f"a GPU --target plans the scanned train step; accum mode {self.accum.mode!r} is "
            "not planned: use accum mode 'scan' (--accum-mode scan)",
        )
        require(
            self.optimizer.params_memory == "device",
            "a GPU --target cannot plan parameters in pinned_host: a deviceless compile drops "
            "host memory kinds on the step's arguments; keep optimizer.params_memory=device",
        )

    @property
    def step_text(self) -> str:
        """The step in words: preset (and adapters), batch, precision, policy, optimizer (report
        headers)."""
        micro = f" in {self.accum.steps} microbatches" if self.accum.steps > 1 else ""
        stack = self.memory.name + (" (unrolled)" if self.memory.unroll else "")
        if self.memory.loss.brief:
            stack += f", {self.memory.loss.brief}"
        if self.memory.mlp_tile_tokens:
            stack += f", MLP in tiles of {self.memory.mlp_tile_tokens} tokens"
        mesh = f", {self.parallel.mesh_text()}" if self.parallel.sharded else ""
        lora = f", {self.adapters.label()}" if self.adapters.enabled else ""
        return (
            f"{self.preset}{lora}, batch {self.run.batch_size} x {self.run.seq_len}{micro}, "
            f"{self.precision.name}, {stack}, {self.optimizer.name}{mesh}"
        )

    @classmethod
    def from_dict(
        cls,
        raw: Mapping[str, Any],
        *,
        seq_len_default: Callable[[str, ModelConfig], int] | None = None,
    ) -> JobConfig:
        """Build from nested data: the preset's model overlaid with the ``model`` section,
        every other section onto its defaults. Unknown sections or keys raise ``ConfigError``.
        Without ``run.seq_len`` the sequence is ``seq_len_default(preset, model)``, or 128,
        capped at the model's ``max_seq_len``."""
        known = {"preset", "precision", "memory", *SECTIONS}
        unknown = sorted(set(raw) - known)
        require(not unknown, f"unknown config section(s) {unknown}; valid: {sorted(known)}")
        preset = raw.get("preset", "small")
        require(isinstance(preset, str), f"preset={preset!r} must be a preset name")
        base_model = _preset_model(preset, raw.get("model"))
        sections: dict[str, Any] = {}
        for name in (*SECTIONS, "memory"):
            values = raw.get(name) or {}
            require(
                isinstance(values, Mapping),
                f"config section [{name}] must be a table of settings, got {values!r}",
            )
            if name == "memory":
                sections[name] = policy_from_dict(values)
            else:
                base = base_model if name == "model" else SECTIONS[name]()
                sections[name] = _overlay(name, base, values)
        if "seq_len" not in (raw.get("run") or {}):
            # the default sequence length fits the model: 128 or its max_seq_len if shorter
            run, model = sections["run"], sections["model"]
            seq_len = seq_len_default(preset, model) if seq_len_default else run.seq_len
            sections["run"] = dataclasses.replace(run, seq_len=min(seq_len, model.max_seq_len))
        opt = sections["optimizer"]
        if opt.schedule != "constant" and opt.decay_steps is None:
            # the schedule's length is the run's (kept in its config: a resumed run with
            # another --steps continues the same schedule)
            sections["optimizer"] = dataclasses.replace(opt, decay_steps=sections["run"].steps)
        name = raw.get("precision", "fp32")
        require(isinstance(name, str), f"precision={name!r} must be a precision name")
        return cls(preset=preset, precision=get_precision(name), **sections)


def _preset_model(preset: str, model_values: Any) -> ModelConfig:
    """The model a preset names: a named preset, or a Hugging Face model directory's
    ``config.json`` (``--preset DIR``). A saved run's config gives every model field itself,
    so a directory preset it names is not read again (the directory may be gone)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    if preset not in PRESETS and isinstance(model_values, Mapping) and names <= set(model_values):
        return PRESETS["small"]  # every field is overlaid by the model section
    return resolve_preset(preset)


def resolve_job(
    *,
    defaults: Mapping[str, Any] | None = None,
    saved: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    flags: Mapping[str, Any] | None = None,
    assignments: Iterable[str] = (),
    seq_len_default: Callable[[str, ModelConfig], int] | None = None,
) -> JobConfig:
    """The one way a step's configuration is built, lowest priority first: ``defaults`` (a
    command's own, as nested data), ``saved`` (a checkpoint's config, when resuming), the
    ``config_file``, ``flags`` (nested data, e.g. ``{"run": {"batch_size": 8}}``) and
    ``assignments`` (``"section.key=value"``). Raises ``ConfigError`` naming the bad value."""
    layered = layered_config(
        defaults=defaults, saved=saved, config_file=config_file, flags=flags,
        assignments=assignments,
    )  # fmt: skip
    return JobConfig.from_dict(layered, seq_len_default=seq_len_default)


def layered_config(
    *,
    defaults: Mapping[str, Any] | None = None,
    saved: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    flags: Mapping[str, Any] | None = None,
    assignments: Iterable[str] = (),
) -> dict[str, Any]:
    """``resolve_job``'s layers merged, as nested data (not yet validated)."""
    layered = merge(dict(defaults or {}), saved or {})
    if config_file:
        layered = merge(layered, read_config_file(config_file))
    layered = merge(layered, flags or {})
    for assignment in assignments:
        layered = merge(layered, parse_assignment(assignment))
    return layered


def write_config(config: JobConfig, path: str) -> None:
    """``config.yaml`` of a run (atomic: written beside it, then renamed)."""
    import yaml

    from jaxmem.files import write_atomic

    header = (
        "# jaxmem resolved run config: `jaxmem train --config THIS_FILE` repeats it\n"
        f"# memory policy {config.memory.name!r} {describe_kept(config.model, config.memory)}\n"
    )
    write_atomic(path, header + yaml.safe_dump(config.to_dict(), sort_keys=False))


# ----------------------------------------------------------------------------------- resuming
def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):  # True == 1 in Python; not here
        return type(a) is type(b) and a == b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


_MISSING = object()


def _show(value: Any) -> str:
    if value is _MISSING:
        return "absent"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def config_conflicts(
    saved: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    allowed: Iterable[str] = RESUMABLE_CHANGES,
    names: tuple[str, str] = ("checkpoint", "now"),
) -> list[str]:
    """Differences between a checkpoint's run config and a new one, one human-readable line per
    dotted path (``"model.d_model: checkpoint 64, now 128"``; ``names`` says what each side
    is), ignoring the ``allowed`` paths (and everything below them). Both sides are compared as
    JSON values (a tuple equals the list it was saved as). Empty when a resume is safe."""
    allowed = tuple(allowed)
    flat_saved = _flatten(json.loads(json.dumps(dict(saved))))
    flat_new = _flatten(json.loads(json.dumps(dict(new))))
    conflicts = []
    for path in sorted(flat_saved.keys() | flat_new.keys()):
        if any(path == a or path.startswith(a + ".") for a in allowed):
            continue
        before, after = flat_saved.get(path, _MISSING), flat_new.get(path, _MISSING)
        if before is _MISSING and path in ADDED_SETTINGS and _same(after, ADDED_SETTINGS[path]):
            continue  # written before the setting existed, and at what it was then
        if before is _MISSING or after is _MISSING or not _same(before, after):
            conflicts.append(f"{path}: {names[0]} {_show(before)}, {names[1]} {_show(after)}")
    return conflicts


# ------------------------------------------------------------------------ files and flags
def _overlay(section: str, base: Any, values: Mapping[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(base)}
    unknown = sorted(set(values) - set(fields))
    require(
        not unknown,
        f"unknown setting(s) {unknown} in [{section}]; valid: {', '.join(fields)}",
    )
    types = typing.get_type_hints(type(base))
    changes = {k: _coerce(section, k, types[k], v) for k, v in values.items()}
    return dataclasses.replace(base, **changes)


def _coerce(section: str, key: str, field_type: Any, value: Any) -> Any:
    """Config files and ``--set`` give ints for floats, lists for tuples and strings such as
    ``3e-4`` or ``1e3`` (YAML 1.1 reads those as text): convert to the field's annotated type
    (``float | None`` as ``float``, None kept), or say which value is wrong."""
    where = f"{section}.{key}={value!r}"
    kinds = {t for t in typing.get_args(field_type) or (field_type,) if t is not type(None)}
    if value is None and type(None) in typing.get_args(field_type):
        return None
    if kinds == {bool}:
        require(isinstance(value, bool), f"{where} must be true or false")
        return value
    if kinds == {float}:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number") from None
    if kinds == {int} and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"{where} must be an integer") from None
        require(number.is_integer(), f"{where} must be an integer")
        return int(number)
    if isinstance(value, list):
        return tuple(value)
    return value


def _yaml_loader() -> Any:
    """PyYAML's safe loader, refusing a key given twice in one table (PyYAML keeps the last one
    silently)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        pass

    def mapping(loader: Any, node: Any, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"key {key!r} is given twice (line {key_node.start_mark.line + 1}); keep one"
                )
            seen.add(key)
        return loader.construct_mapping(node, deep)

    UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return UniqueKeys


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    require(not dupes, f"key(s) {dupes} given twice; keep one")
    return dict(pairs)


def read_config_file(path: str) -> dict[str, Any]:
    """A TOML (``.toml``), YAML (``.yaml``/``.yml``) or JSON config file as nested data: a table
    of sections, each section itself a table (``preset`` and ``precision`` are names). An empty
    file, a key given twice and a section given as a single value are errors, not defaults."""
    require(
        not os.path.isdir(path), f"config file {path} is a directory; give a TOML/YAML/JSON file"
    )
    require(os.path.isfile(path), f"config file {path} does not exist")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".toml":
            with open(path, "rb") as f:
                data = tomllib.load(f)  # TOML itself refuses duplicate keys
        elif ext in (".yaml", ".yml"):
            import yaml

            with open(path) as f:
                data = yaml.load(f, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader)
        elif ext == ".json":
            with open(path) as f:
                data = json.load(f, object_pairs_hook=_no_duplicate_keys)
        else:
            raise ConfigError(
                f"config file {path}: unknown extension {ext!r}; use .toml, .yaml or .json"
            )
    except ConfigError:
        raise
    except Exception as e:  # the parsers' own error types differ; all mean "cannot parse"
        raise ConfigError(f"config file {path} cannot be parsed: {_parse_error(e)}") from None
    require(data not in (None, {}), f"config file {path} is empty; give at least one setting")
    require(isinstance(data, dict), f"config file {path} must hold a table of sections")
    check_sections(data, f"config file {path}")
    return data


def _parse_error(error: Exception) -> str:
    """A parser's error in one line with the line it is at. YAML's message spans lines: where it
    gave up (``problem_mark``) and the construct it was reading (``context_mark``). A stray
    line (a key without its ``:``) or an unclosed list is only found on the line after it, or
    at the end of the file: there the construct's line is the one to fix. JSON's and TOML's
    errors name their line themselves."""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)
    if problem is not None and mark is not None:  # yaml.MarkedYAMLError
        context = getattr(error, "context", None) or ""
        context_mark = getattr(error, "context_mark", None)
        if context_mark is not None and ("simple key" in context or "<stream end>" in problem):
            mark = context_mark
        return f"line {mark.line + 1}: {problem}" + (f" ({context})" if context else "")
    if isinstance(error, json.JSONDecodeError):
        return f"line {error.lineno}: {error.msg}"
    lines = str(error).splitlines()
    return lines[0] if lines else type(error).__name__


def check_sections(data: Mapping[str, Any], where: str) -> None:
    """Each section is a table and ``preset``/``precision`` are names (a section given as a
    single value would otherwise vanish when flags are merged over it)."""
    for name in (*SECTIONS, "memory"):
        value = data.get(name)
        require(
            value is None or isinstance(value, Mapping),
            f"{where}: section [{name}] must be a table of settings, got {value!r}",
        )
    for name in ("preset", "precision"):
        value = data.get(name)
        require(
            value is None or isinstance(value, str),
            f"{where}: {name}={value!r} must be a name (e.g. {name} = "
            f'"{"tiny" if name == "preset" else "fp32"}")',
        )


def merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied section by section (nested dicts merged)."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


def parse_assignment(text: str) -> dict[str, Any]:
    """``--set section.key=value`` as nested data (value parsed as YAML: numbers, booleans,
    lists, text)."""
    import yaml

    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: write section.key=value, e.g. --set model.n_layers=6")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return {parts[0]: {parts[1]: parsed}}

"""The configuration of a training job: one frozen object per concern, resolved in layers.

``jaxmem train`` builds a ``JobConfig`` from, lowest priority first: the defaults, the model
preset, a config file (TOML or YAML, the same sections as ``JobConfig.to_dict()``), and the
command line. The resolved config is written to the run directory as ``config.yaml`` and reads
back to an equal object (``--config RUN/config.yaml`` repeats a run). Sections::

    preset = "small"
    [model]      # any ModelConfig field, overriding the preset's
    [memory]     # policy = "selective" (a preset), or policy = "custom" with save / offload
                 # tag lists and optionally layers_every / layers_first / layers
    [precision]  # name = "fp32" | "bf16" | "fp16" | "pure-bf16"
    [optimizer]  # OptimizerConfig fields (name, lr, weight_decay, ...)
    [accum]      # steps, mode ("scan" | "multisteps")
    [data]       # path (a text file, a directory of text, or nanoGPT .bin files; empty: the
                 # embedded Python-stdlib corpus), val_fraction
    [run]        # RunConfig fields (framework, steps, batch_size, seq_len, seed, ...)

The same object drives jaxmem and torch_ref (``run.framework``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from typing import Any

from jaxmem.config import (
    PLANNING_ONLY,
    AccumConfig,
    ConfigError,
    ModelConfig,
    OptimizerConfig,
    get_preset,
)

FRAMEWORKS: tuple[str, ...] = ("jax", "torch")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokens come from. ``path=None``: the embedded corpus (the Python standard
    library's sources, byte tokens); otherwise a text file, a directory of text files, a
    nanoGPT ``.bin`` file or a directory holding ``train.bin``/``val.bin``
    (``jaxmem prepare`` writes those)."""

    path: str | None = None
    val_fraction: float = 0.05

    def __post_init__(self) -> None:
        _require(
            self.path is None or (isinstance(self.path, str) and self.path != ""),
            f"data path={self.path!r} must be a non-empty path (or unset for the embedded corpus)",
        )
        _require(
            isinstance(self.val_fraction, float) and 0.0 < self.val_fraction < 0.5,
            f"val_fraction={self.val_fraction!r} must be in (0, 0.5)",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """A memory policy by name (``jaxmem.remat.POLICIES``), or ``policy="custom"`` with tag
    names to keep on device (``save``) and to send to host memory (``offload``); the rest is
    recomputed. ``layers_every`` / ``layers_first`` / ``layers`` restrict a policy to some
    layers."""

    policy: str = "none"
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    layers_every: int | None = None
    layers_first: int | None = None
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.policy, str), f"memory policy={self.policy!r} must be a name")
        if self.policy != "custom":
            _require(
                not (self.save or self.offload),
                f"save/offload lists define a custom policy: set policy = 'custom' (not "
                f"{self.policy!r}) or drop them",
            )

    def build(self) -> Any:
        """The ``jaxmem.remat.MemoryPolicy`` (validated: unknown tags, a name both saved and
        offloaded, bad layer selections all raise ``ConfigError``)."""
        from jaxmem.remat import LayerSelection, MemoryPolicy, get_policy

        selection = LayerSelection(
            every=self.layers_every, first=self.layers_first, layers=self.layers
        )
        if self.policy == "custom":
            return MemoryPolicy(
                name="custom", save=self.save, offload=self.offload, layers=selection
            )
        policy = get_policy(self.policy)
        return policy if selection.is_all else policy.replace(layers=selection)


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

    def __post_init__(self) -> None:
        _require(
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
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"{name}={value!r} must be a positive integer",
            )
        for name in ("seed", "log_every", "sample_tokens"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                f"{name}={value!r} must be a non-negative integer",
            )
        _require(
            isinstance(self.temperature, float) and self.temperature >= 0.0,
            f"temperature={self.temperature!r} must be >= 0 (0: greedy)",
        )
        _require(isinstance(self.prompt, str), f"prompt={self.prompt!r} must be text")

    @property
    def refresh_every(self) -> int:
        return self.log_every or max(1, self.steps // 50)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "memory": MemoryConfig,
    "optimizer": OptimizerConfig,
    "accum": AccumConfig,
    "data": DataConfig,
    "run": RunConfig,
}
# Settings a resumed run may change: they do not change the math of the steps already taken.
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
    preset: str
    model: ModelConfig
    memory: MemoryConfig = MemoryConfig()
    precision: str = "fp32"
    optimizer: OptimizerConfig = OptimizerConfig()
    accum: AccumConfig = AccumConfig()
    data: DataConfig = DataConfig()
    run: RunConfig = RunConfig()

    def __post_init__(self) -> None:
        from jaxmem.precision import get_precision  # precision.py imports jax: only here

        _require(
            self.preset not in PLANNING_ONLY and self.preset != "seed",
            f"preset {self.preset!r} is not trainable on this machine (planning-only shape or "
            "the seeds' single layer); train tiny or small",
        )
        if get_precision(self.precision).loss_scale != "none" and self.accum.mode != "scan":
            raise ConfigError(
                f"accum mode {self.accum.mode!r} has no loss scaling; precision "
                f"{self.precision!r} needs it: use accum mode 'scan' or precision bf16"
            )
        host_kept = {self.optimizer.state_memory, self.optimizer.params_memory} != {"device"}
        _require(
            not (host_kept and self.accum.mode == "multisteps"),
            "optimizer state/params in pinned_host need accum mode 'scan' (MultiSteps updates "
            "them once per microbatch on the device)",
        )
        self.policy  # noqa: B018  (validates the policy against the tag names)
        self.accum.check_batch(self.run.batch_size)
        _require(
            self.run.seq_len <= self.model.max_seq_len,
            f"seq_len={self.run.seq_len} exceeds the model's max_seq_len="
            f"{self.model.max_seq_len}; use at most {self.model.max_seq_len} or raise "
            "model.max_seq_len",
        )

    @property
    def policy(self) -> Any:
        return self.memory.build()

    def to_dict(self) -> dict[str, Any]:
        """Plain nested data (lists, not tuples) for YAML/JSON; ``from_dict`` inverts it."""

        def plain(value: Any) -> Any:
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            return value

        out: dict[str, Any] = {"preset": self.preset, "precision": self.precision}
        for section in SECTIONS:
            obj = getattr(self, section)
            out[section] = {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> JobConfig:
        """Build from nested data: the preset's model overlaid with the ``model`` section,
        every other section onto its defaults. Unknown sections or keys raise ``ConfigError``."""
        known = {"preset", "precision", *SECTIONS}
        unknown = sorted(set(raw) - known)
        _require(not unknown, f"unknown config section(s) {unknown}; valid: {sorted(known)}")
        preset = raw.get("preset", "small")
        _require(isinstance(preset, str), f"preset={preset!r} must be a preset name")
        base_model = get_preset(preset)
        sections: dict[str, Any] = {}
        for name, kind in SECTIONS.items():
            values = raw.get(name) or {}
            _require(
                isinstance(values, Mapping),
                f"config section [{name}] must be a table of settings, got {values!r}",
            )
            base = base_model if name == "model" else kind()
            sections[name] = _overlay(name, base, values)
        if "seq_len" not in (raw.get("run") or {}):
            # the default sequence length fits the model: 128 or its max_seq_len if shorter
            run = sections["run"]
            sections["run"] = dataclasses.replace(
                run, seq_len=min(run.seq_len, sections["model"].max_seq_len)
            )
        precision = raw.get("precision", "fp32")
        return cls(preset=preset, precision=precision, **sections)


def _overlay(section: str, base: Any, values: Mapping[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(base)}
    unknown = sorted(set(values) - set(fields))
    _require(
        not unknown,
        f"unknown setting(s) {unknown} in [{section}]; valid: {', '.join(fields)}",
    )
    changes = {k: _coerce(section, k, getattr(base, k), v) for k, v in values.items()}
    return dataclasses.replace(base, **changes)


def _coerce(section: str, key: str, default: Any, value: Any) -> Any:
    """Config files and ``--set`` give ints for floats, lists for tuples and strings such as
    ``3e-4`` (YAML 1.1 reads that as text): convert to the field's type, or say which value
    is wrong."""
    where = f"{section}.{key}={value!r}"
    if isinstance(default, bool):
        _require(isinstance(value, bool), f"{where} must be true or false")
        return value
    if isinstance(default, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number") from None
    if isinstance(value, list):
        return tuple(value)
    return value


def read_config_file(path: str) -> dict[str, Any]:
    """A TOML (``.toml``), YAML (``.yaml``/``.yml``) or JSON config file as nested data."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".toml":
            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif ext in (".yaml", ".yml"):
            import yaml

            with open(path) as f:
                data = yaml.safe_load(f) or {}
        elif ext == ".json":
            with open(path) as f:
                data = json.load(f)
        else:
            raise ConfigError(
                f"config file {path}: unknown extension {ext!r}; use .toml, .yaml or .json"
            )
    except ConfigError:
        raise
    except Exception as e:  # the parsers' own error types differ; all mean "cannot parse"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"config file {path} cannot be parsed: {first}") from None
    _require(isinstance(data, dict), f"config file {path} must hold a table of sections")
    return data


def write_config(config: JobConfig, path: str) -> None:
    """``config.yaml`` of a run (atomic: written beside it, then renamed)."""
    import yaml

    from jaxmem.files import write_atomic

    policy = config.policy
    if not policy.remat:
        kept = "keeps every activation (no remat)"
    elif policy.nested:
        kept = "keeps one block input per segment of ⌈√L⌉ blocks and recomputes the rest"
    else:
        from jaxmem.analytic import kept_tags

        needed = kept_tags(config.model, policy) | {"block_input"}
        on_device = ["block_input"] + [n for n in policy.save if n in needed - {"block_input"}]
        on_host = [n for n in policy.offload if n in needed]
        kept = (
            f"keeps on device {on_device}, offloads {on_host or '-'}"
            f"{', and matmul outputs' if policy.save_dots else ''} (what the backward needs of "
            "what it stores); recomputes the rest"
        )
    header = (
        "# jaxmem resolved run config: `jaxmem train --config THIS_FILE` repeats it\n"
        f"# memory policy {policy.name!r} {kept}\n"
    )
    write_atomic(path, header + yaml.safe_dump(config.to_dict(), sort_keys=False))


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

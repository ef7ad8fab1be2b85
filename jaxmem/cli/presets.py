"""``jaxmem presets``, and the one rule of which command takes which model: the listing prints it
and the commands apply it, so the two cannot disagree."""

from __future__ import annotations

import argparse

import jaxmem.cli.render as render
from jaxmem.cli.common import UsageError
from jaxmem.config import PLANNING_ONLY, PRESETS, ModelConfig

# The commands that take --preset, in the order the listing names them.
COMMANDS = ("train", "memory", "plan", "peak", "parity", "bench")
PARITY_MAX_PARAMS = 50_000_000  # parity runs both frameworks in float64 and fp32 on this machine


def planning_only(preset: str, cfg: ModelConfig) -> bool:
    """A model this machine plans from shapes rather than runs: a planning preset, or a model
    directory (``--preset DIR``) larger than parity runs."""
    if preset in PRESETS:
        return preset in PLANNING_ONLY
    return cfg.n_params > PARITY_MAX_PARAMS


def refusal(command: str, preset: str, cfg: ModelConfig) -> str | None:
    """Why ``command`` does not take ``cfg`` (preset ``preset``), or None when it does."""
    if command == "parity":
        if cfg.n_params > PARITY_MAX_PARAMS:
            return (
                f"--preset {preset} has {cfg.n_params / 1e6:.0f} M parameters; parity runs both "
                "frameworks in float64 and fp32 on this machine: use tiny, small or seed"
            )
        return None
    if not cfg.causal:
        return (
            f"preset {preset!r} has no causal mask: it is not a language model; the seeds' "
            "layer runs in `jaxmem seed-example` and `jaxmem parity`"
        )
    if command == "bench" and planning_only(preset, cfg):
        return (
            f"--preset {preset} cannot run both frameworks on this machine; bench tiny or "
            "small (plan large presets with `jaxmem memory`)"
        )
    return None


def check(command: str, preset: str, cfg: ModelConfig) -> None:
    """A usage error when ``command`` does not take the model."""
    why = refusal(command, preset, cfg)
    if why is not None:
        raise UsageError(why)


def preset_commands(name: str) -> list[str]:
    """The commands that take preset ``name``: ``refusal`` decides."""
    cfg = PRESETS[name]
    takes = [c for c in COMMANDS if refusal(c, name, cfg) is None]
    return takes if cfg.causal else ["seed-example", *takes]


def preset_use(name: str) -> str:
    """``preset_commands`` in a few words (``all``, ``all but`` the ones it refuses, or
    ``from shapes*``)."""
    takes = preset_commands(name)
    if name in PLANNING_ONLY:
        assert takes == ["train", "memory", "plan", "peak"], takes
        return "from shapes*"
    if not PRESETS[name].causal:
        return ", ".join(takes)
    missing = [c for c in COMMANDS if c not in takes]
    return "all" if not missing else "all but " + ", ".join(missing)


def add_parser(sub) -> None:
    p = sub.add_parser("presets", help="list the model presets and the commands that take each")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = [(name, cfg, preset_use(name)) for name, cfg in PRESETS.items()]
    out = render.console()
    render.presets_table(out, rows)
    out.print(
        "* memory, plan and peak plan these presets from shapes (no weights; torch_ref's rows run "
        "on fake tensors); train takes them too, a GPU's work"
    )
    return 0

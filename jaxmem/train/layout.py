"""Where a run keeps its checkpoints, and how to read a checkpoint's saved config without loading
any array (pure: no JAX, no PyTorch at import).

Two layouts live under ``<run>/checkpoints/<step>/``:

- JAX runs: orbax items (``jaxmem.train.checkpoint``);
- PyTorch runs: ``state.pt`` (``torch_ref.checkpoint``), ``run_config.json`` and ``meta.json``,
  the JSON files written last.

``latest_checkpoint`` reads either, so resuming a torch run as a JAX run (or the reverse) is
refused by the config comparison, with a message naming ``run.framework``.
"""

from __future__ import annotations

import json
import os
from typing import Any

CHECKPOINT_DIR = "checkpoints"
RUN_CONFIG_JSON = "run_config.json"  # PyTorch layout
META_JSON = "meta.json"  # PyTorch layout: written last, marks a step complete


class CheckpointError(ValueError):
    """A checkpoint directory is missing, corrupt or does not fit the run being resumed. The
    message names the directory and how to fix it."""


def json_steps(directory: str) -> list[int]:
    """Complete steps of the PyTorch layout (a step directory whose ``meta.json`` exists)."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        int(name)
        for name in os.listdir(directory)
        if name.isdigit() and os.path.isfile(os.path.join(directory, name, META_JSON))
    )


def read_json_config(directory: str, step: int) -> dict[str, Any]:
    """The run config saved with ``step`` in the PyTorch layout."""
    path = os.path.join(directory, str(step), RUN_CONFIG_JSON)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {directory}/{step} has no readable {RUN_CONFIG_JSON} ({e}); "
            "delete that step directory to resume from an earlier one"
        ) from None


def _torch_latest(directory: str) -> tuple[int | None, dict | None]:
    steps = json_steps(directory)
    return (steps[-1], read_json_config(directory, steps[-1])) if steps else (None, None)


def _jax_latest(directory: str) -> tuple[int | None, dict | None]:
    # orbax (JAX's checkpoint library) reads its own layout
    from jaxmem.train.checkpoint import RunCheckpointer

    with RunCheckpointer(directory, keep=1) as reader:
        step = reader.latest_step()
        return step, (reader.read_config(step) if step is not None else None)


def latest_checkpoint(out_dir: str, framework: str) -> tuple[int | None, dict | None]:
    """The latest complete checkpoint's step and saved config in run directory ``out_dir``
    (``(None, None)`` if none), trying ``framework``'s layout first."""
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        return None, None
    readers = (_torch_latest, _jax_latest) if framework == "torch" else (_jax_latest, _torch_latest)
    for read in readers:
        try:
            step, saved = read(directory)
        except CheckpointError:
            continue
        if step is not None and saved is not None:
            return step, saved
    return None, None

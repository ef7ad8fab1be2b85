"""Where a run keeps its checkpoints, and how to read a checkpoint's saved config without loading
any array (pure: no JAX, no PyTorch at import).

Two layouts live under ``<run>/checkpoints/<step>/``:

- JAX runs: orbax items (``jaxmem.train.checkpoint``);
- PyTorch runs: ``state.pt`` (``torch_ref.checkpoint``), ``run_config.json`` and ``meta.json``,
  the JSON files written last.

``jaxmem.train.checkpoint.latest_checkpoint`` reads either, so resuming a torch run as a JAX run
(or the reverse) is refused by the config comparison, with a message naming ``run.framework``.
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

"""Checkpoints of a torch_ref training run, in the PyTorch layout of ``jaxmem.run_layout``.

``checkpoints/<step>/`` holds ``state.pt`` (model, optimizer and GradScaler state dicts),
``run_config.json``, ``meta.json`` and, written last, the integrity manifest
(``jaxmem.run_layout.write_manifest``), all under a temporary name renamed into place, so a
killed save leaves nothing that looks complete. A step counts only if its manifest verifies; the
newest ``keep`` verified steps are kept (``layout.rotate``). They load with
``torch.load(weights_only=True)``: no pickled code runs.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

import jaxmem.run_layout as layout
from jaxmem.run_layout import META_JSON, RUN_CONFIG_JSON, CheckpointError

STATE_FILE = "state.pt"
_TMP = ".tmp-"


class TorchCheckpointer:
    """Atomic, keep-last-k checkpoints of a torch_ref run (see the module docstring)."""

    def __init__(self, directory: str, keep: int):
        self.directory, self.keep = directory, keep

    def all_steps(self) -> list[int]:
        """Every step directory, verified or not (a new save must come after all of them)."""
        return layout.step_dirs(self.directory)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: dict[str, Any], run_config: dict, extra: dict) -> None:
        os.makedirs(self.directory, exist_ok=True)
        final = os.path.join(self.directory, str(step))
        tmp = os.path.join(self.directory, f"{step}{_TMP}{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        torch.save(state, os.path.join(tmp, STATE_FILE))
        with open(os.path.join(tmp, RUN_CONFIG_JSON), "w") as f:
            json.dump(run_config, f)
        with open(os.path.join(tmp, META_JSON), "w") as f:
            json.dump({"step": step, "extra": extra}, f)
        layout.write_manifest(tmp, step)  # last: the step counts once this verifies
        os.replace(tmp, final)
        layout.fsync_dir(self.directory)
        layout.rotate(self.directory, self.keep)
        for name in os.listdir(self.directory):  # leftovers of killed saves
            if _TMP in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def load(self, step: int) -> dict[str, Any]:
        reason = layout.verify(os.path.join(self.directory, str(step)))
        if reason is not None:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} does not verify: {reason}; resume from an "
                "earlier checkpoint (--resume picks the newest that verifies)"
            )
        path = os.path.join(self.directory, str(step), STATE_FILE)
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e:  # torch raises several types for a truncated or foreign file
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded ({type(e).__name__}); delete that step "
                "directory to resume from an earlier one"
            ) from None

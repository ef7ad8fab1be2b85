"""Checkpoints of a torch_ref training run, in the PyTorch layout of ``jaxmem.train.layout``.

``checkpoints/<step>/`` holds ``state.pt`` (model, optimizer and GradScaler state dicts),
``run_config.json`` and ``meta.json``, written under a temporary name and renamed into place, so
a killed save leaves nothing that looks complete; the last ``keep`` are kept. They load with
``torch.load(weights_only=True)``: no pickled code runs.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from jaxmem.train.layout import META_JSON, RUN_CONFIG_JSON, CheckpointError, json_steps

STATE_FILE = "state.pt"
_TMP = ".tmp-"


class TorchCheckpointer:
    """Atomic, keep-last-k checkpoints of a torch_ref run (see the module docstring)."""

    def __init__(self, directory: str, keep: int):
        self.directory, self.keep = directory, keep

    def all_steps(self) -> list[int]:
        return json_steps(self.directory)

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
        with open(os.path.join(tmp, META_JSON), "w") as f:  # written last: marks complete
            json.dump({"step": step, "extra": extra}, f)
        os.replace(tmp, final)
        for old in self.all_steps()[: -self.keep]:
            shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)
        for name in os.listdir(self.directory):  # leftovers of killed saves
            if _TMP in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def load(self, step: int) -> dict[str, Any]:
        path = os.path.join(self.directory, str(step), STATE_FILE)
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e:  # torch raises several types for a truncated or foreign file
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded ({type(e).__name__}); delete that step "
                "directory to resume from an earlier one"
            ) from None

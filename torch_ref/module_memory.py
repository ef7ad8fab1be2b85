"""jaxmem's memory figures for any ``nn.Module``: your own model, a Hugging Face model, not only
torch_ref's decoder.

Three calls, each on a model you do not edit:

- ``CheckpointPlan``: a checkpoint policy as data (which submodules are checkpoint units, by
  class or by a glob on qualified names such as ``"model.layers.*"``; ``none``, ``full`` or
  ``selective``); ``applied(model, plan)`` runs the model under it with stock PyTorch
  (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, selective checkpointing through
  ``create_selective_checkpoint_contexts``) and restores the model on exit.
- ``saved_activations(model, inputs, policy=...)``: what one forward (and loss) leaves for the
  backward pass, by op and by module, on fake tensors by default (``FakeTensorMode``: shapes
  only, no memory), so a GPU-scale batch is measured on a laptop; and the matmul FLOPs of
  forward + backward (``FlopCounterMode``), recompute included.
- ``step_peak(model, inputs, optimizer_factory=...)``: the peak bytes of real training steps
  (forward, backward, optimizer step): the CUDA caching allocator's peak on a GPU, live-tensor
  accounting on CPU.

Every figure says how it was obtained (the ``*source`` fields). Errors about the model or the
plan are ``ModelError`` (a ``jaxmem.config.ConfigError``), one line naming the value.

This module is the public API; the code is in ``torch_ref.checkpoint_plan`` (the plan),
``torch_ref.module_activations`` (what the forward leaves) and ``torch_ref.module_peak`` (the
peak of real steps).
"""

from torch_ref.checkpoint_plan import (
    DEFAULT_SAVE_OPS,
    MODES,
    CheckpointPlan,
    ModelError,
    applied,
    op_name,
    unit_modules,
)
from torch_ref.module_activations import SavedActivations, default_loss, saved_activations
from torch_ref.module_peak import StepPeak, step_peak

__all__ = [
    "DEFAULT_SAVE_OPS",
    "MODES",
    "CheckpointPlan",
    "ModelError",
    "SavedActivations",
    "StepPeak",
    "applied",
    "default_loss",
    "op_name",
    "saved_activations",
    "step_peak",
    "unit_modules",
]

"""jaxmem: decide, prove and run the cheapest memory strategy for training a transformer.

A JAX package: nothing here imports PyTorch but ``jaxmem.compare``, the comparison wing, which
only the cross-framework commands import (it needs ``pip install 'jaxmem[torch]'``).

- pure data, shared with ``torch_ref``: ``config`` (model presets, optimizer, accumulation),
  ``policy`` (memory policies and the tag names), ``precision``, ``data`` (tokens, batches),
  ``files``, ``figures``;
- ``model``: the Flax NNX decoder (tags only), its ops, losses and sampling;
- ``memory``: a policy's JAX translation, the analytic model, residual accounting, compiled
  plans and FLOPs;
- ``train``: the jitted step, the job config, the step loop both frameworks share, the JAX
  trainer and checkpoints;
- ``compare``: weight exchange, tolerances, parity, torch records, benchmarks;
- ``cli``: the ``jaxmem`` command.

Import submodules directly; this package imports nothing heavy on its own.
"""

__version__ = "0.1.0"

"""PyTorch's budgeted partitioner (``activation_memory_budget``), the peer row of ``jaxmem
plan``'s benchmark: saving everything it executes the FLOPs of JAX's `none` (the same model, the
same matmuls), and a zero budget trades saved bytes for recompute."""

from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

from jaxmem.compare.torch_budget import budgeted_steps
from jaxmem.config import PRESETS
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.memory.remat import layers_fn
from jaxmem.model import make_model
from jaxmem.planner.records import lm_step_batch
from jaxmem.policy import POLICIES
from jaxmem.step.train_step import lm_loss_fn

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2)

pytestmark = pytest.mark.slow


def test_budgeted_partitioner_bounds():
    everything, nothing = budgeted_steps(CFG, 4, 32, (1.0, 0.0))
    graphdef, params = nnx.split(make_model(CFG, seed=0), nnx.Param)
    micro = lm_step_batch(CFG, 4, 32, abstract=False)
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(POLICIES["none"], CFG.n_layers))
    jax_none = grad_matmul_flops(lambda p, b: loss(p, b)[0], params, micro)
    assert everything.flops == jax_none
    assert nothing.saved_activation_bytes < everything.saved_activation_bytes
    assert nothing.flops > everything.flops

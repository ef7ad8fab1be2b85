"""FLOPs actually executed, counted from a jaxpr.

Written by hand because ``compiled.cost_analysis()`` on XLA:CPU counts a scan body once whatever
its length, and in unrolled programs XLA may CSE a rematerialised forward away. Counting the
jaxpr of the gradient counts what the program asks for, recompute included: each
``dot_general`` is 2·(output elements)·(contracted size), scan bodies are multiplied by their
length, and calls/remat regions are entered. Only matmuls are counted (the elementwise work is a
few percent and is not what remat trades for memory).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax


def _dot_flops(eqn: Any) -> int:
    lhs, _ = eqn.invars
    (contract_lhs, _), _ = eqn.params["dimension_numbers"]
    contracted = math.prod(lhs.aval.shape[d] for d in contract_lhs)
    return 2 * math.prod(eqn.outvars[0].aval.shape) * contracted


def jaxpr_matmul_flops(jaxpr: Any) -> int:
    """Matmul FLOPs of a (closed) jaxpr, scan bodies × length, recursing into sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim == "dot_general":
            total += _dot_flops(eqn)
        elif prim == "scan":
            total += eqn.params["length"] * jaxpr_matmul_flops(eqn.params["jaxpr"])
        elif prim == "while":
            raise NotImplementedError("while loops have no static trip count to count FLOPs by")
        elif prim == "cond":
            total += max(jaxpr_matmul_flops(b) for b in eqn.params["branches"])
        else:
            for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
                if key in eqn.params and eqn.params[key] is not None:
                    total += jaxpr_matmul_flops(eqn.params[key])
                    break
    return total


def grad_matmul_flops(loss_fn: Callable[..., Any], *args: Any) -> int:
    """Matmul FLOPs of one ``jax.grad(loss_fn)(*args)`` (forward, recompute and backward)."""
    return jaxpr_matmul_flops(jax.make_jaxpr(jax.grad(loss_fn))(*args))


def forward_matmul_flops(fn: Callable[..., Any], *args: Any) -> int:
    """Matmul FLOPs of the forward pass alone."""
    return jaxpr_matmul_flops(jax.make_jaxpr(fn)(*args))

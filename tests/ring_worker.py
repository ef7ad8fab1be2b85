"""Run by ``tests/test_context_parallel.py`` in a subprocess (JAX fixes its CPU device count when
its backends start): context-parallel attention over ``cp`` CPU devices, keys and values
all-gathered and passed round a ring (``jaxmem.step.context.attend_fn``), against the naive
core on the whole row, in float64; and, per device, the matmul FLOPs each form asks for and the
temporary bytes of each one's compiled gradient (XLA:CPU). Prints JSON, a row per case.

    python tests/ring_worker.py
"""

from __future__ import annotations

import json

import jax

DEVICES = 4
jax.config.update("jax_num_cpu_devices", DEVICES)
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jaxmem.compare.tolerances import tolerance  # noqa: E402
from jaxmem.memory.flops import grad_matmul_flops  # noqa: E402
from jaxmem.model.decoder import naive_attention  # noqa: E402
from jaxmem.sharding import AXIS, CONTEXT  # noqa: E402
from jaxmem.step.context import attend_fn, balanced_order  # noqa: E402

# (cp, sequence, query heads, key/value heads, block): grouped and not, a block that does not
# divide a chunk (3 of 4 positions), one that does
CASES = [(2, 16, 4, 2, 4), (4, 32, 4, 1, 3), (4, 32, 2, 2, 8)]
B, K = 2, 8
TOL = tolerance("float64", "fused_vs_naive").kwargs()


def case(cp: int, seq: int, heads: int, kv: int, block: int) -> dict:
    mesh = Mesh(np.array(jax.devices()[:cp]).reshape(1, cp), (AXIS, CONTEXT))
    rng = np.random.default_rng(cp * seq + block)
    q = jnp.asarray(rng.normal(size=(B, seq, heads, K)))
    k, v = (jnp.asarray(rng.normal(size=(B, seq, kv, K))) for _ in range(2))
    g = jnp.asarray(rng.normal(size=(B, seq, heads * K)))
    order = np.asarray(balanced_order(seq, cp))
    pos = jnp.asarray(order, jnp.int32)

    def naive(q, k, v):
        grouped = q.reshape(B, seq, kv, heads // kv, K) if kv < heads else q
        causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
        return jnp.sum(naive_attention(grouped, k, v, causal) * g)

    want = jax.grad(naive, (0, 1, 2))(q, k, v)
    row = {"case": [cp, seq, heads, kv, block]}
    for how in ("gather", "ring"):
        core = attend_fn(mesh, "fused", block, seq, how)

        def loss(q, k, v, core=core):  # the model hands the core its tensors in held order
            return jnp.sum(core(q[:, order], k[:, order], v[:, order], pos) * g[:, order])

        got = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
        pairs = [(jax.jit(loss)(q, k, v), naive(q, k, v)), *zip(got, want, strict=True)]
        row[how] = {  # elementwise within the table's float64 fused-vs-naive tolerance
            "within": [bool(np.allclose(a, b, **TOL)) for a, b in pairs],
            "max_error": max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs),
        }
    return row


def per_device(cp: int, seq: int, heads: int, kv: int, block: int) -> dict:
    """One device's matmul FLOPs (jaxpr) and compiled temporaries of each form's gradient."""
    mesh = Mesh(np.array(jax.devices()[:cp]).reshape(1, cp), (AXIS, CONTEXT))
    q = jax.ShapeDtypeStruct((1, seq, heads, K), jnp.float32)
    kv_shape = jax.ShapeDtypeStruct((1, seq, kv, K), jnp.float32)
    pos = jnp.asarray(balanced_order(seq, cp), jnp.int32)
    out = {}
    for how in ("gather", "ring"):
        core = attend_fn(mesh, "fused", block, seq, how)

        def loss(q, k, v, core=core):
            return jnp.sum(core(q, k, v, pos))

        grad = jax.jit(jax.grad(loss, (0, 1, 2)))
        temp = grad.lower(q, kv_shape, kv_shape).compile().memory_analysis().temp_size_in_bytes
        # the shard_map body has one device's shapes: per device / cp, as the records divide
        # (the ratio of the two forms is what the test reads)
        flops = grad_matmul_flops(loss, q, kv_shape, kv_shape) // cp
        out[how] = {"flops": flops, "temp_bytes": int(temp)}
    return out


def main() -> None:
    rows = [case(*c) for c in CASES]
    # keys and values as large as the queries (no grouping), blocks dividing the chunks
    rows.append({"case": "per_device", **per_device(4, 4096, 4, 4, 256)})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

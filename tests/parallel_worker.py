"""Run by ``tests/test_parallel.py`` in a subprocess: JAX fixes its CPU device count when its
backends start, so the N-device runs need a process of their own. Trains ``tiny`` for a few
AdamW steps on one device and under each strategy over ``DEVICES`` CPU devices, from the same
weights and batches, and prints JSON: per case and strategy, the losses and the per-device
bytes of parameters and optimizer state actually resident on the first device. A case with
``"stream": true`` also runs each strategy's streamed step (``jaxmem.step.stream``) as
``"<strategy>+stream"``. A case with ``"tp": T`` runs each strategy on a data x tensor mesh
(``DEVICES // T`` x ``T``: Megatron's tensor parallelism on the second axis) and, with
``"tp_alone": true``, tensor parallelism alone over ``T`` devices as ``"tp"``; ``"preset"``
names the model (default ``tiny``); ``"loss_chunks": N`` runs the head and loss in N chunks.

    python tests/parallel_worker.py '[{"policy": "full", "precision": "fp32", ...}]'
"""

from __future__ import annotations

import json
import sys

import jax

DEVICES = 4
jax.config.update("jax_num_cpu_devices", DEVICES)

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxmem.config import PRESETS, AccumConfig, OptimizerConfig  # noqa: E402
from jaxmem.data import lm_batch  # noqa: E402
from jaxmem.memory.remat import layers_fn  # noqa: E402
from jaxmem.model import make_model  # noqa: E402
from jaxmem.parallel import STRATEGIES, ParallelConfig  # noqa: E402
from jaxmem.policy import get_policy  # noqa: E402
from jaxmem.precision import PRECISIONS  # noqa: E402
from jaxmem.sharding import parallel_loss, per_device_bytes, step_shardings  # noqa: E402
from jaxmem.step import stream as streaming  # noqa: E402
from jaxmem.step.scaling import init_loss_scale  # noqa: E402
from jaxmem.step.train_step import (  # noqa: E402
    lm_loss_fn,
    make_optimizer,
    make_train_step,
    place,
    tree_bytes,
)

BATCH, SEQ = 8, 32


def run(case: dict, parallel: ParallelConfig, stream: bool = False) -> dict:
    precision = PRECISIONS[case["precision"]]
    opt_cfg = OptimizerConfig(state_memory=case.get("state_memory", "device"))
    accum = AccumConfig(steps=case.get("accum", 1))
    cfg = PRESETS[case.get("preset", "tiny")]
    g, params = nnx.split(make_model(cfg, precision, seed=0), nnx.Param)
    tx = make_optimizer(opt_cfg)
    layers = layers_fn(get_policy(case["policy"]), cfg.n_layers)
    chunks = case.get("loss_chunks", 0)
    loss = lm_loss_fn(g, layers_fn=layers, loss_chunks=chunks)
    sh = None
    if parallel.sharded:
        sh = step_shardings(
            parallel, params, jax.eval_shape(tx.init, params), state_memory=opt_cfg.state_memory
        )
        loss = parallel_loss(
            lambda lf: lm_loss_fn(g, layers_fn=lf, loss_chunks=chunks), layers, parallel, sh.mesh
        )
        params = jax.device_put(params, sh.params)
        opt_state = jax.jit(tx.init, out_shardings=sh.opt_state)(params)
    else:
        opt_state = place(tx.init(params), opt_cfg.state_memory)
    step = make_train_step(
        loss, tx, precision=precision, accum=accum, opt_cfg=opt_cfg, shardings=sh
    )
    if stream:
        where = streaming.placement(tx, params, sh, parallel)
        params, opt_state = streaming.place(params, streaming.init_state(tx, params), where)
        step = streaming.make_streamed_step(
            lambda lf: parallel_loss(
                lambda f: lm_loss_fn(g, layers_fn=f, loss_chunks=chunks), lf, parallel, sh.mesh
            ),
            layers,
            tx,
            accum_steps=accum.steps,
            accum_dtype=jnp.dtype(precision.accum_dtype),
            shardings=sh,
            placement=where,
        )
    scale = init_loss_scale(precision)
    losses = []
    for i in range(case["steps"]):
        x, y = lm_batch(cfg, BATCH, SEQ, seed=100 + i)
        batch = {"inputs": jnp.asarray(x), "targets": jnp.asarray(y)}
        if sh is not None:
            batch = jax.device_put(batch, sh.batch)
        params, opt_state, scale, metrics = step(params, opt_state, scale, batch)
        losses.append(float(metrics["loss"]))
    kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(opt_state)}
    out = {}
    if stream:
        _, stack = streaming.split(params)
        out = {
            "stack_memory_kinds": sorted(
                {x.sharding.memory_kind for x in jax.tree_util.tree_leaves((stack, opt_state[1]))}
            ),
            "stack_bytes": per_device_bytes((stack, opt_state[1])),
            "stack_whole_bytes": tree_bytes((stack, opt_state[1])),
        }
    return {
        **out,
        "losses": losses,
        "params_bytes": per_device_bytes(params),
        "opt_state_bytes": per_device_bytes(opt_state),
        "opt_state_memory_kinds": sorted(kinds),
    }


def main() -> None:
    out = []
    for case in json.loads(sys.argv[1]):
        row = {"case": case}
        if case.get("one_device", True):
            row["one_device"] = run(case, ParallelConfig())
        tp = case.get("tp", 1)  # a data x tensor mesh of DEVICES: DEVICES // tp x tp
        if tp > 1 and case.get("tp_alone"):  # tensor parallelism over tp devices, no data axis
            row["tp"] = run(case, ParallelConfig(devices=tp, tp=tp))
        for strategy in case.get("strategies", STRATEGIES):
            parallel = ParallelConfig(strategy=strategy, devices=DEVICES, tp=tp)
            row[strategy] = run(case, parallel)
            if case.get("stream"):
                row[f"{strategy}+stream"] = run(case, parallel, stream=True)
        out.append(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Run by ``tests/test_parallel.py`` in a subprocess: JAX fixes its CPU device count when its
backends start, so the N-device runs need a process of their own. Trains ``tiny`` for a few
AdamW steps on one device and under each strategy over ``DEVICES`` CPU devices, from the same
weights and batches, each step built as ``jaxmem train`` builds it (``jaxmem.step.build``),
and prints JSON: per case and strategy, the losses and the per-device bytes of parameters and
optimizer state actually resident on the first device. A case with
``"stream": true`` also runs each strategy's streamed step (``jaxmem.step.stream``) as
``"<strategy>+stream"``. A case with ``"tp": T`` runs each strategy on a data x tensor mesh
(``DEVICES // T`` x ``T``: Megatron's tensor parallelism on the second axis) and, with
``"tp_alone": true``, tensor parallelism alone over ``T`` devices as ``"tp"``; ``"preset"``
names the model (default ``tiny``); ``"loss_chunks": N`` runs the head and loss in N chunks;
``"optimizer"`` holds further ``OptimizerConfig`` settings (a schedule, clipping). ``"cp": C``
(and ``"cp_alone"``) does the same with a context axis, and ``"ring": true`` each strategy's mesh
again with ``cp_attention="ring"`` as ``"<strategy>+ring"``; ``"attention"`` sets the model's.

    python tests/parallel_worker.py '[{"policy": "full", "precision": "fp32", ...}]'
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax

DEVICES = 4
jax.config.update("jax_num_cpu_devices", DEVICES)

import jax.numpy as jnp  # noqa: E402

from jaxmem.config import PRESETS, AccumConfig, OptimizerConfig  # noqa: E402
from jaxmem.data import lm_batch  # noqa: E402
from jaxmem.model import make_model  # noqa: E402
from jaxmem.parallel import STRATEGIES, ParallelConfig  # noqa: E402
from jaxmem.policy import LossPolicy, get_policy  # noqa: E402
from jaxmem.precision import PRECISIONS  # noqa: E402
from jaxmem.sharding import per_device_bytes  # noqa: E402
from jaxmem.step import stream as streaming  # noqa: E402
from jaxmem.step.build import build_step  # noqa: E402
from jaxmem.step.scaling import init_loss_scale  # noqa: E402
from jaxmem.step.spec import StepSpec  # noqa: E402
from jaxmem.step.train_step import (  # noqa: E402
    tree_bytes,
)

BATCH, SEQ = 8, 32


def run(case: dict, parallel: ParallelConfig, stream: bool = False) -> dict:
    precision = PRECISIONS[case["precision"]]
    cfg = PRESETS[case.get("preset", "tiny")]
    cfg = dataclasses.replace(cfg, attention=case.get("attention", cfg.attention))
    spec = StepSpec(
        model=cfg,
        policy=get_policy(case["policy"]).replace(loss=LossPolicy(case.get("loss_chunks", 0))),
        precision=precision,
        optimizer=OptimizerConfig(
            **case.get("optimizer", {}),
            state_memory=case.get("state_memory", "device"),
            stream=stream,
        ),
        batch=BATCH,
        seq_len=SEQ,
        accum=AccumConfig(steps=case.get("accum", 1)),
        parallel=parallel,
    )
    built, params = build_step(spec, make_model(cfg, precision, seed=0))
    params, opt_state = built.state(params)
    step, sh = built.step, built.shardings
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
        cp = case.get("cp", 1)  # or a data x context mesh
        if tp > 1 and case.get("tp_alone"):  # tensor parallelism over tp devices, no data axis
            row["tp"] = run(case, ParallelConfig(devices=tp, tp=tp))
        if cp > 1 and case.get("cp_alone"):
            row["cp"] = run(case, ParallelConfig(devices=cp, cp=cp))
        for strategy in case.get("strategies", STRATEGIES):
            parallel = ParallelConfig(strategy=strategy, devices=DEVICES, tp=tp, cp=cp)
            row[strategy] = run(case, parallel)
            if case.get("ring"):  # the same mesh, attention round a ring of the context axis
                ring = dataclasses.replace(parallel, cp_attention="ring")
                row[f"{strategy}+ring"] = run(case, ring)
            if case.get("stream"):
                row[f"{strategy}+stream"] = run(case, parallel, stream=True)
        out.append(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

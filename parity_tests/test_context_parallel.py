"""torch_ref's context parallelism (``torch_ref.context``: the extension; PyTorch's stock
``context_parallel`` does not run on CPU, see its docstring) under torchrun, 2 gloo ranks: each
rank holds chunks i and 3 - i of a row's 4, keys and values all-gathered, FSDP2 over both ranks.
Trains as one device does for a GPT block (naive attention, learned positions) and a Llama block
(RoPE at the permuted positions, grouped-query keys, SDPA with a positional mask); ``jaxmem train
--framework torch --mesh cp=2`` logs JAX's losses and resumes bit for bit.

And JAX's ``--mesh cp=2`` from the same initial weights on the same batches logs the same
losses (bound ``adamw_loss``, as the sharded parity suite compares the frameworks).

Run by pytest, this file launches itself under torchrun; under torchrun (``__main__``), every
rank trains the one-device baseline by itself, then the same initial weights over the context
axis on the same batches, and rank 0 prints one JSON line ``{preset: {"one_device": [losses],
"cp": [losses]}}``. Run as ``python FILE jax`` (2 CPU devices), it trains JAX's step over
``cp=2`` from the same weights and prints ``{preset: [losses]}``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxmem.compare.tolerances import tolerance

PRESETS_RUN = ("tiny", "tiny-llama")
BATCH, SEQ, STEPS = 4, 32, 4


@pytest.fixture(scope="module")
def runs():
    from parity_tests.test_sharded_parity import torchrun

    proc = torchrun(os.path.abspath(__file__))
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torch_context_parallelism_trains_as_one_device(runs):
    """cp=2 over 2 torchrun ranks (FSDP2 over both, keys and values gathered): the one-device
    losses within the data-parallel tolerance, for tiny and tiny-llama (fused attention)."""
    tol = tolerance("float32", "data_parallel_loss")
    assert set(runs) == set(PRESETS_RUN)
    for row in runs.values():
        assert len(row["cp"]) == STEPS
        np.testing.assert_allclose(row["cp"], row["one_device"], **tol.kwargs())


@pytest.fixture(scope="module")
def jax_runs():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    cmd = [sys.executable, os.path.abspath(__file__), "jax"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torch_context_parallelism_logs_jax_context_parallel_losses(runs, jax_runs):
    """The same initial weights and batches: torch_ref's cp=2 losses are JAX's cp=2 losses."""
    tol = tolerance("float32", "adamw_loss")
    for name, row in runs.items():
        np.testing.assert_allclose(row["cp"], jax_runs[name], **tol.kwargs())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torch_context_parallel_job_logs_jax_losses_and_resumes(tmp_path):
    """``jaxmem train --framework torch --mesh cp=2`` (2 torchrun ranks) logs the losses of
    ``jaxmem train --mesh cp=2`` over 10 steps (``adamw_loss``); cut back to its step-5
    checkpoint and resumed, it logs the uninterrupted run's losses and gradient norms."""
    from parity_tests.test_sharded_parity import (
        _jaxmem,
        _metrics,
        _torch_logs_jax_losses,
        torchrun,
    )

    common = ["--preset", "tiny-llama", "--mesh", "cp=2", "--batch-size", "4", "--seq-len", "32"]
    common += ["--policy", "full", "--steps", "10", "--checkpoint-every", "5"]
    common += ["--eval-every", "5", "--sample-tokens", "8"]
    out, t = _torch_logs_jax_losses(tmp_path, common)
    assert "each sequence split over cp=2 ranks" in out.stdout
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "torch", resumed)
    shutil.rmtree(resumed / "checkpoints" / "10")
    torchrun("--no-python", *_jaxmem("train", "--out", str(resumed), "--resume"))
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in _metrics(resumed)] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in t
    ]


def _config(name: str):
    import dataclasses

    from jaxmem.config import PRESETS

    cfg = PRESETS[name]  # the Llama block with the fused core (SDPA here, flash in JAX)
    return dataclasses.replace(cfg, attention="fused") if name == "tiny-llama" else cfg


def _batches(cfg) -> list:
    import torch

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


def _initial(cfg):
    import torch

    import torch_ref

    torch.manual_seed(0)
    return torch_ref.Decoder(cfg)


def jax_main() -> None:
    """JAX's step over cp=2 from ``_initial``'s weights, on ``_batches``: one JSON line."""
    import jax

    from jaxmem.compare.weights import load_torch_state_dict
    from jaxmem.model import make_model
    from jaxmem.parallel import parse_mesh
    from jaxmem.policy import get_policy
    from jaxmem.precision import PRECISIONS
    from jaxmem.step.build import build_step
    from jaxmem.step.spec import StepSpec

    out = {}
    for name in PRESETS_RUN:
        cfg, fp32 = _config(name), PRECISIONS["fp32"]
        model = make_model(cfg, fp32)
        load_torch_state_dict(model, _initial(cfg).state_dict())
        spec = StepSpec(
            model=cfg,
            policy=get_policy("full"),
            precision=fp32,
            batch=BATCH,
            seq_len=SEQ,
            parallel=parse_mesh("cp=2"),
        )
        built, params = build_step(spec, model)
        params, opt_state = built.state(params)
        losses = []
        for batch in _batches(cfg):
            b = jax.device_put({k: v.numpy() for k, v in batch.items()}, built.shardings.batch)
            params, opt_state, _, metrics = built.step(params, opt_state, None, b)
            losses.append(float(metrics["loss"]))
        out[name] = losses
    print(json.dumps(out))


def _train(cfg, model, launch, cp: bool) -> list[float]:

    import torch_ref.distributed as tdist
    from jaxmem.config import OptimizerConfig
    from jaxmem.parallel import ParallelConfig
    from jaxmem.policy import get_policy
    from jaxmem.precision import PRECISIONS
    from torch_ref.context import apply_context_parallel, local_batch
    from torch_ref.remat import apply_memory_policy
    from torch_ref.train import accumulate_grads, make_optimizer

    # FSDP2 over both ranks: each holds its columns of the same rows (data x context)
    parallel = ParallelConfig(strategy="fsdp", devices=launch.world_size) if cp else None
    if cp:
        apply_context_parallel(model, seq_len=SEQ, cp=launch.world_size, rank=launch.rank)
    apply_memory_policy(model.blocks, get_policy("full"))
    if cp:
        model = tdist.shard(model, parallel, launch)
    opt = make_optimizer(model, OptimizerConfig())
    divisor = tdist.token_divisor(parallel, launch) if cp else None
    losses = []
    for batch in _batches(cfg):
        if cp:
            batch = local_batch(batch, launch.world_size, launch.rank)
        opt.zero_grad(set_to_none=True)
        fp32 = PRECISIONS["fp32"]
        loss_sum, n = accumulate_grads(model, batch, precision=fp32, divisor=divisor)
        opt.step()
        if cp:
            loss_sum, n = tdist.all_sum(loss_sum), tdist.all_sum(n)
        losses.append(float(loss_sum / n))
    return losses


def main() -> None:
    import copy

    import torch

    import torch_ref.distributed as tdist

    sys.path.insert(0, os.path.dirname(__file__))
    from torch_parallel_worker import finish  # isort: skip

    torch.set_num_threads(1)
    launch = tdist.from_environment()
    tdist.initialize(launch)
    out = {}
    for name in PRESETS_RUN:
        cfg = _config(name)
        initial = _initial(cfg)
        out[name] = {
            "one_device": _train(cfg, copy.deepcopy(initial), launch, cp=False),
            "cp": _train(cfg, copy.deepcopy(initial), launch, cp=True),
        }
    finish(out, launch)


if __name__ == "__main__":
    jax_main() if sys.argv[1:] == ["jax"] else main()

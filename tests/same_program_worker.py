"""Run by ``tests/test_step_spec.py`` in a subprocess (JAX fixes its CPU device count when its
backends start; the fsdp x tp job needs four). For each job named on the command line: the
program ``jaxmem plan`` compiles for it (``jaxmem.planner.plans.lowered_step`` of the spec the
planner builds for the job's candidate) and the program ``jaxmem train`` runs for it (the
``JaxTrainer``'s lowered step, built from real arrays), as StableHLO text; prints JSON.

    python tests/same_program_worker.py plain mixed streamed fsdp_tp loss_chunks adapters
"""

from __future__ import annotations

import json
import sys

import jax

DEVICES = 4
jax.config.update("jax_num_cpu_devices", DEVICES)

from rich.console import Console  # noqa: E402

from jaxmem.adapters import AdapterConfig  # noqa: E402
from jaxmem.config import PRESETS, AccumConfig, OptimizerConfig  # noqa: E402
from jaxmem.job import JobConfig, RunConfig  # noqa: E402
from jaxmem.parallel import ParallelConfig  # noqa: E402
from jaxmem.planner import plans  # noqa: E402
from jaxmem.policy import POLICIES, BlockPolicy, LayerSelection, LossPolicy, MemoryPolicy, StackPart  # noqa: E402
from jaxmem.precision import PRECISIONS  # noqa: E402
from jaxmem.step.spec import StepSpec  # noqa: E402
from jaxmem.train import run  # noqa: E402

# a mixed stack as jaxmem plan writes one: the first block keeps the attention probabilities and
# the projections, the other recomputes all but q/k/v
MIXED = MemoryPolicy(
    name="custom",
    parts=(
        StackPart(
            layers=LayerSelection(first=1),
            block=BlockPolicy(
                save=("attn_probs", "query_proj", "key_proj", "value_proj", "attn_out", "mlp_up")
            ),
        ),
        StackPart(block=BlockPolicy(save=("query_proj", "key_proj", "value_proj"))),
    ),
)
JOBS = {
    "plain": dict(memory=POLICIES["selective"], accum=AccumConfig(steps=2)),
    "mixed": dict(memory=MIXED),
    "streamed": dict(
        memory=POLICIES["full"], optimizer=OptimizerConfig(stream=True), accum=AccumConfig(steps=2)
    ),
    "fsdp_tp": dict(
        memory=POLICIES["selective"],
        parallel=ParallelConfig(strategy="fsdp", devices=4, tp=2),
    ),
    "loss_chunks": dict(
        memory=POLICIES["full"].replace(loss=LossPolicy(2)), precision=PRECISIONS["bf16"]
    ),
    "adapters": dict(
        memory=POLICIES["selective"],
        accum=AccumConfig(steps=2),
        adapters=AdapterConfig(rank=4, targets=("q", "k", "up"), train=("norm",)),
    ),
}


def job_of(name: str) -> JobConfig:
    run_cfg = RunConfig(steps=1, batch_size=4, seq_len=32, eval_batches=1, sample_tokens=0)
    return JobConfig(preset="tiny", model=PRESETS["tiny"], run=run_cfg, **JOBS[name])


def programs(name: str) -> dict[str, str]:
    job = job_of(name)
    planned = plans.lowered_step(StepSpec.of_job(job)).as_text()
    trainer = run.JaxTrainer(run.prepare(job, None), Console(quiet=True))
    return {"plan": planned, "train": trainer.lowered.as_text()}


if __name__ == "__main__":
    print(json.dumps({name: programs(name) for name in sys.argv[1:]}))

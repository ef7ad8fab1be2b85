"""One step, built once: ``StepSpec`` holds everything that decides the compiled training step,
``build_step`` assembles it, and what ``jaxmem plan`` compiles for a job is the program ``jaxmem
train`` runs (lowered in ``tests/same_program_worker.py``, a process with four CPU devices)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmem.adapters import AdapterConfig
from jaxmem.config import PRESETS, AccumConfig, ConfigError, OptimizerConfig
from jaxmem.memory.targets import get_target
from jaxmem.parallel import ParallelConfig
from jaxmem.policy import POLICIES, LossPolicy
from jaxmem.precision import PRECISIONS
from jaxmem.step.spec import StepSpec

WORKER = Path(__file__).with_name("same_program_worker.py")
JOBS = ("plain", "mixed", "streamed", "fsdp_tp", "loss_chunks", "adapters")
EMPTY_MESH = re.compile(
    r"\s*sdy\.mesh @empty_mesh = <\[\]> \{stablehlo\.mesh = \{axes = \[\]\}\}\n"
)
EMPTY_MESH_SHARDING = re.compile(r"sdy\.sharding = #sdy\.sharding<@empty_mesh, \[[^\]]*\]>(, )?")


def _same_computation(text: str, streamed: bool) -> str:
    """``text`` without what placing arrays adds to a program and shapes cannot: on one device
    the trainer's arrays are committed to it, so each argument carries an empty-mesh sharding
    (the plan's shapes are unplaced: a GPU target's compile places them on its device). A
    streamed plan also takes its stack in device memory without donation (a compile from shapes
    cannot place it in host memory, nor donate a device argument to a host output; the plan
    counts both from shapes), so ``@main``'s arguments lose their memory kinds and aliasing.
    Nothing else is touched: any other difference fails."""
    text = EMPTY_MESH_SHARDING.sub("", EMPTY_MESH.sub("\n", text))
    if streamed:
        head, _, rest = text.partition("func.func public @main(")
        signature, _, body = rest.partition("\n")
        signature = re.sub(r'mhlo\.memory_kind = "pinned_host"(, )?', "", signature)
        signature = re.sub(r"tf\.aliasing_output = \d+ : i32(, )?", "", signature)
        text = f"{head}func.func public @main({signature}\n{body}"
    return text.replace(" {}", "")


@pytest.fixture(scope="module")
def programs() -> dict[str, dict[str, str]]:
    proc = subprocess.run(
        [sys.executable, str(WORKER), *JOBS], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("job", JOBS)
def test_what_jaxmem_plan_compiles_is_what_jaxmem_train_runs(programs, job):
    plan, train = programs[job]["plan"], programs[job]["train"]
    assert "func.func public @main" in plan
    if job == "fsdp_tp":  # both placed over the same mesh: the very same text
        assert plan == train
    streamed = job == "streamed"
    assert _same_computation(plan, streamed) == _same_computation(train, streamed)


def test_the_normalisation_keeps_real_differences():
    """The comparison strips placement annotations only: another op or shape still differs."""
    base = "module {\n  func.func public @main(%arg0: tensor<2xf32>) {\n  stablehlo.add\n}"
    assert _same_computation(base, True) != _same_computation(base.replace("add", "multiply"), True)
    assert _same_computation(base, False) != _same_computation(base.replace("2x", "3x"), False)


def test_a_spec_round_trips_through_json_for_a_child_process():
    spec = StepSpec(
        model=PRESETS["tiny"],
        policy=POLICIES["selective"].replace(loss=LossPolicy(2)),
        precision=PRECISIONS["bf16"],
        optimizer=OptimizerConfig(state_memory="pinned_host"),
        batch=8,
        seq_len=32,
        accum=AccumConfig(steps=2, inplace=False),
        parallel=ParallelConfig(strategy="fsdp", devices=4, tp=2),
        target=get_target("h100"),
        adapters=AdapterConfig(rank=4, alpha=16.0, targets=("q", "v", "down"), train=("norm",)),
    )
    assert StepSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batch": 0}, "StepSpec batch=0 must be a positive integer"),
        ({"seq_len": "32"}, "StepSpec seq_len='32' must be a positive integer"),
        ({"policy": "full"}, "StepSpec policy='full' must be a MemoryPolicy"),
        ({"accum": AccumConfig(steps=3)}, "batch size 8 is not divisible by accum steps 3"),
        (
            {"parallel": ParallelConfig(strategy="dp", devices=16)},
            "microbatch size 8 .* does not split over --mesh",
        ),
        ({"donate": False}, "donate=False is for a streamed step"),
    ],
)
def test_a_bad_spec_is_refused_in_one_line_naming_the_value(changes, message):
    fields = dict(model=PRESETS["tiny"], policy=POLICIES["full"], batch=8, seq_len=32)
    with pytest.raises(ConfigError, match=message) as e:
        StepSpec(**{**fields, **changes})
    assert "\n" not in str(e.value)

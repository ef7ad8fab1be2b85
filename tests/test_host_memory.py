"""``--host-memory``: what a step keeps in host memory must fit the limit (default: this
machine's RAM); a step over it is refused in one line before anything compiles, and the planner
skips candidates over it, saying so."""

from __future__ import annotations

import dataclasses

import pytest

from jaxmem.config import PRESETS, OptimizerConfig
from jaxmem.planner.host import OFFLOADED_INPUTS, host_limit, machine_bytes
from tests.test_cli_contract import run_cli


def test_the_default_limit_is_this_machines_memory_and_a_size_needs_a_unit():
    assert host_limit(None)[0] == machine_bytes() > 0
    assert "this machine's RAM" in host_limit(None)[1]
    assert host_limit(512 * 2**30) == (512 * 2**30, "--host-memory")
    done = run_cli("plan", "--preset", "tiny", "--budget", "10MiB", "--host-memory", "100")
    assert done.returncode == 2 and "--host-memory 100: give a unit" in done.stderr


@pytest.mark.parametrize(
    "argv, needs",
    [
        (["memory", "--preset", "tiny-llama", "--target", "h100", "--policies", "offload",
          "--frameworks", "jax"], "offloaded activations"),
        (["train", "--preset", "tiny", "--state-memory", "pinned_host", "--steps", "1"],
         "optimizer state"),
    ],
)  # fmt: skip
def test_a_step_over_the_host_limit_is_one_line_before_anything_compiles(argv, needs):
    done = run_cli(*argv, "--host-memory", "1KiB")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needs in lines[0], lines
    assert "1.00 KiB is allowed (--host-memory)" in lines[0] and "raise --host-memory" in lines[0]


def test_the_devices_of_one_host_share_its_limit():
    """--host-memory is one host's: a mesh's devices on that host (up to 8) each keep their
    bytes there, so 4 devices need 4 x one device's and a 16-device mesh counts 8 per host."""
    from jaxmem.config import ConfigError
    from jaxmem.parallel import parse_mesh
    from jaxmem.planner.host import check_spec, host_share, spec_host_bytes
    from jaxmem.step.spec import StepSpec

    assert [host_share(n) for n in (1, 2, 4, 8, 16, 64)] == [1, 2, 4, 8, 8, 8]
    cfg = PRESETS["tiny-llama"]
    spec = StepSpec(model=cfg, policy=OFFLOADED_INPUTS, batch=4, seq_len=64,
                    parallel=parse_mesh("fsdp=1,cp=4"))  # fmt: skip
    each = sum(spec_host_bytes(spec).values())
    assert each > 0
    check_spec(spec, 4 * each)  # the host holds the 4 devices' bytes
    with pytest.raises(ConfigError) as e:
        check_spec(spec, 4 * each - 1)
    assert "4 devices on the host, each offloaded activations" in str(e.value)


def test_the_planner_searches_offloaded_inputs_and_skips_what_the_host_cannot_hold():
    from jaxmem.memory.targets import get_target
    from jaxmem.planner.predict import FlopModel
    from jaxmem.planner.search import _lattice
    from jaxmem.planner.space import PlanSpace, Problem

    cfg = PRESETS["tiny-llama"]
    space = PlanSpace(
        policies=("full",), mix=(), accum=(1,), state_memory=("device",), tags=False,
        unroll=False, loss_chunks=2, loss_tiles=(16, 64), offload_inputs=True,
    )  # fmt: skip
    problem = Problem(cfg, 1, 64, get_target("h100"), 2**40, OptimizerConfig())
    flops, said = FlopModel(cfg, 64), []
    outcomes, skipped = _lattice(problem, space, flops, said.append)
    policies = [o.candidate.policy for o in outcomes]
    assert skipped == 0 and OFFLOADED_INPUTS in policies
    # the loss whole, in at most 2 chunks, and in tiles of 16 tokens (a tile of 64 tokens is the
    # whole sequence: coarser than 2 chunks, not searched)
    assert sorted({p.loss.chunks for p in policies}) == [0, 2, 4]
    limited = dataclasses.replace(problem, host_memory_bytes=1)
    outcomes, skipped = _lattice(limited, space, flops, said.append)
    assert skipped > 0 and all(not o.candidate.policy.offloads for o in outcomes)
    assert any("skipped: their host bytes" in line for line in said)


def test_the_planner_chooses_offloaded_inputs_where_only_they_fit_and_the_host_holds_them():
    """A budget under ``full``'s plan but over the plan with the block inputs in host memory
    gets the offloaded inputs, and its command offloads them; a host limit under those inputs
    leaves nothing. Compiles are stood in for (1 MiB + the analytic device bytes, the offloaded
    inputs taken off) so the search alone is tested."""
    from jaxmem.cli.flags import job_argv
    from jaxmem.job import JobConfig, RunConfig
    from jaxmem.memory import analytic
    from jaxmem.memory.targets import get_target
    from jaxmem.planner.host import offloaded_activation_bytes
    from jaxmem.planner.search import search
    from jaxmem.planner.space import PlanSpace, Problem, candidate_job
    from jaxmem.precision import PRECISIONS

    cfg, seq, fp32 = PRESETS["tiny"].replace(n_layers=4), 64, PRECISIONS["fp32"]

    def compile_peak(spec):
        est = analytic.saved_activation_bytes(spec.model, spec.policy, 1, seq, fp32)
        hosted = offloaded_activation_bytes(spec.model, spec.policy, 1, seq, fp32)
        return 2**20 + est.device_bytes - hosted, "stand-in"

    space = PlanSpace(
        policies=("full",), mix=(), accum=(1,), state_memory=("device",), tags=False,
        unroll=False, offload_inputs=True,
    )  # fmt: skip
    problem = Problem(cfg, 1, seq, get_target("h100"), 2**20 + 1024, OptimizerConfig())
    result = search(problem, space, compile_peak=compile_peak)
    assert result.chosen.candidate.policy == OFFLOADED_INPUTS
    job = JobConfig(preset="tiny", model=cfg, run=RunConfig(batch_size=1, seq_len=seq))
    argv = job_argv(candidate_job(job, result.chosen.candidate, 1))
    assert argv[argv.index("--policy") + 1] == "full-host"
    limited = dataclasses.replace(problem, host_memory_bytes=1024)
    result = search(limited, space, compile_peak=compile_peak)
    assert result.chosen is None and result.host_skipped == 1

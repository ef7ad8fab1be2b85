"""Test-session setup shared by ``tests/`` and ``parity_tests/``.

One XLA compilation cache for the whole session (JAX's persistent cache, in a fresh temporary
directory removed at the end, inherited by the subprocesses the tests start): the suite compiles
the same tiny train step dozens of times, in-process and in subprocesses, and a cache hit turns a
15 s tiny run into 6 s on 2 cores. Executables loaded from the cache are the ones XLA compiled
(same numerics, same ``memory_analysis()``), so no assertion changes meaning. A cache directory the
user set already (``JAX_COMPILATION_CACHE_DIR``) is left alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_OWN_CACHE: str | None = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _OWN_CACHE = tempfile.mkdtemp(prefix="jaxmem-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    # cache every compile: the suite's are small and repeated
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


# XLA:CPU compiles with LLVM's optimisation level 0: the suite compiles hundreds of tiny
# programs and LLVM's passes are most of each compile (measured on tests/test_train, _checkpoint,
# _chaos and _remat, 2 workers: 190 s -> 146 s). It changes only the machine code XLA emits: the
# HLO passes, remat, buffer assignment and so every memory_analysis() figure are the same, and
# results stay within the tolerance table (a run is compared with runs compiled the same way).
# Benchmarks and the CLI are not affected. A level the user set in XLA_FLAGS is left alone.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()


# Under pytest-xdist (`make test` runs 2 workers) each worker's PyTorch gets its share of the
# cores instead of all of them: N workers x all-core OpenMP pools oversubscribe the machine, which
# made PyTorch up to 7x slower here. OMP_NUM_THREADS is read when torch is first imported (after
# this), and subprocesses the tests start inherit it. A value the user set is left alone.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and not os.environ.get("OMP_NUM_THREADS"):
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


from jaxmem.backend import contain_cuda_plugin  # noqa: E402  (after the cache settings: JAX reads them at import)

# jaxmem[gpu-plan] puts JAX's CUDA plugin in this environment; on a machine without a driver the
# suite runs on the CPU as the CLI does (subprocesses inherit the choice), and where a driver
# exists JAX picks the GPU and the CUDA-only tests run
contain_cuda_plugin()


def pytest_unconfigure(config) -> None:
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The longest files first: `make test` hands whole files to 2 workers in collection order, so a
# long file collected last runs alone at the end while the other worker idles (longest-first is
# the classic fix for that tail). The files holding the slowest tests of a full run on 2 cores
# (pytest --durations), longest first; the rest keep their order. Only the order changes.
LONGEST_FIRST = (
    "parity_tests/test_policies.py",
    "tests/test_cli_contract.py",
    "tests/test_plan.py",
    "tests/test_parallel.py",
    "parity_tests/test_training_parity.py",
    "tests/test_stream.py",
    "parity_tests/test_compare_cli.py",
    "parity_tests/test_memory_parity.py",
    "parity_tests/test_hf_checkpoints.py",
    "tests/test_readme.py",
    "parity_tests/test_model_parity.py",
    "tests/test_gpu_plan.py",
    "tests/test_gpu_check.py",
    "parity_tests/test_sharded_parity.py",
    "parity_tests/test_torch_measure.py",
    "tests/test_chaos.py",
    "tests/test_train.py",
    # files outside the list above that hold a test or fixture of 25 s or more (the 40 slowest
    # durations of a full run): ahead of the many short files, so none of them ends the run
    "tests/test_step_spec.py",
    "tests/test_lora.py",
    "parity_tests/test_replay.py",
    "tests/test_own_step.py",
    "tests/test_replay.py",
    "tests/test_step_time.py",
    "tests/test_qlora.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: tests keep their order within a file and among the rest

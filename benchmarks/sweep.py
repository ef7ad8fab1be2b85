"""Memory, FLOPs and step time across strategies, JAX vs PyTorch, with plots: the same sweep as
``jaxmem bench`` (see ``jaxmem/compare/bench.py`` for the axes and what each figure is).

    python benchmarks/sweep.py        # a few minutes on 2 CPU cores; writes benchmarks/results
"""

from __future__ import annotations

from jaxmem.compare.bench import DEFAULT, run_sweep, set_threads

if __name__ == "__main__":
    set_threads()  # every usable core, set explicitly for both frameworks, before JAX starts
    result = run_sweep(DEFAULT, "benchmarks/results", progress=print)
    if result["meta"]["busy_warning"]:
        print(f"warning: {result['meta']['busy_warning']}")

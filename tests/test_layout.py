"""The architecture, checked: jaxmem's packages import downwards only (``PACKAGE_ORDER``),
jaxmem's core imports no PyTorch, torch_ref imports no JAX, the comparison wing
(``jaxmem.compare``) is the only code that imports both, jaxmem's pure modules import neither
framework, and a JAX-only install (PyTorch unimportable) trains."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
JAX_FAMILY = ("jax", "jaxlib", "flax", "optax", "orbax")
TORCH_FAMILY = ("torch", "torch_ref")
# jaxmem modules that import neither framework: the data both sides share
PURE = (
    "jaxmem.adapters",
    "jaxmem.quant",
    "jaxmem.compat",
    "jaxmem.config",
    "jaxmem.parallel",
    "jaxmem.policy",
    "jaxmem.policy_config",
    "jaxmem.positions",
    "jaxmem.precision",
    "jaxmem.data",
    "jaxmem.tokens",
    "jaxmem.text_sources",
    "jaxmem.instruct",
    "jaxmem.files",
    "jaxmem.figures",
    "jaxmem.memory.analytic",
    "jaxmem.memory.targets",
    "jaxmem.job",
    "jaxmem.run_layout",
    "jaxmem.hf",
    "jaxmem.hf.config",
    "jaxmem.hf.keys",
    "jaxmem.hf.files",
    "jaxmem.hf.tokenizer",
    "jaxmem.hf.chat",
    "jaxmem.hf.adapters",
    "jaxmem.train.loop",
    "jaxmem.train.prepare",
    "jaxmem.train.run_dir",
    "jaxmem.compare.tolerances",
)


# jaxmem's packages from the bottom up. A module imports modules of its own package or of packages
# below it, never above (lazy imports inside functions included): ``base`` is jaxmem's top-level
# modules (config, policy, precision, parallel, data, files, figures, run_layout, backend,
# sharding, distributed, job) and the packages in ``BASE_PACKAGES``; ``model`` the decoder;
# ``memory`` a policy's JAX translation and the measurements that need no train step; ``step`` the
# jitted train step; ``train`` the job around it; ``planner`` records, peaks and the search, which
# compile the step; ``compare`` the PyTorch comparison wing; ``cli`` the command line.
PACKAGE_ORDER = ("base", "model", "memory", "step", "train", "planner", "compare", "cli")
# packages of the base level, pure throughout (every module in ``PURE``): Hugging Face's files
BASE_PACKAGES = ("hf",)


def package_level(module: str) -> int:
    """``module``'s place in ``PACKAGE_ORDER`` (a top-level module of jaxmem, or a module of a
    package in ``BASE_PACKAGES``, is ``base``)."""
    parts = module.split(".")
    assert parts[0] == "jaxmem", module
    if len(parts) > 1 and parts[1] in PACKAGE_ORDER:
        return PACKAGE_ORDER.index(parts[1])
    is_package = (ROOT / "jaxmem" / parts[1] / "__init__.py").exists() if len(parts) > 1 else False
    assert not is_package or parts[1] in BASE_PACKAGES, f"{module}: jaxmem.{parts[1]} has no level"
    return 0


def modules(package: str) -> list[str]:
    base = ROOT / package
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in base.rglob("*.py")
        if p.name != "__main__.py"  # `python -m` runs it: importing it runs the command
    )


def imported(module: str) -> set[str]:
    """Every module ``module``'s source imports, at any depth of the file (lazy imports too)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            # `from package import submodule` imports the submodule too
            out |= {
                f"{node.module}.{a.name}"
                for a in node.names
                if (ROOT / node.module.replace(".", "/") / f"{a.name}.py").exists()
            }
    return out


def top_package(module: str) -> str:
    """``jaxmem.cli.memory`` -> ``cli``."""
    return PACKAGE_ORDER[package_level(module)]


def top(name: str) -> str:
    return name.split(".")[0]


def loaded_after(code: str, block_torch: bool = False) -> set[str]:
    """Top-level packages in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    prelude = BLOCK_TORCH if block_torch else ""
    script = prelude + code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return {top(m) for m in json.loads(proc.stdout.splitlines()[-1])}


# PyTorch made unimportable, as in an environment with `pip install .` only.
BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys

    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("torch", "torch_ref"):
                raise ModuleNotFoundError(f"No module named {name!r} (JAX-only install)")
            return None

    sys.meta_path.insert(0, _NoTorch())
    """
)


def test_packages_import_only_their_own_level_or_below():
    back_edges = sorted(
        f"{m} ({PACKAGE_ORDER[package_level(m)]}) imports {i} ({PACKAGE_ORDER[package_level(i)]})"
        for m in modules("jaxmem")
        for i in imported(m)
        if top(i) == "jaxmem" and i != "jaxmem" and package_level(i) > package_level(m)
    )
    assert not back_edges


def test_every_jaxmem_package_has_a_place_in_the_order():
    packages = {p.name for p in (ROOT / "jaxmem").iterdir() if (p / "__init__.py").exists()}
    placed = set(PACKAGE_ORDER) | set(BASE_PACKAGES)
    assert packages <= placed, packages - placed
    assert not set(BASE_PACKAGES) & set(PACKAGE_ORDER)
    assert {package_level(f"jaxmem.{p}.x") for p in BASE_PACKAGES} == {0}


def test_the_base_packages_are_pure_throughout():
    for package in BASE_PACKAGES:
        found = set(modules(f"jaxmem/{package}"))
        assert found and found <= set(PURE), found - set(PURE)


def test_the_core_imports_no_pytorch_anywhere_in_its_source():
    core = [m for m in modules("jaxmem") if not m.startswith("jaxmem.compare")]
    offenders = {m: {i for i in imported(m) if top(i) in TORCH_FAMILY} for m in core}
    assert not {m: v for m, v in offenders.items() if v}
    # and none of it imports the comparison wing, which would pull PyTorch in
    assert not {
        m
        for m in core
        if any(i.startswith("jaxmem.compare") for i in imported(m)) and top_package(m) != "cli"
    }


def test_the_cli_reaches_the_frameworks_only_lazily():
    """The CLI's modules import no framework and no jaxmem.compare at start, only inside the
    commands that run them: `jaxmem --help` and a bad flag load neither JAX nor PyTorch."""
    for path in sorted((ROOT / "jaxmem/cli").glob("*.py")):
        tree = ast.parse(path.read_text())
        at_start = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
        at_start |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in at_start if top(m) in (*TORCH_FAMILY, *JAX_FAMILY)}, path
        assert not {m for m in at_start if m.startswith("jaxmem.compare")}, path
    loaded = loaded_after("from jaxmem.cli import build_parser\nbuild_parser()")
    assert not loaded & {*JAX_FAMILY, *TORCH_FAMILY}


def test_torch_ref_imports_no_jax_and_only_jaxmems_pure_modules():
    for m in modules("torch_ref"):
        names = imported(m)
        assert not {i for i in names if top(i) in JAX_FAMILY}, m
        assert {i for i in names if top(i) == "jaxmem"} <= set(PURE), (m, names)


def test_torch_ref_imports_nothing_from_jaxmems_training_package():
    """torch_ref stands beside the JAX wing, not above it: the run layout its checkpoints share
    with JAX runs is a base module (``jaxmem.run_layout``), and the shared step loop is the
    comparison wing's to drive (``jaxmem.compare.torch_run``)."""
    offenders = {
        m: {i for i in imported(m) if i == "jaxmem.train" or i.startswith("jaxmem.train.")}
        for m in modules("torch_ref")
    }
    assert not {m: v for m, v in offenders.items() if v}


def test_pure_modules_import_no_framework_in_their_source():
    for m in PURE:
        assert not {i for i in imported(m) if top(i) in (*JAX_FAMILY, *TORCH_FAMILY)}, m
        assert not {
            i
            for i in imported(m)
            if i.startswith("jaxmem.") and i not in PURE and i != "jaxmem.train.checkpoint"
        }, m


@pytest.mark.slow
def test_importing_the_core_loads_no_pytorch_and_torch_ref_loads_no_jax():
    core = [m for m in modules("jaxmem") if not m.startswith("jaxmem.compare")]
    loaded = loaded_after("\n".join(f"import {m}" for m in core))
    assert "jax" in loaded and not loaded & set(TORCH_FAMILY)
    loaded = loaded_after("\n".join(f"import {m}" for m in modules("torch_ref")))
    assert "torch" in loaded and not loaded & set(JAX_FAMILY)
    loaded = loaded_after("\n".join(f"import {m}" for m in PURE))
    assert not loaded & {*JAX_FAMILY, *TORCH_FAMILY}


@pytest.mark.slow
def test_a_jax_only_install_trains(tmp_path):
    """`pip install .` without the torch extra: `jaxmem train` works and loads no PyTorch;
    asking for PyTorch gives one line naming the extra (CI also checks a real fresh venv)."""
    out = tmp_path / "run"
    code = (
        "from jaxmem.cli import main\n"
        f"assert main(['train', '--preset', 'tiny', '--steps', '5', '--batch-size', '4', "
        f"'--seq-len', '32', '--sample-tokens', '8', '--out', {str(out)!r}]) == 0\n"
    )
    loaded = loaded_after(code, block_torch=True)
    assert not loaded & set(TORCH_FAMILY)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + "from jaxmem.cli import main\nmain(['parity'])"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "jaxmem parity: error: jaxmem parity needs PyTorch, which is not installed: "
        "pip install 'jaxmem[torch]'"
    )


@pytest.mark.parametrize("package", ["jaxmem", "torch_ref"])
def test_no_import_cycles_between_modules(package):
    """A module never imports one that (through the same package) imports it back."""
    known = set(modules("jaxmem") + modules("torch_ref"))
    graph = {m: imported(m) & known for m in known}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = [m for m in modules(package) if m in reach(m)]
    assert not cycles

"""The README's commands run as shown on a fresh clone: every ``jaxmem`` command in its ``bash``
blocks is run here (in a scratch directory), except a block the README marks as not run
(``<!-- not run by the README test: why -->`` on the line before it: a GPU's work, minutes of
training, several hosts), and its Python snippet runs as a script, printing what its comment
says and nothing else. The README's relative links resolve."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tests.test_cli_contract import assert_no_stray_lines

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIP = "<!-- not run by the README test"
RUN = ("jaxmem ", "torchrun ")  # the commands a user types after installing


def readme_commands() -> list[str]:
    """The ``jaxmem ...`` and ``torchrun ...`` lines of the README's bash blocks (continuations
    joined)."""
    lines = README.read_text().splitlines()
    commands, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            skipped = i > 0 and lines[i - 1].strip().startswith(SKIP)
            i += 1
            block = []
            while lines[i].strip() != "```":
                block.append(lines[i])
                i += 1
            if not skipped:
                text = re.sub(r"\\\n\s*", " ", "\n".join(block))
                for line in text.splitlines():
                    line = line.split(" #", 1)[0].strip()
                    if line.startswith(RUN):
                        commands.append(line)
        i += 1
    return commands


def test_the_readme_is_a_short_guide_with_the_two_commands_first():
    text = README.read_text()
    assert len(text.encode()) < 15_000
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    assert "make demo" in first_block and "make test" in first_block
    assert not re.search(r"\bissue \d+", text, re.IGNORECASE)


def test_the_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), target


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One directory for all the README's commands, run in order: a later command may use
    what an earlier one wrote (a run directory to plot or resume)."""
    return tmp_path_factory.mktemp("readme")


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        pytest.param(c, marks=pytest.mark.multiprocess) if c.startswith("torchrun") else c
        for c in readme_commands()
    ],
)
def test_a_readme_command_runs_as_shown(command, scratch):
    argv = shlex.split(command)
    if argv[0] == "jaxmem":
        argv = [sys.executable, "-m", "jaxmem.cli", *argv[1:]]
    else:  # the environment's own launcher, as the user's shell finds it
        argv[0] = os.path.join(os.path.dirname(sys.executable), argv[0])
    bin_dir = os.path.dirname(sys.executable)  # an activated environment: torchrun finds jaxmem
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    proc = subprocess.run(
        argv,
        cwd=scratch,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "100", "PATH": path},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason="the snippet plans for an H100: needs the gpu-plan extra (make test installs it)",
)
def test_the_readme_python_snippet_runs_quietly_and_prints_what_it_says(tmp_path):
    """With the gpu-plan extra and no GPU too: importing jaxmem's tools first starts JAX on the
    CPU without the CUDA plugin's lines or traceback."""
    (snippet,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""
    assert_no_stray_lines(proc.stdout)
    (printed,) = proc.stdout.splitlines()
    assert f"# {printed};" in snippet, printed

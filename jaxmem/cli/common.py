"""What every command shares: exit codes, the one-line usage error, argument types (sizes such as
``70GiB`` among them), the checks for PyTorch, a JAX backend and an output path. Imports no JAX
and no PyTorch at start."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
from collections.abc import Iterator, Sequence

from jaxmem.config import ConfigError

EXIT_USAGE = 2
EXIT_PARITY_FAILED = 1
EXIT_RUN_FAILED = 1  # a training run stopped at run time (non-finite loss, out of memory, disk)
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM (128 + SIGINT), after saving the step
TORCH_EXTRA = "pip install 'jaxmem[torch]'"


class UsageError(Exception):
    """Bad user input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (not the usage block) and exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@contextlib.contextmanager
def usage_errors(*types: type[Exception]) -> Iterator[None]:
    """Report ``ConfigError`` (and ``types``) raised in the block as a usage error: one line
    naming the value, exit code 2."""
    try:
        yield
    except (ConfigError, *types) as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------------------- argument types
def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{value} is not a seed: use 0 .. {2**32 - 1}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{value} must be positive and finite")
    return value


def int_list(text: str, flag: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; anything else is a usage error naming ``flag``."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag} {text!r}: give comma-separated positive integers") from None
    if not values or min(values) <= 0:
        raise UsageError(f"{flag} {text!r}: give comma-separated positive integers, e.g. 1,2,4")
    return values


MOST_BYTES = 2**63  # sizes are int64 bytes in XLA's and torch's memory statistics


def parse_bytes(text: str, flag: str | None = None) -> int:
    """``70GiB``, ``200MiB``, ``1.5GB``, ``4096B`` -> bytes; bad text raises ``ConfigError``
    (``flag``: the option it came from, named in the message). A number without a unit is
    refused: ``100`` is as likely meant in GiB as in bytes."""
    units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    number = t.rstrip("KMGTIB")
    unit = t[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    said = f"{flag} {text}" if flag else f"budget {text!r}"
    if (unit and unit not in units) or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{said} is not a size: give a positive number with a unit, e.g. 70GiB, 512MiB or 1.5GB"
        )
    if not unit:
        n = text.strip()
        raise ConfigError(f"{said}: give a unit, e.g. {n}GiB, {n}MiB or {n}B")
    count = value * units[unit]
    if not count < MOST_BYTES:  # 1e300GiB overflows to inf; no memory is 8 EiB or more
        raise ConfigError(f"{said} is more than any machine's memory: give e.g. 70GiB or 512MiB")
    return int(count)


def names(text: str, valid: Sequence[str], what: str) -> list[str]:
    """Comma-separated names, each once, in the order given."""
    given = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in given if n not in valid]
    if bad or not given:
        raise UsageError(f"unknown {what} {bad or [text]}; choose from: {', '.join(valid)}")
    return given


# ----------------------------------------------------------------------------------- checks
def torch_available() -> bool:
    """Whether PyTorch imports (only asked by the commands that compare with it)."""
    try:
        importlib.import_module("torch")
    except ImportError:
        return False
    return True


def need_torch(what: str) -> None:
    """One line and exit 2 when a command that compares with PyTorch runs without it."""
    if not torch_available():
        raise UsageError(f"{what} needs PyTorch, which is not installed: {TORCH_EXTRA}")


def need_jax_backend() -> None:
    """One line and exit 2 when JAX cannot start the backend ``JAX_PLATFORMS`` asks for (it
    raises a bare AssertionError or RuntimeError on first use)."""
    import jax

    from jaxmem.backend import quiet_native_stderr

    try:
        with quiet_native_stderr(drop_on_error=True):  # the plugin's traceback: said below
            jax.devices()
    except Exception as e:  # jax raises AssertionError / RuntimeError, varying by version
        wanted = os.environ.get("JAX_PLATFORMS", "")
        if any(p in wanted.lower() for p in ("cuda", "gpu")):
            raise UsageError(
                f"JAX has no CUDA backend here (JAX_PLATFORMS={wanted!r}): install "
                "'jaxmem[cuda]' on a machine with an NVIDIA driver, or unset JAX_PLATFORMS"
            ) from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UsageError(
            f"JAX cannot start a backend for JAX_PLATFORMS={wanted!r} ({first}); unset it or "
            "set it to cpu"
        ) from None


def check_writable(path: str | None, flag: str = "--json") -> None:
    """The directory an output file goes to exists and is writable."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path}: directory {parent} is not writable")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a directory; give a file name")


def need_gpu_plan(target) -> None:
    """A GPU target needs ``jaxmem[gpu-plan]`` (or a GPU); one line when it is missing."""
    if target.is_gpu:
        from jaxmem.memory.gpu_plan import require_gpu_plan

        with usage_errors():
            require_gpu_plan(target)


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


# ------------------------------------------------------------------------------ plan budgets
def check_budget(
    problem, space, given: str | None, flag: str, leave: str, elsewhere: str = ""
) -> None:
    """A budget no configuration in ``space`` can meet, refused in one line before any trace or
    compile (``jaxmem plan --budget``, ``jaxmem train --policy auto --memory-budget``):

    - above the target's memory (a GPU's, or this machine's for the local backend): a budget
      cannot be more than the device has;
    - below the step's arguments alone (``planner.predict.argument_floor``, from shapes): no
      memory policy fits it.

    ``given``: the budget's text (None: the target's default budget, not checked against the
    ceiling); ``leave``: the flags that let more of the arguments leave the device;
    ``elsewhere``: how to plan for another machine's memory, said with the local ceiling."""
    from jaxmem.figures import format_bytes
    from jaxmem.planner.predict import argument_floor

    target, budget = problem.target, problem.budget_bytes
    if given is not None:
        if target.device_memory_bytes is not None:
            has, whose = target.device_memory_bytes, f"the {target.description} has"
        else:
            has = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            whose = "this machine's memory (the local backend's device)"
        if budget > has:
            other = f", or {elsewhere}" if elsewhere and not target.is_gpu else ""
            raise UsageError(
                f"{flag} {given} is more than {whose} ({format_bytes(has)}): give at most "
                f"that{other}"
            )
    floor, how = argument_floor(problem, space)
    if budget < floor:
        said = f"{flag} {given}" if given is not None else "the default budget"
        raise UsageError(
            f"{said} ({format_bytes(budget)}) is below the smallest possible step: its arguments "
            f"alone take {format_bytes(floor)} per device ({how}); no memory policy can fit it: "
            f"give at least that, or let more of the arguments leave the device ({leave})"
        )


def search_progress(console):
    """The planner's progress lines (one per compile), dim, on ``console``."""
    return lambda text: console.print(text, style="dim")

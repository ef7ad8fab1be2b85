"""Files and directories a command writes: atomic file writes (a reader, or a run killed
mid-write, sees the old file or the new one, never half of one), the check that an output
directory can be made where it is asked for, and the missing directories above an output made
for one write and removed again when that write fails (pure: no JAX, no PyTorch)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from jaxmem.config import ConfigError


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` beside ``path`` and rename it into place."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json_atomic(path: str, payload: Any) -> None:
    write_atomic(path, json.dumps(payload, indent=2) + "\n")


def check_can_create(path: str | os.PathLike[str], flag: str = "--out") -> None:
    """The directory ``path`` can be made (or written, if it exists): it is not a file, and the
    nearest directory that exists at or above it takes new entries. Tried by making and removing
    an empty directory there: ``os.access`` says yes to root even on a read-only mount. Writes
    nothing; ``ConfigError`` naming ``flag``, the path and the fix otherwise."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file; give a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(
            f"{flag} {path}: {existing} is a file, not a directory; choose another {flag}"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jaxmem-write-test-", dir=existing))
    except OSError:
        raise ConfigError(
            f"{flag} {path}: {existing} is not writable; choose another {flag}"
        ) from None


def missing_dirs(path: str | os.PathLike[str]) -> list[str]:
    """``path`` and the directories above it that do not exist, deepest first (what making
    ``path`` would create, and what to remove to undo it)."""
    missing, found = os.path.abspath(path), []
    while not os.path.exists(missing):
        found.append(missing)
        missing = os.path.dirname(missing)
    return found


@contextlib.contextmanager
def made_dirs(path: str | os.PathLike[str]) -> Iterator[None]:
    """Make ``path`` and the directories missing above it for the block; if the block raises,
    remove the ones made here again (when empty), so a failed write leaves no directories."""
    made = missing_dirs(path)
    os.makedirs(path, exist_ok=True)
    try:
        yield
    except BaseException:
        for directory in made:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise

"""Where a run keeps its checkpoints, how each proves it is whole, and how to read a checkpoint's
saved config without loading any array (pure: no JAX, no PyTorch). A base module, below both
frameworks' training code: torch_ref's checkpoints use it without importing ``jaxmem.train``.

Two layouts live under ``<run>/checkpoints/<step>/``:

- JAX runs: orbax items (``jaxmem.train.checkpoint``);
- PyTorch runs: ``state.pt`` (``torch_ref.checkpoint``), ``run_config.json`` and ``meta.json``.

Integrity, the same for both: once a step's files are on disk, ``write_manifest`` records every
file's size and SHA-256 in ``manifest.json``, written last (beside it, fsync'd, renamed into place).
A step counts only if its manifest verifies (``verify``): a save killed before the manifest, a
truncated or bit-flipped file, a missing or foreign file, all make it fail, with the reason in a
few words. ``newest_verified`` picks the checkpoint to resume from and names the newer ones it
skipped; ``rotate`` keeps the newest ``keep`` verified steps and never deletes a verified step on
account of a newer bad one. A run moves a skipped step out of the way (``quarantine``) instead of
deleting it: it is the user's data.

``jaxmem.train.checkpoint.latest_checkpoint`` reads either, so resuming a torch run as a JAX run
(or the reverse) is refused by the config comparison, with a message naming ``run.framework``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Any

CHECKPOINT_DIR = "checkpoints"
QUARANTINE_DIR = "quarantine"  # <run>/quarantine/checkpoint-<step>: skipped steps, kept
RUN_CONFIG_JSON = "run_config.json"  # PyTorch layout
META_JSON = "meta.json"  # PyTorch layout
MANIFEST = "manifest.json"  # both layouts: written last
MANIFEST_FORMAT = "jaxmem-checkpoint-manifest-v1"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, corrupt or does not fit the run being resumed. The
    message names the directory and how to fix it."""


def step_dirs(directory: str) -> list[int]:
    """The step directories under ``directory`` (names made of digits), ascending, whole or not."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        int(name)
        for name in os.listdir(directory)
        if name.isdigit() and os.path.isdir(os.path.join(directory, name))
    )


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names]
    return sorted(f for f in out if f != MANIFEST and not f.startswith(MANIFEST + "."))


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(step_dir: str, step: int) -> None:
    """Record every file of ``step_dir`` (size, SHA-256) in its ``manifest.json``, written last
    and atomically; the files are fsync'd first, so the manifest never vouches for bytes still
    in the page cache."""
    files = {}
    for rel in _files(step_dir):
        path = os.path.join(step_dir, rel)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[rel] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    payload = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    tmp = os.path.join(step_dir, f"{MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))
    fsync_dir(step_dir)


def verify(step_dir: str, *, checksums: bool = True) -> str | None:
    """None when ``step_dir`` is whole (every file its manifest lists, with that size and, with
    ``checksums``, that SHA-256, and no other file); otherwise why not, in a few words."""
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return "no integrity manifest (its save did not finish, or an older jaxmem wrote it)"
    except (OSError, ValueError) as e:
        return f"its manifest is unreadable ({type(e).__name__})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return "its manifest is not a jaxmem checkpoint manifest"
    listed = manifest.get("files") or {}
    on_disk = set(_files(step_dir))
    missing, foreign = sorted(set(listed) - on_disk), sorted(on_disk - set(listed))
    if missing:
        return f"file {missing[0]} is missing"
    if foreign:
        return f"file {foreign[0]} was not part of the save"
    for rel, entry in sorted(listed.items()):
        size = os.path.getsize(os.path.join(step_dir, rel))
        if size != entry["bytes"]:
            return f"file {rel} has {size} bytes, {entry['bytes']} when saved (truncated?)"
    if checksums:
        for rel, entry in sorted(listed.items()):
            if _sha256(os.path.join(step_dir, rel)) != entry["sha256"]:
                return f"file {rel} changed since it was saved (checksum mismatch)"
    return None


def newest_verified(directory: str) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest step of ``directory`` that verifies (checksums included), and the newer steps
    skipped on the way, each with its reason."""
    skipped = []
    for step in reversed(step_dirs(directory)):
        reason = verify(os.path.join(directory, str(step)))
        if reason is None:
            return step, skipped
        skipped.append((step, reason))
    return None, skipped


def rotate(directory: str, keep: int) -> list[int]:
    """Delete verified steps older than the newest ``keep`` verified ones (sizes checked, not
    checksums: each was verified when written); steps that do not verify are left alone, so a
    bad newer step never costs a good older one. Returns the deleted steps."""
    verified = [
        s
        for s in step_dirs(directory)
        if verify(os.path.join(directory, str(s)), checksums=False) is None
    ]
    doomed = verified[:-keep] if keep > 0 else []
    for step in doomed:
        shutil.rmtree(os.path.join(directory, str(step)))
    return doomed


def quarantine(run_dir: str, step: int) -> str:
    """Move checkpoint ``step`` of run ``run_dir`` out of the checkpoint directory (into
    ``<run>/quarantine/``), keeping it for inspection; returns where it went."""
    target_dir = os.path.join(run_dir, QUARANTINE_DIR)
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, f"checkpoint-{step}")
    if os.path.exists(target):
        target += f"-{time.strftime('%Y%m%d-%H%M%S')}"
    os.replace(os.path.join(run_dir, CHECKPOINT_DIR, str(step)), target)
    return target


def read_json_config(directory: str, step: int) -> dict[str, Any]:
    """The run config saved with ``step`` in the PyTorch layout."""
    path = os.path.join(directory, str(step), RUN_CONFIG_JSON)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {directory}/{step} has no readable {RUN_CONFIG_JSON} ({e}); "
            "delete that step directory to resume from an earlier one"
        ) from None

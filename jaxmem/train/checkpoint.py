"""Saving and resuming a JAX training run: a thin layer over ``orbax.checkpoint.CheckpointManager``
(the checkpoint layout of JAX runs; see ``jaxmem.run_layout``).

One checkpoint is one step directory ``<directory>/<step>/`` holding five orbax items:

- ``params``, ``opt_state``: pytrees of arrays (``StandardSave``); the parameters stay an
  ``nnx.State`` and the optimizer state keeps its optax structure on restore;
- ``loss_scale``: the fp16 ``DynamicLossScale`` (only when there is one);
- ``run_config``: the resolved run configuration, a JSON dict, readable without restoring any
  array (``read_config``) so that a resume can be refused before anything is built;
- ``meta``: JSON: the format version, whether a loss scale was saved, and the caller's ``extra``
  dict (last loss, data-iterator position, rng info, ...).

Atomicity: on a local (POSIX) filesystem orbax writes a step into
``<directory>/<step>.orbax-checkpoint-tmp``, writes ``commit_success.txt`` into it and only then
renames it to ``<directory>/<step>`` (``AtomicRenameTemporaryPath``, orbax's default for
non-GCS paths). Directories still carrying the ``.orbax-checkpoint-tmp`` suffix are never listed
as steps, so a save interrupted at any point is invisible to ``latest_step``; they are deleted
when the next ``RunCheckpointer`` is opened on the directory. ``save`` waits for the write and
the rename to finish (``wait_until_finished``), so a process killed (even by SIGKILL) after
``save`` returned leaves a complete checkpoint. Orbax does not fsync: an OS crash or power loss
right after a save can still lose it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

import jaxmem.run_layout as layout
from jaxmem.run_layout import CHECKPOINT_DIR, CheckpointError, read_json_config

FORMAT_VERSION = 1
TMP_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp"
ARRAY_ITEMS = ("params", "opt_state", "loss_scale")
JSON_ITEMS = ("run_config", "meta")


@contextlib.contextmanager
def _quiet_orbax(quiet_errors: bool = False) -> Iterator[None]:
    """Hide orbax's absl WARNING chatter (e.g. about its own defaults) during our calls; errors
    still show, unless ``quiet_errors`` (a failed save is reported by jaxmem in one line, not
    as pages of absl tracebacks). absl logs through the standard ``logging`` logger ``absl``."""
    logger = logging.getLogger("absl")
    old = logger.level
    level = logging.CRITICAL if quiet_errors else logging.ERROR
    if logger.getEffectiveLevel() < level:
        logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(old)


@contextlib.contextmanager
def contain_background_errors() -> Iterator[None]:
    """While orbax writes: errors its background threads and asyncio tasks hit (after the save
    itself has failed, e.g. ENOSPC reported once per array) are not printed as pages of
    tracebacks; the failure reaches the caller once, as the save's exception."""
    import sys
    import threading

    logger = logging.getLogger("asyncio")
    old = (logger.level, sys.unraisablehook, threading.excepthook)
    logger.setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda unraisable: None
    threading.excepthook = lambda args: None
    try:
        yield
    finally:
        logger.setLevel(old[0])
        sys.unraisablehook, threading.excepthook = old[1], old[2]


_SILENCED = False


def silence_background_errors() -> None:
    """After a failed save, for the rest of the process: orbax's leftover threads and
    tensorstore's callbacks keep failing after the save has raised (a full disk fails every
    array write; a thread logs through absl, another calls into an asyncio loop orbax has closed)
    and would print their own copies of the error, as pages, in a race with the caller's one-line
    report. They only repeat the error the caller already has, so they are dropped from then on:
    the ``asyncio`` and ``absl`` loggers go quiet below CRITICAL, uncaught exceptions in threads
    and unraisable ones are dropped, and the main thread's hook drops only "Event loop is
    closed" (tensorstore prints it through ``sys.excepthook``), and the warning for the write
    coroutines orbax left unawaited (printed when they are collected, at exit). Idempotent."""
    import sys
    import threading
    import warnings

    global _SILENCED
    warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda unraisable: None
    threading.excepthook = lambda args: None
    if _SILENCED:
        return
    _SILENCED = True
    previous = sys.excepthook

    def excepthook(kind: type, value: BaseException, tb: Any) -> None:
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        previous(kind, value, tb)

    sys.excepthook = excepthook


def _fix(directory: Path) -> str:
    return (
        f"delete or move {directory} to start a fresh run, or pass a different checkpoint directory"
    )


def _item_handlers() -> dict[str, Any]:
    # Registering every item's handler up front lets the manager restore a subset of items
    # (just the JSON ones) and read array metadata, also in a process that has not saved yet.
    return {
        **{name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS},
        **{name: ocp.JsonCheckpointHandler() for name in JSON_ITEMS},
    }


def _open_manager(directory: Path, options: ocp.CheckpointManagerOptions) -> Any:
    with _quiet_orbax():
        return ocp.CheckpointManager(directory, options=options, item_handlers=_item_handlers())


def _target(x: Any) -> Any:
    """The orbax restore target for one leaf of a ``*_like`` tree.

    A committed array (or a ``ShapeDtypeStruct`` with a sharding) comes back as a jax.Array with
    that sharding. An uncommitted array (what ``nnx``/``jnp`` initialisation creates), a
    ``ShapeDtypeStruct`` without a sharding or a numpy array is read into numpy (a zero-stride
    numpy target costs no memory) and ``_finish`` puts it on the default device *uncommitted*:
    jit keys its cache on committedness, and orbax would otherwise restore sharding-less targets
    committed (with the saved sharding), recompiling the train step once.
    """
    sharding = getattr(x, "sharding", None) if getattr(x, "committed", True) else None
    if sharding is None:
        return np.broadcast_to(np.zeros((), x.dtype), x.shape)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _finish(restored: Any, like: Any) -> Any:
    def leaf(r: Any, x: Any) -> Any:
        if isinstance(r, np.ndarray) and not isinstance(x, np.ndarray):
            return jax.device_put(r)  # uncommitted, on the default device, like jnp.asarray
        return r

    return jax.tree.map(leaf, restored, like)


def _json_copy(value: Any, what: str) -> Any:
    """``value`` as it will come back from JSON (tuples become lists); a clear error if it cannot
    be written as JSON."""
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{what} must be JSON-serialisable (dicts, lists, str, numbers): {e}"
        ) from e


class _Reader:
    """Read access to the checkpoints of one directory (shared by ``RunCheckpointer`` and
    ``read_config``)."""

    directory: Path
    _manager: ocp.CheckpointManager

    # -- queries ----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending (re-read from disk)."""
        with _quiet_orbax():
            self._manager.reload()
            return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def read_config(self, step: int | None = None) -> dict[str, Any] | None:
        """The run config saved with ``step`` (default: the latest); None without checkpoints."""
        step = self.latest_step() if step is None else step
        return None if step is None else dict(self._restore_json(step, "run_config"))

    def _restore_json(self, step: int, name: str) -> Any:
        restored = self._call(
            step,
            lambda: self._manager.restore(
                step, args=ocp.args.Composite(**{name: ocp.args.JsonRestore()})
            ),
        )
        if restored[name] is None:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} has no '{name}' item (not written by "
                "jaxmem or corrupt); " + _fix(self.directory)
            )
        return restored[name]

    def _call(self, step: int, fn: Any) -> Any:
        """Run an orbax restore, turning its errors about missing or unreadable files into a
        one-line ``CheckpointError``."""
        try:
            with _quiet_orbax():
                return fn()
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"cannot read checkpoint {self.directory}/{step} ({type(e).__name__}: {first}); "
                + _fix(self.directory)
            ) from e

    def close(self) -> None:
        with _quiet_orbax():
            self._manager.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunCheckpointer(_Reader):
    """Saves and restores ``(params, opt_state, loss_scale, run_config, extra)`` of a training
    run under ``directory``, keeping the last ``keep`` checkpoints.

    ``save_interval_steps``: ``save(step)`` only writes when ``step`` is a multiple of it (or
    with ``force=True``, e.g. for the final step).
    """

    def __init__(self, directory: str | Path, keep: int, *, save_interval_steps: int = 1) -> None:
        self.keep = keep
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep={keep!r} must be a positive integer")
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps={save_interval_steps!r} must be >= 1")
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(
                f"checkpoint directory {self.directory} is a file, not a directory; "
                + _fix(self.directory)
            )
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_interval_steps,
            # No preservation policy: orbax would keep the newest `keep` steps, good or bad. The
            # rotation is jaxmem.run_layout.rotate, over steps whose manifest verifies.
            # Remove `<step>.orbax-checkpoint-tmp` left by a killed save.
            cleanup_tmp_directories=True,
            # Synchronous: save() returns once the step directory is renamed into place.
            enable_async_checkpointing=False,
            create=True,
        )
        self._manager = _open_manager(self.directory, options)

    # -- save -------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        params: Any,
        opt_state: Any,
        loss_scale: Any | None,
        run_config: Mapping[str, Any],
        extra: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Write a checkpoint for ``step`` and return True once it is complete on disk; False
        when ``step`` is not a multiple of ``save_interval_steps`` (and ``force`` is not set).

        Call it with the arrays the train step *returned* (before they are donated to the next
        step). Once orbax has renamed the step into place its manifest is written (the step
        counts from then on), and verified checkpoints beyond the newest ``keep`` are deleted.
        """
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise CheckpointError(
                f"cannot save step {step} in {self.directory}: it already holds step {latest}; "
                "resume from the latest checkpoint or use a new checkpoint directory"
            )
        items = {
            "params": ocp.args.StandardSave(params),
            "opt_state": ocp.args.StandardSave(opt_state),
            "run_config": ocp.args.JsonSave(_json_copy(dict(run_config), "run_config")),
            "meta": ocp.args.JsonSave(
                {
                    "format_version": FORMAT_VERSION,
                    "step": step,
                    "has_loss_scale": loss_scale is not None,
                    "extra": _json_copy(dict(extra or {}), "extra"),
                }
            ),
        }
        if loss_scale is not None:
            items["loss_scale"] = ocp.args.StandardSave(loss_scale)
        try:
            with _quiet_orbax(quiet_errors=True), contain_background_errors():
                saved = self._manager.save(step, args=ocp.args.Composite(**items), force=force)
                self._manager.wait_until_finished()
        except BaseException:
            # orbax's threads outlive the failed save and keep reporting it; the caller gets it
            # once, as this exception (the leftover step directory is never verified, so the
            # next reader skips it)
            silence_background_errors()
            raise
        if saved:
            # One process writes the manifest and rotates; in a multi-process run the others
            # wait for it. Each process doing both raced (found by SIGKILLing a 2-process run
            # and resuming it: one process's rotation deleted a step the other was reading,
            # "could not write checkpoint 6: No such file or directory").
            if jax.process_index() == 0:
                layout.write_manifest(str(self.directory / str(step)), step)
                layout.rotate(str(self.directory), self.keep)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices(f"jaxmem checkpoint {step} verified")
            with _quiet_orbax():
                self._manager.reload()
        return bool(saved)

    # -- restore ----------------------------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        *,
        params_like: Any,
        opt_state_like: Any,
        loss_scale_like: Any | None,
    ) -> tuple[Any, Any, Any | None, dict[str, Any], dict[str, Any]]:
        """``(params, opt_state, loss_scale, run_config, extra)`` of ``step`` (default: the
        latest).

        The ``*_like`` trees (concrete arrays or ``jax.eval_shape`` output) give the structure,
        dtypes and shardings of the result: pass the freshly initialised state of the run being
        resumed and the restored arrays are interchangeable with it (same jitted step, no
        recompilation). ``loss_scale_like`` is None exactly when the run has no loss scale.
        """
        if step is None:
            step, _ = layout.newest_verified(str(self.directory))
            if step is None:
                raise CheckpointError(
                    f"no checkpoint that verifies in {self.directory}; train without resuming "
                    "or point to the directory the run was saved in"
                )
        elif step not in self.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory} (steps: "
                f"{self.all_steps()}); pick one of those steps or omit the step"
            )
        reason = layout.verify(str(self.directory / str(step)))
        if reason is not None:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} does not verify: {reason}; resume from an "
                "earlier checkpoint (--resume picks the newest that verifies)"
            )
        meta = self._restore_json(step, "meta")
        if meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} has format version "
                f"{meta.get('format_version')!r}, expected {FORMAT_VERSION}; "
                + _fix(self.directory)
            )
        if meta["has_loss_scale"] != (loss_scale_like is not None):
            saved, now = ("a", "no") if meta["has_loss_scale"] else ("no", "a")
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} has {saved} loss scale but this run has "
                f"{now} loss scale (different precision); resume with the saved precision or "
                "use a new checkpoint directory"
            )
        targets = {"params": params_like, "opt_state": opt_state_like}
        if loss_scale_like is not None:
            targets["loss_scale"] = loss_scale_like
        self._check_shapes(step, targets)
        items = {
            name: ocp.args.StandardRestore(jax.tree.map(_target, like))
            for name, like in targets.items()
        }
        items["run_config"] = ocp.args.JsonRestore()
        restored = self._call(
            step, lambda: self._manager.restore(step, args=ocp.args.Composite(**items))
        )
        out = {name: _finish(restored[name], like) for name, like in targets.items()}
        return (
            out["params"],
            out["opt_state"],
            out.get("loss_scale"),
            dict(restored["run_config"]),
            dict(meta["extra"]),
        )

    def _check_shapes(self, step: int, targets: dict[str, Any]) -> None:
        """Compare the targets' leaf names, shapes and dtypes with the checkpoint's array
        metadata before restoring: orbax would silently cast dtypes, and its errors for other
        mismatches arrive with pages of asyncio tracebacks on stderr."""
        metadata = self._call(step, lambda: self._manager.item_metadata(step))
        problems = []
        for name, target in targets.items():
            stored = metadata[name] if name in metadata.keys() else None
            if stored is None:
                problems.append(f"{name}: not in checkpoint")
                continue
            problems += [f"{name}.{p}" for p in _leaf_mismatches(stored, target)]
        if problems:
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} does not fit this run: "
                f"{'; '.join(problems[:3])}{more}; the model, optimizer or precision differs "
                "from the saved run: resume with the saved config or use a new checkpoint "
                "directory"
            )


def _leaf_mismatches(stored: Any, target: Any) -> list[str]:
    """Differences between the array metadata of a saved item and a target tree, by orbax's
    dotted leaf names (``blocks.layers.ffn.up.kernel.value``, ``0.mu.wte.embedding.value``)."""
    tree = getattr(stored, "tree", stored)
    saved = {
        leaf.name: (tuple(leaf.shape), jax.numpy.dtype(leaf.dtype))
        for leaf in jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape"))
        if hasattr(leaf, "shape")
    }
    wanted = {
        ".".join(ocp.tree.str_keypath(path)): (tuple(x.shape), jax.numpy.dtype(x.dtype))
        for path, x in jax.tree_util.tree_flatten_with_path(target)[0]
    }
    out = []
    for key in sorted(saved.keys() | wanted.keys()):
        before, after = saved.get(key), wanted.get(key)
        if before != after:
            show = lambda v: "absent" if v is None else f"{v[0]} {v[1]}"  # noqa: E731
            out.append(f"{key}: checkpoint {show(before)}, now {show(after)}")
    return out


def read_config(directory: str | Path) -> dict[str, Any] | None:
    """The run config saved with the latest checkpoint in ``directory``, without restoring any
    array and without writing anything; None when ``directory`` holds no complete checkpoint."""
    reader = _Reader()
    reader.directory = Path(directory).absolute()
    if not reader.directory.exists():
        return None
    if not reader.directory.is_dir():
        raise CheckpointError(
            f"checkpoint directory {reader.directory} is a file, not a directory; "
            + _fix(reader.directory)
        )
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    reader._manager = _open_manager(reader.directory, options)
    with reader:
        return reader.read_config()


def restore_params(directory: str | Path, step: int, params_like: Any) -> Any:
    """The parameters alone of checkpoint ``step`` in ``directory``, read-only (nothing in the
    directory is created, moved or deleted): what ``jaxmem export`` writes out. The checkpoint
    must verify; ``params_like`` gives the tree, shapes and dtypes (a mismatch is a one-line
    ``CheckpointError``)."""
    reader = _Reader()
    reader.directory = Path(directory).absolute()
    reason = layout.verify(str(reader.directory / str(step)))
    if reason is not None:
        raise CheckpointError(f"checkpoint {reader.directory}/{step} does not verify: {reason}")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    reader._manager = _open_manager(reader.directory, options)
    with reader:
        metadata = reader._call(step, lambda: reader._manager.item_metadata(step))
        problems = _leaf_mismatches(metadata["params"], params_like)
        if problems:
            raise CheckpointError(
                f"checkpoint {reader.directory}/{step} does not hold this model's parameters: "
                + "; ".join(problems[:3])
            )
        target = ocp.args.StandardRestore(jax.tree.map(_target, params_like))
        restored = reader._call(
            step,
            lambda: reader._manager.restore(step, args=ocp.args.Composite(params=target)),
        )
        return _finish(restored["params"], params_like)


# ------------------------------------------------------------------------- either layout
def _read_saved_config(directory: str, step: int) -> dict | None:
    """The run config saved with a (verified) step, in whichever layout it was written."""
    if os.path.isfile(os.path.join(directory, str(step), layout.RUN_CONFIG_JSON)):
        return read_json_config(directory, step)  # PyTorch layout
    with RunCheckpointer(directory, keep=1) as reader:
        return reader.read_config(step)


def latest_checkpoint(out_dir: str) -> tuple[int | None, dict | None, list[tuple[int, str]]]:
    """In run directory ``out_dir``: the newest checkpoint that verifies (either layout, see
    ``jaxmem.run_layout``), its saved config, and the newer steps skipped with their reasons.
    ``(None, None, skipped)`` when none verifies. Reading the config of the other framework's
    layout lets a resume across frameworks be refused by the config comparison, naming
    ``run.framework``."""
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    step, skipped = layout.newest_verified(directory)
    if step is None:
        return None, None, skipped
    return step, _read_saved_config(directory, step), skipped

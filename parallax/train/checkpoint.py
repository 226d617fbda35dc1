"""Orbax checkpoints of the train state: unboxed arrays plus metadata, resharded on load.

A checkpoint holds the state's arrays (``step``, ``params``, ``opt_state``, ``rng``,
``model_state``: plain arrays, no flax boxes) and a JSON record: the step, the data
position, the strategy and mesh it was written under, the config, and the shape and
dtype of every array. Params are saved as the model writes them (a pipeline's list of blocks,
held stacked, as the list). Restoring checks that record against the model at hand before
reading any array, and lays each array out as the *current* strategy wants: a checkpoint
written under FSDP on 8 devices restores under DP, on 4, or under a pipeline."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

from parallax import _multihost
from parallax.parallel.pipeline.stacked_blocks import as_written, stacked_like, unstacked
from parallax.train.state_record import describe_optimizer_change, differences, signature, state_arrays, structure

log = logging.getLogger("parallax")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored here; the files are left as they are."""


CHECKSUMS = "parallax_checksums.json"
"""``{relative path: [bytes, sha256]}`` of a step's files, written into its folder as orbax commits it."""
ORBAX_BOOKKEEPING = ("_CHECKPOINT_METADATA", "commit_success.txt")
"""Files orbax itself (re)writes at the top of a step's folder while committing; not checksummed."""


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != CHECKSUMS:
                found.append(relative)
    return sorted(found)


def _write_checksums(folder: str) -> None:
    """Records the size and sha256 of every file in ``folder`` (atomically)."""
    sums = {name: [os.path.getsize(os.path.join(folder, name)), _sha256(os.path.join(folder, name))]
            for name in _files(folder) if name not in ORBAX_BOOKKEEPING}
    partial = os.path.join(folder, CHECKSUMS + ".partial")
    with open(partial, "w") as stream:
        json.dump(sums, stream)
    os.replace(partial, os.path.join(folder, CHECKSUMS))


class _OrbaxSyncLine(logging.Filter):
    """Drops orbax's ``Reached preemption sync point, step=N`` warning, which every process prints
    from several threads at a preemption: the Trainer says once per process what it saved."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Reached preemption sync point" not in str(record.msg)


def _orbax():
    """``orbax.checkpoint`` with its sync line quieted, imported by the first :class:`Checkpointer`:
    0.3 s of the 3 s ``import parallax`` took, which a run that writes no checkpoint need not pay."""
    import orbax.checkpoint

    absl = logging.getLogger("absl")  # orbax logs through absl
    if not any(isinstance(f, _OrbaxSyncLine) for f in absl.filters):
        absl.addFilter(_OrbaxSyncLine())
    return orbax.checkpoint


class Checkpointer:
    """Saves every ``every`` steps (async), keeps the last ``keep``, restores by step.

    Args:
        directory: where checkpoints go (one sub-folder per step).
        every: save when ``step % every == 0``; ``None`` saves only when asked.
        keep: how many of the newest checkpoints to keep.
        async_save: write in the background while training goes on.

    Example:
        >>> ckpt = Checkpointer(ckpt_dir, every=100, keep=3)
        >>> ckpt.save(state, {"position": 0})
        >>> ckpt.wait()
        >>> ckpt.latest_step(), ckpt.verify(0)
        (0, None)
    """

    def __init__(self, directory: str | os.PathLike, *, every: int | None = None, keep: int = 3,
                 async_save: bool = True):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"checkpoint_every={every!r}; use a positive number of steps or None.")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep_checkpoints={keep!r}; keep at least 1.")
        self.directory, self.every = os.path.abspath(os.fspath(directory)), every
        self._ocp = ocp = _orbax()  # the module, for the saves and restores below
        # The checksums go into the step's temporary folder just before orbax renames it into
        # place, so a committed checkpoint is verifiable however the process ends afterwards.
        commit = ocp.AsyncOptions(post_finalization_callback=self._record_before_commit) if async_save else None
        self._options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                     create=True, async_options=commit)
        self._manager = None
        self._unrecorded: list[int] = []  # saved steps whose checksums are not written yet

    @property
    def manager(self) -> ocp.CheckpointManager:
        """The orbax manager, made (and the directory created) only when first needed."""
        if self._manager is None:
            self._manager = self._ocp.CheckpointManager(self.directory, options=self._options)
        return self._manager

    def check_writable(self, nbytes: int) -> None:
        """Raises ``ValueError`` now, before training, if a checkpoint of ``nbytes`` cannot be written.

        Checks that the directory is not an existing file, that it (or, before it exists, its
        nearest existing parent) accepts a new file, and that the disk has room for one
        checkpoint. Leaves nothing behind.
        """
        path = self.directory
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"checkpoint_dir {path} is an existing file, not a directory; pass a directory path "
                             "(it is created when the first checkpoint is due).")
        existing = path
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ValueError(f"checkpoint_dir {path} cannot be created: {existing} is a file; choose another path.")
        try:
            handle, probe = tempfile.mkstemp(prefix=".parallax-write-test-", dir=existing)
            os.close(handle)
            os.remove(probe)
        except OSError as err:
            raise ValueError(f"checkpoint_dir {path} is not writable ({existing}: {err.strerror}); choose a "
                             "directory this process can write to.") from None
        free = shutil.disk_usage(existing).free
        if free < nbytes:
            raise ValueError(
                f"checkpoint_dir {path} has {free / 2**20:.1f} MiB free, but one checkpoint of this train "
                f"state takes about {nbytes / 2**20:.1f} MiB; free some space or choose another disk."
            )

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0

    def steps(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        self.manager.reload()  # another process may have written since
        return list(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return max(steps) if steps else None

    def save(self, state: Any, metadata: dict) -> None:
        """Starts saving ``state`` (async) under its step, with ``metadata``."""
        step = int(jax.device_get(state.step))
        if _multihost.agree(step in self.steps()):  # process 0's listing: every process saves, or none
            return
        if self._manager is not None:
            self._manager.wait_until_finished()  # the previous save is committed: record it
            self._record_checksums()
        arrays = as_written(state_arrays(state))  # as the model writes its params (a pipeline's list too)
        record = {**metadata, "step": step, "signature": signature(arrays), "structure": structure(arrays)}
        self._unrecorded.append(step)
        args = self._ocp.args
        self.manager.save(step, args=args.Composite(state=args.StandardSave(arrays), meta=args.JsonSave(record)))
        if not self._options.enable_async_checkpointing:
            self._record_checksums()  # a synchronous save is committed when it returns

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _record_before_commit(self) -> None:
        """Orbax's hook on the primary process once every process's files of the newest save are
        written, before it renames the temporary folder into place: the record commits with them."""
        step = self._unrecorded[-1] if self._unrecorded else None
        pending = os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp")
        if step is not None and os.path.isdir(pending):  # else recorded after the commit, by wait()
            _write_checksums(pending)

    def _record_checksums(self) -> None:
        """Writes the checksums of every committed step saved since the last call that has none yet.

        Process 0 writes them (the folder is shared; orbax has committed every process's files).
        """
        if jax.process_index() != 0:
            self._unrecorded = []
            return
        for step in self._unrecorded:
            folder = self.step_dir(step)
            if os.path.isdir(folder) and not os.path.exists(os.path.join(folder, CHECKSUMS)):
                _write_checksums(folder)  # not yet removed by keep_checkpoints, nor recorded at its commit
        self._unrecorded = []

    def verify(self, step: int) -> str | None:
        """Why checkpoint ``step`` fails verification, or ``None`` if every file matches its checksum.

        A checkpoint written without checksums (by parallax before 0.2, or committed by an orbax
        version whose temporary folders this one does not recognise, the process then killed
        before it recorded them) returns ``"unrecorded"``.
        """
        folder = self.step_dir(step)
        record = os.path.join(folder, CHECKSUMS)
        if not os.path.exists(record):
            return "unrecorded"
        try:
            with open(record) as stream:
                sums = json.load(stream)
        except (OSError, ValueError) as err:
            return f"its checksum record is unreadable ({err})"
        present = set(_files(folder))
        for name, (size, digest) in sorted(sums.items()):
            path = os.path.join(folder, name)
            if name not in present:
                return f"{name} is missing"
            if os.path.getsize(path) != size:
                return f"{name} has {os.path.getsize(path)} bytes, {size} when written"
            if _sha256(path) != digest:
                return f"{name} differs from what was written (sha256 mismatch)"
        extra = sorted(present - set(sums) - set(ORBAX_BOOKKEEPING))  # earlier records list them: still checked
        if extra:
            return f"{extra[0]} was added after the checkpoint was written"
        return None

    def newest_verified(self, before: int | None = None) -> tuple[int | None, list[str]]:
        """The newest step (below ``before``) that verifies, and why newer ones did not.

        Steps without a checksum record count as verified when nothing newer verifies
        either; each is named in the reasons.
        """
        reasons = []
        for step in sorted(self.steps(), reverse=True):
            if before is not None and step >= before:
                continue
            problem = self.verify(step)
            if problem is None:
                return step, reasons
            if problem == "unrecorded":
                reasons.append(f"step {step} has no checksum record (written before checksums, or killed "
                               "before recording them); restored unverified")
                return step, reasons
            reasons.append(f"step {step} fails verification: {problem}")
        return None, reasons

    def read_metadata(self, step: int) -> dict:
        """The JSON record of checkpoint ``step``."""
        try:
            args = self._ocp.args
            restored = self.manager.restore(step, args=args.Composite(meta=args.JsonRestore()))
        except Exception as err:  # orbax raises many kinds; all mean "unreadable"
            raise CheckpointError(
                f"Checkpoint step {step} in {self.directory} cannot be read ({type(err).__name__}: {err}). "
                "It was left in place; delete it by hand or resume from another step."
            ) from err
        return dict(restored["meta"])

    def restore(self, target: Any, step: int | None = None, *, verify: bool = True) -> tuple[dict, dict]:
        """Restores the arrays of ``step`` (the latest by default) laid out as ``target``.

        Args:
            target: ``ShapeDtypeStruct`` s with shardings (``StatePlan.abstract_arrays()``).
            step: which checkpoint; the latest if ``None``.
            verify: check the files against their checksums first (``False`` only when the
                caller just did, e.g. through :meth:`newest_verified`).

        Returns:
            ``(arrays, metadata)``; ``arrays`` has the keys of :func:`state_arrays`.

        Raises:
            CheckpointError: no checkpoint, an unreadable one, or one from another model.
        """
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"No checkpoint in {self.directory} to resume from.")
        problem = self.verify(step) if verify else None
        if problem not in (None, "unrecorded"):
            raise CheckpointError(
                f"Checkpoint step {step} in {self.directory} is damaged: {problem}. It was left in place; "
                "resume from an older step (fit(..., resume=True) picks the newest one that verifies)."
            )
        metadata = self.read_metadata(step)
        held, target_arrays = state_arrays(target), unstacked(state_arrays(target))  # saved as the model writes it
        saved_structure, expected = metadata.get("structure", {}), structure(target_arrays)
        changed = [name for name in expected if name in saved_structure and saved_structure[name] != expected[name]]
        if "opt_state" in changed and "params" not in changed:
            raise CheckpointError(
                f"Checkpoint step {step} in {self.directory} was saved with another optimizer: "
                f"{describe_optimizer_change(saved_structure['opt_state'], expected['opt_state'])}. Resume with the "
                "optimizer it was written with (the same optax chain; learning-rate values may differ), or point "
                "checkpoint_dir elsewhere to start afresh. Nothing was deleted."
            )
        mismatched = differences(metadata.get("signature", {}), signature(target_arrays))
        if mismatched:
            raise CheckpointError(
                f"Checkpoint step {step} in {self.directory} was saved from a different model or "
                f"optimizer (strategy then: {metadata.get('strategy', '?')}):\n  " + "\n  ".join(mismatched)
                + "\nNothing was deleted; point checkpoint_dir elsewhere or build the same model."
            )
        try:
            args = self._ocp.args
            restored = self.manager.restore(step, args=args.Composite(state=args.StandardRestore(target_arrays)))
        except Exception as err:
            raise CheckpointError(
                f"Checkpoint step {step} in {self.directory} cannot be restored ({type(err).__name__}: {err}). "
                "It was left in place."
            ) from err
        return stacked_like(dict(restored["state"]), held), metadata

    def wait(self) -> None:
        """Blocks until background saves have finished, then records their checksums."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._record_checksums()

    def close(self) -> None:
        if self._manager is not None:
            self.wait()
            self._manager.close()


def resume_step_of(checkpointer: Checkpointer | None, resume: bool) -> int | None:
    """The checkpoint ``fit`` starts from: the newest that verifies with ``resume``, ``None`` for
    a fresh start; an error for checkpoints without ``resume`` or none that verifies."""
    # Process 0 reads the directory and verifies; every process acts on what it found.
    existing = _multihost.agree(checkpointer.latest_step() if checkpointer is not None else None)
    if existing is None:
        return None
    if not resume:
        raise ValueError(
            f"checkpoint_dir {checkpointer.directory} already holds checkpoints (newest: step "
            f"{existing}); pass fit(..., resume=True) to continue, or choose another directory.")
    step, reasons = _multihost.agree(checkpointer.newest_verified() if _multihost.is_primary() else None)
    for reason in reasons:
        log.warning("Checkpoint %s (left in place).", reason)
    if step is None:
        raise CheckpointError(
            f"No checkpoint in {checkpointer.directory} verifies:\n  " + "\n  ".join(reasons)
            + "\nAll were left in place; start a new run in another checkpoint_dir.")
    return step

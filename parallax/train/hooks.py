"""The Trainer's own hooks: evaluation and checkpointing, each with an ``every``.

A hook is due at some steps (``due``); the loop then reads the pending metrics back and
runs it, before the read (``after_read = False``: its results reach the step's callbacks,
as evaluation's do) or after it (``after_read = True``: checkpointing, which must only save
a step whose loss was checked). ``at_end`` runs once when training stops.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

import jax

from parallax.train import elastic
from parallax.train.feed import data_record

log = logging.getLogger("parallax")


class Hook(Protocol):
    """A step hook of the training loop."""

    after_read: bool

    def due(self, step: int, preempted: bool) -> bool:
        ...

    def run(self, trainer: Any, step: int, pending: list) -> dict | None:
        ...

    def at_end(self, trainer: Any, step: int, pending: list, reason: str) -> None:
        ...


class Evaluation:
    """Evaluates ``data`` every ``every`` steps and once at the end (unless preempted).

    If an evaluation fails, the step's state is checkpointed before the error propagates (in a
    single process: with several, the others may be waiting in the next step, not saving).
    """

    after_read = False

    def __init__(self, data: Any, every: int | None):
        self.data = data
        self.every = every
        self.evaluated_at: int | None = None

    def due(self, step: int, preempted: bool) -> bool:
        return self.every is not None and step % self.every == 0

    def run(self, trainer: Any, step: int, pending: list) -> dict:
        self.evaluated_at = step
        try:
            return trainer.evaluate(self.data)
        except Exception:
            saving = trainer.hook(Checkpointing)
            # With several processes the others may not have failed: a save (collective) would wait for them.
            if saving is not None and jax.process_count() == 1:
                log.error("Evaluation at step %d failed; saving step %d before the error propagates.", step, step)
                trainer.read_metrics(pending)
                saving.save(trainer, step)
                saving.checkpointer.wait()
            raise

    def at_end(self, trainer: Any, step: int, pending: list, reason: str) -> None:
        if self.evaluated_at != step and reason != "preempted":
            self.run(trainer, step, pending)
            trainer.history.eval[-1]["final"] = True


class Checkpointing:
    """Saves the state every ``checkpointer.every`` steps, when preempted, and at the end.

    A state is saved only after its step's loss was read and checked, and only if it holds
    no NaN or Inf; the metadata records where in the data the step stands.
    """

    after_read = True

    def __init__(self, checkpointer: Any):
        self.checkpointer = checkpointer
        self.last_saved: int | None = None

    def due(self, step: int, preempted: bool) -> bool:
        return preempted or self.checkpointer.due(step)

    def run(self, trainer: Any, step: int, pending: list) -> None:
        self.save(trainer, step)

    def at_end(self, trainer: Any, step: int, pending: list, reason: str) -> None:
        self.save(trainer, step)

    def save(self, trainer: Any, step: int) -> None:
        if self.last_saved == step:
            return
        trainer.guard.check_state(step, trainer.state)
        position = step + trainer.data_offset
        self.checkpointer.save(trainer.state, {
            "position": position,
            "examples": position * trainer.batch_size,
            "batch_size": trainer.batch_size,
            "steps_per_epoch": trainer.steps_per_epoch,
            "strategy": trainer.strategy.describe(),
            "mesh": {name: int(size) for name, size in trainer.mesh.shape.items()},
            "layout": elastic.layout_of(trainer.mesh.shape, trainer.strategy.data_shards(trainer.mesh),
                                        trainer.config.step.grad_accum),
            "elastic": trainer.layout_change,
            "config": _jsonable(dataclasses.asdict(trainer.config)),
            "data": data_record(trainer.feed),  # an iterator's position after this step's batch, per process
        })
        self.last_saved = step


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)

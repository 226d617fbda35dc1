"""Callbacks: one hook per step, called every ``every`` steps with the step's info.

A callback is any object with an ``every`` attribute and an ``on_step(info)`` method;
``on_fit_start(trainer)`` and ``on_fit_end(trainer)`` are optional, and ``needs_state = True``
gives it the state of the step it is told about (``info.state``). Metrics reach
callbacks late, never early: step t's metrics are read from the device only after step
t+1 has been dispatched (in batches, see ``TrainerConfig.fetch_every``), so logging
never stalls the accelerator.

With several processes, callbacks run on every process, except those whose class sets
``primary_only = True`` (:class:`ProgressBar`, :class:`JSONLogger`,
:class:`TensorBoardLogger`), which run on process 0 only. Metrics are the same on every
process; a callback that calls ``trainer.request_stop`` must do so on every process (decide
from the metrics), or the processes stop at different steps.

Example:
    >>> class PrintLoss:
    ...     every = 100
    ...     def on_step(self, info):
    ...         print(info.step, info.metrics["loss"])
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass
class StepInfo:
    """What a callback sees.

    Attributes:
        step: the number of updates done (1 after the first step).
        epoch: the epoch the step's batch came from (0-based), if known.
        metrics: the step's training metrics as floats (``loss`` and the loss function's).
        eval_metrics: evaluation metrics if an evaluation just ran at this step, else None.
        max_steps: the planned number of steps, if known.
        trainer: the running trainer (``trainer.request_stop(reason)`` ends training).
        state: the train state right after this step, for a callback that sets
            ``needs_state = True`` (the trainer then reads such a step back before it
            dispatches the next one); otherwise ``None`` for steps whose state a later step
            has already replaced (its buffers are donated).
    """

    step: int
    epoch: int | None
    metrics: dict[str, float]
    eval_metrics: dict[str, float] | None
    max_steps: int | None
    trainer: Any = None
    state: Any = None


@runtime_checkable
class Callback(Protocol):
    """The callback protocol: ``every`` and ``on_step``."""

    every: int

    def on_step(self, info: StepInfo) -> None:
        ...


def due(callback: Callback, info: StepInfo) -> bool:
    """Whether ``callback`` runs at this step (always when eval metrics arrive)."""
    every = getattr(callback, "every", 1) or 1
    return (info.step % every == 0 or info.eval_metrics is not None or info.step == info.max_steps
            or _due_at(callback, info.step))


def _due_at(callback: Any, step: int) -> bool:
    """Whether ``callback`` asks for this step besides every ``every``-th (its ``due_at(step)``, if it has one)."""
    return bool(getattr(callback, "due_at", lambda _: False)(step))


def state_wanted(callbacks: Sequence[Any], step: int) -> bool:
    """Whether a callback that reads the state (``needs_state``) is due at this step."""
    return any(getattr(cb, "needs_state", False) and step % (getattr(cb, "every", 1) or 1) == 0 for cb in callbacks)


def read_wanted(callbacks: Sequence[Any], steps: Sequence[int], fetch_every: int) -> bool:
    """Whether the metrics of these pending steps are due for a callback, or enough have piled up."""
    return len(steps) >= fetch_every or any(step % (getattr(cb, "every", 1) or 1) == 0 or _due_at(cb, step)
                                            for step in steps for cb in callbacks)


def _format(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


class ProgressBar:
    """A progress line: step/total, steps/s, loss and ETA (rich in a terminal, plain lines in a log).

    The first step compiles the train step (and any search before it): the line says
    "compiling" until it is done and how long it took, and steps/s and the ETA count only the
    steps after it.

    Args:
        every: refresh every this many steps.
        stream: where plain lines go when not in a terminal.
    """

    primary_only = True

    def __init__(self, every: int = 1, stream: Any = None):
        self.every = every
        self.stream = stream or sys.stderr
        self._progress = None
        self._task = None
        self._start = None
        self._compiled: tuple[int, float] | None = None  # (the first step, when it was done)
        self._first = 1
        self._last_print = 0.0

    def due_at(self, step: int) -> bool:
        """Also the first step of a fit: it says what compiling took."""
        return self._compiled is None and self._start is not None and step == self._first

    def on_fit_start(self, trainer: Any) -> None:
        self._start, self._compiled, self._first = time.perf_counter(), None, trainer.start_step + 1
        if getattr(self.stream, "isatty", lambda: False)():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),  # our own ETA:
                                      TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[text]}"),  # rich's
                                      transient=False)  # would count the compilation
            self._progress.start()
            self._task = self._progress.add_task("train", total=trainer.max_steps, completed=trainer.start_step,
                                                 rate="compiling…", text="")
        else:
            total = f"/{trainer.max_steps}" if trainer.max_steps else ""
            print(f"step {trainer.start_step}{total} compiling…", file=self.stream, flush=True)

    def _rate(self, step: int, now: float) -> float | None:
        """Steps per second since the first step was done (``None`` before two more: the step after
        the first was dispatched before the first's metrics were read, and is nearly done by then)."""
        first, at = self._compiled
        return (step - first) / (now - at) if step > first + 1 and now > at else None

    def on_step(self, info: StepInfo) -> None:
        now = time.perf_counter()
        text = _format(info.metrics)
        if info.eval_metrics:
            text += " | eval " + _format(info.eval_metrics)
        if self._compiled is None:  # the first step: compiled, then run
            self._compiled = (info.step, now)
            speed = f"compiled in {now - self._start:.1f}s"
        else:
            rate = self._rate(info.step, now)
            speed = f"{rate:.2f} it/s" if rate is not None else ""
            if info.max_steps and rate:
                speed += f" eta {math.ceil((info.max_steps - info.step) / rate)}s"
        if self._progress is not None:
            self._progress.update(self._task, completed=info.step, rate=speed, text=text)
            return
        if (now - self._last_print < 1.0 and info.eval_metrics is None and info.step != info.max_steps
                and not speed.startswith("compiled")):
            return
        self._last_print = now
        total = f"/{info.max_steps}" if info.max_steps else ""
        print(f"step {info.step}{total} {speed} {text}", file=self.stream, flush=True)

    def on_fit_end(self, trainer: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class JSONLogger:
    """Appends one JSON object per logged step to ``path``.

    Each line: ``{"step": ..., "time": ..., "train": {...}, "eval": {...}}``. Process 0 writes it.
    """

    primary_only = True

    def __init__(self, path: str | os.PathLike, every: int = 1):
        self.path = os.fspath(path)
        self.every = every

    def on_step(self, info: StepInfo) -> None:
        record = {"step": info.step, "epoch": info.epoch, "time": time.time(), "train": info.metrics}
        if info.eval_metrics is not None:
            record["eval"] = info.eval_metrics
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as stream:
            stream.write(json.dumps(record) + "\n")


class TensorBoardLogger:
    """Writes scalars for TensorBoard (``train/loss``, ``eval/accuracy``, ...) to ``logdir``.

    Needs the ``tensorboardX`` package (``pip install tensorboardX``). Process 0 writes them.
    """

    primary_only = True

    def __init__(self, logdir: str | os.PathLike, every: int = 1):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as err:
            raise ImportError("TensorBoardLogger needs tensorboardX: pip install tensorboardX") from err
        self.logdir = os.fspath(logdir)
        self._writer_class = SummaryWriter
        self._writer = None
        self.every = every

    @property
    def writer(self) -> Any:
        """The event file writer, made (and ``logdir`` created) when first needed."""
        if self._writer is None:
            self._writer = self._writer_class(self.logdir)
        return self._writer

    def on_step(self, info: StepInfo) -> None:
        for name, value in info.metrics.items():
            self.writer.add_scalar(f"train/{name}", value, info.step)
        for name, value in (info.eval_metrics or {}).items():
            self.writer.add_scalar(f"eval/{name}", value, info.step)

    def on_fit_end(self, trainer: Any) -> None:
        if self._writer is not None:
            self._writer.flush()


class EarlyStopping:
    """Stops training when an evaluation metric has not improved for ``patience`` evaluations.

    Args:
        monitor: an eval metric name, e.g. ``"loss"`` or ``"accuracy"``.
        mode: ``"min"`` or ``"max"``.
        patience: evaluations without improvement before stopping.
        min_delta: the smallest change that counts as improvement.
    """

    every = 1

    def __init__(self, monitor: str = "loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}); use 'min' or 'max'.")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.bad_evaluations = 0

    def on_step(self, info: StepInfo) -> None:
        if info.eval_metrics is None:
            return
        if self.monitor not in info.eval_metrics:
            raise ValueError(f"EarlyStopping monitors {self.monitor!r}, but evaluation reports "
                             f"{sorted(info.eval_metrics)}.")
        value = info.eval_metrics[self.monitor]
        better = self.best is None or (value < self.best - self.min_delta if self.mode == "min"
                                       else value > self.best + self.min_delta)
        if better:
            self.best, self.bad_evaluations = value, 0
            return
        self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience:
            info.trainer.request_stop(f"early stopping: eval {self.monitor} has not improved for "
                                      f"{self.patience} evaluations (best {self.best:.4g})")


class LearningRateLogger:
    """Adds ``learning_rate`` (the rate step ``t`` was taken with) to the step's metrics.

    Put it before the loggers.

    Args:
        schedule: the optax schedule (``count -> lr``, step ``t`` uses ``schedule(t - 1)``)
            or a constant. Without one the rate is read from the step's own state, built
            with ``optax.inject_hyperparams`` (the trainer then reads each logged step back
            before dispatching the next).
        every: how often.
    """

    def __init__(self, schedule: Callable[[int], Any] | float | None = None, every: int = 1):
        self.schedule = schedule
        self.every = every
        self.needs_state = schedule is None

    def on_step(self, info: StepInfo) -> None:
        if callable(self.schedule):
            rate = self.schedule(info.step - 1)
        elif self.schedule is not None:
            rate = self.schedule
        else:
            if info.state is None:
                return  # not a step it asked for (an eval or the last step read with older ones)
            rate = _injected_learning_rate(info.state.opt_state)
            if rate is None:
                raise ValueError("LearningRateLogger found no learning rate: pass schedule=..., or build the "
                                 "optimizer with optax.inject_hyperparams.")
        info.metrics["learning_rate"] = float(rate)


def _injected_learning_rate(opt_state: Any) -> Any:
    import jax

    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
        if hasattr(node, "hyperparams") and "learning_rate" in node.hyperparams:
            return jax.device_get(node.hyperparams["learning_rate"])
    return None

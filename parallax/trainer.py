"""``Trainer.fit``: the training loop around the step — data in, callbacks, checkpoints.

Example:
    >>> trainer = px.Trainer(model, optax.adamw(3e-4), loss_fn, strategy=px.FSDP(),
    ...                      max_steps=1000, batch_size=128, eval_every=200,
    ...                      checkpoint_dir="runs/ckpt", checkpoint_every=200)
    >>> state, history = trainer.fit((x_train, y_train), eval_data=(x_test, y_test))
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import signal
import threading
from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from parallax import metrics as metric_lib
from parallax._tree import unbox
from parallax.callbacks import ProgressBar, StepInfo, due
from parallax.checkpoint import Checkpointer, CheckpointError
from parallax.data import as_data, check_batch_leaves, to_global
from parallax.state import LossFn, TrainState, call_model, check_model, model_rngs, plan_state
from parallax.step import make_eval_step, make_train_step
from parallax.strategy import DataParallel, Strategy

log = logging.getLogger("parallax")


class NonFiniteLossError(FloatingPointError):
    """Training stopped because the loss (or the state) became NaN or Inf."""


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Every option of :class:`Trainer`; pass them as keywords or as an ``ml_collections.ConfigDict``.

    Attributes:
        max_steps: stop after this many updates (counted from the start of the run).
        epochs: stop after this many passes over the data (if ``max_steps`` is unset).
        batch_size: global batch size when the data is given as arrays.
        eval_batch_size: batch size for array eval data (``batch_size`` by default).
        eval_every: evaluate every this many steps (and at the end).
        checkpoint_dir: where checkpoints go; ``None`` disables them.
        checkpoint_every: save every this many steps (and at the end).
        keep_checkpoints: how many of the newest checkpoints to keep.
        async_checkpoints: write checkpoints in the background.
        seed: seeds init, dropout streams and the data order.
        shuffle: shuffle array data each epoch.
        grad_accum, precision, remat, compile, batch_stats, rng_streams: as in
            :func:`parallax.make_train_step`.
        on_nonfinite: ``"stop"`` (raise :class:`NonFiniteLossError` naming the step) or
            ``"skip"`` (skip that update and go on).
        on_preemption: on SIGTERM or a first SIGINT (Ctrl-C), finish the step, save it
            (whenever the signal arrives), then ``"exit"`` (status 0) or ``"return"`` from
            ``fit``. A second SIGINT stops at once (``KeyboardInterrupt``).
        progress: show a progress bar.
        log_every: refresh the progress bar every this many steps.
        fetch_every: read metrics back from the device at least every this many steps
            (they are also read whenever a callback or checkpoint needs them). A NaN
            loss is noticed at that read; a checkpoint is only written after its step's
            loss and state were checked.
    """

    max_steps: int | None = None
    epochs: int | None = None
    batch_size: int | None = None
    eval_batch_size: int | None = None
    eval_every: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    seed: int = 0
    shuffle: bool = True
    grad_accum: int = 1
    precision: str | None = None
    remat: tuple = ()
    compile: str = "auto"
    batch_stats: str = "global"
    rng_streams: tuple = ("dropout",)
    on_nonfinite: str = "stop"
    on_preemption: str = "exit"
    progress: bool = True
    log_every: int = 10
    fetch_every: int = 32

    def __post_init__(self):
        for name in ("log_every", "fetch_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; use a positive integer.")
        for name in ("max_steps", "epochs", "eval_every", "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}; use a positive integer or None.")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}; use 'stop' or 'skip'.")
        if self.on_preemption not in ("exit", "return"):
            raise ValueError(f"on_preemption={self.on_preemption!r}; use 'exit' or 'return'.")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every is set but checkpoint_dir is not; say where checkpoints go.")

    @classmethod
    def create(cls, config: Any = None, **options: Any) -> "TrainerConfig":
        """Merges a ConfigDict/dict (first) and keywords (override) into a config."""
        merged: dict[str, Any] = {}
        if config is not None:
            merged.update(config.to_dict() if hasattr(config, "to_dict") else dict(config))
        merged.update(options)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise ValueError(f"Unknown Trainer option(s) {unknown}; the options are {sorted(known)}.")
        for name in ("remat", "rng_streams"):
            if name in merged and isinstance(merged[name], list):
                merged[name] = tuple(merged[name])
        return cls(**merged)


@dataclasses.dataclass
class History:
    """Metrics of a run: ``train`` (one dict per step) and ``eval`` (one per evaluation)."""

    train: list[dict] = dataclasses.field(default_factory=list)
    eval: list[dict] = dataclasses.field(default_factory=list)


class FitResult(NamedTuple):
    """What ``fit`` returns: ``state, history = trainer.fit(...)`` also works."""

    state: TrainState
    history: History
    stop_reason: str = ""


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


class Trainer:
    """Trains an unmodified flax model with any parallax strategy.

    Args:
        model: the flax linen module.
        optimizer: an optax transformation.
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, metrics)``.
        strategy: the parallelism strategy (``DataParallel()`` by default).
        config: an ``ml_collections.ConfigDict`` (or dict) of :class:`TrainerConfig` options.
        eval_loss_fn: the loss for evaluation (e.g. calling the model with
            ``train=False``); ``loss_fn`` by default.
        callbacks: extra callbacks (see :mod:`parallax.callbacks`).
        devices: the devices to use; all by default.
        **options: :class:`TrainerConfig` options; they override ``config``.

    Example:
        >>> trainer = px.Trainer(model, optax.adam(1e-3), loss_fn, strategy=px.FSDP(),
        ...                      epochs=3, batch_size=64)
        >>> result = trainer.fit((x, y))
        >>> result.history.train[-1]["loss"]
    """

    def __init__(self, model: nn.Module, optimizer: optax.GradientTransformation, loss_fn: LossFn, *,
                 strategy: Strategy | None = None, config: Any = None, eval_loss_fn: LossFn | None = None,
                 callbacks: Sequence[Any] = (), devices: Sequence[jax.Device] | None = None, **options: Any):
        self.config = TrainerConfig.create(config, **options)
        check_model(model)
        _check_optimizer(optimizer)
        _check_loss_fn(loss_fn, "loss_fn")
        if eval_loss_fn is not None:
            _check_loss_fn(eval_loss_fn, "eval_loss_fn")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.eval_loss_fn = eval_loss_fn or loss_fn
        self.strategy = strategy if strategy is not None else DataParallel()
        if not isinstance(self.strategy, Strategy):
            raise ValueError(f"strategy must be a parallax strategy (e.g. px.FSDP()), got {self.strategy!r}.")
        self.mesh = self.strategy.make_mesh(devices)
        cfg = self.config
        self.callbacks = list(callbacks)
        if cfg.progress:
            self.callbacks.append(ProgressBar(every=cfg.log_every))
        self.train_step = make_train_step(
            loss_fn, self.strategy, compile=cfg.compile, grad_accum=cfg.grad_accum, batch_stats=cfg.batch_stats,
            rng_streams=cfg.rng_streams, precision=cfg.precision, remat=cfg.remat,
            skip_nonfinite=cfg.on_nonfinite == "skip",
        )
        self.eval_step = make_eval_step(self.eval_loss_fn, self.strategy, compile=cfg.compile,
                                        batch_stats=cfg.batch_stats, rng_streams=cfg.rng_streams,
                                        precision=cfg.precision)
        self.eval_step_any_size = make_eval_step(self.eval_loss_fn, self.strategy, batch_stats=cfg.batch_stats,
                                                 rng_streams=cfg.rng_streams, precision=cfg.precision,
                                                 replicated_batch=True)
        self.batch_sharding = NamedSharding(self.mesh, self.strategy.batch_spec())
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.checkpointer = (Checkpointer(cfg.checkpoint_dir, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints,
                                          async_save=cfg.async_checkpoints) if cfg.checkpoint_dir else None)
        self.state: TrainState | None = None
        self.plan = None
        self.start_step = 0
        self.max_steps: int | None = None
        self.history = History()
        self._stop_reason: str | None = None
        self._preempted: str | None = None  # the signal that asked to stop ("SIGTERM", "SIGINT")
        self._last_saved: int | None = None
        self._batch_size: int | None = None  # global batch size of the data being fit
        self._steps_per_epoch: int | None = None
        self._data_offset = 0  # data position (in batches) minus step: nonzero after resuming with another batch size

    # --- state ---------------------------------------------------------------------------
    def _plan(self, example_batch: Any):
        if self.plan is None:
            self.plan = plan_state(self.model, self.optimizer, example_batch, strategy=self.strategy,
                                   rng=self.config.seed, loss_fn=self.loss_fn, mesh=self.mesh,
                                   rng_streams=self.config.rng_streams)
        return self.plan

    def init(self, example_batch: Any) -> TrainState:
        """Builds a fresh sharded state from an example (host) batch."""
        self.state = self._plan(example_batch).build()
        return self.state

    def restore(self, example_batch: Any, step: int | None = None) -> dict:
        """Loads checkpoint ``step`` (the latest by default) into ``self.state``, resharded
        for this trainer's strategy and mesh; returns the checkpoint's metadata."""
        if self.checkpointer is None:
            raise ValueError("This trainer has no checkpoint_dir to restore from.")
        return self._load(example_batch, step, verify=True)

    def _load(self, example_batch: Any, step: int | None, verify: bool) -> dict:
        plan = self._plan(example_batch)
        arrays, metadata = self.checkpointer.restore(plan.abstract_arrays(), step, verify=verify)
        self.state = TrainState(model=self.model, tx=self.optimizer, **arrays)
        return metadata

    def request_stop(self, reason: str) -> None:
        """Ends training after the current step (used by callbacks such as EarlyStopping)."""
        self._stop_reason = reason

    # --- fit -------------------------------------------------------------------------------
    def _resolve_max_steps(self, source) -> int:
        cfg = self.config
        if cfg.max_steps is not None:
            return cfg.max_steps
        epochs = cfg.epochs or 1
        if source.steps_per_epoch is None:
            raise ValueError("The training data has no len(); pass max_steps=... (or data with a length).")
        return epochs * source.steps_per_epoch

    def fit(self, train_data: Any, eval_data: Any = None, *, resume: bool = False) -> FitResult:
        """Trains until ``max_steps`` / ``epochs``, evaluating and checkpointing on the way.

        Args:
            train_data: arrays (``(x, y)`` or a dict; needs ``batch_size``) or an iterable of
                batches (re-iterated each epoch; a function returning one also works).
            eval_data: the same kinds; evaluated every ``eval_every`` steps and at the end.
            resume: continue from the newest checkpoint in ``checkpoint_dir`` (same data
                order and rngs: the result equals an uninterrupted run).

        Returns:
            :class:`FitResult` ``(state, history, stop_reason)``.
        """
        cfg = self.config
        source = as_data(train_data, cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed, drop_remainder=True)
        if source.dropped_per_epoch:
            log.warning("Each epoch drops the last %d examples, which do not fill a batch of %d.",
                        source.dropped_per_epoch, cfg.batch_size)
        first = next(iter(source.iter_from(0)), None)
        if first is None:
            raise ValueError("The training data yields no batches.")
        check_batch_leaves(first, "a training batch")
        self.max_steps = self._resolve_max_steps(source)
        if eval_data is not None:
            self._check_eval_data(eval_data, first)
        if self.checkpointer is not None:
            arrays = self._plan(first).abstract_arrays()
            self.checkpointer.check_writable(sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(arrays)))
        self._batch_size = int(getattr(source, "batch_size", None) or
                               np.shape(jax.tree.leaves(first)[0])[0] * jax.process_count())
        self._steps_per_epoch = source.steps_per_epoch
        self.strategy.check_batch_size(self._batch_size, self.mesh, multiple=cfg.grad_accum)
        self.start_step = self._start(first, resume)
        self._stop_reason, self._preempted = None, None
        try:
            stop_reason = self._loop(source, eval_data)
        finally:
            for callback in self.callbacks:
                if hasattr(callback, "on_fit_end"):
                    callback.on_fit_end(self)
            if self.checkpointer is not None:
                self.checkpointer.wait()
        if stop_reason == "preempted":
            saved = f"saved step {self._last_saved}" if self._last_saved is not None else "no checkpoint_dir, nothing saved"
            if cfg.on_preemption == "exit":
                log.warning("Preempted (%s): %s, exiting.", self._preempted, saved)
                raise SystemExit(0)
            log.warning("Preempted (%s): %s, returning.", self._preempted, saved)
        return FitResult(self.state, self.history, stop_reason)

    def _start(self, example_batch: Any, resume: bool) -> int:
        existing = self.checkpointer.latest_step() if self.checkpointer is not None else None
        if resume and existing is not None:
            step, reasons = self.checkpointer.newest_verified()
            for reason in reasons:
                log.warning("Checkpoint %s (left in place).", reason)
            if step is None:
                raise CheckpointError(
                    f"No checkpoint in {self.checkpointer.directory} verifies:\n  " + "\n  ".join(reasons)
                    + "\nAll were left in place; start a new run in another checkpoint_dir."
                )
            metadata = self._load(example_batch, step, verify=False)  # newest_verified just checked it
            log.info("Resumed from step %d in %s.", step, self.checkpointer.directory)
            self._data_offset = self._data_position(metadata) - step
            return step
        if existing is not None:
            raise ValueError(
                f"checkpoint_dir {self.checkpointer.directory} already holds checkpoints (newest: step "
                f"{existing}); pass fit(..., resume=True) to continue, or choose another directory."
            )
        self.init(example_batch)
        self._data_offset = 0
        return 0

    def _check_batch(self, batch: Any, step: int) -> None:
        """A batch of another size than the first (an iterable's last one) must still split over the data axes."""
        rows = int(np.shape(jax.tree.leaves(batch)[0])[0]) * jax.process_count()
        if rows != self._batch_size:
            try:
                self.strategy.check_batch_size(rows, self.mesh, multiple=self.config.grad_accum)
            except ValueError as err:
                raise ValueError(f"The batch for step {step} has {rows} examples (the first had {self._batch_size}). "
                                 f"{err} Drop or pad the last batch of the data.") from None

    def _data_position(self, metadata: dict) -> int:
        """The batch to resume at: the same example as when the checkpoint was written.

        A checkpoint records its position in batches and the batch size. With another batch
        size, training continues at the same example of the same epoch when the new size
        divides the examples already seen in it; otherwise it is an error with the options.
        """
        position = int(metadata["position"])
        saved_size = metadata.get("batch_size")
        if saved_size is None or int(saved_size) == self._batch_size:
            return position
        saved_size, new_size = int(saved_size), self._batch_size
        saved_epoch_steps = metadata.get("steps_per_epoch")
        epoch, offset = divmod(position, saved_epoch_steps) if saved_epoch_steps else (0, position)
        seen = offset * saved_size  # examples of this epoch already trained on
        if seen % new_size:
            shards = self.strategy.data_shards(self.mesh)
            small = [d for d in range(1, math.isqrt(seen) + 1) if seen % d == 0]
            divisors = [d for d in set(small + [seen // d for d in small]) if d % shards == 0]
            nearby = sorted(divisors, key=lambda d: (abs(d - new_size), d))[:3]
            raise ValueError(
                f"The checkpoint was written with batch_size={saved_size} after {seen} examples of epoch "
                f"{epoch}; batch_size={new_size} does not divide {seen}, so training cannot continue at the "
                f"same example. Resume with batch_size={saved_size}, or one that divides {seen} "
                f"(e.g. {', '.join(map(str, nearby))}), or start a new run in another checkpoint_dir."
            )
        if epoch and not self._steps_per_epoch:
            raise ValueError(
                f"The checkpoint was written with batch_size={saved_size} in epoch {epoch}; with batch_size="
                f"{new_size} the epoch length of this data is unknown, so the position cannot be carried "
                f"over. Resume with batch_size={saved_size}."
            )
        new_position = epoch * (self._steps_per_epoch or 0) + seen // new_size
        log.warning("Resuming with batch_size=%d instead of %d: continuing at example %d of epoch %d (batch %d).",
                    new_size, saved_size, seen, epoch, new_position)
        return new_position

    def _loop(self, source, eval_data) -> str:
        cfg = self.config
        previous_handler = self._install_sigterm()
        for callback in self.callbacks:
            if hasattr(callback, "on_fit_start"):
                callback.on_fit_start(self)
        step, reason, evaluated_at = self.start_step, "max_steps", None
        pending: list[tuple] = []  # (step, epoch, device metrics) not yet read from the device
        batches = source.iter_from(self.start_step + self._data_offset)
        try:
            while step < self.max_steps:
                batch = next(batches, None)
                if batch is None:
                    reason = "data exhausted"
                    break
                epoch = (step + self._data_offset) // source.steps_per_epoch if source.steps_per_epoch else None
                self._check_batch(batch, step + 1)
                self.state, metrics = self.train_step(self.state, to_global(batch, self.batch_sharding))
                step += 1
                if pending:
                    # Step t is queued; wait for step t-1 so that at most two steps are in
                    # flight (no transfer: the values are read in batches below).
                    jax.block_until_ready(pending[-1][2])
                pending.append((step, epoch, metrics))
                evaluate = eval_data is not None and cfg.eval_every is not None and step % cfg.eval_every == 0
                save = self.checkpointer is not None and self.checkpointer.due(step)
                if evaluate or save or self._preempted or self._stop_reason or step == self.max_steps:
                    eval_metrics = self._evaluate_or_save(eval_data, step, pending) if evaluate else None
                    evaluated_at = step if evaluate else evaluated_at
                    self._flush(pending, eval_metrics)
                    if save or self._preempted:
                        self._save(step)
                elif self._wanted(pending[:-1]):
                    # Read the older steps only: this step is still running on the device.
                    self._flush(pending[:-1])
                    del pending[:-1]
                if self._stop_reason:
                    reason = self._stop_reason
                    break
                if self._preempted:
                    reason = "preempted"
                    break
            self._flush(pending)
            if self._preempted:
                # The signal may have landed after this step's save check (while metrics were
                # read): the step it stops at is saved all the same.
                reason = "preempted"
            if eval_data is not None and evaluated_at != step and reason != "preempted":
                self._evaluate_or_save(eval_data, step, pending)
                self.history.eval[-1]["final"] = True
            if self.checkpointer is not None:
                self._save(step)
        finally:
            self._restore_sigterm(previous_handler)
        return reason

    def _wanted(self, pending: list[tuple]) -> bool:
        """Whether some read-back step is due for a callback, or enough have piled up."""
        if len(pending) >= self.config.fetch_every:
            return True
        return any(step % (getattr(cb, "every", 1) or 1) == 0 for step, _, _ in pending for cb in self.callbacks)

    def _flush(self, pending: list[tuple], eval_metrics: dict | None = None) -> None:
        """Reads the pending steps' metrics in one transfer; NaN guard; history; callbacks."""
        if not pending:
            return
        fetched = jax.device_get([metrics for _, _, metrics in pending])
        for index, ((step, epoch, _), values) in enumerate(zip(pending, fetched)):
            host = {"loss": float(values["loss"]), **{k: float(v) for k, v in values.items() if k != "loss"}}
            if not math.isfinite(host["loss"]):
                if self.config.on_nonfinite == "stop":
                    self._raise_nonfinite(step, f"the loss is {host['loss']}")
                log.warning("Step %d: the loss is %s; the update was skipped.", step, host["loss"])
            self.history.train.append({"step": step, **host})
            last = index == len(pending) - 1
            info = StepInfo(step=step, epoch=epoch, metrics=host, eval_metrics=eval_metrics if last else None,
                            max_steps=self.max_steps, trainer=self)
            for callback in self.callbacks:
                if due(callback, info):
                    callback.on_step(info)
        pending.clear()

    def _raise_nonfinite(self, step: int, what: str):
        last = None
        if self.checkpointer is not None:
            self.checkpointer.wait()
            last = self.checkpointer.newest_verified()[0]
        where = (f" The newest checkpoint that verifies, step {last} in {self.checkpointer.directory}, is kept."
                 if last is not None else "")
        raise NonFiniteLossError(
            f"Training stopped at step {step}: {what}.{where} Lower the learning rate, check the data, or "
            "pass on_nonfinite='skip' to skip such updates."
        )

    def _save(self, step: int) -> None:
        if self._last_saved == step:
            return
        if not bool(_all_finite(self.state)):
            self._raise_nonfinite(step, "the state holds NaN or Inf values, so it was not saved")
        self.checkpointer.save(self.state, {
            "position": step + self._data_offset,
            "examples": (step + self._data_offset) * self._batch_size,
            "batch_size": self._batch_size,
            "steps_per_epoch": self._steps_per_epoch,
            "strategy": self.strategy.describe(),
            "mesh": {name: int(size) for name, size in self.mesh.shape.items()},
            "config": _jsonable(dataclasses.asdict(self.config)),
        })
        self._last_saved = step

    # --- evaluation -----------------------------------------------------------------------
    def _check_eval_data(self, eval_data: Any, example_batch: Any) -> None:
        """Runs ``eval_loss_fn`` on the first eval batch abstractly (shapes only) before step 1."""
        cfg = self.config
        source = as_data(eval_data, cfg.eval_batch_size or cfg.batch_size, shuffle=False, seed=0,
                         drop_remainder=False)
        batch = next(iter(source.epoch()), None)
        if batch is None:
            raise ValueError("eval_data yields no batches; pass at least one example, or no eval_data.")
        abstract = self._plan(example_batch).abstract
        method = call_model(self.model, batch, self.eval_loss_fn)

        def run(params, model_state, batch, key):
            return self.model.apply({"params": params, **model_state}, batch, method=method, mutable=True,
                                    rngs=model_rngs(key, cfg.rng_streams))

        try:
            jax.eval_shape(run, unbox(abstract.params), abstract.model_state, batch, abstract.rng)
        except Exception as err:  # whatever flax/jax raise, it is the eval data against this model
            shapes = {jax.tree_util.keystr(key_path): f"{leaf.dtype}{tuple(np.shape(leaf))}"
                      for key_path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]}
            raise ValueError(
                f"eval_data does not fit the model: its first batch {shapes} fails in the eval loss with "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Checked before training; "
                "give eval_data the training data's feature shapes and dtypes."
            ) from err

    def _evaluate_or_save(self, eval_data: Any, step: int, pending: list) -> dict[str, float]:
        """Evaluates; if evaluation fails, the state of ``step`` is checkpointed before the error propagates."""
        try:
            return self.evaluate(eval_data)
        except Exception:
            if self.checkpointer is not None:
                log.error("Evaluation at step %d failed; saving step %d before the error propagates.", step, step)
                self._flush(pending)
                self._save(step)
                self.checkpointer.wait()
            raise

    def evaluate(self, eval_data: Any, state: TrainState | None = None) -> dict[str, float]:
        """Exact metric means over a whole eval set, the last partial batch included.

        Full batches are split over the data axes; a last batch the data axes do not
        divide is given whole to every device.
        """
        state = self.state if state is None else state
        if state is None:
            raise ValueError("No state yet: call fit(...) or init(example_batch) first.")
        cfg = self.config
        source = as_data(eval_data, cfg.eval_batch_size or cfg.batch_size, shuffle=False, seed=0,
                         drop_remainder=False)
        shards = self.strategy.data_shards(self.mesh)
        totals = None
        for batch in source.epoch():
            size = int(np.shape(jax.tree.leaves(batch)[0])[0])
            if size % shards == 0:
                sums = self.eval_step(state, to_global(batch, self.batch_sharding))
            else:
                sums = self.eval_step_any_size(state, to_global(batch, self.replicated))
            totals = sums if totals is None else metric_lib.add_sums(totals, sums)
        if totals is None:
            raise ValueError("The eval data yields no batches.")
        means = {name: float(value) for name, value in metric_lib.means(jax.device_get(totals)).items()}
        self.history.eval.append({"step": int(jax.device_get(state.step)), **means})
        return means

    # --- preemption -------------------------------------------------------------------------
    def _install_sigterm(self):
        """SIGTERM, and a first SIGINT (Ctrl-C): finish the step, save it, stop. A second SIGINT stops at once."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            if signum == signal.SIGINT and self._preempted == "SIGINT":
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt("second SIGINT: stopped at once, without saving")
            if self._preempted is None:
                self._preempted = signal.Signals(signum).name
                if signum == signal.SIGINT:
                    log.warning("SIGINT: finishing this step and saving it; press Ctrl-C again to stop at once.")

        return signal.signal(signal.SIGTERM, handler), signal.signal(signal.SIGINT, handler)

    def _restore_sigterm(self, previous) -> None:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])


def _check_optimizer(optimizer: Any) -> None:
    """Raises a clear error for anything that is not an optax ``GradientTransformation``."""
    if isinstance(optimizer, optax.GradientTransformation):
        return
    name = getattr(optimizer, "__qualname__", None) or type(optimizer).__name__
    if callable(optimizer):
        raise ValueError(
            f"optimizer is {getattr(optimizer, '__module__', '')}.{name}, a function; pass the optimizer it "
            f"builds, e.g. {name}(1e-3) (an optax GradientTransformation)."
        )
    raise ValueError(f"optimizer must be an optax GradientTransformation (e.g. optax.adam(1e-3)), got {optimizer!r:.80}.")


def _check_loss_fn(loss_fn: Any, what: str) -> None:
    """Raises a clear error for a loss function that cannot be called as ``loss_fn(model, batch)``."""
    if not callable(loss_fn):
        raise ValueError(f"{what} must be a function loss_fn(model, batch) -> loss | (loss, metrics), got {loss_fn!r:.80}.")
    try:
        parameters = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to check
    try:
        parameters.bind(object(), object())
    except TypeError:
        raise ValueError(
            f"{what} is called as {what}(model, batch), but {getattr(loss_fn, '__name__', what)}{parameters} "
            "does not take two arguments; write it as def loss_fn(model, batch): ..."
        ) from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)

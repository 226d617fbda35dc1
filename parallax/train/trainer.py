"""``Trainer.fit``: the training loop around the step, with hooks for evaluation and checkpoints.

Example:
    >>> trainer = px.Trainer(model, optax.adamw(3e-4), loss_fn, strategy=px.FSDP(), progress=False,
    ...                      max_steps=4, batch_size=32, eval_every=2)
    >>> state, history = trainer.fit(train_data, eval_data=eval_data)
    >>> int(state.step), len(history.eval)
    (4, 2)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax import _multihost
from parallax.models import LossFn, adapter_for, unwrap_pretrained
from parallax.parallel.candidates import AUTO, as_strategy
from parallax.sharding.parts import DataParallel
from parallax.sharding.strategy import Strategy
from parallax.state.plan import StatePlan
from parallax.state.search import Resolved
from parallax.step.build import make_eval_step, make_train_step
from parallax.step.train_state import TrainState
from parallax.train import elastic
from parallax.train.callbacks import ProgressBar, StepInfo, due, read_wanted, state_wanted
from parallax.train.checkpoint import Checkpointer, resume_step_of
from parallax.train.checks import (
    check_eval_data,
    check_later_batch,
    check_loss_fn,
    check_mesh_option,
    check_optimizer,
    check_plan,
)
from parallax.train.config import FitResult, History, TrainerConfig
from parallax.train.data import batch_signature, check_batch_leaves
from parallax.train.evaluation import evaluate
from parallax.train.feed import Feed, saved_state
from parallax.train.guard import NonFiniteGuard
from parallax.train.hooks import Checkpointing, Evaluation, Hook
from parallax.train.planning import plan_run
from parallax.train.preemption import Preemption
from parallax.train.process_failure import Peers
from parallax.train.process_rows import rows_held
from parallax.train.resume import data_position
from parallax.train.sources import as_data, check_first_batch, epoch_steps, lay_out, layouts_it_fits

log = logging.getLogger("parallax")


class Trainer:
    """Trains an unmodified flax model with any parallax strategy.

    Args:
        model: a flax linen module; an NNX module (trained in place: after ``fit`` it holds
            the trained values); or a function that builds an NNX module (planned from shapes;
            ``result.state.module()`` gives the trained module).
        optimizer: an optax transformation, or an ``nnx.Optimizer(model, tx, wrt=nnx.Param)``.
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, metrics)``.
        strategy: the parallelism strategy (``DataParallel()`` by default), or ``"auto"``: at
            the first batch every DP/FSDP/TP mesh of the devices is compiled and priced by
            the cost model, and the fastest that fits is used (``trainer.search`` says what
            was chosen and why; printed with ``progress``). ``FSDP(split="auto")`` likewise.
        config: an ``ml_collections.ConfigDict`` (or dict) of :class:`TrainerConfig` options.
        eval_loss_fn: the loss for evaluation (e.g. the model called with ``train=False``); ``loss_fn`` by default.
        callbacks: extra callbacks (see :mod:`parallax.callbacks`).
        devices: the devices to use; all by default.
        mesh: your own mesh (``jax.make_mesh``'s: any axis types), an axis per strategy part:
            trained on in its device order; axis types follow the model (``sharding_mode``).
        params: pretrained params to start from (a pytree or an orbax path; see :func:`parallax.init_state`).
        **options: :class:`TrainerConfig` options; they override ``config``.

    Example:
        >>> trainer = px.Trainer(model, optax.adam(1e-3), loss_fn, strategy=px.FSDP(),
        ...                      epochs=1, batch_size=64, progress=False)
        >>> result = trainer.fit(train_data)
        >>> result.stop_reason, len(result.history.train)
        ('max_steps', 4)
    """

    def __init__(self, model: Any, optimizer: optax.GradientTransformation, loss_fn: LossFn, *,
                 strategy: Strategy | str | None = None, config: Any = None, eval_loss_fn: LossFn | None = None,
                 callbacks: Sequence[Any] = (), devices: Sequence[jax.Device] | None = None,
                 mesh: Mesh | None = None, params: Any = None, **options: Any):
        self.config = cfg = TrainerConfig.create(config, **options)
        model, params = unwrap_pretrained(model, params)  # a Hugging Face model object: its module and params
        self.adapter = adapter_for(model)
        self.tx = self.adapter.optimizer(optimizer)[0]  # an nnx.Optimizer gives its optax transformation
        check_optimizer(self.tx)
        check_loss_fn(loss_fn, "loss_fn")
        if eval_loss_fn is not None:
            check_loss_fn(eval_loss_fn, "eval_loss_fn")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.eval_loss_fn = eval_loss_fn or loss_fn
        strategy = as_strategy(strategy if strategy is not None else DataParallel())  # "fsdp" as px.plan reads it
        self.devices, self.pretrained = devices, params
        self.search: Resolved | None = None  # what strategy="auto" or FSDP(split="auto") chose, once a batch is seen
        self.layout_allowed = None  # (mesh, strategy) -> whether the data can fill it (an iterable's parts)
        check_mesh_option(mesh, devices, strategy)
        self.given_mesh = mesh is not None or devices is not None  # else a jax.set_mesh around fit is used
        if mesh is None and strategy != AUTO:
            try:
                mesh = strategy.make_mesh(devices)
            except ValueError:  # sizes only a mesh settles (two parts of size -1): a jax.set_mesh around fit
                if self.given_mesh:
                    raise
        self._use(strategy, mesh)
        # With several processes, process 0 alone runs the callbacks that print or write logs.
        self.callbacks = [cb for cb in callbacks if _multihost.is_primary() or not getattr(cb, "primary_only", False)]
        if cfg.progress and _multihost.is_primary():  # one process prints
            self.callbacks.append(ProgressBar(every=cfg.log_every))
        self.checkpointer = (Checkpointer(cfg.checkpoint_dir, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints,
                                          async_save=cfg.async_checkpoints) if cfg.checkpoint_dir else None)
        self.guard = NonFiniteGuard(cfg.on_nonfinite, self.checkpointer)
        self.hooks: list[Hook] = []
        self.state: TrainState | None = None
        self.plan: StatePlan | None = None
        self.max_steps: int | None = None
        self.start_step, self.history = 0, History()
        self.batch_size: int | None = None  # global batch size of the data being fit
        self.steps_per_epoch: int | None = None
        self.data_offset = 0  # data position (in batches) minus step: nonzero after resuming with another batch size
        self._stop_reason: str | None = None
        self._preemption = Preemption()
        self._live_step: int | None = None  # the step self.state is after, while fit runs
        self.layout_change: dict | None = None  # what an elastic resume changed (logged, and saved in metadata)
        self.feed: Feed | None = None  # the batches of the running fit, placed ahead
        self.saved_data: dict | None = None  # the data iterator's state a resume starts from

    def _use(self, strategy: Strategy | str, mesh: Mesh | None) -> None:
        """Trains with ``strategy`` on ``mesh`` (``None`` for ``"auto"`` until a batch is seen): the steps for them."""
        self.strategy, self.mesh, options = strategy, mesh, self.config.step
        self.train_step = make_train_step(self.loss_fn, strategy, options)
        self.train_step.reuse(getattr(self.search, "step", None))  # the program the search compiled for its pick
        self.eval_step = make_eval_step(self.eval_loss_fn, strategy, options)
        self.eval_step_any_size = make_eval_step(self.eval_loss_fn, strategy, options, compile="auto",
                                                 replicated_batch=True)
        self.batch_sharding = NamedSharding(mesh, strategy.batch_spec()) if mesh is not None else None
        self.replicated = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None

    # --- state ---------------------------------------------------------------------------
    def _plan(self, example_batch: Any) -> StatePlan:
        """The run's plan, made at the first use of a batch (:func:`parallax.train.planning.plan_run`): the
        trainer takes its strategy, mesh, devices, config and search, and builds its steps on them."""
        if self.plan is None:
            run = plan_run(self, example_batch)
            self.devices, self.config, self.search = run.devices, run.config, run.search
            self._use(run.strategy, run.mesh)
            self.plan = run.plan
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
        self.state = TrainState(model=self.adapter.model, tx=self.tx, **arrays)
        return metadata

    def request_stop(self, reason: str) -> None:
        """Ends training after the current step (used by callbacks such as EarlyStopping)."""
        self._stop_reason = reason

    def hook(self, kind: type) -> Any:
        """The running hook of this kind (``Evaluation``, ``Checkpointing``), if any."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    # --- fit -------------------------------------------------------------------------------
    def fit(self, train_data: Any, eval_data: Any = None, *, resume: bool = False) -> FitResult:
        """Trains until ``max_steps`` / ``epochs``, evaluating and checkpointing on the way.

        Args:
            train_data: arrays (``(x, y)`` or a dict) or a ``grain.MapDataset`` of examples, both
                with ``batch_size``; or an iterable of batches (a Grain ``IterDataset`` or
                ``DataLoader``, a list, a generator; re-iterated each epoch; a function returning
                one also works). See :mod:`parallax.train.sources`.
            eval_data: the same kinds; evaluated every ``eval_every`` steps and at the end.
            resume: continue from the newest checkpoint in ``checkpoint_dir`` (same data
                order and rngs: the same training, on another number of devices too: ``elastic``).

        Returns:
            :class:`FitResult`: unpacks as ``state, history``; ``.stop_reason`` says why it stopped.
        """
        cfg = self.config
        source = as_data(train_data, cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed, drop_remainder=True)
        self.feed = None
        with Peers() as self.peers:  # several processes: all end when one fails, falls silent or runs out of data
            try:
                self._prepare(source, eval_data, resume)
            except BaseException as error:
                self.peers.failed(error)  # the others end now, not after a heartbeat timeout
                source.close()  # a Grain loader it already started (its workers) ends with the error
                raise
            try:
                with self._preemption:
                    held = len(rows_held(self.batch_sharding, self.batch_size))  # once, not at every step
                    check = lambda batch, step: check_later_batch(batch, step, self.batch_size, self.strategy,
                                                                  self.batch_sharding, self.config.step.grad_accum,
                                                                  held)
                    self.feed = Feed(source, self.start_step + self.data_offset, self.saved_data, self.batch_sharding,
                                     cfg.prefetch, check, self.start_step + 1, self.max_steps - self.start_step)
                    stop_reason = self._loop(source)
            except BaseException as error:
                self.peers.failed(error)
                raise
            finally:
                if self.feed is not None:
                    self.feed.close()  # a Grain loader's workers end with fit, however it ends
                for callback in self.callbacks:
                    if hasattr(callback, "on_fit_end"):
                        callback.on_fit_end(self)
                if self.checkpointer is not None:
                    self.checkpointer.wait()
        self.adapter.write_back(self.state.params, self.state.model_state)
        if stop_reason == "preempted":
            saving = self.hook(Checkpointing)
            self._preemption.report(saving.last_saved if saving is not None else None, cfg.on_preemption)
        return FitResult(self.state, self.history, stop_reason)

    def _prepare(self, source: Any, eval_data: Any, resume: bool) -> None:
        """Everything before step one: the first batch, the checks, the plan, the state (fresh or resumed)."""
        cfg = self.config
        resume_step = resume_step_of(self.checkpointer, resume)
        metadata = self.checkpointer.read_metadata(resume_step) if resume_step is not None else {}
        self.saved_data = saved_state(metadata)  # an iterator's own position: a resume re-reads nothing
        if (first := source.peek(self.saved_data)) is None:
            raise ValueError("The training data yields no batches.")
        check_first_batch(first, source, cfg.batch_size)
        check_batch_leaves(first, "a training batch")
        _multihost.check_same(batch_signature(first), "The first training batch (each process's part)",
                              "give every process a part of each batch with the same shapes and dtypes.")
        _multihost.check_same(source.steps_per_epoch, "The training data's batches per epoch (each process's)",
                              "give each process as many batches (drop the extra ones), or data parallax splits "
                              "itself: arrays or a grain.MapDataset with batch_size=.")
        self.max_steps = cfg.max_steps if cfg.max_steps is not None else epoch_steps(source, cfg.epochs)
        summary = (cfg.progress if cfg.summary is None else cfg.summary) and _multihost.is_primary()
        self.batch_size = int(getattr(source, "batch_size", None)
                              or np.shape(jax.tree.leaves(first)[0])[0] * jax.process_count())
        self.layout_allowed = layouts_it_fits(source, self.batch_size)
        check_plan(self._plan(first), summary, cfg.fail_if_replicated_over)
        lay_out(source, self.batch_sharding, self.batch_size)  # each process feeds the rows its devices hold
        if eval_data is not None:
            check_eval_data(self.adapter, self.plan.abstract, eval_data, self.eval_loss_fn, cfg)
        if self.checkpointer is not None:
            self.checkpointer.check_writable(sum(x.size * x.dtype.itemsize
                                                 for x in jax.tree.leaves(self.plan.abstract_arrays())))
        self.steps_per_epoch = source.steps_per_epoch
        self.start_step = self._start(first, resume_step, metadata)
        self._stop_reason = None
        self.hooks = ([Evaluation(eval_data, cfg.eval_every)] if eval_data is not None else []) + (
            [Checkpointing(self.checkpointer)] if self.checkpointer is not None else [])

    def _start(self, example_batch: Any, step: int | None, metadata: dict) -> int:
        """The state to train from: checkpoint ``step`` (its ``metadata`` read), or a fresh one."""
        self.data_offset = 0
        self._fit_layout(metadata)
        if step is None:
            self.init(example_batch)
            return 0
        metadata = self._load(example_batch, step, verify=False)  # newest_verified just checked it
        log.info("Resumed from step %d in %s.", step, self.checkpointer.directory)
        shards = self.strategy.data_shards(self.mesh)
        self.data_offset = data_position(metadata, self.batch_size, self.steps_per_epoch, shards) - step
        return step

    def _fit_layout(self, metadata: dict) -> None:
        """Keeps a checkpoint's global batch on another number of devices (``elastic``); checks the batch splits."""
        cfg = self.config
        accum, self.layout_change = elastic.adapt(
            metadata, mode=cfg.elastic, batch_size=self.batch_size, data_shards=self.strategy.data_shards(self.mesh),
            grad_accum=cfg.step.grad_accum, mesh_shape=dict(self.mesh.shape))
        if accum != cfg.step.grad_accum:
            self.config = dataclasses.replace(cfg, step=dataclasses.replace(cfg.step, grad_accum=accum))
            self.train_step = make_train_step(self.loss_fn, self.strategy, self.config.step)
        self.strategy.check_batch_size(self.batch_size, self.mesh, multiple=self.config.step.grad_accum)

    def _loop(self, source) -> str:
        for callback in self.callbacks:
            if hasattr(callback, "on_fit_start"):
                callback.on_fit_start(self)
        step, reason = self.start_step, "max_steps"
        pending: list[tuple] = []  # (step, epoch, device metrics) not yet read from the device
        while step < self.max_steps:
            batch, placed = next(self.feed, (None, None))
            if self.peers.data_ended(batch is None, step + 1, length_known=source.steps_per_epoch is not None,
                                     max_steps=self.max_steps):
                reason = "data exhausted"
                break
            epoch = (step + self.data_offset) // source.steps_per_epoch if source.steps_per_epoch else None
            self.state, metrics = self.train_step(self.state, placed)
            step = self._live_step = step + 1
            if pending:
                # Step t is queued; wait for step t-1 so that at most two steps are in
                # flight (no transfer: the values are read in batches below).
                jax.block_until_ready(pending[-1][2])
            pending.append((step, epoch, metrics))
            preempted = self._preemption.stop_after(step)  # agreed by every process
            hooks = [hook for hook in self.hooks if hook.due(step, preempted)]
            if hooks or preempted or self._stop_reason or step == self.max_steps or state_wanted(self.callbacks, step):
                eval_metrics: dict = {}
                for hook in hooks:
                    if not hook.after_read:
                        eval_metrics.update(hook.run(self, step, pending) or {})
                self.read_metrics(pending, eval_metrics or None)
                for hook in hooks:
                    if hook.after_read:
                        hook.run(self, step, pending)
            elif read_wanted(self.callbacks, [s for s, _, _ in pending[:-1]], self.config.fetch_every):
                # Read the older steps only: this step is still running on the device.
                self.read_metrics(pending[:-1])
                del pending[:-1]
            if self._stop_reason:
                reason = self._stop_reason
                break
            if self._preemption.stopping:  # in one process, it may have landed while metrics were read
                break
        self.read_metrics(pending)
        if self._preemption.stopping:
            # The signal may have landed after this step's hooks ran (while metrics were
            # read): the step it stops at is saved all the same.
            reason = "preempted"
        for hook in self.hooks:
            hook.at_end(self, step, pending, reason)
        return reason

    def read_metrics(self, pending: list[tuple], eval_metrics: dict | None = None) -> None:
        """Reads the pending steps' metrics in one transfer; NaN guard; history; callbacks.

        The newest pending step's info carries the live state (``StepInfo.state``) when it is
        this trainer's current state; older steps' states were donated to later steps.
        """
        if not pending:
            return
        fetched = jax.device_get([metrics for _, _, metrics in pending])
        for index, ((step, epoch, _), values) in enumerate(zip(pending, fetched)):
            host = {"loss": float(values["loss"]), **{k: float(v) for k, v in values.items() if k != "loss"}}
            self.guard.check_loss(step, host["loss"])
            self.history.train.append({"step": step, **host})
            last = index == len(pending) - 1
            info = StepInfo(step=step, epoch=epoch, metrics=host, eval_metrics=eval_metrics if last else None,
                            max_steps=self.max_steps, trainer=self,
                            state=self.state if step == self._live_step else None)
            for callback in self.callbacks:
                if due(callback, info):
                    callback.on_step(info)
        pending.clear()

    # --- evaluation -----------------------------------------------------------------------
    def evaluate(self, eval_data: Any, state: TrainState | None = None) -> dict[str, float]:
        """Exact metric means over a whole eval set, the last partial batch included.

        Full batches are split over the data axes; a batch the data axes (or the processes)
        do not divide is given whole to every device (:mod:`parallax.train.evaluation`).
        """
        state = self.state if state is None else state
        if state is None:
            raise ValueError("No state yet: call fit(...) or init(example_batch) first.")
        means = evaluate(self, eval_data, state)
        self.history.eval.append({"step": int(jax.device_get(state.step)), **means})
        return means

"""Clear errors, before anything compiles, for arguments the Trainer cannot take."""

from __future__ import annotations

import inspect
from typing import Any

import jax
import numpy as np
import optax

from parallax import _multihost
from parallax.models import LossFn, ModelAdapter, ModelRun
from parallax.parallel.pipeline.stacked_blocks import unstacked
from parallax.state.plan import StatePlan
from parallax.state.summary import summarize
from parallax.step.train_state import TrainState, model_rngs
from parallax.train.data import ArrayData, batch_signature
from parallax.train.evaluation import eval_source


def check_optimizer(optimizer: Any) -> None:
    """Raises a clear error for anything that is not an optax ``GradientTransformation``."""
    if isinstance(optimizer, optax.GradientTransformation):
        return
    name = getattr(optimizer, "__qualname__", None) or type(optimizer).__name__
    if callable(optimizer):
        raise ValueError(
            f"optimizer is {getattr(optimizer, '__module__', '')}.{name}, a function; pass the optimizer it "
            f"builds, e.g. {name}(1e-3) (an optax GradientTransformation)."
        )
    raise ValueError("optimizer must be an optax GradientTransformation (e.g. optax.adam(1e-3)), "
                     f"got {optimizer!r:.80}.")


def check_loss_fn(loss_fn: Any, what: str) -> None:
    """Raises a clear error for a loss function that cannot be called as ``loss_fn(model, batch)``."""
    if not callable(loss_fn):
        raise ValueError(f"{what} must be a function loss_fn(model, batch) -> loss | (loss, metrics), "
                         f"got {loss_fn!r:.80}.")
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


def check_eval_batch(adapter: ModelAdapter, abstract: TrainState, batch: Any, eval_loss_fn: LossFn,
                     rng_streams: Any) -> None:
    """Runs the eval loss on one eval batch abstractly (shapes only); a clear error if it does not fit."""

    def run(params, model_state, batch, key):
        return adapter.apply(unstacked(params), model_state, batch, rngs=model_rngs(key, rng_streams),
                             loss_fn=eval_loss_fn, run=ModelRun(train=True))

    try:
        jax.eval_shape(run, adapter.unbox(abstract.params), abstract.model_state, batch, abstract.rng)
    except Exception as err:  # whatever flax/jax raise, it is the eval data against this model
        shapes = {jax.tree_util.keystr(key_path): f"{leaf.dtype}{tuple(np.shape(leaf))}"
                  for key_path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]}
        raise ValueError(
            f"eval_data does not fit the model: its first batch {shapes} fails in the eval loss with "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Checked before training; "
            "give eval_data the training data's feature shapes and dtypes."
        ) from err


def check_plan(plan: StatePlan, summary: bool, fail_if_replicated_over: int | None) -> None:
    """Prints the state's summary (``summary=True``) and raises ``px.ReplicatedParamError`` for a param
    of more than ``fail_if_replicated_over`` bytes whole on every device, before anything is built."""
    if summary or fail_if_replicated_over is not None:
        report = summarize(plan, fail_if_replicated_over=fail_if_replicated_over, find_frozen=summary)
        if summary:
            report.print()


def check_eval_data(adapter: Any, abstract: Any, eval_data: Any, eval_loss_fn: Any, cfg: Any) -> None:
    """Runs ``eval_loss_fn`` on the first eval batch abstractly (shapes only) before step 1."""
    source = eval_source(eval_data, cfg)
    if isinstance(source, ArrayData):
        batch = source.take(next(source.epoch_rows()), whole=True)
    else:
        batch = next(iter(source.epoch()), None)
    if batch is None:
        raise ValueError("eval_data yields no batches; pass at least one example, or no eval_data.")
    _multihost.check_same(batch_signature(batch, rows=False), "The eval data's features",
                          "give every process eval data of the same feature shapes and dtypes.")
    check_eval_batch(adapter, abstract, batch, eval_loss_fn, cfg.step.rng_streams)


def check_later_batch(batch: Any, step: int, batch_size: int, strategy: Any, sharding: Any, grad_accum: int,
                      held: int) -> None:
    """A batch of another size than the first (an iterable's last one) must still split over the data axes;
    with several processes each part has ``held`` rows, what this process's devices hold of a full batch."""
    local = int(np.shape(jax.tree.leaves(batch)[0])[0])
    if jax.process_count() > 1:
        if local != held:
            raise ValueError(
                f"Process {jax.process_index()}: its part of the batch for step {step} has {local} examples, its "
                f"part of the first batch had {held}. With several processes every part of every batch must have "
                "the first's size (the processes cannot see each other's); drop or pad the last batch.")
        return
    if local != batch_size:
        try:
            strategy.check_batch_size(local, sharding.mesh, multiple=grad_accum)
        except ValueError as err:
            raise ValueError(f"The batch for step {step} has {local} examples (the first had {batch_size}). "
                             f"{err} Drop or pad the last batch of the data.") from None


def check_mesh_option(mesh: Any, devices: Any, strategy: Any) -> None:
    """``Trainer(mesh=...)``: a ``jax.sharding.Mesh`` with an axis of each strategy part's name."""
    if mesh is None:
        return
    if devices is not None:
        raise ValueError("Pass mesh= or devices=, not both: the mesh already says which devices.")
    if isinstance(strategy, str):
        raise ValueError("strategy='auto' searches meshes of its own; with mesh= pass the strategy to train.")
    strategy.check_mesh(mesh)

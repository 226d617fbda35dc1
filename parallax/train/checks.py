"""Clear errors, before anything compiles, for arguments the Trainer cannot take."""

from __future__ import annotations

import inspect
from typing import Any

import jax
import numpy as np
import optax

from parallax.models import LossFn, ModelAdapter, ModelRun
from parallax.step.plan import StatePlan
from parallax.step.state import TrainState, model_rngs
from parallax.step.summary import summarize


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
    raise ValueError(f"optimizer must be an optax GradientTransformation (e.g. optax.adam(1e-3)), got {optimizer!r:.80}.")


def check_loss_fn(loss_fn: Any, what: str) -> None:
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


def check_eval_batch(adapter: ModelAdapter, abstract: TrainState, batch: Any, eval_loss_fn: LossFn,
                     rng_streams: Any) -> None:
    """Runs the eval loss on one eval batch abstractly (shapes only); a clear error if it does not fit."""

    def run(params, model_state, batch, key):
        return adapter.apply(params, model_state, batch, rngs=model_rngs(key, rng_streams), loss_fn=eval_loss_fn,
                             run=ModelRun(train=True))

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
        report = summarize(plan, fail_if_replicated_over=fail_if_replicated_over)
        if summary:
            report.print()

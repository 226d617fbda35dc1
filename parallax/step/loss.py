"""The one loss closure both compile paths differentiate: model run → loss → metric sums."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from parallax.models import LossFn, ModelAdapter, ModelRun
from parallax.parallel.pipeline.stacked_blocks import unstacked
from parallax.step import metrics as metric_lib
from parallax.step.batch import leading_dims
from parallax.step.train_state import model_rngs


def loss_closure(adapter: ModelAdapter, loss_fn: LossFn, rng_streams: Sequence[str], run: ModelRun) -> Callable:
    """``loss(params, model_state, batch, key) -> (loss, (sums, new_model_state))``.

    ``sums`` are ``(sum, count)`` pairs of the loss and each metric over the batch the
    closure sees (a data shard inside ``shard_map``, the global batch under ``jit``).
    """

    def loss(params: Any, model_state: dict, batch: Any, key: Any):
        output, new_model_state = adapter.apply(unstacked(params), model_state,  # a list held stacked, as written
                                                batch, rngs=model_rngs(key, rng_streams), loss_fn=loss_fn, run=run)
        value, metrics = metric_lib.split_loss_output(output)
        sums = metric_lib.to_sums(value, metrics, leading_dims(batch)[0][1])
        return value, (sums, new_model_state)

    return loss

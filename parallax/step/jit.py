"""The ``jit`` compile path: the loss on global arrays, every collective placed by the compiler."""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax.models import LossFn, ModelRun, adapter_for
from parallax.sharding.strategy import Strategy
from parallax.step.accumulate import accumulated
from parallax.step.loss import loss_closure
from parallax.step.options import StepOptions


def jit_run(options: StepOptions, mesh: Mesh, train: bool) -> ModelRun:
    """How the model runs on the global batch: BatchNorm over all of it, the model's own constraints kept."""
    return ModelRun(train=train, batch_stats_axes=None, remat=options.remat, constraint_axes=tuple(mesh.axis_names),
                    compute_dtype=options.policy.compute_dtype)


def jit_gradients(loss_fn: LossFn, strategy: Strategy, options: StepOptions, mesh: Mesh, train: bool) -> Callable:
    """``gradients(state, batch, key)``: ``(grads, sums, model_state)`` in training, ``sums`` in evaluation.

    GSPMD places the collectives; BatchNorm sees the global batch, as on one device.
    """
    run = jit_run(options, mesh, train)
    microbatch_sharding = NamedSharding(mesh, PartitionSpec(None, *strategy.batch_spec()))

    def gradients(state, batch, key):
        loss = loss_closure(adapter_for(state.model), loss_fn, options.rng_streams, run)
        if not train:
            return loss(state.params, state.model_state, batch, key)[1][0]
        grad_fn = jax.value_and_grad(loss, has_aux=True)
        whole_batch = accumulated(grad_fn, options.grad_accum, strategy.data_shards(mesh),
                                  constrain=lambda parts: jax.lax.with_sharding_constraint(parts, microbatch_sharding))
        return whole_batch(state.params, state.model_state, batch, key)

    return gradients

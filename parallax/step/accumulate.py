"""Gradient accumulation around any gradient function: microbatches, summed with ``lax.scan``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from parallax.step import metrics as metric_lib

GradFn = Callable  # (params, model_state, batch, key) -> ((loss, (sums, model_state)), grads)


def microbatches(batch: Any, grad_accum: int, shards: int) -> Any:
    """``(k, B/k, ...)`` microbatches; each keeps rows from every one of ``shards`` data shards.

    Example:
        >>> microbatches(jnp.arange(8), 2, 2)  # shards [0..3] and [4..7], two rows of each per microbatch
        Array([[0, 1, 4, 5],
               [2, 3, 6, 7]], dtype=int32)
    """

    def split(x):
        per_shard = x.shape[0] // shards
        x = x.reshape(shards, grad_accum, per_shard // grad_accum, *x.shape[1:])
        x = jnp.swapaxes(x, 0, 1)
        return x.reshape(grad_accum, x.shape[1] * x.shape[2], *x.shape[3:])

    return jax.tree.map(split, batch)


def accumulated(grad_fn: GradFn, grad_accum: int, shards: int = 1,
                constrain: Callable[[Any], Any] | None = None) -> Callable:
    """``gradients(params, model_state, batch, key) -> (grads, sums, model_state)`` over the whole batch.

    With ``grad_accum > 1`` the batch is cut into microbatches (each with rows of every
    data shard, ``constrain`` placing them), gradients and metric sums are summed over them
    with ``lax.scan`` and the gradient is divided by ``grad_accum``: the update equals one
    step on the whole batch. Microbatch ``i`` draws from ``fold_in(key, i)``.
    """

    def whole(params, model_state, batch, key):
        (_, (sums, model_state)), grads = grad_fn(params, model_state, batch, key)
        return grads, sums, model_state

    if grad_accum == 1:
        return whole

    def gradients(params, model_state, batch, key):
        parts = microbatches(batch, grad_accum, shards)
        if constrain is not None:
            parts = constrain(parts)

        def body(carry, inputs):
            grads_acc, sums_acc, model_state = carry
            index, part = inputs
            grads, sums, model_state = whole(params, model_state, part, jax.random.fold_in(key, index))
            return (jax.tree.map(jnp.add, grads_acc, grads), metric_lib.add_sums(sums_acc, sums), model_state), None

        first = jax.tree.map(lambda x: x[0], parts)
        sums_shape = jax.eval_shape(lambda: grad_fn(params, model_state, first, key)[0][1][0])
        zeros_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
        zeros_grads = jax.tree.map(jnp.zeros_like, params)
        (grads, sums, model_state), _ = jax.lax.scan(
            body, (zeros_grads, zeros_sums, model_state), (jnp.arange(grad_accum), parts)
        )
        return jax.tree.map(lambda g: g / grad_accum, grads), sums, model_state

    return gradients

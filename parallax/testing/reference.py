"""The one-device reference of :func:`parallax.testing.assert_equivalent`: value_and_grad, then optax.

It shares nothing with parallax's step builders: the model is called through its adapter, as
any caller would call it. For the ``shard_map`` path it runs each data shard's loss (``vmap``
over the shards, BatchNorm over all of them) and averages, as that path declares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from parallax.models import ModelRun
from parallax.step.train_state import TrainState, model_rngs
from parallax.testing.rounding import dither

_SHARDS = "shards"  # the vmapped axis standing for the data shards


class Reference:
    """The one-device loop: ``value_and_grad`` of the loss, then optax. Nothing of parallax's
    step builders: the model is called through its adapter, as any caller would call it."""

    def __init__(self, adapter, tx, loss_fn, options, data_shards: int, per_shard: bool):
        self.adapter, self.tx, self.loss_fn = adapter, tx, loss_fn
        self.data_shards = data_shards  # microbatches keep rows of every data shard
        self.shards = data_shards if per_shard else 1  # the loss runs per shard on the shard_map path
        self.streams, self.accum = options.rng_streams, options.grad_accum
        self.dtype = options.policy.compute_dtype
        self.global_stats = options.batch_stats == "global"
        self.step = jax.jit(self._step)

    def _loss(self, params, model_state, batch, key, micro=None):
        """The mean loss over the data shards (one shard under ``jit``), and the new model state.
        Shard ``s`` draws from ``fold_in(key, s)``, then microbatch ``micro`` from a fold of that."""

        def one(part, shard_key, axes):
            run = ModelRun(train=True, batch_stats_axes=axes, compute_dtype=self.dtype)
            output, new_state = self.adapter.apply(params, model_state, part, rngs=model_rngs(shard_key, self.streams),
                                                   loss_fn=self.loss_fn, run=run)
            return (output[0] if isinstance(output, tuple) else output), new_state

        def fold(k):
            return k if micro is None else jax.random.fold_in(k, micro)

        if self.shards == 1:
            return one(batch, fold(key), None)
        parts = jax.tree.map(lambda x: x.reshape(self.shards, x.shape[0] // self.shards, *x.shape[1:]), batch)
        keys = jax.vmap(lambda s: fold(jax.random.fold_in(key, s)))(jnp.arange(self.shards))
        axes = (_SHARDS,) if self.global_stats else None
        values, states = jax.vmap(lambda p, k: one(p, k, axes), axis_name=_SHARDS)(parts, keys)
        return values.mean(), jax.tree.map(lambda x: x.mean(0) if jnp.issubdtype(x.dtype, jnp.floating) else x[0],
                                           states)

    def grads(self, params, model_state, batch, key):
        """The gradient of one step (microbatched as ``grad_accum`` says), the loss and the new model state."""
        if self.accum == 1:
            (value, model_state), grads = jax.value_and_grad(self._loss, has_aux=True)(params, model_state, batch, key)
            return grads, value, model_state
        total, values = None, []
        for index in range(self.accum):  # each microbatch keeps rows of every data shard
            part = jax.tree.map(lambda x, index=index: self._microbatch(x, index), batch)
            (value, model_state), grads = jax.value_and_grad(self._loss, has_aux=True)(params, model_state, part,
                                                                                       key, index)
            total = grads if total is None else jax.tree.map(jnp.add, total, grads)
            values.append(value)
        return jax.tree.map(lambda g: g / self.accum, total), jnp.mean(jnp.stack(values)), model_state

    def _microbatch(self, x, index):
        rows = x.shape[0] // self.data_shards
        per = rows // self.accum
        x = x.reshape(self.data_shards, rows, *x.shape[1:])[:, index * per:(index + 1) * per]
        return x.reshape(-1, *x.shape[2:])

    def _step(self, params, model_state, opt_state, batch, key):
        grads, value, model_state = self.grads(params, model_state, batch, key)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), model_state, opt_state, value, grads

    def run(self, initial: TrainState, batches, place: Callable | None = None) -> Run:
        """Trains from ``initial`` on ``batches``, every step's inputs placed by ``place(tree, kind)``
        (``kind``: ``"state"``, ``"batch"`` or ``"key"``) if given (so that one program runs them all: jit
        would compile again for outputs the compiler laid out otherwise)."""
        params, model_state, opt_state = initial.params, initial.model_state, initial.opt_state
        losses, inputs, grads = [], [], []
        for t, batch in enumerate(batches):
            if place is not None:
                (params, model_state, opt_state), batch = place((params, model_state, opt_state), "state"), \
                    place(batch, "batch")
            key = jax.random.fold_in(initial.rng, t)
            key = key if place is None else place(key, "key")
            inputs.append((params, model_state, key))
            params, model_state, opt_state, value, grad = self.step(params, model_state, opt_state, batch, key)
            losses.append(float(value))
            grads.append(grad)
        final = jax.device_get(initial.replace(params=params, model_state=model_state, opt_state=opt_state))
        return Run(np.array(losses), final, inputs, grads)

    def gradients_at(self, inputs: list, batches, initial: TrainState, place: Callable) -> list:
        """The gradient at each of another run's ``inputs`` (params, model state, key), placed by
        ``place`` as :meth:`run` places them: read from the program ``run(..., place)`` runs (the
        optimizer's part of it, from ``initial``'s optimizer state, is not used)."""
        opt_state = place((initial.params, initial.model_state, initial.opt_state), "state")[2]  # placed once
        return [self.step(*place((params, model_state, opt_state), "state"), place(batch, "batch"),
                          place(key, "key"))[4]
                for (params, model_state, key), batch in zip(inputs, batches, strict=True)]

    def dithered_gradients(self, inputs: list, batches, initial: TrainState) -> list:
        """The gradient at each of another run's ``inputs`` with the params moved an ulp up or
        down at random (:func:`parallax.testing.rounding.dither`; step ``t`` by seed ``t``), on one
        device: every rounding of the model's computation changed, inside each example too."""
        return [self.step(dither(params, seed=t), model_state, initial.opt_state, batch, key)[4]
                for t, ((params, model_state, key), batch) in enumerate(zip(inputs, batches, strict=True))]


@dataclasses.dataclass(frozen=True)
class Run:
    """One reference run: its losses, final state, and each step's inputs (params, model state, key) and gradient."""

    losses: np.ndarray
    final: TrainState
    inputs: list
    grads: list

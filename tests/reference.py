"""A plain single-device training loop: the reference every strategy must match."""

from __future__ import annotations

import jax
import numpy as np
import optax

import parallax as px


def plain_step(model, tx, loss_fn):
    """value_and_grad + optax, nothing else: what a user writes for one device."""

    def step(params, model_state, opt_state, batch):
        def loss(p):
            out, updates = model.apply(
                {"params": p, **model_state}, batch, method=lambda m, b: loss_fn(m, b), mutable=list(model_state)
            )
            return (out[0] if isinstance(out, tuple) else out), updates

        (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(params)
        upd, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), {**model_state, **updates}, opt_state, value

    return jax.jit(step)


def run_plain(model, tx, loss_fn, state: px.TrainState, batches, place=None):
    """Trains from ``state``'s values; ``place(tree, kind)`` puts inputs somewhere.

    Returns the loss trajectory and the final (params, model_state).
    """
    params = jax.device_get(state.params)
    model_state = jax.device_get(state.model_state)
    opt_state = tx.init(params)
    if place is not None:
        params, model_state, opt_state = place(params, "params"), place(model_state, "rep"), place(opt_state, "opt")
    step = plain_step(model, tx, loss_fn)
    losses = []
    for batch in batches:
        if place is not None:
            batch = place(batch, "batch")
        params, model_state, opt_state, value = step(params, model_state, opt_state, batch)
        losses.append(float(value))
    return np.array(losses), jax.device_get(params), jax.device_get(model_state)


def mesh_placer(state: px.TrainState, strategy: px.Strategy):
    """Places plain-loop inputs on the strategy's mesh with its shardings (GSPMD floor)."""
    mesh, specs = px.step.state_specs_of(state)
    param_shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs.params,
                                   is_leaf=px.specs.is_spec)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    batch_sharding = jax.sharding.NamedSharding(mesh, strategy.batch_spec())

    def place(tree, kind):
        if kind == "params":
            return jax.device_put(tree, param_shardings)
        if kind == "batch":
            return jax.device_put(tree, batch_sharding)
        return jax.device_put(tree, replicated)

    return place

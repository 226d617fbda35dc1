"""A plain single-device training loop: the reference every strategy must match.

Also what every equivalence test shares: the strategy and optimizer grid, the largest
difference between two trees, and the bound: 1e-5, or twice what plain ``jit`` already drifts
when the same values are merely placed on the strategy's mesh (the compiler's own floor).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import optax

import parallax as px

TOL = 1e-5


def _fsdp(size=-1):
    return px.FSDP(size, min_weight_size=64)


STRATEGIES = {
    "dp": lambda: px.DataParallel(),
    "fsdp": lambda: _fsdp(),
    "tp": lambda: px.TensorParallel(),
    "dp+fsdp": lambda: px.combine(px.DataParallel(2), _fsdp(4)),
    "fsdp+tp": lambda: px.combine(_fsdp(4), px.TensorParallel(2)),
    "dp+fsdp+tp": lambda: px.combine(px.DataParallel(2), _fsdp(2), px.TensorParallel(2)),
}
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(3e-3, weight_decay=0.1)}


def max_diff(a, b) -> float:
    """The largest absolute difference between two trees of arrays with the same structure.

    0.0 for trees without leaves (e.g. SGD's ``EmptyState``s); different structures fail.
    """
    assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max((float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in pairs), default=0.0)


def with_params(state: px.TrainState, params) -> px.TrainState:
    """``state`` holding ``params`` (e.g. the one-device initial values), laid out like its own params."""
    return state.replace(params=jax.device_put(params, jax.tree.map(lambda x: x.sharding, state.params)))


def run_steps(step, state: px.TrainState, batches) -> tuple[px.TrainState, np.ndarray]:
    """Runs ``step`` over ``batches``: the final state and the loss trajectory."""
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


def bound(diff: float, floor) -> float:
    """``TOL`` when ``diff`` is within it, else ``max(TOL, 2 * floor())`` (computed only then)."""
    return TOL if diff <= TOL else max(TOL, 2 * floor())


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


class PlainRun(NamedTuple):
    """What :func:`run_plain` returns: the loss trajectory and the final values (on the host)."""

    losses: np.ndarray
    params: Any
    model_state: Any
    opt_state: Any


class Drift(NamedTuple):
    """How far one run is from another: losses (max over steps) and final params and optimizer state."""

    losses: float
    params: float
    opt_state: float


def run_plain(model, tx, loss_fn, state: px.TrainState, batches, place=None) -> PlainRun:
    """Trains from ``state``'s values (the optimizer state starts from ``tx.init``).

    ``place(tree, kind)`` puts inputs somewhere.
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
    return PlainRun(np.array(losses), *jax.device_get((params, model_state, opt_state)))


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


def drift_floor(model, tx, loss_fn, start: px.TrainState, batches, strategy: px.Strategy, ref: PlainRun) -> Drift:
    """How far plain jit drifts from the one-device run ``ref`` with ``start``'s values on the mesh."""
    run = run_plain(model, tx, loss_fn, start, batches, place=mesh_placer(start, strategy))
    return Drift(float(np.abs(run.losses - ref.losses).max()), max_diff(run.params, ref.params),
                 max_diff(run.opt_state, ref.opt_state))

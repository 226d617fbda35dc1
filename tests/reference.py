"""A plain single-device training loop: the reference every strategy must match.

Also what every equivalence test shares: the strategy and optimizer grid, the largest
difference between two trees, and the bound: 1e-5; past it, twice what plain ``jit`` already
drifts when the same values are merely placed on the strategy's mesh (the compiler's own
floor), and for each param element also twice what the optimizer amplifies of twice the gradients'
rounding (``px.testing.rounding``: Adam turns a rounding change of a near-zero gradient into a
param change of up to its learning rate, which a loss or optimizer state never shows).
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

import parallax as px

TOL = 1e-5


def _fsdp(size=-1):
    return px.FSDP(size, min_weight_size=64, split="largest")


STRATEGIES = {
    "dp": lambda: px.DataParallel(),
    "fsdp": lambda: _fsdp(),
    "tp": lambda: px.TensorParallel(),
    "dp+fsdp": lambda: px.combine(px.DataParallel(2), _fsdp(4)),
    "fsdp+tp": lambda: px.combine(_fsdp(4), px.TensorParallel(2)),
    "dp+fsdp+tp": lambda: px.combine(px.DataParallel(2), _fsdp(2), px.TensorParallel(2)),
}
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(3e-3, weight_decay=0.1)}


def wait_for_newest_save(checkpointer, step: int) -> None:
    """Waits until the newest save due by ``step`` is committed (renamed into place), without
    ``Checkpointer.wait()``, which would itself write a checksum record the commit lacked."""
    due = [s for s in range(1, step + 1) if checkpointer.due(s)]
    while due and not os.path.isdir(checkpointer.step_dir(due[-1])):
        time.sleep(0.01)


def max_diff(a, b) -> float:
    """The largest absolute difference between two trees of arrays with the same structure.

    0.0 for trees without leaves (e.g. SGD's ``EmptyState``s); different structures fail.
    """
    assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max((float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in pairs), default=0.0)


def snapshot(tree) -> list:
    """Host copies of the leaves (rng keys as their data): copies, since a NumPy view of a CPU array holds its
    buffer, and a buffer held so is not donated (a view kept in tests/test_user_objects.py hid the deletion it
    exists to catch)."""
    return [np.array(jax.random.key_data(x) if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) else x, copy=True)
            for x in jax.tree.leaves(tree)]


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


def _loss(model, loss_fn, model_state, batch):
    def loss(params):
        out, updates = model.apply(
            {"params": params, **model_state}, batch, method=lambda m, b: loss_fn(m, b), mutable=list(model_state)
        )
        return (out[0] if isinstance(out, tuple) else out), updates

    return loss


def plain_step(model, tx, loss_fn):
    """value_and_grad + optax, nothing else: what a user writes for one device (it also returns the gradient)."""

    def step(params, model_state, opt_state, batch):
        (value, updates), grads = jax.value_and_grad(_loss(model, loss_fn, model_state, batch), has_aux=True)(params)
        upd, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), {**model_state, **updates}, opt_state, value, grads

    return jax.jit(step)


class PlainRun(NamedTuple):
    """What :func:`run_plain` returns: the loss trajectory and the final values (on the host), and
    each step's inputs (params, model state) and gradient."""

    losses: np.ndarray
    params: Any
    model_state: Any
    opt_state: Any
    inputs: list = []  # noqa: RUF012 (NamedTuple field default)
    grads: list = []  # noqa: RUF012 (NamedTuple field default)


class Drift(NamedTuple):
    """How far one run is from another: losses (max over steps), final params beyond ``allowance``
    (per element, twice the optimizer's amplification of twice the gradients' rounding) and optimizer state."""

    losses: float
    params: float
    opt_state: float
    allowance: Any = None


def one_device_state(model: Any, optimizer, batch: Any, loss_fn, **options: Any) -> px.TrainState:
    """``model``'s train state built on the first device alone (``init_state(..., rng=0)``): the
    initial variables a one-device reference run and a strategy's run both start from."""
    single = px.DataParallel(1)
    return px.init_state(model, optimizer, batch, strategy=single, rng=0, loss_fn=loss_fn,
                         mesh=single.make_mesh(jax.devices()[:1]), **options)


def run_plain(model, tx, loss_fn, state: px.TrainState, batches, place=None, step=None) -> PlainRun:
    """Trains from ``state``'s values (the optimizer state starts from ``tx.init``).

    ``place(tree, kind)`` puts inputs somewhere: every step's, so that one program runs them all
    (the compiler may lay a step's outputs out otherwise, and jit would compile again for them).
    ``step``: a :func:`plain_step` to run (one is made otherwise).
    """
    params = jax.device_get(state.params)
    model_state = jax.device_get(state.model_state)
    opt_state = tx.init(params)
    step = step or plain_step(model, tx, loss_fn)
    losses, inputs, grads = [], [], []
    for batch in batches:
        if place is not None:
            params, model_state = place(params, "params"), place(model_state, "rep")
            opt_state, batch = place(opt_state, "opt"), place(batch, "batch")
        inputs.append((params, model_state))
        params, model_state, opt_state, value, grad = step(params, model_state, opt_state, batch)
        losses.append(float(value))
        grads.append(grad)
    return PlainRun(np.array(losses), *jax.device_get((params, model_state, opt_state)), inputs, jax.device_get(grads))


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
    """How far plain jit drifts from the one-device run ``ref`` with ``start``'s values on the mesh.

    The params' drift is what is left beyond each element's rounding allowance: the gradient of
    every step of ``ref``, computed again at ``ref``'s own inputs placed on the mesh (another
    reduction order), gives the step's rounding level, and the optimizer rerun on ``ref``'s
    gradients turns it into each param's allowance (``px.testing.rounding_allowance``).
    """
    place, step = mesh_placer(start, strategy), plain_step(model, tx, loss_fn)
    run = run_plain(model, tx, loss_fn, start, batches, place=place, step=step)
    initial = jax.device_get(ref.inputs[0][0])
    opt_state = place(tx.init(initial), "opt")  # any: only the gradient is read, from the program the run ran
    other = [step(place(params, "params"), place(state, "rep"), opt_state, place(batch, "batch"))[4]
             for (params, state), batch in zip(ref.inputs, batches, strict=True)]
    allowance = px.testing.rounding_allowance(tx, initial, tx.init(initial), ref.grads, jax.device_get(other))
    beyond = max(px.testing.excess(run.params, ref.params, allowance).values(), default=0.0)
    return Drift(float(np.abs(run.losses - ref.losses).max()), beyond, max_diff(run.opt_state, ref.opt_state),
                 allowance)


def params_bound(params, ref: PlainRun, floor) -> tuple[float, float]:
    """The final ``params``' difference from ``ref`` and its bound.

    Within ``TOL``: the plain difference and ``TOL``. Past it: the largest difference beyond each
    element's rounding allowance, and ``max(TOL, 2 * floor().params)`` (``floor`` computed only then).
    """
    diff = max_diff(params, ref.params)
    if diff <= TOL:
        return diff, TOL
    drift = floor()
    return max(px.testing.excess(params, ref.params, drift.allowance).values(), default=0.0), max(TOL, 2 * drift.params)


def assert_named(step, log_text: str) -> None:
    """Whatever the compiler replicated in the path ``step`` took is named (by the params that ask
    for it or the JAX op that made it) in ``describe()`` and the log."""
    from parallax.step.resharding import describe_all

    found = step.reshardings.get(step.mode(), [])
    for resharding in found:
        assert resharding.suspects or "/" in resharding.op, resharding
    if found:
        assert describe_all(found) in step.describe()
        assert describe_all(found) in log_text
        # and says what lays the step out without them (another split, path, or the search)
        assert "Exact, but each copy costs memory and time. Laid out without them: " in log_text, log_text[-2000:]


def assert_like_reference(label: str, params, losses: np.ndarray, ref: PlainRun, floor) -> float:
    """The loss trajectory and final ``params`` equal the one-device run ``ref``: within ``TOL``, or
    past it within twice the drift ``floor()`` measures (computed only then). Prints both
    differences under ``label``; returns the losses' bound."""
    loss_diff = float(np.abs(losses - ref.losses).max())
    loss_tol = bound(loss_diff, lambda: floor().losses)
    params_diff, params_tol = params_bound(params, ref, floor)
    print(f"{label}: loss diff {loss_diff:.2e} (bound {loss_tol:.1e}), "
          f"final params diff {params_diff:.2e} (bound {params_tol:.1e})")
    assert loss_diff <= loss_tol, (losses.tolist(), ref.losses.tolist())
    assert params_diff <= params_tol
    return loss_tol

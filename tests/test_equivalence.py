"""Every strategy matches one device, step by step, with SGD and AdamW (8 fake devices).

Compared: the loss trajectory, the final params, the final optimizer state (Adam's moments and step
count; SGD's state has no arrays, so its tree structure) and BatchNorm statistics, each to 1e-5 or,
past it, to the bounds of ``tests/reference.py`` (the compiler's own drift; for params also what the
optimizer amplifies of gradient rounding).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import parallax as px
from tests import tiers
from tests.models import MODELS, batches
from tests.reference import (
    OPTIMIZERS,
    STRATEGIES,
    bound,
    drift_floor,
    max_diff,
    one_device_state,
    params_bound,
    run_plain,
    run_steps,
    with_params,
)

pytestmark = pytest.mark.core

STEPS = 10


@functools.cache
def reference(model_name: str, opt_name: str):
    """Initial params (as built on one device) and the one-device run (a ``PlainRun``)."""
    model_cls, loss_fn = MODELS[model_name]
    data = batches(model_name, STEPS)
    state = one_device_state(model_cls(), OPTIMIZERS[opt_name](), data[0], loss_fn)
    return jax.device_get(state.params), run_plain(model_cls(), OPTIMIZERS[opt_name](), loss_fn, state, data)


def initial_state(model_name: str, opt_name: str, strategy: px.Strategy, random_init: bool = False) -> px.TrainState:
    """The strategy's sharded state, holding exactly the one-device initial variables.

    With ``random_init``, the strategy's own random init is built and compared with one device's
    first (each strategy and model once: the AdamW ``jit`` case); otherwise the one-device values
    are passed as ``params=`` (no random init compiled).
    """
    model_cls, loss_fn = MODELS[model_name]
    init_params = reference(model_name, opt_name)[0]
    state = px.init_state(model_cls(), OPTIMIZERS[opt_name](), batches(model_name, 1)[0], strategy=strategy, rng=0,
                          loss_fn=loss_fn, params=None if random_init else init_params)
    if not random_init:
        return state
    # The sharded init computes the same values as one device (to the last bit or two:
    # newer XLA versions round a few elements of a partitioned init differently) ...
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 jax.device_get(state.params), init_params)
    # ... and the comparison starts from exactly the same initial variables.
    return with_params(state, init_params)


@functools.cache
def _floor(model_name, opt_name, strategy):
    """How far plain jit drifts from one device with the same values merely placed on the mesh (a ``Drift``)."""
    model_cls, loss_fn = MODELS[model_name]
    return drift_floor(model_cls(), OPTIMIZERS[opt_name](), loss_fn, initial_state(model_name, opt_name, strategy),
                       batches(model_name, STEPS), strategy, reference(model_name, opt_name)[1])


CASES = [(s, c) for s in STRATEGIES for c in (("jit",) if s == "tp" else ("shard_map", "jit"))]
GRID = [(s, c, m, o) for s, c in CASES for m in sorted(MODELS) for o in sorted(OPTIMIZERS)]
# The core tier: each strategy on each path with AdamW, every model at least once (the CNN's BatchNorm on
# shard_map under a data axis), and SGD where a gradient summed over the data axis would show.
CORE = [("dp", "shard_map", "cnn", "adamw"), ("dp", "jit", "lm", "adamw"), ("fsdp", "shard_map", "mlp", "adamw"),
        ("fsdp", "jit", "cnn", "adamw"), ("tp", "jit", "mlp", "adamw"), ("dp+fsdp", "shard_map", "cnn", "adamw"),
        ("dp+fsdp", "shard_map", "mlp", "sgd"), ("dp+fsdp", "jit", "mlp", "adamw"),
        ("fsdp+tp", "shard_map", "lm", "adamw"), ("fsdp+tp", "jit", "cnn", "adamw"),
        ("dp+fsdp+tp", "shard_map", "mlp", "adamw"), ("dp+fsdp+tp", "jit", "lm", "adamw")]


@pytest.mark.parametrize("strategy_name, compile_mode, model_name, opt_name",
                         tiers.cases(GRID, CORE))
def test_matches_single_device(strategy_name, compile_mode, model_name, opt_name):
    _model_cls, loss_fn = MODELS[model_name]
    data = batches(model_name, STEPS)
    _, ref = reference(model_name, opt_name)
    strategy = STRATEGIES[strategy_name]()  # TensorParallel() derives each model's layout from its computation

    state = initial_state(model_name, opt_name, strategy, random_init=(opt_name, compile_mode) == ("adamw", "jit"))
    used = set().union(*(px.specs.dims_axes(list(spec)) for spec in jax.tree.leaves(
        px.step.state_specs_of(state)[1].params, is_leaf=px.specs.is_spec)))
    assert used == {p.axis for p in strategy.parts if not isinstance(p, px.DataParallel)}, used
    state, losses = run_steps(px.make_train_step(loss_fn, strategy, compile=compile_mode), state, data)
    diff = float(np.abs(losses - ref.losses).max())
    # The same optax state tree as one device's (max_diff checks the structure): moments, counts.
    opt_diff = max_diff(jax.device_get(state.opt_state), ref.opt_state)
    floor = functools.partial(_floor, model_name, opt_name, strategy)  # cached; run only past TOL
    tol = bound(diff, lambda: floor().losses)
    params_diff, params_tol = params_bound(jax.device_get(state.params), ref, floor)  # beyond rounding allowances
    opt_tol = bound(opt_diff, lambda: floor().opt_state)
    print(f"{strategy_name}/{compile_mode}/{model_name}/{opt_name}: max loss diff {diff:.2e} (bound {tol:.1e}), "
          f"max final param diff {params_diff:.2e} (past 1e-5: beyond rounding allowances; bound {params_tol:.1e}), "
          f"max final opt-state diff {opt_diff:.2e} (bound {opt_tol:.1e})")
    assert diff <= tol, f"{strategy.describe()}: loss trajectory differs by {diff:.3g} > {tol:.3g}"
    assert params_diff <= params_tol, (f"{strategy.describe()}: final params differ by {params_diff:.3g} "
                                       f"> {params_tol:.3g}")
    assert opt_diff <= opt_tol, f"{strategy.describe()}: final opt state differs by {opt_diff:.3g} > {opt_tol:.3g}"
    # BatchNorm statistics after N steps match one device.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=max(tol, 1e-5) * 10),
                 jax.device_get(state.model_state), ref.model_state)
    assert int(state.step) == STEPS

"""Third-party Flax models, unchanged, train like one device under every strategy (8 fake devices).

Models: transformers' Flax GPT-2, Llama, BERT, ViT and ResNet (see ``tests/third_party.py``),
each against a plain one-device optax loop from the same initial variables, with SGD (every strategy) and
AdamW (the three-axis hybrid): default step arguments under DP, FSDP and TP, ``compile="jit"`` on the
hybrids. The bound is max(1e-5, twice the drift of plain ``jit`` on the same values placed on the mesh),
computed here.
"""

from __future__ import annotations

import functools
import logging

import jax
import pytest

import parallax as px
from tests import tiers
from tests.reference import (
    OPTIMIZERS,
    TOL,
    assert_like_reference,
    assert_named,
    drift_floor,
    max_diff,
    run_plain,
    run_steps,
)
from tests.third_party import MODELS, batches

pytestmark = pytest.mark.core

STEPS = 6
MIN = 256  # FSDP splits params above this many elements (the tiny configs' kernels)

# TensorParallel() has no rules: each model's layout is derived from its computation.
STRATEGIES = {
    "dp": lambda: px.DataParallel(),
    "fsdp": lambda: px.FSDP(min_weight_size=MIN, split="largest"),
    "tp": lambda: px.TensorParallel(),
    "fsdp+tp": lambda: px.combine(px.FSDP(4, min_weight_size=MIN, split="largest"), px.TensorParallel(2)),
    "dp+fsdp+tp": lambda: px.combine(px.DataParallel(2), px.FSDP(2, min_weight_size=MIN, split="largest"),
                                     px.TensorParallel(2)),
}


@functools.cache
def module(model_name: str):
    return MODELS[model_name][0]()


@functools.cache
def reference(model_name: str, opt_name: str):
    _, loss_fn, kind = MODELS[model_name]
    data = batches(kind, STEPS)
    single = px.DataParallel(1)
    state = px.init_state(module(model_name), OPTIMIZERS[opt_name](), data[0], strategy=single, rng=0,
                          loss_fn=loss_fn, mesh=single.make_mesh(jax.devices()[:1]))
    return jax.device_get(state.params), run_plain(module(model_name), OPTIMIZERS[opt_name](), loss_fn, state, data)


# SGD under every strategy (it shows a wrong gradient scale, which Adam hides); AdamW under the
# hybrid that uses all three axes. Compiling dominates the cost: this grid keeps the suite short.
GRID = [(s, "sgd") for s in STRATEGIES] + [("dp+fsdp+tp", "adamw")]


CASES = [(m, s, o) for m in MODELS for s, o in GRID]
# The core tier: AdamW under the hybrid of all three axes, on each model.
CORE = [(m, "dp+fsdp+tp", "adamw") for m in MODELS]


@pytest.mark.parametrize("model_name, strategy_name, opt_name",
                         tiers.cases(CASES, CORE))
def test_third_party_model_matches_one_device(model_name, strategy_name, opt_name, fresh_compiles, caplog):
    _, loss_fn, kind = MODELS[model_name]
    data = batches(kind, STEPS)
    init_params, ref = reference(model_name, opt_name)
    strategy = STRATEGIES[strategy_name]()

    def start():  # the step donates its input state: each run gets its own
        return px.init_state(module(model_name), OPTIMIZERS[opt_name](), data[0], strategy=strategy, rng=0,
                             loss_fn=loss_fn, params=init_params)

    # DP and FSDP take the default (the cost model's path where the loss's trace is per-example);
    # the hybrids take jit, the path exact for any loss, to keep one compile per test.
    options = {"compile": "jit"} if "+" in strategy_name else {}
    caplog.set_level(logging.WARNING, logger="parallax")
    step = px.make_train_step(loss_fn, strategy, **options)
    state, losses = run_steps(step, start(), data)
    assert_named(step, caplog.text)  # any tensor the compiler replicated to reshard it is named
    floor = functools.cache(lambda: drift_floor(module(model_name), OPTIMIZERS[opt_name](), loss_fn, start(), data,
                                                strategy, ref))
    loss_tol = assert_like_reference(f"{model_name}/{strategy_name}/{opt_name}", jax.device_get(state.params), losses,
                                     ref, floor)
    if ref.model_state:  # BatchNorm statistics
        assert max_diff(jax.device_get(state.model_state), ref.model_state) <= 10 * max(loss_tol, TOL)
    # Every non-data axis really splits something.
    specs = [x.sharding.spec for x in jax.tree.leaves(state.params)]
    for part in strategy.parts:
        if not isinstance(part, px.DataParallel):
            assert any(part.axis in str(spec) for spec in specs), (part.axis, model_name)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_derived_tensor_layout_splits_most_of_the_model(model_name):
    """No rules: the layout read from the computation splits the bulk of every model's params."""
    _, loss_fn, kind = MODELS[model_name]
    import optax

    plan = px.plan_state(module(model_name), optax.sgd(0.1), batches(kind, 1)[0], loss_fn=loss_fn,
                         strategy=px.combine(px.DataParallel(4), px.TensorParallel(2)))
    layout = plan.found.of(plan.strategy.parts[1])
    print(plan.describe_layout())
    assert layout.split_fraction >= 0.5, plan.describe_layout()

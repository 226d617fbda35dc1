"""Models that read their params their own way, or place their own sharding constraints.

Both habits come from real code: transformers' Flax GPT-2 and BERT tie the output layer to
the embedding by reading ``self.variables["params"][...]`` and transposing it; MaxText-style
models call ``nn.with_logical_constraint`` and are trained inside ``nn.logical_axis_rules``.
Every strategy, on both compile paths, must train them exactly like a plain one-device loop.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import parallax as px
from tests.reference import run_plain, run_steps

pytestmark = pytest.mark.core

STEPS = 4
TOL = 1e-5


class TiedLM(nn.Module):
    """The output layer is the embedding table, read directly and transposed (as GPT-2 does)."""

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(64, 32, name="embed")(tokens)
        x = x + nn.Dense(32, name="down")(nn.gelu(nn.Dense(64, name="up")(x)))
        table = self.variables["params"]["embed"]["embedding"]
        return x @ table.T


def logical(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class LogicalMLP(nn.Module):
    """Annotated params and activation constraints in logical names (MaxText style)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.with_logical_constraint(x, ("batch", "embed"))
        h = nn.Dense(64, name="up", kernel_init=logical(("embed", "mlp")))(x)
        h = nn.with_logical_constraint(nn.relu(h), ("batch", "mlp"))
        return nn.Dense(10, name="down", kernel_init=logical(("mlp", "embed")))(h)


# The rules the model's authors train with: they name axes that not every parallax mesh has.
RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"))


def lm_loss(model, batch):
    logits = model(batch["x"][:, :-1], train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:]).mean()


def classifier_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"], train=True), batch["y"]).mean()


def make_batches(kind):
    rng = np.random.default_rng(0)
    if kind == "tied":
        return [{"x": rng.integers(0, 64, (16, 9)).astype(np.int32)} for _ in range(STEPS)]
    return [{"x": rng.normal(size=(16, 24)).astype(np.float32), "y": rng.integers(0, 10, 16).astype(np.int32)}
            for _ in range(STEPS)]


CASES = {"tied": (TiedLM, lm_loss), "logical": (LogicalMLP, classifier_loss)}
STRATEGIES = {
    "dp": lambda: px.DataParallel(),
    "fsdp": lambda: px.FSDP(min_weight_size=64, split="largest"),
    "fsdp+tp": lambda: px.combine(px.FSDP(4, min_weight_size=64, split="largest"), px.TensorParallel(2)),
    "dp+fsdp+tp": lambda: px.combine(px.DataParallel(2), px.FSDP(2, min_weight_size=64, split="largest"),
                                     px.TensorParallel(2)),
}


@functools.cache
def reference(case):
    model_cls, loss_fn = CASES[case]
    data = make_batches(case)
    single = px.DataParallel(1)
    with nn.logical_axis_rules(RULES):
        state = px.init_state(model_cls(), optax.sgd(0.1), data[0], strategy=single, loss_fn=loss_fn,
                              mesh=single.make_mesh(jax.devices()[:1]))
    ref = run_plain(model_cls(), optax.sgd(0.1), loss_fn, state, data)
    return jax.device_get(state.params), ref.losses, ref.params


@pytest.mark.parametrize("compile_mode", ["shard_map", "jit"])
@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
@pytest.mark.parametrize("case", list(CASES))
def test_trains_like_one_device(case, strategy_name, compile_mode):
    model_cls, loss_fn = CASES[case]
    data = make_batches(case)
    init_params, ref_losses, ref_params = reference(case)
    strategy = STRATEGIES[strategy_name]()
    with nn.logical_axis_rules(RULES):
        state = px.init_state(model_cls(), optax.sgd(0.1), data[0], strategy=strategy, loss_fn=loss_fn,
                              params=init_params)
        state, losses = run_steps(px.make_train_step(loss_fn, strategy, compile=compile_mode), state, data)
    np.testing.assert_allclose(losses, ref_losses, atol=TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=TOL), jax.device_get(state.params), ref_params)
    if case == "tied" and "fsdp" in strategy_name:
        assert any("fsdp" in str(x.sharding.spec) for x in jax.tree.leaves(state.params))


def test_tied_embedding_under_fsdp_keeps_the_reduce_scatter_gradient():
    strategy = px.FSDP(min_weight_size=64, split="largest")
    batch = make_batches("tied")[0]
    state = px.init_state(TiedLM(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=lm_loss)
    step = px.make_train_step(lm_loss, strategy, compile="shard_map")
    stats = px.inspect.collective_bytes(step.lower(state, batch).compile().as_text())
    split = [x for x in jax.tree.leaves(state.params) if any(x.sharding.spec)]
    assert stats["reduce-scatter"].count == len(split)
    assert stats["reduce-scatter"].bytes == sum(x.size * x.dtype.itemsize for x in split)

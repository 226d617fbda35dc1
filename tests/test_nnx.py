"""Flax NNX models through the same seam: every strategy matches a plain one-device NNX + optax loop.

The first slice of NNX support (issue 13): params and model state as plain dicts split from
the module, planned from a function that builds it or taken from an instance.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from tests.reference import OPTIMIZERS, TOL, max_diff

STEPS = 10


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.down = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.hidden(nnx.relu(self.up(x)))))


class CNN(nnx.Module):
    """Conv → BatchNorm → Dense: model state that training changes."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.head = nnx.Linear(16 * 8 * 8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        return self.head(x.reshape(x.shape[0], -1))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


MODELS = {"mlp": (MLP, (16,)), "cnn": (CNN, (8, 8, 1))}


def batches(name: str, n: int = STEPS, size: int = 32) -> list[dict]:
    rng = np.random.default_rng(1)
    shape = MODELS[name][1]
    return [{"x": rng.normal(size=(size, *shape)).astype(np.float32),
             "y": rng.integers(0, 10, size).astype(np.int32)} for _ in range(n)]


def plain_nnx_run(build, tx, data, place=None):
    """value_and_grad over the module's Param values + optax, on one device: what an NNX user writes."""
    graphdef, params, rest = nnx.split(build(), nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    opt_state = tx.init(params)
    if place is not None:
        params, rest, opt_state = place(params, "params"), place(rest, "rep"), place(opt_state, "opt")

    @jax.jit
    def step(params, rest, opt_state, batch):
        def loss(p):
            model = nnx.merge(graphdef, p, rest)
            value = loss_fn(model, batch)
            return value, nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])

        (value, rest), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, value

    losses = []
    for batch in data:
        params, rest, opt_state, value = step(params, rest, opt_state, batch if place is None else place(batch, "batch"))
        losses.append(float(value))
    return np.array(losses), jax.device_get(params), jax.device_get(rest), jax.device_get(opt_state)


@functools.lru_cache(maxsize=None)
def reference(name: str, opt_name: str):
    cls = MODELS[name][0]
    with jax.default_device(jax.devices()[0]):
        return plain_nnx_run(lambda: cls(nnx.Rngs(0)), OPTIMIZERS[opt_name](), batches(name))


def floor(name, opt_name, state, strategy):
    """Plain jit with the same values merely placed on the strategy's mesh: the compiler's own drift."""
    mesh, specs = px.step.state_specs_of(state)
    shard = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
    rep = shard(jax.sharding.PartitionSpec())

    def place(tree, kind):
        if kind == "params":
            return jax.device_put(tree, jax.tree.map(shard, specs.params, is_leaf=px.specs.is_spec))
        if kind == "batch":
            return jax.device_put(tree, shard(strategy.batch_spec()))
        return jax.device_put(tree, rep)

    cls = MODELS[name][0]
    losses, params, _, _ = plain_nnx_run(lambda: cls(nnx.Rngs(0)), OPTIMIZERS[opt_name](), batches(name), place)
    ref_losses, ref_params, _, _ = reference(name, opt_name)
    return float(np.abs(losses - ref_losses).max()), max_diff(params, ref_params)


STRATEGIES = {
    "dp": lambda: px.DataParallel(),
    "fsdp": lambda: px.FSDP(min_weight_size=64),
    "tp": lambda: px.TensorParallel(),
    "dp+fsdp": lambda: px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=64)),
    "fsdp+tp": lambda: px.combine(px.FSDP(4, min_weight_size=64), px.TensorParallel(2)),
}
CASES = ([("mlp", s, "auto", o) for s in STRATEGIES for o in sorted(OPTIMIZERS)]
         + [("mlp", "fsdp", "shard_map", "adamw"), ("cnn", "fsdp", "shard_map", "adamw"),
            ("cnn", "fsdp+tp", "jit", "sgd")])


@pytest.mark.parametrize("name, strategy_name, compile_mode, opt_name", CASES,
                         ids=["-".join(case) for case in CASES])
def test_nnx_model_matches_one_device(name, strategy_name, compile_mode, opt_name):
    cls = MODELS[name][0]
    strategy = STRATEGIES[strategy_name]()
    data = batches(name)
    state = px.init_state(lambda: cls(nnx.Rngs(0)), OPTIMIZERS[opt_name](), data[0], strategy=strategy,
                          loss_fn=loss_fn)
    ref_losses, ref_params, ref_rest, ref_opt = reference(name, opt_name)
    np.testing.assert_allclose(max_diff(jax.device_get(state.params), plain_nnx_run(
        lambda: cls(nnx.Rngs(0)), OPTIMIZERS[opt_name](), data[:0])[1]), 0, atol=1e-6)
    step = px.make_train_step(loss_fn, strategy, compile=compile_mode)
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    diffs = {"loss": float(np.abs(np.array(losses) - ref_losses).max()),
             "params": max_diff(jax.device_get(state.params), ref_params),
             "opt_state": max_diff(jax.device_get(state.opt_state), ref_opt),
             "model_state": max_diff(jax.device_get(state.model_state), ref_rest)}
    bounds = {k: TOL for k in diffs}
    if any(v > TOL for v in diffs.values()):
        loss_floor, params_floor = floor(name, opt_name, state, strategy)
        bounds = {k: max(TOL, 2 * max(loss_floor, params_floor)) for k in diffs}
    print(f"nnx {name}/{strategy_name}/{compile_mode}/{opt_name}: "
          + ", ".join(f"{k} {v:.2e} (bound {bounds[k]:.1e})" for k, v in diffs.items()))
    for key, value in diffs.items():
        assert value <= bounds[key], f"{strategy.describe()}: {key} differs by {value:.3g} > {bounds[key]:.3g}"


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="up")(x))
        x = nn.relu(nn.Dense(64, name="hidden")(x))
        return nn.Dense(10, name="down")(x)


@pytest.mark.parametrize("strategy_name", ["fsdp", "fsdp+tp"])
def test_linen_and_nnx_definitions_of_one_network_train_alike(strategy_name):
    """The same network in linen and in NNX, from the same weights, gives the same losses."""
    strategy = STRATEGIES[strategy_name]()
    data = batches("mlp")
    nnx_state = px.init_state(lambda: MLP(nnx.Rngs(0)), optax.adamw(3e-3), data[0], strategy=strategy,
                              loss_fn=loss_fn)
    linen_state = px.init_state(LinenMLP(), optax.adamw(3e-3), data[0], strategy=strategy, loss_fn=loss_fn)
    linen_state = linen_state.replace(params=jax.device_put(
        jax.device_get(nnx_state.params), jax.tree.map(lambda x: x.sharding, linen_state.params)))
    trajectories = []
    for state in (nnx_state, linen_state):
        step = px.make_train_step(loss_fn, strategy)
        losses = []
        for batch in data:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        trajectories.append(np.array(losses))
    print(f"linen vs nnx ({strategy_name}): max loss diff {np.abs(trajectories[0] - trajectories[1]).max():.2e}")
    np.testing.assert_allclose(trajectories[0], trajectories[1], atol=TOL)


def test_a_model_built_from_a_function_is_never_whole_on_one_device():
    class Wide(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 1024, rngs=rngs)
            self.down = nnx.Linear(1024, 10, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    state = px.init_state(lambda: Wide(nnx.Rngs(0)), optax.adam(1e-3), batches("mlp", 1)[0],
                          strategy=px.FSDP(min_weight_size=0), loss_fn=loss_fn)
    kernel = state.params["up"]["kernel"]
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(16, 128)}
    assert {shard.data.shape for shard in state.opt_state[0].mu["up"]["kernel"].addressable_shards} == {(16, 128)}


def test_an_instance_keeps_its_own_values():
    """A module the user already has (e.g. pretrained) is placed as it is, not re-initialised."""
    model = MLP(nnx.Rngs(7))
    model.down.bias.set_value(model.down.bias.get_value() + 1.0)  # as if trained
    expected = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    strategy = px.combine(px.FSDP(4, min_weight_size=0), px.TensorParallel(2))
    state = px.init_state(model, optax.sgd(0.1), batches("mlp", 1)[0], strategy=strategy, loss_fn=loss_fn)
    assert max_diff(jax.device_get(state.params), expected) == 0.0
    assert state.params["up"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")

"""Flax NNX models through the same seam: every strategy matches a plain one-device NNX + optax loop.

The first slice of NNX support (issue 13): params and model state as plain dicts split from
the module, planned from a function that builds it or taken from an instance.
"""

from __future__ import annotations

import functools
import os
import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from tests import tiers
from tests.reference import OPTIMIZERS, TOL, max_diff, run_steps

pytestmark = pytest.mark.core

STEPS = 10


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.down = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.hidden(nnx.relu(self.up(x)))))


class CNN(nnx.Module):
    """Conv → BatchNorm → Dropout → Dense: model state that training changes, and random masks."""

    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.25):
        self.conv = nnx.Conv(1, 16, (3, 3), use_bias=False, rngs=rngs)  # BatchNorm follows
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(16 * 8 * 8, 10, rngs=rngs)

    def __call__(self, x):
        x = self.drop(nnx.relu(self.bn(self.conv(x))))
        return self.head(x.reshape(x.shape[0], -1))


class Transformer(nnx.Module):
    """Embedding, one pre-norm block (causal self-attention, MLP, dropout on both), LM head."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, dim: int = 32, heads: int = 4):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, dropout_rate=0.1, use_bias=False, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.drop(self.attn(self.ln1(x), mask=nnx.make_causal_mask(tokens)))
        x = x + self.drop(self.down(nnx.gelu(self.up(self.ln2(x)))))
        return self.head(x)


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


MODELS = {
    "mlp": lambda: MLP(nnx.Rngs(0)),
    "cnn": lambda: CNN(nnx.Rngs(0, dropout=1)),
    "cnn-nodrop": lambda: CNN(nnx.Rngs(0, dropout=1), dropout=0.0),
    "transformer": lambda: Transformer(nnx.Rngs(0, dropout=1)),
}


def batches(name: str, n: int = STEPS, size: int = 32) -> list[dict]:
    rng = np.random.default_rng(1)
    if name == "transformer":
        tokens = rng.integers(0, 64, (n, size, 9)).astype(np.int32)
        return [{"x": t[:, :-1], "y": t[:, 1:]} for t in tokens]
    shape = (16,) if name == "mlp" else (8, 8, 1)
    return [{"x": rng.normal(size=(size, *shape)).astype(np.float32),
             "y": rng.integers(0, 10, size).astype(np.int32)} for _ in range(n)]


def step_keys(seed: int = 0):
    """The dropout key of each step, as parallax documents it: the state's key is the third split of
    the seed, step ``t`` uses ``fold_in(key, t)``, and rng stream ``i`` of ``rng_streams`` folds in ``i``."""
    state_key = jax.random.split(jax.random.PRNGKey(seed), 3)[2]
    return lambda t: jax.random.fold_in(jax.random.fold_in(state_key, t), 0)


def with_dropout_key(model, key):
    """Points the model's "dropout" streams at ``key`` (count 0): what a user does before each step."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.RngStream) and node.tag == "dropout":
            node.key.set_value(jax.random.wrap_key_data(key))
            node.count.set_value(jax.numpy.zeros_like(node.count.get_value()))


def floats(tree):
    """The floating leaves of a state (BatchNorm statistics): rng keys and counts are not compared."""
    return [x for x in jax.tree.leaves(tree) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]


def plain_nnx_run(build, tx, data, place=None, at=None):
    """value_and_grad over the module's Param values + optax, on one device: what an NNX user writes.

    Returns the losses, final params, final floating model state, final optimizer state, each
    step's gradient and inputs. ``place(tree, kind)`` puts every step's inputs somewhere (so that
    one program runs them all); with ``at`` (another run's ``(params, rest)`` per step) also the
    gradients at those inputs, from the same program (for the rounding level of the gradients).
    """
    model = build()
    model.train()  # dropout on, BatchNorm on the batch's statistics
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    opt_state = tx.init(params)
    place = place or (lambda tree, kind: tree)
    key_of = step_keys()

    def grads_of(params, rest, batch, key):
        def loss(p):
            model = nnx.merge(graphdef, p, rest)
            with_dropout_key(model, key)
            value = loss_fn(model, batch)
            return value, nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])

        return jax.value_and_grad(loss, has_aux=True)(params)

    @jax.jit
    def step(params, rest, opt_state, batch, key):
        (value, new_rest), grads = grads_of(params, rest, batch, key)
        new_rest = jax.tree.map(lambda old, new: new if jax.numpy.issubdtype(new.dtype, jax.numpy.floating) else old,
                                rest, new_rest)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_rest, opt_state, value, grads

    losses, inputs, grads, at_grads = [], [], [], []
    for t, batch in enumerate(data):
        params, rest, opt_state, batch = place(params, "params"), place(rest, "rep"), place(opt_state, "opt"), \
            place(batch, "batch")
        if at is not None:
            at_grads.append(step(place(at[t][0], "params"), place(at[t][1], "rep"), opt_state, batch, key_of(t))[4])
        inputs.append((params, rest))
        params, rest, opt_state, value, grad = step(params, rest, opt_state, batch, key_of(t))
        losses.append(float(value))
        grads.append(grad)
    run = (np.array(losses), jax.device_get(params), floats(jax.device_get(rest)), jax.device_get(opt_state),
           jax.device_get(grads), inputs)
    return run if at is None else (*run, jax.device_get(at_grads))


@functools.cache
def reference(name: str, opt_name: str):
    with jax.default_device(jax.devices()[0]):
        return plain_nnx_run(MODELS[name], OPTIMIZERS[opt_name](), batches(name))


def floor(name, opt_name, state, strategy):
    """Plain jit with the same values merely placed on the strategy's mesh: the compiler's own drift
    of the losses and of the params beyond their rounding allowance (``tests/reference.py``), and
    the allowance."""
    mesh, specs = px.step.state_specs_of(state)
    shard = lambda spec: jax.sharding.NamedSharding(mesh, spec)
    rep = shard(jax.sharding.PartitionSpec())

    def place(tree, kind):
        if kind == "params":
            return jax.device_put(tree, jax.tree.map(shard, specs.params, is_leaf=px.specs.is_spec))
        if kind == "batch":
            return jax.device_put(tree, shard(strategy.batch_spec()))
        return jax.device_put(tree, rep)

    ref_losses, ref_params, _, _, ref_grads, inputs = reference(name, opt_name)
    losses, params, _, _, _, _, other = plain_nnx_run(MODELS[name], OPTIMIZERS[opt_name](), batches(name), place,
                                                      at=inputs)
    initial = jax.device_get(inputs[0][0])
    tx = OPTIMIZERS[opt_name]()
    allowance = px.testing.rounding_allowance(tx, initial, tx.init(initial), ref_grads, other)
    beyond = max(px.testing.excess(params, ref_params, allowance).values(), default=0.0)
    return float(np.abs(losses - ref_losses).max()), beyond, allowance


STRATEGIES = {
    "dp": lambda: px.DataParallel(),
    "fsdp": lambda: px.FSDP(min_weight_size=64, split="largest"),
    "tp": lambda: px.TensorParallel(),
    "dp+fsdp": lambda: px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=64, split="largest")),
    "fsdp+tp": lambda: px.combine(px.FSDP(4, min_weight_size=64, split="largest"), px.TensorParallel(2)),
}
# Dropout draws one mask for the global batch under jit (what compile="auto" picks for a loss not
# marked per-example), so it matches one device; per-shard streams (shard_map) are tested apart.
CASES = ([(m, s, "auto", o) for m in ("mlp", "cnn", "transformer") for s in STRATEGIES for o in sorted(OPTIMIZERS)]
         + [("mlp", "fsdp", "shard_map", "adamw"), ("cnn-nodrop", "dp+fsdp", "shard_map", "adamw")])


CORE = [("mlp", "dp", "auto", "adamw"), ("cnn", "fsdp", "auto", "adamw"), ("transformer", "tp", "auto", "adamw"),
        ("cnn", "dp+fsdp", "auto", "adamw"), ("transformer", "fsdp+tp", "auto", "adamw"),
        ("mlp", "fsdp", "shard_map", "adamw"), ("cnn-nodrop", "dp+fsdp", "shard_map", "adamw")]


@pytest.mark.parametrize("name, strategy_name, compile_mode, opt_name",
                         tiers.cases(CASES, CORE))
def test_nnx_model_matches_one_device(name, strategy_name, compile_mode, opt_name):
    strategy = STRATEGIES[strategy_name]()
    data = batches(name)
    ref_losses, ref_params, ref_rest, ref_opt, _, _ = reference(name, opt_name)
    initial = nnx.to_pure_dict(nnx.state(MODELS[name](), nnx.Param))  # built eagerly; parallax builds it under jit
    # The sharded build of the module's own initial values is compared once per model and strategy
    # (AdamW); the SGD runs start from the eager values as params= (no random init compiled).
    state = px.init_state(MODELS[name], OPTIMIZERS[opt_name](), data[0], strategy=strategy, loss_fn=loss_fn,
                          params=initial if opt_name == "sgd" else None)
    assert max_diff(jax.device_get(state.params), initial) <= 1e-6  # initializers round alike up to an ulp
    step = px.make_train_step(loss_fn, strategy, compile=compile_mode)
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    diffs = {"loss": float(np.abs(np.array(losses) - ref_losses).max()),
             "params": max_diff(jax.device_get(state.params), ref_params),
             "opt_state": max_diff(jax.device_get(state.opt_state), ref_opt),
             "model_state": max_diff(floats(jax.device_get(state.model_state)), ref_rest)}
    bounds = dict.fromkeys(diffs, TOL)
    if any(v > TOL for v in diffs.values()):  # past 1e-5: the params beyond their rounding allowance
        loss_floor, params_floor, allowance = floor(name, opt_name, state, strategy)
        diffs["params"] = max(px.testing.excess(jax.device_get(state.params), ref_params, allowance).values())
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


@pytest.mark.parametrize("strategy_name", ["fsdp",
                                           pytest.param("fsdp+tp", marks=pytest.mark.wide(tiers.SECOND_OPTIMIZER))])
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
                          strategy=px.FSDP(min_weight_size=0, split="largest"), loss_fn=loss_fn)
    kernel = state.params["up"]["kernel"]
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(16, 128)}
    assert {shard.data.shape for shard in state.opt_state[0].mu["up"]["kernel"].addressable_shards} == {(16, 128)}
    mesh, specs = px.step.state_specs_of(state)
    assert px.FSDP(min_weight_size=0).param_specs(jax.device_get(state.params), mesh) == specs.params


def test_an_instance_keeps_its_own_values():
    """A module the user already has (e.g. pretrained) is placed as it is, not re-initialised."""
    model = MLP(nnx.Rngs(7))
    model.down.bias.set_value(model.down.bias.get_value() + 1.0)  # as if trained
    expected = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    strategy = px.combine(px.FSDP(4, min_weight_size=0, split="largest"), px.TensorParallel(2))
    state = px.init_state(model, optax.sgd(0.1), batches("mlp", 1)[0], strategy=strategy, loss_fn=loss_fn)
    assert max_diff(jax.device_get(state.params), expected) == 0.0
    assert state.params["up"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


class DropoutProbe(nnx.Module):
    """Each example reads its own row; the gradient of that row is its dropout mask."""

    def __init__(self, rngs: nnx.Rngs):
        self.table = nnx.Param(jax.numpy.zeros((32, 64)))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, index):
        return (self.table[index] * self.drop(jax.numpy.ones((index.shape[0], 64)))).sum(-1)


def probe_loss(model, batch):
    return model(batch["index"]).mean()


def dropout_masks(strategy, seed, devices=None):
    """Row i of the result is example i's mask after one SGD step with lr -32 (per-shard losses: shard_map)."""
    batch = {"index": np.arange(32, dtype=np.int32)}
    state = px.init_state(lambda: DropoutProbe(nnx.Rngs(0, dropout=1)), optax.sgd(-32.0), batch, strategy=strategy,
                          rng=seed, loss_fn=probe_loss, mesh=strategy.make_mesh(devices))
    state, _ = px.make_train_step(probe_loss, strategy, compile="shard_map")(state, batch)
    return np.asarray(jax.device_get(state.params["table"]))


def test_nnx_dropout_differs_per_data_shard_repeats_from_the_seed_and_ignores_tensor_shards():
    masks = dropout_masks(px.DataParallel(), seed=0)
    assert set(np.unique(masks)) <= {0.0, 2.0} and 0.4 < (masks == 2.0).mean() < 0.6
    for row in range(4):  # 8 shards of 4 rows: the same local row differs on every shard
        assert len({r.tobytes() for r in masks[row::4]}) == 8
    np.testing.assert_array_equal(dropout_masks(px.DataParallel(), seed=0), masks)
    assert not np.array_equal(dropout_masks(px.DataParallel(), seed=1), masks)
    hybrid = px.combine(px.DataParallel(4), px.TensorParallel(2, rules=[(r"table$", "column")]))
    np.testing.assert_array_equal(dropout_masks(hybrid, 0), dropout_masks(px.DataParallel(4), 0, jax.devices()[:4]))


def arrays(name, n):
    return {k: np.concatenate([b[k] for b in batches(name, n // 32 + 1)])[:n] for k in ("x", "y")}


def test_trainer_fits_an_nnx_instance_in_place_evaluates_and_resumes_bitwise(tmp_path):
    """fit trains the user's module in place, evaluate matches the module on one device, and a run
    resumed from a checkpoint (BatchNorm statistics, dropout streams) ends bitwise equal."""
    ckpt = str(tmp_path / "ckpt")
    train, test = arrays("cnn", 192), arrays("cnn", 40)

    def trainer(model, **options):
        return px.Trainer(model, optax.adamw(3e-3), loss_fn, strategy=px.FSDP(min_weight_size=64), batch_size=32,
                          max_steps=6, progress=False, shuffle=False, checkpoint_dir=ckpt, checkpoint_every=3,
                          **options)

    model = MODELS["cnn"]()
    first = trainer(model)
    result = first.fit(train)
    trained = jax.device_get(result.state)
    assert max_diff(nnx.to_pure_dict(nnx.state(model, nnx.Param)), trained.params) == 0.0
    assert max_diff(floats(nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))), floats(trained.model_state)) == 0.0

    metrics = first.evaluate(test)
    with jax.default_device(jax.devices()[0]):
        one_device = nnx.merge(nnx.graphdef(model), jax.device_get(nnx.state(model)))
        one_device.eval()
        expected = float(loss_fn(one_device, test))
    assert abs(metrics["loss"] - expected) <= TOL, (metrics["loss"], expected)

    os.rename(f"{ckpt}/6", str(tmp_path / "step6"))  # resume from step 3
    resumed = trainer(MODELS["cnn"]).fit(train, resume=True)
    assert [h["loss"] for h in resumed.history.train] == [h["loss"] for h in result.history.train[3:]]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params), trained.params)
    jax.tree.map(np.testing.assert_array_equal, floats(jax.device_get(resumed.state.model_state)),
                 floats(trained.model_state))
    module = resumed.state.module()
    assert isinstance(module, CNN) and module.bn.mean.get_value().shape == (16,)

    # The step-6 checkpoint (of the resumed run) under another strategy and mesh size: the same values.
    elsewhere = px.Trainer(MODELS["cnn"], optax.adamw(3e-3), loss_fn, strategy=px.DataParallel(),
                           devices=jax.devices()[:4], checkpoint_dir=ckpt, progress=False)
    elsewhere.restore({k: v[:4] for k, v in train.items()})
    assert int(elsewhere.state.step) == 6 and elsewhere.state.params["head"]["kernel"].sharding.mesh.size == 4
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(elsewhere.state.params), trained.params)


def test_an_nnx_optimizer_gives_its_transformation_and_its_state():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    data = batches("mlp", 2)
    fresh = px.init_state(model, optimizer, data[0], strategy=px.FSDP(min_weight_size=64, split="largest"),
                          loss_fn=loss_fn)
    assert int(fresh.opt_state[0].count) == 0 and fresh.tx is optimizer.tx
    grads = nnx.grad(lambda m: loss_fn(m, data[0]))(model)
    optimizer.update(model, grads)  # the user already trained a step, NNX style
    state = px.init_state(model, optimizer, data[1], strategy=px.FSDP(min_weight_size=64, split="largest"),
                          loss_fn=loss_fn)
    mu = nnx.to_pure_dict(nnx.state(optimizer.opt_state[0].mu))  # as the NNX optimizer holds it
    assert max_diff(jax.device_get(state.opt_state[0].mu), mu) == 0.0 and int(state.opt_state[0].count) == 1
    assert state.opt_state[0].mu["hidden"]["kernel"].sharding.spec == state.params["hidden"]["kernel"].sharding.spec


def test_an_nnx_optimizer_that_leaves_params_out_is_a_clear_error():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.PathContains("up"))
    with pytest.raises(ValueError, match=r"leaves these params out: (down|hidden)/.*wrt=nnx.Param"):
        px.Trainer(model, optimizer, loss_fn, strategy=px.FSDP())


def test_sharding_annotations_on_nnx_variables_are_respected():
    """nnx.with_partitioning names a mesh axis (or a logical name and its rule): the plan follows it."""
    lecun = nnx.initializers.lecun_normal()

    class Annotated(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(lecun, ("fsdp", None)), rngs=rngs)
            self.down = nnx.Linear(64, 10, kernel_init=nnx.with_partitioning(
                lecun, ("hidden", "classes"), sharding_rules=(("classes", "tensor"),)), rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    strategy = px.combine(px.FSDP(4, min_weight_size=0, split="largest"), px.TensorParallel(2))
    state = px.init_state(lambda: Annotated(nnx.Rngs(0)), optax.sgd(0.1), batches("mlp", 1)[0], strategy=strategy,
                          loss_fn=loss_fn)
    # Unannotated, FSDP would split the larger dim (64) of up/kernel; the annotation asks for dim 0.
    assert next(iter(state.params["up"]["kernel"].sharding.spec)) == "fsdp"
    assert tuple(state.params["down"]["kernel"].sharding.spec)[-1] == "tensor"
    state, metrics = px.make_train_step(loss_fn, strategy)(state, batches("mlp", 1)[0])
    assert np.isfinite(float(metrics["loss"]))


def test_variables_on_different_meshes_are_a_clear_error():
    model = MLP(nnx.Rngs(0))
    devices = np.array(jax.devices())
    first = jax.sharding.Mesh(devices[:4], ("a",))
    second = jax.sharding.Mesh(devices[4:], ("a",))
    rep = jax.sharding.PartitionSpec()
    model.up.kernel.set_value(jax.device_put(model.up.kernel.get_value(), jax.sharding.NamedSharding(first, rep)))
    model.down.kernel.set_value(jax.device_put(model.down.kernel.get_value(),
                                               jax.sharding.NamedSharding(second, rep)))
    with pytest.raises(ValueError, match=r"different meshes: down/kernel on devices \[4, 5, 6, 7\]"
                                         r".*up/kernel on devices \[0, 1, 2, 3\]"):
        px.init_state(model, optax.sgd(0.1), batches("mlp", 1)[0], strategy=px.FSDP(), loss_fn=loss_fn)


@pytest.mark.parametrize("compile_mode", ["jit", "shard_map"])  # shard_map: FSDP shards gathered where read
def test_remat_recomputes_nnx_modules_without_changing_results(compile_mode):
    """remat= names NNX module classes (or class names): same losses, and the step recomputes."""
    strategy = px.FSDP(min_weight_size=64, split="largest")
    data = batches("transformer", 3)
    trajectories, barriers = [], []
    for remat in ((), ("MultiHeadAttention", nnx.Linear)):
        state = px.init_state(MODELS["transformer"], optax.sgd(0.1), data[0], strategy=strategy, loss_fn=loss_fn)
        step = px.make_train_step(loss_fn, strategy, remat=remat, compile=compile_mode)
        barriers.append("optimization_barrier" in step.lower(state, data[0]).as_text())  # how remat reaches XLA
        trajectories.append(run_steps(step, state, data)[1])
    assert barriers == [False, True]
    np.testing.assert_allclose(trajectories[1], trajectories[0], atol=1e-6)


def test_fsdp_shards_of_an_nnx_model_are_gathered_where_the_model_reads_them():
    """Inside shard_map each FSDP shard is all-gathered where its layer reads it (ZeRO-3), so a
    later layer's gather comes after an earlier layer's matmul, not all before the model runs."""
    strategy = px.FSDP(min_weight_size=0, split="largest")
    batch = batches("mlp", 1)[0]
    state = px.init_state(MODELS["mlp"], optax.sgd(0.1), batch, strategy=strategy, loss_fn=loss_fn)
    text = px.make_train_step(loss_fn, strategy, compile="shard_map").lower(state, batch).as_text()
    ops = re.findall(r"stablehlo\.(all_gather|dot_general)", text)
    assert ops.index("dot_general") < len(ops) - 1 - ops[::-1].index("all_gather"), ops


def test_gradient_accumulation_and_bf16_on_an_nnx_model():
    """grad_accum=2 equals one step on the whole batch; precision="bf16" computes in bf16 with
    float32 params and still trains."""
    strategy = px.FSDP(min_weight_size=64, split="largest")
    data = batches("mlp", 2)
    results = {}
    for accum in (1, 2):
        state = px.init_state(MODELS["mlp"], optax.sgd(0.1), data[0], strategy=strategy, loss_fn=loss_fn)
        results[accum] = run_steps(px.make_train_step(loss_fn, strategy, grad_accum=accum), state, data)
    np.testing.assert_allclose(results[2][1], results[1][1], atol=1e-6)
    assert max_diff(jax.device_get(results[2][0].params), jax.device_get(results[1][0].params)) <= 1e-6

    fit = batches("mlp", 1) * 20
    state = px.init_state(MODELS["mlp"], optax.adam(1e-2), fit[0], strategy=strategy, loss_fn=loss_fn)
    step = px.make_train_step(loss_fn, strategy, precision="bf16")
    assert "xbf16>" in step.lower(state, fit[0]).as_text()  # tensors in bf16
    state, losses = run_steps(step, state, fit)
    assert state.params["up"]["kernel"].dtype == np.float32 and losses[-1] < 0.5 * losses[0]


def test_inspect_reads_an_nnx_step():
    """parallax.inspect works on NNX state and steps: per-device bytes and collectives."""
    strategy = px.FSDP(min_weight_size=0, split="largest")
    data = batches("mlp", 1)
    state = px.init_state(MODELS["mlp"], optax.adam(1e-3), data[0], strategy=strategy, loss_fn=loss_fn)
    total = sum(x.nbytes for x in jax.tree.leaves(jax.device_get((state.params, state.opt_state))))
    assert px.inspect.state_bytes_per_device(state) <= total // 8 + 1024  # scalars and small leaves whole
    compiled = px.make_train_step(loss_fn, strategy).lower(state, data[0]).compile()
    collectives = px.inspect.collective_bytes(compiled.as_text())
    assert collectives and px.inspect.memory_bytes(compiled)["temporaries"] > 0

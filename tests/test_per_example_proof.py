"""Reading from a loss's trace whether it is a mean of per-example terms.

Every case is checked twice: by the proof (``parallax.jaxpr.per_example``) and by
numbers, independently of it: the loss and its metric sums computed on the global batch,
against each shard's loss averaged over the shards and each shard's sums added up. A proven
case must agree to float32 rounding; a rejected case that changes meaning per shard must be
shown to differ, so the table cannot pass by rejecting everything or proving everything.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax as px
from parallax.jaxpr.per_example import prove_loss
from parallax.models import ModelRun, adapter_for
from parallax.step.loss import loss_closure
from tests import tiers
from tests.models import CNN, MLP, TinyLM, classifier_loss, lm_loss
from tests.reference import (
    OPTIMIZERS,
    bound,
    drift_floor,
    max_diff,
    one_device_state,
    params_bound,
    run_plain,
    run_steps,
)

pytestmark = pytest.mark.core

SHARDS = 4


class Layer(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        return nn.relu(nn.Dense(16)(carry)), None


class ScannedMLP(nn.Module):
    """Two layers under ``nn.scan``, as in models that scan over their blocks."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(16)(x)
        x, _ = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()(x, None)
        return nn.Dense(10)(x)


class Dropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        return nn.Dense(10)(nn.Dropout(0.5, deterministic=not train)(nn.Dense(16)(x)))


class KernelAttention(nn.Module):
    """Causal self-attention by jax's Pallas flash-attention kernel (run by the interpreter on this CPU), then a
    head over the tokens: a kernel whose grid gives each cell one example."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        from jax.experimental.pallas.ops.gpu import attention

        h = nn.Embed(64, 32)(x)
        q, k, v = (nn.DenseGeneral((2, 16))(h) for _ in range(3))
        out = attention.mha(q, k, v, segment_ids=None, causal=True, interpret=True)
        return nn.Dense(64)(h + nn.DenseGeneral(32, axis=(-2, -1))(out))


def _kernel(body, grid_over_rows: bool):
    """A Pallas kernel on a ``(rows, 10)`` value (the interpreter runs it on this CPU), one row a cell or all
    at once."""
    from jax.experimental import pallas as pl

    def call(x):
        rows, width = x.shape
        spec = pl.BlockSpec((None, width), lambda i: (i, 0)) if grid_over_rows else pl.BlockSpec((rows, width),
                                                                                                 lambda: (0, 0))
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(rows,) if grid_over_rows
                              else (), in_specs=[spec], out_specs=spec, interpret=True)(x)
    return call


def _centred(x_ref, o_ref):
    o_ref[...] = x_ref[...] - x_ref[...].mean(0, keepdims=True)


def _by_position(x_ref, o_ref):
    from jax.experimental import pallas as pl

    o_ref[...] = x_ref[...] * (1 + pl.program_id(0)).astype(x_ref.dtype)


def ce(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


# name -> (model, loss_fn, batch kind, proven?, reason substring when not)
PROVEN = {
    "mean cross-entropy": (MLP, classifier_loss, "x"),
    "LM token mean": (TinyLM, lm_loss, "tokens"),
    "flattened tokens": (TinyLM, lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
        m(b["x"]).reshape(-1, 64), b["y"].reshape(-1)).mean(), "tokens"),
    "sum / batch size read from the batch": (MLP, lambda m, b: ce(m, b).sum() / b["x"].shape[0], "x"),
    "mean plus L2 on params": (MLP, lambda m, b: ce(m, b).mean() + 1e-2 * sum(
        jnp.sum(w ** 2) for w in jax.tree.leaves(m.variables["params"])), "x"),
    "weighted per-example metrics": (MLP, lambda m, b: (ce(m, b).mean(), {
        "per_example": ce(m, b), "pair": ((ce(m, b) * b["w"]).sum(), b["w"].sum()),
        "accuracy": (m(b["x"]).argmax(-1) == b["y"]).mean()}), "x"),
    "mean over tokens, then over examples": (TinyLM, lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
        m(b["x"]), b["y"]).mean(-1).mean(), "tokens"),
    "scan over layers": (ScannedMLP, classifier_loss, "x"),
    "a Pallas attention kernel": (KernelAttention, lm_loss, "tokens"),
    "a Pallas kernel one row a cell": (MLP, lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
        _kernel(lambda x_ref, o_ref: o_ref.__setitem__(..., jnp.tanh(x_ref[...])), True)(m(b["x"])), b["y"]).mean(),
                                       "x"),
}
REJECTED = {
    "masked-token mean": (TinyLM, lambda m, b: (optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"])
                                                * b["mask"]).sum() / b["mask"].sum(), "tokens",
                          "divides batch-wide sums", True),
    "in-batch negatives": (MLP, lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
        m(b["x"]) @ m(b["x"]).T, jnp.arange(b["x"].shape[0])).mean(), "x", "every example with every other", True),
    "BatchNorm": (CNN, classifier_loss, "image", "batch-wide sum", True),
    "dropout": (Dropout, classifier_loss, "x", "random numbers", False),
    "divisor written in": (MLP, lambda m, b: ce(m, b).sum() / 32.0, "x", "does not scale with the batch size", True),
    "sum, no mean": (MLP, lambda m, b: ce(m, b).sum(), "x", "does not scale with the batch size", True),
    "weights over the batch position": (MLP, lambda m, b: (ce(m, b) * jnp.arange(b["x"].shape[0])).mean(), "x",
                                        "different slice", True),
    "hardest example": (MLP, lambda m, b: ce(m, b).max(), "x", "reduce_max over the examples", True),
    "batch-centred": (MLP, lambda m, b: ((ce(m, b) - ce(m, b).mean()) ** 2).mean(), "x",
                      "back into per-example values", True),
    "mean of a square of means": (MLP, lambda m, b: ce(m, b).mean() ** 2, "x", "to a batch-wide sum", True),
    "metric scaled by the batch size": (MLP, lambda m, b: (ce(m, b).mean(), {"total": (ce(m, b).sum(), 1.0)}),
                                        "x", "count is not the number", True),
    "scaled by a count of the batch": (MLP, lambda m, b: (ce(m, b) * jnp.ones(b["x"].shape[0]).sum()).mean(), "x",
                                       "computes differently at one shard's batch size", True),
    "per-example weights as long as the batch": (MLP, lambda m, b: (ce(m, b)[:, None] * jnp.arange(
        b["x"].shape[0])[None, :]).sum(1).mean(), "x", "computes differently at one shard's batch size", True),
    "first example's loss": (MLP, lambda m, b: ce(m, b)[0], "x", "part of the example dim", True),
    "a Pallas kernel over the whole batch": (MLP, lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
        _kernel(_centred, False)(m(b["x"])), b["y"]).mean(), "x", "do not each see one example", True),
    "a Pallas kernel reading its row's place": (MLP, lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
        _kernel(_by_position, True)(m(b["x"])), b["y"]).mean(), "x", "where in the batch", True),
}


def make_batch(kind: str, rows: int = 16, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    if kind == "tokens":
        return {"x": rng.integers(0, 64, (rows, 8)).astype(np.int32),
                "y": rng.integers(0, 64, (rows, 8)).astype(np.int32),
                "mask": (rng.random((rows, 8)) < rng.uniform(0.1, 0.7, (rows, 1))).astype(np.float32)}
    if kind == "image":
        return {"x": rng.normal(size=(rows, 8, 8, 3)).astype(np.float32), "y": rng.integers(0, 10, rows)}
    return {"x": rng.normal(size=(rows, 12)).astype(np.float32), "y": rng.integers(0, 10, rows).astype(np.int32),
            "w": rng.random(rows).astype(np.float32)}


def closure_and_args(model_cls, loss_fn, kind: str):
    model, batch = model_cls(), make_batch(kind)
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, batch["x"], train=False)
    params, model_state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    loss = loss_closure(adapter_for(model), loss_fn, ("dropout",), ModelRun(train=True))
    return loss, (params, model_state, batch, jax.random.key(2))


def per_shard_difference(loss, args) -> float:
    """How far each shard's loss averaged (and its sums added) is from the global batch's: by numbers,
    relative to each value's size where it exceeds 1 (a sum of 16 token losses, ~75, is resolved in
    float32 to ~8e-6: summed in two halves it differed by 1.1e-5 on jax 0.12 with flax 0.12.12)."""
    params, model_state, batch, key = args
    value, (sums, _) = jax.jit(loss)(*args)
    shards = [jax.jit(loss)(params, model_state, jax.tree.map(lambda x, i=i: np.split(x, SHARDS)[i], batch), key)
              for i in range(SHARDS)]

    def apart(whole, parts):
        return abs(float(whole) - parts) / max(1.0, abs(float(whole)))

    diffs = [apart(value, np.mean([float(v) for v, _ in shards]))]
    for name, (total, count) in sums.items():
        diffs.append(apart(total, sum(float(s[1][0][name][0]) for s in shards)))
        diffs.append(apart(count, sum(float(s[1][0][name][1]) for s in shards)))
    return max(diffs)


@pytest.mark.parametrize("name", list(PROVEN))
def test_a_mean_of_per_example_terms_is_proven_and_averages_over_shards(name):
    model_cls, loss_fn, kind = PROVEN[name]
    loss, args = closure_and_args(model_cls, loss_fn, kind)
    proof = prove_loss(loss, *args, SHARDS)
    assert proof, proof.reason
    assert per_shard_difference(loss, args) < 1e-5


def test_batchnorm_statistics_synced_over_the_data_shards_are_proven_and_average_over_shards():
    """The shard_map path runs BatchNorm with the data axes (its statistics are the whole batch's):
    the proof reads the psum of each shard's mean as batch-free. By numbers: the shards, each
    normalised by the psum'd statistics (vmap over an axis named like the data axis), average
    to the global batch's loss, and their new running statistics are the global batch's."""
    model, batch = CNN(), make_batch("image")
    variables = model.init({"params": jax.random.key(0)}, batch["x"], train=False)
    params, model_state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    key = jax.random.key(2)
    synced = loss_closure(adapter_for(model), classifier_loss, ("dropout",),
                          ModelRun(train=True, batch_stats_axes=("data",)))
    proof = prove_loss(synced, params, model_state, batch, key, SHARDS, [("data", SHARDS)])
    assert proof, proof.reason
    whole = loss_closure(adapter_for(model), classifier_loss, ("dropout",), ModelRun(train=True))
    value, (_, state) = jax.jit(whole)(params, model_state, batch, key)
    split = jax.tree.map(lambda x: np.stack(np.split(x, SHARDS)), batch)
    values, (_, states) = jax.vmap(synced, in_axes=(None, None, 0, None), axis_name="data")(params, model_state,
                                                                                            split, key)
    assert abs(float(value) - float(values.mean())) < 1e-5
    assert max_diff(jax.tree.map(lambda x: x[0], states), state) < 1e-5
    # A psum of a sum (not a mean), or of per-example values, is not the whole batch's.
    def summed(model, batch):
        return jax.lax.psum(ce(model, batch).sum(), "data") / batch["x"].shape[0]

    def gathered(model, batch):
        return jax.lax.psum(ce(model, batch), "data").mean()

    for loss_fn in (summed, gathered):
        closure, args = closure_and_args(MLP, loss_fn, "x")
        assert not prove_loss(closure, *args, SHARDS, [("data", SHARDS)])


@pytest.mark.parametrize("name", list(REJECTED))
def test_a_loss_that_is_not_a_mean_of_per_example_terms_is_not_proven(name):
    model_cls, loss_fn, kind, reason, differs = REJECTED[name]
    loss, args = closure_and_args(model_cls, loss_fn, kind)
    proof = prove_loss(loss, *args, SHARDS)
    assert not proof and reason in proof.reason, proof.reason
    if differs:  # by numbers: the shards really do not average to the whole
        assert per_shard_difference(loss, args) > 1e-4


@pytest.fixture(scope="module")
def lm_data():
    return [make_batch("tokens", 16, seed) for seed in range(4)]


@pytest.mark.parametrize("strategy_name, opt_name",
                         tiers.cases([("dp", "sgd"), ("fsdp", "adamw")], [("fsdp", "adamw")]))
def test_an_unmarked_mean_loss_gets_the_cost_models_choice_and_trains_like_one_device(strategy_name, opt_name, lm_data):
    strategy = {"dp": px.DataParallel(), "fsdp": px.FSDP(min_weight_size=2**8, split="largest")}[strategy_name]
    start = one_device_state(TinyLM(), OPTIMIZERS[opt_name](), lm_data[0], lm_loss)
    reference = run_plain(TinyLM(), OPTIMIZERS[opt_name](), lm_loss, start, lm_data)
    def on_mesh():
        return px.init_state(TinyLM(), OPTIMIZERS[opt_name](), lm_data[0], strategy=strategy, rng=0, loss_fn=lm_loss,
                             params=jax.device_get(start.params))

    state = on_mesh()  # donated by the step
    step = px.make_train_step(lm_loss, strategy)
    assert step.mode() == "auto"  # read at the first call
    state, losses = run_steps(step, state, lm_data)
    assert step.proof and set(step.choice.estimates) == {"jit", "shard_map"}
    assert step.mode() == step.choice.picked and "mean of per-example terms" in step.describe()
    loss_diff = float(np.abs(losses - reference.losses).max())
    floor = functools.cache(lambda: drift_floor(TinyLM(), OPTIMIZERS[opt_name](), lm_loss, on_mesh(), lm_data,
                                                strategy, reference))
    params_diff, params_tol = params_bound(jax.device_get(state.params), reference, floor)
    print(f"{strategy_name}/{opt_name} on {step.mode()}: loss diff {loss_diff:.2e}, params diff {params_diff:.2e}")
    assert loss_diff <= bound(loss_diff, lambda: floor().losses)
    assert params_diff <= params_tol


def test_a_loss_the_trace_does_not_prove_keeps_the_global_batch_and_says_why():
    def masked(model, batch):
        per_token = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
        return (per_token * batch["mask"]).sum() / batch["mask"].sum()

    strategy = px.DataParallel()
    batch = make_batch("tokens")
    state = px.init_state(TinyLM(), optax.sgd(0.1), batch, strategy=strategy, rng=0, loss_fn=masked)
    step = px.make_train_step(masked, strategy)
    assert step.modes() == ("jit", "shard_map")  # until the trace is read
    assert not step.prove(state, batch) and step.modes() == ("jit",)  # read without compiling
    run_steps(step, state, [batch])
    assert step.mode() == "jit" and step.choice is None and not step.proof
    assert "divides batch-wide sums" in step.describe() and "px.per_example_loss" in step.describe()

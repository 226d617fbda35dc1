"""parallax.testing: the public equivalence check passes on correct strategies and names planted bugs.

Each planted bug is one a sharded training library can have (gradients summed instead of
averaged, BatchNorm statistics per shard, one dropout key on every shard, an FSDP shard
updated with another shard's gradient, updates rounded to bfloat16: a bug only the params
show); the report must say where training went apart. The tolerance's rounding allowance
(``px.testing.rounding``) is checked against Adam's first step worked out by hand.
"""

from __future__ import annotations

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.sharding import gather as gather_lib
from parallax.step import shard_map as shard_map_step
from parallax.step import update
from tests.models import CNN, MLP, batches, classifier_loss
from tests.reference import STRATEGIES
from tests.scripts.plant_bug import bf16_updates

pytestmark = pytest.mark.core

per_example_loss = px.per_example_loss(classifier_loss)


@pytest.fixture(scope="module")
def pretrained():
    """Params as a fine-tuning run starts from (not the model's init with the runs' seed), and their
    first loss by a plain one-device forward pass."""
    data = batches("mlp", 4, 32)
    params = jax.tree.map(lambda x: x + 0.05, MLP().init(jax.random.key(7), data[0]["x"])["params"])
    first = classifier_loss(MLP().bind({"params": params}), data[0])[0]
    return data, jax.device_get(params), float(first)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_built_in_strategy_passes_from_the_params_given(name, pretrained):
    data, params, first = pretrained
    report = px.testing.assert_equivalent(MLP(), optax.adamw(3e-3), classifier_loss, data, STRATEGIES[name](),
                                          params=params)
    assert report.passed and report.max_diff <= 1e-5 and "trains like one device" in str(report)
    assert abs(report.losses[0] - first) <= 1e-5, (report.losses[0], first)  # both runs started from params=
    assert "=-1" not in report.strategy  # the sizes it ran with: FSDP(fsdp=8), not FSDP(fsdp=-1)


@pytest.mark.parametrize("strategy_name, loss, options", [
    ("dp+fsdp", per_example_loss, {"compile": "shard_map"}),  # per-shard dropout keys, BatchNorm over all shards
    ("fsdp+tp", per_example_loss, {"grad_accum": 2, "compile": "jit"}),  # statistics and masks per microbatch
], ids=["shard_map", "jit-accumulated"])
def test_batchnorm_and_dropout_pass_on_both_paths(strategy_name, loss, options):
    report = px.testing.assert_equivalent(CNN(dropout_rate=0.5), optax.sgd(0.1), loss, batches("cnn", 3, 32),
                                          STRATEGIES[strategy_name](), **options)
    assert report.passed, report
    assert report.mode == options["compile"]
    if "grad_accum" in options:  # unmarked, BatchNorm's statistics over half the batch are refused before training
        with pytest.raises(ValueError, match=r"grad_accum=2 splits each batch into microbatches, but the loss is not a "
                                             r"mean of per-example terms: it applies square to a batch-wide sum "
                                             r"\(batch statistics, e\.g\. BatchNorm's\)"
                                             r".*mark the loss px\.per_example_loss"):
            px.testing.assert_equivalent(CNN(dropout_rate=0.5), optax.sgd(0.1), classifier_loss,
                                         batches("cnn", 3, 32), STRATEGIES[strategy_name](), **options)


def test_the_report_says_what_it_compared_on_the_devices_given():
    """``devices=`` makes the strategy's mesh of them; the headline names what the tolerance held."""
    report = px.testing.assert_equivalent(MLP(), optax.adam(1e-2), classifier_loss, batches("mlp", 2, 16),
                                          px.FSDP(4, min_weight_size=64), devices=jax.devices()[:4])
    assert report.strategy == "FSDP(fsdp=4)", report.strategy
    assert "max difference" in str(report) and "(losses and final state), tolerance 1e-05" in str(report), str(report)
    allowed = dataclasses.replace(report, param_allowance={"Dense_0/kernel": 1.0},
                                  param_excess=dict.fromkeys(report.state_diffs["params"], 0.0))
    text = str(allowed)  # with allowances: the held difference first, the raw one beside it
    assert "each param beyond its rounding allowance; " in text and "before the allowances" in text, text
    most = max(report.state_diffs["params"], key=report.state_diffs["params"].get)
    assert f"(most different: {most} by " in text, text


def test_an_nnx_model_passes():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(24, 64, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.down = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            return self.down(self.drop(nnx.relu(self.up(x))))

    def loss(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    report = px.testing.assert_equivalent(lambda: Net(nnx.Rngs(0, dropout=1)), optax.adam(1e-2), loss,
                                          batches("mlp", 3, 32), STRATEGIES["fsdp+tp"]())
    assert report.passed, report


def test_bf16_passes_with_a_tolerance_that_says_what_it_is_based_on():
    report = px.testing.assert_equivalent(MLP(), optax.adam(1e-3), classifier_loss, batches("mlp", 3, 32),
                                          STRATEGIES["fsdp"](), precision="bf16")
    assert report.passed
    assert report.tolerance == 1e-5 or "bf16 compute" in report.tolerance_basis, report


def caught(*args, **options) -> str:
    with pytest.raises(px.testing.NotEquivalentError) as failure:
        px.testing.assert_equivalent(*args, **options)
    text = str(failure.value)
    print(text)
    assert "does NOT train like one device" in text
    return text


def test_catches_a_gradient_summed_instead_of_averaged_over_one_data_axis(monkeypatch):
    pmean = jax.lax.pmean

    def summed_over_data(x, axis_name, **kwargs):
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        return jax.lax.psum(x, axis_name) if "data" in names else pmean(x, axis_name, **kwargs)

    monkeypatch.setattr(jax.lax, "pmean", summed_over_data)
    text = caught(MLP(), optax.sgd(0.1), per_example_loss, batches("mlp", 3, 32), STRATEGIES["dp+fsdp"](),
                  compile="shard_map")
    assert "first step whose loss differs: step 1" in text  # step 0's loss is computed before the update
    assert re.search(r"params differ: \S*bias", text)
    # Off by the axis size: a replicated bias summed over all 8 shards, an FSDP kernel over the 2-way data axis.
    for name, factor in (("up/bias", 8), ("down/kernel", 2)):
        norms = re.search(rf"{name} \(max difference \S+; norm (\S+) sharded, (\S+) one device\)", text)
        assert norms and float(norms.group(1)) == pytest.approx(factor * float(norms.group(2)), rel=1e-3), name


def test_catches_batchnorm_statistics_computed_per_shard(monkeypatch):
    model_run = shard_map_step.ModelRun
    monkeypatch.setattr(shard_map_step, "ModelRun", lambda **kwargs: model_run(**{**kwargs, "batch_stats_axes": None}))
    text = caught(CNN(), optax.sgd(0.1), per_example_loss, batches("cnn", 3, 32), STRATEGIES["dp"](),
                  compile="shard_map")
    assert re.search(r"model state differ: batch_stats/BatchNorm_\d/var", text)


def test_catches_the_same_dropout_key_on_every_data_shard(monkeypatch):
    monkeypatch.setattr(jax.lax, "axis_index", lambda axis_name: jnp.int32(0))
    text = caught(CNN(dropout_rate=0.5), optax.sgd(0.1), per_example_loss, batches("cnn", 3, 32), STRATEGIES["dp"](),
                  compile="shard_map")
    assert "first step whose loss differs: step 0" in text and "params differ: head/" in text


def test_catches_an_fsdp_shard_updated_with_another_shards_gradient():
    def neighbours_gradient(axis_name, dim, _, grad):
        mean = jax.lax.psum_scatter(grad, axis_name, scatter_dimension=dim, tiled=True) / 8
        return (jax.lax.ppermute(mean, axis_name, [(i, (i + 1) % 8) for i in range(8)]),)

    gather_lib.all_gather_mean_grad.defvjp(gather_lib._gather_fwd, neighbours_gradient)
    try:
        text = caught(MLP(), optax.sgd(0.1), per_example_loss, batches("mlp", 3, 32), px.FSDP(min_weight_size=64),
                      compile="shard_map")
    finally:
        gather_lib.all_gather_mean_grad.defvjp(gather_lib._gather_fwd, gather_lib._gather_bwd)
    assert re.search(r"params differ: \S*kernel", text)
    assert re.search(r"first-step gradients that differ most: \S*kernel", text)


@pytest.mark.parametrize("optimizer", [optax.sgd(0.1), optax.adamw(3e-3, weight_decay=0.1)], ids=["sgd", "adamw"])
def test_catches_updates_rounded_to_bfloat16_which_only_the_params_show(monkeypatch, optimizer):
    """A mixed-precision bug: each update rounded to bfloat16 before it is added (about 0.2% of
    it). Every loss and the optimizer state agree within 1e-5; the final params do not, and under
    AdamW the rounding allowance (large only where a gradient is near Adam's eps) hides nothing."""
    monkeypatch.setattr(update, "optax", types.SimpleNamespace(apply_updates=bf16_updates))
    text = caught(MLP(), optimizer, classifier_loss, batches("mlp", 3, 32), STRATEGIES["fsdp"]())
    assert "first step whose loss differs" not in text and "optimizer state: equal within tolerance" in text, text
    assert re.search(r"params differ: [^\n]*kernel", text)


def test_rounding_allowance_is_adams_first_step_worked_out_by_hand():
    """Adam's first step moves a param by ``-lr * g / (|g| + eps)`` (bias-corrected moments are
    ``g`` and ``g**2``): pushing ``g`` by ``d`` moves it by almost nothing where ``|g| >> eps``,
    and by up to ``lr`` where ``g`` is near ``eps`` or zero."""
    lr, eps, d = 1e-3, 1e-8, 2e-9
    g = np.array([1e-2, -3e-8, 1e-8, 0.0, -5e-9], np.float64)
    adam = optax.adam(lr, eps=eps)
    params = np.zeros(g.shape, np.float32)
    sensitivity = px.testing.optimizer_rounding(adam, params, adam.init(params), [g.astype(np.float32)],
                                                [np.float32(d)])

    def first_step(x):
        return -lr * x / (np.abs(x) + eps)

    expected = np.maximum(np.abs(first_step(g + d) - first_step(g)), np.abs(first_step(g - d) - first_step(g)))
    np.testing.assert_allclose(sensitivity, expected, rtol=1e-3, atol=1e-9)
    assert sensitivity[0] < 1e-9 and sensitivity[3] > 1e-4


def key_bias_attention(params, x, reverse):
    """A one-head attention whose key bias has zero gradient in exact arithmetic (a query's scores
    all move together; the softmax does not change); ``reverse``: the same attention with its keys
    in the other order, as a context-parallel strategy sums them: other roundings, the same math."""
    q, k, v = x @ params["q"], x @ params["k"] + params["key_bias"], x @ params["v"]
    if reverse:
        k, v = k[:, ::-1], v[:, ::-1]
    weights = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k), axis=-1)
    return jnp.mean((jnp.einsum("bqk,bkd->bqd", weights, v) - x[..., :4]) ** 2)


def test_the_allowance_sees_a_gradient_that_is_rounding_alone_and_still_catches_a_bfloat16_ulp_a_step():
    """Adam moves a zero-gradient key bias by its rounding alone, each order of the keys another way:
    0.02 apart after 3 steps here. A level read off the same sums in the same order (what placing
    the inputs on a mesh leaves of an attention) is one ulp of the bias's rounding and allows
    nothing; the level read off params dithered by a ulp (every rounding moved) allows it. The
    other params keep allowances of about 2e-6, so updates rounded to bfloat16 a step still fail."""
    rng = np.random.default_rng(0)
    params = {name: rng.normal(size=(8, 4)).astype(np.float32) for name in "qkv"} | {
        "key_bias": np.zeros(4, np.float32)}
    xs = [rng.normal(size=(4, 16, 8)).astype(np.float32) for _ in range(3)]
    tx, grad = optax.adam(1e-2), jax.jit(jax.grad(key_bias_attention), static_argnums=2)

    def train(reverse, apply=optax.apply_updates):
        current, state, grads, seen = params, tx.init(params), [], []
        for x in xs:
            seen.append(current)
            g = grad(current, x, reverse)
            grads.append(jax.device_get(g))
            updates, state = tx.update(g, state, current)
            current = apply(current, updates)
        return jax.device_get(current), grads, seen

    ref, grads, seen = train(False)
    other = train(True)[0]
    same = [grad(p, x, False) for p, x in zip(seen, xs)]  # the same order again: bit for bit
    dithered = [grad(px.testing.dither(p, seed=t), x, False) for t, (p, x) in enumerate(zip(seen, xs))]
    assert max(float(np.abs(g["key_bias"]).max()) for g in grads) < 1e-5  # rounding alone (the others: 0.6 to 2)
    assert px.testing.excess(other, ref)["key_bias"] > 1e-2  # another order moved it that far

    def held(allowance, run=other):
        return px.testing.excess(run, ref, allowance)

    assert held(px.testing.rounding_allowance(tx, params, tx.init(params), grads, same))["key_bias"] > 1e-2
    allowance = px.testing.rounding_allowance(tx, params, tx.init(params), grads, same, dithered)
    assert max(held(allowance).values()) <= 1e-5, held(allowance)
    assert max(float(np.max(allowance[name])) for name in "qkv") < 1e-5, allowance
    buggy = train(True, apply=bf16_updates)[0]
    assert max(held(allowance, buggy)[name] for name in "qkv") > 1e-5, held(allowance, buggy)


def test_fake_devices_gives_the_devices_it_can_and_says_how_to_get_more(parallax_devices):
    assert len(parallax_devices) == 8 and px.testing.fake_devices(8) == parallax_devices  # the pytest fixture
    with pytest.raises(RuntimeError, match="XLA_FLAGS=--xla_force_host_platform_device_count=64"):
        px.testing.fake_devices(64)

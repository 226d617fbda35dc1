"""The train step: accumulation, exact metrics, rngs, precision, remat, both compile paths."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax as px
from parallax.inspect import collective_bytes
from tests.models import CNN, MLP, TinyLM, batches, classifier_loss, lm_loss
from tests.reference import run_plain


def train(model, tx, loss_fn, strategy, data, **step_kwargs):
    state = px.init_state(model, tx, data[0], strategy=strategy, rng=0, loss_fn=loss_fn)
    step = px.make_train_step(loss_fn, strategy, **step_kwargs)
    history = []
    for batch in data:
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return state, history


def losses(history):
    return np.array([h["loss"] for h in history])


HYBRID = px.combine(px.DataParallel(2), px.FSDP(2, min_weight_size=256), px.TensorParallel(2))


@pytest.mark.parametrize("compile_mode", ["shard_map", "jit"])
@pytest.mark.parametrize("strategy", [px.FSDP(min_weight_size=256), HYBRID], ids=["fsdp", "dp+fsdp+tp"])
def test_grad_accumulation_equals_one_big_step(strategy, compile_mode):
    data = batches("lm", 5, batch_size=32)
    tx = optax.adamw(3e-3)
    _, one = train(TinyLM(), tx, lm_loss, strategy, data, compile=compile_mode)
    state, four = train(TinyLM(), tx, lm_loss, strategy, data, compile=compile_mode, grad_accum=4)
    np.testing.assert_allclose(losses(four), losses(one), atol=1e-5)
    np.testing.assert_allclose([h["accuracy"] for h in four], [h["accuracy"] for h in one], atol=1e-6)


def test_grad_accumulation_reduce_scatters_once_per_step():
    strategy = px.FSDP(min_weight_size=256)
    batch = batches("lm", 1, batch_size=32)[0]
    stats = {}
    for k in (1, 4):
        state = px.init_state(TinyLM(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=lm_loss)
        step = px.make_train_step(lm_loss, strategy, grad_accum=k, compile="shard_map")
        stats[k] = collective_bytes(step.lower(state, batch).compile().as_text())
    assert stats[4]["reduce-scatter"] == stats[1]["reduce-scatter"]
    assert stats[4]["all-gather"].bytes <= stats[1]["all-gather"].bytes
    assert stats[1]["reduce-scatter"].count == 8  # one per FSDP-split param


def metrics_loss(model, batch):
    logits = model(batch["x"])
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    correct = (logits.argmax(-1) == batch["y"]).astype(jnp.float32)
    return per_example.mean(), {
        "accuracy": correct.mean(),  # a scalar mean
        "per_example_loss": per_example,  # per-example values
        "correct": (correct.sum(), jnp.asarray(correct.shape[0], jnp.float32)),  # (sum, count)
        "first_label_share": ((batch["y"] == 0).sum(), batch["y"].shape[0]),
    }


@pytest.mark.parametrize("strategy", [px.DataParallel(), px.FSDP(min_weight_size=0), HYBRID],
                         ids=["dp", "fsdp", "dp+fsdp+tp"])
def test_metrics_equal_one_device(strategy):
    batch = batches("mlp", 1, batch_size=24 if strategy.data_shards() == 8 else 16)[0]
    state = px.init_state(MLP(), optax.sgd(0.0), batch, strategy=strategy, loss_fn=metrics_loss)
    variables = jax.device_get(state.variables)
    logits = np.asarray(MLP().apply(variables, batch["x"]))
    per_example = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))
    correct = (logits.argmax(-1) == batch["y"]).mean()
    _, metrics = px.make_train_step(metrics_loss, strategy)(state, batch)
    np.testing.assert_allclose(metrics["loss"], per_example.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["per_example_loss"], per_example.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], correct, rtol=1e-6)
    np.testing.assert_allclose(metrics["correct"], correct, rtol=1e-6)
    np.testing.assert_allclose(metrics["first_label_share"], (batch["y"] == 0).mean(), rtol=1e-6)


def test_eval_step_returns_sums_and_counts():
    strategy = px.FSDP(min_weight_size=0)
    batch = batches("mlp", 1)[0]
    state = px.init_state(MLP(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=metrics_loss)
    sums = px.make_eval_step(metrics_loss, strategy)(state, batch)
    assert float(sums["loss"][1]) == 16.0 and float(sums["correct"][1]) == 16.0
    _, metrics = px.make_train_step(metrics_loss, strategy, donate=False)(state, batch)
    np.testing.assert_allclose(px.metrics.means(sums)["loss"], metrics["loss"], rtol=1e-6)


class DropoutProbe(nn.Module):
    """Each example reads its own row; the gradient of that row is its dropout mask."""

    @nn.compact
    def __call__(self, index):
        table = self.param("table", nn.initializers.zeros_init(), (32, 64))
        mask = nn.Dropout(0.5, deterministic=False)(jnp.ones((index.shape[0], 64)))
        return (table[index] * mask).sum(-1)


def probe_loss(model, batch):
    return model(batch["index"]).mean()


def dropout_masks(strategy, seed, devices=None):
    batch = {"index": np.arange(32, dtype=np.int32)}
    state = px.init_state(DropoutProbe(), optax.sgd(-32.0), batch, strategy=strategy, rng=seed, loss_fn=probe_loss,
                          mesh=strategy.make_mesh(devices))
    state, _ = px.make_train_step(probe_loss, strategy)(state, batch)
    return np.asarray(jax.device_get(state.params["table"]))  # row i = mask of example i


@pytest.mark.parametrize("compile_mode", ["shard_map", "jit"])
def test_dropout_streams_differ_across_data_shards_and_repeat_from_the_seed(compile_mode):
    strategy = px.DataParallel()
    step_masks = dropout_masks(strategy, seed=0)
    assert set(np.unique(step_masks)) <= {0.0, 2.0}
    assert 0.4 < (step_masks == 2.0).mean() < 0.6
    # 8 shards of 4 rows: the same local row on different shards has a different mask.
    for row in range(4):
        shard_rows = step_masks[row::4]
        assert len({r.tobytes() for r in shard_rows}) == 8
    np.testing.assert_array_equal(dropout_masks(strategy, seed=0), step_masks)
    assert not np.array_equal(dropout_masks(strategy, seed=1), step_masks)


def test_dropout_is_the_same_across_tensor_shards():
    """With a tensor axis, masks depend only on the data shard: the same as DP alone."""
    hybrid = px.combine(px.DataParallel(4), px.TensorParallel(2, rules=[(r"table$", "column")]))
    with_tensor = dropout_masks(hybrid, 0)
    for row in range(8):
        assert len({r.tobytes() for r in with_tensor[row::8]}) == 4
    np.testing.assert_array_equal(with_tensor, dropout_masks(px.DataParallel(4), 0, jax.devices()[:4]))


def test_bf16_policy_trains_with_float32_master_params():
    data = batches("mlp", 1, batch_size=64) * 30  # fit one batch
    strategy = px.FSDP(min_weight_size=0)
    state, history = train(MLP(), optax.adam(1e-2), classifier_loss, strategy, data, precision="bf16")
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(state.params))
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(state.opt_state[0].mu))
    step = px.make_train_step(classifier_loss, strategy, precision="bf16")
    hlo = step.lower(state, data[0]).as_text()
    assert "bf16" in hlo
    with pytest.raises(ValueError, match=r"precision='fp8'"):
        px.make_train_step(classifier_loss, strategy, precision="fp8")


def test_remat_recomputes_blocks_without_changing_results():
    data = batches("lm", 4)
    strategy = px.FSDP(min_weight_size=256)
    _, plain = train(TinyLM(), optax.sgd(0.1), lm_loss, strategy, data)
    _, remat = train(TinyLM(), optax.sgd(0.1), lm_loss, strategy, data, remat=("Block",))
    np.testing.assert_allclose(losses(remat), losses(plain), atol=1e-6)
    state = px.init_state(TinyLM(), optax.sgd(0.1), data[0], strategy=strategy, loss_fn=lm_loss)
    text = px.make_train_step(lm_loss, strategy, remat=("Block",)).lower(state, data[0]).as_text()
    assert "optimization_barrier" in text  # how remat reaches XLA
    plain_text = px.make_train_step(lm_loss, strategy).lower(state, data[0]).as_text()
    assert "optimization_barrier" not in plain_text


@pytest.mark.parametrize("strategy", [px.DataParallel(), px.FSDP(min_weight_size=64),
                                      px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=64))],
                         ids=["dp", "fsdp", "dp+fsdp"])
def test_both_compile_paths_give_the_same_losses(strategy):
    data = batches("cnn", 6)
    _, via_shard_map = train(CNN(), optax.adamw(3e-3), classifier_loss, strategy, data, compile="shard_map")
    _, via_jit = train(CNN(), optax.adamw(3e-3), classifier_loss, strategy, data, compile="jit")
    np.testing.assert_allclose(losses(via_shard_map), losses(via_jit), atol=1e-6)


class HardCodedBatchNorm(nn.Module):
    """BatchNorm written for pmap, with an axis_name that does not exist here."""

    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(16)(x.reshape(x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
        return nn.Dense(10)(nn.relu(x))


def test_batchnorm_with_a_hard_coded_axis_name_uses_the_global_batch():
    data = batches("cnn", 5)
    strategy = px.DataParallel()
    state, history = train(HardCodedBatchNorm(), optax.sgd(0.1), classifier_loss, strategy, data)
    single = px.DataParallel(1)
    start = px.init_state(HardCodedBatchNorm(None), optax.sgd(0.1), data[0], strategy=single,
                          mesh=single.make_mesh(jax.devices()[:1]), loss_fn=classifier_loss)
    ref, _, ref_state = run_plain(HardCodedBatchNorm(None), optax.sgd(0.1), classifier_loss, start, data)
    np.testing.assert_allclose(losses(history), ref, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), jax.device_get(state.model_state),
                 ref_state)


def test_local_batch_stats_option():
    data = batches("cnn", 3)
    strategy = px.DataParallel()
    _, global_stats = train(CNN(), optax.sgd(0.1), classifier_loss, strategy, data)
    state, local_stats = train(CNN(), optax.sgd(0.1), classifier_loss, strategy, data, batch_stats="local")
    assert not np.allclose(losses(local_stats), losses(global_stats), atol=1e-4)  # per-shard statistics
    for leaf in jax.tree.leaves(state.model_state):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])  # identical on every shard


def test_global_norm_clipping_sees_the_whole_gradient_under_fsdp():
    """The optimizer runs on global arrays: clip_by_global_norm matches one device."""
    data = batches("lm", 6)
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5))
    strategy = px.FSDP(min_weight_size=256)
    _, history = train(TinyLM(), tx, lm_loss, strategy, data)
    single = px.DataParallel(1)
    start = px.init_state(TinyLM(), tx, data[0], strategy=single, mesh=single.make_mesh(jax.devices()[:1]),
                          loss_fn=lm_loss)
    ref, _, _ = run_plain(TinyLM(), tx, lm_loss, start, data)
    np.testing.assert_allclose(losses(history), ref, atol=1e-5)

"""The train step: accumulation, exact metrics, rngs, precision, remat, both compile paths."""

from __future__ import annotations

import re
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax as px
from parallax.inspect import collective_bytes
from tests import tiers
from tests.models import CNN, MLP, TinyLM, batches, classifier_loss, lm_loss
from tests.reference import one_device_state, run_plain, run_steps

pytestmark = pytest.mark.core


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


HYBRID = px.combine(px.DataParallel(2), px.FSDP(2, min_weight_size=256, split="largest"), px.TensorParallel(2))


@pytest.mark.parametrize("strategy, compile_mode", [
    pytest.param(px.FSDP(min_weight_size=256, split="largest"), "shard_map", id="fsdp-shard_map"),
    pytest.param(px.FSDP(min_weight_size=256, split="largest"), "jit", id="fsdp-jit",
                 marks=pytest.mark.wide(tiers.SECOND_OPTIMIZER)),
    pytest.param(HYBRID, "shard_map", id="dp+fsdp+tp-shard_map", marks=pytest.mark.wide(tiers.SECOND_OPTIMIZER)),
    pytest.param(HYBRID, "jit", id="dp+fsdp+tp-jit"),
])
def test_grad_accumulation_equals_one_big_step(strategy, compile_mode):
    data = batches("lm", 5, batch_size=32)
    tx = optax.adamw(3e-3)
    _, one = train(TinyLM(), tx, lm_loss, strategy, data, compile=compile_mode)
    _state, four = train(TinyLM(), tx, lm_loss, strategy, data, compile=compile_mode, grad_accum=4)
    np.testing.assert_allclose(losses(four), losses(one), atol=1e-5)
    np.testing.assert_allclose([h["accuracy"] for h in four], [h["accuracy"] for h in one], atol=1e-6)


def test_grad_accumulation_reduce_scatters_once_per_step():
    strategy = px.FSDP(min_weight_size=256, split="largest")
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


@pytest.mark.parametrize("strategy", [px.DataParallel(), px.FSDP(min_weight_size=0, split="largest"), HYBRID],
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
    strategy = px.FSDP(min_weight_size=0, split="largest")
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
    strategy = px.FSDP(min_weight_size=0, split="largest")
    state, history = train(MLP(), optax.adam(1e-2), classifier_loss, strategy, data, precision="bf16")
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(state.params))
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(state.opt_state[0].mu))
    step = px.make_train_step(classifier_loss, strategy, precision="bf16")
    hlo = step.lower(state, data[0]).as_text()
    assert "bf16" in hlo
    with pytest.raises(ValueError, match=r"precision='fp8'"):
        px.make_train_step(classifier_loss, strategy, precision="fp8")


# HLO text: `%name = <result type> <opcode>(<operands>), ...`. An operand shows its type inline
# (`f32[8,32]{1,0} %p`) or only where it is defined; a tuple result reads `(f32[10]{0}, f32[])`; the
# unoptimized HLO of `Lowered.as_text(dialect="hlo")` prints names without the `%`.
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<result>.*?)\s(?P<op>[a-z][\w\-]*)\(")
_HLO_ELEMENT_TYPE = re.compile(r"\b(pred|bf16|[fsuc][0-9]+\w*)\[")
_HLO_OPERAND_NAME = re.compile(r"%?\b([A-Za-z_][\w.\-]*)(?=[\s,)]|$)")  # not `f32` of `f32[...]`
_GATHERS_AND_REDUCTIONS = ("all-gather", "reduce-scatter", "all-reduce")


def _instructions(hlo_text: str) -> list[tuple[re.Match, str]]:
    """Each instruction's match and its operand text (to the parenthesis that closes the opcode's)."""
    out = []
    for line in hlo_text.splitlines():
        m = _HLO_INSTRUCTION.match(line)
        if m is not None:
            depth, end = 1, m.end()
            while end < len(line) and depth:
                depth += {"(": 1, ")": -1}.get(line[end], 0)
                end += 1
            out.append((m, line[m.end():end - 1]))
    return out


def collective_element_types(hlo_text: str) -> list[tuple[str, str, set[str]]]:
    """``(kind, name, element types of its result and operands)`` of every all-gather, reduce-scatter and
    all-reduce (or its async ``-start``) in HLO text."""
    instructions = _instructions(hlo_text)
    defined = {m["name"]: m["result"] for m, _ in instructions}
    found = []
    for m, operands in instructions:
        kind = m["op"].removesuffix("-start")
        if kind in _GATHERS_AND_REDUCTIONS:
            types = set(_HLO_ELEMENT_TYPE.findall(m["result"] + " " + operands))
            for name in _HLO_OPERAND_NAME.findall(operands):
                types |= set(_HLO_ELEMENT_TYPE.findall(defined.get(name, "")))
            found.append((kind, m["name"], types))
    return found


def not_float32(found: list[tuple[str, str, set[str]]]) -> list[tuple[str, str, set[str]]]:
    """The collectives that move a floating type other than f32 (bf16, f16, fp8, f64)."""
    return [(kind, name, types) for kind, name, types in found if {t for t in types if t[0] in "bf"} - {"f32"}]


def test_collective_element_types_flag_a_bfloat16_collective():
    """The parser the bf16 test relies on sees bf16 inline, on the operand's definition, and in async tuples."""
    hlo = "\n".join([
        "%p = bf16[8,32]{1,0} parameter(0)",
        "%all-gather.3 = bf16[64,32]{1,0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}",
        "%g = f32[64]{0} parameter(1)",
        "%reduce-scatter.1 = f32[8]{0} reduce-scatter(f32[64]{0} %g), dimensions={0}, to_apply=%add",
        "%reduce-scatter.2 = f32[8]{0} reduce-scatter(%p), dimensions={0}, to_apply=%add",  # bf16 operand only
        "ROOT %all-reduce-start = (f32[10]{0}, bf16[]) all-reduce-start(f32[10]{0} %a, bf16[] %b), to_apply=%add",
        "%all-reduce-done = (f32[10]{0}, bf16[]) all-reduce-done(%all-reduce-start)",
        '%x = f32[4]{0} add(%y, %z), metadata={op_name="jit(step)/all_gather"}',
        "all_gather.1 = f32[64,32]{1,0} all-gather(p), channel_id=1, dimensions={0}",  # no `%`; bf16 operand
    ])
    found = collective_element_types(hlo)
    assert [(kind, name) for kind, name, _ in found] == [
        ("all-gather", "all-gather.3"), ("reduce-scatter", "reduce-scatter.1"), ("reduce-scatter", "reduce-scatter.2"),
        ("all-reduce", "all-reduce-start"), ("all-gather", "all_gather.1")]
    assert [name for _, name, _ in not_float32(found)] == [
        "all-gather.3", "reduce-scatter.2", "all-reduce-start", "all_gather.1"]


def test_bf16_on_the_shard_map_path_gathers_and_reduces_in_float32():
    """bf16 compute, but FSDP's all-gathers and every gradient reduction move float32 (the master params are
    gathered before the cast, and gradients come back through the cast as float32)."""
    data = batches("mlp", 1, batch_size=64) * 10
    strategy = px.FSDP(min_weight_size=0, split="largest")
    state = px.init_state(MLP(), optax.adam(1e-2), data[0], strategy=strategy, rng=0, loss_fn=classifier_loss)
    step = px.make_train_step(classifier_loss, strategy, compile="shard_map", precision="bf16")
    assert step.mode() == "shard_map"
    lowered = step.lower(state, data[0])
    handed_to_xla = lowered.as_text(dialect="hlo")
    # Both what parallax hands XLA and what runs: XLA:CPU turns a bf16 collective into an f32 one (after the
    # values were rounded to bf16), so on this backend only the first would show a bf16 collective.
    for stage, text in (("handed to XLA", handed_to_xla), ("compiled", lowered.compile().as_text())):
        found = collective_element_types(text)
        kinds = Counter(kind for kind, _, _ in found)
        print(f"{stage}: {dict(kinds)}")
        for kind, name, types in found:
            print(f"  {kind:15s} {name:20s} {sorted(types)}")
        assert kinds["all-gather"] >= 1, f"{stage}: no all-gather found (the check would pass vacuously)"
        assert kinds["reduce-scatter"] + kinds["all-reduce"] >= 1, f"{stage}: no gradient reduction found"
        assert not not_float32(found), f"{stage}: {not_float32(found)}"
    # ... while the model computes in bf16: every matmul parallax hands XLA (XLA:CPU then computes a bf16 dot
    # in f32 and rounds, so the compiled text has bf16 values around f32 dots).
    dots = [m["result"] for m, _ in _instructions(handed_to_xla) if m["op"] == "dot"]
    print(f"dots handed to XLA: {dots}")
    assert dots and all(result.startswith("bf16[") for result in dots), dots

    state, trajectory = run_steps(step, state, data)
    print("bf16 shard_map losses:", np.round(trajectory, 4).tolist())
    assert trajectory[-1] < 0.8 * trajectory[0]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((state.opt_state[0].mu, state.opt_state[0].nu)))


def test_remat_recomputes_blocks_without_changing_results():
    data = batches("lm", 4)
    strategy = px.FSDP(min_weight_size=256, split="largest")
    _, plain = train(TinyLM(), optax.sgd(0.1), lm_loss, strategy, data)
    _, remat = train(TinyLM(), optax.sgd(0.1), lm_loss, strategy, data, remat=("Block",))
    np.testing.assert_allclose(losses(remat), losses(plain), atol=1e-6)
    state = px.init_state(TinyLM(), optax.sgd(0.1), data[0], strategy=strategy, loss_fn=lm_loss)
    text = px.make_train_step(lm_loss, strategy, remat=("Block",)).lower(state, data[0]).as_text()
    assert "optimization_barrier" in text  # how remat reaches XLA
    plain_text = px.make_train_step(lm_loss, strategy).lower(state, data[0]).as_text()
    assert "optimization_barrier" not in plain_text


@pytest.mark.parametrize("strategy", [
    pytest.param(px.DataParallel(), id="dp", marks=pytest.mark.wide(tiers.SECOND_OPTIMIZER)),
    pytest.param(px.FSDP(min_weight_size=64, split="largest"), id="fsdp",
                 marks=pytest.mark.wide(tiers.SECOND_OPTIMIZER)),
    pytest.param(px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=64, split="largest")), id="dp+fsdp"),
])
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
    start = one_device_state(HardCodedBatchNorm(None), optax.sgd(0.1), data[0], classifier_loss)
    ref = run_plain(HardCodedBatchNorm(None), optax.sgd(0.1), classifier_loss, start, data)
    np.testing.assert_allclose(losses(history), ref.losses, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), jax.device_get(state.model_state),
                 ref.model_state)


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
    strategy = px.FSDP(min_weight_size=256, split="largest")
    _, history = train(TinyLM(), tx, lm_loss, strategy, data)
    start = one_device_state(TinyLM(), tx, data[0], lm_loss)
    ref = run_plain(TinyLM(), tx, lm_loss, start, data)
    np.testing.assert_allclose(losses(history), ref.losses, atol=1e-5)

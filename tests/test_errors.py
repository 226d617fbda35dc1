"""Bad input: a ValueError that names the value and the fix, before anything compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import parallax as px
from tests.models import MLP, batches, classifier_loss

pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def fsdp_state():
    strategy = px.FSDP(min_weight_size=0, split="largest")
    return strategy, px.init_state(MLP(), optax.sgd(0.1), batches("mlp", 1)[0], strategy=strategy,
                                   loss_fn=classifier_loss)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: px.combine(px.DataParallel(3), px.FSDP(2)).make_mesh(), r"need 6 devices but 8 are available"),
        (lambda: px.DataParallel(16).make_mesh(), r"need 16 devices but 8"),
        (lambda: px.combine(px.DataParallel(3), px.FSDP(-1)).make_mesh(), r"multiply to 3, which does not divide"),
        (lambda: px.combine(px.DataParallel(-1), px.FSDP(-1)).make_mesh(), r"at most one axis"),
        (lambda: px.combine(px.DataParallel(axis="x"), px.FSDP(axis="x")), r"axis name 'x' twice"),
        (lambda: px.combine(px.FSDP(2), px.FSDP(4)), r"more than one FSDP"),
        (lambda: px.FSDP(min_weight_size=-1), r"min_weight_size=-1.*>= 0"),
        (lambda: px.DataParallel(0), r"size=0"),
        (lambda: px.TensorParallel(rules=[("q/kernel", "diagonal")]), r"layout 'diagonal'"),
        (lambda: px.TensorParallel(rules=[("q/(kernel", "column")]), r"does not compile"),
        (lambda: px.TensorParallel(derive="yes"), r"derive='yes'.*True or False"),
        (lambda: px.TensorParallel(min_split_fraction=2), r"min_split_fraction=2.*\[0, 1\]"),
        (lambda: px.make_train_step(classifier_loss, px.FSDP(), grad_accum=0), r"grad_accum=0"),
        (lambda: px.make_train_step(classifier_loss, px.FSDP(), compile="pjit"), r"compile='pjit'"),
        (lambda: px.make_train_step(classifier_loss, px.FSDP(), batch_stats="local", compile="jit"),
         r"batch_stats='local' needs compile='shard_map'"),
        (lambda: px.Trainer(None, optax.sgd(0.1), classifier_loss, max_steps=0), r"max_steps=0"),
        (lambda: px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, strategy="zero3"),
         r"strategy 'zero3': 'zero3' is not dp, fsdp, tp, pp, cp or ep.*e.g. 'fsdp', 'dp2\+fsdp'"),
        (lambda: px.make_train_step(classifier_loss, 8), r"a short name \(e.g. 'fsdp', 'dp2\+fsdp'\) or 'auto', got 8"),
        (lambda: px.Trainer(None, optax.sgd(0.1), classifier_loss, checkpoint_every=5),
         r"checkpoint_every is set but checkpoint_dir is not"),
    ],
)
def test_bad_configuration(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_strategy_by_the_short_name_px_plan_takes():
    trainer = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, strategy="dp2+fsdp")
    assert trainer.strategy.describe(trainer.mesh) == "DataParallel(data=2) × FSDP(fsdp=4)"


def test_mesh_from_another_strategy():
    mesh = px.DataParallel().make_mesh()
    with pytest.raises(ValueError, match=r"needs axis 'fsdp'.*strategy.make_mesh"):
        px.FSDP().param_specs({"w": jnp.ones((8, 8))}, mesh)


def test_rule_that_matches_no_param():
    strategy = px.TensorParallel(rules=[(r"attention/wq/kernel$", "column"), (r"up/kernel$", "column")])
    with pytest.raises(ValueError, match=r"'attention/wq/kernel\$' matches no param.*up/kernel"):
        px.init_state(MLP(), optax.sgd(0.1), batches("mlp", 1)[0], strategy=strategy, loss_fn=classifier_loss)


def test_default_rules_that_match_nothing():
    with pytest.raises(ValueError, match=r"default rules match none.*Dense_0/kernel.*rules=.*derive=True"):
        px.TensorParallel(derive=False).param_specs({"Dense_0": {"kernel": jnp.ones((8, 8))}})


def test_rule_with_unknown_axis_name():
    strategy = px.TensorParallel(rules=[(r"up/kernel$", P(None, "model"))])
    with pytest.raises(ValueError, match=r"names axis \['model'\].*'tensor'"):
        strategy.param_specs({"up": {"kernel": jnp.ones((8, 8))}})


def _compiled_count(step):
    return len(step._cache)


def test_batch_the_mesh_does_not_divide(fsdp_state):
    strategy, state = fsdp_state
    step = px.make_train_step(classifier_loss, strategy)
    bad = batches("mlp", 1, batch_size=12)[0]
    with pytest.raises(ValueError, match=r"Batch size 12 is not divisible by 8 \(fsdp=8\).*e\.g\. 8 or 16"):
        step(state, bad)
    assert _compiled_count(step) == 0


def test_batch_that_grad_accum_does_not_divide(fsdp_state):
    strategy, state = fsdp_state
    step = px.make_train_step(classifier_loss, strategy, grad_accum=4)
    with pytest.raises(ValueError, match=r"Batch size 16 is not divisible by 32 \(fsdp=8 × grad_accum=4\)"):
        step(state, batches("mlp", 1)[0])
    assert _compiled_count(step) == 0


def test_batch_leaves_of_different_sizes(fsdp_state):
    strategy, state = fsdp_state
    batch = {"x": np.zeros((16, 24), np.float32), "y": np.zeros((8,), np.int32)}
    with pytest.raises(ValueError, match=r"different leading \(batch\) dims"):
        px.make_train_step(classifier_loss, strategy)(state, batch)


def test_loss_that_is_not_a_scalar(fsdp_state):
    strategy, state = fsdp_state

    def per_example_loss(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    with pytest.raises(ValueError, match=r"loss of shape \(\d+,\); it must be a scalar"):
        px.make_train_step(per_example_loss, strategy)(state, batches("mlp", 1)[0])


def test_metrics_that_are_not_arrays(fsdp_state):
    strategy, state = fsdp_state

    def loss_with_text(model, batch):
        loss, _ = classifier_loss(model, batch)
        return loss, {"note": "hello"}

    with pytest.raises(ValueError, match=r"Metric 'note' is a str, not an array"):
        px.make_train_step(loss_with_text, strategy)(state, batches("mlp", 1)[0])


def test_state_not_built_by_parallax():
    strategy = px.DataParallel()
    state = px.init_state(MLP(), optax.sgd(0.1), batches("mlp", 1)[0], strategy=strategy, loss_fn=classifier_loss)
    host_state = jax.device_get(state)
    with pytest.raises(ValueError, match=r"build the state with px.init_state"):
        px.make_train_step(classifier_loss, strategy)(host_state, batches("mlp", 1)[0])


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(24, 10, rngs=rngs)

    def __call__(self, x):
        return self.up(x)


@pytest.mark.parametrize("make", [
    lambda model: px.Trainer(model, optax.sgd(0.1), classifier_loss),
    lambda model: px.init_state(model, optax.sgd(0.1), batches("mlp", 1)[0], strategy=px.DataParallel(),
                                loss_fn=classifier_loss),
], ids=["Trainer", "init_state"])
def test_models_parallax_cannot_take_are_named_before_anything_compiles(make):
    with pytest.raises(ValueError, match=r"model is the NNX class NNXModel; pass an instance"):
        make(NNXModel)
    with pytest.raises(ValueError, match=r"model is the class MLP; pass an instance, e\.g\. MLP\(\.\.\.\)"):
        make(MLP)
    with pytest.raises(ValueError, match=r"model is a function that takes arguments \(x\)"):
        make(lambda x: x)
    with pytest.raises(ValueError, match=r"model is a function that returns an array int32\(\), not an NNX module"):
        make(lambda: 3)
    with pytest.raises(ValueError, match=r"model must be a flax\.linen\.Module or flax\.nnx\.Module instance.*got str"):
        make("resnet50")


def _trainer(**kwargs):
    args = {"model": MLP(), "optimizer": optax.sgd(0.1), "loss_fn": classifier_loss}
    args.update(kwargs)
    return px.Trainer(args.pop("model"), args.pop("optimizer"), args.pop("loss_fn"), batch_size=16, max_steps=2,
                      progress=False, **args)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: _trainer(optimizer=optax.adam), r"optimizer is optax.*adam, a function; pass the optimizer it builds, "
                                                 r"e.g. adam\(1e-3\)"),
        (lambda: _trainer(optimizer=lambda grads: grads), r"optimizer is .*a function"),
        (lambda: _trainer(optimizer="adam"), r"must be an optax GradientTransformation.*'adam'"),
        (lambda: _trainer(loss_fn=lambda batch: 0.0), r"loss_fn is called as loss_fn\(model, batch\), but .*\(batch\) "
                                                      r"does not take two arguments"),
    ],
)
def test_trainer_arguments_are_checked_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_data_that_is_not_a_dataset_says_what_to_do():
    examples = [{"x": np.float32(i), "y": np.int32(i % 2)} for i in range(32)]
    with pytest.raises(ValueError, match=r"list of 32 per-example dicts \({'x', 'y'}\); pass one dict of arrays"):
        _trainer().fit(examples)
    x = np.ones((32, 24), np.float32)
    with pytest.raises(ValueError, match=r"the training data\['y'\] holds strings.*encode them as numbers"):
        _trainer().fit({"x": x, "y": np.array(["cat", "dog"] * 16)})
    with pytest.raises(ValueError, match=r"the training data\['y'\] is a Python list; make it an array"):
        _trainer().fit({"x": x, "y": ["cat", "dog"] * 16})


def test_a_batch_size_the_data_axes_do_not_divide_fails_before_step_one_on_the_trainer_path():
    data = {"x": np.ones((96, 24), np.float32), "y": np.zeros(96, np.int32)}
    trainer = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, batch_size=12, max_steps=2, progress=False)
    with pytest.raises(ValueError, match=r"Batch size 12 is not divisible by 8 \(data=8\); use a multiple of 8"):
        trainer.fit(data)
    assert trainer.state is None
    ragged = [{k: v[:16] for k, v in data.items()}, {k: v[:12] for k, v in data.items()}]
    trainer = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, max_steps=2, progress=False)
    with pytest.raises(ValueError, match=r"The batch for step 2 has 12 examples \(the first had 16\).*Drop or pad"):
        trainer.fit(ragged)


def test_a_python_float_inside_the_loss_is_named_before_compiling():
    def loss_fn(model, batch):
        loss, metrics = classifier_loss(model, batch)
        return float(loss), metrics

    with pytest.raises(ValueError, match=r"turns a traced array into a Python value: float\(x\)"
                                         r".*return the loss array"):
        px.init_state(MLP(), optax.sgd(0.1), batches("mlp", 1)[0], strategy=px.DataParallel(), loss_fn=loss_fn)


def test_a_batch_placed_on_another_mesh_is_named():
    strategy = px.FSDP(4, min_weight_size=0, split="largest")
    batch = batches("mlp", 1)[0]
    state = px.init_state(MLP(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=classifier_loss,
                          mesh=strategy.make_mesh(jax.devices()[:4]))
    elsewhere = strategy.make_mesh(jax.devices()[4:])
    placed = px.data.to_global(batch, jax.sharding.NamedSharding(elsewhere, strategy.batch_spec()))
    with pytest.raises(ValueError, match=r"batch\['x'\] is placed on a mesh with axes \{'fsdp': 4\}, other devices "
                                         r"than the state's mesh.*to_global"):
        px.make_train_step(classifier_loss, strategy)(state, placed)
    # FSDP's default split='auto' compiles each split to price it: the batch is named before any compiles.
    with pytest.raises(ValueError, match=r"batch\['x'\] is placed on a mesh with axes \{'fsdp': 4\}, other devices "
                                         r"than the state's mesh"):
        px.testing.assert_equivalent(MLP(), optax.sgd(0.1), classifier_loss, [placed], px.FSDP(4, min_weight_size=0),
                                     devices=jax.devices()[:4])


def test_a_batch_laid_out_on_another_mesh_of_the_same_devices_is_named_before_compiling(caplog):
    """jit would refuse it (another mesh's shape: "Sharding passed to jit does not match") or move it on every
    call (the devices in another order); said by the step, in well under a second, nothing compiled."""
    import logging

    from jax.sharding import Mesh, NamedSharding

    strategy = px.FSDP(min_weight_size=0, split="largest")
    batch = batches("mlp", 1)[0]
    state = px.init_state(MLP(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=classifier_loss)
    step = px.make_train_step(classifier_loss, strategy)
    devices = np.array(jax.devices())
    for mesh, said in ((Mesh(devices.reshape(4, 2), ("rows", "cols")), r"a mesh with axes \{'rows': 4, 'cols': 2\}"),
                       (Mesh(devices[::-1], ("fsdp",)), "its devices in another order than the state's mesh's")):
        placed = jax.device_put(batch, NamedSharding(mesh, P(mesh.axis_names[0])))
        caplog.clear()
        with jax.log_compiles(), caplog.at_level(logging.WARNING), pytest.raises(
                ValueError, match=rf"batch\['x'\] is laid out on .*{said}.*not as the step takes it"
                                  r".*px\.data\.to_global"):
            step(state, placed)
        assert "Compiling" not in caplog.text, caplog.text  # nothing compiled

"""The public surface the refactor reshaped: step options, the part protocol, what fit returns,
and callbacks that see their own step's state."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import parallax as px
from parallax.sharding.strategy import Strategy
from tests.models import MLP, classifier_loss

pytestmark = pytest.mark.core


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 24)).astype(np.float32)
    return {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}


# --- step options ----------------------------------------------------------------------------
def test_step_options_are_declared_once_and_shared():
    defaults = px.StepOptions()
    step = px.make_train_step(classifier_loss, px.FSDP())
    config = px.TrainerConfig.create()
    assert step.options == defaults == config.step
    assert defaults.rng_streams == ("dropout",) and config.rng_streams == ("dropout",)
    # Flat Trainer options and ConfigDict keys land in the same object; lists become tuples.
    config = px.TrainerConfig.create({"grad_accum": 2, "remat": ["Block"]}, precision="bf16", max_steps=3)
    assert config.step == px.StepOptions(grad_accum=2, remat=("Block",), precision="bf16")
    assert config.grad_accum == 2 and config.max_steps == 3
    # skip_nonfinite follows the Trainer's own option.
    assert px.TrainerConfig.create(on_nonfinite="skip").step.skip_nonfinite
    with pytest.raises(ValueError, match="on_nonfinite='skip'"):
        px.TrainerConfig.create(skip_nonfinite=True)
    # make_train_step takes an options object and keyword overrides.
    step = px.make_train_step(classifier_loss, px.FSDP(), px.StepOptions(grad_accum=4), compile="jit")
    assert step.options == px.StepOptions(grad_accum=4, compile="jit")


@pytest.mark.parametrize("options, message", [
    ({"compile": "fast"}, r"compile='fast'; use one of \('auto', 'shard_map', 'jit'\)"),
    ({"grad_accum": 0}, r"grad_accum=0; use an integer >= 1"),
    ({"batch_stats": "local", "compile": "jit"}, r"batch_stats='local' needs compile='shard_map'"),
    ({"precision": "fp8"}, r"precision='fp8'"),
    ({"remat": "Block"}, r"remat='Block'; pass a tuple"),
    ({"rng_streams": [1]}, r"rng_streams takes rng names"),
    ({"grad_acum": 2}, r"Unknown step option\(s\) \['grad_acum'\] \(did you mean 'grad_accum'\?\)"),
])
def test_bad_step_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        px.make_train_step(classifier_loss, px.FSDP(), **options)


def test_unknown_trainer_option_lists_step_options_too():
    with pytest.raises(ValueError, match=r"Unknown Trainer option\(s\) \['grad_acum'\].*'grad_accum'"):
        px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, grad_acum=2)


# --- the part protocol -----------------------------------------------------------------------
def test_a_part_that_does_not_declare_itself_is_refused():
    with pytest.raises(TypeError, match=r"does not declare \['splits_batch', 'gathers_params'\]"):
        @dataclasses.dataclass(frozen=True)
        class Pipeline(Strategy):
            size: int = -1
            axis: str = "stage"
            placement_priority = 5

            def place(self, path, shape, dims, axis_sizes):
                return dims


def test_a_new_kind_of_part_is_classified_by_what_it_declares():
    """A model-axis part that is neither FSDP nor TensorParallel: not a data axis, not gathered."""

    @dataclasses.dataclass(frozen=True)
    class Expert(Strategy):
        size: int = -1
        axis: str = "expert"
        splits_batch = False
        gathers_params = False
        placement_priority = 15

        def place(self, path, shape, dims, axis_sizes):
            if path.endswith("kernel") and dims[0] is None and shape[0] % axis_sizes[self.axis] == 0:
                dims[0] = self.axis
            return dims

    strategy = px.combine(px.FSDP(4, min_weight_size=0, split="largest"), Expert(2))
    assert strategy.data_axes == ("fsdp",) and strategy.fsdp_axes == ("fsdp",)
    assert strategy.model_axes == ("expert",)
    assert strategy.batch_spec() == jax.sharding.PartitionSpec("fsdp")
    assert px.make_train_step(px.per_example_loss(classifier_loss), strategy).modes() == ("jit", "shard_map")
    spec = strategy.param_specs({"Dense_0": {"kernel": jax.ShapeDtypeStruct((24, 64), np.float32)}})
    assert spec["Dense_0"]["kernel"] == jax.sharding.PartitionSpec("expert", "fsdp")


def test_what_a_part_finds_stays_beside_the_strategy():
    """A part of the user's own that reads the traced loss: its record is the plan's, handed back as found=; the
    plan's strategy is the one given; a part written for the old protocol (fit_to_computation) is refused."""

    @dataclasses.dataclass(frozen=True)
    class Widest(Strategy):  # splits the largest kernel the traced loss shows, nothing else
        size: int = -1
        axis: str = "wide"
        splits_batch = False
        gathers_params = False
        placement_priority = 15
        uses_computation = True

        def find_in(self, computation):
            shapes = dict(zip(computation.param_paths, computation.param_shapes))
            return max((path for path in shapes if path.endswith("kernel")), key=lambda path: np.prod(shapes[path]))

        def place(self, path, shape, dims, axis_sizes, found=None):
            return [*dims[:-1], self.axis] if path == found else dims

        def why_whole(self, path, shape, axis_sizes, found=None):
            return f"not the largest kernel ({found})"

    given = px.combine(px.DataParallel(2), Widest(2))
    model, batch = MLP(hidden=64), {"x": np.ones((8, 16), np.float32), "y": np.zeros((8,), np.int32)}
    plan = px.plan_state(model, optax.sgd(0.1), batch, strategy=given, loss_fn=classifier_loss,
                         mesh=given.make_mesh(jax.devices()[:4]))
    assert plan.strategy == given and plan.strategy is given
    assert plan.found["wide"] == "hidden/kernel" and plan.found.of(given.parts[0]) is None  # (64, 64)
    assert plan.specs.params["hidden"]["kernel"] == jax.sharding.PartitionSpec(None, "wide")
    assert plan.specs.params["up"]["kernel"] == jax.sharding.PartitionSpec()
    whole = {row.path: row.reason for row in px.summarize(plan, large_bytes=0).lint.replicated}
    assert "not the largest kernel (hidden/kernel)" in whole["up/kernel"], whole

    with pytest.raises(TypeError, match=r"defines fit_to_computation.*find_in\(computation\)"):
        @dataclasses.dataclass(frozen=True)
        class Old(Strategy):
            size: int = -1
            axis: str = "old"
            splits_batch = gathers_params = False
            placement_priority = 15

            def place(self, path, shape, dims, axis_sizes):
                return dims

            def fit_to_computation(self, computation):
                return self


# --- fit's result ----------------------------------------------------------------------------
def test_fit_unpacks_as_documented():
    trainer = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, strategy=px.FSDP(min_weight_size=0),
                         max_steps=2, batch_size=16, progress=False)
    result = trainer.fit(data())
    state, history = result  # the README's and the docstrings' unpacking
    assert state is result.state and history is result.history
    assert result.stop_reason == "max_steps" and int(state.step) == 2 and len(history.train) == 2
    assert result[:2] == (state, history)


# --- callbacks see their own step -------------------------------------------------------------
def test_learning_rate_logger_reports_the_rate_of_its_own_step():
    """With inject_hyperparams the rate comes from the step's state; metrics are read late
    (fetch_every), so reading the trainer's current state would report a later step's rate."""
    schedule = optax.linear_schedule(1.0, 0.0, transition_steps=8)
    seen = {}

    class Record:
        every = 1

        def on_step(self, info):
            seen[info.step] = info.metrics.get("learning_rate")

    trainer = px.Trainer(MLP(), optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), classifier_loss,
                         strategy=px.FSDP(min_weight_size=0), max_steps=6, batch_size=16, progress=False,
                         callbacks=[px.LearningRateLogger(), Record()])
    trainer.fit(data())
    expected = {step: float(schedule(step - 1)) for step in range(1, 7)}
    assert seen == pytest.approx(expected), seen
    # The schedule form agrees with the state form.
    seen.clear()
    trainer = px.Trainer(MLP(), optax.sgd(schedule), classifier_loss, strategy=px.FSDP(min_weight_size=0),
                         max_steps=6, batch_size=16, progress=False,
                         callbacks=[px.LearningRateLogger(schedule), Record()])
    trainer.fit(data())
    assert seen == pytest.approx(expected)


def test_step_info_carries_the_state_of_its_own_step():
    states = {}

    class NeedsState:
        every = 2
        needs_state = True

        def on_step(self, info):
            states[info.step] = int(info.state.step)

    trainer = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, strategy=px.FSDP(min_weight_size=0), max_steps=6,
                         batch_size=16, progress=False, callbacks=[NeedsState()])
    trainer.fit(data())
    assert states == {2: 2, 4: 4, 6: 6}

"""Steps: the train state, planning it, and the jitted train/eval steps built from a loss.

Above the model seam (:mod:`parallax.models`) and the sharding layer; below the Trainer.
"""

from parallax.step import metrics
from parallax.step.batch import state_specs_of
from parallax.step.build import Step, make_eval_step, make_train_step
from parallax.step.options import StepOptions
from parallax.step.per_example import PerExampleLoss, is_per_example_loss, per_example_loss
from parallax.step.initialize import init_state
from parallax.step.plan import StatePlan, plan_state
from parallax.step.state import TrainState

__all__ = [
    "PerExampleLoss", "StatePlan", "Step", "StepOptions", "TrainState", "init_state", "is_per_example_loss",
    "make_eval_step", "make_train_step", "metrics", "per_example_loss", "plan_state", "state_specs_of",
]

"""Building the step: the train state it updates, and the jitted train/eval steps built from a loss.

Above the model seam (:mod:`parallax.models`), the sharding layer and the pricing of compiled
programs (:mod:`parallax.pricing`, which picks a step's compile path); below planning the state
(:mod:`parallax.state`) and the Trainer.
"""

from parallax.step import metrics
from parallax.step.batch import state_specs_of
from parallax.step.build import Step, make_eval_step, make_train_step
from parallax.step.options import StepOptions
from parallax.step.per_example import PerExampleLoss, is_per_example_loss, per_example_loss
from parallax.step.train_state import TrainState

__all__ = [
    "PerExampleLoss", "Step", "StepOptions", "TrainState", "is_per_example_loss", "make_eval_step",
    "make_train_step", "metrics", "per_example_loss", "state_specs_of",
]

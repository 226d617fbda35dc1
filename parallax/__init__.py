"""parallax: train an unchanged Flax model with DP, FSDP and tensor parallelism."""

from parallax.rules import DEFAULT_RULES
from parallax.strategy import FSDP
from parallax.strategy import Combined
from parallax.strategy import DataParallel
from parallax.strategy import Strategy
from parallax.strategy import TensorParallel
from parallax.strategy import combine

__version__ = "0.1.0"

from parallax import inspect
from parallax import metrics
from parallax.state import TrainState
from parallax.state import StatePlan
from parallax.state import init_state
from parallax.state import plan_state
from parallax.step import make_eval_step
from parallax.step import make_train_step

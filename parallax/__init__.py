"""parallax: train an unchanged Flax model with DP, FSDP and tensor parallelism.

Example:
    >>> import parallax as px
    >>> trainer = px.Trainer(model, optax.adamw(3e-4), loss_fn, strategy=px.FSDP())
    >>> state, history = trainer.fit(train_data, eval_data=eval_data)
"""

from parallax import callbacks
from parallax import inspect
from parallax import metrics
from parallax.callbacks import EarlyStopping
from parallax.callbacks import JSONLogger
from parallax.callbacks import LearningRateLogger
from parallax.callbacks import ProgressBar
from parallax.callbacks import TensorBoardLogger
from parallax.checkpoint import CheckpointError
from parallax.rules import DEFAULT_RULES
from parallax.state import StatePlan
from parallax.state import TrainState
from parallax.state import init_state
from parallax.state import plan_state
from parallax.step import make_eval_step
from parallax.step import make_train_step
from parallax.strategy import FSDP
from parallax.strategy import Combined
from parallax.strategy import DataParallel
from parallax.strategy import Strategy
from parallax.strategy import TensorParallel
from parallax.strategy import combine
from parallax.trainer import FitResult
from parallax.trainer import NonFiniteLossError
from parallax.trainer import Trainer
from parallax.trainer import TrainerConfig

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_RULES", "FSDP", "CheckpointError", "Combined", "DataParallel", "EarlyStopping", "FitResult",
    "JSONLogger", "LearningRateLogger", "NonFiniteLossError", "ProgressBar", "StatePlan", "Strategy",
    "TensorBoardLogger", "TensorParallel", "TrainState", "Trainer", "TrainerConfig", "callbacks", "combine",
    "init_state", "inspect", "make_eval_step", "make_train_step", "metrics", "plan_state",
]

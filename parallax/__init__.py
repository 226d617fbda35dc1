"""parallax: train an unchanged Flax model with DP, FSDP and tensor parallelism.

Example:
    >>> import parallax as px
    >>> trainer = px.Trainer(model, optax.adamw(3e-4), loss_fn, strategy=px.FSDP())
    >>> state, history = trainer.fit(train_data, eval_data=eval_data)
"""

# Read by the import guard that parallax-flax installs (packaging/_parallax_flax_guard.py): it
# tells this library apart from other projects that also install a module named `parallax`.
__distribution__ = "parallax-flax"
__version__ = "0.1.0"

try:
    from parallax import callbacks
    from parallax import inspect
    from parallax import metrics
    from parallax.callbacks import EarlyStopping
    from parallax.callbacks import JSONLogger
    from parallax.callbacks import LearningRateLogger
    from parallax.callbacks import ProgressBar
    from parallax.callbacks import TensorBoardLogger
    from parallax.checkpoint import CheckpointError
    from parallax.per_example import PerExampleLoss
    from parallax.per_example import is_per_example_loss
    from parallax.per_example import per_example_loss
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
except ImportError as err:  # a file of this package overwritten by another project's `parallax`?
    try:
        import _parallax_flax_guard as _guard
    except ImportError:  # a source tree used without installing parallax-flax
        _guard = None
    if _guard is not None and _guard.other_distributions():
        raise ImportError(_guard.conflict_message(
            f"parallax-flax in {__path__[0]} could not import its own modules ({err}), "
            "and another project that installs `parallax` is present: it has probably overwritten "
            "some of its files.")) from err
    raise

__all__ = [
    "DEFAULT_RULES", "FSDP", "CheckpointError", "Combined", "DataParallel", "EarlyStopping", "FitResult",
    "JSONLogger", "LearningRateLogger", "NonFiniteLossError", "PerExampleLoss", "ProgressBar", "StatePlan", "Strategy",
    "TensorBoardLogger", "TensorParallel", "TrainState", "Trainer", "TrainerConfig", "callbacks", "combine",
    "init_state", "inspect", "is_per_example_loss", "make_eval_step", "make_train_step", "metrics",
    "per_example_loss", "plan_state",
]

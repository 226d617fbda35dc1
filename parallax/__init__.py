"""parallax: train an unchanged Flax model with DP, FSDP and tensor parallelism.

The package is layered, and imports flow one way: ``sharding`` (where things live) →
``models`` (the model seam) → ``pricing`` (what a compiled program costs, which is cheapest) →
``step`` (building the compiled steps) → ``state`` (planning the state, and the search that picks
a plan) → ``train`` (the Trainer). This module only re-exports the public names.

Example:
    >>> import parallax as px
    >>> trainer = px.Trainer(model, optax.adamw(3e-4), loss_fn, strategy=px.FSDP(), max_steps=4,
    ...                      batch_size=32, progress=False)
    >>> state, history = trainer.fit(train_data, eval_data=eval_data)
    >>> len(history.train), sorted(history.eval[-1])
    (4, ['accuracy', 'final', 'loss', 'step'])
"""

# Read by the import guard that parallax-flax installs (packaging/_parallax_flax_guard.py): it
# tells this library apart from other projects that also install a module named `parallax`.
__distribution__ = "parallax-flax"
__version__ = "0.2.0"

try:
    from parallax import distributed, inspect, plan, testing
    from parallax.models.linen import wrap_for_shard_map
    from parallax.parallel.context.part import ContextParallel
    from parallax.parallel.experts.part import ExpertParallel
    from parallax.parallel.pipeline.part import PipelineParallel
    from parallax.pricing.hardware import Hardware
    from parallax.sharding import specs
    from parallax.sharding.parts import FSDP, DataParallel, TensorParallel
    from parallax.sharding.rules import DEFAULT_RULES
    from parallax.sharding.strategy import Combined, Strategy, combine
    from parallax.sharding.topology import Topology
    from parallax.state.initialize import init_state
    from parallax.state.plan import StatePlan, plan_state
    from parallax.state.summary import ReplicatedParamError, Summary, summarize
    from parallax.step import metrics
    from parallax.step.build import make_eval_step, make_train_step
    from parallax.step.options import StepOptions
    from parallax.step.per_example import PerExampleLoss, is_per_example_loss, per_example_loss
    from parallax.step.train_state import TrainState
    from parallax.train import callbacks, checkpoint, data
    from parallax.train.callbacks import EarlyStopping, JSONLogger, LearningRateLogger, ProgressBar, TensorBoardLogger
    from parallax.train.checkpoint import CheckpointError
    from parallax.train.config import FitResult, TrainerConfig
    from parallax.train.guard import NonFiniteLossError
    from parallax.train.trainer import Trainer
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
    "DEFAULT_RULES", "FSDP", "CheckpointError", "Combined", "ContextParallel", "DataParallel", "EarlyStopping",
    "ExpertParallel", "FitResult", "Hardware", "JSONLogger", "LearningRateLogger", "NonFiniteLossError",
    "PerExampleLoss", "PipelineParallel", "ProgressBar", "ReplicatedParamError", "StatePlan", "StepOptions", "Strategy",
    "Summary", "TensorBoardLogger", "TensorParallel", "Topology", "TrainState", "Trainer", "TrainerConfig", "callbacks",
    "checkpoint", "combine", "data", "distributed", "init_state", "inspect", "is_per_example_loss", "make_eval_step",
    "make_train_step", "metrics", "per_example_loss", "plan", "plan_state", "specs", "step", "summarize", "testing",
    "wrap_for_shard_map",
]

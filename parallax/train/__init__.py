"""Training: the Trainer's loop and its hooks, callbacks, checkpoints, data and preemption.

The top layer: it builds on :mod:`parallax.step`; nothing below imports from here.
"""

from parallax.train import callbacks, checkpoint, data
from parallax.train.checkpoint import CheckpointError
from parallax.train.config import FitResult, History, TrainerConfig
from parallax.train.guard import NonFiniteLossError
from parallax.train.trainer import Trainer

__all__ = ["CheckpointError", "FitResult", "History", "NonFiniteLossError", "Trainer", "TrainerConfig", "callbacks",
           "checkpoint", "data"]

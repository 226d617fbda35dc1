"""The NaN guard: a non-finite loss or state stops training, naming the step and what is kept."""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
import jax.numpy as jnp

log = logging.getLogger("parallax")


class NonFiniteLossError(FloatingPointError):
    """Training stopped because the loss (or the state) became NaN or Inf."""


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


class NonFiniteGuard:
    """Checks each step's loss as it is read back, and the state before it is saved.

    Args:
        policy: ``"stop"`` (raise :class:`NonFiniteLossError`) or ``"skip"`` (the step
            skipped the update on the device; warn and go on).
        checkpointer: where the newest checkpoint that verifies is found, for the message.
    """

    def __init__(self, policy: str, checkpointer: Any = None):
        self.policy = policy
        self.checkpointer = checkpointer

    def check_loss(self, step: int, loss: float) -> None:
        if math.isfinite(loss):
            return
        if self.policy == "stop":
            self.fail(step, f"the loss is {loss}")
        log.warning("Step %d: the loss is %s; the update was skipped.", step, loss)

    def check_state(self, step: int, state: Any) -> None:
        """Raises before a state with NaN/Inf values is saved (the checkpoints on disk are kept)."""
        if not bool(_all_finite(state)):
            self.fail(step, "the state holds NaN or Inf values, so it was not saved")

    def fail(self, step: int, what: str):
        last = None
        if self.checkpointer is not None:
            self.checkpointer.wait()
            last = self.checkpointer.newest_verified()[0]
        where = (f" The newest checkpoint that verifies, step {last} in {self.checkpointer.directory}, is kept."
                 if last is not None else "")
        raise NonFiniteLossError(
            f"Training stopped at step {step}: {what}.{where} Lower the learning rate, check the data, or "
            "pass on_nonfinite='skip' to skip such updates."
        )

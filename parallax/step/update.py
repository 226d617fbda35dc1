"""The bodies of the train and eval steps: gradients, then the optimizer update, with the
offloaded parts of the state moved to device memory where they are used and back.

Nothing here knows how the gradients are computed (``jit`` or ``shard_map``: ``gradients``
is either path's function); :mod:`parallax.step.build` jits these bodies with the state's
shardings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from parallax.step import metrics as metric_lib
from parallax.step.offload import DEVICE, HOST, to_memory
from parallax.step.train_state import TrainState


def step_bodies(gradients: Callable, shardings: TrainState, skip_nonfinite: bool,
                offloaded: tuple[str, ...] = ()) -> tuple[Callable, Callable]:
    """``(train_step, eval_step)`` for ``gradients(state, batch, key) -> (grads, sums, model_state)``.

    ``shardings`` are the state's, with memory kinds (:func:`parallax.step.offload.with_memory_kinds`);
    of the ``offloaded`` parts (``"params"``, ``"opt_state"``), the params move to device memory
    before the forward pass, the optimizer state before the update, and both return to host
    memory after it, inside the compiled program. ``skip_nonfinite``: as in
    :class:`parallax.StepOptions`.
    """

    def on_device(state: TrainState, part: str) -> Any:
        value = getattr(state, part)
        return to_memory(value, getattr(shardings, part), DEVICE) if part in offloaded else value

    def on_host(state: TrainState) -> TrainState:
        return state.replace(**{part: to_memory(getattr(state, part), getattr(shardings, part), HOST)
                                for part in offloaded})

    def train_step(state: TrainState, batch: Any):
        key = jax.random.fold_in(state.rng, state.step)
        state = state.replace(params=on_device(state, "params"))
        grads, sums, model_state = gradients(state, batch, key)
        if "opt_state" in offloaded:  # fetched once the gradients exist: else XLA may fetch it first, at the peak
            grads, held = jax.lax.optimization_barrier((grads, state.opt_state))
            state = state.replace(opt_state=held)
        state = state.replace(opt_state=on_device(state, "opt_state"))
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state)
        metrics = metric_lib.means(sums)
        if skip_nonfinite:
            finite = jnp.isfinite(metrics["loss"])
            for grad in jax.tree.leaves(grads):
                finite &= jnp.isfinite(grad).all()
            kept = state.replace(step=state.step + 1)
            new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, kept)
            metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        return on_host(new_state), metrics

    def eval_step(state: TrainState, batch: Any):
        key = jax.random.fold_in(state.rng, state.step)
        return gradients(state.replace(params=on_device(state, "params")), batch, key)

    return train_step, eval_step

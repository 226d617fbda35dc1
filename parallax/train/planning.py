"""The Trainer's plan, made at the first batch it sees: the mesh (a ``jax.set_mesh`` around ``fit``
where none was given), the strategy an ``"auto"`` search picks, and the state's plan on them."""

from __future__ import annotations

import dataclasses
from typing import Any

from parallax import _multihost
from parallax.sharding.auto import AUTO, is_auto
from parallax.sharding.context import mesh_or_context
from parallax.sharding.mesh import is_explicit
from parallax.state.plan import StatePlan, plan_state, warn_if_unsharded
from parallax.state.search import resolve


def plan_run(trainer: Any, example_batch: Any) -> StatePlan:
    """``trainer.plan`` for ``example_batch``, made once: on the mesh set with ``jax.set_mesh`` where
    the trainer was given no ``mesh=`` or ``devices=`` (its devices, for ``strategy="auto"``), after
    the search of an ``"auto"`` strategy or split; the trainer's steps are rebuilt on the result."""
    if trainer.plan is not None:
        return trainer.plan
    if not trainer.given_mesh:
        mesh, devices = mesh_or_context(trainer.strategy, None, None)
        if trainer.strategy == AUTO:
            trainer.devices = devices
        elif mesh is not None:
            trainer._use(trainer.strategy, mesh)
    if trainer.mesh is None and trainer.strategy != AUTO:  # none in context either: the strategy's own (or its error)
        trainer._use(trainer.strategy, trainer.strategy.make_mesh(trainer.devices))
    cfg = trainer.config
    if is_auto(trainer.strategy):
        trainer.search = resolve(trainer.model, trainer.optimizer, example_batch, trainer.strategy,
                                 loss_fn=trainer.loss_fn, devices=trainer.devices, mesh=trainer.mesh, options=cfg.step,
                                 rng=cfg.seed, rng_streams=cfg.step.rng_streams,
                                 steps=trainer.max_steps if trainer.max_steps is not None else cfg.max_steps)
        # What the search had to change to fit the budget, and the compile path it priced its pick on.
        trainer.config = cfg = dataclasses.replace(cfg, step=trainer.search.step_options(cfg.step))
        trainer._use(trainer.search.strategy, trainer.search.mesh)
        if cfg.progress and _multihost.is_primary():
            print(trainer.search.headline())  # all of it (describe()) in the log, at INFO
    trainer.plan = plan_state(trainer.model, trainer.optimizer, example_batch, strategy=trainer.strategy, rng=cfg.seed,
                              loss_fn=trainer.loss_fn, mesh=trainer.mesh, rng_streams=cfg.step.rng_streams,
                              params=trainer.pretrained, sharding_mode=cfg.sharding_mode, offload=cfg.step.offload)
    changed = trainer.plan.mesh is not trainer.mesh or is_explicit(trainer.plan.mesh)  # axis types follow the model
    trainer._use(trainer.strategy.resolved(trainer.plan.mesh), trainer.plan.mesh)
    warn_if_unsharded(trainer.plan)
    if changed and cfg.progress and _multihost.is_primary():
        print(trainer.plan.sharding_note)
    return trainer.plan

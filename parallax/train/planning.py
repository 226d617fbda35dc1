"""The Trainer's plan, made at the first batch it sees: the mesh (a ``jax.set_mesh`` around ``fit``
where none was given), the strategy an ``"auto"`` search picks, and the state's plan on them."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np
from jax.dtypes import canonicalize_dtype
from jax.sharding import NamedSharding

from parallax import _multihost
from parallax.parallel.candidates import AUTO, is_auto
from parallax.parallel.mesh_context import mesh_or_context
from parallax.pricing.host_layout import laid_out_by_bytes
from parallax.sharding.mesh import build_mesh, is_explicit
from parallax.state.plan import StatePlan, plan_state, warn_if_crossing, warn_if_unsharded
from parallax.state.search import abstract_batch, resolve
from parallax.step.build import make_train_step

log = logging.getLogger("parallax")


def plan_run(trainer: Any, example_batch: Any) -> StatePlan:
    """``trainer.plan`` for ``example_batch``, made once: on the mesh set with ``jax.set_mesh`` where
    the trainer was given no ``mesh=`` or ``devices=`` (its devices, for ``strategy="auto"``), after
    the search of an ``"auto"`` strategy or split; the trainer's steps are rebuilt on the result."""
    if trainer.plan is not None:
        return trainer.plan
    # Laid out by parallax (no mesh= given; devices= alone is parallax's mesh on them): over several hosts, by
    # the bytes each axis moves.
    own_mesh = not trainer.given_mesh or trainer.devices is not None
    if not trainer.given_mesh:
        mesh, devices = mesh_or_context(trainer.strategy, None, None)
        if trainer.strategy == AUTO:
            trainer.devices = devices
        elif mesh is not None:
            trainer._use(trainer.strategy, mesh)
            own_mesh = False
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
    if own_mesh:
        lay_out_by_bytes(trainer, example_batch)
    else:
        warn_if_crossing(trainer.strategy, trainer.mesh)  # a user's mesh whose tensor or FSDP axis spans hosts
    trainer.plan = plan_state(trainer.model, trainer.optimizer, example_batch, strategy=trainer.strategy, rng=cfg.seed,
                              loss_fn=trainer.loss_fn, mesh=trainer.mesh, rng_streams=cfg.step.rng_streams,
                              params=trainer.pretrained, sharding_mode=cfg.sharding_mode, offload=cfg.step.offload)
    changed = trainer.plan.mesh is not trainer.mesh or is_explicit(trainer.plan.mesh)  # axis types follow the model
    trainer._use(trainer.strategy.resolved(trainer.plan.mesh), trainer.plan.mesh)
    warn_if_unsharded(trainer.plan)
    if changed and cfg.progress and _multihost.is_primary():
        print(trainer.plan.sharding_note)
    return trainer.plan


def lay_out_by_bytes(trainer: Any, example_batch: Any) -> None:
    """Over several hosts, the trainer's mesh laid out so that its step moves the fewest bytes across
    them (:mod:`parallax.pricing.host_layout`: the step compiled once, on the kinds' order, as
    ``px.plan`` compiles it), among the layouts where each process's part of an iterable still fits;
    process 0's choice on every process."""
    cfg, strategy, devices = trainer.config, trainer.strategy, list(trainer.mesh.devices.flat)
    # the global batch, as the step takes it
    rows = trainer.batch_size or np.shape(jax.tree.leaves(example_batch)[0])[0]
    example_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), canonicalize_dtype(x.dtype)),
                                 example_batch)

    def compiled(mesh):
        plan = plan_state(trainer.model, trainer.optimizer, example_batch, strategy=strategy, rng=cfg.seed,
                          loss_fn=trainer.loss_fn, mesh=mesh, rng_streams=cfg.step.rng_streams,
                          params=None, sharding_mode=cfg.sharding_mode, offload=cfg.step.offload)
        step = make_train_step(trainer.loss_fn, plan.strategy, cfg.step)
        return step.lower(plan.abstract_arrays(), abstract_batch(example_batch, NamedSharding(
            plan.mesh, plan.strategy.batch_spec()))).compile()

    fits = trainer.layout_allowed
    layout = laid_out_by_bytes(compiled, strategy, devices, allowed=fits and (lambda mesh: fits(mesh, strategy)))
    if layout is None:
        return
    order = tuple(_multihost.agree(list(layout.inside_first)))
    axes = [(name, int(trainer.mesh.shape[name])) for name in trainer.mesh.axis_names]
    trainer._use(strategy, build_mesh(axes, devices, order))
    log.info(layout.describe())

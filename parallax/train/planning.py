"""The Trainer's plan, made at the first batch it sees: the mesh (a ``jax.set_mesh`` around ``fit``
where none was given), the strategy an ``"auto"`` search picks, and the state's plan on them, returned as a
:class:`RunPlan` the Trainer takes (nothing here changes the Trainer)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.dtypes import canonicalize_dtype
from jax.sharding import Mesh

from parallax import _multihost
from parallax.parallel.candidates import AUTO, is_auto
from parallax.parallel.mesh_context import mesh_or_context
from parallax.pricing.host_layout import laid_out_by_bytes
from parallax.sharding.mesh import build_mesh, is_explicit
from parallax.sharding.strategy import Strategy
from parallax.state.candidate import plan_candidate
from parallax.state.plan import StatePlan, plan_state, warn_if_crossing, warn_if_unsharded
from parallax.state.search import Resolved, resolve

log = logging.getLogger("parallax")


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a Trainer trains with, planned at the first batch it sees (:func:`plan_run`); the Trainer takes it.

    Attributes:
        strategy: the strategy the state is laid out by: the search's pick for ``"auto"`` or an open FSDP split,
            resolved on the mesh.
        mesh: the state's mesh (its axis types as the model needs them).
        devices: the devices ``"auto"`` searched over (a ``jax.set_mesh``'s around ``fit``), else as given.
        config: the trainer's config, its step options with what the search changed to fit the memory budget and
            the compile path it priced its pick on.
        search: what ``strategy="auto"`` or ``FSDP(split="auto")`` chose (``None`` where nothing was searched).
        plan: the state's plan on ``mesh``.
    """

    strategy: Strategy
    mesh: Mesh
    devices: Sequence[jax.Device] | None
    config: Any
    search: Resolved | None
    plan: StatePlan


def plan_run(trainer: Any, example_batch: Any) -> RunPlan:
    """The run's plan for ``example_batch``, read from the trainer and returned, the trainer left as it is: on the
    mesh set with ``jax.set_mesh`` where the trainer was given no ``mesh=`` or ``devices=`` (its devices, for
    ``strategy="auto"``), after the search of an ``"auto"`` strategy or split."""
    strategy, mesh, devices, cfg, search = trainer.strategy, trainer.mesh, trainer.devices, trainer.config, None
    # Laid out by parallax (no mesh= given; devices= alone is parallax's mesh on them): over several hosts, by
    # the bytes each axis moves.
    own_mesh = not trainer.given_mesh or trainer.devices is not None
    if not trainer.given_mesh:
        around, around_devices = mesh_or_context(strategy, None, None)
        if strategy == AUTO:
            devices = around_devices
        elif around is not None:
            mesh, own_mesh = around, False
    if mesh is None and strategy != AUTO:  # none in context either: the strategy's own (or its error)
        mesh = strategy.make_mesh(devices)
    if is_auto(strategy):
        search = resolve(trainer.model, trainer.optimizer, example_batch, strategy, loss_fn=trainer.loss_fn,
                         devices=devices, mesh=mesh, options=cfg.step, rng=cfg.seed, rng_streams=cfg.step.rng_streams,
                         steps=trainer.max_steps if trainer.max_steps is not None else cfg.max_steps)
        # What the search had to change to fit the budget, and the compile path it priced its pick on.
        cfg = dataclasses.replace(cfg, step=search.step_options(cfg.step))
        strategy, mesh = search.strategy, search.mesh
        if cfg.progress and _multihost.is_primary():
            print(search.headline())  # all of it (describe()) in the log, at INFO
    if own_mesh:
        mesh = lay_out_by_bytes(trainer, strategy, mesh, cfg, example_batch)
    else:
        warn_if_crossing(strategy, mesh)  # a user's mesh whose tensor or FSDP axis spans hosts
    plan = search.state_plan(mesh, trainer.pretrained, cfg.sharding_mode) if search is not None else None
    if plan is None:  # not the state the search planned for its pick (another mesh, params given): planned here
        plan = plan_state(trainer.model, trainer.optimizer, example_batch, strategy=strategy, rng=cfg.seed,
                          loss_fn=trainer.loss_fn, mesh=mesh, rng_streams=cfg.step.rng_streams,
                          params=trainer.pretrained, sharding_mode=cfg.sharding_mode, offload=cfg.step.offload)
    changed = plan.mesh is not mesh or is_explicit(plan.mesh)  # axis types follow the model
    warn_if_unsharded(plan)
    if changed and cfg.progress and _multihost.is_primary():
        print(plan.sharding_note)
    return RunPlan(strategy.resolved(plan.mesh), plan.mesh, devices, cfg, search, plan)


def lay_out_by_bytes(trainer: Any, strategy: Strategy, mesh: Mesh, cfg: Any, example_batch: Any) -> Mesh:
    """Over several hosts, ``mesh`` laid out so that the step moves the fewest bytes across them
    (:mod:`parallax.pricing.host_layout`: the step compiled once, on the kinds' order, as
    ``px.plan`` compiles it), among the layouts where each process's part of an iterable still fits;
    process 0's choice on every process. ``mesh`` itself where there is one host or nothing to choose."""
    devices = list(mesh.devices.flat)
    # the global batch, as the step takes it
    rows = trainer.batch_size or np.shape(jax.tree.leaves(example_batch)[0])[0]
    example_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), canonicalize_dtype(x.dtype)),
                                 example_batch)

    def compiled(candidate: Mesh) -> Any:  # the state planned once per layout tried, as px.plan plans a candidate
        return plan_candidate(trainer.model, trainer.optimizer, example_batch, trainer.loss_fn, strategy,
                              mesh=candidate, options=cfg.step, rng=cfg.seed,
                              sharding_mode=cfg.sharding_mode).compiled()

    fits = trainer.layout_allowed
    layout = laid_out_by_bytes(compiled, strategy, devices, allowed=fits and (lambda m: fits(m, strategy)))
    if layout is None:
        return mesh
    order = tuple(_multihost.agree(list(layout.inside_first)))
    axes = [(name, int(mesh.shape[name])) for name in mesh.axis_names]
    log.info(layout.describe())
    return build_mesh(axes, devices, order)

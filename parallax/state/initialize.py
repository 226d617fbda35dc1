"""``init_state``: the sharded train state, built from shapes, for a strategy or ``"auto"``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from parallax.models import LossFn, unwrap_pretrained
from parallax.parallel.candidates import as_strategy
from parallax.parallel.mesh_context import mesh_or_context
from parallax.sharding.strategy import Strategy
from parallax.state.plan import plan_state, warn_if_crossing, warn_if_unsharded
from parallax.state.search import describe_changes, resolve
from parallax.step.options import StepOptions
from parallax.step.train_state import TrainState

log = logging.getLogger("parallax")


def init_state(
    model: Any,
    optimizer: optax.GradientTransformation,
    example_batch: Any,
    *,
    strategy: Strategy | str,
    rng: Any = 0,
    loss_fn: LossFn | None = None,
    mesh: Mesh | None = None,
    rng_streams: Sequence[str] = ("dropout",),
    devices: Sequence[jax.Device] | None = None,
    options: StepOptions | None = None,
    params: Any = None,
    sharding_mode: str = "detect",
    steps: int | None = None,
) -> TrainState:
    """Builds the sharded train state from shapes (``eval_shape`` → specs → ``jit``).

    Each device computes only its own shard of every param and moment; no param is
    ever whole on one device under FSDP. What you hand in stays yours: an NNX instance's
    values, ``params`` and an ``nnx.Optimizer``'s state are copied onto their shards, so the
    train step (which donates the state) never deletes or changes them; the trained module is
    ``state.module()`` (``Trainer.fit``, by NNX's convention, updates an NNX instance in place).

    Args:
        model: an unmodified flax linen module; an NNX module (its values are kept, e.g.
            pretrained weights); or a function that builds an NNX module (planned from shapes:
            each device builds only its shards).
        optimizer: an optax transformation, or an ``nnx.Optimizer(model, tx, wrt=nnx.Param)``
            (its ``tx``, and its state once it has taken steps).
        example_batch: a batch as the loss function receives it (any batch size; only
            shapes and dtypes matter beyond the feature dims).
        strategy: the parallelism strategy, or ``"auto"``: every DP/FSDP/TP mesh of the
            devices is planned and its train step compiled, and the fastest by the cost
            model that fits the memory budget is built (where the best estimates are close,
            the closest few are first timed for a few steps: ``StepOptions.timed_candidates``);
            one log line says what was chosen and why (:func:`parallax.state.search.resolve`). FSDP's default
            ``split="auto"`` picks each weight's split dim the same way (without ``loss_fn``, which
            compiling needs: its largest dim).
        rng: a seed or a PRNG key.
        loss_fn: if given, the model is initialised by running ``loss_fn(model, batch)``,
            which calls the model exactly as training will. Otherwise the model is
            called on ``example_batch`` (unpacked if it is a tuple).
        mesh: the device mesh: the mesh set with ``jax.set_mesh`` around the call, else
            ``strategy.make_mesh()``; or your own (e.g.
            ``jax.make_mesh``'s, Explicit, Auto or mixed axes) with an axis of each strategy
            part's name; its devices and their order are kept, its axis types follow the model
            (``sharding_mode``).
        rng_streams: rng names the model draws from besides ``"params"``.
        devices: the devices ``strategy="auto"`` searches meshes over (all by default).
        options: the :class:`parallax.StepOptions` the train step will use: the candidates
            of an ``"auto"`` search are compiled and priced with them (``memory_budget``,
            ``grad_accum``, ``precision``...), and its ``offload`` parts are built straight into
            host memory (with ``strategy="auto"``, what the search had to change to fit
            ``memory_budget`` when nothing fits without: a warning names it, and a step with
            ``offload=None`` keeps the state where it was built).
        params: pretrained params to start from instead of initialising: a pytree of host or
            device arrays, or an orbax checkpoint path (see :mod:`parallax.state.pretrained`);
            checked against the model's shapes, placed shard by shard.
        sharding_mode: ``"detect"`` (Auto axes, or Explicit ones for a model JAX refuses with
            Auto axes: one that calls ``reshard`` or passes ``out_sharding=``), ``"auto"`` or
            ``"explicit"`` (see :mod:`parallax.step.mesh_mode`).
        steps: how many steps the run will train: an ``"auto"`` or split search stops once it has spent
            what they could win back (without them: after ``options.search_seconds``).

    Returns:
        A :class:`TrainState` whose arrays carry ``NamedSharding`` s on ``mesh``.

    Example:
        >>> state = px.init_state(model, optax.adam(1e-3), batch, strategy=px.FSDP(min_weight_size=0, split="largest"),
        ...                       rng=0, loss_fn=loss_fn)
        >>> tuple(state.params["Dense_1"]["kernel"].sharding.spec), int(state.step)
        (('fsdp',), 0)
    """
    strategy = as_strategy(strategy)
    model, params = unwrap_pretrained(model, params)  # a Hugging Face model object: its module and params
    mesh, devices = mesh_or_context(strategy, mesh, devices)  # a jax.set_mesh around the call, where none is given
    warn_if_crossing(strategy, mesh)  # a user's mesh whose tensor or FSDP axis spans hosts
    found = resolve(model, optimizer, example_batch, strategy, loss_fn=loss_fn, devices=devices, mesh=mesh,
                    options=options, rng=rng, rng_streams=rng_streams, steps=steps)
    plan = found.state_plan(found.mesh, params, sharding_mode)  # the search's, where it planned this state
    if plan is None:
        plan = plan_state(model, optimizer, example_batch, strategy=found.strategy, rng=rng, loss_fn=loss_fn,
                          mesh=found.mesh, rng_streams=rng_streams, params=params, sharding_mode=sharding_mode,
                          offload=found.changes.get("offload", StepOptions.create(options).offload))
    if found.changes:
        log.warning("strategy='auto' fits the memory budget only with %s: the state is built so; build the train "
                    "step with the same options (px.make_train_step(..., %s)).", describe_changes(found.changes),
                    describe_changes(found.changes))
    warn_if_unsharded(plan)
    return plan.build()

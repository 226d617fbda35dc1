"""The ``jit`` compile path: the loss on global arrays, every collective placed by the compiler."""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax.models import LossFn, ModelRun, adapter_for
from parallax.sharding.mesh import is_explicit
from parallax.sharding.specs import is_spec
from parallax.sharding.strategy import Strategy
from parallax.step.accumulate import accumulated
from parallax.step.loss import loss_closure
from parallax.step.options import StepOptions


def jit_run(options: StepOptions, mesh: Mesh, train: bool) -> ModelRun:
    """How the model runs on the global batch: BatchNorm over all of it, the model's own constraints kept."""
    return ModelRun(train=train, batch_stats_axes=None, remat=options.remat, constraint_axes=tuple(mesh.axis_names),
                    compute_dtype=options.policy.compute_dtype)


def gathered_on_use(param_specs: Any, fsdp_axes: tuple[str, ...]) -> Callable[[Any], Any]:
    """On a mesh with Explicit axes, ``params -> params`` resharded without the FSDP axes: each
    FSDP shard is all-gathered where the model uses it (the transpose, a reduce-scatter, brings
    its gradient back to the shard), as Explicit mode wants a contraction's operands to agree."""

    def without_fsdp(spec):
        entries = [tuple(a for a in ((e,) if isinstance(e, str) else (e or ())) if a not in fsdp_axes) for e in spec]
        return PartitionSpec(*[(e[0] if len(e) == 1 else e) if e else None for e in entries])

    compute = jax.tree.map(without_fsdp, param_specs, is_leaf=is_spec)

    def gather(params):
        return jax.tree.map(lambda p, spec: jax.sharding.reshard(p, spec), params, compute)

    return gather


def jit_gradients(loss_fn: LossFn, strategy: Strategy, options: StepOptions, mesh: Mesh, train: bool,
                  param_specs: Any = None) -> Callable:
    """``gradients(state, batch, key)``: ``(grads, sums, model_state)`` in training, ``sums`` in evaluation.

    GSPMD places the collectives; BatchNorm sees the global batch, as on one device. On a mesh
    with Explicit axes (a model that shards itself), FSDP params are gathered where they are used.
    """
    run = jit_run(options, mesh, train)
    microbatch_sharding = NamedSharding(mesh, PartitionSpec(None, *strategy.batch_spec()))
    gather = (gathered_on_use(param_specs, strategy.fsdp_axes)
              if is_explicit(mesh) and strategy.fsdp_axes and param_specs is not None else None)

    def gradients(state, batch, key):
        closure = loss_closure(adapter_for(state.model), loss_fn, options.rng_streams, run)
        loss = closure if gather is None else (lambda params, *rest: closure(gather(params), *rest))
        if not train:
            return loss(state.params, state.model_state, batch, key)[1][0]
        grad_fn = jax.value_and_grad(loss, has_aux=True)
        whole_batch = accumulated(grad_fn, options.grad_accum, strategy.data_shards(mesh),
                                  constrain=lambda parts: jax.lax.with_sharding_constraint(parts, microbatch_sharding))
        return whole_batch(state.params, state.model_state, batch, key)

    return gradients

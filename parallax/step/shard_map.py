"""The ``shard_map`` compile path: the loss per data shard, explicit collectives.

Manual over the data/FSDP axes (a tensor axis stays automatic). FSDP shards are
all-gathered where a layer reads them; their gradient is a reduce-scatter. Replicated
params get a ``pmean`` over every data axis they are not split over. ``check_vma=False``:
with it on, the gradient of a replicated input comes back already summed and a ``pmean``
would leave it N times too large.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from parallax._compat import shard_map
from parallax.models import LossFn, ModelRun, ParamGather, adapter_for
from parallax.sharding.gather import gather_once, scatter_mean
from parallax.sharding.specs import dims_axes, is_spec, without_axes
from parallax.sharding.strategy import Strategy
from parallax.step.accumulate import accumulated
from parallax.step.list_scan import scanned_lists
from parallax.step.loss import loss_closure
from parallax.step.options import StepOptions


def shard_map_gradients(loss_fn: LossFn, strategy: Strategy, options: StepOptions, mesh: Mesh, specs,
                        train: bool) -> Callable:
    """``gradients(state, batch, key)``: ``(grads, sums, model_state)`` in training, ``sums`` in evaluation."""
    data_axes = strategy.data_axes
    manual = set(data_axes)
    fsdp_axes = frozenset(set(strategy.fsdp_axes) & manual)
    param_specs = jax.tree.map(lambda s: without_axes(s, manual), specs.params, is_leaf=is_spec)
    state_in = jax.tree.map(lambda s: without_axes(s, manual), specs.model_state, is_leaf=is_spec)
    bn_axes = data_axes if options.batch_stats == "global" else None
    run = ModelRun(train=train, batch_stats_axes=bn_axes, remat=options.remat,
                   constraint_axes=tuple(a for a in mesh.axis_names if a not in manual),
                   compute_dtype=options.policy.compute_dtype)
    # Each FSDP shard gathered where the model uses it; accumulation gathers once per step instead.
    gathering_run = dataclasses.replace(run, gather=ParamGather(param_specs, fsdp_axes) if fsdp_axes else None)
    accumulating = options.grad_accum > 1

    def closure(adapter, model_run):  # a list of identical checkpointed blocks run as a loop, as jit's step runs it
        loss = loss_closure(adapter, loss_fn, options.rng_streams, model_run)
        return scanned_lists(loss, params_argnum=0) if options.scan_lists and fsdp_axes else loss

    def fold_over_data(key):
        index = 0
        for axis in data_axes:
            index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
        return jax.random.fold_in(key, index)

    def mean_over_replicas(grads):
        def mean(grad, spec):
            axes = tuple(a for a in data_axes if a not in dims_axes(list(spec)))
            return jax.lax.pmean(grad, axes) if axes else grad

        return jax.tree.map(mean, grads, param_specs)

    def reduce_sums(sums):
        return jax.tree.map(lambda x: jax.lax.psum(x, data_axes), sums)

    def local(model, params, model_state, batch, key):
        key = fold_over_data(key)
        adapter = adapter_for(model)
        if not train:
            loss = closure(adapter, gathering_run)
            return reduce_sums(loss(params, model_state, batch, key)[1][0])
        if not accumulating:
            loss = closure(adapter, gathering_run)
            grads, sums, model_state = accumulated(jax.value_and_grad(loss, has_aux=True), 1)(
                params, model_state, batch, key)
        else:
            # Gather each FSDP shard once per step, accumulate full gradients over the
            # microbatches, then reduce-scatter once (not once per microbatch).
            loss = closure(adapter, run)
            full = gather_once(params, param_specs, set(fsdp_axes))
            grads, sums, model_state = accumulated(jax.value_and_grad(loss, has_aux=True), options.grad_accum)(
                full, model_state, batch, key)
            grads = scatter_mean(grads, param_specs, set(fsdp_axes), mesh.shape)
        if bn_axes is None:
            model_state = jax.tree.map(
                lambda x: jax.lax.pmean(x, data_axes) if jnp.issubdtype(x.dtype, jnp.floating) else x, model_state)
        return mean_over_replicas(grads), reduce_sums(sums), model_state

    def gradients(state, batch, key):
        batch_spec = jax.tree.map(lambda _: strategy.batch_spec(), batch)
        out_specs = PartitionSpec() if not train else (param_specs, PartitionSpec(), state_in)
        mapped = shard_map(
            lambda p, m, b, k: local(state.model, p, m, b, k),
            mesh=mesh,
            in_specs=(param_specs, state_in, batch_spec, PartitionSpec()),
            out_specs=out_specs,
            manual_axes=manual,
        )
        try:
            return mapped(state.params, state.model_state, batch, key)
        except ValueError as err:
            raise _manual_axis_error(err, data_axes) from err

    return gradients


_MANUAL_CONSTRAINT = re.compile(r"can only refer to Auto axes of the mesh\. Got spec=(?P<spec>P\(.*?\)) and mesh")


def _manual_axis_error(err: ValueError, data_axes: tuple[str, ...]) -> ValueError:
    """JAX's refusal of a model's own ``with_sharding_constraint`` over the axes this path splits
    by hand, said as what to do; any other error unchanged."""
    found = _MANUAL_CONSTRAINT.search(str(err))
    if found is None:
        return err
    return ValueError(
        f"The model constrains its own arrays with a sharding over the data axes ({found['spec']}: "
        f"jax.lax.with_sharding_constraint), and the shard_map compile path splits {', '.join(map(repr, data_axes))} "
        "by hand, where JAX allows no such constraint. Use compile='jit' or 'auto' (auto picks jit for this model: "
        "the same training, exact), or drop the constraint from the model.")

"""The ``jit`` compile path: the loss on global arrays, every collective placed by the compiler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax._errors import first_line
from parallax.models import LossFn, ModelAdapter, ModelRun, adapter_for
from parallax.sharding.mesh import is_explicit
from parallax.sharding.specs import dims_axes, is_spec, without_axes
from parallax.sharding.strategy import Strategy
from parallax.step.accumulate import accumulated
from parallax.step.loss import loss_closure
from parallax.step.mesh_mode import is_mode_error
from parallax.step.options import StepOptions
from parallax.step.run_changes import with_blocks_marked, with_run_changes


def jit_run(options: StepOptions, mesh: Mesh, train: bool) -> ModelRun:
    """How the model runs on the global batch: BatchNorm over all of it, the model's own constraints kept."""
    return ModelRun(train=train, batch_stats_axes=None, remat=options.remat, constraint_axes=tuple(mesh.axis_names),
                    compute_dtype=options.policy.compute_dtype)


def jit_loss(adapter: ModelAdapter, loss_fn: LossFn, rng_streams: Sequence[str], run: ModelRun, mesh: Mesh,
             strategy: Strategy, param_specs: Any = None, scan_lists: bool = True,
             on_whole: Callable[[str], None] | None = None) -> Callable:
    """The loss closure (:func:`parallax.step.loss.loss_closure`) as the jit path runs it.

    On a mesh with Explicit axes, which wants a contraction's operands to agree, the params are
    first resharded without the FSDP axes: each FSDP shard is all-gathered where the model uses
    it, and the transpose (a reduce-scatter) brings its gradient back to the shard. A param split
    on another axis (tensor parallelism's) keeps its split where the model's own shardings say how
    to shard what its contractions make (``out_sharding=``); where they do not (JAX refuses the
    loss or its gradient: "Contracting dimensions are sharded and it is ambiguous ..."), every
    param is gathered whole where it is used, as the model runs on its author's mesh, and
    ``on_whole`` is told why. A list of identical checkpointed blocks runs as a loop where
    ``scan_lists`` (:func:`with_run_changes`).
    """
    closure = with_run_changes(loss_closure(adapter, loss_fn, rng_streams, with_blocks_marked(run, strategy)),
                               strategy, mesh, run.remat, scan_lists)
    if not (is_explicit(mesh) and param_specs is not None):
        return closure
    fsdp = set(strategy.fsdp_axes)
    kept = jax.tree.map(lambda spec: without_axes(spec, dims_axes(spec) - fsdp), param_specs, is_leaf=is_spec)
    split = any(len(spec) for spec in jax.tree.leaves(kept, is_leaf=is_spec))
    if not (fsdp or split):
        return closure
    whole = jax.tree.map(lambda spec: PartitionSpec(), param_specs, is_leaf=is_spec)

    def used(specs):
        return lambda params, *rest: closure(jax.tree.map(jax.sharding.reshard, params, specs), *rest)

    def loss(params, *rest):
        refused = _refused(used(kept), params, rest) if split else None
        if refused is not None and on_whole is not None:
            on_whole(f"The model's params split over {sorted(_axes(kept))} are gathered whole where the model uses "
                     f"them (JAX refuses them split: {first_line(refused, 200)}); to keep them split, give the "
                     "model's contractions over a split dim out_sharding= (NNX layers and jnp.einsum take it).")
        return used(kept if refused is None else whole)(params, *rest)

    return loss


def _axes(specs: Any) -> set[str]:
    return set().union(*(dims_axes(spec) for spec in jax.tree.leaves(specs, is_leaf=is_spec)))


def _refused(loss: Callable, params: Any, rest: tuple) -> BaseException | None:
    """What JAX says, tracing ``loss``'s value and gradient on values typed as ``params`` and
    ``rest`` (tracers or arrays; nothing compiles), where the model's own shardings and the
    params' do not agree on an Explicit mesh; ``None`` where they do."""
    def typed(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.typeof(x).sharding) if hasattr(x, "dtype") else x

    try:
        jax.eval_shape(jax.value_and_grad(loss, has_aux=True), *jax.tree.map(typed, (params, *rest)))
    except Exception as err:
        if not is_mode_error(err):
            raise
        return err
    return None


def jit_gradients(loss_fn: LossFn, strategy: Strategy, options: StepOptions, mesh: Mesh, train: bool,
                  param_specs: Any = None) -> Callable:
    """``gradients(state, batch, key)``: ``(grads, sums, model_state)`` in training, ``sums`` in evaluation.

    GSPMD places the collectives; BatchNorm sees the global batch, as on one device. On a mesh
    with Explicit axes (a model that shards itself), FSDP params are gathered where they are used.

    Each gradient is laid out as its param (``param_specs``), so the optimizer update runs where
    the param lives: a split param's gradient is reduce-scattered to its shard, a whole one's
    all-reduced. Left to infer it, the partitioner may split a whole param's update over the
    devices and all-gather the param and each optimizer moment afterwards (three all-gathers for
    Adam where one all-reduce does): on MLPs with FSDP's output split, pinning the gradients
    took 10 of 25 collectives out of the step and 10-14% off its time (``benchmarks/zoo.py``).
    """
    run = jit_run(options, mesh, train)
    microbatch_sharding = NamedSharding(mesh, PartitionSpec(None, *strategy.batch_spec()))
    pin = None if param_specs is None or is_explicit(mesh) else jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), param_specs, is_leaf=is_spec)

    def gradients(state, batch, key):
        loss = jit_loss(adapter_for(state.model), loss_fn, options.rng_streams, run, mesh, strategy, param_specs,
                        options.scan_lists)
        if not train:
            return loss(state.params, state.model_state, batch, key)[1][0]
        grad_fn = jax.value_and_grad(loss, has_aux=True)
        whole_batch = accumulated(grad_fn, options.grad_accum, strategy.data_shards(mesh),
                                  constrain=lambda parts: jax.lax.with_sharding_constraint(parts, microbatch_sharding))
        grads, sums, model_state = whole_batch(state.params, state.model_state, batch, key)
        if pin is not None:  # on an Explicit mesh the gradients' types already carry their params' shardings
            grads = jax.lax.with_sharding_constraint(grads, pin)
        return grads, sums, model_state

    return gradients

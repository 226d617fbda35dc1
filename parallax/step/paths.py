"""Which compile paths a step may take, and why: ``jit``, ``shard_map``, or both for the cost model
to choose between (:class:`parallax.step.build.Step`); the loss's proof decides."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from parallax.jaxpr.per_example import Proof, prove_loss
from parallax.models import adapter_for
from parallax.sharding.strategy import Strategy
from parallax.step.batch import leading_dims
from parallax.step.jit import jit_run
from parallax.step.loss import loss_closure
from parallax.step.options import StepOptions
from parallax.step.per_example import is_per_example_loss
from parallax.step.run_changes import run_change_paths


def allowed_paths(strategy: Strategy | None, options: StepOptions, loss_fn: Any, proof: Proof | None, *, train: bool,
                  replicated_batch: bool, explicit: bool) -> tuple[tuple[str, ...], str]:
    """The paths a step may compile on, and why.

    Args:
        strategy: the step's strategy (``None``: ``"auto"``, not yet read from a state).
        options: its :class:`~parallax.step.options.StepOptions` (``compile``, ``batch_stats``).
        loss_fn: its loss (marked :func:`parallax.per_example_loss` or not).
        proof: what the loss's trace showed (``None`` until read).
        train: a train step (an eval step is not worth a second compile).
        replicated_batch: an eval step taking a batch of any size whole on every device.
        explicit: the state's mesh has Explicit axes (a model that shards itself).

    Example:
        >>> allowed_paths(px.FSDP(), px.StepOptions(compile="jit"), loss_fn, None, train=True,
        ...               replicated_batch=False, explicit=False)
        (('jit',), 'compile= as given')
    """
    if strategy is None:
        raise ValueError("strategy='auto': the step learns its strategy from the state at the first call.")
    changed = run_change_paths(strategy, options.compile)
    if changed is not None:
        return changed
    if replicated_batch or not strategy.data_axes:
        return ("jit",), "no data axis to split the batch over"
    if explicit:
        return ("jit",), "the mesh's axes are Explicit (the model shards itself): only jit compiles it"
    if options.batch_stats == "local":  # per-shard statistics only exist where shards are explicit
        return ("shard_map",), "batch_stats='local' needs explicit shards"
    if options.compile != "auto":
        return (options.compile,), "compile= as given"
    marked = is_per_example_loss(loss_fn)
    if not marked and not train:
        return ("jit",), "the loss sees the global batch"
    if not marked and proof is None:
        return ("jit", "shard_map"), ("jit, or the cost model's pick if the loss's trace shows a mean of "
                                      "per-example terms (read at the first call)")
    if not marked and not proof:  # per-shard losses averaged would change a batch-level loss
        return ("jit",), (f"the loss sees the global batch: {proof.reason} (if it is a mean of "
                          "per-example terms, mark it px.per_example_loss to let the cost model choose)")
    if not train:  # an eval step is not worth a second compile
        return (("jit",) if strategy.fsdp_axes and not strategy.model_axes else ("shard_map",),
                "eval steps take the path measured faster in benchmarks/")
    why = "marked px.per_example_loss" if marked else proof.reason
    return ("jit", "shard_map"), f"{why}: the cost model picks jit or shard_map at the first call"


def preferred(allowed: tuple[tuple[str, ...], str], prefer: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """Of the ``allowed`` paths, those in ``prefer`` (the search prices an FSDP split on the path it
    is fast on); all of them where none is preferred.

    Example:
        >>> preferred((("jit", "shard_map"), "marked px.per_example_loss"), ("shard_map",))
        (('shard_map',), 'marked px.per_example_loss; priced on shard_map')
    """
    modes, why = allowed
    kept = tuple(mode for mode in modes if mode in prefer)
    return (kept, f"{why}; priced on {kept[0]}") if kept and kept != modes else (modes, why)


def read_proof(loss_fn: Any, strategy: Strategy, options: StepOptions, train: bool, state: Any, batch: Any,
               mesh: Mesh) -> Proof:
    """Whether the loss as written is a mean of per-example terms, read from its trace on one
    microbatch (nothing compiles or runs): :func:`parallax.jaxpr.per_example.prove_loss`."""
    # The model as the shard_map path runs it: BatchNorm's statistics summed over the data
    # shards (batch_stats="global"), which the proof reads as the whole batch's.
    data_axes = tuple(strategy.data_axes)
    run = dataclasses.replace(jit_run(options, mesh, train), batch_stats_axes=data_axes)
    loss = loss_closure(adapter_for(state.model), loss_fn, options.rng_streams, run)
    rows = leading_dims(batch)[0][1] // options.grad_accum  # one microbatch, as the loss sees it
    microbatch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), batch)
    return prove_loss(loss, state.params, state.model_state, microbatch, state.rng, strategy.data_shards(mesh),
                      [(axis, mesh.shape[axis]) for axis in data_axes])


def check_microbatches(loss_fn: Any, options: StepOptions, state: Any, batch: Any, mesh: Mesh) -> None:
    """Refuses ``grad_accum`` microbatches that would compute other values than the whole batch.

    Accumulating ``k`` microbatches' gradients is one step on the batch exactly when the loss is
    a mean of per-example terms: read from the loss's trace at the batch and at one microbatch
    (:func:`parallax.jaxpr.per_example.prove_loss`, each per-example random draw read as
    a per-example value: a microbatch draws its rows' mask from its own key). A loss marked
    :func:`parallax.per_example_loss` is taken as its author says: each microbatch on its own.

    Raises:
        ValueError: the loss is not proven a mean of per-example terms, naming what the trace
            showed, where, and the fixes.
    """
    if is_per_example_loss(loss_fn):
        return
    run = jit_run(options, mesh, True)
    loss = loss_closure(adapter_for(state.model), loss_fn, options.rng_streams, run)
    proof = prove_loss(loss, state.params, state.model_state, batch, state.rng, options.grad_accum, draws=True)
    if proof:
        return
    where = f" (at {proof.where})" if proof.where else ""
    raise ValueError(
        f"grad_accum={options.grad_accum} splits each batch into microbatches, but the loss is not a mean of "
        f"per-example terms: {proof.reason}{where}. Each microbatch would compute it on its own rows "
        "(a capacity, a batch statistic or a normaliser over fewer examples), another objective than the whole "
        "batch's. Compute it within each example (route a mixture of experts' tokens in groups of one sequence; "
        "normalise a masked mean by a count that does not depend on the batch), or train with grad_accum=1 (more "
        "devices, or a smaller batch); or, "
        "if each microbatch computing on its own rows is what you want (as other libraries accumulate), mark the loss "
        "px.per_example_loss.")

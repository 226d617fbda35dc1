"""The changes a strategy's parts make to how the model runs, carried out on the loss.

A part that only places arrays leaves the loss as it is. A part with a ``run_change``
(:attr:`parallax.sharding.strategy.Strategy.run_changes`) changes how the model computes it: a
:class:`~parallax.parallel.pipeline.part.PipelineRun` runs the model's stack of blocks as a pipeline
over its axis (:mod:`parallax.parallel.pipeline.stack`); a
:class:`~parallax.parallel.context.part.ContextRun` splits each attention along its queries'
sequence over its axis (:mod:`parallax.parallel.context.attention`). Each change is carried out on
the traced loss, so the model's own code runs unchanged, and only on the ``jit`` path (the
compiler places every other axis's collectives around it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from jax.sharding import Mesh

from parallax.models import ModelRun
from parallax.models.blocks import listed_siblings, repeated_blocks
from parallax.models.remat_policy import remat_parts
from parallax.parallel.context.attention import context_parallel
from parallax.parallel.context.part import ContextRun
from parallax.parallel.experts.dispatch import expert_parallel
from parallax.parallel.experts.part import ExpertRun
from parallax.parallel.pipeline.part import NoStackError, PipelineRun, blocks_unnamed, with_found_blocks
from parallax.parallel.pipeline.rows import prove_layer
from parallax.parallel.pipeline.stack import pipelined
from parallax.sharding.mesh import is_explicit
from parallax.sharding.strategy import Strategy
from parallax.step.batch_pins import batch_pinned
from parallax.step.list_scan import scanned_lists

log = logging.getLogger("parallax")


def with_run_changes(loss: Callable, strategy: Strategy, mesh: Mesh, remat: tuple = (),
                     scan_lists: bool = True) -> Callable:
    """``loss(params, model_state, batch, key)`` with the strategy's run changes carried out; a
    pipeline's iterations keep what ``remat``'s checkpoint policy keeps besides their inputs. A
    strategy that only places arrays and splits the batch (data parallelism, FSDP, with tensor
    parallelism) runs a list of identical checkpointed blocks as a loop where ``scan_lists`` and FSDP
    splits the params
    (:mod:`parallax.step.list_scan`) and keeps the batch's split through the model's loops
    (:mod:`parallax.step.batch_pins`)."""
    policy = remat_parts(remat)[1]
    spec = strategy.batch_spec()
    batch = spec[0] if spec else None
    if scan_lists and strategy.fsdp_axes and not strategy.run_changes and not is_explicit(mesh):
        # A list of identical checkpointed blocks run as a loop over their params stacked, as a
        # stack runs: compile time independent of the depth, FSDP's gathers one block at a time.
        # Only where FSDP splits the params: the stacked copy is then each device's share (whole
        # params copied under data parallelism: +12 % on a planned H200 bf16+remat run).
        loss = scanned_lists(loss, params_argnum=0)
    if batch and all(isinstance(c, ContextRun) for c in strategy.run_changes) and not is_explicit(mesh):
        # The batch's split kept through the model's loops (a scanned stack), which the compiler may
        # otherwise gather to keep the weights where they are (parallax.step.batch_pins).
        loss = batch_pinned(loss, mesh=mesh, batch_axes=(batch,) if isinstance(batch, str) else tuple(batch),
                            batch_argnum=2)
    tiled = [c for c in strategy.run_changes if isinstance(c, ContextRun) and (c.method == "ring" or c.load_balance)]
    if tiled and any(isinstance(c, PipelineRun) for c in strategy.run_changes):
        what = "the ring method" if tiled[0].method == "ring" else "load_balance=True"
        raise ValueError(f"{strategy.describe()}: {what} does not run inside a pipeline's stages (its "
                         "shard_map would nest in the pipeline's): use ContextParallel(method='all_gather') without "
                         "load_balance with PipelineParallel, or this context split without a pipeline.")
    # The attention split and the experts' pins first: a pipeline then runs the layers with them.
    for change in sorted(strategy.run_changes, key=lambda c: isinstance(c, PipelineRun)):
        if isinstance(change, ContextRun):
            loss = context_parallel(loss, mesh=mesh, axis=change.axis, method=change.method,
                                    load_balance=change.load_balance)
        elif isinstance(change, ExpertRun):
            batch = strategy.batch_spec()[0]
            loss = expert_parallel(loss, mesh=mesh, axis=change.axis, rules=change.rules, batch_argnum=2,
                                   batch_axes=(batch,) if isinstance(batch, str) else batch,
                                   listed=change.modules is not None)
        elif isinstance(change, PipelineRun):
            stages, shards = int(mesh.shape[change.axis]), strategy.data_shards(mesh)
            loss = pipelined(loss, mesh=mesh, axis=change.axis, repeats=change.repeats, policy=policy,
                             microbatches=lambda rows, c=change, n=stages, d=shards: c.microbatches_for(rows, n, d),
                             params_argnum=0, batch_argnums=(2,), state_argnums=(1,), prove=prove_layer,
                             keep_layer_inputs=change.remat == "layer",
                             marked=marks_blocks(change.blocks, remat))
        else:
            raise TypeError(f"No step carries out the run change {change!r}.")
    return loss


def marks_blocks(blocks: str | type | None, remat: tuple) -> bool:
    """Whether the step marks ``blocks`` (a pipeline's class) itself, to find their calls, because the
    step options' ``remat`` names no such class: then each call's checkpoint is parallax's, not one the
    user asked for (:func:`with_blocks_marked`).

    Example:
        >>> marks_blocks("Block", ()), marks_blocks("Block", ("Block",)), marks_blocks(None, ())
        (True, False, False)
    """
    name = lambda entry: entry if isinstance(entry, str) else getattr(entry, "__name__", None)
    return blocks is not None and name(blocks) not in {name(target) for target in remat_parts(remat)[0]}


def with_blocks_marked(run: ModelRun, strategy: Strategy) -> ModelRun:
    """``run`` with the block classes a pipeline runs, and the expert classes expert parallelism
    runs, rematerialised: each call is then one call in the traced loss, which
    :mod:`parallax.jaxpr.chains` (blocks called in turn) and :mod:`parallax.jaxpr.siblings`
    (experts called side by side) find: a list leaves no ``scan`` or stacked param to find. The
    pipeline runs each block's body itself, rematerialised per iteration; the experts run as one
    batch, rematerialised."""
    classes = [change.blocks if isinstance(change, PipelineRun) else getattr(change, "modules", None)
               for change in strategy.run_changes]
    marks = tuple(dict.fromkeys(mark for mark in classes if mark is not None))
    if not marks:
        return run
    return dataclasses.replace(run, remat=(*marks, *(entry for entry in run.remat if entry not in marks)))


def pipelined_blocks(strategy: Strategy, model: object, example_batch: object, loss_fn: object,
                     error: NoStackError) -> Strategy:
    """``strategy`` pipelining the model's one repeated block class, kept in a list, where a
    :class:`~parallax.PipelineParallel` names no ``blocks=`` and the model has no stack; else
    ``error`` raised, naming the block classes the model calls at several places, if any."""
    try:
        found = repeated_blocks(model, example_batch, loss_fn) if blocks_unnamed(strategy) else ()
    except Exception:
        found = ()
    if len(found) != 1:
        hint = (f" The model calls {', '.join(found)} at several places: if those are its blocks, kept in a list, "
                f"PipelineParallel(blocks={found[0]!r}) pipelines them." if found else "")
        raise NoStackError(f"{error}{hint}") from None
    log.info("PipelineParallel: the model stacks no blocks; it calls one block class at several places, %s, "
             "pipelined as blocks kept in a list (PipelineParallel(blocks=%r) says so).", found[0], found[0])
    return with_found_blocks(strategy, found[0])


def listed_experts_hint(model: object, example_batch: object, loss_fn: object) -> str:
    """For expert parallelism that found no experts: a sentence naming the module classes the
    model calls side by side under one module, as ``ExpertParallel(modules=...)`` takes them."""
    try:
        found = listed_siblings(model, example_batch, loss_fn)
    except Exception:
        return ""
    return (f" The model calls {', '.join(found)} side by side: if those are its experts, kept in a list, "
            f"ExpertParallel(modules={found[0]!r}) runs them as one batch split by expert." if found else "")


_WHAT = {ContextRun: "splits the model's attention over the sequence",
         ExpertRun: "sends the model's tokens to the devices holding their experts"}


def run_change_paths(strategy: Strategy, compile_option: str) -> tuple[tuple[str, ...], str] | None:
    """The compile paths a strategy that changes how the model runs allows (``None``: any)."""
    if not strategy.run_changes:
        return None
    what = " and ".join(dict.fromkeys(_WHAT.get(type(c), "runs the model's stack as a pipeline")
                                      for c in strategy.run_changes))
    if compile_option == "shard_map":
        raise ValueError(f"{strategy.describe()} {what}, which the jit path compiles: "
                         "pass compile='jit' or 'auto' (compile='shard_map' cannot take it).")
    return ("jit",), f"{strategy.describe()} {what}: it runs on the jit path"

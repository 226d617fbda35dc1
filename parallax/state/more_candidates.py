"""The candidates ``strategy="auto"`` adds for what a model shows once its meshes are priced.

Beyond every DP × FSDP × TP mesh of the devices (:func:`parallax.sharding.auto.candidates`): a
pipeline over the model's stack of blocks, where a priced candidate found one, or over its one
repeated block class kept in a list (:func:`~parallax.sharding.auto.pipeline_candidates`; where the
stack's blocks rematerialise themselves, each also with ``remat="layer"``: fewer FLOPs for more
memory, the budget and the prices decide); the sequence split over a context axis, for a model
with attention whose batch the devices do not divide (a few long sequences) or where no mesh
priced so far fits the memory budget (:func:`~parallax.sharding.auto.context_candidates`, the ring
method and load balancing among them); and an expert axis for a model that stacks a mixture of experts' weights, or
keeps its experts in a list (:func:`~parallax.sharding.auto.expert_candidates`).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import numpy as np

from parallax._errors import first_line
from parallax.models.blocks import listed_experts, module_calls, repeated_blocks
from parallax.models.context_attention import holds_attention
from parallax.models.expert_dispatch import stacked_experts
from parallax.models.traced import stack_rematerialises, traced_loss
from parallax.sharding.auto import context_candidates, expert_candidates, pipeline_candidates
from parallax.sharding.expert_parallel import ExpertParallel
from parallax.sharding.pipeline import PipelineParallel
from parallax.sharding.strategy import Strategy

log = logging.getLogger("parallax")


def more_candidates(stacked: bool, model: Any, example_batch: Any, loss_fn: Any, rng_streams: Sequence[str],
                    device_count: int, over_budget: bool = False) -> list[Strategy]:
    """The pipelines, context and expert meshes to price besides the DP/FSDP/TP meshes
    (``stacked``: the model stacks its blocks, :func:`stacks`; ``over_budget``: none of those
    meshes fits the memory budget)."""
    more = []
    split_rows = rows(example_batch) % device_count
    traced = traced_loss(model, example_batch, loss_fn, rng_streams).jaxpr if stacked or split_rows or over_budget \
        else None
    calls = read_or_none("modules", lambda: module_calls(model, example_batch, loss_fn))  # read once, for both
    listed = None if calls is None else listed_experts(model, example_batch, loss_fn, calls)
    if stacked:
        more += pipeline_candidates(device_count)
        if stack_rematerialises(traced):  # each block's input kept: one forward fewer, for more memory
            more += pipeline_candidates(device_count, pipeline=PipelineParallel(remat="layer"))
    else:  # one block class kept in a list (not the experts): the pipeline finds it (PipelineParallel's blocks=)
        blocks = () if calls is None else repeated_blocks(model, example_batch, loss_fn, calls)
        if len(blocks) == 1 and (listed is None or blocks[0] != listed[0]):
            more += pipeline_candidates(device_count)
    if (split_rows or over_budget) and holds_attention(traced):
        more += context_candidates(device_count)
    experts = read_or_none("stacked experts", lambda: stacked_experts(model, example_batch, loss_fn, rng_streams)) or 0
    if experts:
        more += expert_candidates(device_count, experts)
    elif listed:
        more += expert_candidates(device_count, listed[1], expert=ExpertParallel(modules=listed[0]))
    return more


def read_or_none(what: str, read: Any) -> Any:
    """What ``read()`` finds in the model, or ``None`` (logged) where it cannot be read: the
    meshes already priced stand without the candidates it would add."""
    try:
        return read()
    except Exception as err:  # noqa: BLE001
        log.info("Could not read the model's %s (%s); the candidates they would add are not priced.", what,
                 first_line(err, 200))
        return None


def rows(batch: Any) -> int:
    """The batch's rows (its leaves' leading dim; 0 for a batch without one)."""
    shapes = [tuple(getattr(leaf, "shape", np.shape(leaf))) for leaf in jax.tree.leaves(batch)]
    return next((int(shape[0]) for shape in shapes if shape), 0)


def stacks(found: dict) -> bool:
    """Whether a priced candidate found a stack of blocks in the model (an FSDP part told which
    param dims a ``scan`` steps over)."""
    return any(getattr(part, "scanned", None) for strategy, *_ in found.values() for part in strategy.parts)

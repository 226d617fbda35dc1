"""The candidates ``strategy="auto"`` adds for what a model shows once its meshes are priced.

Beyond every DP × FSDP × TP mesh of the devices (:func:`parallax.sharding.auto.candidates`): a
pipeline over the model's stack of blocks, where a priced candidate found one
(:func:`~parallax.sharding.auto.pipeline_candidates`; where the blocks rematerialise themselves,
each also with ``remat="layer"``: fewer FLOPs for more memory, the budget and the prices decide), and the sequence split over a context axis,
for a model with attention whose batch the devices do not divide: a few long sequences
(:func:`~parallax.sharding.auto.context_candidates`); and an expert axis for a model that stacks a
mixture of experts' weights (:func:`~parallax.sharding.auto.expert_candidates`).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import numpy as np

from parallax.models.context_attention import holds_attention
from parallax.models.expert_dispatch import stacked_experts
from parallax.models.traced import stack_rematerialises, traced_loss
from parallax.sharding.auto import context_candidates, expert_candidates, pipeline_candidates
from parallax.sharding.pipeline import PipelineParallel
from parallax.sharding.strategy import Strategy

log = logging.getLogger("parallax")


def more_candidates(found: dict, model: Any, example_batch: Any, loss_fn: Any, rng_streams: Sequence[str],
                    device_count: int) -> list[Strategy]:
    """The pipelines and context meshes to price besides the meshes already priced (``found``)."""
    more = []
    traced = traced_loss(model, example_batch, loss_fn, rng_streams).jaxpr if stacks(found) or rows(
        example_batch) % device_count else None
    if stacks(found):
        more += pipeline_candidates(device_count)
        if stack_rematerialises(traced):  # each block's input kept: one forward fewer, for more memory
            more += pipeline_candidates(device_count, pipeline=PipelineParallel(remat="layer"))
    if rows(example_batch) % device_count and holds_attention(traced):
        more += context_candidates(device_count)
    try:
        experts = stacked_experts(model, example_batch, loss_fn, rng_streams)
    except Exception as err:  # noqa: BLE001 (what auto adds: the meshes already priced stand without it)
        log.info("Could not read whether the model stacks experts (%s); ExpertParallel is not among the candidates.",
                 str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
        experts = 0
    if experts:
        more += expert_candidates(device_count, experts)
    return more


def rows(batch: Any) -> int:
    """The batch's rows (its leaves' leading dim; 0 for a batch without one)."""
    shapes = [tuple(getattr(leaf, "shape", np.shape(leaf))) for leaf in jax.tree.leaves(batch)]
    return next((int(shape[0]) for shape in shapes if shape), 0)


def stacks(found: dict) -> bool:
    """Whether a priced candidate found a stack of blocks in the model (an FSDP part told which
    param dims a ``scan`` steps over)."""
    return any(getattr(part, "scanned", None) for strategy, *_ in found.values() for part in strategy.parts)

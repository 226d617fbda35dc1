"""Whether a pipeline's state holds its list of blocks stacked, and where the stacked leaves live.

A :class:`~parallax.PipelineParallel` over blocks kept in a list (``blocks=``) holds their params
and optimizer state stacked by layer (:mod:`parallax.parallel.pipeline.stacked_blocks`), the layer dim
over the stage axis, where it can: each stage's devices then hold their blocks whole and the step
moves only activations between stages. It cannot where the blocks are not the children of one
mapping, where the model is an NNX one (its state is the model's own), or where the optimizer
does not treat each stacked row as the block on its own (it masks params by their rank, or
scales each by its own norm, as LAMB does): checked before anything compiles on a miniature of
the params (every leaf's rank and names, each dim at most 3) through two updates. The blocks
then stay in the model's tree, each split over the stages and restacked by the step, and the
log says why.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from parallax.parallel.pipeline.part import FoundBlocks, PipelineParallel
from parallax.parallel.pipeline.stacked_blocks import Group, StackedBlocks, block_groups, stacked, subtree, with_subtree
from parallax.sharding.found import Found
from parallax.sharding.specs import dims_axes, follow_params, is_spec, without_axes
from parallax.sharding.strategy import Strategy

log = logging.getLogger("parallax")


def _listed(strategy: Strategy, found: Found) -> tuple[PipelineParallel, FoundBlocks] | tuple[None, None]:
    """``strategy``'s pipeline over listed blocks and what it found of them (``None, None`` where it has none)."""
    for part in strategy.parts:
        record = found.of(part)
        if isinstance(part, PipelineParallel) and record is not None and record.chained:
            return part, record
    return None, None


def stacking_groups(strategy: Strategy, found: Found, params: Any, optimizer: Any, linen: bool,
                    axis_sizes: Mapping[str, int]) -> list[Group]:
    """The lists of blocks ``strategy``'s pipeline holds stacked in the state (none where it has no
    pipeline over listed blocks, or cannot: logged with the reason); ``found``: what planning found of them."""
    part, blocks = _listed(strategy, found)
    if part is None or not part.stack_blocks:
        return []
    stages = axis_sizes[part.axis]
    why = ("the model is an NNX module (its state is the model's own)" if not linen else
           f"its {blocks.layers} blocks are not a multiple of the {stages} stages × repeats={part.repeats}"
           if blocks.layers % (stages * part.repeats) else None)
    groups = block_groups(blocks.chained, params) if why is None else why
    why = groups if isinstance(groups, str) else optimizer_differs(optimizer, params, groups)
    if why is not None:
        log.warning("%s: the blocks' params stay in the model's tree, each split over the stages and restacked "
                    "by every step (their bytes cross the stage axis each step), because %s.",
                    strategy.describe(), why)
        return []
    return groups


def optimizer_differs(optimizer: Any, params: Any, groups: Sequence[Group]) -> str | None:
    """Why ``optimizer`` updates a stacked row otherwise than the block it holds (run on a miniature
    of ``params``: each leaf's rank, dims at most 3, random values, two updates), or ``None``."""
    rng = np.random.default_rng(0)
    small = jax.tree.map(lambda leaf: rng.standard_normal(tuple(min(d, 3) for d in leaf.shape)).astype(np.float32),
                         params)
    grads = [jax.tree.map(lambda leaf: rng.standard_normal(leaf.shape).astype(np.float32), small) for _ in range(2)]

    def run(tree, gradients):
        state = optimizer.init(tree)
        for g in gradients:
            updates, state = optimizer.update(g, state, tree)
            tree = jax.tree.map(lambda p, u: p + u, tree, updates)
        return tree

    def both():
        with jax.default_device(jax.devices("cpu")[0]):
            plain, held = run(small, grads), run(stacked(small, groups), [stacked(g, groups) for g in grads])
            return jax.device_get((stacked(plain, groups), held))

    try:  # on this host's CPU, in a thread of its own: out of the mesh in context (a plan's devices may be
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # ones only compiled for)
            expected, held = pool.submit(both).result()
    except Exception as err:
        return f"the optimizer does not take the stacked params ({type(err).__name__}: {str(err)[:160]})"
    for got, want in zip(jax.tree.leaves(held), jax.tree.leaves(expected), strict=True):
        if np.shape(got) != np.shape(want) or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
            return ("the optimizer updates a stacked param otherwise than each block's own (it treats params by "
                    "their shape or scales each by its own norm)")
    return None


def storage_specs(abstract: Any, specs: Any, groups: Sequence[Group], strategy: Strategy, found: Found) -> Any:
    """The state's specs for ``abstract`` (a state whose params hold ``groups`` stacked) from
    ``specs`` (the same state's, its params as the model writes them): each stacked leaf over
    the pipeline's axis on its layer dim, its other dims as its blocks' (without that axis), the
    optimizer's leaves following their params."""
    axis = _listed(strategy, found)[0].axis
    held = jax.tree.map(lambda s: without_axes(s, dims_axes(s) - {axis}), specs.params, is_leaf=is_spec)
    for parent, keys in groups:
        blocks = subtree(held, parent)
        first = jax.tree.leaves(blocks[keys[0]], is_leaf=is_spec)
        if any(jax.tree.leaves(blocks[k], is_leaf=is_spec) != first for k in keys):
            raise ValueError(f"The blocks under {'/'.join(parent) or 'the params'} are placed differently from one "
                             "another, so they cannot be held stacked: give their params the same placement, or "
                             "pass PipelineParallel(stack_blocks=False) to keep them as the model writes them.")
        held = with_subtree(held, parent, StackedBlocks(
            jax.tree.map(lambda s: PartitionSpec(axis, *s), blocks[keys[0]], is_leaf=is_spec), keys,
            {k: v for k, v in blocks.items() if k not in keys}))
    return follow_params(abstract, held)


"""Pipeline parallelism: the layers of a model's stack split over a mesh axis of stages.

A part that changes how the model runs, not only where its arrays live: besides placing the
stacked block params (the layer dim a ``scan`` steps over goes to the stage axis, so each
device holds only its stages' layers and their optimizer state), it declares a
:class:`PipelineRun` (:attr:`Strategy.run_change`), which the step carries out on the traced
loss (:mod:`parallax.parallel.pipeline.stack`): the stack runs as a pipeline of microbatches,
everything before and after it on the whole batch as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from parallax.sharding.parts import check_module_class
from parallax.sharding.specs import dims_axes, entry_size
from parallax.sharding.strategy import Combined, Strategy

SCHEDULES = ("gpipe", "circular")
REMATS = ("iteration", "layer")


def split_layers(count: int, groups: int) -> list[int]:
    """How many of a stack's ``count`` layers each of ``groups`` groups of consecutive layers holds
    (a stage's, or with ``repeats`` a stage's group's): as even as they can be, the first ones one
    more where ``groups`` does not divide ``count``.

    Example:
        >>> split_layers(126, 8), split_layers(8, 4)
        ([16, 16, 16, 16, 16, 16, 15, 15], [2, 2, 2, 2])
    """
    if groups < 1 or count < groups:
        raise ValueError(f"The stack has {count} layers, fewer than its {groups} groups of layers (stages × repeats): "
                         f"use at most {count} stages × repeats.")
    base, extra = divmod(count, groups)
    return [base + 1] * extra + [base] * (groups - extra)


def describe_split(count: int, stages: int, repeats: int) -> str:
    """A sentence on how a stack's layers go to the stages, where they do not divide evenly.

    Example:
        >>> describe_split(126, 8, 1)
        '126 layers over 8 stages: 6 stages hold 16 layers, 2 hold 15; each stage runs 16 layer slots per microbatch, a shorter one passing its input on in its last (2 of 128 slots, 1.6%, idle besides the bubble)'
    """  # noqa: E501 (a doctest's output)
    sizes = split_layers(count, stages * repeats)
    longer, per_group = sizes.count(sizes[0]), sizes[0]
    slots = per_group * len(sizes)
    groups = "stages" if repeats == 1 else "groups"
    per = "per microbatch" if repeats == 1 else f"per group and microbatch ({repeats} groups a stage)"
    return (f"{count} layers over {stages} stages{'' if repeats == 1 else f' × repeats={repeats}'}: {longer} {groups} "
            f"hold {per_group} layers, {len(sizes) - longer} hold {per_group - 1}; each {groups[:-1]} runs {per_group} "
            f"layer slots {per}, a shorter one passing its input on in its last ({slots - count} of {slots} slots, "
            f"{100 * (slots - count) / slots:.1f}%, idle besides the bubble)")


def stage_split(shape: tuple[int, ...], dims: list, axis: str, axis_sizes: Mapping[str, int],
                layer: int | None = None) -> list:
    """``dims`` with the stage ``axis`` added where a param split over the stages along another dim than
    its layers' has it: its largest free dim the stages divide, else beside the axes already on a dim
    (FSDP's first) whose shards the stages divide, else nowhere (whole on each stage); never ``layer``.

    Example:
        >>> stage_split((8, 6), [None, "fsdp"], "stage", {"stage": 2, "fsdp": 2})
        ['stage', 'fsdp']
    """
    stages = axis_sizes[axis]
    free = [d for d in range(len(shape)) if dims[d] is None and d != layer and shape[d] % stages == 0]
    if free:
        d = max(free, key=lambda d: (shape[d], -d))
        return [*dims[:d], axis, *dims[d + 1:]]
    taken = [d for d in range(len(shape)) if dims[d] is not None and d != layer
             and shape[d] % (entry_size(dims[d], axis_sizes) * stages) == 0]
    if not taken:
        return dims
    d = max(taken, key=lambda d: ("fsdp" in dims_axes([dims[d]]), shape[d], -d))
    entry = dims[d] if isinstance(dims[d], tuple) else (dims[d],)
    return [*dims[:d], (*entry, axis), *dims[d + 1:]]


class NoStackError(ValueError):
    """A :class:`PipelineParallel` with no ``blocks=`` found no stack in the model (the planner adds
    which repeated block class to name, where the model has one)."""


def blocks_unnamed(strategy: Strategy) -> bool:
    """Whether ``strategy`` pipelines with a part that names no ``blocks=`` (a stack, or the one
    repeated block class the model keeps in a list: :func:`with_found_blocks`)."""
    return any(isinstance(part, PipelineParallel) and part.blocks is None for part in strategy.parts)


def with_found_blocks(strategy: Strategy, blocks: str) -> Strategy:
    """``strategy`` with each :class:`PipelineParallel` part that names no ``blocks=`` pipelining
    the model's listed ``blocks`` (a model with no stack and one repeated block class).

    Example:
        >>> with_found_blocks(px.combine(px.PipelineParallel(2), px.FSDP(4)), "Block").describe()
        "PipelineParallel(stage=2, blocks='Block') × FSDP(fsdp=4)"
    """
    parts = tuple(dataclasses.replace(part, blocks=blocks) if isinstance(part, PipelineParallel) and part.blocks is None
                  else part for part in strategy.parts)
    return parts[0] if strategy.parts == (strategy,) else Combined(parts)


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    """How the model's stack runs: over ``axis`` in ``microbatches`` (``None``: the part's
    default for the batch), each stage holding ``repeats`` groups of layers, what its backward
    pass recomputes as ``remat`` says (:class:`PipelineParallel`)."""

    axis: str
    microbatches: int | None
    repeats: int
    blocks: str | type | None = None
    remat: str = "iteration"

    def microbatches_for(self, rows: int, stages: int, data_shards: int) -> int:
        """The microbatch count for a batch of ``rows``: as given, else the most up to ``2·stages``
        that split the batch into equal microbatches each divisible over the data shards."""
        if self.microbatches is not None:
            return self.microbatches
        fits = [m for m in range(1, 2 * stages + 1) if rows % m == 0 and (rows // m) % data_shards == 0
                and (self.repeats == 1 or m >= stages)]
        if not fits:
            raise ValueError(f"A batch of {rows} rows cannot be split into microbatches for {stages} stages over "
                             f"{data_shards} data shards: pass PipelineParallel(microbatches=...) or a batch size "
                             f"divisible by {stages * data_shards}.")
        return max(fits)


@dataclasses.dataclass(frozen=True)
class FoundBlocks:
    """What :class:`PipelineParallel` finds in the traced loss (:meth:`PipelineParallel.find_in`): a stack or,
    with ``blocks=``, the listed blocks.

    Attributes:
        stacked: the stacked params' layer dims, by path (``None`` for listed blocks).
        chained: the listed blocks' params, by path: ``(chain, layer)``, which run of calls and which block of it
            (``None`` for a stack).
        layers: the stack's layer count, or the list's block count.
    """

    stacked: Mapping[str, int] | None = None
    chained: Mapping[str, tuple[int, int]] | None = None
    layers: int | None = None


@dataclasses.dataclass(frozen=True)
class PipelineParallel(Strategy):
    """The model's stack of repeated blocks split over ``stages`` devices and run as a pipeline.

    The stack is found in the traced loss: a ``scan`` over stacked params (linen ``nn.scan``
    with ``variable_axes={"params": 0}``, NNX ``nnx.vmap`` + ``nnx.scan``, a ``lax.scan`` over
    stacked weights) whose carry is the activations, or, with ``blocks=``, a list of blocks of
    that class called in turn (Hugging Face's Flax GPT-2 and Llama). Its layers are split over
    the axis, the batch runs through them as ``microbatches`` microbatches, and everything else
    (embeddings, head, loss) runs on the whole batch as on one device. Combines with the other
    parts: ``px.combine(px.PipelineParallel(2), px.FSDP(4))``.

    Args:
        stages: devices on the axis; ``-1`` takes the devices left over.
        microbatches: how many microbatches go through the pipeline; ``None``: up to
            ``2·stages``, as the batch divides. The bubble, the share of the loop a stage idles,
            is ``(S-1)/(R·M+S-1)``.
        schedule: ``"gpipe"`` (each stage holds contiguous layers) or ``"circular"``
            (``repeats`` groups each, the microbatches going round ``repeats`` times).
        repeats: layer groups per stage (``1`` for GPipe, at least 2 for circular).
        axis: the mesh axis name.
        blocks: the class (or class name) of a model's blocks kept in a list and called in turn,
            e.g. ``"FlaxGPT2Block"``; ``None``: the model stacks its blocks.
        stack_blocks: with ``blocks``, the state holds the list's params (and their optimizer
            state) stacked by layer, the layer dim over the stage axis
            (:mod:`parallax.parallel.pipeline.stacked_blocks`): each stage's devices hold their own blocks
            whole, and only activations cross the stage axis. ``False``, or where it cannot (an NNX
            model, an optimizer that treats params by their shape: logged), each block's params
            stay in the model's tree, split over the stage axis, and every step restacks them (their
            bytes cross the stage axis each step).
        remat: what the backward pass recomputes. ``"iteration"``: each pipeline iteration keeps
            only its input and is recomputed from it: the least memory (one input per iteration);
            a stack's blocks that checkpoint themselves (``nn.remat``) are then recomputed once
            more inside their own checkpoint (a third forward of every block), a list's run
            plainly inside the iteration. ``"layer"``: a stack's self-checkpointing block, and every
            block of a list (run as a checkpoint), keeps its input too and is recomputed once: the
            FLOPs of the same model without a pipeline, for the memory it keeps without one (an
            input per block and microbatch); a stack whose blocks do not checkpoint themselves
            runs as by default.

    ``stages × repeats`` need not divide the model's layers: the first groups then hold one layer more
    (:func:`split_layers`), a stack's params are split over the stages along another dim, as listed blocks
    are, and the step regroups them by stage. What the part finds in the traced loss (the stack or the
    listed blocks, and their count) is a :class:`FoundBlocks` in the state's plan.

    Example:
        >>> px.PipelineParallel(2).describe(), px.PipelineParallel(2).model_axes
        ('PipelineParallel(stage=2)', ('stage',))
    """

    stages: int = -1
    microbatches: int | None = None
    schedule: str = "gpipe"
    repeats: int = 1
    axis: str = "stage"
    blocks: str | type | None = None
    remat: str = "iteration"
    stack_blocks: bool = True

    splits_batch = False
    gathers_params = False
    placement_priority = 0  # the layer dim first: the other parts split the dims left
    link_rank = 40  # activations once per stage and microbatch: what crosses slow links
    uses_computation = True  # to find the stack

    def __post_init__(self):
        if not isinstance(self.axis, str) or not self.axis:
            raise ValueError(f"PipelineParallel(axis={self.axis!r}): the axis name must be a non-empty string.")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or (self.stages < 1 and self.stages != -1):
            raise ValueError(f"PipelineParallel(stages={self.stages!r}): use a positive number of devices, or -1 for "
                             "the devices left over.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineParallel(schedule={self.schedule!r}): use one of {SCHEDULES}.")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1 \
                or (self.schedule == "gpipe") != (self.repeats == 1):
            raise ValueError(f"PipelineParallel(schedule={self.schedule!r}, repeats={self.repeats!r}): GPipe holds one "
                             "group of layers per stage (repeats=1); circular holds several (repeats >= 2).")
        check_module_class("PipelineParallel", "blocks", self.blocks, "the blocks'", "FlaxGPT2Block")
        if self.remat not in REMATS:
            raise ValueError(f"PipelineParallel(remat={self.remat!r}): use 'iteration' (each iteration keeps its "
                             "input: the least memory) or 'layer' (each block's input kept too: no block recomputed "
                             "twice).")
        if not isinstance(self.stack_blocks, bool):
            raise ValueError(f"PipelineParallel(stack_blocks={self.stack_blocks!r}): use True (the state holds a "
                             "list's blocks stacked by stage) or False (as the model writes them, restacked every "
                             "step).")
        if self.microbatches is not None and (isinstance(self.microbatches, bool) or not isinstance(
                self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"PipelineParallel(microbatches={self.microbatches!r}): use a positive number, or None "
                             "to take up to 2·stages.")

    @property
    def size(self) -> int:
        return self.stages

    def with_size(self, size: int) -> PipelineParallel:
        return dataclasses.replace(self, stages=size)

    @property
    def described_options(self) -> str:
        """What differs from the defaults: ``", microbatches=8, schedule='circular', repeats=2, blocks='Block'"``."""
        options = [f"microbatches={self.microbatches}" if self.microbatches is not None else "",
                   f"schedule={self.schedule!r}, repeats={self.repeats}" if self.schedule != "gpipe" else "",
                   f"blocks={getattr(self.blocks, '__name__', self.blocks)!r}" if self.blocks is not None else "",
                   f"remat={self.remat!r}" if self.remat != "iteration" else "",
                   "stack_blocks=False" if not self.stack_blocks else ""]
        return "".join(f", {option}" for option in options if option)

    @property
    def run_change(self) -> PipelineRun:
        return PipelineRun(self.axis, self.microbatches, self.repeats, self.blocks, self.remat)

    def find_in(self, computation: Any) -> FoundBlocks:
        """The stacked params (or, with ``blocks``, the listed blocks' params) found in the traced loss.

        Raises:
            NoStackError: no ``blocks=`` named and the model stacks no blocks.
            ValueError: ``blocks=`` names a class the model does not call in turn.
        """
        if self.blocks is not None:
            chained = computation.chained_params()
            if not chained:
                name = getattr(self.blocks, "__name__", self.blocks)
                raise ValueError(
                    f"PipelineParallel(blocks={name!r}) found no blocks of that class called in turn in the model: no "
                    f"two calls of {name} that compute the same thing on their own params, each on the activations the "
                    "one before returned. Name the class of the model's repeated block, or leave blocks=None for a "
                    "model that stacks its blocks.")
            first = min(chain for chain, _ in chained.values())
            blocks = len({layer for chain, layer in chained.values() if chain == first})
            return FoundBlocks(chained=dict(chained), layers=blocks)
        scanned = computation.scanned_dims()
        if not scanned:
            raise NoStackError(
                "PipelineParallel found no stack of blocks in the model: no param has a dim that a scan steps over. "
                "Stack the repeated blocks (linen nn.scan with variable_axes={'params': 0}, NNX nnx.vmap + nnx.scan, "
                "or a lax.scan over stacked weights), or name the class of blocks kept in a list: "
                "PipelineParallel(blocks=...).")
        stacked = {path: dims[0] for path, dims in scanned.items()}
        shapes = dict(zip(computation.param_paths, computation.param_shapes))
        counts = {shapes[path][dim] for path, dim in stacked.items() if path in shapes}
        return FoundBlocks(stacked=stacked, layers=max(counts) if counts else None)

    def layout_report(self, found: FoundBlocks | None = None) -> str | None:
        """How the layers go to the stages, where ``stages × repeats`` does not divide them."""
        stages = self.stages if self.stages > 0 else None
        layers = found.layers if found is not None else None
        if layers is None or stages is None or layers % (stages * self.repeats) == 0:
            return None
        return f"PipelineParallel({self.axis}): {describe_split(layers, stages, self.repeats)}."

    def _regrouped(self, path: str, shape: tuple[int, ...], axis_sizes: Mapping[str, int], found: FoundBlocks) -> bool:
        """Whether the step stacks (or regroups) this param's layers by stage, its state split over the
        stages along another dim: a listed block's param, or a stack's whose layers the groups do not divide."""
        dim = (found.stacked or {}).get(path)
        if dim is not None and shape[dim] % (axis_sizes[self.axis] * self.repeats):
            split_layers(shape[dim], axis_sizes[self.axis] * self.repeats)  # at least one layer a group, or the error
            return True
        return path in (found.chained or {})

    def place(self, path, shape, dims, axis_sizes, found: FoundBlocks | None = None):
        """``dims`` with the stage axis on a stacked param's layer dim (``found``: :meth:`find_in`'s); a param the
        step regroups by stage takes it last (:meth:`place_last`)."""
        found = found or FoundBlocks()
        dim = (found.stacked or {}).get(path)
        if dim is None or self._regrouped(path, shape, axis_sizes, found):
            return dims  # a regrouped param takes the stage axis last, on a dim the other parts leave
        return [*dims[:dim], self.axis, *dims[dim + 1:]]

    def place_last(self, path, shape, dims, axis_sizes, found: FoundBlocks | None = None):
        """A regrouped param's stage axis: on its largest free dim the stages divide, else beside the axes
        already on a dim (FSDP's first) whose shards the stages divide, else nowhere (whole on each stage)."""
        found = found or FoundBlocks()
        if not self._regrouped(path, shape, axis_sizes, found):
            return dims
        return stage_split(shape, dims, self.axis, axis_sizes, (found.stacked or {}).get(path))

    def why_whole(self, path, shape, axis_sizes, found: FoundBlocks | None = None) -> str:
        if found is not None and found.chained is not None:
            return f"PipelineParallel({self.axis}) splits only the listed blocks' params"
        return f"PipelineParallel({self.axis}) splits only the stacked blocks' layer dim"

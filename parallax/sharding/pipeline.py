"""Pipeline parallelism: the layers of a model's stack split over a mesh axis of stages.

A part that changes how the model runs, not only where its arrays live: besides placing the
stacked block params (the layer dim a ``scan`` steps over goes to the stage axis, so each
device holds only its stages' layers and their optimizer state), it declares a
:class:`PipelineRun` (:attr:`Strategy.run_change`), which the step carries out on the traced
loss (:mod:`parallax.models.pipeline_stack`): the stack runs as a pipeline of microbatches,
everything before and after it on the whole batch as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from parallax.sharding.strategy import Strategy

SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    """How the model's stack runs: over ``axis`` in ``microbatches`` (``None``: the part's
    default for the batch), each stage holding ``repeats`` groups of layers."""

    axis: str
    microbatches: int | None
    repeats: int

    def microbatches_for(self, rows: int, stages: int, data_shards: int) -> int:
        """The microbatch count for a batch of ``rows``: as given, else the most up to ``2·stages``
        that split the batch into equal microbatches each divisible over the data shards."""
        if self.microbatches is not None:
            return self.microbatches
        fits = [m for m in range(1, 2 * stages + 1) if rows % m == 0 and (rows // m) % data_shards == 0
                and (self.repeats == 1 or m >= stages)]
        if not fits:
            raise ValueError(f"A batch of {rows} rows cannot be split into microbatches for {stages} stages over "
                             f"{data_shards} data shards: pass PipelineParallel(microbatches=...) or a batch size divisible "
                             f"by {stages * data_shards}.")
        return max(fits)


@dataclasses.dataclass(frozen=True)
class PipelineParallel(Strategy):
    """The model's stack of repeated blocks split over ``stages`` devices and run as a pipeline.

    The stack is found in the traced loss: a ``scan`` over stacked params (linen ``nn.scan``
    with ``variable_axes={"params": 0}``, NNX ``nnx.vmap`` + ``nnx.scan``, a ``lax.scan`` over
    stacked weights) whose carry is the activations. Its layers are split over the axis, the
    batch runs through them as ``microbatches`` microbatches, and everything else (embeddings,
    head, loss) runs on the whole batch as on one device. Combines with the other parts:
    ``px.combine(px.PipelineParallel(2), px.FSDP(4))``.

    Args:
        stages: devices on the axis; ``-1`` takes the devices left over.
        microbatches: how many microbatches go through the pipeline; ``None``: up to
            ``2·stages``, as the batch divides. The bubble, the share of the loop a stage idles,
            is ``(S-1)/(R·M+S-1)``.
        schedule: ``"gpipe"`` (each stage holds contiguous layers) or ``"circular"``
            (``repeats`` groups each, the microbatches going round ``repeats`` times).
        repeats: layer groups per stage (``1`` for GPipe, at least 2 for circular).
        axis: the mesh axis name.
        stacked: the stacked params' layer dims, by path (set when the state is planned).

    Example:
        >>> px.PipelineParallel(2).describe(), px.PipelineParallel(2).model_axes
        ('PipelineParallel(stage=2)', ('stage',))
    """

    stages: int = -1
    microbatches: int | None = None
    schedule: str = "gpipe"
    repeats: int = 1
    axis: str = "stage"
    stacked: Any = dataclasses.field(default=None, compare=False, repr=False)

    splits_batch = False
    gathers_params = False
    placement_priority = 0  # the layer dim first: the other parts split the dims left
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
        if self.microbatches is not None and (isinstance(self.microbatches, bool) or not isinstance(
                self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"PipelineParallel(microbatches={self.microbatches!r}): use a positive number, or None "
                             "to take up to 2·stages.")

    @property
    def size(self) -> int:
        return self.stages

    def with_size(self, size: int) -> "PipelineParallel":
        return dataclasses.replace(self, stages=size)

    @property
    def run_change(self) -> PipelineRun:
        return PipelineRun(self.axis, self.microbatches, self.repeats)

    def fit_to_computation(self, computation: Any) -> "PipelineParallel":
        """This part with the stacked params found in the traced loss."""
        scanned = computation.scanned_dims()
        if not scanned:
            raise ValueError(
                "PipelineParallel found no stack of blocks in the model: no param has a dim that a scan steps over. "
                "Stack the repeated blocks (linen nn.scan with variable_axes={'params': 0}, NNX nnx.vmap + nnx.scan, "
                "or a lax.scan over stacked weights).")
        return dataclasses.replace(self, stacked={path: dims[0] for path, dims in scanned.items()})

    def place(self, path, shape, dims, axis_sizes):
        dim = (self.stacked or {}).get(path)
        if dim is None:
            return dims
        stages = axis_sizes[self.axis]
        if shape[dim] % (stages * self.repeats):
            raise ValueError(f"The stack has {shape[dim]} layers ({path}), which {stages} stages × repeats="
                             f"{self.repeats} do not divide: use a number of stages (and repeats) whose product "
                             f"divides {shape[dim]}.")
        return [*dims[:dim], self.axis, *dims[dim + 1:]]

    def why_whole(self, path, shape, axis_sizes) -> str:
        return f"PipelineParallel({self.axis}) splits only the stacked blocks' layer dim"

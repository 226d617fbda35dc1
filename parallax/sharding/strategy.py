"""Strategies: where params live and how the batch is split, over named mesh axes.

A strategy is a frozen dataclass. ``DataParallel``, ``FSDP`` and ``TensorParallel`` each
own one mesh axis; :func:`combine` joins them into one strategy over a multi-axis mesh,
the way ``optax.chain`` joins transformations.

Example:
    >>> import parallax as px
    >>> strategy = px.combine(px.DataParallel(2), px.FSDP(-1))
    >>> tuple(strategy.batch_spec())  # the batch's leading dim over both axes
    (('data', 'fsdp'),)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from parallax.sharding import specs as spec_lib
from parallax.sharding.found import NOTHING, Found
from parallax.sharding.mesh import build_mesh, resolve_axis_sizes

__all__ = ["Combined", "Strategy", "combine"]

# What every single-axis part must declare (see Strategy): checked when its class is defined.
PART_DECLARATIONS = ("splits_batch", "gathers_params", "placement_priority", "place")


class Strategy:
    """Methods every strategy shares; subclasses are frozen dataclasses.

    A strategy is made of single-axis *parts* (``parts``; a part is its own only part). A
    part declares what it is, explicitly, so that nothing has to guess from its type:

    * ``axis: str`` and ``size: int`` — its mesh axis (``-1``: the devices left over);
    * ``splits_batch: bool`` — the batch's leading dim is split over its axis;
    * ``gathers_params: bool`` — params it splits are all-gathered where a layer uses
      them inside ``shard_map`` (their gradient is a reduce-scatter);
    * ``placement_priority: int`` and ``place(path, shape, dims, axis_sizes) -> dims`` —
      how it places a param (lower priorities place first);
    * optionally ``check_params(paths, axis_sizes)``, and ``find_in(computation)`` with
      ``uses_computation`` for what only the traced loss shows (see
      :class:`parallax.jaxpr.computation.Computation`): it returns the part's record of what it found
      (or ``None``), which the state's plan keeps beside the strategy (:mod:`parallax.sharding.found`) and
      hands back to the part's ``place``, ``place_last``, ``check_params``, ``why_whole`` and
      ``layout_report`` as ``found=``; the strategy itself holds only what its user said;
    * optionally ``run_change``: a description of how the part changes the way the model runs
      (a pipeline over the stack), which the step carries out on the traced loss
      (:mod:`parallax.step.run_changes`); parts that only place arrays have none.

    A part class that leaves one of the first four out is an error when it is defined.
    """

    uses_computation = False
    # Over several hosts, parts of lower rank are laid out inside a host first: what their axis
    # moves per step, most first (parallax.sharding.topology). A part may declare its own.
    link_rank = 50
    # Whether its axis's collectives carry the activations each layer waits for (tensor, context and
    # expert parallelism), on the step's critical path, rather than running beside the computation
    # (gradients reduced, params gathered, stages' activations sent): parallax.pricing.step_time.
    critical_path = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.parts is not Strategy.parts:
            return  # a composite (it overrides ``parts``): its parts declare themselves
        if "fit_to_computation" in vars(cls):
            raise TypeError(
                f"Strategy part {cls.__name__} defines fit_to_computation, which parallax no longer calls: return "
                "what the part finds from find_in(computation) instead (the state's plan keeps it and passes it "
                "back as found=; see parallax.sharding.found).")
        missing = [name for name in PART_DECLARATIONS if not hasattr(cls, name)]
        if missing:
            raise TypeError(
                f"Strategy part {cls.__name__} does not declare {missing}: a part says how it splits the "
                "batch, whether its params are gathered on use and how it places a param (see "
                "parallax.sharding.strategy.Strategy)."
            )

    @property
    def parts(self) -> tuple[Strategy, ...]:
        return (self,)

    def with_size(self, size: int) -> Strategy:
        """This part with ``size`` devices on its axis."""
        return dataclasses.replace(self, size=size)

    @property
    def run_changes(self) -> tuple[Any, ...]:
        """How the parts change the way the model runs (e.g. a pipeline's
        :class:`~parallax.parallel.pipeline.part.PipelineRun`), carried out by the step on the traced
        loss; empty for parts that only place arrays."""
        return tuple(part.run_change for part in self.parts if getattr(part, "run_change", None) is not None)

    def check_params(self, paths: Sequence[str], axis_sizes: Mapping[str, int], found: Any = None) -> None:
        """Raises ``ValueError`` for param paths this part cannot place (default: accepts all); ``found``: its
        record of what it found in the traced loss, where it has one."""

    def find_in(self, computation: Any) -> Any:
        """What this part places by that only the traced loss shows, as its record (default: ``None``, nothing)."""
        return None

    # --- mesh -------------------------------------------------------------------------
    def mesh_axes(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of each mesh axis, in mesh order (sizes may be ``-1``)."""
        return tuple((part.axis, part.size) for part in self.parts)

    def axis_sizes(self, mesh: Mesh | None = None) -> dict[str, int]:
        """Resolved axis sizes: from ``mesh`` if given, else over all devices."""
        if mesh is not None:
            self.check_mesh(mesh)
            return {name: int(mesh.shape[name]) for name, _ in self.mesh_axes()}
        return dict(resolve_axis_sizes(self.mesh_axes(), jax.device_count()))

    def make_mesh(self, devices: Sequence[jax.Device] | None = None, topology: Any = None) -> Mesh:
        """The device mesh of this strategy (Auto axes, topology-ordered devices).

        Over several hosts (processes), the axes that move the most bytes per step are laid out
        inside a host, whatever order the parts were combined in (:meth:`inside_first`); the
        axis order, names and specs stay the strategy's.

        Args:
            devices: the devices; all of ``jax.devices()`` by default.
            topology: a :class:`parallax.Topology` to lay the devices out over as if they were
                that many hosts; the processes by default.

        Example:
            >>> mesh = px.FSDP().make_mesh()
            >>> mesh.axis_names
            ('fsdp',)
        """
        return build_mesh(self.mesh_axes(), devices, self.inside_first(), topology)

    def host_crossing(self, mesh: Mesh, topology: Any = None) -> str | None:
        """A sentence for a mesh (a user's) whose tensor or FSDP axis spans hosts where this
        strategy's own layout would not (:func:`parallax.sharding.topology.host_crossing`)."""
        from parallax.sharding.topology import host_crossing

        return host_crossing(self, mesh, topology)

    def inside_first(self) -> tuple[str, ...]:
        """The axis names, the one to keep inside a host most first: by each part's
        ``link_rank`` (tensor, then FSDP, then data, then pipeline stages), then in mesh order.

        Example:
            >>> px.combine(px.DataParallel(2), px.FSDP(2), px.TensorParallel(2)).inside_first()
            ('tensor', 'fsdp', 'data')
        """
        ranked = sorted(enumerate(self.parts), key=lambda pair: (pair[1].link_rank, pair[0]))
        return tuple(part.axis for _, part in ranked)

    def resolved(self, mesh: Mesh) -> Strategy:
        """This strategy with each ``-1`` size replaced by the size ``mesh`` gives its axis
        (itself when every size is already the mesh's).

        Example:
            >>> px.combine(px.DataParallel(2), px.FSDP()).resolved(jax.make_mesh((2, 4), ("data", "fsdp"))).describe()
            'DataParallel(data=2) × FSDP(fsdp=4)'
        """
        sizes = self.axis_sizes(mesh)
        if all(part.size == sizes[part.axis] for part in self.parts):
            return self
        parts = tuple(part.with_size(sizes[part.axis]) for part in self.parts)
        return parts[0] if self.parts == (self,) else Combined(parts)

    def check_mesh(self, mesh: Mesh) -> None:
        """Raises ``ValueError`` when ``mesh`` lacks an axis, has a wrong size, or has an axis
        of more than one device that no part of the strategy uses.

        Any mesh whose axes match may be passed (``jax.make_mesh``'s, with Explicit, Auto or
        mixed axis types); axes of size 1 the strategy does not use are allowed (a model's own
        sharding may name them).
        """
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((8,), ('fsdp',))), got {mesh!r}.")
        for name, size in self.mesh_axes():
            if name not in mesh.shape:
                raise ValueError(
                    f"The mesh has axes {dict(mesh.shape)} but the strategy {self.describe()} needs axis "
                    f"{name!r}; build the mesh with strategy.make_mesh(), name a mesh axis {name!r}, or "
                    f"give the part your axis's name (e.g. FSDP(axis='my_axis'))."
                )
            if size != -1 and mesh.shape[name] != size:
                raise ValueError(
                    f"Mesh axis {name!r} has size {mesh.shape[name]} but the strategy asks "
                    f"for {size}; build the mesh with strategy.make_mesh(), or give the part size=-1 "
                    "to take the mesh's size."
                )
        used = {name for name, _ in self.mesh_axes()}
        unused = {name: int(mesh.shape[name]) for name in mesh.axis_names if name not in used and mesh.shape[name] > 1}
        if unused:
            name, size = next(iter(unused.items()))
            raise ValueError(
                f"Mesh axis {name!r} has {size} devices but no part of the strategy {self.describe()} uses it, so "
                f"they would all compute the same thing; add a part on it (e.g. px.combine(px.DataParallel(axis="
                f"{name!r}), ...)) or build the mesh without it."
            )

    # --- batch ------------------------------------------------------------------------
    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the batch's leading dim is split over (DP and FSDP axes)."""
        return tuple(part.axis for part in self.parts if part.splits_batch)

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """The axes whose params are gathered where they are used inside ``shard_map`` (FSDP axes)."""
        return tuple(part.axis for part in self.parts if part.gathers_params)

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The axes that do not split the batch (tensor axes): the model itself is split over them."""
        return tuple(part.axis for part in self.parts if not part.splits_batch)

    def batch_spec(self) -> PartitionSpec:
        """The ``PartitionSpec`` of a batch leaf: leading dim over every data-like axis."""
        axes = self.data_axes
        if not axes:
            return PartitionSpec()
        return PartitionSpec(axes if len(axes) > 1 else axes[0])

    def data_shards(self, mesh: Mesh | None = None) -> int:
        """How many pieces the batch's leading dim is split into."""
        sizes = self.axis_sizes(mesh)
        return math.prod(sizes[a] for a in self.data_axes)

    def check_batch_size(self, batch_size: int, mesh: Mesh | None = None, multiple: int = 1) -> None:
        """Raises ``ValueError`` unless ``batch_size`` splits evenly over the data axes."""
        shards = self.data_shards(mesh) * multiple
        if batch_size % shards:
            sizes = self.axis_sizes(mesh)
            what = " × ".join(f"{a}={sizes[a]}" for a in self.data_axes) or "1"
            if multiple > 1:
                what += f" × grad_accum={multiple}"
            lower = batch_size - batch_size % shards
            nearest = f"{lower} or {lower + shards}" if lower else f"{shards}"
            raise ValueError(
                f"Batch size {batch_size} is not divisible by {shards} ({what}); use a "
                f"multiple of {shards}, e.g. {nearest}."
            )

    # --- params and state --------------------------------------------------------------
    def param_specs(self, abstract_params: Any, mesh: Mesh | None = None, found: Found = NOTHING) -> Any:
        """A ``PartitionSpec`` for every param (boxes of ``nn.with_partitioning`` are read), each part given its
        record of ``found`` (what planning found in the traced loss: a :class:`~parallax.StatePlan`'s)."""
        sizes = self.axis_sizes(mesh)
        self._check_params(abstract_params, sizes, found)
        return spec_lib.param_specs(abstract_params, self.parts, sizes, found)

    def state_specs(self, abstract_state: Any, mesh: Mesh | None = None, found: Found = NOTHING) -> Any:
        """A ``PartitionSpec`` tree matching a train state.

        Params follow the strategy; optimizer leaves shaped like a param (Adam moments)
        follow that param; step, counts, rng and other collections are replicated.

        Example:
            >>> specs = px.FSDP(min_weight_size=0).state_specs(jax.eval_shape(make_state))
            >>> [tuple(s) for s in (specs.params["Dense_1"]["kernel"], specs.opt_state[0].mu["Dense_1"]["kernel"],
            ...                     specs.step)]
            [('fsdp',), ('fsdp',), ()]
        """
        sizes = self.axis_sizes(mesh)
        self._check_params(spec_lib.params_of(abstract_state), sizes, found)
        return spec_lib.state_specs(abstract_state, self.parts, sizes, found)

    def _check_params(self, abstract_params: Any, sizes: Mapping[str, int], found: Found) -> None:
        paths = [
            spec_lib.path_str(key_path)
            for key_path, _ in jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=spec_lib.is_box)[0]
        ]
        for part in self.parts:
            part.check_params(paths, sizes, **found.given(part))

    # --- what only the computation shows --------------------------------------------------
    @property
    def needs_computation(self) -> bool:
        """Whether a part wants the traced loss (a deriving ``TensorParallel``; ``FSDP`` for scans)."""
        return any(part.uses_computation for part in self.parts)

    def found_in(self, computation: Any) -> Found:
        """What every part finds in the traced loss (:meth:`find_in`), by axis; the strategy is left as it is."""
        records = {part.axis: part.find_in(computation) for part in self.parts}
        return Found({axis: record for axis, record in records.items() if record is not None})

    def layout_report(self, found: Any = None) -> str | None:
        """What this part's placement derived from the computation (``found``: its record), if it derives
        anything."""
        return None

    def describe_layout(self, found: Found = NOTHING) -> str:
        """The layout reports of the parts that derive one (a ``TensorParallel``'s split params), from what
        planning ``found`` (:attr:`parallax.StatePlan.found`; ``plan.describe_layout()`` passes its own).

        Example:
            >>> px.combine(px.DataParallel(2), px.FSDP(4)).describe_layout()
            'DataParallel(data=2) × FSDP(fsdp=4): no part derives a layout (no tensor-parallel axis).'
        """
        reports = [report for part in self.parts if (report := part.layout_report(**found.given(part))) is not None]
        return ("\n".join(reports) if reports
                else f"{self.describe()}: no part derives a layout (no tensor-parallel axis).")

    described_options = ""  # what a part's one-line summary adds after its axis's size (", method='ring'")

    def describe(self, mesh: Mesh | None = None) -> str:
        """A one-line summary, e.g. ``"DataParallel(data=2) × FSDP(fsdp=-1)"``; with a mesh, the
        sizes it gives each axis (``"DataParallel(data=2) × FSDP(fsdp=4)"``)."""
        sizes = self.axis_sizes(mesh) if mesh is not None else {p.axis: p.size for p in self.parts}
        return " × ".join(f"{type(p).__name__}({p.axis}={sizes[p.axis]}{p.described_options})" for p in self.parts)


@dataclasses.dataclass(frozen=True)
class Combined(Strategy):
    """Several single-axis strategies over one multi-axis mesh; build with :func:`combine`."""

    members: tuple = ()

    @property
    def parts(self) -> tuple[Strategy, ...]:
        return self.members


def combine(*strategies: Strategy) -> Combined:
    """One strategy over a multi-axis mesh, axes in the order given.

    Example:
        >>> strategy = px.combine(px.DataParallel(2), px.FSDP(2), px.TensorParallel(2))
        >>> dict(strategy.make_mesh().shape)
        {'data': 2, 'fsdp': 2, 'tensor': 2}
    """
    parts: list[Strategy] = []
    for strategy in strategies:
        if not isinstance(strategy, Strategy):
            raise ValueError(f"combine() takes parallax strategies, got {strategy!r}.")
        parts.extend(strategy.parts)
    if not parts:
        raise ValueError("combine() needs at least one strategy, e.g. combine(DataParallel(2), FSDP(4)).")
    kinds = [type(p).__name__ for p in parts]
    repeated = sorted({k for k in kinds if kinds.count(k) > 1})
    if repeated:
        raise ValueError(f"combine() got more than one {repeated[0]} ({kinds}); use each kind once.")
    names = [p.axis for p in parts]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ValueError(
            f"combine() got the axis name {clash[0]!r} twice ({names}); give each strategy "
            "its own axis name."
        )
    return Combined(tuple(parts))

"""Strategies: where params live and how the batch is split, over named mesh axes.

A strategy is a frozen dataclass. ``DataParallel``, ``FSDP`` and ``TensorParallel`` each
own one mesh axis; :func:`combine` joins them into one strategy over a multi-axis mesh,
the way ``optax.chain`` joins transformations.

Example:
    >>> import parallax as px
    >>> strategy = px.combine(px.DataParallel(2), px.FSDP(-1))
    >>> strategy.batch_spec()
    PartitionSpec(('data', 'fsdp'),)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
from flax.core import meta
from jax.sharding import Mesh, PartitionSpec

from parallax import rules as tp_rules
from parallax import specs as spec_lib
from parallax.gather import GatherOnUse, gather_dim
from parallax.mesh import build_mesh, resolve_axis_sizes

__all__ = ["Strategy", "DataParallel", "FSDP", "TensorParallel", "Combined", "combine"]


def _check_axis(kind: str, size: Any, axis: Any) -> None:
    if not isinstance(axis, str) or not axis:
        raise ValueError(f"{kind}(axis={axis!r}): the axis name must be a non-empty string.")
    if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
        raise ValueError(
            f"{kind}(size={size!r}): use a positive number of devices, or -1 for the "
            "devices left over."
        )


class Strategy:
    """Methods every strategy shares; subclasses are frozen dataclasses.

    Subclasses provide ``parts`` (the single-axis strategies they are made of).
    """

    @property
    def parts(self) -> tuple["Strategy", ...]:
        return (self,)

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

    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The device mesh of this strategy (Auto axes, topology-ordered devices).

        Example:
            >>> mesh = px.FSDP().make_mesh()
            >>> mesh.axis_names
            ('fsdp',)
        """
        return build_mesh(self.mesh_axes(), devices)

    def check_mesh(self, mesh: Mesh) -> None:
        """Raises ``ValueError`` when ``mesh`` lacks an axis or has a wrong size."""
        for name, size in self.mesh_axes():
            if name not in mesh.shape:
                raise ValueError(
                    f"The mesh has axes {tuple(mesh.axis_names)} but the strategy needs axis "
                    f"{name!r}; build the mesh with strategy.make_mesh()."
                )
            if size != -1 and mesh.shape[name] != size:
                raise ValueError(
                    f"Mesh axis {name!r} has size {mesh.shape[name]} but the strategy asks "
                    f"for {size}; build the mesh with strategy.make_mesh()."
                )

    # --- batch ------------------------------------------------------------------------
    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the batch's leading dim is split over (DP and FSDP axes)."""
        return tuple(part.axis for part in self.parts if part.splits_batch)

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """The axes whose params are gathered inside ``shard_map`` (FSDP axes)."""
        return tuple(part.axis for part in self.parts if isinstance(part, FSDP))

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
    def param_specs(self, abstract_params: Any, mesh: Mesh | None = None) -> Any:
        """A ``PartitionSpec`` for every param (boxes of ``nn.with_partitioning`` are read)."""
        sizes = self.axis_sizes(mesh)
        self._check_params(abstract_params, sizes)
        return spec_lib.param_specs(abstract_params, self.parts, sizes)

    def state_specs(self, abstract_state: Any, mesh: Mesh | None = None) -> Any:
        """A ``PartitionSpec`` tree matching a train state.

        Params follow the strategy; optimizer leaves shaped like a param (Adam moments)
        follow that param; step, counts, rng and other collections are replicated.

        Example:
            >>> specs = px.FSDP(min_weight_size=0).state_specs(jax.eval_shape(make_state))
        """
        sizes = self.axis_sizes(mesh)
        self._check_params(spec_lib.params_of(abstract_state), sizes)
        return spec_lib.state_specs(abstract_state, self.parts, sizes)

    def _check_params(self, abstract_params: Any, sizes: Mapping[str, int]) -> None:
        paths = [
            spec_lib.path_str(key_path)
            for key_path, _ in jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=spec_lib.is_box)[0]
        ]
        for part in self.parts:
            check = getattr(part, "check_params", None)
            if check is not None:
                check(paths, sizes)

    # --- derived layouts ----------------------------------------------------------------
    @property
    def needs_layout(self) -> bool:
        """Whether a part (a ``TensorParallel`` that derives) still needs the computation."""
        return any(part.needs_layout for part in self.parts if part is not self)

    def with_part(self, old: "Strategy", new: "Strategy") -> "Strategy":
        """This strategy with the part ``old`` replaced by ``new``."""
        if self.parts == (self,):
            return new if self is old else self
        return Combined(tuple(new if part is old else part for part in self.parts))

    # --- shard_map -------------------------------------------------------------------
    def wrap(self, module: nn.Module, mesh: Mesh | None = None) -> nn.Module:
        """The same module, wrapped with ``nn.map_variables`` to run inside ``shard_map``.

        Inside ``shard_map`` (with the FSDP axes manual) the wrapped module takes params
        as ``nn.Partitioned`` boxes of local shards, as the notebook recipe keeps them:
        on read, each shard split over an FSDP axis is all-gathered where the layer
        uses it (gradient: reduce-scatter / N); on write (``init``), a full param is cut
        to this device's shard and boxed with its spec's names. Param paths are
        unchanged.

        Example:
            >>> wrapped = strategy.wrap(model)
            >>> # inside jax.shard_map(..., axis_names=set(strategy.data_axes)):
            >>> variables = wrapped.init(rng, x)   # params: nn.Partitioned local shards
            >>> y = wrapped.apply(variables, x)    # same y as model.apply on full params
        """
        fsdp_axes = set(self.fsdp_axes)
        sizes = self.axis_sizes(mesh)

        def gather_in(params):
            def to_gather(leaf):
                if isinstance(leaf, meta.Partitioned):
                    found = gather_dim(PartitionSpec(*leaf.names), fsdp_axes)
                    if found is not None:
                        return GatherOnUse(leaf.value, found[0], found[1])
                    return leaf.value
                return leaf

            return jax.tree.map(to_gather, params, is_leaf=spec_lib.is_box)

        def shard_out(params):
            def to_shard(key_path, leaf):
                if isinstance(leaf, GatherOnUse):
                    names = [None] * leaf.value.ndim
                    names[leaf.dim] = leaf.axis_name
                    return nn.Partitioned(leaf.value, tuple(names))
                if spec_lib.is_box(leaf) and not isinstance(leaf, meta.Partitioned):
                    return leaf
                value = leaf.value if isinstance(leaf, meta.Partitioned) else leaf
                spec = spec_lib.place_param(spec_lib.path_str(key_path), value.shape, self.parts, sizes, box=leaf)
                names = list(spec) + [None] * (value.ndim - len(spec))
                found = gather_dim(spec, fsdp_axes)
                if found is not None:
                    dim, axis = found
                    chunk = value.shape[dim] // sizes[axis]
                    start = jax.lax.axis_index(axis) * chunk
                    value = jax.lax.dynamic_slice_in_dim(value, start, chunk, axis=dim)
                return nn.Partitioned(value, tuple(names))

            return jax.tree_util.tree_map_with_path(to_shard, params, is_leaf=spec_lib.is_box)

        wrapped_cls = nn.map_variables(
            type(module), "params", trans_in_fn=gather_in, trans_out_fn=shard_out, init=True, mutable=True
        )
        fields = {
            f.name: getattr(module, f.name)
            for f in dataclasses.fields(module)
            if f.init and f.name not in ("parent", "name")
        }
        return wrapped_cls(**fields)

    def describe(self) -> str:
        """A one-line summary, e.g. ``"DataParallel(data=2) × FSDP(fsdp=-1)"``."""
        return " × ".join(f"{type(p).__name__}({p.axis}={p.size})" for p in self.parts)


@dataclasses.dataclass(frozen=True)
class DataParallel(Strategy):
    """Params replicated, batch split over ``axis``, gradients averaged.

    Args:
        size: devices on the axis; ``-1`` takes the devices left over.
        axis: the mesh axis name.

    Example:
        >>> trainer = px.Trainer(model, optax.adam(1e-3), loss_fn, strategy=px.DataParallel())
    """

    size: int = -1
    axis: str = "data"

    splits_batch = True
    placement_priority = 30

    def __post_init__(self):
        _check_axis("DataParallel", self.size, self.axis)

    def place(self, path, shape, dims, axis_sizes):
        return dims


@dataclasses.dataclass(frozen=True)
class FSDP(Strategy):
    """Fully sharded data parallel (ZeRO-3): params, grads and optimizer state split.

    Every param with more than ``min_weight_size`` elements is split along its largest
    dim that the axis size divides (and that no other axis or annotation already
    uses); smaller or indivisible params stay replicated. The batch is split over the
    same axis.

    Args:
        size: devices on the axis; ``-1`` takes the devices left over.
        axis: the mesh axis name.
        min_weight_size: params with at most this many elements stay replicated.
        scanned: param dims a ``scan`` steps over, by path (set when the state is planned;
            not part of the strategy's identity).

    Example:
        >>> strategy = px.FSDP(min_weight_size=2**14)
    """

    size: int = -1
    axis: str = "fsdp"
    min_weight_size: int = 2**18
    scanned: Any = dataclasses.field(default=None, compare=False, repr=False)

    splits_batch = True
    placement_priority = 20

    def __post_init__(self):
        _check_axis("FSDP", self.size, self.axis)
        if isinstance(self.min_weight_size, bool) or not isinstance(self.min_weight_size, int) or self.min_weight_size < 0:
            raise ValueError(
                f"FSDP(min_weight_size={self.min_weight_size!r}): use an integer >= 0 "
                "(0 splits every param whose dims allow it)."
            )

    def skipping_scanned(self, scanned: Mapping[str, tuple[int, ...]]) -> "FSDP":
        """This strategy, told which param dims a ``scan`` steps over (never split those).

        Set when the state is planned (the loss is traced): splitting the stacked layer dim
        of ``nn.scan``'s params would gather the whole stack on every device each step.
        """
        return dataclasses.replace(self, scanned=dict(scanned))

    def place(self, path, shape, dims, axis_sizes):
        size = axis_sizes[self.axis]
        if size == 1 or self.axis in spec_lib.dims_axes(dims) or math.prod(shape) <= self.min_weight_size:
            return dims
        skip = (self.scanned or {}).get(path, ())
        for dim in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
            if dims[dim] is None and shape[dim] % size == 0 and dim not in skip:
                dims[dim] = self.axis
                break
        return dims


@dataclasses.dataclass(frozen=True)
class TensorParallel(Strategy):
    """Megatron tensor parallelism, with the layout read from the model's computation.

    With no rules, the layout is derived when the state is planned (``init_state``,
    ``plan_state``, ``Trainer``): the loss is traced once and each param's dims are
    followed through the matmuls and convolutions (see :mod:`parallax.tp_layout`). A
    hidden dim produced by one weight and consumed by the next is split (the first
    column-wise, the second row-wise), attention by heads, embeddings by vocabulary,
    whatever the layers are called and however their kernels are stored. Name rules,
    when given, place the params they match; the rest is still derived (unless
    ``derive=False``). The batch is replicated over ``axis``; the compiler (GSPMD)
    inserts the activation collectives, so any layout trains exactly like one device:
    the derivation is about speed.

    Args:
        size: devices on the axis; ``-1`` takes the devices left over.
        axis: the mesh axis name.
        rules: ``(regex, layout)`` pairs searched in param paths, first match wins (see
            :mod:`parallax.rules`). A rule you pass that matches no param is an error.
        derive: derive the layout of params no rule matches from the computation. With
            ``derive=False`` and no rules, :data:`parallax.rules.DEFAULT_RULES` (common
            layer names) are used instead.
        min_split_fraction: a derived layout that splits less than this fraction of the
            param elements is an error naming the reason (heads not divisible by the
            axis size, no matmul chain); ``0`` allows any layout.
        layout: the derived :class:`parallax.tp_layout.TensorLayout` (set by
            :meth:`with_layout` when the state is planned; not part of the strategy's identity).

    Example:
        >>> tp = px.TensorParallel(2)                       # layout from the computation
        >>> tp = px.TensorParallel(2, rules=[(r"attn/(q|k|v)/kernel$", "column"),
        ...                                   (r"attn/o/kernel$", "row")])
    """

    size: int = -1
    axis: str = "tensor"
    rules: tuple | None = None
    derive: bool = True
    min_split_fraction: float = 0.1
    layout: Any = dataclasses.field(default=None, compare=False, repr=False)

    splits_batch = False
    placement_priority = 10

    def __post_init__(self):
        _check_axis("TensorParallel", self.size, self.axis)
        if self.rules is not None:
            object.__setattr__(self, "rules", tp_rules.validate_rules(self.rules))
        if not isinstance(self.derive, bool):
            raise ValueError(f"TensorParallel(derive={self.derive!r}): use True or False.")
        fraction = self.min_split_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(
                f"TensorParallel(min_split_fraction={fraction!r}): use a number in [0, 1] (0 allows "
                "any derived layout)."
            )

    @property
    def active_rules(self) -> tuple:
        """The name rules in force: the user's, or the defaults when nothing is derived."""
        if self.rules is not None:
            return self.rules
        return () if self.derive else tp_rules.DEFAULT_RULES

    @property
    def needs_layout(self) -> bool:
        """Whether this part still needs a layout derived from the computation."""
        return self.derive and self.layout is None

    def with_layout(self, layout: Any) -> "TensorParallel":
        """This strategy with a derived layout in place.

        Raises:
            ValueError: the layout splits less than ``min_split_fraction`` of the param
                elements; the message lists why the largest params were not split.
        """
        if layout.split_fraction < self.min_split_fraction:
            reasons = "\n  ".join(layout.unsplit_reasons())
            raise ValueError(
                f"TensorParallel({self.axis}={layout.axis_size}) found a layout for only "
                f"{100 * layout.split_fraction:.1f}% of the param elements (min_split_fraction="
                f"{self.min_split_fraction}). The largest params it leaves whole:\n  {reasons}\n"
                "Use an axis size that divides those dims, name layouts with rules=[(regex, 'column'|"
                "'row'|...)], or allow it with TensorParallel(min_split_fraction=0)."
            )
        return dataclasses.replace(self, layout=layout)

    def describe_layout(self) -> str:
        """Which params the derived layout splits, along which dim, and why the rest are not.

        Example:
            >>> plan = px.plan_state(model, optax.sgd(0.1), batch, strategy=px.TensorParallel(2))
            >>> print(plan.strategy.parts[0].describe_layout())  # doctest: +SKIP
        """
        if self.layout is None:
            if not self.derive:
                return f"TensorParallel({self.axis}): placed by name rules only (derive=False)."
            return (f"TensorParallel({self.axis}): no layout derived yet; plan the state with "
                    "px.plan_state(...) and read plan.strategy, or call plan.describe_layout().")
        return self.layout.describe()

    def check_params(self, paths: Sequence[str], axis_sizes: Mapping[str, int]) -> None:
        """Raises ``ValueError`` for a rule that matches no param, or an unknown axis."""
        for pattern, layout in self.active_rules:
            if isinstance(layout, PartitionSpec):
                unknown = spec_lib.dims_axes(list(layout)) - set(axis_sizes)
                if unknown:
                    raise ValueError(
                        f"Tensor-parallel rule {pattern!r} names axis {sorted(unknown)} but the "
                        f"mesh has axes {sorted(axis_sizes)}; use one of those names."
                    )
        self._require_layout()
        matched = {tp_rules.match_rule(path, self.active_rules) for path in paths} - {None}
        matched_indices = {index for index, _ in matched}
        sample = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
        if self.rules is None:
            if not self.derive and not matched_indices:
                raise ValueError(
                    "TensorParallel's default rules match none of the model's params "
                    f"({sample}); pass rules=[(regex, 'column'|'row'|...), ...] naming your layers, "
                    "or let it derive the layout from the computation (derive=True, the default)."
                )
            return
        for index, (pattern, _) in enumerate(self.rules):
            if index not in matched_indices:
                raise ValueError(
                    f"Tensor-parallel rule {pattern!r} matches no param (or an earlier rule "
                    f"takes all its matches). The param paths are: {sample}."
                )

    def _require_layout(self) -> None:
        if self.needs_layout:
            raise ValueError(
                f"TensorParallel({self.axis}) derives its layout from the model's computation, which "
                "param shapes alone do not show. Plan the state with px.plan_state(model, optimizer, "
                "batch, strategy=...) and use plan.specs (init_state and Trainer do this), or place "
                "params by names only with TensorParallel(rules=..., derive=False)."
            )

    def rule_dims(self, path, shape, dims, axis_sizes):
        """``dims`` with the first matching name rule applied; ``None`` if no rule matches."""
        match = tp_rules.match_rule(path, self.active_rules)
        if match is None:
            return None
        layout = match[1]
        if isinstance(layout, PartitionSpec):
            for dim, entry in enumerate(list(layout)[: len(shape)]):
                if entry is not None and dims[dim] is None and shape[dim] % spec_lib.entry_size(entry, axis_sizes) == 0:
                    dims[dim] = entry
            return dims
        size = axis_sizes[self.axis]
        for dim in tp_rules.layout_dims(layout, path, shape, size):
            if dims[dim] is None and shape[dim] % size == 0:
                dims[dim] = self.axis
                break
        return dims

    def place(self, path, shape, dims, axis_sizes):
        self._require_layout()
        if self.axis in spec_lib.dims_axes(dims):
            return dims  # the model's own annotation already places this axis
        ruled = self.rule_dims(path, shape, list(dims), axis_sizes)
        if ruled is not None:
            return ruled
        if self.layout is not None:
            dim = self.layout.dim_of(path)
            if dim is not None and dim < len(shape) and dims[dim] is None and shape[dim] % axis_sizes[self.axis] == 0:
                dims[dim] = self.axis
        return dims


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
        >>> strategy.make_mesh().shape
        OrderedDict([('data', 2), ('fsdp', 2), ('tensor', 2)])
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

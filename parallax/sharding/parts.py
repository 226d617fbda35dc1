"""The single-axis strategy parts: ``DataParallel``, ``FSDP`` and ``TensorParallel``.

Each is a frozen dataclass that declares what it is through the part protocol of
:class:`parallax.sharding.strategy.Strategy` (its axis, whether it splits the batch, whether
its params are gathered where a layer uses them, how it places a param).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from parallax.sharding import rules as tp_rules
from parallax.sharding import specs as spec_lib
from parallax.sharding.strategy import Strategy

__all__ = ["FSDP", "DataParallel", "TensorParallel"]


def check_axis(kind: str, size: Any, axis: Any) -> None:
    if not isinstance(axis, str) or not axis:
        raise ValueError(f"{kind}(axis={axis!r}): the axis name must be a non-empty string.")
    if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
        raise ValueError(f"{kind}(size={size!r}): use a positive number of devices, or -1 for the devices left over.")


def check_module_class(kind: str, option: str, value: Any, what: str, example: str) -> None:
    """Raises ``ValueError`` unless ``value`` (a part's ``option``, naming a class of the model's modules) is
    ``None``, a non-empty class name or a class.

    Example:
        >>> check_module_class("PipelineParallel", "blocks", "", "the blocks'", "FlaxGPT2Block")
        Traceback (most recent call last):
        ...
        ValueError: PipelineParallel(blocks=''): name the blocks' module class, or give the class itself (e.g. blocks='FlaxGPT2Block').
    """  # noqa: E501 (a doctest's output)
    if value is not None and not ((isinstance(value, str) and value) or isinstance(value, type)):
        raise ValueError(f"{kind}({option}={value!r}): name {what} module class, or give the class itself "
                         f"(e.g. {option}={example!r}).")


@dataclasses.dataclass(frozen=True)
class DataParallel(Strategy):
    """Params replicated, batch split over ``axis``, gradients averaged.

    Args:
        size: devices on the axis; ``-1`` takes the devices left over.
        axis: the mesh axis name.

    Example:
        >>> tuple(px.DataParallel().batch_spec()), px.DataParallel().fsdp_axes
        (('data',), ())
    """

    size: int = -1
    axis: str = "data"

    splits_batch = True
    gathers_params = False
    placement_priority = 30
    link_rank = 30  # one all-reduce of the gradients per step: across hosts first

    def __post_init__(self):
        check_axis("DataParallel", self.size, self.axis)

    def place(self, path, shape, dims, axis_sizes):
        return dims

    def why_whole(self, path, shape, axis_sizes) -> str:
        """Why this part leaves a param whole (a line for ``px.summarize``'s lint)."""
        return f"DataParallel({self.axis}) replicates params"


FSDP_SPLITS = ("largest", "output", "input", "auto")


@dataclasses.dataclass(frozen=True)
class FSDP(Strategy):
    """Fully sharded data parallel (ZeRO-3): params, grads and optimizer state split.

    Every param with more than ``min_weight_size`` elements is split along one dim that
    the axis size divides (and that no other axis or annotation already uses): the dim
    ``split`` prefers, else the largest such dim. Smaller or indivisible params stay
    replicated. The batch is split over the same axis.

    Args:
        size: devices on the axis; ``-1`` takes the devices left over.
        axis: the mesh axis name.
        min_weight_size: params with at most this many elements stay replicated.
        split: the dim to prefer: ``"auto"`` (default: the cost model's pick, each split priced on the
            compile paths it is fast on, the search bounded by what the run's steps could win back,
            :mod:`parallax.state.search`; ``"largest"`` without a loss), ``"largest"``, ``"output"`` (a
            kernel's output features: the compiler may move activations instead of weights) or ``"input"``.

    Example:
        >>> strategy = px.FSDP(min_weight_size=2**14)
        >>> strategy.fsdp_axes, strategy.data_axes
        (('fsdp',), ('fsdp',))
    """

    size: int = -1
    axis: str = "fsdp"
    min_weight_size: int = 2**18
    split: str = "auto"

    splits_batch = True
    gathers_params = True
    placement_priority = 20
    link_rank = 20  # params gathered forward and backward, gradients reduce-scattered
    uses_computation = True  # to learn which param dims a scan steps over

    def __post_init__(self):
        check_axis("FSDP", self.size, self.axis)
        if (isinstance(self.min_weight_size, bool) or not isinstance(self.min_weight_size, int)
                or self.min_weight_size < 0):
            raise ValueError(
                f"FSDP(min_weight_size={self.min_weight_size!r}): use an integer >= 0 "
                "(0 splits every param whose dims allow it)."
            )
        if self.split not in FSDP_SPLITS:
            raise ValueError(f"FSDP(split={self.split!r}): use 'largest', 'output' (last dim), 'input' or 'auto'.")

    def find_in(self, computation: Any) -> dict[str, tuple[int, ...]] | None:
        """The param dims a ``scan`` steps over, by path (never split: splitting the stacked layer dim of
        ``nn.scan``'s params would gather the whole stack on every device each step); ``None`` where none is."""
        scanned = computation.scanned_dims()
        return dict(scanned) if scanned else None

    def dim_order(self, shape: Sequence[int]) -> list[int]:
        """The dims of a param in the order this strategy tries to split them (``[2, 3, 0, 1]``
        for a (3, 3, 64, 128) conv kernel and ``split="input"``)."""
        largest = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
        if self.split in ("largest", "auto") or not shape:  # "auto" not resolved (no loss to price): largest
            return largest
        first = len(shape) - 1 if self.split == "output" else max(len(shape) - 2, 0)
        return [first] + [d for d in largest if d != first]

    def _split(self, path, shape, dims, axis_sizes, scanned) -> tuple[int | None, str]:
        """The dim to split (``None``: none), and why none is: one decision for ``place`` and ``why_whole``."""
        size, skip = axis_sizes[self.axis], (scanned or {}).get(path, ())
        if size == 1 or self.axis in spec_lib.dims_axes(dims):
            return None, f"FSDP axis {self.axis!r} has size 1" if size == 1 else "annotated on this axis already"
        if math.prod(shape) <= self.min_weight_size:
            return None, (f"{math.prod(shape)} elements, at most FSDP min_weight_size={self.min_weight_size} "
                          "(lower it to split smaller params)")
        dim = next((d for d in self.dim_order(shape) if dims[d] is None and shape[d] % size == 0 and d not in skip),
                   None)
        if dim is None and not any(shape[d] % size == 0 and d not in skip for d in range(len(shape))):
            scanned = f" (dim {', '.join(map(str, skip))} is a scanned layer dim)" if skip else ""
            return None, f"no dim of {tuple(shape)} is divisible by {self.axis}={size}{scanned}"
        return dim, f"its divisible dims are taken by other axes ({self.axis}={size})"

    def why_whole(self, path, shape, axis_sizes, found: Mapping[str, tuple[int, ...]] | None = None) -> str:
        return self._split(path, shape, [None] * len(shape), axis_sizes, found)[1]

    def place(self, path, shape, dims, axis_sizes, found: Mapping[str, tuple[int, ...]] | None = None):
        """``dims`` with this axis on the param's dim to split, never one of the dims a ``scan`` steps over
        (``found``: :meth:`find_in`'s)."""
        dim = self._split(path, shape, dims, axis_sizes, found)[0]
        return dims if dim is None else [*dims[:dim], self.axis, *dims[dim + 1:]]


@dataclasses.dataclass(frozen=True)
class TensorParallel(Strategy):
    """Megatron tensor parallelism, with the layout read from the model's computation.

    With no rules, the layout is derived when the state is planned (``init_state``,
    ``plan_state``, ``Trainer``): the loss is traced once and each param's dims are
    followed through the matmuls and convolutions (see :mod:`parallax.jaxpr.tp_layout`). A
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
            :mod:`parallax.sharding.rules`). A rule you pass that matches no param is an error.
        derive: derive the layout of params no rule matches from the computation. With
            ``derive=False`` and no rules, :data:`parallax.sharding.rules.DEFAULT_RULES` (common
            layer names) are used instead.
        min_split_fraction: a derived layout that splits less than this fraction of the
            param elements is an error naming the reason (heads not divisible by the
            axis size, no matmul chain); ``0`` allows any layout.

    Example:
        >>> tp = px.TensorParallel(2)                       # layout from the computation
        >>> tp = px.TensorParallel(2, rules=[(r"attn/(q|k|v)/kernel$", "column"),
        ...                                   (r"attn/o/kernel$", "row")])
        >>> tp.model_axes, tuple(tp.batch_spec())  # the batch is whole on every tensor shard
        (('tensor',), ())
    """

    size: int = -1
    axis: str = "tensor"
    rules: tuple | None = None
    derive: bool = True
    min_split_fraction: float = 0.1

    splits_batch = False
    gathers_params = False
    placement_priority = 10
    link_rank, critical_path = 10, True  # activations every layer waits for: inside a host first

    def __post_init__(self):
        check_axis("TensorParallel", self.size, self.axis)
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
    def uses_computation(self) -> bool:
        return self.derive

    def find_in(self, computation: Any) -> Any:
        """The layout derived from the traced loss (a :class:`parallax.jaxpr.tp_layout.TensorLayout`: params its
        rules or the model's annotations place are fixed, the rest derived); ``None`` with ``derive=False``."""
        if not self.derive:
            return None
        sizes = computation.axis_sizes
        fixed = {}
        for path, shape, box in zip(computation.param_paths, computation.param_shapes, computation.param_boxes):
            annotated = spec_lib.annotation_dims(box, shape, sizes)
            dim = next((d for d, entry in enumerate(annotated) if self.axis in spec_lib.dims_axes([entry])), None)
            if dim is not None:
                fixed[path] = (dim, "annotation")
                continue
            ruled = self.rule_dims(path, shape, [None] * len(shape), sizes)
            if ruled is not None:
                fixed[path] = (next((d for d, entry in enumerate(ruled) if entry == self.axis), None), "rule")
        return self.checked_layout(computation.derive_layout(self.axis, fixed))

    def checked_layout(self, layout: Any) -> Any:
        """``layout`` (derived from the computation), where it splits enough of the params.

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
        return layout

    def layout_report(self, found: Any = None) -> str:
        """Which params the derived layout (``found``: :meth:`find_in`'s) splits, along which dim, and why the rest
        are not.

        Example:
            >>> plan = px.plan_state(model, optax.sgd(0.1), batch, strategy=px.TensorParallel(2),
            ...                      loss_fn=loss_fn, mesh=px.TensorParallel(2).make_mesh(jax.devices()[:2]))
            >>> print(plan.strategy.layout_report(plan.found["tensor"]).splitlines()[0])  # rows: plan.describe_layout()
            tensor-parallel layout over 'tensor' (size 2): 5 of 6 params split, 98.9% of param elements
        """
        if found is None:
            if not self.derive:
                return f"TensorParallel({self.axis}): placed by name rules only (derive=False)."
            return (f"TensorParallel({self.axis}): no layout derived yet; plan the state with "
                    "px.plan_state(...) and call plan.describe_layout() (the layout: plan.found).")
        return found.describe()

    def check_params(self, paths: Sequence[str], axis_sizes: Mapping[str, int], found: Any = None) -> None:
        """Raises ``ValueError`` for a rule that matches no param, or an unknown axis."""
        for pattern, layout in self.active_rules:
            if isinstance(layout, PartitionSpec):
                unknown = spec_lib.dims_axes(list(layout)) - set(axis_sizes)
                if unknown:
                    raise ValueError(
                        f"Tensor-parallel rule {pattern!r} names axis {sorted(unknown)} but the "
                        f"mesh has axes {sorted(axis_sizes)}; use one of those names."
                    )
        self._require_layout(found)
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

    def _require_layout(self, found: Any) -> None:
        if self.derive and found is None:
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

    def why_whole(self, path, shape, axis_sizes, found: Any = None) -> str:
        entry = next((p for p in found.params if p.path == path), None) if found is not None else None
        if entry is not None:
            return f"TensorParallel({self.axis}): {entry.reason}"
        return f"TensorParallel({self.axis}): no rule matches it and no layout was derived for it"

    def place(self, path, shape, dims, axis_sizes, found: Any = None):
        """``dims`` with this axis where a rule, the model's annotation or the derived layout (``found``:
        :meth:`find_in`'s) puts it."""
        self._require_layout(found)
        if self.axis in spec_lib.dims_axes(dims):
            return dims  # the model's own annotation already places this axis
        ruled = self.rule_dims(path, shape, list(dims), axis_sizes)
        if ruled is not None:
            return ruled
        if found is not None:
            dim = found.dim_of(path)
            if dim is not None and dim < len(shape) and dims[dim] is None and shape[dim] % axis_sizes[self.axis] == 0:
                dims[dim] = self.axis
        return dims

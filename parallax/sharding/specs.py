"""Spec trees: a ``PartitionSpec`` for every leaf of a train state, derived from shapes.

Everything here is a pure function of abstract shapes, param paths and the strategy's
*placers* (the parts of a strategy that decide where a param lives). Nothing compiles and
nothing touches a device, so the functions are tested against constant tables.

A placer is any object with

* ``placement_priority: int`` — lower places first (tensor rules before FSDP), and
* ``place(path, shape, dims, axis_sizes) -> dims`` — returns the per-dim mesh axes of a
  param, given what earlier placers (and the model's own annotations) already chose; and
  optionally ``place_last(...)``, the same, called once every placer has placed (for an axis
  that can go on any dim and should take what the others leave: a pipeline's stage axis on
  listed blocks).

A placer that found something in the traced loss (:mod:`parallax.sharding.found`) takes its record as
``found=``; a placer that finds nothing is called without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from flax.core import meta
from flax.core import spmd as core_spmd
from jax.sharding import PartitionSpec

from parallax._tree import is_box, path_str
from parallax.sharding.found import NOTHING, Found

Dims = list  # one entry per array dim: None, an axis name, or a tuple of axis names


class Placer(Protocol):
    """The part of a strategy that places params on mesh axes."""

    placement_priority: int

    def place(self, path: str, shape: tuple[int, ...], dims: Dims, axis_sizes: Mapping[str, int]) -> Dims:
        ...


def dims_axes(dims: Sequence[Any]) -> set[str]:
    """The mesh axes used anywhere in ``dims``."""
    used: set[str] = set()
    for entry in dims:
        if entry is None:
            continue
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return used


def entry_size(entry: Any, axis_sizes: Mapping[str, int]) -> int:
    """How many pieces one spec entry (an axis name or a tuple of them) splits a dim into."""
    axes = entry if isinstance(entry, tuple) else (entry,)
    return int(np.prod([axis_sizes[a] for a in axes]))


def logical_to_mesh(names: Sequence[Any], rules: Sequence[tuple[str, Any]] | None = None) -> tuple:
    """Mesh axes for logical dim names, by rules in order of precedence (flax's resolution).

    A rule ``(logical, mesh)`` gives the first dim named ``logical`` the mesh axes ``mesh``
    if that dim is still free and no dim took those axes yet. ``rules=None`` reads the
    ``logical_axis_rules`` context. Names no rule resolves stay unsplit (``None``).

    Example:
        >>> logical_to_mesh(("embed", "mlp"), [("mlp", "tensor"), ("embed", "fsdp")])
        ('fsdp', 'tensor')
    """
    rules = tuple(core_spmd.get_logical_axis_rules() if rules is None else rules)
    unassigned = object()
    result: list[Any] = [unassigned if isinstance(name, str) else name for name in names]
    for logical, mesh_axes in rules:
        if logical not in names:
            continue
        taken = dims_axes([r for r in result if r is not unassigned])
        wanted = mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)
        position = list(names).index(logical)
        if result[position] is unassigned and not taken & {a for a in wanted if a is not None}:
            result[position] = mesh_axes
    return tuple(None if r is unassigned else r for r in result)


def annotation_dims(box: Any, shape: tuple[int, ...], axis_sizes: Mapping[str, int]) -> Dims:
    """The dims a model's own ``nn.with_partitioning`` / logical annotation asks for.

    Names that are not axes of this mesh (logical names without a rule, axes of some
    other mesh) are dropped; a named axis whose size does not divide the dim is dropped
    too, since the array could not be laid out that way.
    """
    dims: Dims = [None] * len(shape)
    if not isinstance(box, meta.Partitioned):
        return dims
    names = tuple(box.names)
    if hasattr(box, "rules"):  # logical names (nn.with_logical_partitioning): resolve through the rules
        names = logical_to_mesh(names, box.rules)
    for d, entry in enumerate(names[: len(shape)]):
        axes = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in axes if isinstance(a, str) and a in axis_sizes)
        if not kept:
            continue
        entry = kept if len(kept) > 1 else kept[0]
        if shape[d] % entry_size(entry, axis_sizes) == 0:
            dims[d] = entry
    return dims


def place_param(
    path: str,
    shape: tuple[int, ...],
    placers: Sequence[Placer],
    axis_sizes: Mapping[str, int],
    box: Any = None,
    found: Found = NOTHING,
) -> PartitionSpec:
    """The ``PartitionSpec`` of one param (each placer given its record of ``found``: what planning found in the
    traced loss, :mod:`parallax.sharding.found`).

    Example:
        >>> from parallax import FSDP
        >>> tuple(place_param("Dense_0/kernel", (1024, 512), [FSDP(min_weight_size=0)], {"fsdp": 8}))
        ('fsdp',)
    """
    dims = annotation_dims(box, shape, axis_sizes)
    ordered = sorted(placers, key=lambda p: p.placement_priority)
    for placer in ordered:
        dims = placer.place(path, shape, list(dims), axis_sizes, **found.given(placer))
    for placer in ordered:
        if hasattr(placer, "place_last"):
            dims = placer.place_last(path, shape, list(dims), axis_sizes, **found.given(placer))
    while dims and dims[-1] is None:
        dims = dims[:-1]
    return PartitionSpec(*dims)


def _flatten(tree: Any) -> list[tuple[tuple, Any]]:
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]


def _shape(leaf: Any) -> tuple[int, ...]:
    value = leaf.value if is_box(leaf) else leaf
    return tuple(np.shape(value))


def param_specs(abstract_params: Any, placers: Sequence[Placer], axis_sizes: Mapping[str, int],
                found: Found = NOTHING) -> Any:
    """A ``PartitionSpec`` tree with the structure of the (unboxed) params.

    Args:
        abstract_params: params or their shapes (``jax.eval_shape`` output); flax
            ``Partitioned`` boxes are read for the model's own annotations.
        placers: the strategy parts that place params.
        axis_sizes: mesh axis name to size.
    """

    def spec(key_path, leaf):
        return place_param(path_str(key_path), _shape(leaf), placers, axis_sizes, box=leaf, found=found)

    return jax.tree_util.tree_map_with_path(spec, abstract_params, is_leaf=is_box)


def params_of(state: Any) -> Any:
    """The params of a train state (a ``params`` attribute or key)."""
    if hasattr(state, "params"):
        return state.params
    if isinstance(state, Mapping) and "params" in state:
        return state["params"]
    raise ValueError(
        f"Cannot find params in a state of type {type(state).__name__}; pass a state with "
        "a `params` attribute or key (e.g. a parallax.TrainState)."
    )


def _components(key_path: tuple) -> tuple[str, ...]:
    return tuple(path_str((k,)) for k in key_path)


def state_specs(abstract_state: Any, placers: Sequence[Placer], axis_sizes: Mapping[str, int],
                found: Found = NOTHING) -> Any:
    """A ``PartitionSpec`` tree matching a whole train state.

    Params get their placement. Every other leaf whose path ends with a param's path and
    has the param's shape (Adam's ``mu``/``nu``, momentum, EMA copies, ...) follows that
    param; the rest (step, counts, rng, ``batch_stats``, other collections) is replicated.
    """
    params = params_of(abstract_state)
    placed = jax.tree_util.tree_map_with_path(
        lambda key_path, leaf: place_param(path_str(key_path), _shape(leaf), placers, axis_sizes, box=leaf,
                                           found=found),
        params, is_leaf=is_box)
    return follow_params(abstract_state, placed)


def follow_params(abstract_state: Any, param_specs: Any) -> Any:
    """A whole train state's specs from its params' (``param_specs``, a tree like the params): every
    other leaf whose path ends with a param's path and has its shape follows it, the rest replicated."""
    by_suffix: dict[tuple[str, ...], tuple[tuple[int, ...], PartitionSpec]] = {}
    for (key_path, leaf), spec in zip(_flatten(params_of(abstract_state)),
                                      jax.tree.leaves(param_specs, is_leaf=is_spec), strict=True):
        by_suffix[_components(key_path)] = (_shape(leaf), spec)
    longest = max((len(k) for k in by_suffix), default=0)

    def spec(key_path, leaf):
        components = _components(key_path)
        shape = _shape(leaf)
        for n in range(min(longest, len(components)), 0, -1):
            found = by_suffix.get(components[-n:])
            if found is not None and found[0] == shape:
                return found[1]
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec, abstract_state, is_leaf=is_box)


def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def without_axes(spec: PartitionSpec, keep: set[str]) -> PartitionSpec:
    """``spec`` with every axis not in ``keep`` removed (the manual part of a spec)."""
    dims = []
    for entry in spec:
        axes = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in axes if a is not None and a in keep)
        dims.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while dims and dims[-1] is None:
        dims.pop()
    return PartitionSpec(*dims)

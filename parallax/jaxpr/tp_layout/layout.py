"""Choosing the classes to split: costs, conflicts, the layout and why each param is (not) split."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from parallax._units import format_bytes
from parallax.jaxpr.tp_layout.graph import DimGraph, ParamClass, is_var, nbytes, shape_of
from parallax.jaxpr.tp_layout.walk import build_graph


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where one param goes on the tensor axis, and why.

    Attributes:
        path: the param's path, e.g. ``"Dense_0/kernel"``.
        shape: its shape.
        dim: the dim split over the tensor axis, or ``None`` (replicated over it).
        role: ``"column"`` (an output dim of its matmul), ``"row"`` (a contracted dim),
            ``"vocab"`` (the dim a lookup indexes), ``"elementwise"`` (a bias or scale
            following its class), ``"rule"`` / ``"annotation"`` (placed by a name rule or
            the model's own annotation), or ``""`` when not split.
        reason: one line saying why it is split this way, or why it is not split.
    """

    path: str
    shape: tuple[int, ...]
    dim: int | None
    role: str
    reason: str


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """The tensor-parallel layout derived from a model's computation.

    Attributes:
        axis: the tensor mesh axis.
        axis_size: its size.
        params: one :class:`ParamLayout` per param, in the params' order.
    """

    axis: str
    axis_size: int
    params: tuple[ParamLayout, ...]

    @functools.cached_property
    def _dims(self) -> dict[str, int | None]:
        return {entry.path: entry.dim for entry in self.params}

    def dim_of(self, path: str) -> int | None:
        """The dim of ``path`` split over the tensor axis (``None``: not split or unknown)."""
        return self._dims.get(path)

    @property
    def split_fraction(self) -> float:
        """The fraction of param elements in params split over the tensor axis."""
        total = sum(math.prod(p.shape) for p in self.params)
        split = sum(math.prod(p.shape) for p in self.params if p.dim is not None)
        return split / total if total else 0.0

    def describe(self) -> str:
        """A table: every param, its shape, the dim split over the axis and why.

        Example:
            >>> plan = px.plan_state(model, optax.sgd(0.1), batch, strategy=px.TensorParallel(2),
            ...                      loss_fn=loss_fn, mesh=px.TensorParallel(2).make_mesh(jax.devices()[:2]))
            >>> print(plan.found["tensor"].describe().splitlines()[0])  # the rows: plan.describe_layout()
            tensor-parallel layout over 'tensor' (size 2): 5 of 6 params split, 98.9% of param elements
        """
        split = sum(p.dim is not None for p in self.params)
        lines = [
            f"tensor-parallel layout over {self.axis!r} (size {self.axis_size}): {split} of "
            f"{len(self.params)} params split, {100 * self.split_fraction:.1f}% of param elements"
        ]
        width = max((len(p.path) for p in self.params), default=0)
        shape_width = max((len(str(p.shape)) for p in self.params), default=0)
        for p in self.params:
            where = f"dim {p.dim}" if p.dim is not None else "whole"
            lines.append(f"  {p.path:<{width}}  {p.shape!s:<{shape_width}}  {where:<6} {p.role or '-':<11} {p.reason}")
        return "\n".join(lines)

    def unsplit_reasons(self, limit: int = 5) -> list[str]:
        """Why the largest unsplit params are not split (``path: reason``), largest first."""
        unsplit = sorted((p for p in self.params if p.dim is None), key=lambda p: -math.prod(p.shape))
        return [f"{p.path} {p.shape}: {p.reason}" for p in unsplit[:limit]]


# --- the graph of tied dims ------------------------------------------------------------------


def derive_layout(
    closed_jaxpr: Any,
    param_paths: Sequence[str],
    *,
    axis: str,
    axis_size: int,
    batch_invars: Sequence[int] = (),
    fixed: Mapping[str, tuple[int | None, str]] | None = None,
) -> TensorLayout:
    """Derives a Megatron layout for the params from a traced loss.

    Args:
        closed_jaxpr: ``jax.make_jaxpr(loss)(params, ...)``, the params' leaves first.
        param_paths: the path of each of the first ``len(param_paths)`` invars.
        axis: the tensor mesh axis name.
        axis_size: its size.
        batch_invars: indices of invars that are batch leaves (their leading dim is the
            batch, which the tensor axis never splits).
        fixed: params already placed on the tensor axis by a rule or an annotation:
            ``path -> (dim or None, "rule" | "annotation")``; the derivation keeps them
            and builds around them.

    Returns:
        A :class:`TensorLayout` with one entry per param path.
    """
    fixed = dict(fixed or {})
    graph, params, outvars = build_graph(closed_jaxpr, len(param_paths), batch_invars)
    classes = _classes(graph, params, axis_size)
    _add_costs(graph, classes, outvars)
    conflicts = _conflicts(graph)

    chosen: list = []
    chosen_roots: set = set()
    reasons: dict = {}
    # fixed placements come first: their classes are taken whatever they cost
    for index, path in enumerate(param_paths):
        if path in fixed and fixed[path][0] is not None:
            root = graph.find((id(params[index]), fixed[path][0]))
            if root in classes and root not in chosen_roots:
                chosen.append(classes[root])
                chosen_roots.add(root)
    candidates = sorted(
        (c for c in classes.values() if c.root not in chosen_roots and any(
            len(shape_of(params[i])) >= 2 for i, _ in c.param_nodes)),
        key=lambda c: (-c.ratio, -c.param_bytes, c.order),
    )
    for cls in candidates:
        if cls.invalid:
            reasons[cls.root] = cls.invalid
            continue
        if not (cls.flows or cls.reduces):
            reasons[cls.root] = "the computation uses it whole (splitting it would only gather it back)"
            continue
        clash = next((other for other in chosen if other.root in conflicts.get(cls.root, ())), None)
        if clash is not None:
            reasons[cls.root] = (f"shares arrays with {_describe_class(clash, param_paths, params, graph.roles)}, "
                                 "split instead")
            continue
        chosen.append(cls)
        chosen_roots.add(cls.root)

    entries = []
    for index, (path, var) in enumerate(zip(param_paths, params)):
        shape = shape_of(var)
        if path in fixed:
            dim, source = fixed[path]
            entries.append(ParamLayout(path, shape, dim, source if dim is not None else "",
                                       f"placed by a {source}" if dim is not None else f"kept whole by a {source}"))
            continue
        split = [d for d in range(len(shape))
                 if (id(var), d) in graph.parent and graph.find((id(var), d)) in chosen_roots]
        if split:
            dim = split[0]
            cls = classes[graph.find((id(var), dim))]
            role = _role(graph.roles, index, dim) or "elementwise"
            entries.append(ParamLayout(path, shape, dim, role, _split_reason(cls, param_paths, params, graph.roles)))
        else:
            entries.append(ParamLayout(path, shape, None, "", _unsplit_reason(graph, var, classes, reasons)))
    return TensorLayout(axis, axis_size, tuple(entries))


def _classes(graph: DimGraph, params: list, axis_size: int) -> dict:
    classes: dict = {}
    for order, node in enumerate(graph.parent):
        root = graph.find(node)
        cls = classes.get(root)
        if cls is None:
            cls = classes[root] = ParamClass(root, [], [], order=order)
        cls.nodes.append(node)
    index_of = {id(v): i for i, v in enumerate(params)}
    for cls in classes.values():
        seen_vars: dict = {}
        for node in cls.nodes:
            var_id, dim = node
            if node in graph.forbidden and not cls.invalid:
                cls.invalid = f"its dim is {graph.forbidden[node]}"
            if graph.size[node] % axis_size and not cls.invalid:
                cls.invalid = (f"its chain has a dim of size {graph.size[node]}, which the axis size "
                               f"{axis_size} does not divide")
            if var_id in seen_vars and not cls.invalid:
                cls.invalid = "the chain ties two dims of one array together"
            seen_vars[var_id] = dim
            if var_id not in graph.origin:
                cls.flows = True
            if var_id in index_of:
                cls.param_nodes.append((index_of[var_id], dim))
                cls.param_bytes += nbytes(graph.vars[var_id])
    return {root: cls for root, cls in classes.items() if cls.param_nodes}


def _add_costs(graph: DimGraph, classes: dict, outvars: Sequence) -> None:
    """Bytes communicated per step if a class is split (forward and backward)."""

    def classes_of(var):
        return {graph.find((id(var), d)) for d in range(len(shape_of(var))) if (id(var), d) in graph.parent}

    for eqn in graph.eqns:
        in_classes = [classes_of(v) for v in eqn.invars]
        out_classes = set().union(*(classes_of(v) for v in eqn.outvars)) if eqn.outvars else set()
        ends = set().union(*in_classes) - out_classes if in_classes else set()
        for root in ends & classes.keys():
            if any(graph.find(node) == root for node in eqn.reduced):
                classes[root].reduces = True
                cost = sum(nbytes(v) for v in eqn.outvars)  # partial sums: all-reduce the result
            else:
                cost = sum(nbytes(v) for v, found in zip(eqn.invars, in_classes) if root in found)  # all-gather
            classes[root].comm_bytes += cost * eqn.weight
        for root in out_classes & classes.keys():
            # an operand that lacks the split dim gets a partial gradient: all-reduce it
            lacking = [v for v, found in zip(eqn.invars, in_classes) if root not in found and id(v) in graph.needs_grad]
            classes[root].comm_bytes += sum(nbytes(v) for v in lacking) * eqn.weight
    for var in outvars:
        if is_var(var):
            for root in classes_of(var) & classes.keys():
                classes[root].comm_bytes += nbytes(var)


def _conflicts(graph: DimGraph) -> dict:
    """root -> roots of classes that share an array with it (one array can split one dim)."""
    found: dict = {}
    for var_id, var in graph.vars.items():
        roots = {graph.find((var_id, d)) for d in range(len(shape_of(var))) if graph.size.get((var_id, d), 1) > 1}
        if len(roots) > 1:
            for root in roots:
                found.setdefault(root, set()).update(roots - {root})
    return found


def _describe_class(cls: ParamClass, param_paths: Sequence[str], params: list, roles: Mapping) -> str:
    names = [f"{param_paths[i]}[{d}]" + (f" {_role(roles, i, d)}" if _role(roles, i, d) else "")
             for i, d in cls.param_nodes if len(shape_of(params[i])) >= 2]
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"the chain {shown}"


def _role(roles: Mapping, index: int, dim: int) -> str:
    found = roles.get((index, dim), set())
    return next((r for r in ("vocab", "row", "column") if r in found), "")


def _split_reason(cls: ParamClass, param_paths, params, roles: Mapping) -> str:
    size = shape_of(params[cls.param_nodes[0][0]])[cls.param_nodes[0][1]]
    comm = format_bytes(cls.comm_bytes) if cls.comm_bytes else "nothing"
    return f"splits {_describe_class(cls, param_paths, params, roles)} (size {size}); communicates {comm} per step"


def _unsplit_reason(graph: DimGraph, var: Any, classes: dict, reasons: dict) -> str:
    shape = shape_of(var)
    if not shape:
        return "a scalar"
    notes = []
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        node = (id(var), d)
        if shape[d] <= 1 or node not in graph.parent:
            continue
        root = graph.find(node)
        if root in reasons:
            notes.append(f"dim {d} ({shape[d]}): {reasons[root]}")
        elif root in classes and classes[root].invalid:
            notes.append(f"dim {d} ({shape[d]}): {classes[root].invalid}")
    if not notes:
        return "a bias or scale whose dims no split chain reaches" if len(shape) == 1 else "no matmul chain found"
    return "; ".join(notes[:2])

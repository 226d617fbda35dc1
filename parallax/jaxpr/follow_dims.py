"""Following dims through a traced computation, for expert parallelism's pins
(:mod:`parallax.parallel.experts.dispatch`): where a value's experts dim and the batch's rows dim
land in each equation's results, and which values are laid out by expert.

Example:
    >>> eqn = jax.make_jaxpr(lambda x: x.T)(jnp.ones((2, 3))).jaxpr.eqns[0]
    >>> moved(eqn, [0], eqn.outvars[0])  # a transpose takes dim 0 to dim 1
    1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.extend import core

from parallax._compat import scan_counts
from parallax.jaxpr.rebind import reshaped_dim


@dataclasses.dataclass
class Follow:
    """What expert parallelism's evaluation follows through a computation: each value's experts dim
    (``tracked``), its batch rows dim (``rows``), and the values laid out by expert (``laid``: a
    matmul's result pinned along its experts dim, and what elementwise ops make of it)."""

    tracked: dict
    rows: dict = dataclasses.field(default_factory=dict)
    laid: set = dataclasses.field(default_factory=set)

    def at(self, eqn: Any) -> tuple[list, list, list]:
        """``eqn``'s operands' experts dims, rows dims, and whether each is laid out by expert."""
        return (dims_of(eqn, self.tracked), dims_of(eqn, self.rows),
                [not isinstance(v, core.Literal) and v in self.laid for v in eqn.invars])

    def inside(self, invars: Sequence[Any], dims: list, rows: list, laid: list) -> Follow:
        """The same for a call's (or loop body's) own invars."""
        return Follow({v: d for v, d in zip(invars, dims) if d is not None},
                      {v: d for v, d in zip(invars, rows) if d is not None},
                      {v for v, flag in zip(invars, laid) if flag})

    def outside(self, inner: Follow, inner_outs: Sequence[Any], outvars: Sequence[Any]) -> None:
        """Takes a call's results' dims from what its body's outputs were found to be."""
        for v, o in zip(outvars, inner_outs):
            if isinstance(o, core.Literal):
                continue
            if o in inner.tracked:
                self.tracked[v] = inner.tracked[o]
            if o in inner.rows:
                self.rows[v] = inner.rows[o]
            if o in inner.laid:
                self.laid.add(v)


def dims_of(eqn: Any, found: dict) -> list:
    """The dim ``found`` holds for each of ``eqn``'s operands (``None`` where it holds none)."""
    return [None if isinstance(v, core.Literal) else found.get(v) for v in eqn.invars]


def note(found: dict, outvars: Sequence[Any], dims: Sequence[Any]) -> None:
    """Records each result's dim, where it has one."""
    found.update({v: d for v, d in zip(outvars, dims) if d is not None})


def follow_rows(eqn: Any, row_dims: list, rows: dict) -> None:
    """Where the batch's rows dim of ``eqn``'s operand lands in its results (none where it is
    contracted, reduced or mixed)."""
    if all(d is None for d in row_dims):
        return
    if eqn.primitive.name == "dot_general":
        for side, dim in enumerate(row_dims):
            at = dot_dim(eqn, side, dim) if dim is not None else None
            if at is not None:
                rows[eqn.outvars[0]] = at
                return
        return
    operand, dim = next((i, d) for i, d in enumerate(row_dims) if d is not None)
    call = any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in eqn.params.values())
    for out in eqn.outvars:
        found = None if call else moved(eqn, row_dims, out)  # a call, loop or branch: its leading dim alone
        leading = tuple(getattr(out.aval, "shape", ()))[:1] == tuple(eqn.invars[operand].aval.shape)[:1]
        if found is None and dim == 0 and leading:  # rows kept first (a lookup of each row's embedding)
            found = 0
        if found is not None:
            rows[out] = found


def dot_dim(eqn: Any, side: int, dim: int) -> int | None:
    """Where dim ``dim`` of a matmul's operand ``side`` lands in its result (``None``: contracted)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    shapes = [v.aval.shape for v in eqn.invars]
    free = [[d for d in range(len(shapes[s])) if d not in ((lc, rc)[s] + (lb, rb)[s])] for s in (0, 1)]
    batch = (lb, rb)[side]
    if dim in batch:
        return list(batch).index(dim)
    if dim in free[side]:
        return len(lb) + (free[0].index(dim) if side == 0 else len(free[0]) + free[1].index(dim))
    return None


def split_scan(eqn: Any, items: Sequence[Any]) -> tuple[list, list, list]:
    """A ``scan``'s operands (or anything laid out like them) as its consts, carry and stepped-over values."""
    consts, carry = scan_counts(eqn.params)
    return list(items[:consts]), list(items[consts:consts + carry]), list(items[consts + carry:])


def moved(eqn: Any, dims: list, out: Any) -> int | None:
    """Where the experts dim of ``eqn``'s tracked operand is in its result ``out`` (``None``: lost)."""
    operand, dim = next((i, d) for i, d in enumerate(dims) if d is not None)
    shape, name = tuple(eqn.invars[operand].aval.shape), eqn.primitive.name
    out_shape = tuple(getattr(out.aval, "shape", ()))
    if name == "transpose":
        return list(eqn.params["permutation"]).index(dim)
    if name == "broadcast_in_dim":
        return int(eqn.params["broadcast_dimensions"][dim])
    if name == "reshape":
        return reshaped_dim(shape, out_shape, dim)
    if name in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"):
        axes = [int(a) for a in eqn.params["axes"]]
        return None if dim in axes else dim - sum(a < dim for a in axes)
    if out_shape == shape or (len(out_shape) == len(shape) and out_shape[dim] == shape[dim]):
        return dim  # elementwise
    return None

"""The batch's split kept through a model's loops, in a traced computation.

Under data parallelism or FSDP the compiler is given the batch split over the batch axes and every
param's layout, and places everything between. Through a ``scan`` (a stack of blocks: linen
``nn.scan``, NNX ``nnx.scan``, a ``lax.scan`` over stacked weights) it places the loop's body
once, for every iteration, from what the loop's operands say; there it may keep the weights where
they are and split each block's activations along their features instead, gathering the whole
batch on every device: a scanned Llama under FSDP 8 computed 1.7 to 2.8 times a device's share of
the matmuls (every device the attention of the whole batch) where the same blocks kept in a list
computed 1.02 times it. :func:`batch_pinned` re-runs a function's traced computation with the
activations each such loop carries pinned, at the start of every iteration, split along the
batch's rows over the batch axes (every other dim left to the compiler): each device then
computes its rows, gathering each block's weights as FSDP does. Nothing the model computes
changes; a pin is a layout.

Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("data",))
    >>> def forward(w, x):
    ...     return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0].sum()
    >>> w, x = jnp.ones((3, 4, 4)) / 4, jnp.ones((8, 4))
    >>> pinned = batch_pinned(forward, mesh=mesh, batch_axes=("data",), batch_argnum=1)
    >>> bool(jnp.allclose(jax.jit(pinned)(w, x), forward(w, x)))
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from parallax.jaxpr.chains import CALLS, REMAT, call_body
from parallax.jaxpr.follow_dims import follow_rows, note, split_scan
from parallax.jaxpr.rebind import bind_eqn

_OPENED = (*CALLS, *REMAT)


def batch_pinned(fn: Callable, *, mesh: Mesh, batch_axes: Sequence[str], batch_argnum: int) -> Callable:
    """``fn`` with the per-example values each loop carries split along the batch's rows.

    Args:
        fn: the function (a loss).
        mesh: the mesh.
        batch_axes: the axes the batch's rows are split over, in order.
        batch_argnum: the argument holding the batch (every leaf with its rows on its leading dim).

    Returns:
        A function of the same arguments, returning what ``fn`` returns.
    """
    axes = tuple(batch_axes)
    size = math.prod(int(mesh.shape[name]) for name in axes)
    spec_axes = axes[0] if len(axes) == 1 else axes

    def pin(x: Any, dim: int) -> Any:
        """``x`` split along ``dim`` over the batch axes, where they are automatic in the mesh in
        context and divide it; else as it is."""
        context = jax.sharding.get_abstract_mesh()
        if context.empty or any(t == AxisType.Manual for t in context.axis_types) or x.shape[dim] % size:
            return x
        dims = [PartitionSpec.UNCONSTRAINED] * x.ndim
        dims[dim] = spec_axes
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*dims)))

    def run(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        first = len(jax.tree.leaves(args[:batch_argnum]))
        count = len(jax.tree.leaves(args[batch_argnum]))
        rows = {v: 0 for v in closed.jaxpr.invars[first:first + count] if v.aval.ndim}
        outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), rows, pin)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], rows: dict, pin: Callable) -> list[Any]:
    """Evaluates ``jaxpr``, following the batch's rows dim (``rows``: value to dim) and pinning
    the per-example carry of every loop it reaches."""
    values: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    values.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else values[v]
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        row_dims = [None if isinstance(v, core.Literal) else rows.get(v) for v in eqn.invars]
        name = eqn.primitive.name
        if all(d is None for d in row_dims):
            outs = bind_eqn(eqn, ins)
        elif name in _OPENED:
            outs = _open(eqn, ins, row_dims, rows, pin)
        elif name == "scan" and any(d is not None for d in split_scan(eqn, row_dims)[1]):
            outs = _scan(eqn, ins, row_dims, rows, pin)
        else:
            outs = bind_eqn(eqn, ins)
            follow_rows(eqn, row_dims, rows)
        values.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _scan(eqn: Any, ins: list, row_dims: list, rows: dict, pin: Callable) -> list[Any]:
    """A loop carrying per-example values, each pinned along its rows at the start of every iteration."""
    body, params = eqn.params["jaxpr"], eqn.params
    consts, carry, xs = split_scan(eqn, ins)
    c_rows, k_rows, x_rows = split_scan(eqn, row_dims)
    inner_rows = c_rows + k_rows + [None if d is None or d == 0 else d - 1 for d in x_rows]

    def step(state: Any, x: Any) -> Any:
        state = [value if dim is None else pin(value, dim) for value, dim in zip(state, k_rows)]
        inner = {v: d for v, d in zip(body.jaxpr.invars, inner_rows) if d is not None}
        outs = _evaluate(body.jaxpr, body.consts, [*consts, *state, *x], inner, pin)
        return outs[:len(carry)], outs[len(carry):]

    final, ys = jax.lax.scan(step, carry, xs, length=params["length"], reverse=params["reverse"],
                             unroll=params["unroll"])
    note(rows, eqn.outvars, k_rows)  # the activations carried through
    return [*final, *ys]


def _open(eqn: Any, ins: list, row_dims: list, rows: dict, pin: Callable) -> list[Any]:
    """A call or checkpoint reading per-example values, run opened (a checkpoint kept, with its
    policy); its results' rows noted in ``rows``."""
    inner, inner_consts = call_body(eqn)
    found: dict = {}

    def opened(*args: Any) -> list[Any]:
        found.clear()
        found.update({v: d for v, d in zip(inner.invars, row_dims) if d is not None})
        return _evaluate(inner, inner_consts, args, found, pin)

    call = opened
    if eqn.primitive.name in REMAT:
        call = jax.checkpoint(opened, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
    outs = list(call(*ins))
    for v, o in zip(eqn.outvars, inner.outvars):
        if not isinstance(o, core.Literal) and o in found:
            rows[v] = found[o]
    return outs

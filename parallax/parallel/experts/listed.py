"""A list of experts run as one batch split by expert, in a traced computation.

A mixture of experts kept as a list of separate modules calls each expert on its own params
(:mod:`parallax.jaxpr.siblings` finds the calls). No axis can split a list, so
:func:`run_siblings` stacks the calls' params and their differing operands by expert, pins the
stack along the experts dim over the expert axis, and runs the module's body once, vectorised
over the experts (``jax.vmap``, rematerialised as the call was): each device computes its experts
on the operands they read, and each call gets its own slice of the result back. The values are
the ones each call computes alone. :func:`schedule` orders a computation's equations so that each
group runs once all its calls' operands are known.

Example:
    >>> import parallax.jaxpr.siblings as siblings
    >>> def two(w0, w1, x):
    ...     expert = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))
    ...     return expert(w0, x) + expert(w1, x)
    >>> jaxpr = jax.make_jaxpr(two)(jnp.ones((3, 3)), jnp.ones((3, 3)), jnp.ones((2, 3))).jaxpr
    >>> group, = siblings.find_siblings(jaxpr, lambda v: v in jaxpr.invars[:2])
    >>> group.calls, group.weights, schedule(jaxpr.eqns, [group])
    ((0, 1), (0,), [Siblings(calls=(0, 1), weights=(0,), varying=()), 2])
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core

from parallax.jaxpr.chains import REMAT, call_body
from parallax.jaxpr.follow_dims import dims_of, follow_rows, note
from parallax.jaxpr.rebind import bind_eqn
from parallax.jaxpr.siblings import Siblings

_CALLS = ("jit", "pjit", "closed_call", "core_call")


def schedule(eqns: Sequence[Any], groups: Sequence[Siblings]) -> list:
    """The equations' indices in an order that computes every value before it is read, each
    group's calls replaced by the group (at the earliest place all their operands are known),
    every other equation as early as the original order allows."""
    member_of = {call: group for group in groups for call in group.calls}
    node = (lambda i: member_of[i].calls[0] if i in member_of else i)
    producer = {v: node(i) for i, eqn in enumerate(eqns) for v in eqn.outvars}
    waits: dict[int, set] = {}
    users: dict[int, set] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            made = None if isinstance(v, core.Literal) else producer.get(v)
            if made is not None and made != node(i):
                waits.setdefault(node(i), set()).add(made)
                users.setdefault(made, set()).add(node(i))
    nodes = sorted({node(i) for i in range(len(eqns))})
    ready = [n for n in nodes if not waits.get(n)]
    heapq.heapify(ready)
    order: list = []
    while ready:
        n = heapq.heappop(ready)
        order.append(member_of.get(n, n))
        for user in users.get(n, ()):
            waits[user].discard(n)
            if not waits[user]:
                heapq.heappush(ready, user)
    if len(order) != len(nodes):  # find_siblings groups only calls that do not read one another
        raise AssertionError("the grouped calls read one another's results")
    return order


def run_siblings(group: Siblings, eqns: Sequence[Any], read: Callable, pin: Callable, rows: dict) -> list[list[Any]]:
    """Each call's results, computed as one batch over the group's calls split by expert.

    ``rows`` holds the batch's rows dim of values where it is known (:mod:`parallax.jaxpr.follow_dims`).
    An operand whose calls' values still hold the rows (tokens dispatched per sequence: ``[groups,
    capacity, d]``) is stacked, pinned along the rows as the devices computed it, then along the
    experts: the compiler moves it with one all-to-all. Where such tokens were dispatched, a result
    holding the rows goes back along them the same way before the calls read their slices, and its
    rows are noted in ``rows``; the results of experts that all read the same tokens (a dense
    mixture) stay where the compiler puts them."""
    first = eqns[group.calls[0]]
    body, consts = call_body(first)
    stacked = set(group.weights) | set(group.varying)
    held = [_common(rows, [eqns[call].invars[p] for call in group.calls]) for p in range(len(first.invars))]

    def operand(p: int, v: Any) -> Any:
        if p not in stacked:
            return read(v)
        x = jnp.stack([read(eqns[call].invars[p]) for call in group.calls])
        at = None if held[p] is None else held[p] + 1
        return pin(pin(x, None, at), 0, at) if at is not None else pin(x, 0)

    operands = [operand(p, v) for p, v in enumerate(first.invars)]

    def one(*args: Any) -> list[Any]:
        values = {**dict(zip(body.constvars, consts)), **dict(zip(body.invars, args))}
        read_here = (lambda v: v.val if isinstance(v, core.Literal) else values[v])
        for eqn in body.eqns:
            values.update(zip(eqn.outvars, bind_eqn(eqn, [read_here(v) for v in eqn.invars])))
        return [read_here(v) for v in body.outvars]

    inner = {v: d for v, d in zip(body.invars, held) if d is not None}
    for eqn in body.eqns:  # where the rows land in the body's results
        follow_rows(eqn, dims_of(eqn, inner), inner)
    out_rows = [None if isinstance(v, core.Literal) else inner.get(v) for v in body.outvars]
    call = jax.checkpoint(one, prevent_cse=first.params["prevent_cse"], policy=first.params["policy"])
    in_axes = tuple(0 if p in stacked else None for p in range(len(operands)))
    outs = [pin(out, 0) for out in jax.vmap(call, in_axes=in_axes)(*operands)]
    if any(held[p] is not None for p in group.varying):  # tokens dispatched to each expert: back along the rows
        outs = [out if at is None else pin(pin(out, 0, at + 1), None, at + 1) for out, at in zip(outs, out_rows)]
        for call_index in group.calls:
            note(rows, eqns[call_index].outvars, out_rows)
    return [[out[member] for out in outs] for member in range(len(group.calls))]


def _common(rows: dict, values: Sequence[Any]) -> int | None:
    """The rows dim all of ``values`` hold, or ``None``."""
    found = {None if isinstance(v, core.Literal) else rows.get(v) for v in values}
    return found.pop() if len(found) == 1 else None


def holds_modules(eqn: Any) -> bool:
    """Whether a call equation's body (or a call inside it) calls a rematerialised module."""
    if eqn.primitive.name not in _CALLS:
        return False
    body = call_body(eqn)[0]
    return any(inner.primitive.name in REMAT or holds_modules(inner) for inner in body.eqns)

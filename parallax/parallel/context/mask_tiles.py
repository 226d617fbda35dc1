"""A value an attention's weights read that the model computes from no input (a causal mask from
positions), computed at one tile of the scores alone.

Context parallelism runs an attention a tile of its scores at a time
(:mod:`parallax.parallel.context.balanced`). Its mask, traced at the whole sequence's shapes, has
``queries × keys`` entries: 4 GiB of booleans at 65,536 tokens, whose rows a device would hold whole. Here
the equations that compute it (:func:`compute`'s recipe: iotas, broadcasts, comparisons) are run again at
a tile's shapes (:func:`compute_tile`): each value's queries' and keys' dims are followed back from the
mask through them, so each ``iota`` along one is made at the tile's length and started at its first
query or key. A recipe with an op not followed here is computed whole inside the
tile's loop and sliced (a zero that depends on the loop added to its iotas, so the compiler computes the
slice alone instead of hoisting the whole value out of the loop).

Example:
    >>> from parallax.parallel.context.tiles import _recipe
    >>> closed = jax.make_jaxpr(lambda: nn.make_causal_mask(jnp.ones((1, 8))))()
    >>> mask = closed.jaxpr.outvars[0]
    >>> recipe = _recipe(mask, closed.jaxpr.eqns, [])
    >>> tile = compute_tile(recipe, mask, (2, 3), {"q": (4, 2), "k": (3, 3)})
    >>> bool((tile == nn.make_causal_mask(jnp.ones((1, 8)))[..., 4:6, 3:6]).all()), tile.shape
    (True, (1, 1, 2, 3))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend import core

from parallax.jaxpr.chains import call_body
from parallax.jaxpr.rebind import bind
from parallax.parallel.context.weights import CALL_PRIMITIVES, Const, back_through, movable

_SHAPES = {"iota": "shape", "broadcast_in_dim": "shape", "reshape": "new_sizes"}  # the param holding the result's


class Unfollowed(Exception):
    """A recipe :func:`compute_tile` does not follow (an op other than those it knows, or a constant
    array along the queries or keys)."""


def compute_tile(recipe: Sequence[Any], v: Any, dims: tuple[int | None, int | None], at: dict,
                 squeeze: bool = False) -> Any:
    """``v`` (of ``recipe``, :func:`compute`'s; ``dims``: its queries' and keys' dims) at one tile: ``at``
    gives the queries' and keys' ``(start, length)`` (``"q"``, ``"k"``). Each value is computed at the
    tile's shapes for each way it is used (a position is a query's along one broadcast and a key's along
    another), each iota along a followed dim started at the tile's first query or key. ``squeeze``: every
    other dim of 1, where the value is known to be the same along it (an iota along one raises).

    Raises:
        Unfollowed: for an op other than elementwise ones, ``broadcast_in_dim``, ``transpose``,
            ``squeeze``, a reshape that keeps the queries' and keys' dims each a dim of its own, and ``iota``,
            or a constant array along either dim.
    """
    memo: dict = {}

    def value(x: Any, mine: tuple, scope: tuple) -> Any:
        if isinstance(x, core.Literal):
            return x.val
        if isinstance(x, Const):
            if mine != (None, None):
                raise Unfollowed("a constant array along the queries or keys")
            return x.value
        made, links = scope
        if x in links:  # a body's input: the value the call passed it, in the scope around it
            return value(links[x][0], mine, links[x][1])
        key = (x, id(made), mine)
        if key not in memo:
            eqn = made[x]
            if eqn.primitive.name in CALL_PRIMITIVES:  # its body, at the tile's shapes too
                body, consts = call_body(eqn)
                inner = ({o: e for e in body.eqns for o in e.outvars},
                         {**{c: (Const(k), scope) for c, k in zip(body.constvars, consts)},
                          **{b: (o, scope) for b, o in zip(body.invars, eqn.invars)}})
                memo[key] = value(body.outvars[eqn.outvars.index(x)], mine, inner)
            else:
                memo[key] = _run(eqn, mine, scope)
        return memo[key]

    def _run(eqn: Any, mine: tuple, scope: tuple) -> Any:
        """``eqn`` at the tile's shapes, ``mine``: its result's (queries', keys') dims."""
        name, params = eqn.primitive.name, unsharded(eqn.params)
        if name != "iota" and not movable(eqn):
            raise Unfollowed(name)
        ins = []
        for x in eqn.invars:  # each operand's dims followed back as the weights' side values are (back_through)
            theirs = (None, None) if isinstance(x, core.Literal) else back_through(eqn, x, mine)
            if name == "reshape" and any(m is not None and t is None for m, t in zip(mine, theirs)):
                raise Unfollowed("a reshape that merges the queries' or keys' dim with another")
            ins.append(value(x, theirs, scope))
        followed = {d: role for d, role in zip(mine, "qk") if d is not None}
        if squeeze and name == "iota" and params["dimension"] not in followed:
            raise Unfollowed("an iota along a dim other than the queries' and keys'")
        if name in _SHAPES and (followed or squeeze):
            params[_SHAPES[name]] = tuple(at[followed[d]][1] if d in followed else 1 if squeeze else n
                                          for d, n in enumerate(params[_SHAPES[name]]))
        try:
            result = bind(eqn.primitive, params, ins)[0]
        except (TypeError, ValueError) as err:  # squeezed: a value along another dim that is not broadcast
            if not squeeze:
                raise
            raise Unfollowed(str(err)) from None
        if name == "iota" and params["dimension"] in followed:
            result = result + jnp.asarray(at[followed[params["dimension"]]][0]).astype(result.dtype)
        return result

    top = ({out: eqn for eqn in recipe for out in eqn.outvars}, {})
    return value(v, tuple(dims), top)


def compute(recipe: Sequence[Any], v: Any, salt: Any = None) -> Any:
    """``v`` computed again by its recipe, where this runs (inside a ``shard_map``: its equations'
    shardings, traced outside it, left out). ``salt``: a traced integer zero added to every ``iota``, so
    that inside a loop the value depends on the loop and the compiler neither hoists it out nor keeps it
    whole: sliced there, only the slice is computed."""
    env: dict = {}
    get = lambda x: x.val if isinstance(x, core.Literal) else x.value if isinstance(x, Const) else env[x]
    for e in recipe:
        out = bind(e.primitive, unsharded(e.params), [get(x) for x in e.invars])
        if salt is not None and e.primitive.name == "iota":
            out = [o + salt.astype(o.dtype) for o in out]
        env.update(zip(e.outvars, out))
    return env[v]


def unsharded(params: dict) -> dict:
    """An equation's params without its shardings: traced outside the ``shard_map``, they name the mesh
    before its axis went manual (left to the body)."""
    return {name: None if name in ("sharding", "out_sharding") else value for name, value in params.items()}

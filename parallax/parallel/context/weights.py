"""An attention's ops from its scores to its weights, with each value's queries' and keys' dims.

Between an attention's two contractions (:mod:`parallax.parallel.context.attention` finds them) a
model computes its weights with ops of its own, traced at the whole sequence's shapes: a mask, a
softmax, dropout, transposes, calls. :func:`weights_ops` lists them with their calls inlined and
follows the queries' and keys' dims of every value through them: forward from the scores, and back
from where the weights' ops read a value computed without them (a mask's broadcast, a comparison),
so :mod:`parallax.parallel.context.ring` can run them at a block's shapes. It raises for an op that
mixes positions other than by a reduction over the keys, and for a model that reads the scores or
weights elsewhere (:func:`region`).

A value an attention's weights read that the model computes from no input (a causal mask from
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

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend import core

from parallax.jaxpr.chains import REMAT, call_body
from parallax.jaxpr.rebind import bind, reshaped_dim

CALL_PRIMITIVES = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                   "custom_vjp_call_jaxpr", *REMAT)  # inlined: each block's step is rematerialised as a whole
REDUCTIONS = ("reduce_max", "reduce_min", "reduce_sum")  # over the keys: combined across blocks
SHAPED = {"broadcast_in_dim": "shape", "reshape": "new_sizes"}  # the param holding the result's shape
_ELEMENTWISE = frozenset((  # each result element from the operands' elements at its position (size-1 dims broadcast)
    "add", "sub", "mul", "div", "rem", "pow", "integer_pow", "max", "min", "neg", "abs", "sign", "square", "sqrt",
    "rsqrt", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf", "erfc", "sin", "cos", "floor", "ceil",
    "round", "clamp", "select_n", "convert_element_type", "stop_gradient", "reduce_precision", "copy", "copy_p",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "is_finite", "nextafter", "atan2",
    "shift_left", "shift_right_logical", "shift_right_arithmetic"))


@dataclasses.dataclass(frozen=True, eq=False)
class Const:
    """A constant of an inlined call's body, where a variable would be."""

    value: Any


@dataclasses.dataclass
class Op:
    """One equation of an attention's weights, its calls inlined."""

    primitive: Any
    params: dict
    invars: list
    outvars: list


def flatten(eqns: Sequence[Any], alias: dict) -> list[Op]:
    """``eqns`` with every call's body inlined (``alias``: a call's results and body's inputs, each
    to what it stands for)."""
    ops: list[Op] = []
    for eqn in eqns:
        ins = [v if isinstance(v, core.Literal) else alias.get(v, v) for v in eqn.invars]
        if eqn.primitive.name not in CALL_PRIMITIVES:
            ops.append(Op(eqn.primitive, eqn.params, ins, list(eqn.outvars)))
            continue
        body, consts = call_body(eqn)
        inner = dict(alias)
        inner.update(zip(body.constvars, map(Const, consts)))
        inner.update(zip(body.invars, ins))
        ops.extend(flatten(body.eqns, inner))
        alias.update(inner)
        for outer, out in zip(eqn.outvars, body.outvars):
            alias[outer] = out if isinstance(out, core.Literal) else inner.get(out, out)
    return ops


def is_var(v: Any) -> bool:
    return not isinstance(v, (core.Literal, Const))


def shape_of(v: Any) -> tuple:
    return tuple(getattr(v.value if isinstance(v, Const) else v.aval, "shape", ()))


@dataclasses.dataclass
class Weights:
    """An attention's ops from its scores to the weights its values contraction reads."""

    ops: list[Op]  # in order; those not computed from the scores are the model's side values
    derived: set  # the variables computed from the scores
    roles: dict  # variable -> (queries' dim, keys' dim), each None where it has none
    reductions: list[int]  # the ops reducing over the keys, in order
    inside: set  # the ops not computed from the scores that run per block all the same
    sides: list  # the values computed whole (without the scores) that those and the weights' ops read


def weights_ops(ops: list[Op], scores: Any, roles: tuple, weights: Any) -> Weights:
    """Follows the queries' and keys' dims from the scores through ``ops``; raises for an op that
    mixes positions some other way than a reduction over the keys."""
    derived, found = {scores}, {scores: roles}
    reductions = []
    for index, op in enumerate(ops):
        if not any(is_var(v) and v in derived for v in op.invars):
            continue
        derived.update(op.outvars)
        name, operand = op.primitive.name, next(v for v in op.invars if is_var(v) and v in derived)
        q, k = found.get(operand, (None, None))
        out = op.outvars[0]
        if name == "transpose":
            perm = list(op.params["permutation"])
            found[out] = tuple(None if d is None else perm.index(d) for d in (q, k))
        elif name == "broadcast_in_dim":
            found[out] = tuple(None if d is None else int(op.params["broadcast_dimensions"][d]) for d in (q, k))
        elif name == "reshape":
            found[out] = tuple(None if d is None else reshaped_dim(shape_of(operand), shape_of(out), d) for d in (q, k))
        elif name == "squeeze":
            gone = sorted(int(d) for d in op.params["dimensions"])
            found[out] = tuple(None if d is None else d - sum(g < d for g in gone) for d in (q, k))
        elif name in REDUCTIONS:
            axes = sorted(int(a) for a in op.params["axes"])
            if q in axes or (k in axes and axes != [k]):
                raise unreachable(f"its weights are computed with a {name} over the queries' dim, or over the keys' "
                                   "and other dims together")
            if k in axes:
                reductions.append(index)
            found[out] = tuple(None if d is None or d in axes else d - sum(a < d for a in axes) for d in (q, k))
        elif _elementwise(op):
            found[out] = _merged(found, [v for v in op.invars if is_var(v) and v in derived])
        else:
            raise unreachable(f"its weights are computed with a {name}, which mixes positions")
        kept = found[out]
        if (q is not None and kept[0] is None) or (k is not None and kept[1] is None and index not in reductions):
            raise unreachable(f"its weights are computed with a {name} that merges the queries' or keys' dim with "
                               "another")
    if weights not in derived:
        raise unreachable("what it multiplies the values by is not computed from its scores")
    inside, sides = _side_values(ops, derived, found)
    return Weights(ops, derived, found, reductions, inside, sides)


def _side_values(ops: list[Op], derived: set, found: dict) -> tuple[set, list]:
    """Which ops not computed from the scores run per block too (those that move or combine values
    elementwise: a mask's broadcast, a comparison), with their values' dims followed back from
    where the weights' ops read them; and the values they start from, computed whole (``found``
    gets their dims)."""
    needed, outside, inside = set(), set(), set()
    computed = derived_ops(ops, derived)
    for index in reversed(range(len(ops))):
        op = ops[index]
        operands = [v for v in op.invars if is_var(v) and v not in derived and shape_of(v)]
        if index in computed:
            for v in operands:
                needed.add(v)
                if _elementwise(op):
                    found.setdefault(v, found[op.outvars[0]])
            continue
        if not any(v in needed for v in op.outvars) or any(v in outside for v in op.outvars) or not movable(op):
            outside.update(operands)
            continue
        inside.add(index)
        out = op.outvars[0]
        for v in operands:
            needed.add(v)
            found.setdefault(v, back_through(op, v, found.get(out, (None, None))))
    made = {v for index in inside for v in ops[index].outvars}
    starts = [v for v in dict.fromkeys(v for op in ops for v in op.invars if is_var(v) or isinstance(v, Const))
              if v in needed and v not in made and v not in derived]
    return inside, starts


def derived_ops(ops: list[Op], derived: set) -> set[int]:
    return {i for i, op in enumerate(ops) if any(is_var(v) and v in derived for v in op.invars)}


def _elementwise(op: Op) -> bool:
    """An elementwise op on operands of its result's rank (or scalars)."""
    if op.primitive.name not in _ELEMENTWISE or len(op.outvars) != 1:
        return False
    rank = len(shape_of(op.outvars[0]))
    return all(len(shape_of(v)) in (0, rank) for v in op.invars)


def movable(op: Op) -> bool:
    """Computes the same values at a block's shapes from the block of its operands."""
    return _elementwise(op) or op.primitive.name in ("broadcast_in_dim", "transpose", "reshape", "squeeze")


def back_through(op: Op, operand: Any, roles: tuple) -> tuple:
    """The (queries, keys) dims of ``operand`` of ``op`` (one of :func:`movable`'s), from its result's."""
    name, shape, out = op.primitive.name, shape_of(operand), shape_of(op.outvars[0])

    def each(dim: int | None) -> int | None:
        if dim is None:
            return None
        if name == "broadcast_in_dim":
            found = [d for d, b in enumerate(op.params["broadcast_dimensions"]) if int(b) == dim]
            return found[0] if found and shape[found[0]] == out[dim] else None
        if name == "transpose":
            return int(op.params["permutation"][dim])
        if name == "reshape":
            return reshaped_dim(out, shape, dim)
        if name == "squeeze":
            kept = [d for d in range(len(shape)) if d not in {int(g) for g in op.params["dimensions"]}]
            return kept[dim]
        return dim if len(shape) == len(out) else None

    return each(roles[0]), each(roles[1])


def _merged(found: dict, operands: list) -> tuple:
    dims = [found.get(v, (None, None)) for v in operands]
    return tuple(next((d[i] for d in dims if d[i] is not None), None) for i in (0, 1))


def unreachable(what: str) -> ValueError:
    return ValueError(
        f"ContextParallel(method='ring') cannot run this attention in blocks of keys (nor load_balance=True in tiles): "
        f"{what}. Use method='all_gather' without load_balance (which runs any attention context parallelism finds).")


def region(jaxpr: Any, attention: Any) -> list[int]:
    """The indices of the equations between an attention's two contractions computed from its
    scores; raises if anything else reads them (the ring never holds them whole)."""
    eqns = jaxpr.eqns
    derived, found = set(eqns[attention.scores].outvars), []
    for index in range(attention.scores + 1, attention.values):
        if any(is_var(v) and v in derived for v in eqns[index].invars):
            derived.update(eqns[index].outvars)
            found.append(index)
    inside = {attention.scores, *found, attention.values}
    read_outside = [v for i, e in enumerate(eqns) if i not in inside for v in e.invars if is_var(v) and v in derived]
    if read_outside or any(is_var(v) and v in derived for v in jaxpr.outvars):
        raise unreachable("the model also reads its scores or weights elsewhere (returns or stores them), "
                          "and a ring never holds them whole")
    return found


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

"""An attention's ops from its scores to its weights, ready to run on a tile of its scores.

:mod:`parallax.parallel.context.ring` and :mod:`parallax.parallel.context.balanced` run an attention
found in a trace (:mod:`parallax.parallel.context.attention`) inside a ``shard_map`` over the context
axis, a tile of the scores at a time: some of the queries against some of the keys. The ops between
the two contractions (a mask, a softmax, dropout: the model's own, traced at the whole sequence's
shapes) are re-run at the tile's shapes, each value's queries' and keys' dims followed through them
(:mod:`parallax.parallel.context.weights`). :class:`Tiles` holds what both need: the ops, the values
they read besides the scores (computed whole, once), where each operand's sequence dims are, and
:meth:`Tiles.run`, which evaluates the ops on one tile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.sharding import PartitionSpec

from parallax.jaxpr.rebind import bind, bind_eqn
from parallax.parallel.context.mask_tiles import Unfollowed, compute, compute_tile, unsharded
from parallax.parallel.context.weights import (
    SHAPED,
    Const,
    Weights,
    derived_ops,
    flatten,
    is_var,
    shape_of,
    weights_ops,
)


@dataclasses.dataclass
class Tiles:
    """One attention's equations and dims, and its weights' ops (:meth:`run` on a tile).

    Attributes:
        scores_eqn, values_eqn: the two contractions.
        query_side, weights_side: which operand of each holds the queries, the weights.
        q_dim, k_dim, v_dim, out_dim: the queries' dim in ``q``, the keys' in ``k`` and ``v``, the
            queries' in the result.
        queries, keys: the sequence lengths.
        info: the weights' ops (:class:`~parallax.parallel.context.weights.Weights`).
        sides, side_dims: the values those ops read besides the scores, and each one's (queries'
            dim, keys' dim).
        fixed: for each side value computed from no input of the function (a causal mask made from
            positions the model counts itself), the equations that compute it (:func:`compute`), so
            each device can compute it where it stands; ``None`` for the others.
    """

    scores_eqn: Any
    values_eqn: Any
    query_side: int
    weights_side: int
    q_dim: int
    k_dim: int
    v_dim: int
    out_dim: int
    queries: int
    keys: int
    info: Weights
    sides: list
    side_dims: list
    scores: Any
    weights: Any
    per_block: set
    val: Callable
    fixed: list


    @classmethod
    def of(cls, eqns: Sequence[Any], attention: Any, region: list[int], read: Callable) -> Tiles:
        """The tiles of ``attention`` (found in ``eqns``; ``region``: the equations between its
        contractions computed from its scores; ``read``: a variable's value before the values
        contraction). The side values are computed here, whole."""
        scores_eqn, values_eqn = eqns[attention.scores], eqns[attention.values]
        dims = attention.dims
        query_side = 0 if dims[(attention.scores, 0)][0] is not None else 1
        weights_side = 0 if dims[(attention.values, 0)][0] is not None else 1
        scores = scores_eqn.outvars[0]
        alias: dict = {}
        ops = flatten([eqns[i] for i in region], alias)
        weights = values_eqn.invars[weights_side]
        weights = alias.get(weights, weights)  # a call's result: the variable its body computes it in
        info = weights_ops(ops, scores, dims[(attention.scores, "out")], weights)
        env: dict = {}

        def val(v: Any) -> Any:
            if isinstance(v, (core.Literal, Const)):
                return v.val if isinstance(v, core.Literal) else v.value
            return env[v] if v in env else read(v)

        per_block = derived_ops(ops, info.derived) | info.inside
        for index, op in enumerate(ops):  # the side values the tiles start from (a mask, dropout's bits), whole
            if index not in per_block:
                env.update(zip(op.outvars, bind(op.primitive, op.params, [val(v) for v in op.invars])))
        return cls(scores_eqn, values_eqn, query_side, weights_side,
                   q_dim=dims[(attention.scores, query_side)][0], k_dim=dims[(attention.scores, 1 - query_side)][1],
                   v_dim=dims[(attention.values, 1 - weights_side)][1], out_dim=dims[(attention.values, "out")][0],
                   queries=attention.queries, keys=attention.keys, info=info, sides=list(info.sides),
                   side_dims=[info.roles.get(v, (None, None)) for v in info.sides], scores=scores, weights=weights,
                   per_block=per_block, val=val, fixed=[_recipe(v, eqns, ops) for v in info.sides])

    @property
    def ops(self) -> list:
        return self.info.ops

    def inputs(self, read: Callable) -> tuple[Any, Any, Any, list]:
        """The queries, keys and values, and the side values (whole)."""
        return (read(self.scores_eqn.invars[self.query_side]), read(self.scores_eqn.invars[1 - self.query_side]),
                read(self.values_eqn.invars[1 - self.weights_side]), [self.val(v) for v in self.sides])

    def specs(self, axis: str, q: Any, k: Any, v: Any) -> tuple:
        """``shard_map``'s specs: the queries split along theirs, the keys and values along theirs,
        each side value along its queries' dim (if it has one at full length), the result along its
        queries'."""
        spec = lambda ndim, split: PartitionSpec(*[axis if d == split else None for d in range(ndim)])
        sides = [spec(len(shape_of(v)), qd if qd is not None and shape_of(v)[qd] == self.queries else None)
                 for v, (qd, _) in zip(self.sides, self.side_dims)]
        ins = (spec(q.ndim, self.q_dim), spec(k.ndim, self.k_dim), spec(v.ndim, self.v_dim), *sides)
        return ins, spec(len(shape_of(self.values_eqn.outvars[0])), self.out_dim)

    def scores_of(self, q: Any, k: Any) -> Any:
        """The scores of a tile of queries against a block of keys."""
        return bind_eqn(self.scores_eqn, [q, k] if self.query_side == 0 else [k, q])[0]

    def values_of(self, weights: Any, v: Any) -> Any:
        """A tile's weights times its block of values."""
        return bind_eqn(self.values_eqn, [weights, v] if self.weights_side == 0 else [v, weights])[0]

    def side_tile(self, x: Any, dims: tuple, key_start: Any, key_len: int) -> Any:
        """A side value's columns ``key_start`` to ``key_start + key_len`` (if it has the keys' dim whole)."""
        return part_of(x, dims[1], self.keys, key_start, key_len)

    def fixed_tile(self, i: int, rows: tuple[Any, int], keys: tuple[Any, int], squeeze: bool = False) -> Any:
        """Side value ``i`` (one computed from no input: a causal mask from positions) at the queries'
        rows ``rows`` and keys' columns ``keys`` (each ``(start, length)``), computed there alone: the
        whole value (``queries × keys`` entries) is never held, and inside a loop over tiles each tile
        computes its own entries. ``squeeze``: its other dims of 1 (for a value the same along them; raises
        :class:`~parallax.parallel.context.mask_tiles.Unfollowed` where that is not known)."""
        q_dim, k_dim = self.side_dims[i]
        try:  # its ops run at the tile's shapes (parallax.parallel.context.mask_tiles)
            return compute_tile(self.fixed[i], self.sides[i], (q_dim, k_dim), {"q": rows, "k": keys}, squeeze)
        except Unfollowed:
            if squeeze:
                raise
        # Computed whole inside the loop and sliced: with a zero from the loop in its iotas, the compiler
        # computes the slice alone instead of hoisting the whole value out of the loop.
        salt = jnp.minimum(jax.lax.optimization_barrier(jnp.asarray(keys[0], jnp.int32)), 0)  # 0, as the loop
        made = compute(self.fixed[i], self.sides[i], salt)
        return part_of(part_of(made, q_dim, self.queries, *rows), k_dim, self.keys, *keys)

    def run(self, scores: Any, sides: Sequence[Any], finals: dict, shape: tuple[int, int],
            until: int | None = None, want: Any = None, squeeze: bool = False) -> Any:
        """The weights of one tile of ``shape`` (queries, keys), from its scores and its side values.

        Args:
            scores: the tile's scores.
            sides: the side values, each at the tile's queries' rows and keys' columns.
            finals: ``{op index: value}``: reductions over the keys already combined over the tiles.
            shape: the tile's number of queries and of keys.
            until: stop after this op and return its result.
            want: return this variable (once the ops before ``until`` ran) instead.
        """
        local: dict = {self.scores: scores}
        local.update(zip(self.sides, sides))
        get = lambda v: local[v] if is_var(v) and v in local else self.val(v)
        for index, op in enumerate(self.ops):
            if index not in self.per_block:
                continue
            if index == until and want is not None:
                return get(want)
            if index in finals:
                local[op.outvars[0]] = finals[index]
                continue
            params = unsharded(op.params)
            if op.primitive.name in SHAPED:
                key = SHAPED[op.primitive.name]
                roles = self.info.roles.get(op.outvars[0], (None, None))
                params[key] = self.blocked(params[key], roles, shape, squeeze)
            local.update(zip(op.outvars, bind(op.primitive, params, [get(v) for v in op.invars])))
            if index == until:
                return local[op.outvars[0]]
        return get(want) if want is not None else local[self.weights]

    def blocked(self, full: Sequence[int], roles: tuple, shape: tuple[int, int], squeeze: bool = False) -> tuple:
        """A shape traced for the whole sequence, at a tile's (queries, keys); ``squeeze``: every other dim 1."""
        q, k = roles
        return tuple(shape[0] if d == q and n == self.queries else shape[1] if d == k and n == self.keys else
                     1 if squeeze else n for d, n in enumerate(full))


def _recipe(v: Any, eqns: Sequence[Any], ops: Sequence[Any]) -> list | None:
    """The equations, in order, that compute ``v`` from literals and constants alone (among ``eqns``,
    a jaxpr's, and ``ops``); ``None`` if it reads an input of the function."""
    made = {out: e for e in (*eqns, *ops) for out in e.outvars}
    order: list = []
    seen: dict = {}

    def walk(x: Any) -> bool:
        if not is_var(x):
            return True
        if x not in seen:
            seen[x] = False  # an input of the function, or a cycle's guard
            if x in made and all(walk(u) for u in made[x].invars):
                seen[x] = True
                if made[x] not in order:
                    order.append(made[x])
        return seen[x]

    return order if walk(v) else None


def part_of(x: Any, dim: int | None, full: int, start: Any, length: int) -> Any:
    """``x``'s ``length`` entries from ``start`` along ``dim``, if it has all ``full`` there (else ``x``:
    a dim it broadcasts, or none)."""
    if dim is None or x.shape[dim] != full or length == full:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, length, axis=dim)

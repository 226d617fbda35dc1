"""An attention's ops from its scores to its weights, ready to run on a tile of its scores.

:mod:`parallax.parallel.context.ring` and :mod:`parallax.parallel.context.balanced` run an attention
found in a trace (:mod:`parallax.parallel.context.attention`) inside a ``shard_map`` over the context
axis, a tile of the scores at a time: some of the queries against some of the keys. The ops between
the two contractions (a mask, a softmax, dropout: the model's own, traced at the whole sequence's
shapes) are re-run at the tile's shapes, each value's queries' and keys' dims followed through them
(:mod:`parallax.parallel.context.weights`). :class:`Tiles` holds what both need: the ops, the values
they read besides the scores (computed whole, once), where each operand's sequence dims are, and
:meth:`Tiles.run`, which evaluates the ops on one tile.

An attention whose weights are a softmax over the keys, run in one pass over tiles of its keys.

:mod:`parallax.parallel.context.ring` and :mod:`parallax.parallel.context.balanced` run the model's
own ops between an attention's contractions on a tile of its scores at a time. A reduction over the
keys needs every tile before the ops after it can run, so in general each reduction (a softmax's
maximum, then its sum) takes a pass over the tiles of its own, and the weights times the values a
last one: every tile's scores computed three times, and round a ring the keys passed round three
times. Where the ops are a softmax's (:func:`find`: a maximum over the keys, ``exp`` of a value less
that maximum, a sum of that over the keys, the one divided by the other, and around them only ops
that keep every weight proportional: a mask or bias before, dropout's multiplier or a cast after),
one pass does (the running maximum and sum of flash attention): each tile's exponentials are taken
against the largest maximum seen so far, the sums and the weighted values found before rescaled by
``exp(old maximum - new maximum)``, and the weighted values divided by the sum at the end. The
model's own ops still compute each tile's maximum, exponentials, sum and weights (given the running
maximum, and a sum of 1, as the finals a pass would give them), so a mask, a scale or dropout is the
model's. In exact arithmetic the result is the softmax's; in floating point it differs by the order
of the sums and the rescalings, as the passes' results differ from one device's. The maximum is not
differentiated (the result does not depend on it; a softmax stops its gradient too).

Example:
    >>> import numpy as np
    >>> s = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6)), jnp.float32)
    >>> v = jnp.asarray(np.random.default_rng(1).normal(size=(6, 3)), jnp.float32)
    >>> m, l, o = -jnp.inf * jnp.ones(2), jnp.zeros(2), jnp.zeros((2, 3))
    >>> for t in range(3):  # three tiles of two keys, as rescale() combines them
    ...     m, l, o = rescale((m, l, o), s[:, 2 * t:2 * t + 2].max(1), lambda safe: (
    ...         jnp.exp(s[:, 2 * t:2 * t + 2] - safe[:, None]).sum(1),
    ...         jnp.exp(s[:, 2 * t:2 * t + 2] - safe[:, None]) @ v[2 * t:2 * t + 2]), rows=lambda y: y[:, None])
    >>> bool(jnp.allclose(o / l[:, None], jax.nn.softmax(s) @ v, atol=1e-6))
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.sharding import PartitionSpec

from parallax.jaxpr.rebind import bind, bind_eqn
from parallax.parallel.context.weights import (
    SHAPED,
    Const,
    Unfollowed,
    Weights,
    compute,
    compute_tile,
    derived_ops,
    flatten,
    is_var,
    shape_of,
    unsharded,
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
        :class:`~parallax.parallel.context.weights.Unfollowed` where that is not known)."""
        q_dim, k_dim = self.side_dims[i]
        try:  # its ops run at the tile's shapes (parallax.parallel.context.weights)
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


_MOVES = frozenset(("broadcast_in_dim", "reshape", "squeeze", "transpose", "stop_gradient", "copy",
                    "copy_p"))  # one operand, each element kept as it is
_CASTS = frozenset(("convert_element_type", "reduce_precision"))  # not of the maximum: it must stay exact


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
    """How to run one attention's softmax in one pass over its tiles (:func:`find`).

    Attributes:
        tiles: the attention's tiles.
        max_op, sum_op, sub_op: the indices (in ``tiles.ops``) of the softmax's maximum and sum over
            the keys, and of the value less the maximum.
        shift: the maximum as that subtraction reads it (moved by the model's ops into the weights'
            layout, with the keys' dim of 1 or whole).
        k_dim: the keys' dim of the weights (laid out as the subtraction's result and the sum's operand).
        same_rows: whether the maximum's rows are laid out as the sum's (else they are moved as the
            model moves them).
    """

    tiles: Tiles
    max_op: int
    sum_op: int
    sub_op: int
    shift: Any
    k_dim: int
    same_rows: bool

    def start(self, tile: Callable, v: Any) -> tuple:
        """The state before any tile: the running maximum (``-inf``), sum and weighted values (0).
        ``tile()`` gives a tile's ``run(finals, until, want=None)`` (its shapes are read, nothing computed)."""
        def shapes() -> tuple:
            run = tile()
            return run({}, self.max_op), run({}, self.sum_op), self.tiles.values_of(run({}, None), v)

        m, total, o = jax.eval_shape(shapes)
        return (jnp.full(m.shape, -jnp.inf, m.dtype), jnp.zeros(total.shape, total.dtype),
                jnp.zeros(o.shape, o.dtype))

    def step(self, state: tuple, run: Callable, v: Any) -> tuple:
        """``state`` with one more tile: ``run(finals, until, want=None)`` runs the model's ops on the
        tile's scores (as :meth:`parallax.parallel.context.tiles.Tiles.run`), ``v`` its block of values."""
        ones = jnp.ones(state[1].shape, state[1].dtype)  # the sum, as the division reads it

        def tile(safe: Any) -> tuple:
            weights = run({self.max_op: safe, self.sum_op: ones}, None)
            return run({self.max_op: safe}, self.sum_op), self.tiles.values_of(weights, v)

        return rescale(state, run({}, self.max_op), tile, lambda x: self.to_sum(x, run),
                       lambda y: self.rows(y, state[2].shape))

    def result(self, state: tuple) -> Any:
        """The attention's result: the weighted values over the sum."""
        _, total, values = state
        return values / self.rows(total, values.shape).astype(values.dtype)

    def rows(self, y: Any, shape: tuple) -> Any:
        """``y`` (one value per row, laid out as the sum: the weights' dims but the keys') laid out as the
        attention's result (of ``shape``): each of its dims where the values contraction puts that dim
        of the weights, broadcast along the values' own dims."""
        tiles = self.tiles
        (lc, rc), (lb, rb) = tiles.values_eqn.params["dimension_numbers"]
        side = tiles.weights_side
        w_con, w_batch = (lc, lb) if side == 0 else (rc, rb)
        w_free = [d for d in range(y.ndim + 1) if d not in w_con and d not in w_batch]
        frees = list(w_free) if side == 0 else [None] * (len(shape) - len(w_batch) - len(w_free)) + list(w_free)
        at = {d: i for i, d in enumerate(w_batch)}  # weights' dim -> the result's
        at.update((d, len(w_batch) + i) for i, d in enumerate(frees) if d is not None)
        kept = [d for d in range(y.ndim + 1) if d != self.k_dim]  # y's dims, as the weights'
        order = sorted(range(len(kept)), key=lambda i: at[kept[i]])
        return jax.lax.broadcast_in_dim(jnp.transpose(y, order), shape, sorted(at[kept[i]] for i in order))

    def to_sum(self, x: Any, run: Callable) -> Any:
        """``x`` (one value per row, laid out as the maximum) laid out as the sum: each row moved as the
        model's ops move the maximum (``run``, a tile's; they may stop gradients, so an index is moved)."""
        if self.same_rows:
            return x
        index = jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape)
        moved = jax.lax.index_in_dim(run({self.max_op: index}, self.sub_op, self.shift), 0, self.k_dim, keepdims=False)
        return jnp.reshape(x, -1)[moved.astype(jnp.int32)]


def rescale(state: tuple, tile_max: Any, tile: Callable, to_sum: Callable = lambda x: x,
            rows: Callable = lambda y: y) -> tuple:
    """The running ``(maximum, sum, weighted values)`` with one more tile: ``tile(maximum)`` gives its
    sum of exponentials and weighted values against the new maximum; ``to_sum(x)`` lays a value per
    row of the maximum out as the sum, ``rows(y)`` one of the sum's as the weighted values. A row that
    has seen only ``-inf`` takes its exponentials against 0."""
    m, total, values = state
    new = jax.lax.stop_gradient(jnp.maximum(m, tile_max))
    safe = jnp.where(jnp.isneginf(new), jnp.zeros_like(new), new)
    unseen = jnp.isneginf(m)
    scale = to_sum(jnp.where(unseen, jnp.zeros_like(m), jnp.exp(jnp.where(unseen, jnp.zeros_like(m), m) - safe)))
    tile_sum, tile_values = tile(safe)
    return new, total * scale.astype(total.dtype) + tile_sum, values * rows(scale).astype(values.dtype) + tile_values


def find(tiles: Tiles) -> OnlineSoftmax | None:
    """The one-pass form of ``tiles``' ops where they are a softmax over the keys (see the module), else ``None``.

    Each value from the maximum on is classed: ``m`` (the maximum, moved), ``d`` (a value less the
    maximum), ``e`` (its ``exp``, times values that do not depend on the maximum), ``l`` (their sum,
    moved), ``w`` (``e`` over ``l``, times such values); any other use of them, or a sum or weights
    laid out otherwise than the subtraction, and the passes run as before."""
    info, ops = tiles.info, tiles.ops
    if len(info.reductions) != 2:
        return None
    max_op, sum_op = info.reductions
    if ops[max_op].primitive.name != "reduce_max" or ops[sum_op].primitive.name != "reduce_sum":
        return None
    kind: dict = {ops[max_op].outvars[0]: "m"}
    subs, moves = [], []
    for index in range(max_op + 1, len(ops)):
        op = ops[index]
        classes = [kind.get(v, "x") if is_var(v) else "x" for v in op.invars]
        if set(classes) == {"x"}:
            continue
        out = _class(op, index == sum_op, classes)
        if out is None:
            return None
        subs += [index] if out == "d" else []
        moves += [op] if out == "m" else []
        kind.update((v, out) for v in op.outvars)
    weights, summed = tiles.weights, ops[sum_op].invars[0]
    if kind.get(weights) != "w" or len(subs) != 1:
        return None
    sub = ops[subs[0]].outvars[0]
    roles = info.roles.get(sub, (None, None))
    k_dim = roles[1]
    if k_dim is None or any(info.roles.get(v) != roles or shape_of(v) != shape_of(sub) for v in (weights, summed)) or \
            tuple(int(a) for a in ops[sum_op].params["axes"]) != (k_dim,):
        return None
    reduced = ops[max_op].invars[0]
    same = info.roles.get(reduced) == roles and shape_of(reduced) == shape_of(sub) and all(
        op.primitive.name != "broadcast_in_dim" or list(op.params["broadcast_dimensions"]) == sorted(
            op.params["broadcast_dimensions"]) for op in moves) and not any(
        op.primitive.name in ("transpose", "reshape", "squeeze") for op in moves)
    return OnlineSoftmax(tiles, max_op, sum_op, subs[0], ops[subs[0]].invars[1], k_dim, same)


def _class(op: Any, is_sum: bool, classes: list) -> str | None:
    """The class of ``op``'s result from its operands' (``x``: independent of the maximum)."""
    name, marked = op.primitive.name, [c for c in classes if c != "x"]
    if is_sum:
        return "l" if classes == ["e"] else None
    if name in _MOVES and len(classes) == 1:
        return classes[0] if classes[0] in ("m", "e", "l", "w") else None
    if name in _CASTS and len(classes) == 1:
        return classes[0] if classes[0] in ("e", "l", "w") else None
    if name in ("max", "min") and sorted(classes) == ["m", "x"] and _infinite(op.invars[classes.index("x")],
                                                                             -1 if name == "max" else 1):
        return "m"  # jnp.max's initial=-inf: the maximum itself
    if name == "sub" and classes == ["x", "m"]:
        return "d"
    if name == "exp" and classes == ["d"]:
        return "e"
    if name == "div" and classes == ["e", "l"]:
        return "w"
    if name in ("mul", "div") and len(marked) == 1 and marked[0] in ("e", "w") and (name == "mul" or classes[0] != "x"):
        return marked[0]  # times (or over) a value that does not depend on the maximum: still proportional
    return None


def _infinite(v: Any, sign: int) -> bool:
    """Whether ``v`` is a literal (or constant) whose every element is infinite of ``sign`` (-1 for a
    max, 1 for a min): a max with ``-inf`` (a min with ``inf``) leaves the maximum as it is."""
    if is_var(v):
        return False
    value = v.val if isinstance(v, core.Literal) else v.value
    try:
        return bool(np.all(np.asarray(value) == sign * np.inf))
    except TypeError:
        return False

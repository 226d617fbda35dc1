"""An attention whose weights are a softmax over the keys, run in one pass over tiles of its keys.

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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from parallax.parallel.context.tiles import Tiles
from parallax.parallel.context.weights import is_var, shape_of

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

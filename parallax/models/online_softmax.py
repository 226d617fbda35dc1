"""An attention whose weights are a softmax over the keys, run in one pass over tiles of its keys.

:mod:`parallax.models.ring_attention` and :mod:`parallax.models.balanced_attention` run the model's
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
    ...         jnp.exp(s[:, 2 * t:2 * t + 2] - safe[:, None]) @ v[2 * t:2 * t + 2]), lambda x: x[:, None])
    >>> bool(jnp.allclose(o / l[:, None], jax.nn.softmax(s) @ v, atol=1e-6))
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from parallax.models.attention_tiles import Tiles
from parallax.models.attention_weights import is_var, shape_of

_MOVES = frozenset(("broadcast_in_dim", "reshape", "squeeze", "transpose", "stop_gradient", "copy",
                    "copy_p"))  # one operand, each element kept as it is
_CASTS = frozenset(("convert_element_type", "reduce_precision"))  # not of the maximum: it must stay exact


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
    """How to run one attention's softmax in one pass over its tiles (:func:`find`).

    Attributes:
        tiles: the attention's tiles.
        max_op, sum_op: the indices (in ``tiles.ops``) of the softmax's maximum and sum over the keys.
        k_dim: the keys' dim of the value the maximum reduces (laid out as the weights are).
    """

    tiles: Tiles
    max_op: int
    sum_op: int
    k_dim: int

    def start(self, run: Callable, v: Any) -> tuple:
        """The state before any tile: the running maximum (``-inf``), sum and weighted values (0).
        ``run(finals, until)`` runs the ops on a tile (its shapes are read, nothing computed)."""
        m = jax.eval_shape(lambda: run({}, self.max_op))
        o = jax.eval_shape(lambda: self.tiles.values_of(run({}, None), v))
        return (jnp.full(m.shape, -jnp.inf, m.dtype), jnp.zeros(m.shape, m.dtype), jnp.zeros(o.shape, o.dtype))

    def step(self, state: tuple, run: Callable, v: Any) -> tuple:
        """``state`` with one more tile: ``run(finals, until)`` runs the model's ops on the tile's scores
        (as :meth:`parallax.models.attention_tiles.Tiles.run`), ``v`` its block of values."""
        ones = lambda safe: jnp.ones(safe.shape, state[1].dtype)  # noqa: E731 (the sum, as the division reads it)

        def tile(safe: Any) -> tuple:
            weights = run({self.max_op: safe, self.sum_op: ones(safe)}, None)
            return run({self.max_op: safe}, self.sum_op), self.tiles.values_of(weights, v)

        return rescale(state, run({}, self.max_op), tile, lambda x: self.rows(x, v))

    def result(self, state: tuple, v: Any) -> Any:
        """The attention's result: the weighted values over the sum."""
        _, total, values = state
        return values / self.rows(total, v)

    def rows(self, x: Any, v: Any) -> Any:
        """``x`` (one value per row of the weights: the maximum's shape) laid out as the attention's
        result: the values contraction of ``x`` (a key dim of 1) with ones."""
        tiles = self.tiles
        weights = jnp.expand_dims(x, self.k_dim).astype(tiles.weights.aval.dtype)
        ones = jnp.ones(tuple(1 if d == tiles.v_dim else n for d, n in enumerate(v.shape)), v.dtype)
        return tiles.values_of(weights, ones)


def rescale(state: tuple, tile_max: Any, tile: Callable, rows: Callable) -> tuple:
    """The running ``(maximum, sum, weighted values)`` with one more tile: ``tile(maximum)`` gives its
    sum of exponentials and weighted values against the new maximum; ``rows(x)`` lays a value per row
    out as the weighted values. A row that has seen only ``-inf`` takes its exponentials against 0."""
    m, total, values = state
    new = jax.lax.stop_gradient(jnp.maximum(m, tile_max))
    safe = jnp.where(jnp.isneginf(new), jnp.zeros_like(new), new)
    unseen = jnp.isneginf(m)
    scale = jnp.where(unseen, jnp.zeros_like(m), jnp.exp(jnp.where(unseen, jnp.zeros_like(m), m) - safe))
    tile_sum, tile_values = tile(safe)
    return new, total * scale.astype(total.dtype) + tile_sum, values * rows(scale).astype(values.dtype) + tile_values


def find(tiles: Tiles) -> OnlineSoftmax | None:
    """The one-pass form of ``tiles``' ops where they are a softmax over the keys (see the module), else ``None``.

    Each value from the maximum on is classed: ``m`` (the maximum, moved), ``d`` (a value less the
    maximum), ``e`` (its ``exp``, times values that do not depend on the maximum), ``l`` (their sum,
    moved), ``w`` (``e`` over ``l``, times such values); any other use of them, or weights of another
    class, and the passes run as before."""
    info, ops = tiles.info, tiles.ops
    if len(info.reductions) != 2:
        return None
    max_op, sum_op = info.reductions
    if ops[max_op].primitive.name != "reduce_max" or ops[sum_op].primitive.name != "reduce_sum":
        return None
    reduced, weights = ops[max_op].invars[0], tiles.weights
    k_dim = info.roles.get(reduced, (None, None))[1]
    if (k_dim is None or tuple(ops[max_op].params["axes"]) != (k_dim,) or shape_of(reduced) != shape_of(weights)
            or info.roles.get(reduced) != info.roles.get(weights)
            or shape_of(ops[sum_op].outvars[0]) != shape_of(ops[max_op].outvars[0])):
        return None
    kind: dict = {ops[max_op].outvars[0]: "m"}
    for index in range(max_op + 1, len(ops)):
        op = ops[index]
        classes = [kind.get(v, "x") if is_var(v) else "x" for v in op.invars]
        if set(classes) == {"x"}:
            continue
        out = _class(op, index == sum_op, classes)
        if out is None:
            return None
        kind.update((v, out) for v in op.outvars)
    if kind.get(weights) != "w":
        return None
    return OnlineSoftmax(tiles, max_op, sum_op, k_dim)


def _class(op: Any, is_sum: bool, classes: list) -> str | None:
    """The class of ``op``'s result from its operands' (``x``: independent of the maximum)."""
    name, marked = op.primitive.name, [c for c in classes if c != "x"]
    if is_sum:
        return "l" if classes == ["e"] else None
    if name in _MOVES and len(classes) == 1:
        return classes[0] if classes[0] in ("m", "e", "l", "w") else None
    if name in _CASTS and len(classes) == 1:
        return classes[0] if classes[0] in ("e", "l", "w") else None
    if name in ("max", "min") and sorted(classes) == ["m", "x"] and _infinite(op.invars[classes.index("x")]):
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


def _infinite(v: Any) -> bool:
    """Whether ``v`` is a literal (or constant) whose every element is infinite: a max or min with it
    leaves the maximum as it is."""
    if is_var(v):
        return False
    value = v.val if isinstance(v, core.Literal) else v.value
    try:
        return bool(np.all(np.isinf(np.asarray(value))))
    except TypeError:
        return False

"""An attention found in a trace, its masked tiles skipped and the sequence reordered so that every
device of the context axis skips as many (``ContextParallel(load_balance=True)``).

A causal mask hides half of an attention's scores. Split along the sequence in order, the first
device's queries see few keys and the last device's see all of them; skipping what the mask hides
would leave the last device with most of the work. Here, inside a ``shard_map`` over the axis, the
sequence is cut into ``2 × size`` chunks and device ``i`` holds chunks ``i`` and ``2 × size - 1 - i``
(an early and a late one: the "zig-zag" order), its queries' rows exchanged into that order and the
result exchanged back (``ppermute``), so positions, masks and losses keep the model's own order
outside the attention. Each device computes the scores of its two chunks of queries against each
chunk of keys, one tile at a time, and skips (``lax.cond``) a tile whose every score the model's mask
hides; the model's own ops (mask, softmax, dropout) then run on its rows of the scores, and the
weights times the values skip the same tiles. Under a causal mask every device computes
``2 × size + 1`` of its ``4 × size`` tiles, the same number.

What counts as hidden is read from the model's ops, not assumed: the value the softmax's maximum
reduces over (the scores masked, scaled, biased) is evaluated for scores of ``+1e30`` and of ``-1e30``
(no matmul: the mask's ops alone); an entry is hidden where both are at most ``-1e30``, which a
``where(mask, scores, big_negative)`` and an additive ``finfo.min`` bias both give. A hidden entry's
weight is then exactly 0 (its ``exp`` underflows), provided its row has some entry the mask leaves
(the row's maximum is then that entry's, far above); a tile is skipped only where every row of its
queries has one, so a fully masked row (padding) keeps every tile and computes what one device does.
The weights of skipped tiles come out of the model's ops as exact zeros. So the result is what one
device computes, up to the order of the sums.

Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("context",))
    >>> def attend(q, k, v):
    ...     return jax.nn.dot_product_attention(q, k, v, is_causal=True).sum()
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> from parallax.models.context_attention import context_parallel
    >>> split = context_parallel(attend, mesh=mesh, axis="context", load_balance=True)
    >>> bool(jnp.allclose(jax.jit(split)(q, k, v), attend(q, k, v), rtol=1e-5))
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from parallax._compat import shard_map
from parallax.models.attention_tiles import Tiles
from parallax.models.attention_weights import is_var
from parallax.models.rebind import bind_eqn

PROBE = 1e30  # the scores the mask is evaluated at, either sign; an entry at most -PROBE both times is hidden


@dataclasses.dataclass(frozen=True)
class Balanced:
    """How one attention runs with its hidden tiles skipped, over ``axis`` in zig-zag order.

    ``count``: also return, per device, how many tiles of scores it computed (an ``int32`` array of
    the axis's size), which the docs' and benchmarks' per-device work is read from.
    """

    mesh: Mesh
    axis: str
    count: bool = False

    @property
    def size(self) -> int:
        return int(self.mesh.shape[self.axis])

    def __call__(self, eqns: Sequence[Any], attention: Any, region: list[int], read: Callable) -> Any:
        """The result of the attention's values contraction (see the module's doc); the arguments as
        :class:`~parallax.models.ring_attention.Ring`'s."""
        tiles = Tiles.of(eqns, attention, region, read)
        q_in, k_in, v_in, side_values = tiles.inputs(read)
        size, axis = self.size, self.axis
        chunk = tiles.keys // (2 * size)
        in_specs, out_specs = tiles.specs(axis, q_in, k_in, v_in)
        # The keys and values enter whole: the compiler gathers them, keeping the batch's split (gathered inside
        # the shard_map, the batch was gathered over the data axis too).
        whole = jax.sharding.PartitionSpec()
        split_sides = [spec != jax.sharding.PartitionSpec(*[None] * len(spec)) for spec in in_specs[3:]]
        # A side value computed from no input (a causal mask) enters whole and each device takes its rows where it
        # stands; one computed from the batch (a padding mask, dropout's bits) enters split and is exchanged.
        moved = [split and not fixed for split, fixed in zip(split_sides, tiles.fixed)]
        in_specs = (in_specs[0], whole, whole, *[spec if move else whole for spec, move in zip(in_specs[3:], moved)])
        if tiles.queries != tiles.keys or tiles.keys % (2 * size):
            raise ValueError(
                f"ContextParallel({axis}={size}, load_balance=True) cuts the sequence into {2 * size} chunks, two per "
                f"device, and an attention has {tiles.queries} queries and {tiles.keys} keys: use a sequence length "
                f"that {2 * size} divides (pad it, masking the padding), or load_balance=False.")
        hidden = _hidden_rule(tiles)

        def body(q, k, v, *sides):
            q = zigzag(q, tiles.q_dim, axis, size)
            sides = [zigzag(x, dims[0], axis, size) if move else zigzag_rows(x, dims[0], axis, size) if split else x
                     for x, dims, split, move in zip(sides, tiles.side_dims, split_sides, moved)]
            rows = 2 * chunk
            skip = hidden(sides, rows) if hidden else np.zeros((2, 2 * size), bool)
            q_chunks = [jax.lax.slice_in_dim(q, x * chunk, (x + 1) * chunk, axis=tiles.q_dim) for x in (0, 1)]
            k_chunks = [jax.lax.slice_in_dim(k, g * chunk, (g + 1) * chunk, axis=tiles.k_dim) for g in range(2 * size)]
            v_chunks = [jax.lax.slice_in_dim(v, g * chunk, (g + 1) * chunk, axis=tiles.v_dim) for g in range(2 * size)]
            q_out, k_out = tiles.info.roles[tiles.scores]
            scores = jnp.concatenate([
                jnp.concatenate([_unless(skip[x][g], tiles.scores_of, q_chunks[x], k_chunks[g])
                                 for g in range(2 * size)], axis=k_out) for x in (0, 1)], axis=q_out)
            weights = tiles.run(scores, sides, {}, (rows, tiles.keys))
            q_w, k_w = tiles.info.roles[tiles.weights]
            out = jnp.concatenate([
                sum(_unless(skip[x][g], tiles.values_of,
                            _tile(weights, (q_w, x * chunk), (k_w, g * chunk), chunk), v_chunks[g])
                    for g in range(2 * size)) for x in (0, 1)], axis=tiles.out_dim)
            out = unzigzag(out, tiles.out_dim, axis, size)
            if not self.count:
                return out
            computed = sum(jnp.where(skip[x][g], 0, 1) for x in (0, 1) for g in range(2 * size))
            return out, jnp.reshape(computed, (1,)).astype(jnp.int32)

        specs = (out_specs, jax.sharding.PartitionSpec(axis)) if self.count else out_specs
        run = shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=specs, manual_axes={axis})
        return run(q_in, k_in, v_in, *side_values)


def _unless(skip: Any, fn: Callable, a: Any, b: Any) -> Any:
    """``fn(a, b)``, or its zeros where ``skip`` (a traced bool) holds: the work not done."""
    if isinstance(skip, (bool, np.bool_)):
        return jnp.zeros(**_like(jax.eval_shape(fn, a, b))) if skip else fn(a, b)
    zeros = lambda a, b: jnp.zeros(**_like(jax.eval_shape(fn, a, b)))  # noqa: E731
    return jax.lax.cond(skip, zeros, fn, a, b)


def _like(shaped: Any) -> dict:
    return {"shape": shaped.shape, "dtype": shaped.dtype}


def _tile(x: Any, rows: tuple[int, int], cols: tuple[int, int], chunk: int) -> Any:
    """``x``'s ``chunk`` rows from ``rows = (dim, start)`` and ``chunk`` columns from ``cols``."""
    x = jax.lax.slice_in_dim(x, rows[1], rows[1] + chunk, axis=rows[0])
    return jax.lax.slice_in_dim(x, cols[1], cols[1] + chunk, axis=cols[0])


def _rows(x: Any, dim: int | None, start: int, length: int, rows: int) -> Any:
    """``x``'s rows ``start`` to ``start + length`` along ``dim`` (if it has all ``rows`` there)."""
    if dim is None or x.shape[dim] != rows:
        return x
    return jax.lax.slice_in_dim(x, start, start + length, axis=dim)


def _hidden_rule(tiles: Tiles) -> Callable | None:
    """A function of a device's side values (zig-zag rows) and its rows' count, giving each tile's
    skip flag (``[2][2 × size]`` traced bools), or ``None`` where the mask cannot be read (the first
    reduction over the keys is not a maximum, or the scores' dtype cannot hold ``PROBE``)."""
    info = tiles.info
    if not info.reductions or info.ops[info.reductions[0]].primitive.name != "reduce_max":
        return None
    first = info.reductions[0]
    reduced = next(v for v in info.ops[first].invars if is_var(v) and v in info.derived)
    q_dim, k_dim = info.roles.get(reduced, (None, None))
    dtype = tiles.scores.aval.dtype
    if q_dim is None or k_dim is None or not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).max < 1e37:
        return None

    def skip(sides: Sequence[Any], rows: int) -> list[list[Any]]:
        chunk, count = rows // 2, tiles.keys // (rows // 2)
        shape = list(tiles.scores.aval.shape)
        q_out, k_out = info.roles[tiles.scores]
        shape[q_out], shape[k_out] = chunk, chunk
        flags = []
        for x in (0, 1):  # tile by tile, each reduced where it is made: no (rows x keys) probe is held
            hidden, live = [], None
            for g in range(count):
                tile_sides = [_rows(tiles.side_tile(side, dims, g * chunk, chunk), dims[0], x * chunk, chunk, rows)
                              for side, dims in zip(sides, tiles.side_dims)]
                both = None
                for sign in (1, -1):
                    value = tiles.run(jnp.full(shape, sign * PROBE, dtype), tile_sides, {}, (chunk, chunk),
                                      until=first, want=reduced)
                    both = value <= -PROBE if both is None else both & (value <= -PROBE)
                hidden.append(jnp.all(both))
                kept = jnp.any(~both, axis=k_dim)  # each row: some key in this tile it keeps
                live = kept if live is None else live | kept
            flags.append([jnp.all(live) & h for h in hidden])
        return flags

    return skip


def zigzag(x: Any, dim: int, axis: str, size: int) -> Any:
    """A device's block of the sequence (chunks ``2i`` and ``2i + 1`` of ``2 × size``) exchanged for
    chunks ``i`` and ``2 × size - 1 - i`` (in that order) along ``dim``."""
    if size == 1:
        return x
    dest = lambda g: g if g < size else 2 * size - 1 - g  # noqa: E731  the device chunk g goes to
    half = x.shape[dim] // 2
    first, second = (jax.lax.slice_in_dim(x, h * half, (h + 1) * half, axis=dim) for h in (0, 1))
    from_even = jax.lax.ppermute(first, axis, [(d, dest(2 * d)) for d in range(size)])
    from_odd = jax.lax.ppermute(second, axis, [(d, dest(2 * d + 1)) for d in range(size)])
    even = jax.lax.axis_index(axis) % 2 == 0  # its chunk i is even: it came as some device's first half
    return jnp.concatenate([jnp.where(even, from_even, from_odd), jnp.where(even, from_odd, from_even)], axis=dim)


def zigzag_rows(x: Any, dim: int, axis: str, size: int) -> Any:
    """A device's chunks ``i`` and ``2 × size - 1 - i`` of ``2 × size`` along ``dim`` of ``x``, held whole."""
    chunk, index = x.shape[dim] // (2 * size), jax.lax.axis_index(axis)
    return jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk, axis=dim)
                            for c in (index, 2 * size - 1 - index)], axis=dim)


def unzigzag(x: Any, dim: int, axis: str, size: int) -> Any:
    """:func:`zigzag` undone: chunks ``i`` and ``2 × size - 1 - i`` back to ``2i`` and ``2i + 1``."""
    if size == 1:
        return x
    half = x.shape[dim] // 2
    first, second = (jax.lax.slice_in_dim(x, h * half, (h + 1) * half, axis=dim) for h in (0, 1))
    even = jax.lax.axis_index(axis) % 2 == 0
    even_chunk, odd_chunk = jnp.where(even, first, second), jnp.where(even, second, first)
    to_even = [(r, (r if r % 2 == 0 else 2 * size - 1 - r) // 2) for r in range(size)]  # chunk g is home on g // 2
    to_odd = [(r, (2 * size - 1 - r if r % 2 == 0 else r) // 2) for r in range(size)]
    return jnp.concatenate([jax.lax.ppermute(even_chunk, axis, to_even), jax.lax.ppermute(odd_chunk, axis, to_odd)],
                           axis=dim)


def tiles_computed(fn: Callable, *args: Any, mesh: Mesh, axis: str) -> np.ndarray:
    """How many tiles of scores each device of ``axis`` computes for the first attention ``fn``
    computes (the others are run alike), of ``4 × size``: what load balancing evens out.

    Example:
        >>> mesh = jax.sharding.Mesh(jax.devices()[:4], ("context",))
        >>> causal = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
        >>> q = jnp.ones((1, 16, 2, 4))
        >>> tiles_computed(causal, q, q, q, mesh=mesh, axis="context").tolist()  # 9 of 16 each, not 16
        [9, 9, 9, 9]
    """
    from parallax.models.attention_weights import region
    from parallax.models.context_attention import find_attention

    closed = jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    attention = find_attention(jaxpr)[0]
    values = dict(zip(jaxpr.constvars, closed.consts))
    values.update(zip(jaxpr.invars, jax.tree.leaves(args)))
    for eqn in jaxpr.eqns[:attention.values]:
        values.update(zip(eqn.outvars, bind_eqn(eqn, [v.val if not is_var(v) else values[v] for v in eqn.invars])))
    read = lambda v: v.val if not is_var(v) else values[v]  # noqa: E731
    run = Balanced(mesh, axis, count=True)
    return np.asarray(jax.jit(lambda: run(jaxpr.eqns, attention, region(jaxpr, attention), read)[1])())

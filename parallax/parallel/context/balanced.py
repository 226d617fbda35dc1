"""An attention found in a trace, its masked tiles skipped and the sequence reordered so that every
device of the context axis skips as many (``ContextParallel(load_balance=True)``).

A causal mask hides half of an attention's scores. Split along the sequence in order, the first
device's queries see few keys and the last device's see all of them; skipping what the mask hides
would leave the last device with most of the work. Here, inside a ``shard_map`` over the axis, the
sequence is cut into ``2 × size`` chunks and device ``i`` holds chunks ``i`` and ``2 × size - 1 - i``
(an early and a late one: the "zig-zag" order), its queries' rows exchanged into that order and the
result exchanged back (``ppermute``), so positions, masks and losses keep the model's own order
outside the attention. Each device runs its two chunks of queries against each chunk of keys, one
tile at a time, as :mod:`parallax.parallel.context.ring` runs a block: the keys and values taken
from a gathered copy (``method="all_gather"``) or passed round the axis two chunks a turn
(``"ring"``), the model's own ops between the contractions (mask, softmax, dropout) re-run on the
tile (:mod:`parallax.parallel.context.tiles`): a softmax's in one pass over the tiles, its running
maximum and sum (:mod:`parallax.parallel.context.tiles`), other ops a pass over the tiles for each
reduction over the keys, then the weights times the values summed over them. A tile whose every
score the mask hides is skipped (``lax.cond`` inside the tile's checkpoint) in every pass, the
backward included. Under a causal mask every device computes ``2 × size + 1`` of its ``4 × size``
tiles, the same number, and holds one tile of scores at a time. Where the mask is computed from no
input (a causal mask from positions), which tiles each device skips is read before tracing; where every
device keeps as many (of the gathered keys, or of each turn's block round the ring), the loop runs over
the kept tiles alone, without a branch: the program's FLOPs and bytes are the kept tiles' (what
``px.plan`` prices); on the causal LM of ``benchmarks/context_balance.py`` (CP 8, gathered) a step took
0.69 (1,024 tokens) and 0.52 (2,048) of the unbalanced one's, with the branch 0.74 and 0.65.

What counts as hidden is read from the model's ops, not assumed: the value the softmax's maximum
reduces over (the scores masked, scaled, biased) is evaluated for scores of ``+1e30`` and of ``-1e30``
(no matmul: the mask's ops alone); an entry is hidden where both are at most ``-1e30``, which a
``where(mask, scores, big_negative)`` and an additive ``finfo.min`` bias both give. A hidden entry's
weight is then exactly 0 (its ``exp`` underflows), provided its row has some entry the mask leaves
(the row's maximum is then that entry's, far above); a tile is skipped only where every row of its
queries has one, so a fully masked row (padding) keeps every tile and computes what one device does.
So the result is what one device computes, up to the order of the sums. A mask computed from no
input (a causal mask from positions the model counts) is computed again inside the ``shard_map``;
one computed from the batch (padding, dropout's bits) has its rows exchanged with the queries'.

Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("context",))
    >>> def attend(q, k, v):
    ...     return jax.nn.dot_product_attention(q, k, v, is_causal=True).sum()
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> from parallax.parallel.context.attention import context_parallel
    >>> split = context_parallel(attend, mesh=mesh, axis="context", load_balance=True)
    >>> bool(jnp.allclose(jax.jit(split)(q, k, v), attend(q, k, v), rtol=1e-5))
    True

Which tiles of an attention's scores each device of a load-balanced context axis skips, and the loop
over the kept ones (:mod:`parallax.parallel.context.balanced`).

A tile is skipped where the model's mask hides every score in it and every row of its queries keeps some
key (:func:`skips`, from a device's rows of the mask). Where the mask is computed from no input (a
causal mask from positions), the skips of every device are read before tracing
(:func:`static_skips`); with the keys gathered and every device keeping as many tiles
(:func:`schedule`), :func:`scheduled` runs the kept tiles alone, so the program's FLOPs and bytes are
theirs.

Example:
    >>> table = np.array([[[False, True], [False, False]], [[False, False], [True, False]]])  # 2 devices
    >>> schedule(table)[1].tolist()  # device 1's tiles: (row of chunks, chunk of keys)
    [[0, 0], [0, 1], [1, 1]]
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from parallax._compat import shard_map
from parallax.parallel.context.ring import COMBINE, IDENTITY
from parallax.parallel.context.tiles import Tiles, find, part_of
from parallax.parallel.context.weights import Unfollowed, is_var

PROBE = 1e30  # the scores the mask is evaluated at, either sign; an entry at most -PROBE both times is hidden


@dataclasses.dataclass(frozen=True)
class Balanced:
    """How one attention runs with its hidden tiles skipped, over ``axis`` in zig-zag order.

    Attributes:
        mesh, axis: the mesh and the context axis.
        gather: the keys and values gathered whole (``method="all_gather"``); otherwise passed round
            the axis a block (two chunks) at a time (``"ring"``).
        count: also return, per device, how many tiles of scores it computes (an ``int32`` array
            of the axis's size): what the docs' and benchmarks' per-device work is read from.
        block: keys per step inside a tile, where the weights are a softmax's (one pass): a device holds
            ``chunk × block`` scores per row of the other dims at a time, not ``chunk²`` (at 262,144
            tokens over 8 devices, ``chunk`` is 16,384); a tile of fewer keys, or a multiple of none,
            runs whole.
    """

    mesh: Mesh
    axis: str
    gather: bool = True
    count: bool = False
    block: int = 512

    @property
    def size(self) -> int:
        return int(self.mesh.shape[self.axis])

    def __call__(self, eqns: Sequence[Any], attention: Any, region: list[int], read: Callable) -> Any:
        """The result of the attention's values contraction (see the module's doc); the arguments as
        :class:`~parallax.parallel.context.ring.Ring`'s."""
        tiles = Tiles.of(eqns, attention, region, read)
        q_in, k_in, v_in, side_values = tiles.inputs(read)
        size, axis, n = self.size, self.axis, 2 * self.size
        if tiles.queries != tiles.keys or tiles.keys % n:
            raise ValueError(
                f"ContextParallel({axis}={size}, load_balance=True) cuts the sequence into {n} chunks, two per "
                f"device, and an attention has {tiles.queries} queries and {tiles.keys} keys: use a sequence length "
                f"that {n} divides (pad it, masking the padding), or load_balance=False.")
        chunk = tiles.keys // n
        in_specs, out_specs = tiles.specs(axis, q_in, k_in, v_in)
        whole = PartitionSpec()
        if self.gather:  # the compiler gathers them, keeping the batch's split (inside, it gathered the batch too)
            in_specs = (in_specs[0], whole, whole, *in_specs[3:])
        split_sides = [spec != PartitionSpec(*[None] * len(spec)) for spec in in_specs[3:]]
        # A side value computed from no input (a causal mask) is computed again inside, each device keeping its
        # rows; one computed from the batch (a padding mask, dropout's bits) enters split and is exchanged.
        entering = [i for i, recipe in enumerate(tiles.fixed) if recipe is None]
        in_specs = (*in_specs[:3], *[in_specs[3 + i] for i in entering])
        probe = _probe(tiles)
        block = self.block if 0 < self.block < chunk and chunk % self.block == 0 else chunk
        table = None if probe is None or entering else static_skips(tiles, probe, chunk, size, block)
        order = None if table is None or not self.gather else schedule(table)
        turns = None if table is None or self.gather else ring_schedule(table)
        ops, info = tiles.ops, tiles.info
        online = find(tiles)

        def body(q, k, v, *entered):
            index = jax.lax.axis_index(axis)
            given = dict(zip(entering, entered))
            # The sides entered are exchanged into zig-zag order; the others are computed a tile at a time.
            sides = [None if i not in given else zigzag(given[i], dims[0], axis, size) if split else given[i]
                     for i, (dims, split) in enumerate(zip(tiles.side_dims, split_sides))]
            q = zigzag(q, tiles.q_dim, axis, size)
            if not self.gather:
                k, v = zigzag(k, tiles.k_dim, axis, size), zigzag(v, tiles.v_dim, axis, size)
            q_rows = [jax.lax.slice_in_dim(q, x * chunk, (x + 1) * chunk, axis=tiles.q_dim) for x in (0, 1)]
            side_rows = [[None if side is None else part_of(side, dims[0], 2 * chunk, x * chunk, chunk)
                          for side, dims in zip(sides, tiles.side_dims)] for x in (0, 1)]

            def tile_sides(x, held, start, length):
                """The side values at this device's chunk of queries ``x`` (``held``: the entered ones' rows
                there) and keys ``start`` to ``start + length``."""
                row = jnp.where(jnp.asarray(x) == 0, index, 2 * size - 1 - index) * chunk
                return [tiles.fixed_tile(i, (row, chunk), (start, length)) if side is None else
                        tiles.side_tile(side, dims, start, length)
                        for i, (side, dims) in enumerate(zip(held, tiles.side_dims))]

            if table is not None:  # read from the mask before tracing: this device's row of it
                skip = jnp.asarray(table)[index]
            else:
                skip = jnp.zeros((2, n), bool) if probe is None else skips(
                    tiles, probe, lambda x, start, length: tile_sides(x, side_rows[x], start, length), chunk, n, block)

            def fold(update: Callable, first: list, moves_values: bool) -> list:
                """Each row's state folded over its tiles by ``update`` (checkpointed: the backward recomputes
                a tile): the kept ones alone (``order``, ``turns``), else every tile with the skipped ones passed
                over (a branch inside the tile's checkpoint)."""
                if order is not None:
                    return scheduled(jax.checkpoint(update), first, k, v, jnp.asarray(order)[index], chunk, tiles)
                if turns is not None:
                    return ring_scheduled(jax.checkpoint(update), first, k, v, turns, index, chunk, axis, moves_values,
                                          tiles)

                def guarded(state, kc, vc, g, x):
                    keep = lambda state, kc, vc, g: state
                    return jax.checkpoint(lambda *a: jax.lax.cond(skip[x, g], keep, lambda s, kc, vc, g: update(
                        s, kc, vc, g, x), *a))(state, kc, vc, g)

                return _over_tiles(guarded, first, k, v, index, chunk, size, self.gather, axis, moves_values, tiles)

            def tile(kc, start, x, rows, stacked, names=()):
                """The tile's scores (``kc``: its keys, from ``start``) and side values (``rows``: each one's
                two rows of chunks, ``stacked`` for a traced row, then the reductions ``names`` says):
                ``run(finals, until, want=None)`` runs the model's ops on them."""
                q, *sides_x = [None if pair[0] is None else pair[x] if isinstance(x, int) else
                               jax.lax.dynamic_index_in_dim(both, x, 0, False)
                               for pair, both in zip(rows, stacked or rows)]
                sides_x, final = sides_x[:len(tiles.sides)], dict(zip(names, sides_x[len(tiles.sides):]))
                length = kc.shape[tiles.k_dim]
                sides_x = tile_sides(x, sides_x, start, length)
                scores = tiles.scores_of(q, kc)
                return lambda finals, until, want=None: tiles.run(scores, sides_x, {**final, **finals}, (chunk, length),
                                                                  until, want)

            def stack(rows: list) -> list | None:  # each pair of rows stacked, for a row the loop traces
                return (None if order is None and turns is None
                        else [None if p[0] is None else jnp.stack(p) for p in rows])

            if online is not None:  # a softmax's: one pass over the tiles (parallax.parallel.context.tiles)
                rows = [q_rows, *zip(*side_rows)]
                stacked = stack(rows)

                def update(state, kc, vc, g, x):  # a tile, ``block`` keys a step (each step's tile recomputed)
                    step = jax.checkpoint(lambda state, kb, vb, at:
                                          online.step(state, tile(kb, at, x, rows, stacked), vb))
                    if block == chunk:
                        return step(state, kc, vc, g * chunk)
                    return jax.lax.scan(lambda state, j: (step(state, piece(kc, tiles.k_dim, j, block),
                                                               piece(vc, tiles.v_dim, j, block), g * chunk + j * block),
                                                          None), state, jnp.arange(chunk // block))[0]

                kc, vc = (jax.lax.slice_in_dim(x, 0, block, axis=d) for x, d in ((k, tiles.k_dim), (v, tiles.v_dim)))
                start = online.start(lambda: tile(kc, 0, 0, rows, stacked), vc)
                states = fold(update, [start, start], True)
                out = jnp.concatenate([online.result(state) for state in states], axis=tiles.out_dim)
            else:
                finals: list[dict] = [{}, {}]
                for reduction in [*info.reductions, None]:  # a pass over the tiles for each, then the values'
                    combine = jax.lax.add if reduction is None else COMBINE[ops[reduction].primitive.name]
                    names = list(finals[0])
                    rows = [q_rows, *zip(*side_rows), *([f[r] for f in finals] for r in names)]
                    stacked = stack(rows)

                    def part(kc, vc, g, x, reduction=reduction, rows=rows, stacked=stacked, names=names):
                        weights = tile(kc, g * chunk, x, rows, stacked, names)({}, reduction)
                        return weights if reduction is not None else tiles.values_of(weights, vc)

                    def update(total, kc, vc, g, x, part=part, combine=combine):
                        return combine(total, part(kc, vc, g, x))

                    totals = fold(update, identities(part, combine, k, v, chunk, tiles), moves_values=reduction is None)
                    if reduction is None:
                        out = jnp.concatenate(totals, axis=tiles.out_dim)
                        break
                    finals = [{**finals[x], reduction: totals[x]} for x in (0, 1)]
            out = unzigzag(out, tiles.out_dim, axis, size)
            if not self.count:
                return out
            return out, jnp.reshape(jnp.sum(~skip), (1,)).astype(jnp.int32)

        specs = (out_specs, PartitionSpec(axis)) if self.count else out_specs
        run = shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=specs, manual_axes={axis})
        return run(q_in, k_in, v_in, *[side_values[i] for i in entering])


def _over_tiles(update: Callable, first: list, k: Any, v: Any, index: Any, chunk: int, size: int, gather: bool,
                axis: str, moves_values: bool, tiles: Tiles) -> list:
    """Each row of chunks' state (``first``) folded over every chunk of keys, ``update(state, k chunk, v
    chunk, chunk of keys, row)``: taken from the gathered keys (a scan over the chunks) or round the ring
    (a scan over the turns, two chunks a turn: the source device's ``j`` and ``2 × size - 1 - j``)."""
    n = 2 * size
    cut = lambda x, dim, at: piece(x, dim, at, chunk)

    def add(totals, kc, vc, g):
        return [update(totals[x], kc, vc, g, x) for x in (0, 1)]

    if gather:
        def step(totals, g):
            return add(totals, cut(k, tiles.k_dim, g), cut(v, tiles.v_dim, g), g), None

        return jax.lax.scan(step, first, jnp.arange(n))[0]
    perm = [(i, (i + 1) % size) for i in range(size)]

    def turn(carry, t):
        kb, vb, totals = carry
        source = (index - t) % size
        for y, g in ((0, source), (1, n - 1 - source)):  # the block's chunks, in zig-zag order
            totals = add(totals, cut(kb, tiles.k_dim, y), cut(vb, tiles.v_dim, y), g)
        kb = jax.lax.ppermute(kb, axis, perm)  # the block of the device before, in turn
        vb = jax.lax.ppermute(vb, axis, perm) if moves_values else vb
        return (kb, vb, totals), None

    return jax.lax.scan(turn, (k, v, first), jnp.arange(size))[0][2]


@dataclasses.dataclass(frozen=True)
class _Probe:
    """Which entries of a tile the mask hides: the value the softmax's maximum reduces over, for
    scores of ``PROBE`` and ``-PROBE``, at most ``-PROBE`` both times (no matmul: the mask's ops)."""

    tiles: Tiles
    first: int
    reduced: Any
    k_dim: int

    def __call__(self, sides: Sequence[Any], shape: tuple[int, int], squeeze: bool = False) -> Any:
        """``squeeze``: the scores' other dims (batch, heads) of 1, for side values the same along them."""
        tiles = self.tiles
        q_out, k_out = tiles.info.roles[tiles.scores]
        full = [1 if squeeze else n for n in tiles.scores.aval.shape]
        full[q_out], full[k_out] = shape
        hidden = None
        for sign in (1, -1):
            value = tiles.run(jnp.full(full, sign * PROBE, tiles.scores.aval.dtype), sides, {}, shape,
                              until=self.first, want=self.reduced, squeeze=squeeze)
            hidden = value <= -PROBE if hidden is None else hidden & (value <= -PROBE)
        return hidden


def _probe(tiles: Tiles) -> _Probe | None:
    """The :class:`_Probe` of an attention, or ``None`` where the mask cannot be read (the first
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
    return _Probe(tiles, first, reduced, k_dim)


def zigzag(x: Any, dim: int, axis: str, size: int) -> Any:
    """A device's block of the sequence (chunks ``2i`` and ``2i + 1`` of ``2 × size``) exchanged for
    chunks ``i`` and ``2 × size - 1 - i`` (in that order) along ``dim``."""
    if size == 1:
        return x
    dest = lambda g: g if g < size else 2 * size - 1 - g
    half = x.shape[dim] // 2
    first, second = (jax.lax.slice_in_dim(x, h * half, (h + 1) * half, axis=dim) for h in (0, 1))
    from_even = jax.lax.ppermute(first, axis, [(d, dest(2 * d)) for d in range(size)])
    from_odd = jax.lax.ppermute(second, axis, [(d, dest(2 * d + 1)) for d in range(size)])
    even = jax.lax.axis_index(axis) % 2 == 0  # its chunk i is even: it came as some device's first half
    return jnp.concatenate([jnp.where(even, from_even, from_odd), jnp.where(even, from_odd, from_even)], axis=dim)


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


STATIC_ENTRIES = 2**36  # the mask's entries up to which the skipped tiles are read before tracing (262,144²: 80 s here)
STATIC_SCORES = 2**31  # ... and the scores' (every head's), for a mask that varies along the heads


def skips(tiles: Tiles, probe: Any, tile_sides: Callable, chunk: int, n: int, block: int, squeeze: bool = False) -> Any:
    """Which of a device's tiles to skip (``[2, n]``: its two chunks of queries against each chunk of
    keys; ``tile_sides(x, start, length)``: the side values at its chunk of queries ``x`` and those keys):
    those the mask hides whole, where every row of its queries keeps some key. Read ``block`` keys at a
    time, so no more than ``chunk × block`` entries (per row of the other dims) are held; ``squeeze``:
    the scores' other dims taken as 1 (side values the same along them)."""
    steps = chunk // block

    def look(kept, g):
        def part(carry, j):
            kept, hidden = carry
            seen = [probe(tile_sides(x, g * chunk + j * block, block), (chunk, block), squeeze) for x in (0, 1)]
            return ([k | jnp.any(~h, axis=probe.k_dim) for k, h in zip(kept, seen)],
                    [a & jnp.all(h) for a, h in zip(hidden, seen)]), None

        (kept, hidden), _ = jax.lax.scan(part, (kept, [jnp.asarray(True)] * 2), jnp.arange(steps))
        return kept, jnp.stack(hidden)

    held = jax.eval_shape(lambda: jnp.any(probe(tile_sides(0, 0, block), (chunk, block), squeeze), axis=probe.k_dim))
    kept, hidden = jax.lax.scan(look, [jnp.zeros(held.shape, bool)] * 2, jnp.arange(n))
    return hidden.T & jnp.stack([jnp.all(k) for k in kept])[:, None]


def static_skips(tiles: Tiles, probe: Any, chunk: int, size: int, block: int) -> np.ndarray | None:
    """:func:`skips` for every device of the axis (``[size, 2, n]``), computed before tracing where
    every side value is computed from no input (a causal mask from positions), each tile's entries where
    the tile is read (:meth:`~parallax.parallel.context.tiles.Tiles.fixed_tile`). Computed on this
    machine's CPU in a thread of its own, outside the step's trace and mesh (which may be of devices not
    in hand: a deviceless GPU target). Where the mask is the same along the scores' other dims (batch,
    heads: every side value made from iotas along the queries and keys alone, broadcast) it is read once
    for them all, ``queries × keys`` entries; otherwise every entry of the scores is. ``None`` where one
    cannot be computed here, or where more entries would be read than ``STATIC_ENTRIES`` (of a mask read
    once) or ``STATIC_SCORES`` (every head's: at 65,536 tokens and 32 heads, minutes on a CPU); each
    device then reads its own in the step, where they cost a fraction of what its scores cost."""
    n = 2 * size

    def table(squeeze: bool) -> np.ndarray:
        def one(d):
            def tile_sides(x, start, length):
                row = (d if x == 0 else 2 * size - 1 - d) * chunk
                return [tiles.fixed_tile(i, (row, chunk), (start, length), squeeze) for i in range(len(tiles.sides))]
            return skips(tiles, probe, tile_sides, chunk, n, block, squeeze)

        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            run = jax.jit(one)
            return np.stack([np.asarray(run(d)) for d in range(size)])

    def either() -> np.ndarray | None:
        try:
            return table(squeeze=True) if tiles.queries * tiles.keys <= STATIC_ENTRIES else None
        except (Unfollowed, TypeError, ValueError):  # a value that varies along the other dims: every entry read
            return table(squeeze=False) if int(np.prod(tiles.scores.aval.shape)) <= STATIC_SCORES else None

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(either).result()
    except (jax.errors.JAXTypeError, RuntimeError):  # a value only known when the step runs (or no CPU backend):
        return None  # the tiles are skipped as the step finds them


def schedule(table: np.ndarray) -> np.ndarray | None:
    """Per device, the (row of chunks, chunk of keys) of each tile it computes, each row's in the order
    of its keys (``[size, kept, 2]``); ``None`` where the devices keep unequal counts."""
    kept = ~table
    if len({int(count) for count in kept.sum(axis=(1, 2))}) != 1:
        return None
    return np.stack([np.argwhere(mine) for mine in kept]).astype(np.int32)


def piece(x: Any, dim: int, at: Any, length: int) -> Any:
    """``x``'s ``at``-th piece of ``length`` along ``dim`` (a chunk of keys, a block of one)."""
    return jax.lax.dynamic_slice_in_dim(x, at * length, length, axis=dim)


def _fold_tile(update: Callable, totals: Any, kc: Any, vc: Any, g: Any, x: Any) -> Any:
    """``totals`` (the two rows' states, stacked) with the tile of row ``x`` and chunk of keys ``g``
    folded into row ``x``'s (both traced)."""
    mine = jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, x, 0, keepdims=False), totals)
    now = update(mine, kc, vc, g, x)
    return jax.tree.map(lambda t, new: jax.lax.dynamic_update_index_in_dim(t, new, x, 0), totals, now)


def scheduled(update: Callable, first: Sequence[Any], k: Any, v: Any, order: Any, chunk: int, tiles: Tiles) -> list:
    """Each row of chunks' state (``first``: the two rows' before any tile) folded over the chunks of keys
    ``order`` (this device's pairs of :func:`schedule`) names, from the gathered keys:
    ``update(state, k chunk, v chunk, chunk of keys, row)`` (the row traced). The tiles the mask hides are
    not in the loop, so its FLOPs and bytes are the kept tiles' alone, in the order the loop with a branch
    per tile folds them."""
    def step(totals, pair):
        x, g = pair[0], pair[1]
        return _fold_tile(update, totals, piece(k, tiles.k_dim, g, chunk), piece(v, tiles.v_dim, g, chunk), g, x), None

    totals = jax.lax.scan(step, jax.tree.map(lambda *rows: jnp.stack(rows), *first), order)[0]
    return [jax.tree.map(lambda t, x=x: t[x], totals) for x in (0, 1)]


def ring_schedule(table: np.ndarray) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Round the ring, per device and turn, the (row of chunks, chunk of the block) of each tile it
    computes: the first turn's (its own block, ``[size, kept, 2]``) and the others' (``[size, size - 1,
    kept, 2]``); ``None`` where, on some turn, the devices keep unequal counts (or the later turns do).
    Under a causal mask a device keeps 3 tiles of its own block and 2 of each other."""
    size, n = table.shape[0], table.shape[2]
    turns = []
    for t in range(size):
        slots = []
        for d in range(size):
            s = (d - t) % size  # the block's source: its chunks s and n - 1 - s
            slots.append([(x, y) for y, g in ((0, s), (1, n - 1 - s)) for x in (0, 1) if not table[d, x, g]])
        if len({len(kept) for kept in slots}) != 1:
            return None
        turns.append(np.asarray(slots, np.int32).reshape(size, len(slots[0]), 2))
    if len({turn.shape[1] for turn in turns[1:]}) > 1:
        return None
    return turns[0], (np.stack(turns[1:], axis=1) if size > 1 else None)


def ring_scheduled(update: Callable, first: Sequence[Any], k: Any, v: Any, plan: tuple, index: Any, chunk: int,
                   axis: str, moves_values: bool, tiles: Tiles) -> list:
    """:func:`scheduled` round the ring: each turn's kept tiles of the block in hand (``plan``:
    :func:`ring_schedule`'s; ``index``: this device's), the blocks passed round the axis between turns.
    No tile the mask hides is in the loop, and no branch: the program's FLOPs and bytes are the kept
    tiles'."""
    own, later = plan
    size, n = own.shape[0], 2 * own.shape[0]
    perm = [(i, (i + 1) % size) for i in range(size)]

    def run(totals, kb, vb, source, slots):
        for j in range(slots.shape[0]):
            x, y = slots[j, 0], slots[j, 1]
            totals = _fold_tile(update, totals, piece(kb, tiles.k_dim, y, chunk), piece(vb, tiles.v_dim, y, chunk),
                                jnp.where(y == 0, source, n - 1 - source), x)
        return totals

    totals = run(jax.tree.map(lambda *rows: jnp.stack(rows), *first), k, v, index, jnp.asarray(own)[index])
    if later is not None:
        def turn(carry, t):
            kb, vb, totals = carry
            kb = jax.lax.ppermute(kb, axis, perm)  # the block of the device before, in turn
            vb = jax.lax.ppermute(vb, axis, perm) if moves_values else vb
            totals = run(totals, kb, vb, (index - t) % size, jnp.asarray(later)[index][t - 1])
            return (kb, vb, totals), None

        totals = jax.lax.scan(turn, (k, v, totals), jnp.arange(1, size))[0][2]
    return [jax.tree.map(lambda t, x=x: t[x], totals) for x in (0, 1)]


def identities(part: Callable, combine: Callable, k: Any, v: Any, chunk: int, tiles: Tiles) -> list:
    """A pass's totals before any tile: ``combine``'s identity at a tile's result's shape, for each row."""
    out = jax.eval_shape(lambda kc, vc: part(kc, vc, 0, 0), jax.lax.slice_in_dim(k, 0, chunk, axis=tiles.k_dim),
                         jax.lax.slice_in_dim(v, 0, chunk, axis=tiles.v_dim))
    return [jnp.full(out.shape, IDENTITY[combine], out.dtype)] * 2

"""Which tiles of an attention's scores each device of a load-balanced context axis skips, and the loop
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
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from parallax.parallel.context.mask_tiles import Unfollowed
from parallax.parallel.context.ring import IDENTITY
from parallax.parallel.context.tiles import Tiles

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

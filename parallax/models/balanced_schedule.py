"""Which tiles of an attention's scores each device of a load-balanced context axis skips, and the loop
over the kept ones (:mod:`parallax.models.balanced_attention`).

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
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from parallax.models.attention_tiles import Tiles, compute, part_of
from parallax.models.ring_attention import IDENTITY


def skips(tiles: Tiles, probe: Any, sides: Sequence[Any], chunk: int, n: int) -> Any:
    """Which of a device's tiles to skip (``[2, n]``: its two chunks of queries against each chunk of
    keys; ``sides``: its rows of the side values): those the mask hides whole, where every row of its
    queries keeps some key."""
    shape = (chunk, chunk)
    rows = [[part_of(side, dims[0], 2 * chunk, x * chunk, chunk) for side, dims in zip(sides, tiles.side_dims)]
            for x in (0, 1)]

    def tile_sides(x, g):
        return [tiles.side_tile(side, dims, g * chunk, chunk) for side, dims in zip(rows[x], tiles.side_dims)]

    def look(kept, g):
        hidden = [probe(tile_sides(x, g), shape) for x in (0, 1)]
        kept = [k | jnp.any(~h, axis=probe.k_dim) for k, h in zip(kept, hidden)]
        return kept, jnp.stack([jnp.all(h) for h in hidden])

    held = jax.eval_shape(lambda: jnp.any(probe(tile_sides(0, 0), shape), axis=probe.k_dim))
    kept, hidden = jax.lax.scan(look, [jnp.zeros(held.shape, bool)] * 2, jnp.arange(n))
    return hidden.T & jnp.stack([jnp.all(k) for k in kept])[:, None]


def device_rows(x: Any, dim: int, index: Any, size: int) -> Any:
    """Device ``index``'s chunks ``index`` and ``2 × size - 1 - index`` of ``2 × size`` along ``dim`` of
    ``x`` (``index``: an int, or the context axis's index inside its ``shard_map``)."""
    chunk = x.shape[dim] // (2 * size)
    rows = jnp.concatenate([jnp.arange(chunk) + index * chunk, jnp.arange(chunk) + (2 * size - 1 - index) * chunk])
    return jnp.take(x, rows, axis=dim, mode="clip")


def static_skips(tiles: Tiles, probe: Any, split_sides: Sequence[bool], chunk: int, size: int) -> np.ndarray | None:
    """:func:`skips` for every device of the axis (``[size, 2, n]``), computed before tracing where
    every side value is computed from no input (a causal mask from positions): each device's rows of
    them (:func:`device_rows`). Computed on this machine's
    CPU in a thread of its own, outside the step's trace and mesh (which may be of devices not in hand:
    a deviceless GPU target). ``None`` where one cannot be computed here."""
    n = 2 * size

    def table() -> np.ndarray:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            made = [compute(recipe, side) for recipe, side in zip(tiles.fixed, tiles.sides)]
            run = jax.jit(lambda *sides: skips(tiles, probe, sides, chunk, n))
            found = []
            for d in range(size):
                found.append(np.asarray(run(*[device_rows(m, dims[0], d, size) if split else m
                                              for m, dims, split in zip(made, tiles.side_dims, split_sides)])))
        return np.stack(found)

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(table).result()
    except (jax.errors.JAXTypeError, RuntimeError):  # a value only known when the step runs (or no CPU backend):
        return None  # the tiles are skipped as the step finds them


def schedule(table: np.ndarray) -> np.ndarray | None:
    """Per device, the (row of chunks, chunk of keys) of each tile it computes, each row's in the order
    of its keys (``[size, kept, 2]``); ``None`` where the devices keep unequal counts."""
    kept = ~table
    if len({int(count) for count in kept.sum(axis=(1, 2))}) != 1:
        return None
    return np.stack([np.argwhere(mine) for mine in kept]).astype(np.int32)


def scheduled(update: Callable, first: Sequence[Any], k: Any, v: Any, order: Any, chunk: int, tiles: Tiles) -> list:
    """Each row of chunks' state (``first``: the two rows' before any tile) folded over the chunks of keys
    ``order`` (this device's pairs of :func:`schedule`) names, from the gathered keys:
    ``update(state, k chunk, v chunk, chunk of keys, row)`` (the row traced). The tiles the mask hides are
    not in the loop, so its FLOPs and bytes are the kept tiles' alone, in the order the loop with a branch
    per tile folds them."""
    def cut(x, dim, at):
        return jax.lax.dynamic_slice_in_dim(x, at * chunk, chunk, axis=dim)

    def step(totals, pair):
        x, g = pair[0], pair[1]
        mine = jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, x, 0, keepdims=False), totals)
        now = update(mine, cut(k, tiles.k_dim, g), cut(v, tiles.v_dim, g), g, x)
        return jax.tree.map(lambda t, n: jax.lax.dynamic_update_index_in_dim(t, n, x, 0), totals, now), None

    totals = jax.lax.scan(step, jax.tree.map(lambda *rows: jnp.stack(rows), *first), order)[0]
    return [jax.tree.map(lambda t, x=x: t[x], totals) for x in (0, 1)]


def identities(part: Callable, combine: Callable, k: Any, v: Any, chunk: int, tiles: Tiles) -> list:
    """A pass's totals before any tile: ``combine``'s identity at a tile's result's shape, for each row."""
    out = jax.eval_shape(lambda kc, vc: part(kc, vc, 0, 0), jax.lax.slice_in_dim(k, 0, chunk, axis=tiles.k_dim),
                         jax.lax.slice_in_dim(v, 0, chunk, axis=tiles.v_dim))
    return [jnp.full(out.shape, IDENTITY[combine], out.dtype)] * 2

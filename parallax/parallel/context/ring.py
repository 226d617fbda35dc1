"""An attention found in a trace, run as a ring: keys and values passed round the context axis.

:mod:`parallax.parallel.context.attention` finds each attention a model computes (the scores
``q·kᵀ``, the ops that turn them into weights, the weights times ``v``). Its ``all_gather`` method
gathers the keys and values whole on every device of the axis. The ``ring`` method here holds one
block of them at a time: inside a ``shard_map`` manual over the axis, each device keeps its block
of queries and passes the key and value blocks round the axis with ``ppermute``, computing one
(its queries × one block of keys) tile of the scores per step, so no device holds more than
``1/size`` of its queries' scores.

The ops between the two contractions (a mask, a softmax, dropout: whatever the model wrote) are the
model's own, traced at the whole sequence's shapes. They are re-run here at a block's shapes, each
value's queries' and keys' dims followed through them. Where they are a softmax's (a mask, a scale
or dropout around it), the ring goes round once, each block's exponentials taken against the
running maximum and the running sum and weighted values rescaled as it grows
(:mod:`parallax.parallel.context.tiles`, as flash attention does). Otherwise a reduction over the
keys needs every block: each one gets a pass of the ring of its own, its blocks' partial results
combined (max, sum or min), before the ops after it run on the combined value; the weights times
``v``, a sum over the keys, are summed over the blocks in the last pass. Values the ops read
besides the scores start from what the model computes whole (a mask, dropout's bits), each device
taking its queries' rows and, per step, the block of keys' columns; what the model only moves or
combines elementwise from those (a mask's broadcast to every head) runs per block too
(:mod:`parallax.parallel.context.weights` follows every value's dims). So the ring computes what
one device computes, up to the order of the sums. Each block's step is rematerialised: the backward
pass recomputes a tile rather than keeping it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from parallax._compat import shard_map
from parallax.parallel.context.tiles import Tiles, find

COMBINE = {"reduce_max": jax.lax.max, "reduce_min": jax.lax.min, "reduce_sum": jax.lax.add}
IDENTITY = {jax.lax.max: -jnp.inf, jax.lax.min: jnp.inf, jax.lax.add: 0}


@dataclasses.dataclass(frozen=True)
class Ring:
    """How one attention runs round the axis: the equation indices and dims it needs."""

    mesh: Mesh
    axis: str

    @property
    def size(self) -> int:
        return int(self.mesh.shape[self.axis])

    def __call__(self, eqns: Sequence[Any], attention: Any, region: list[int], read: Callable) -> Any:
        """The result of the attention's values contraction, computed round the ring.

        Args:
            eqns: the equations of the jaxpr holding the attention.
            attention: the :class:`~parallax.parallel.context.attention.Attention` found there.
            region: the indices of the equations between its two contractions computed from its scores.
            read: a variable's value (everything computed before the values contraction).
        """
        tiles = Tiles.of(eqns, attention, region, read)
        q_in, k_in, v_in, side_values = tiles.inputs(read)
        size, block = self.size, tiles.keys // self.size
        shape = (tiles.queries // size, block)
        ops = tiles.ops

        def one_block(q, kb, source, finals, sides, until):
            sides = [tiles.side_tile(x, dims, source * block, block) for x, dims in zip(sides, tiles.side_dims)]
            return tiles.run(tiles.scores_of(q, kb), sides, finals, shape, until)

        online = find(tiles)

        def one_pass(q, k, v, sides):
            """A softmax's weights in one pass round the ring (:mod:`parallax.parallel.context.tiles`)."""
            index = jax.lax.axis_index(self.axis)
            perm = [(i, (i + 1) % size) for i in range(size)]

            def runner(kb, source):
                scores = tiles.scores_of(q, kb)
                blocks = [tiles.side_tile(x, dims, source * block, block) for x, dims in zip(sides, tiles.side_dims)]
                return lambda finals, until, want=None: tiles.run(scores, blocks, finals, shape, until, want)

            update = jax.checkpoint(lambda state, kb, vb, source: online.step(state, runner(kb, source), vb))

            def step(carry, turn):
                kb, vb, state = carry
                state = update(state, kb, vb, (index - turn) % size)
                return (jax.lax.ppermute(kb, self.axis, perm), jax.lax.ppermute(vb, self.axis, perm), state), None

            state = online.start(lambda: runner(k, index), v)
            return online.result(jax.lax.scan(step, (k, v, state), jnp.arange(size))[0][2])

        def body(q, k, v, *sides):
            if online is not None:
                return one_pass(q, k, v, sides)
            index = jax.lax.axis_index(self.axis)
            perm = [(i, (i + 1) % size) for i in range(size)]
            finals: dict = {}
            for reduction in [*tiles.info.reductions, None]:  # a pass round the ring for each, then the values'
                if reduction is None:
                    part = jax.checkpoint(lambda kb, vb, source: tiles.values_of(
                        one_block(q, kb, source, finals, sides, None), vb))  # noqa: B023 (one dict, filled as it goes)
                    combine = jax.lax.add
                else:
                    part = jax.checkpoint(lambda kb, vb, source, r=reduction:
                                          one_block(q, kb, source, finals, sides, r))  # noqa: B023
                    combine = COMBINE[ops[reduction].primitive.name]

                def step(carry, turn, part=part, combine=combine, moves_values=reduction is None):
                    kb, vb, total = carry
                    total = combine(total, part(kb, vb, (index - turn) % size))
                    kb = jax.lax.ppermute(kb, self.axis, perm)  # the block of the device before, in turn
                    vb = jax.lax.ppermute(vb, self.axis, perm) if moves_values else vb
                    return (kb, vb, total), None

                shape_out = jax.eval_shape(part, k, v, index)
                start = jnp.full(shape_out.shape, IDENTITY[combine], shape_out.dtype)
                total = jax.lax.scan(step, (k, v, start), jnp.arange(size))[0][2]
                if reduction is None:
                    return total
                finals = {**finals, reduction: total}
            raise AssertionError("unreachable")

        in_specs, out_specs = tiles.specs(self.axis, q_in, k_in, v_in)
        run = shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, manual_axes={self.axis})
        return run(q_in, k_in, v_in, *side_values)

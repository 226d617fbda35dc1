"""An attention found in a trace, run as a ring: keys and values passed round the context axis.

:mod:`parallax.models.context_attention` finds each attention a model computes (the scores
``q·kᵀ``, the ops that turn them into weights, the weights times ``v``). Its ``all_gather`` method
gathers the keys and values whole on every device of the axis. The ``ring`` method here holds one
block of them at a time: inside a ``shard_map`` manual over the axis, each device keeps its block
of queries and passes the key and value blocks round the axis with ``ppermute``, computing one
(its queries × one block of keys) tile of the scores per step, so no device holds more than
``1/size`` of its queries' scores.

The ops between the two contractions (a mask, a softmax, dropout: whatever the model wrote) are the
model's own, traced at the whole sequence's shapes. They are re-run here at a block's shapes, each
value's queries' and keys' dims followed through them. A reduction over the keys (a softmax's max
and sum) needs every block: each one gets a pass of the ring of its own, its blocks' partial results
combined (max, sum or min), before the ops after it run on the combined value; the weights times
``v``, a sum over the keys, are summed over the blocks in the last pass. Values the ops read
besides the scores start from what the model computes whole (a mask, dropout's bits), each device
taking its queries' rows and, per step, the block of keys' columns; what the model only moves or
combines elementwise from those (a mask's broadcast to every head) runs per block too
(:mod:`parallax.models.attention_weights` follows every value's dims). So the ring computes what
one device computes, up to the order of the sums. Each block's step is rematerialised: the backward
pass recomputes a tile rather than keeping it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.sharding import Mesh, PartitionSpec

from parallax._compat import shard_map
from parallax.models.attention_weights import SHAPED, Const, derived_ops, flatten, is_var, shape_of, weights_ops
from parallax.models.rebind import bind, bind_eqn

_COMBINE = {"reduce_max": jax.lax.max, "reduce_min": jax.lax.min, "reduce_sum": jax.lax.add}
_IDENTITY = {jax.lax.max: -jnp.inf, jax.lax.min: jnp.inf, jax.lax.add: 0}


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
            attention: the :class:`~parallax.models.context_attention.Attention` found there.
            region: the indices of the equations between its two contractions computed from its scores.
            read: a variable's value (everything computed before the values contraction).
        """
        scores_eqn, values_eqn = eqns[attention.scores], eqns[attention.values]
        dims = attention.dims
        query_side = 0 if dims[(attention.scores, 0)][0] is not None else 1
        weights_side = 0 if dims[(attention.values, 0)][0] is not None else 1
        scores = scores_eqn.outvars[0]
        weights = values_eqn.invars[weights_side]
        alias: dict = {}
        ops = flatten([eqns[i] for i in region], alias)
        weights = alias.get(weights, weights)  # a call's result: the variable its body computes it in
        info = weights_ops(ops, scores, dims[(attention.scores, "out")], weights)
        env: dict = {}

        def val(v: Any) -> Any:
            if isinstance(v, (core.Literal, Const)):
                return v.val if isinstance(v, core.Literal) else v.value
            return env[v] if v in env else read(v)

        per_block = derived_ops(ops, info.derived) | info.inside
        for index, op in enumerate(ops):  # the side values the blocks start from (a mask, dropout's bits), whole
            if index not in per_block:
                env.update(zip(op.outvars, bind(op.primitive, op.params, [val(v) for v in op.invars])))
        q_in = read(scores_eqn.invars[query_side])
        k_in = read(scores_eqn.invars[1 - query_side])
        v_in = read(values_eqn.invars[1 - weights_side])
        side_values = [val(v) for v in info.sides]
        queries, keys = attention.queries, attention.keys
        spec = lambda ndim, split: PartitionSpec(*[self.axis if d == split else None for d in range(ndim)])  # noqa: E731
        q_dim = dims[(attention.scores, query_side)][0]
        k_dim = dims[(attention.scores, 1 - query_side)][1]
        v_dim = dims[(attention.values, 1 - weights_side)][1]
        side_dims = [info.roles.get(v, (None, None)) for v in info.sides]
        side_specs = [spec(len(shape_of(v)), q if q is not None and shape_of(v)[q] == queries else None)
                      for v, (q, _) in zip(info.sides, side_dims)]
        out_dim = dims[(attention.values, "out")][0]
        size, block = self.size, keys // self.size

        def blocked(shape: Sequence[int], roles: tuple) -> tuple:
            q, k = roles
            return tuple(queries // size if d == q and n == queries else block if d == k and n == keys else n
                         for d, n in enumerate(shape))

        def one_block(q, kb, source, finals, sides, until):
            local: dict = {scores: bind_eqn(scores_eqn, [q, kb] if query_side == 0 else [kb, q])[0]}
            for v, (qd, kd), x in zip(info.sides, side_dims, sides):
                if kd is not None and x.shape[kd] == keys:
                    x = jax.lax.dynamic_slice_in_dim(x, source * block, block, axis=kd)
                local[v] = x
            get = lambda v: local[v] if is_var(v) and v in local else val(v)  # noqa: E731
            for index, op in enumerate(ops):
                if index not in per_block:
                    continue
                if index in finals:
                    local[op.outvars[0]] = finals[index]
                    continue
                # Shardings traced outside the ring name the mesh before its axis went manual: left to the body.
                params = {name: None if name in ("sharding", "out_sharding") else value
                          for name, value in op.params.items()}
                if op.primitive.name in SHAPED:
                    key = SHAPED[op.primitive.name]
                    params[key] = blocked(params[key], info.roles.get(op.outvars[0], (None, None)))
                local.update(zip(op.outvars, bind(op.primitive, params, [get(v) for v in op.invars])))
                if index == until:
                    return local[op.outvars[0]]
            return local[weights]

        def body(q, k, v, *sides):
            index = jax.lax.axis_index(self.axis)
            perm = [(i, (i + 1) % size) for i in range(size)]
            finals: dict = {}
            for reduction in [*info.reductions, None]:  # a pass round the ring for each, then the values'
                if reduction is None:
                    part = jax.checkpoint(lambda kb, vb, source: bind_eqn(values_eqn, _sides(
                        one_block(q, kb, source, finals, sides, None), vb, weights_side))[0])
                    combine = jax.lax.add
                else:
                    part = jax.checkpoint(lambda kb, vb, source, r=reduction: one_block(q, kb, source, finals, sides, r))
                    combine = _COMBINE[ops[reduction].primitive.name]

                def step(carry, turn, part=part, combine=combine, moves_values=reduction is None):
                    kb, vb, total = carry
                    total = combine(total, part(kb, vb, (index - turn) % size))
                    kb = jax.lax.ppermute(kb, self.axis, perm)  # the block of the device before, in turn
                    vb = jax.lax.ppermute(vb, self.axis, perm) if moves_values else vb
                    return (kb, vb, total), None

                shape = jax.eval_shape(part, k, v, index)
                start = jnp.full(shape.shape, _IDENTITY[combine], shape.dtype)
                total = jax.lax.scan(step, (k, v, start), jnp.arange(size))[0][2]
                if reduction is None:
                    return total
                finals = {**finals, reduction: total}
            raise AssertionError("unreachable")

        run = shard_map(body, mesh=self.mesh,
                        in_specs=(spec(q_in.ndim, q_dim), spec(k_in.ndim, k_dim), spec(v_in.ndim, v_dim), *side_specs),
                        out_specs=spec(len(shape_of(values_eqn.outvars[0])), out_dim), manual_axes={self.axis})
        return run(q_in, k_in, v_in, *side_values)


def _sides(weights: Any, values: Any, weights_side: int) -> list:
    return [weights, values] if weights_side == 0 else [values, weights]

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
besides the scores (masks, dropout's bits) are computed whole, as the model computes them, and each
device takes its queries' rows and, per step, the block of keys' columns. So the ring computes what
one device computes, up to the order of the sums. Each block's step is rematerialised: the backward
pass recomputes a tile rather than keeping it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.sharding import Mesh, PartitionSpec

from parallax._compat import shard_map
from parallax.sharding.chains import call_body

_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
_COMBINE = {"reduce_max": jax.lax.max, "reduce_min": jax.lax.min, "reduce_sum": jax.lax.add}
_IDENTITY = {jax.lax.max: -jnp.inf, jax.lax.min: jnp.inf, jax.lax.add: 0}
_SHAPED = {"broadcast_in_dim": "shape", "reshape": "new_sizes"}  # the param holding the result's shape
_MOVING = ("transpose", "squeeze", *_SHAPED, *_COMBINE, "reduce_precision", "copy", "copy_p")


@dataclasses.dataclass(frozen=True, eq=False)
class _Const:
    """A constant of an inlined call's body, where a variable would be."""

    value: Any


@dataclasses.dataclass
class _Op:
    """One equation of an attention's weights, its calls inlined."""

    primitive: Any
    params: dict
    invars: list
    outvars: list


def _flatten(eqns: Sequence[Any], alias: dict) -> list[_Op]:
    """``eqns`` with every call's body inlined (``alias``: a call's results and body's inputs, each
    to what it stands for)."""
    ops: list[_Op] = []
    for eqn in eqns:
        ins = [v if isinstance(v, core.Literal) else alias.get(v, v) for v in eqn.invars]
        if eqn.primitive.name not in _CALLS:
            ops.append(_Op(eqn.primitive, eqn.params, ins, list(eqn.outvars)))
            continue
        body, consts = call_body(eqn)
        inner = dict(alias)
        inner.update(zip(body.constvars, map(_Const, consts)))
        inner.update(zip(body.invars, ins))
        ops.extend(_flatten(body.eqns, inner))
        alias.update(inner)
        for outer, out in zip(eqn.outvars, body.outvars):
            alias[outer] = out if isinstance(out, core.Literal) else inner.get(out, out)
    return ops


def reshaped_dim(old: Sequence[int], new: Sequence[int], dim: int) -> int | None:
    """Where ``dim`` of shape ``old`` is in the reshape to ``new``, where it stays a dim of its own."""
    before = math.prod(old[:dim])
    for j in range(len(new)):
        if math.prod(new[:j]) == before and new[j] == old[dim]:
            return j
    return None


def _is_var(v: Any) -> bool:
    return not isinstance(v, (core.Literal, _Const))


def _shape(v: Any) -> tuple:
    return tuple(getattr(v.value if isinstance(v, _Const) else v.aval, "shape", ()))


@dataclasses.dataclass
class _Weights:
    """An attention's ops from its scores to the weights its values contraction reads."""

    ops: list[_Op]  # in order; those not computed from the scores are the model's side values
    derived: set  # the variables computed from the scores
    roles: dict  # variable -> (queries' dim, keys' dim), each None where it has none
    reductions: list[int]  # the ops reducing over the keys, in order
    inside: set  # the ops not computed from the scores that run per block all the same
    sides: list  # the values computed whole (without the scores) that those and the weights' ops read


def _weights(ops: list[_Op], scores: Any, roles: tuple, weights: Any) -> _Weights:
    """Follows the queries' and keys' dims from the scores through ``ops``; raises for an op that
    mixes positions some other way than a reduction over the keys."""
    derived, found = {scores}, {scores: roles}
    reductions = []
    for index, op in enumerate(ops):
        if not any(_is_var(v) and v in derived for v in op.invars):
            continue
        derived.update(op.outvars)
        name, operand = op.primitive.name, next(v for v in op.invars if _is_var(v) and v in derived)
        q, k = found.get(operand, (None, None))
        out = op.outvars[0]
        if name == "transpose":
            perm = list(op.params["permutation"])
            found[out] = tuple(None if d is None else perm.index(d) for d in (q, k))
        elif name == "broadcast_in_dim":
            found[out] = tuple(None if d is None else int(op.params["broadcast_dimensions"][d]) for d in (q, k))
        elif name == "reshape":
            found[out] = tuple(None if d is None else reshaped_dim(_shape(operand), _shape(out), d) for d in (q, k))
        elif name == "squeeze":
            gone = sorted(int(d) for d in op.params["dimensions"])
            found[out] = tuple(None if d is None else d - sum(g < d for g in gone) for d in (q, k))
        elif name in _COMBINE:
            axes = sorted(int(a) for a in op.params["axes"])
            if q in axes or (k in axes and axes != [k]):
                raise _unreachable(f"its weights are computed with a {name} over the queries' dim, or over the keys' "
                                   "and other dims together")
            if k in axes:
                reductions.append(index)
            found[out] = tuple(None if d is None or d in axes else d - sum(a < d for a in axes) for d in (q, k))
        elif len(op.outvars) == 1 and all(len(_shape(v)) in (0, len(_shape(out))) for v in op.invars):
            found[out] = _merged(found, [v for v in op.invars if _is_var(v) and v in derived])
        else:
            raise _unreachable(f"its weights are computed with a {name}, which mixes positions")
    if weights not in derived:
        raise _unreachable("what it multiplies the values by is not computed from its scores")
    inside, sides = _side_values(ops, derived, found)
    return _Weights(ops, derived, found, reductions, inside, sides)


def _side_values(ops: list[_Op], derived: set, found: dict) -> tuple[set, list]:
    """Which ops not computed from the scores run per block too (those that move or combine values
    elementwise: a mask's broadcast, a comparison), with their values' dims followed back from
    where the weights' ops read them; and the values they start from, computed whole (``found``
    gets their dims)."""
    needed, outside, inside = set(), set(), set()
    computed = derived_ops(ops, derived)
    for index in reversed(range(len(ops))):
        op = ops[index]
        operands = [v for v in op.invars if _is_var(v) and v not in derived and _shape(v)]
        if index in computed:
            for v in operands:
                needed.add(v)
                if _elementwise(op):
                    found.setdefault(v, found[op.outvars[0]])
            continue
        if not any(v in needed for v in op.outvars) or any(v in outside for v in op.outvars) or not _movable(op):
            outside.update(operands)
            continue
        inside.add(index)
        out = op.outvars[0]
        for v in operands:
            needed.add(v)
            found.setdefault(v, _back(op, v, found.get(out, (None, None))))
    made = {v for index in inside for v in ops[index].outvars}
    starts = [v for v in dict.fromkeys(v for op in ops for v in op.invars if _is_var(v) or isinstance(v, _Const))
              if v in needed and v not in made and v not in derived]
    return inside, starts


def derived_ops(ops: list[_Op], derived: set) -> set[int]:
    return {i for i, op in enumerate(ops) if any(_is_var(v) and v in derived for v in op.invars)}


def _elementwise(op: _Op) -> bool:
    """One result, computed elementwise from operands of its rank (or scalars)."""
    if len(op.outvars) != 1 or op.primitive.name in _MOVING:
        return False
    rank = len(_shape(op.outvars[0]))
    ranks = [len(_shape(v)) for v in op.invars]
    return rank in ranks and all(r in (0, rank) for r in ranks)


def _movable(op: _Op) -> bool:
    """Computes the same values at a block's shapes from the block of its operands."""
    return _elementwise(op) or op.primitive.name in ("broadcast_in_dim", "transpose", "reshape", "squeeze")


def _back(op: _Op, operand: Any, roles: tuple) -> tuple:
    """The (queries, keys) dims of ``operand`` of ``op`` (one of :func:`_movable`'s), from its result's."""
    name, shape, out = op.primitive.name, _shape(operand), _shape(op.outvars[0])

    def each(dim: int | None) -> int | None:
        if dim is None:
            return None
        if name == "broadcast_in_dim":
            found = [d for d, b in enumerate(op.params["broadcast_dimensions"]) if int(b) == dim]
            return found[0] if found and shape[found[0]] == out[dim] else None
        if name == "transpose":
            return int(op.params["permutation"][dim])
        if name == "reshape":
            return reshaped_dim(out, shape, dim)
        if name == "squeeze":
            kept = [d for d in range(len(shape)) if d not in {int(g) for g in op.params["dimensions"]}]
            return kept[dim]
        return dim if len(shape) == len(out) else None

    return each(roles[0]), each(roles[1])


def _merged(found: dict, operands: list) -> tuple:
    dims = [found.get(v, (None, None)) for v in operands]
    return tuple(next((d[i] for d in dims if d[i] is not None), None) for i in (0, 1))


def _unreachable(what: str) -> ValueError:
    return ValueError(
        f"ContextParallel(method='ring') cannot run this attention in blocks of keys: {what}. Use "
        "method='all_gather' (which runs any attention context parallelism finds).")


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
        ops = _flatten([eqns[i] for i in region], alias)
        weights = alias.get(weights, weights)  # a call's result: the variable its body computes it in
        info = _weights(ops, scores, dims[(attention.scores, "out")], weights)
        env: dict = {}
        val = lambda v: v.val if isinstance(v, core.Literal) else v.value if isinstance(v, _Const) else env[v] if v in env else read(v)  # noqa: E731
        per_block = derived_ops(ops, info.derived) | info.inside
        for index, op in enumerate(ops):  # the side values the blocks start from (a mask, dropout's bits), whole
            if index not in per_block:
                outs = op.primitive.bind(*[val(v) for v in op.invars], **op.primitive.get_bind_params(op.params))
                env.update(zip(op.outvars, outs if op.primitive.multiple_results else [outs]))
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
        side_specs = [spec(len(_shape(v)), q if q is not None and _shape(v)[q] == queries else None)
                      for v, (q, _) in zip(info.sides, side_dims)]
        out_dim = dims[(attention.values, "out")][0]
        size, block = self.size, keys // self.size

        def blocked(shape: Sequence[int], roles: tuple) -> tuple:
            q, k = roles
            return tuple(queries // size if d == q and n == queries else block if d == k and n == keys else n
                         for d, n in enumerate(shape))

        def one_block(q, kb, source, finals, sides, until):
            local: dict = {scores: _bind(scores_eqn, [q, kb] if query_side == 0 else [kb, q])[0]}
            for v, (qd, kd), x in zip(info.sides, side_dims, sides):
                if kd is not None and x.shape[kd] == keys:
                    x = jax.lax.dynamic_slice_in_dim(x, source * block, block, axis=kd)
                local[v] = x
            get = lambda v: local[v] if _is_var(v) and v in local else val(v)  # noqa: E731
            for index, op in enumerate(ops):
                if index not in per_block:
                    continue
                if index in finals:
                    local[op.outvars[0]] = finals[index]
                    continue
                # Shardings traced outside the ring name the mesh before its axis went manual: left to the body.
                params = {name: None if name in ("sharding", "out_sharding") else value for name, value in op.params.items()}
                if op.primitive.name in _SHAPED:
                    key = _SHAPED[op.primitive.name]
                    params[key] = blocked(params[key], info.roles.get(op.outvars[0], (None, None)))
                outs = op.primitive.bind(*[get(v) for v in op.invars], **op.primitive.get_bind_params(params))
                local.update(zip(op.outvars, outs if op.primitive.multiple_results else [outs]))
                if index == until:
                    return local[op.outvars[0]]
            return local[weights]

        def body(q, k, v, *sides):
            index = jax.lax.axis_index(self.axis)
            perm = [(i, (i + 1) % size) for i in range(size)]
            finals: dict = {}
            for reduction in [*info.reductions, None]:  # a pass round the ring for each, then the values'
                if reduction is None:
                    part = jax.checkpoint(lambda kb, vb, source: _bind(values_eqn, _sides(
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
                        out_specs=spec(len(_shape(values_eqn.outvars[0])), out_dim), manual_axes={self.axis})
        return run(q_in, k_in, v_in, *side_values)


def region(jaxpr: Any, attention: Any) -> list[int]:
    """The indices of the equations between an attention's two contractions computed from its
    scores; raises if anything else reads them (the ring never holds them whole)."""
    eqns = jaxpr.eqns
    derived, found = set(eqns[attention.scores].outvars), []
    for index in range(attention.scores + 1, attention.values):
        if any(_is_var(v) and v in derived for v in eqns[index].invars):
            derived.update(eqns[index].outvars)
            found.append(index)
    inside = {attention.scores, *found, attention.values}
    read_outside = [v for i, e in enumerate(eqns) if i not in inside for v in e.invars if _is_var(v) and v in derived]
    if read_outside or any(_is_var(v) and v in derived for v in jaxpr.outvars):
        raise _unreachable("the model also reads its scores or weights elsewhere (returns or stores them), "
                          "and a ring never holds them whole")
    return found


def _sides(weights: Any, values: Any, weights_side: int) -> list:
    return [weights, values] if weights_side == 0 else [values, weights]


def _bind(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]

"""A mixture of experts' tokens sent to the devices holding their experts, in a traced computation.

Expert parallelism (:class:`parallax.ExpertParallel`) splits the experts dim of the params that
stack a mixture of experts' weights over a mesh axis, and the batch over the same axis for the
layers outside the experts. Left to itself the compiler may gather every expert's weights on every
device instead of moving the tokens. :func:`expert_parallel` re-runs a function's traced computation
with every matmul that reads the experts' weights along their experts dim pinned: its result (and,
where the experts dim is batched, its other operand: the tokens dispatched to each expert) split
along the experts dim over the axis, every other dim left to the compiler. Each device then
computes only its experts' tokens; the tokens reach them as the model dispatches them (an
all-to-all where the model groups them by expert with a dispatch mask, an all-gather where every
expert sees every token) and the results come back the same way. Where the dispatched tokens
still hold the batch's rows (one group per sequence: ``[experts, groups, capacity, d]``), they are
pinned split along the rows first, as the devices computed them, and then along the experts, so
that the compiler moves them with an all-to-all rather than gathering every device's tokens; the
experts' results are pinned back along the rows before the model combines them. A stack of
blocks (a ``scan``) is opened, so the matmuls of each layer are pinned too. What the model
computes is unchanged: routers, capacities and load-balancing losses are the one device's, over
the global batch.

Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("expert",))
    >>> def moe(params, tokens):  # tokens already dispatched: [experts, capacity, d]
    ...     return jnp.einsum("ecd,edh->ech", tokens, params["w"]).sum()
    >>> params, tokens = {"w": jnp.ones((4, 3, 5))}, jnp.ones((4, 2, 3))
    >>> split = expert_parallel(moe, mesh=mesh, axis="expert")
    >>> bool(jnp.allclose(jax.jit(split)(params, tokens), moe(params, tokens)))
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from parallax._tree import path_str
from parallax.jaxpr.chains import CALLS, REMAT, call_body, params_within
from parallax.jaxpr.follow_dims import Follow, dot_dim, follow_rows, moved, note, split_scan
from parallax.jaxpr.rebind import bind_eqn
from parallax.jaxpr.siblings import Siblings, find_siblings
from parallax.jaxpr.tp_layout import expert_dims
from parallax.models.traced import params_loss
from parallax.parallel.experts.listed import holds_modules, run_siblings, schedule
from parallax.parallel.experts.part import ruled_dims

_OPENED = (*CALLS, *REMAT)


def expert_parallel(fn: Callable, *, mesh: Mesh, axis: str, rules: Sequence[tuple[str, int]] = (),
                    listed: bool = False, batch_argnum: int | None = None,
                    batch_axes: Sequence[str] | None = None) -> Callable:
    """``fn(params, *rest)`` with every matmul over the experts' weights split along the experts dim.

    Args:
        fn: the function (a loss), params first.
        mesh: the mesh (the axis and any others the surrounding step uses).
        axis: the expert axis.
        rules: ``(regex, dim)`` pairs naming the experts dim of params by path (``"moe/w_in"``),
            besides those the trace shows (:func:`parallax.jaxpr.tp_layout.expert_dims`).
        listed: also run each list of experts (calls of one rematerialised module on their own
            params, :mod:`parallax.jaxpr.siblings`) as one batch split by expert
            (:mod:`parallax.parallel.experts.listed`).
        batch_argnum: the argument holding the batch (its leaves' rows on their leading dim),
            followed to the dispatched tokens; ``None``: no rows are followed.
        batch_axes: the mesh axes the batch's rows are split over, in order (``axis`` among
            them); by default ``axis`` alone.

    Returns:
        A function of the same arguments, returning what ``fn`` returns.
    """

    every = tuple(batch_axes or (axis,))
    rest = tuple(name for name in every if name != axis)

    def pin(x: Any, dim: int | None, rows: int | None = None) -> Any:
        """``x`` split along ``dim`` by expert (its ``rows`` dim over the other batch axes), or
        with ``dim`` ``None`` along its ``rows`` dim over every batch axis. Where those axes are
        not automatic in the mesh in context (a trace of shapes alone, or inside a pipeline's
        stages, where the stage axis is manual), the compiler places ``x`` as it would."""
        context = jax.sharding.get_abstract_mesh()
        if context.empty or any(context.axis_types[context.axis_names.index(name)] == AxisType.Manual
                                for name in context.axis_names):
            return x
        dims: list[Any] = [PartitionSpec.UNCONSTRAINED] * x.ndim
        if dim is not None:
            dims[dim] = (axis,)
        if rows is not None and rows != dim:
            dims[rows] = rest if dim is not None else every
        for at, names in enumerate(dims):
            if isinstance(names, tuple):
                size = math.prod(mesh.shape[name] for name in names)
                if x.shape[at] % size:  # a split the axes do not divide is the compiler's to choose
                    return x
                dims[at] = None if not names else names[0] if len(names) == 1 else names
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*dims)))

    def run(params: Any, *rest: Any) -> Any:
        paths = [path_str(key_path) for key_path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(params, *rest)
        experts = {**expert_dims(closed, paths), **ruled_dims(paths, rules)}
        tracked = {closed.jaxpr.invars[index]: experts[path] for index, path in enumerate(paths) if path in experts}
        args = (params, *rest)
        first = len(jax.tree.leaves(args[:batch_argnum])) if batch_argnum is not None else 0
        count = len(jax.tree.leaves(args[batch_argnum])) if batch_argnum is not None else 0
        rows = {v: 0 for v in closed.jaxpr.invars[first:first + count] if v.aval.ndim}
        flags = [i < len(paths) for i in range(len(closed.jaxpr.invars))] if listed else None
        outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), Follow(tracked, rows), pin, flags)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def stacked_experts(model: Any, example_batch: Any, loss_fn: Any, rng_streams: Sequence[str] = ("dropout",)) -> int:
    """How many experts ``model`` stacks in the params of its mixture of experts (0: none; the
    greatest common divisor where several mixtures differ), read from its trace (the model
    initialised and run from shapes: nothing is allocated)."""
    closed, paths, shapes = params_loss(model, example_batch, loss_fn, rng_streams)
    found = expert_dims(closed, paths)
    return math.gcd(*(int(shapes[paths.index(path)][dim]) for path, dim in found.items()))


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], follow: Follow, pin: Callable,
              param_flags: Sequence[bool] | None = None) -> list[Any]:
    """Evaluates ``jaxpr``, following the experts dim, the batch's rows dim and the layout by
    expert of values (``follow``) and pinning the matmuls over the experts dim; with
    ``param_flags`` (which invars are params), each list of experts run as one batch."""
    values: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    values.update(zip(jaxpr.invars, args))
    tracked, rows = follow.tracked, follow.rows
    read = lambda v: v.val if isinstance(v, core.Literal) else values[v]
    order: list = list(range(len(jaxpr.eqns)))
    params: set = set()
    if param_flags is not None:
        params = params_within(jaxpr, param_flags)
        groups = find_siblings(jaxpr, lambda v: v in params, consts)
        order = schedule(jaxpr.eqns, groups) if groups else order
    for item in order:
        if isinstance(item, Siblings):
            for call, outs in zip(item.calls, run_siblings(item, jaxpr.eqns, read, pin, rows)):
                values.update(zip(jaxpr.eqns[call].outvars, outs))
            continue
        eqn = jaxpr.eqns[item]
        ins = [read(v) for v in eqn.invars]
        dims, row_dims, laid = follow.at(eqn)
        name = eqn.primitive.name
        if param_flags is not None and holds_modules(eqn):  # a call holding a list of experts: opened
            flags = [not isinstance(v, core.Literal) and v in params for v in eqn.invars]
            outs = _open(eqn, ins, follow, pin, flags)
        elif all(d is None for d in dims):
            outs = bind_eqn(eqn, ins)
            follow_rows(eqn, row_dims, rows)
        elif name == "dot_general":
            outs, out_dim, by_expert = _matmul(eqn, ins, dims, row_dims, laid, pin)
            if out_dim is not None:
                tracked[eqn.outvars[0]] = out_dim
            if by_expert:
                follow.laid.add(eqn.outvars[0])
            follow_rows(eqn, row_dims, rows)
        elif name in _OPENED:
            outs = _open(eqn, ins, follow, pin)
        elif name == "scan" and not any(d is not None for d in split_scan(eqn, dims)[1]):
            outs = _scan(eqn, ins, follow, pin)
        else:
            outs = bind_eqn(eqn, ins)
            follow_rows(eqn, row_dims, rows)
            for index, out in enumerate(eqn.outvars):
                at = moved(eqn, dims, out)
                if at is not None:
                    tracked[out] = at
                    same = tuple(out.aval.shape) in [tuple(v.aval.shape) for v in eqn.invars]
                    if any(laid) and (same or name in ("transpose", "reshape")):
                        follow.laid.add(out)  # elementwise of, or a view of, a value laid out by expert: kept so
                        outs[index] = pin(outs[index], at, rows.get(out))
        values.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _scan(eqn: Any, ins: list, follow: Follow, pin: Callable) -> list[Any]:
    """A ``scan`` reading the experts' weights (a stack of MoE blocks), run with each iteration's
    matmuls pinned: its carry's rows followed in, its stepped-over values' dims one lower."""
    body, params = eqn.params["jaxpr"], eqn.params
    consts, carry, xs = split_scan(eqn, ins)
    lower = lambda ds: [None if d is None or d == 0 else d - 1 for d in ds]
    dims, row_dims, _ = follow.at(eqn)
    (c_dims, k_dims, x_dims), (c_rows, k_rows, x_rows) = split_scan(eqn, dims), split_scan(eqn, row_dims)
    inner_dims, inner_rows = c_dims + k_dims + lower(x_dims), c_rows + k_rows + lower(x_rows)

    def step(state: Any, x: Any) -> Any:
        inner = follow.inside(body.jaxpr.invars, inner_dims, inner_rows, [False] * len(inner_dims))
        outs = _evaluate(body.jaxpr, body.consts, [*consts, *state, *x], inner, pin)
        return outs[:len(carry)], outs[len(carry):]

    final, ys = jax.lax.scan(step, carry, xs, length=params["length"], reverse=params["reverse"],
                             unroll=params["unroll"])
    note(follow.rows, eqn.outvars, k_rows)  # the activations carried through
    return [*final, *ys]


def _open(eqn: Any, ins: list, follow: Follow, pin: Callable, param_flags: Sequence[bool] | None = None) -> list:
    """A call or checkpoint reading a tracked value (or holding a list of experts), run with its
    matmuls pinned (a checkpoint kept, with its policy); its results' dims noted in ``follow``."""
    inner, inner_consts = call_body(eqn)
    dims, row_dims, laid = follow.at(eqn)
    found: list = []

    def opened(*args: Any) -> list[Any]:
        inside = follow.inside(inner.invars, dims, row_dims, laid)
        outs = _evaluate(inner, inner_consts, args, inside, pin, param_flags)
        found[:] = [inside]
        return outs

    call = opened
    if eqn.primitive.name in REMAT:
        call = jax.checkpoint(opened, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
    outs = list(call(*ins))
    follow.outside(found[0], inner.outvars, eqn.outvars)
    return outs


def _matmul(eqn: Any, ins: list, dims: list, row_dims: list, laid: list,
            pin: Callable) -> tuple[list, int | None, bool]:
    """A matmul reading a value along its experts dim, pinned: its result, where the experts dim
    lands, and whether the result is laid out by expert.

    The experts' weights batched with the tokens dispatched to them: the tokens pinned by expert.
    Tokens that are still laid out by the batch's rows (one group per sequence) are pinned along
    the rows first, as the devices computed them, so the compiler moves them with an all-to-all
    rather than gathering every device's tokens. A value with the experts dim as a free dim: a
    dispatch (a routing tensor laid out by rows) is computed where its rows are; a router (weights
    smaller than the tokens) gathers its weights rather than the tokens; the experts of a dense
    mixture (every expert on every token) are computed where their weights are. A matmul combining
    the experts' results (contracting the experts dim) takes them back along the rows first."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    shapes = [v.aval.shape for v in eqn.invars]
    free = [[d for d in range(len(shapes[s])) if d not in ((lc, rc)[s] + (lb, rb)[s])] for s in (0, 1)]
    for side, dim in enumerate(dims):
        if dim is None:
            continue
        other = 1 - side
        batch = (lb, rb)[side]
        if dim in batch:  # the experts' weights batched with the tokens dispatched to them
            k = list(batch).index(dim)
            ins = list(ins)
            at, held = (lb, rb)[other][k], row_dims[other]
            if not laid[other] and held is not None and held != at:  # tokens still laid out by rows
                ins[other] = pin(ins[other], None, held)
            ins[other] = pin(ins[other], at, held)
            rows = dot_dim(eqn, other, held) if held is not None else None
            return [pin(bind_eqn(eqn, ins)[0], k, rows)], k, True
        if dim in free[side]:
            at = len(lb) + (free[0].index(dim) if side == 0 else len(free[0]) + free[1].index(dim))
            out = bind_eqn(eqn, ins)[0]
            mine, theirs = row_dims[side], row_dims[other]
            rows = (dot_dim(eqn, side, mine) if mine is not None else
                    dot_dim(eqn, other, theirs) if theirs is not None and _nbytes(ins[side]) <= _nbytes(ins[other])
                    else None)
            if rows is not None:  # a dispatch, or a router: computed where the rows are
                return [pin(out, None, rows)], at, False
            return [pin(out, at)], at, True  # every expert's outputs (a dense mixture): split by expert
        held = row_dims[side]
        if laid[side] and held is not None and held != dim and dim in (lc, rc)[side]:
            ins = list(ins)  # the experts' results combined: back along the rows first
            ins[side] = pin(ins[side], None, held)
            return bind_eqn(eqn, ins), None, False
    return bind_eqn(eqn, ins), None, False  # contracted over the experts: combined, the compiler reduces it


def _nbytes(x: Any) -> int:
    return int(math.prod(jax.numpy.shape(x))) * jax.numpy.dtype(jax.numpy.result_type(x)).itemsize



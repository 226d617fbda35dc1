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
expert sees every token) and the results come back the same way. What the model computes is
unchanged: routers, capacities and load-balancing losses are the one device's, over the global batch.

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
from typing import Any, Callable, Sequence

import jax
from jax.extend import core
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax._tree import path_str
from parallax.models.listed_experts import holds_modules, run_siblings, schedule
from parallax.models.rebind import bind_eqn, reshaped_dim
from parallax.sharding.chains import REMAT, call_body, params_within
from parallax.sharding.expert_parallel import ruled_dims
from parallax.sharding.siblings import Siblings, find_siblings
from parallax.sharding.tp_layout import expert_dims

_OPENED = ("jit", "pjit", "closed_call", "core_call", *REMAT)


def expert_parallel(fn: Callable, *, mesh: Mesh, axis: str, rules: Sequence[tuple[str, int]] = (),
                    listed: bool = False) -> Callable:
    """``fn(params, *rest)`` with every matmul over the experts' weights split along the experts dim.

    Args:
        fn: the function (a loss), params first.
        mesh: the mesh (the axis and any others the surrounding step uses).
        axis: the expert axis.
        rules: ``(regex, dim)`` pairs naming the experts dim of params by path (``"moe/w_in"``),
            besides those the trace shows (:func:`parallax.sharding.tp_layout.expert_dims`).
        listed: also run each list of experts (calls of one rematerialised module on their own
            params, :mod:`parallax.sharding.siblings`) as one batch split by expert
            (:mod:`parallax.models.listed_experts`).

    Returns:
        A function of the same arguments, returning what ``fn`` returns.
    """

    def pin(x: Any, dim: int) -> Any:
        dims: list[Any] = [PartitionSpec.UNCONSTRAINED] * x.ndim
        dims[dim] = axis
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*dims)))

    def run(params: Any, *rest: Any) -> Any:
        paths = [path_str(key_path) for key_path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(params, *rest)
        experts = {**expert_dims(closed, paths), **ruled_dims(paths, rules)}
        tracked = {closed.jaxpr.invars[index]: experts[path] for index, path in enumerate(paths) if path in experts}
        flags = [i < len(paths) for i in range(len(closed.jaxpr.invars))] if listed else None
        outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves((params, *rest)), tracked, pin, flags)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def stacked_experts(model: Any, example_batch: Any, loss_fn: Any, rng_streams: Sequence[str] = ("dropout",)) -> int:
    """How many experts ``model`` stacks in the params of its mixture of experts (0: none; the
    greatest common divisor where several mixtures differ), read from its trace (the model
    initialised and run from shapes: nothing is allocated)."""
    from parallax.models import ModelRun, adapter_for

    adapter = adapter_for(model)
    key = jax.random.PRNGKey(0)
    rngs = {name: jax.random.fold_in(key, i) for i, name in enumerate(("params", *rng_streams))}
    params, state = jax.eval_shape(lambda: adapter.init(rngs, example_batch, loss_fn, ()))
    params = adapter.unbox(params)
    paths = [path_str(key_path) for key_path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def loss(params: Any, state: Any, batch: Any) -> Any:
        return adapter.apply(params, state, batch, rngs=rngs, loss_fn=loss_fn, run=ModelRun(train=True))

    shapes = [leaf.shape for leaf in jax.tree.leaves(params)]
    found = expert_dims(jax.make_jaxpr(loss)(params, state, example_batch), paths)
    return math.gcd(*(int(shapes[paths.index(path)][dim]) for path, dim in found.items()))


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], tracked: dict, pin: Callable,
              param_flags: Sequence[bool] | None = None) -> list[Any]:
    """Evaluates ``jaxpr``, following the experts dim of ``tracked`` values and pinning the matmuls
    over it; with ``param_flags`` (which invars are params), each list of experts run as one batch."""
    values: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    values.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else values[v]  # noqa: E731
    order: list = list(range(len(jaxpr.eqns)))
    params: set = set()
    if param_flags is not None:
        params = params_within(jaxpr, param_flags)
        groups = find_siblings(jaxpr, lambda v: v in params, consts)
        order = schedule(jaxpr.eqns, groups) if groups else order
    for item in order:
        if isinstance(item, Siblings):
            for call, outs in zip(item.calls, run_siblings(item, jaxpr.eqns, read, pin)):
                values.update(zip(jaxpr.eqns[call].outvars, outs))
            continue
        eqn = jaxpr.eqns[item]
        ins = [read(v) for v in eqn.invars]
        dims = [None if isinstance(v, core.Literal) else tracked.get(v) for v in eqn.invars]
        name = eqn.primitive.name
        if param_flags is not None and holds_modules(eqn):  # a call holding a list of experts: opened
            flags = [not isinstance(v, core.Literal) and v in params for v in eqn.invars]
            outs, out_dims = _open(eqn, ins, dims, pin, flags)
            tracked.update({v: d for v, d in zip(eqn.outvars, out_dims) if d is not None})
        elif all(d is None for d in dims):
            outs = bind_eqn(eqn, ins)
        elif name == "dot_general":
            outs, out_dim = _matmul(eqn, ins, dims, pin)
            if out_dim is not None:
                tracked[eqn.outvars[0]] = out_dim
        elif name in _OPENED:
            outs, out_dims = _open(eqn, ins, dims, pin)
            tracked.update({v: d for v, d in zip(eqn.outvars, out_dims) if d is not None})
        else:
            outs = bind_eqn(eqn, ins)
            for out in eqn.outvars:
                moved = _moved(eqn, dims, out)
                if moved is not None:
                    tracked[out] = moved
        values.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _open(eqn: Any, ins: list, dims: list, pin: Callable, param_flags: Sequence[bool] | None = None
          ) -> tuple[list, list]:
    """A call or checkpoint reading a tracked value (or holding a list of experts), run with its
    matmuls pinned (a checkpoint kept, with its policy); its results and where their experts dims are."""
    inner, inner_consts = call_body(eqn)
    out_dims: list = []

    def opened(*args: Any) -> list[Any]:
        found = {v: d for v, d in zip(inner.invars, dims) if d is not None}
        outs = _evaluate(inner, inner_consts, args, found, pin, param_flags)
        out_dims[:] = [None if isinstance(v, core.Literal) else found.get(v) for v in inner.outvars]
        return outs

    call = opened
    if eqn.primitive.name in REMAT:
        call = jax.checkpoint(opened, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
    return list(call(*ins)), out_dims


def _matmul(eqn: Any, ins: list, dims: list, pin: Callable) -> tuple[list, int | None]:
    """A matmul reading a value along its experts dim: pinned, and where the experts dim lands."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    shapes = [v.aval.shape for v in eqn.invars]
    free = [[d for d in range(len(shapes[s])) if d not in ((lc, rc)[s] + (lb, rb)[s])] for s in (0, 1)]
    for side, dim in enumerate(dims):
        if dim is None:
            continue
        batch = (lb, rb)[side]
        if dim in batch:  # the experts' weights batched with the tokens dispatched to them
            k = list(batch).index(dim)
            other = 1 - side
            ins = list(ins)
            ins[other] = pin(ins[other], (lb, rb)[other][k])
            return [pin(bind_eqn(eqn, ins)[0], k)], k
        if dim in free[side]:  # every expert's outputs (a dense dispatch): split by expert
            at = len(lb) + (free[0].index(dim) if side == 0 else len(free[0]) + free[1].index(dim))
            return [pin(bind_eqn(eqn, ins)[0], at)], at
    return bind_eqn(eqn, ins), None  # contracted over the experts: combined, the compiler reduces it


def _moved(eqn: Any, dims: list, out: Any) -> int | None:
    """Where the experts dim of ``eqn``'s tracked operand is in its result ``out`` (``None``: lost)."""
    operand, dim = next((i, d) for i, d in enumerate(dims) if d is not None)
    shape, name = tuple(eqn.invars[operand].aval.shape), eqn.primitive.name
    out_shape = tuple(getattr(out.aval, "shape", ()))
    if name == "transpose":
        return list(eqn.params["permutation"]).index(dim)
    if name == "broadcast_in_dim":
        return int(eqn.params["broadcast_dimensions"][dim])
    if name == "reshape":
        return reshaped_dim(shape, out_shape, dim)
    if name in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"):
        axes = [int(a) for a in eqn.params["axes"]]
        return None if dim in axes else dim - sum(a < dim for a in axes)
    if out_shape == shape or (len(out_shape) == len(shape) and out_shape[dim] == shape[dim]):
        return dim  # elementwise
    return None

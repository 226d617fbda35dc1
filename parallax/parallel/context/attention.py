"""The attention a traced computation already has, run over a sequence split across a mesh axis.

Context parallelism splits a model's sequence over an axis. Everything position-wise (embeddings,
norms, MLPs, the loss) then runs on each device's share of the positions; only attention mixes
positions. Attention, whatever code a model writes it with (linen's and NNX's attention modules,
``jax.nn.dot_product_attention``, a hand-written einsum as Hugging Face's Flax models have), traces
to the same two contractions: the scores ``q·kᵀ`` (over the batch and heads, contracting the head
dim, one sequence dim left from each side) and, after a softmax of the scores (a mask, dropout),
those weights times ``v`` (contracting the keys' dim). :func:`context_parallel` re-runs a function's
traced computation with each such pair pinned to the axis: the queries, the scores and the output
split along the queries' sequence dim, the keys and values whole along theirs (gathered: the
``all_gather`` method), every other dim left to the compiler. So each device computes its queries'
rows of the scores against every key, no device holds the whole sequence's scores, the model's
code runs unchanged, and what it computes (positions, masks, losses) means what it means on one
device.

Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("context",))
    >>> def attend(q, k, v):
    ...     return jax.nn.dot_product_attention(q, k, v, is_causal=True).sum()
    >>> q = k = v = jnp.ones((1, 8, 2, 4))
    >>> split = context_parallel(attend, mesh=mesh, axis="context")
    >>> bool(jnp.allclose(jax.jit(split)(q, k, v), attend(q, k, v)))
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax._compat import scan_counts
from parallax.jaxpr.chains import CALLS, REMAT, call_body
from parallax.jaxpr.rebind import bind_eqn, reshaped_dim
from parallax.models.traced import traced_loss
from parallax.parallel.context.balanced import Balanced
from parallax.parallel.context.ring import Ring
from parallax.parallel.context.weights import is_var, region

_INLINED = CALLS  # calls opened to reach the attention inside them
_OPAQUE = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")  # read, not opened
_OPENED = (*_INLINED, *REMAT, "scan")


@dataclasses.dataclass(frozen=True)
class Attention:
    """One attention in a jaxpr: the equation of its scores and of its weighted values, and where
    the queries' and the keys' sequence dims are in each operand and result.

    Attributes:
        scores: the index of the ``dot_general`` of ``q·kᵀ``.
        values: the index of the ``dot_general`` of the weights times ``v``.
        dims: ``{(equation index, operand 0 | 1 | "out"): (split dim, whole dim)}``: each operand and
            result of the two to pin, its queries' dim split over the axis (``None``: none) and its
            keys' dim whole (``None``: none).
        queries, keys: the sequence lengths of the queries and of the keys.
    """

    scores: int
    values: int
    dims: dict
    queries: int
    keys: int


def _dims(eqn: Any) -> tuple[tuple, tuple, list[int], list[int]]:
    """A ``dot_general``'s contracting and batch dims and each side's free dims."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.ndim for v in eqn.invars)
    return ((lc, rc), (lb, rb), [d for d in range(lhs) if d not in (*lc, *lb)],
            [d for d in range(rhs) if d not in (*rc, *rb)])


def _moved(eqn: Any, operand: int, dims: tuple[int, int]) -> list[tuple[int, int] | None]:
    """Where the (queries, keys) dims of ``eqn``'s operand at ``operand`` are in each of its results."""
    name, shape = eqn.primitive.name, tuple(eqn.invars[operand].aval.shape)
    if name == "transpose":
        perm = list(eqn.params["permutation"])
        return [tuple(perm.index(d) for d in dims)]
    if name == "broadcast_in_dim":
        return [tuple(int(eqn.params["broadcast_dimensions"][d]) for d in dims)]
    if name == "reshape":
        moved = tuple(reshaped_dim(shape, tuple(eqn.outvars[0].aval.shape), d) for d in dims)
        return [None if None in moved else moved]
    inner = _body(eqn)
    if inner is not None and name != "scan":
        return _track(inner[0], {inner[0].invars[operand]: dims}, outputs=True)
    return [dims if tuple(getattr(v.aval, "shape", ())) == shape else None for v in eqn.outvars]


def _track(jaxpr: Any, tracked: dict, outputs: bool = False) -> Any:
    """The (queries, keys) dims of every value computed from ``tracked`` in ``jaxpr``, through any
    equation but a ``dot_general`` (``outputs``: those of its outputs, in order)."""
    tracked = dict(tracked)
    for eqn in jaxpr.eqns:
        _follow(eqn, tracked)
    if outputs:
        return [None if isinstance(v, core.Literal) else tracked.get(v) for v in jaxpr.outvars]
    return tracked


def _follow(eqn: Any, tracked: dict) -> None:
    """Adds to ``tracked`` the (queries, keys) dims of ``eqn``'s results computed from tracked operands."""
    for operand, v in enumerate(eqn.invars):
        if isinstance(v, core.Literal) or v not in tracked or eqn.primitive.name == "dot_general":
            continue
        for out, dims in zip(eqn.outvars, _moved(eqn, operand, tracked[v])):
            if dims is not None:
                tracked.setdefault(out, dims)


def find_attention(jaxpr: Any) -> list[Attention]:
    """The attentions computed in ``jaxpr`` itself (not inside its calls), in the order they run.

    A pair of ``dot_general`` equations: the scores, batched over some dims (batch, heads) with one
    free dim on the keys' side (their sequence) and the queries' sequence among the other side's
    free dims, and a later one that contracts a value computed from the scores (through a mask, a
    softmax, dropout, transposes and reshapes) over the keys' dim and keeps the queries' dim.
    """
    eqns = jaxpr.eqns
    found, taken = [], set()
    for index, eqn in enumerate(eqns):
        if eqn.primitive.name != "dot_general" or index in taken:
            continue
        _, (lb, _), lhs_free, rhs_free = _dims(eqn)
        if not lb:
            continue
        for query_side in (0, 1):
            query_free, key_free = (lhs_free, rhs_free) if query_side == 0 else (rhs_free, lhs_free)
            if len(key_free) != 1 or not query_free:
                continue
            keys = int(eqn.invars[1 - query_side].aval.shape[key_free[0]])
            query_shape = eqn.invars[query_side].aval.shape
            query_dim = max(query_free, key=lambda d: (query_shape[d] == keys, query_shape[d]))
            at = ({d: len(lb) + i for i, d in enumerate(lhs_free)},  # where each side's free dims are in the result
                  {d: len(lb) + len(lhs_free) + i for i, d in enumerate(rhs_free)})
            out = (at[query_side][query_dim], at[1 - query_side][key_free[0]])
            match = _weighted_values(eqns, index, out)
            if match is None:
                continue
            values, dims = match
            dims[(index, query_side)] = (query_dim, None)
            dims[(index, 1 - query_side)] = (None, key_free[0])
            dims[(index, "out")] = out
            found.append(Attention(index, values, dims, int(query_shape[query_dim]), keys))
            taken.add(values)
            break
    return found


def _weighted_values(eqns: Sequence[Any], index: int, out: tuple[int, int]) -> tuple[int, dict] | None:
    """The equation after ``index`` that contracts the scores' weights over the keys' dim, keeping
    the queries' dim, and the dims to pin in it; ``None`` if there is none."""
    tracked = {eqns[index].outvars[0]: out}
    for later_index in range(index + 1, len(eqns)):
        later = eqns[later_index]
        if later.primitive.name == "dot_general":
            (lc, rc), (lb, _), lhs_free, rhs_free = _dims(later)
            for side, (contract, other_contract, free) in enumerate(((lc, rc, lhs_free), (rc, lc, rhs_free))):
                operand = later.invars[side]
                dims = None if isinstance(operand, core.Literal) else tracked.get(operand)
                if dims is None or tuple(contract) != (dims[1],) or dims[0] not in free:
                    continue
                query_out = len(lb) + (free.index(dims[0]) if side == 0 else len(lhs_free) + free.index(dims[0]))
                return later_index, {(later_index, side): dims, (later_index, 1 - side): (None, other_contract[0]),
                                     (later_index, "out"): (query_out, None)}
        _follow(later, tracked)
    return None


def holds_attention(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` computes an attention, in itself or in a call, scan or checkpoint inside it
    (not inside a custom derivative's function, which :func:`context_parallel` does not open)."""
    if find_attention(jaxpr):
        return True
    return any(eqn.primitive.name in _OPENED and holds_attention(call_body(eqn)[0]) for eqn in jaxpr.eqns)


def model_has_attention(model: Any, example_batch: Any, loss_fn: Any,
                        rng_streams: Sequence[str] = ("dropout",)) -> bool:
    """Whether ``loss_fn(model, batch)`` computes an attention :func:`context_parallel` reaches
    (the model initialised and run from shapes: nothing is allocated)."""
    return holds_attention(traced_loss(model, example_batch, loss_fn, rng_streams).jaxpr)


def _body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    name = eqn.primitive.name
    if name in (*_INLINED, *REMAT, "scan", *_OPAQUE):
        inner = call_body(eqn)
        return inner if inner[0] is not None else None
    return None


@dataclasses.dataclass(frozen=True)
class _Pin:
    mesh: Mesh
    axis: str
    method: str = "all_gather"
    load_balance: bool = False
    block: int = 512

    def __call__(self, x: Any, split: int | None = None, whole: int | None = None) -> Any:
        """``x`` with its dim ``split`` over the axis and its dim ``whole`` on no axis, the rest free."""
        dims: list[Any] = [PartitionSpec.UNCONSTRAINED] * x.ndim
        if split is not None:
            dims[split] = self.axis
        if whole is not None:
            dims[whole] = None
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*dims)))


def context_parallel(fn: Callable, *, mesh: Mesh, axis: str, method: str = "all_gather",
                     load_balance: bool = False, block: int = 512) -> Callable:
    """``fn`` with every attention it computes split along its queries' sequence over ``mesh``'s ``axis``.

    Args:
        fn: the function (a model's forward pass, a loss).
        mesh: the mesh (the axis and any others the surrounding step uses).
        axis: the context axis.
        method: ``"all_gather"`` (each device gathers the keys and values whole) or ``"ring"``
            (:mod:`parallax.parallel.context.ring`: passed round the axis a block at a time).
        load_balance: skip the tiles of the scores the model's mask hides, the sequence reordered
            inside each attention so that every device skips as many
            (:mod:`parallax.parallel.context.balanced`).
        block: with ``load_balance``, the keys a softmax's tile takes a step (its ``block``).

    Returns:
        A function of the same arguments, returning what ``fn`` returns.

    Raises:
        ValueError: ``fn`` computes no attention this reaches (the message names where to route
            it), or a sequence length the axis does not divide (and what to pad it to).
    """
    size = int(mesh.shape[axis])
    pin = _Pin(mesh, axis, method, load_balance, block)

    def run(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        reached = _check(closed.jaxpr, size, axis, load_balance)
        if not reached:
            raise ValueError(
                f"ContextParallel({axis}) found no attention in the model to split over the sequence: no q·kᵀ "
                "contraction followed by the weights times v outside a custom_jvp/custom_vjp. Compute attention with "
                "flax's attention modules (nn.MultiHeadDotProductAttention, nnx.MultiHeadAttention), "
                "jax.nn.dot_product_attention (implementation='xla' or None) or an einsum of q and k, a softmax and "
                "an einsum with v.")
        outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), pin)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def _check(jaxpr: Any, size: int, axis: str, load_balance: bool = False) -> int:
    """How many attentions :func:`_evaluate` reaches in ``jaxpr``; raises for a length the axis's
    chunks (``size``, or ``2 × size`` balanced) do not divide."""
    count, parts = 0, 2 * size if load_balance else size
    for attention in find_attention(jaxpr):
        for what, length in (("queries", attention.queries), ("keys", attention.keys)):
            if length % parts:
                padded = -(-length // parts) * parts
                cut = (f"cuts the sequence into {parts} chunks, two per device," if load_balance else
                       "splits the sequence,")
                raise ValueError(
                    f"ContextParallel({axis}={size}{', load_balance=True' if load_balance else ''}) {cut} and an "
                    f"attention's {what} have length {length}, which {parts} does not divide: pad the sequence to "
                    f"{padded} (masking the padding, e.g. with the attention mask), or "
                    + ("load_balance=False." if load_balance and length % 2 else
                       f"use a context size that divides {length // (2 if load_balance else 1)}."))
        count += 1
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _OPENED:
            count += _check(call_body(eqn)[0], size, axis, load_balance)
    return count


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], pin: _Pin) -> list[Any]:
    """Evaluates ``jaxpr``, each attention's operands and results pinned by ``pin``; calls, scans and
    checkpoints holding an attention opened (a checkpoint kept, with its policy)."""
    values: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    values.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else values[v]
    attentions = find_attention(jaxpr)
    pinned = {i: a.dims for a in attentions for i in (a.scores, a.values)}
    rings, skipped = {}, set()
    if pin.method == "ring" or pin.load_balance:
        for a in attentions:
            rings[a.values] = (a, region(jaxpr, a))
            skipped.update((a.scores, *rings[a.values][1]))
    tiled = (Balanced(pin.mesh, pin.axis, gather=pin.method == "all_gather", block=pin.block) if pin.load_balance
             else Ring(pin.mesh, pin.axis))
    for index, eqn in enumerate(jaxpr.eqns):
        if index in skipped:
            continue
        if index in rings:
            values[eqn.outvars[0]] = tiled(jaxpr.eqns, *rings[index], read)
            continue
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if index in pinned:
            dims = pinned[index]
            ins = [pin(x, *dims[(index, side)]) if (index, side) in dims else x for side, x in enumerate(ins)]
            outs = [pin(bind_eqn(eqn, ins)[0], *dims[(index, "out")])]
        elif name in _OPENED and holds_attention(call_body(eqn)[0]):
            outs = _open(eqn, ins, pin)
        else:
            outs = bind_eqn(eqn, ins)
        values.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _open(eqn: Any, ins: Sequence[Any], pin: _Pin) -> list[Any]:
    """A call, checkpoint or scan holding an attention, run with its attentions pinned."""
    inner, inner_consts = call_body(eqn)
    name = eqn.primitive.name
    if name != "scan":
        opened = lambda *a: _evaluate(inner, inner_consts, a, pin)
        if name in REMAT:
            opened = jax.checkpoint(opened, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
        return list(opened(*ins))
    params = eqn.params
    num_consts, num_carry = scan_counts(params)
    consts, carry, xs = ins[:num_consts], ins[num_consts:num_consts + num_carry], ins[num_consts + num_carry:]

    def step(c: list, x: list) -> tuple[list, list]:
        outs = _evaluate(inner, inner_consts, [*consts, *c, *x], pin)
        return outs[:num_carry], outs[num_carry:]

    carry_out, ys = jax.lax.scan(step, list(carry), list(xs), length=params["length"], reverse=params["reverse"],
                                 unroll=params["unroll"])
    return [*carry_out, *ys]


def tiles_computed(fn: Callable, *args: Any, mesh: Mesh, axis: str, method: str = "all_gather") -> np.ndarray:
    """How many tiles of scores each device of ``axis`` computes for the first attention ``fn``
    computes (the others are run alike), of ``4 × size``: what load balancing evens out.

    Example:
        >>> mesh = jax.sharding.Mesh(jax.devices()[:4], ("context",))
        >>> causal = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
        >>> q = jnp.ones((1, 16, 2, 4))
        >>> tiles_computed(causal, q, q, q, mesh=mesh, axis="context").tolist()  # 9 of 16 each, not 16
        [9, 9, 9, 9]
    """
    closed = jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    attention = find_attention(jaxpr)[0]
    values = dict(zip(jaxpr.constvars, closed.consts))
    values.update(zip(jaxpr.invars, jax.tree.leaves(args)))
    for eqn in jaxpr.eqns[:attention.values]:
        values.update(zip(eqn.outvars, bind_eqn(eqn, [v.val if not is_var(v) else values[v] for v in eqn.invars])))
    read = lambda v: v.val if not is_var(v) else values[v]
    run = Balanced(mesh, axis, gather=method == "all_gather", count=True)
    return np.asarray(jax.jit(lambda: run(jaxpr.eqns, attention, region(jaxpr, attention), read)[1])())

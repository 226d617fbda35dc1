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
from typing import Any, Callable, Sequence

import jax
from jax.extend import core
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax._compat import scan_counts
from parallax.sharding.chains import REMAT, call_body

_INLINED = ("jit", "pjit", "closed_call", "core_call")  # calls opened to reach the attention inside them
_OPAQUE = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")


@dataclasses.dataclass(frozen=True)
class Attention:
    """One attention in a jaxpr: the equation of its scores and of its weighted values.

    Attributes:
        scores: the index of the ``dot_general`` of ``q·kᵀ``.
        values: the index of the ``dot_general`` of the weights times ``v``.
        query_dim, key_dim: the sequence dims of ``q`` and ``k``.
        weights_operand: which operand of ``values`` holds the weights (0 or 1).
        value_dim: the keys' dim of ``v`` (the one ``values`` contracts).
        queries: the sequence length of the queries; keys: of the keys.
    """

    scores: int
    values: int
    query_dim: int
    key_dim: int
    weights_operand: int
    value_dim: int
    queries: int
    keys: int


def _dims(eqn: Any) -> tuple[tuple, tuple, list[int], list[int]]:
    """A ``dot_general``'s contracting and batch dims and each side's free dims."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.ndim for v in eqn.invars)
    return (lc, rc), (lb, rb), [d for d in range(lhs) if d not in (*lc, *lb)], [d for d in range(rhs) if d not in (*rc, *rb)]


def find_attention(jaxpr: Any) -> list[Attention]:
    """The attentions computed in ``jaxpr`` itself (not inside its calls), in the order they run.

    A pair of ``dot_general`` equations: the scores, with batch dims and one free dim on each side
    (the queries' and the keys' sequence), and a later one that contracts a value computed from
    the scores, of their shape, over the keys' dim and batches over the same dims.
    """
    eqns = jaxpr.eqns
    found, taken = [], set()
    for index, eqn in enumerate(eqns):
        if eqn.primitive.name != "dot_general" or index in taken:
            continue
        _, (lb, _), lhs_free, rhs_free = _dims(eqn)
        if not lb or len(lhs_free) != 1 or len(rhs_free) != 1:
            continue
        shape = eqn.outvars[0].aval.shape
        batch, key_at = len(lb), len(lb) + 1  # the output is (batch..., queries, keys)
        derived = {eqn.outvars[0]}
        for later_index in range(index + 1, len(eqns)):
            later = eqns[later_index]
            operands = [v for v in later.invars if not isinstance(v, core.Literal)]
            if not any(v in derived for v in operands):
                continue
            if later.primitive.name == "dot_general":
                match = _weighted_values(later, derived, shape, batch, key_at)
                if match is not None:
                    weights_operand, value_dim = match
                    query_dim, key_dim = lhs_free[0], rhs_free[0]
                    found.append(Attention(index, later_index, query_dim, key_dim, weights_operand, value_dim,
                                           int(eqn.invars[0].aval.shape[query_dim]),
                                           int(eqn.invars[1].aval.shape[key_dim])))
                    taken.add(later_index)
                    break
            derived.update(later.outvars)
    return found


def _weighted_values(eqn: Any, derived: set, shape: tuple, batch: int, key_at: int) -> tuple[int, int] | None:
    """``(weights operand, v's keys dim)`` if ``eqn`` contracts weights of the scores' ``shape``
    (computed from them) over the keys' dim, batching over the scores' batch dims; else ``None``."""
    (lc, rc), (lb, rb), _, _ = _dims(eqn)
    for side, (contract, batched, other_contract) in enumerate(((lc, lb, rc), (rc, rb, lc))):
        operand = eqn.invars[side]
        if isinstance(operand, core.Literal) or operand not in derived or tuple(operand.aval.shape) != tuple(shape):
            continue
        if tuple(contract) == (key_at,) and tuple(batched) == tuple(range(batch)):
            return side, other_contract[0]
    return None


def holds_attention(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` computes an attention, in itself or in a call, scan or checkpoint inside it."""
    if find_attention(jaxpr):
        return True
    return any(_body(eqn) is not None and holds_attention(_body(eqn)[0]) for eqn in jaxpr.eqns)


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

    def __call__(self, x: Any, split: int | None = None, whole: int | None = None) -> Any:
        """``x`` with its dim ``split`` over the axis and its dim ``whole`` on no axis, the rest free."""
        dims: list[Any] = [PartitionSpec.UNCONSTRAINED] * x.ndim
        if split is not None:
            dims[split] = self.axis
        if whole is not None:
            dims[whole] = None
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*dims)))


def context_parallel(fn: Callable, *, mesh: Mesh, axis: str) -> Callable:
    """``fn`` with every attention it computes split along its queries' sequence over ``mesh``'s ``axis``.

    Args:
        fn: the function (a model's forward pass, a loss).
        mesh: the mesh (the axis and any others the surrounding step uses).
        axis: the context axis.

    Returns:
        A function of the same arguments, returning what ``fn`` returns.

    Raises:
        ValueError: ``fn`` computes no attention this reaches (the message names where to route
            it), or a sequence length the axis does not divide (and what to pad it to).
    """
    size = int(mesh.shape[axis])
    pin = _Pin(mesh, axis)

    def run(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        reached = _check(closed.jaxpr, size, axis)
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


def _check(jaxpr: Any, size: int, axis: str) -> int:
    """How many attentions :func:`_evaluate` reaches in ``jaxpr``; raises for a length ``size`` does not divide."""
    count = 0
    for attention in find_attention(jaxpr):
        for what, length in (("queries", attention.queries), ("keys", attention.keys)):
            if length % size:
                padded = -(-length // size) * size
                raise ValueError(
                    f"ContextParallel({axis}={size}) splits the sequence, and an attention's {what} have length "
                    f"{length}, which {size} does not divide: pad the sequence to {padded} (masking the padding, "
                    f"e.g. with the attention mask), or use a context size that divides {length}.")
        count += 1
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in (*_INLINED, *REMAT, "scan"):
            count += _check(call_body(eqn)[0], size, axis)
    return count


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], pin: _Pin) -> list[Any]:
    """Evaluates ``jaxpr``, each attention's operands and results pinned by ``pin``; calls, scans and
    checkpoints holding an attention opened (a checkpoint kept, with its policy)."""
    values: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    values.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else values[v]  # noqa: E731
    scores = {a.scores: a for a in find_attention(jaxpr)}
    weighted = {a.values: a for a in scores.values()}
    for index, eqn in enumerate(jaxpr.eqns):
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if index in scores:
            a = scores[index]
            ins = [pin(ins[0], split=a.query_dim), pin(ins[1], whole=a.key_dim)]
            out = _bind(eqn, ins)[0]  # (batch..., queries, keys)
            outs = [pin(out, split=out.ndim - 2, whole=out.ndim - 1)]
        elif index in weighted:
            a = weighted[index]
            w = a.weights_operand
            ins[w] = pin(ins[w], split=ins[w].ndim - 2, whole=ins[w].ndim - 1)
            ins[1 - w] = pin(ins[1 - w], whole=a.value_dim)
            (_, _), (lb, _), lhs_free, _ = _dims(eqn)
            query_at = len(lb) + (0 if w == 0 else len(lhs_free))
            outs = [pin(_bind(eqn, ins)[0], split=query_at)]
        elif name in (*_INLINED, *REMAT, "scan") and holds_attention(call_body(eqn)[0]):
            outs = _open(eqn, ins, pin)
        else:
            outs = _bind(eqn, ins)
        values.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _open(eqn: Any, ins: Sequence[Any], pin: _Pin) -> list[Any]:
    """A call, checkpoint or scan holding an attention, run with its attentions pinned."""
    inner, inner_consts = call_body(eqn)
    name = eqn.primitive.name
    if name != "scan":
        opened = lambda *a: _evaluate(inner, inner_consts, a, pin)  # noqa: E731
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

"""A list of identical blocks run as a loop over their params stacked, as a scanned stack runs.

Code that keeps its blocks in a list and calls them in turn (Hugging Face's Flax models, most
hand-written ones), each block rematerialised (``nn.remat``, ``jax.checkpoint``), traces to one
``checkpoint`` call per block (:mod:`parallax.jaxpr.chains` finds the run of them). Compiled as
it is, the step is unrolled: compile time grows with the depth (a 70B-shaped list of 80 blocks took
7.6 minutes to plan for 256 GPUs, its stack 14 s; looped, 64 s), and under FSDP the compiler schedules the
blocks' all-gathers early, holding several blocks' params at once (a list's peak 2.3 to 3.3 times
the same blocks stacked). :func:`scanned_lists` re-runs a function's traced computation with each
such run of calls replaced by one ``lax.scan`` over the blocks' params stacked along a new leading
axis (each call's checkpoint kept, with its policy): what a ``nn.scan`` of the block computes, the
same operations on the same values. The state keeps the user's tree; the stacking is a copy of
each device's share of the blocks' params, and of their gradients.

A run is left unrolled where a loop cannot express it: the model reads a block's output besides
the next block (every layer's hidden states), or an output besides the activations (attention
weights, a cache, updated statistics).

Example:
    >>> def block(w, h):
    ...     return jnp.tanh(h @ w)
    >>> def forward(ws, x):
    ...     for w in ws:
    ...         x = jax.checkpoint(block)(w, x)
    ...     return x.sum()
    >>> ws, x = [jnp.eye(3) * (i + 1) / 4 for i in range(4)], jnp.ones((2, 3))
    >>> looped = scanned_lists(forward)
    >>> [e.primitive.name for e in jax.make_jaxpr(looped)(ws, x).jaxpr.eqns if e.primitive.name == "scan"]
    ['scan']
    >>> bool(jnp.allclose(looped(ws, x), forward(ws, x)))
    True
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core

from parallax.jaxpr.chains import (
    CALLS,
    REMAT,
    Chain,
    call_body,
    find_chains,
    folded_constants,
    params_within,
    use_counts,
)
from parallax.jaxpr.rebind import bind_eqn

log = logging.getLogger("parallax")


def scanned_lists(fn: Callable, *, params_argnum: int = 0) -> Callable:
    """``fn`` with each list of identical checkpointed blocks it calls in turn run as a ``lax.scan``.

    Args:
        fn: the function (a model's forward pass, a loss).
        params_argnum: the argument holding the params (a block's own are read from them alone).

    Returns:
        A function of the same arguments, returning what ``fn`` returns; ``fn`` itself where it
        calls no such list.
    """
    def run(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flags = [i == params_argnum for i, arg in enumerate(args) for _ in jax.tree.leaves(arg)]
        found = _find(closed.jaxpr, flags, closed.consts)
        if found is None:
            return fn(*args)
        outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), found)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


@dataclasses.dataclass(frozen=True)
class _Found:
    """Where a jaxpr's loops are: its chains a loop runs, by their last call's index, and what the
    calls it opens (by index) hold."""
    loops: dict[int, Chain]
    inner: dict[int, _Found]


def _find(jaxpr: Any, flags: Sequence[bool], consts: Sequence[Any]) -> _Found | None:
    """The loops of ``jaxpr`` and of the calls it makes (``flags``: which invars are params), read
    once; ``None`` where there are none."""
    params = params_within(jaxpr, flags)
    uses = use_counts(jaxpr)
    loops = {}
    for chain in find_chains(jaxpr, lambda v: v in params, consts):
        calls = [jaxpr.eqns[i] for i in chain.calls]
        carried = all(uses.get(eqn.outvars[q], 0) == 1 for eqn in calls[:-1] for q in chain.carry_out)
        others = any(uses.get(v, 0) for eqn in calls for q, v in enumerate(eqn.outvars) if q not in chain.carry_out)
        typed = all(calls[0].invars[p].aval == calls[0].outvars[q].aval for p, q in zip(chain.carry, chain.carry_out))
        if carried and not others and typed:  # else left unrolled: a loop's carry keeps its type
            loops[chain.calls[-1]] = chain
    inner = {}
    for index, eqn in enumerate(jaxpr.eqns):
        body, body_consts = call_body(eqn) if eqn.primitive.name in CALLS else (None, ())
        held = None if body is None else _find(
            body, [not isinstance(v, core.Literal) and v in params for v in eqn.invars], body_consts)
        if held is not None:
            inner[index] = held
    return _Found(loops, inner) if loops or inner else None


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], found: _Found) -> list[Any]:
    """Evaluates ``jaxpr``, each of ``found``'s chains run as a ``lax.scan`` at its last call, the
    calls that hold one opened."""
    values: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    values.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else values[v]
    inside = {index for chain in found.loops.values() for index in chain.calls[:-1]}
    for index, eqn in enumerate(jaxpr.eqns):
        if index in inside:  # run in the loop, at the chain's last call
            continue
        if index in found.loops:
            outs = _loop(found.loops[index], [jaxpr.eqns[i] for i in found.loops[index].calls], read)
        elif index in found.inner:
            inner, inner_consts = call_body(eqn)
            outs = _evaluate(inner, inner_consts, [read(v) for v in eqn.invars], found.inner[index])
        else:
            outs = bind_eqn(eqn, [read(v) for v in eqn.invars])
        values.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _loop(chain: Chain, calls: Sequence[Any], read: Callable) -> list[Any]:
    """The chain's calls run as one ``lax.scan`` over what differs from call to call (each one's
    params, a key per block, the constants linen folds into its keys): the last call's outputs."""
    first, last = calls[0], calls[-1]
    log.debug("A list of %d identical checkpointed blocks runs as one loop over their params stacked "
              "(StepOptions(scan_lists=False) unrolls it).", len(calls))
    stepped = (*chain.weights, *chain.varying)
    xs = [jax.numpy.stack([read(eqn.invars[p]) for eqn in calls]) for p in stepped]
    if chain.folded:
        xs.append(jax.numpy.asarray([[folded_constants(call_body(eqn)[0])[i] for i in chain.folded] for eqn in calls],
                                    jax.numpy.uint32))
    operands = [read(v) for v in first.invars]
    body, body_consts = call_body(first)

    def call(*ordered: Any) -> list[Any]:  # the block's body, its folded constants the loop's
        *ordered, folds = ordered
        values: dict[Any, Any] = dict(zip(body.constvars, body_consts))
        values.update(zip(body.invars, ordered))
        fold = dict(zip(chain.folded, folds)) if chain.folded else {}
        get = lambda v: v.val if isinstance(v, core.Literal) else values[v]
        for i, eqn in enumerate(body.eqns):
            ins = [get(v) for v in eqn.invars]
            values.update(zip(eqn.outvars, bind_eqn(eqn, [ins[0], fold[i]] if i in fold else ins)))
        return [get(v) for v in body.outvars]

    if first.primitive.name in REMAT:
        call = jax.checkpoint(call, prevent_cse=first.params["prevent_cse"], policy=first.params["policy"])

    def step(carry: list, x: list) -> tuple[list, None]:
        ordered = list(operands)
        for p, value in [*zip(stepped, x), *zip(chain.carry, carry)]:
            ordered[p] = value
        outs = call(*ordered, x[-1] if chain.folded else None)
        return [outs[q] for q in chain.carry_out], None

    carry, _ = jax.lax.scan(step, [operands[p] for p in chain.carry], xs)
    results = [jax.numpy.zeros(v.aval.shape, v.aval.dtype) for v in last.outvars]
    for q, value in zip(chain.carry_out, carry):
        results[q] = value
    return results

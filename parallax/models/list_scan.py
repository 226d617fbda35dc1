"""A list of identical blocks run as a loop over their params stacked, as a scanned stack runs.

Code that keeps its blocks in a list and calls them in turn (Hugging Face's Flax models, most
hand-written ones), each block rematerialised (``nn.remat``, ``jax.checkpoint``), traces to one
``checkpoint`` call per block (:mod:`parallax.sharding.chains` finds the run of them). Compiled as
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

import logging
from typing import Any, Callable, Sequence

import jax
from jax.extend import core

from parallax.models.rebind import bind_eqn
from parallax.sharding.chains import REMAT, Chain, call_body, find_chains, folded_constants, params_within

log = logging.getLogger("parallax")
_INLINED = ("jit", "pjit", "closed_call", "core_call")  # calls opened to reach a list inside them


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
        if not _holds_list(closed.jaxpr, flags, closed.consts):
            return fn(*args)
        outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), flags)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def _loops(jaxpr: Any, flags: Sequence[bool], consts: Sequence[Any]) -> dict[int, Chain]:
    """The chains of ``jaxpr`` a loop runs, by their last call's index."""
    params = params_within(jaxpr, flags)
    uses: dict[Any, int] = {}
    for v in [*(v for eqn in jaxpr.eqns for v in eqn.invars), *jaxpr.outvars]:
        if not isinstance(v, core.Literal):
            uses[v] = uses.get(v, 0) + 1
    found = {}
    for chain in find_chains(jaxpr, lambda v: v in params, consts):
        calls = [jaxpr.eqns[i] for i in chain.calls]
        carried = all(uses.get(eqn.outvars[q], 0) == 1 for eqn in calls[:-1] for q in chain.carry_out)
        others = any(uses.get(v, 0) for eqn in calls for q, v in enumerate(eqn.outvars) if q not in chain.carry_out)
        typed = all(calls[0].invars[p].aval == calls[0].outvars[q].aval for p, q in zip(chain.carry, chain.carry_out))
        if carried and not others and typed:  # else left unrolled: a loop's carry keeps its type
            found[chain.calls[-1]] = chain
    return found


def _holds_list(jaxpr: Any, flags: Sequence[bool], consts: Sequence[Any]) -> bool:
    if _loops(jaxpr, flags, consts):
        return True
    params = params_within(jaxpr, flags)
    return any(_opened(eqn, params) for eqn in jaxpr.eqns if eqn.primitive.name in _INLINED)


def _inner_flags(eqn: Any, params: set) -> list[bool]:
    return [not isinstance(v, core.Literal) and v in params for v in eqn.invars]


def _opened(eqn: Any, params: set) -> bool:
    """Whether the call ``eqn`` holds a loopable chain (``params``: its caller's values read from params alone)."""
    inner, inner_consts = call_body(eqn)
    return inner is not None and _holds_list(inner, _inner_flags(eqn, params), inner_consts)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], flags: Sequence[bool]) -> list[Any]:
    """Evaluates ``jaxpr``, each loopable chain run as a ``lax.scan`` at its last call, the calls
    that hold one opened (``flags``: which of ``args`` are params)."""
    values: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    values.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else values[v]  # noqa: E731
    loops = _loops(jaxpr, flags, consts)
    inside = {index for chain in loops.values() for index in chain.calls[:-1]}
    params = params_within(jaxpr, flags)
    for index, eqn in enumerate(jaxpr.eqns):
        if index in inside:  # run in the loop, at the chain's last call
            continue
        if index in loops:
            outs = _loop(loops[index], [jaxpr.eqns[i] for i in loops[index].calls], read)
        elif eqn.primitive.name in _INLINED and _opened(eqn, params):
            inner, inner_consts = call_body(eqn)
            outs = _evaluate(inner, inner_consts, [read(v) for v in eqn.invars], _inner_flags(eqn, params))
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
        get = lambda v: v.val if isinstance(v, core.Literal) else values[v]  # noqa: E731
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

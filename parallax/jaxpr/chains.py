"""A model's list of identical blocks, as its traced loss shows them: a chain of calls.

Code that keeps its blocks in a list and calls them in a loop (Hugging Face's Flax GPT-2 and
Llama, most hand-written models) leaves no ``scan`` in its trace: the blocks' operations are
inlined one after another. Rematerialised (:class:`parallax.StepOptions`'s ``remat`` of the
block class), each call becomes one ``checkpoint`` equation whose operands are the block's params,
the activations and the values every block reads (a mask, the positions). :func:`find_chains`
reads the runs of such equations that compute the same thing on different params, each fed the
activations the one before returned. Only the jaxpr is read here.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.extend import core

REMAT = ("checkpoint", "remat2", "remat")  # jax.checkpoint's primitive, by its names across versions
CALLS = ("jit", "pjit", "closed_call", "core_call")  # the primitives that call a traced function as it is


@dataclasses.dataclass(frozen=True)
class Chain:
    """Calls of one block, each on the activations the one before returned.

    Attributes:
        calls: the calls' equation indices, in order.
        weights: the operand positions holding a call's own params (a layer).
        carry: the operand positions holding the activations.
        carry_out: the output positions that become the next call's ``carry``, in its order.
        varying: operand positions that differ from call to call but are not params (a random key
            given to each block).
        folded: the equations of the body whose key constant differs from call to call (a linen
            module folds its path into the random keys it makes): a value per block, like ``varying``.
    """

    calls: tuple[int, ...]
    weights: tuple[int, ...]
    carry: tuple[int, ...]
    carry_out: tuple[int, ...]
    varying: tuple[int, ...] = ()
    folded: tuple[int, ...] = ()


def find_chains(jaxpr: Any, is_param: Callable[[Any], bool], consts: Sequence[Any] = ()) -> list[Chain]:
    """The chains of two or more calls in ``jaxpr`` (not inside its calls), in the order they run.

    Args:
        jaxpr: a ``Jaxpr``.
        is_param: whether an operand (a ``Var``) is computed from the params alone.
        consts: the values of ``jaxpr``'s constvars (two equal constants are one value).
    """
    eqns = jaxpr.eqns
    calls = [i for i, eqn in enumerate(eqns) if eqn.primitive.name in REMAT]
    same = Recomputed(jaxpr, consts)
    text = {i: body_text(eqns[i].params["jaxpr"]) for i in calls}
    chains, taken = [], set()
    for start in calls:
        if start in taken:
            continue
        link = None
        members = [start]
        for following in calls:
            if following <= members[-1] or following in taken or text[following] != text[start]:
                continue
            found = _link(eqns[members[-1]], eqns[following], is_param, same)
            if found is None or (link is not None and found != link):
                break
            link, members = found, members + [following]
        if len(members) > 1:
            carry, carry_out, weights, varying = link
            constants = [folded_constants(eqns[i].params["jaxpr"]) for i in members]
            folded = tuple(i for i in constants[0] if len({c[i] for c in constants}) > 1)
            chains.append(Chain(tuple(members), weights, carry, carry_out, varying, folded))
            taken.update(members)
    return chains


def folded_constants(body: Any) -> dict[int, int]:
    """The constants ``body`` folds into random keys (``random_fold_in`` of a literal), by equation:
    a linen module folds the hash of its path into each key it makes, so blocks alike but for their
    place in the model differ there alone."""
    body = getattr(body, "jaxpr", body)
    return {i: int(eqn.invars[1].val) for i, eqn in enumerate(body.eqns)
            if eqn.primitive.name == "random_fold_in" and isinstance(eqn.invars[1], core.Literal)}


def body_text(body: Any) -> str:
    """``body`` printed with its folded key constants left out: what two calls of one block share."""
    body = getattr(body, "jaxpr", body)
    folded = folded_constants(body)
    eqns = [eqn.replace(invars=[eqn.invars[0], core.Literal(np.uint32(0), eqn.invars[1].aval)]) if i in folded else eqn
            for i, eqn in enumerate(body.eqns)]
    return str(body.replace(eqns=eqns))


def _link(before: Any, after: Any, is_param: Callable[[Any], bool], same: Recomputed) -> tuple | None:
    """How ``after`` continues ``before`` (carry, carry_out, weights, varying positions), or ``None``."""
    outs = {v: i for i, v in enumerate(before.outvars)}
    carry = tuple(p for p, v in enumerate(after.invars) if not isinstance(v, core.Literal) and v in outs)
    if not carry:
        return None
    weights, varying = [], []
    for position, (a, b) in enumerate(zip(before.invars, after.invars)):
        if position in carry or same(a, b):
            continue
        if is_param(a) and is_param(b):
            weights.append(position)
        else:
            varying.append(position)
    if not weights:
        return None
    return carry, tuple(outs[after.invars[p]] for p in carry), tuple(weights), tuple(varying)


class Recomputed:
    """Whether two values are the same: one value, or the same operations on the same values (a
    block's caller may compute what every block reads anew for each, e.g. Llama's rotary table
    gathered at the positions)."""

    def __init__(self, jaxpr: Any, consts: Sequence[Any]):
        self.producer = {v: (eqn, i) for eqn in jaxpr.eqns for i, v in enumerate(eqn.outvars)}
        self.keys: dict[Any, Any] = {}
        for var, value in zip(jaxpr.constvars, consts):  # a constant each block's setup made anew
            try:
                array = np.asarray(value)
            except Exception:
                continue
            self.keys[var] = ("constant", array.dtype.str, array.shape, hashlib.sha1(array.tobytes()).hexdigest())

    def key(self, v: Any, depth: int = 0) -> Any:
        if isinstance(v, core.Literal):
            return ("literal", repr(v.val), str(v.aval))
        if v not in self.keys:
            made = self.producer.get(v)
            if made is None or made[0].effects or made[0].primitive.name in REMAT or depth > 32:
                return ("value", id(v))  # an input, an effect, a block's output, or too far back to compare
            eqn, index = made
            params = tuple(sorted((k, str(value)) for k, value in eqn.params.items()))
            self.keys[v] = (eqn.primitive.name, params, tuple(self.key(i, depth + 1) for i in eqn.invars), index)
        return self.keys[v]

    def __call__(self, a: Any, b: Any) -> bool:
        return a is b or self.key(a) == self.key(b)


def param_sources(jaxpr: Any, param_count: int) -> dict[Any, int]:
    """For each value that is one param as it is or cast (``convert_element_type``, ``copy``):
    that param's index among the first ``param_count`` invars."""
    sources = {v: i for i, v in enumerate(jaxpr.invars[:param_count])}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("convert_element_type", "copy") and eqn.invars[0] in sources:
            sources[eqn.outvars[0]] = sources[eqn.invars[0]]
    return sources


def params_only(jaxpr: Any, param_count: int) -> set:
    """The values of ``jaxpr`` computed from its first ``param_count`` invars alone."""
    return params_within(jaxpr, [i < param_count for i in range(len(jaxpr.invars))])


def params_within(jaxpr: Any, flags: Sequence[bool]) -> set:
    """The values of ``jaxpr`` computed from its invars flagged in ``flags`` alone."""
    found = {v for v, flag in zip(jaxpr.invars, flags) if flag}
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, core.Literal)]
        if ins and all(v in found for v in ins):
            found.update(eqn.outvars)
    return found


def chained_params(jaxpr: Any, param_count: int, consts: Sequence[Any] = ()) -> dict[int, tuple[int, int]]:
    """Each param a chain's call reads as its own: its index → (chain, layer)."""
    return owned_params(jaxpr, param_count, find_chains, consts)


def owned_params(jaxpr: Any, param_count: int, find: Callable,
                 consts: Sequence[Any] = ()) -> dict[int, tuple[int, int]]:
    """Each param a call of a group ``find(jaxpr, is_param, consts)`` returns reads as its own (at
    the group's ``weights`` positions): its index → (group, the call's place in the group)."""
    only = params_only(jaxpr, param_count)
    sources = param_sources(jaxpr, param_count)
    found: dict[int, tuple[int, int]] = {}
    for number, group in enumerate(find(jaxpr, lambda v: v in only, consts)):
        for member, index in enumerate(group.calls):
            for position in group.weights:
                source = sources.get(jaxpr.eqns[index].invars[position])
                if source is not None:
                    found[source] = (number, member)
    return found


def use_counts(jaxpr: Any) -> dict[Any, int]:
    """How many times each value of ``jaxpr`` is read: by its equations and as an output."""
    uses: dict[Any, int] = {}
    for v in [*(v for eqn in jaxpr.eqns for v in eqn.invars), *jaxpr.outvars]:
        if not isinstance(v, core.Literal):
            uses[v] = uses.get(v, 0) + 1
    return uses


def call_body(eqn: Any) -> Any:
    """A call's body as a ``ClosedJaxpr``-like pair: ``(jaxpr, consts)`` (``(None, ())`` for an
    equation that calls nothing)."""
    body = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    return (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, ())


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs nested in ``eqn``'s params (a call's body, a loop's, a ``cond``'s branches)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, core.Jaxpr):
                found.append(item)
    return found

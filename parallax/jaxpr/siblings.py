"""A model's list of identical modules called side by side, as its traced loss shows them.

A mixture of experts kept as a list of separate expert modules (nano-moe-jax's ``ExpertFFN``),
each rematerialised (``ExpertParallel(modules=...)`` marks the class), leaves one ``checkpoint``
equation per expert in the trace: the same computation on each expert's own params, none reading
another's result. :func:`find_siblings` reads such groups; unlike a chain of blocks
(:mod:`parallax.jaxpr.chains`), whose calls run one after another, a group's calls can all run
at once, one per device. Only the jaxpr is read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax.extend import core

from parallax.jaxpr.chains import REMAT, Recomputed, body_text, folded_constants, owned_params


@dataclasses.dataclass(frozen=True)
class Siblings:
    """Calls of one module, each on its own params, none reading another's result.

    Attributes:
        calls: the calls' equation indices, in order.
        weights: the operand positions holding a call's own params.
        varying: the other operand positions whose values differ from call to call (the tokens
            dispatched to each expert); every position in neither is one value all calls read.
    """

    calls: tuple[int, ...]
    weights: tuple[int, ...]
    varying: tuple[int, ...] = ()


def find_siblings(jaxpr: Any, is_param: Callable[[Any], bool], consts: Sequence[Any] = ()) -> list[Siblings]:
    """The groups of two or more calls in ``jaxpr`` (not inside its calls) of one rematerialised
    module on different params, none depending on another, in the order they start.

    Args:
        jaxpr: a ``Jaxpr``.
        is_param: whether an operand (a ``Var``) is computed from the params alone.
        consts: the values of ``jaxpr``'s constvars (two equal constants are one value).
    """
    eqns = jaxpr.eqns
    calls = [i for i, eqn in enumerate(eqns) if eqn.primitive.name in REMAT
             and not folded_constants(eqn.params["jaxpr"])]  # a module drawing its own random bits: not batched
    texts = {i: body_text(eqns[i].params["jaxpr"]) for i in calls}
    reaches = _reaches(jaxpr, set(calls))
    same = Recomputed(jaxpr, consts)
    groups: list[list[int]] = []
    for call in calls:
        reached = set().union(*(reaches.get(v, ()) for v in eqns[call].invars if not isinstance(v, core.Literal)))
        open_group = next((g for g in reversed(groups) if texts[g[0]] == texts[call]), None)
        if open_group is None or reached & set(open_group) or not _own_params(eqns, open_group, call, is_param, same):
            groups.append([call])
        else:
            open_group.append(call)
    found = []
    for group in (g for g in groups if len(g) > 1):
        first = eqns[group[0]].invars
        weights = tuple(p for p, v in enumerate(first) if is_param(v)
                        and not all(same(v, eqns[c].invars[p]) for c in group[1:]))
        varying = tuple(p for p, v in enumerate(first) if p not in weights
                        and not all(same(v, eqns[c].invars[p]) for c in group[1:]))
        found.append(Siblings(tuple(group), weights, varying))
    return found


def sibling_params(jaxpr: Any, param_count: int, consts: Sequence[Any] = ()) -> dict[int, tuple[int, int]]:
    """Each param a group's call reads as its own: its index → (group, member)."""
    return owned_params(jaxpr, param_count, find_siblings, consts)


def _own_params(eqns: Sequence[Any], group: Sequence[int], call: int, is_param: Callable, same: Callable) -> bool:
    """Whether ``call`` reads params of its own where ``group``'s first call reads its params."""
    first, this = eqns[group[0]].invars, eqns[call].invars
    own = [p for p, v in enumerate(first) if is_param(v) and is_param(this[p]) and not same(v, this[p])]
    taken = {eqns[c].invars[p] for c in group for p in own}
    return bool(own) and not any(this[p] in taken for p in own)


def _reaches(jaxpr: Any, calls: set[int]) -> dict[Any, frozenset]:
    """For each value, the ``calls`` (equation indices) it is computed from."""
    reaches: dict[Any, frozenset] = {}
    for index, eqn in enumerate(jaxpr.eqns):
        found = frozenset().union(*(reaches.get(v, frozenset()) for v in eqn.invars if not isinstance(v, core.Literal)))
        if index in calls:
            found = found | {index}
        if found:
            reaches.update(dict.fromkeys(eqn.outvars, found))
    return reaches

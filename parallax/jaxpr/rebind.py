"""Re-running a traced computation's equations: binding one again on new operands, and where a dim
of an operand lands through a reshape.

What the run changes that re-evaluate a traced loss share (:mod:`parallax.parallel.context.attention`,
:mod:`parallax.parallel.context.ring`, :mod:`parallax.parallel.experts.dispatch`,
:mod:`parallax.parallel.pipeline.stack`).

Example:
    >>> eqn = jax.make_jaxpr(lambda x: x.reshape(2, 3))(jnp.ones(6)).jaxpr.eqns[0]
    >>> bind(eqn.primitive, eqn.params, [jnp.arange(6.0)])[0].shape, reshaped_dim((4, 6), (4, 2, 3), 0)
    ((2, 3), 0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from parallax._compat import traced_at


def bind(primitive: Any, params: dict, ins: Sequence[Any]) -> list[Any]:
    """``primitive`` bound on ``ins`` with ``params``; its results as a list."""
    outs = primitive.bind(*ins, **primitive.get_bind_params(params))
    return list(outs) if primitive.multiple_results else [outs]


def bind_eqn(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    """``eqn`` bound again on ``ins``, with its own params, recording the model's source line as its own."""
    with traced_at(eqn):
        return bind(eqn.primitive, eqn.params, ins)


def reshaped_dim(old: Sequence[int], new: Sequence[int], dim: int) -> int | None:
    """Where ``dim`` of shape ``old`` is in the reshape to ``new``, where it stays a dim of its own."""
    before = math.prod(old[:dim])
    for j in range(len(new)):
        if math.prod(new[:j]) == before and new[j] == old[dim]:
            return j
    return None

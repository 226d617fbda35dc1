"""Frozen params: those the optimizer never changes, read from the optimizer itself.

A param is frozen when the update ``tx.update`` gives it does not depend on the gradient at
all (``optax.set_to_zero()`` under ``optax.multi_transform``, ``optax.masked(optax.set_to_zero(),
mask)``, ``optax.freeze``...): its update is a constant, so training leaves it as it is. This is
read from the traced update (nothing runs): each update's dependence on the gradients is
followed through the computation; anything that may depend on them counts as trained.

Example:
    >>> params = {"body": {"kernel": jnp.ones((4, 4))}, "head": {"kernel": jnp.ones((4, 2))}}
    >>> tx = optax.multi_transform({"train": optax.adam(1e-3), "freeze": optax.set_to_zero()},
    ...                            {"body": "freeze", "head": "train"})
    >>> frozen_paths(tx, params, tx.init(params))
    ('body/kernel',)
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.extend import core as jex_core

from parallax._tree import path_str


def _structs(tree: Any) -> Any:
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)


def frozen_paths(tx: optax.GradientTransformation, params: Any, opt_state: Any) -> tuple[str, ...]:
    """The paths of the params (``path_str`` form) whose update does not depend on the gradients.

    Args:
        tx: the optimizer.
        params: the params as the optimizer sees them (arrays or ``ShapeDtypeStruct`` s).
        opt_state: its state for them (arrays or structs).

    Returns:
        The frozen params' paths, in tree order; empty where the update cannot be traced.
    """
    params, opt_state = _structs(params), _structs(opt_state)
    try:
        closed = jax.make_jaxpr(lambda grads, state, values: tx.update(grads, state, values)[0])(
            params, opt_state, params)
    except Exception:  # an optimizer that cannot be traced from shapes: nothing is claimed
        return ()
    jaxpr = closed.jaxpr
    depends = set(jaxpr.invars[:len(jax.tree.leaves(params))])  # the gradients
    for eqn in jaxpr.eqns:  # an equation's outputs depend on the gradients if any of its inputs may
        if any(not isinstance(var, jex_core.Literal) and var in depends for var in eqn.invars):
            depends.update(eqn.outvars)
    keyed = jax.tree_util.tree_flatten_with_path(params)[0]
    if len(keyed) != len(jaxpr.outvars):
        return ()
    return tuple(path_str(key) for (key, _), var in zip(keyed, jaxpr.outvars)
                 if isinstance(var, jex_core.Literal) or var not in depends)

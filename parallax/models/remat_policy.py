"""What ``remat=`` names: module classes to rematerialise, and at most one JAX checkpoint policy.

A policy (``jax.checkpoint_policies.dots_saveable``, ``offload_dot_with_no_batch_dims(...)``,
or any function of that form) decides which of a rematerialised call's intermediates are kept
(or moved to host memory) for the backward pass instead of recomputed. It applies to every
module class named beside it; without one, a named module keeps nothing (``nn.remat``'s default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from parallax.jaxpr.chains import REMAT, call_body

_CALLS = ("jit", "pjit", "closed_call", "core_call", "scan")  # opened to reach the matmuls inside them

NAMED_POLICIES = {  # short name: (the policy, what it keeps)
    "nothing": (lambda: jax.checkpoint_policies.nothing_saveable,
                "nothing_saveable: keep nothing, recompute the whole call (the default)"),
    "dots": (lambda: jax.checkpoint_policies.dots_saveable,
             "dots_saveable: keep matmul outputs, recompute elementwise work"),
    "dots_no_batch": (lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                      "dots_with_no_batch_dims_saveable: keep the weight matmuls' outputs, not attention scores"),
    "offload_dots": (lambda: jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
                     "offload_dot_with_no_batch_dims('device', 'pinned_host'): those outputs in host memory"),
}


def named_policy(name: str) -> Callable[..., bool]:
    """The JAX checkpoint policy of a short name (:data:`NAMED_POLICIES`), for command lines.

    Example:
        >>> named_policy("dots") is jax.checkpoint_policies.dots_saveable
        True
    """
    if name not in NAMED_POLICIES:
        raise ValueError(f"remat policy {name!r}; use one of {sorted(NAMED_POLICIES)} (or pass a JAX checkpoint "
                         "policy).")
    return NAMED_POLICIES[name][0]()


def array_arguments(args: tuple, kwargs: dict) -> tuple[list, Callable[[Sequence], tuple[tuple, dict]]]:
    """A call's array arguments (what a rematerialised call traces), and ``rebuild(arrays)`` giving
    ``(args, kwargs)`` back with those arrays replaced and every other argument as it was (static).

    Example:
        >>> arrays, rebuild = array_arguments((np.ones(2), "tanh"), {"train": True})
        >>> rebuild([np.zeros(2)])
        ((array([0., 0.]), 'tanh'), {'train': True})
    """
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]

    def rebuild(arrays: Sequence) -> tuple[tuple, dict]:
        merged = list(leaves)
        for index, value in zip(dynamic, arrays):
            merged[index] = value
        return jax.tree.unflatten(treedef, merged)

    return [leaves[i] for i in dynamic], rebuild


def is_policy(entry: Any) -> bool:
    """Whether a ``remat`` entry is a checkpoint policy (a callable that is not a class)."""
    return callable(entry) and not isinstance(entry, type)


def remat_parts(remat: Sequence[Any]) -> tuple[tuple[type | str, ...], Callable[..., bool] | None]:
    """``remat`` split into its module targets and its checkpoint policy (``None``: keep nothing).

    Example:
        >>> remat_parts(("Block", jax.checkpoint_policies.dots_saveable))[0]
        ('Block',)
        >>> remat_parts(("Block",))[1] is None
        True
    """
    targets = tuple(entry for entry in remat if not is_policy(entry))
    policies = [entry for entry in remat if is_policy(entry)]
    return targets, (policies[0] if policies else None)


def check_remat(remat: Sequence[Any]) -> None:
    """Raises for entries that are neither module classes, class names nor one checkpoint policy,
    and for a policy with no module class to apply it to."""
    for entry in remat:
        if not isinstance(entry, (str, type)) and not is_policy(entry):
            raise ValueError(f"remat takes module classes, class names and one JAX checkpoint policy, got {entry!r}.")
    targets, policy = remat_parts(remat)
    if sum(is_policy(entry) for entry in remat) > 1:
        raise ValueError("remat takes at most one checkpoint policy; it applies to every module class named in remat.")
    if policy is not None and not targets:
        name = getattr(policy, "__name__", repr(policy))
        raise ValueError(
            f"remat has the checkpoint policy {name} but no module class to apply it to; name the model's "
            "repeated block beside it, e.g. remat=('Block', policy). (A policy over the whole model keeps "
            "every activation the backward pass needs at once, so it saves no memory.)")


def rematerialises(jaxpr: Any) -> bool:
    """Whether every matmul of ``jaxpr`` (one layer) runs inside a ``jax.checkpoint`` of its own (as
    ``nn.remat`` of a scanned block traces), so that its backward pass recomputes it there anyway.

    Example:
        >>> layer = jax.checkpoint(lambda w, h: jnp.tanh(h @ w))
        >>> rematerialises(jax.make_jaxpr(layer)(jnp.ones((3, 3)), jnp.ones((2, 3))).jaxpr)
        True
        >>> rematerialises(jax.make_jaxpr(lambda w, h: jnp.tanh(h @ w))(jnp.ones((3, 3)), jnp.ones((2, 3))).jaxpr)
        False
    """
    return _covered(jaxpr) is True


def _covered(jaxpr: Any) -> bool | None:
    """``True``: ``jaxpr`` runs checkpoints and no matmul outside them; ``False``: a matmul outside
    any; ``None``: neither (nothing to recompute)."""
    found = None
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in REMAT:
            found = True
        elif name in ("dot_general", "conv_general_dilated"):
            return False
        elif name in _CALLS:
            inner = _covered(call_body(eqn)[0])
            if inner is False:
                return False
            found = found or inner
    return found

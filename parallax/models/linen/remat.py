"""Activation rematerialisation of chosen module classes, without changing the model.

:func:`remat_modules` intercepts calls of the named module classes and runs each under
``nn.remat``: their activations are recomputed in the backward pass instead of kept.
(Measured on the pinned stack: XLA on CPU still keeps each FSDP-gathered param for the
backward pass rather than gathering it again; the all-gather count is unchanged.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import flax.linen as nn

from parallax.models.remat_policy import array_arguments, remat_parts


def _matches(module: nn.Module, targets: Sequence[type | str]) -> bool:
    return any(
        (isinstance(t, str) and type(module).__name__ == t) or (isinstance(t, type) and isinstance(module, t))
        for t in targets
    )


@contextlib.contextmanager
def remat_modules(remat: Sequence) -> Iterator[None]:
    """Within this context, calls of modules in ``remat`` are rematerialised.

    Args:
        remat: module classes, or class names, e.g. ``("Block",)``, and at most one JAX
            checkpoint policy (what those calls keep instead of recomputing).

    Example:
        >>> x = jnp.ones((4, 16))
        >>> params = model.init(jax.random.PRNGKey(0), x)["params"]
        >>> def total(params, targets=()):
        ...     with remat_modules(targets):
        ...         return model.apply({"params": params}, x).sum()
        >>> def recomputes(targets):  # how remat reaches XLA: a barrier before the recomputation
        ...     return "optimization_barrier" in jax.jit(jax.grad(lambda p: total(p, targets))).lower(params).as_text()
        >>> recomputes(()), recomputes(("Dense",))
        (False, True)
    """
    targets, policy = remat_parts(remat)
    if not targets:
        yield
        return
    inside: list[int] = []

    def interceptor(next_fun, args, kwargs, context):
        if inside or context.method_name != "__call__" or not _matches(context.module, targets):
            return next_fun(*args, **kwargs)
        arrays, rebuild = array_arguments(args, kwargs)

        def body(module, *values):
            call_args, call_kwargs = rebuild(values)
            inside.append(1)
            try:
                return type(module).__call__(module, *call_args, **call_kwargs)
            finally:
                inside.pop()

        return nn.remat(body, policy=policy)(context.module, *arrays)

    with nn.intercept_methods(interceptor):
        yield

"""Batch statistics over the global batch inside ``shard_map``, without touching the model.

Inside ``shard_map`` an unmodified ``nn.BatchNorm`` normalises each shard by its own
statistics, unlike one device. :func:`batch_stats_over` intercepts every BatchNorm call
and gives it the data axes as its ``axis_name`` (replacing a hard-coded one, which names
an axis that does not exist here), so the mean and variance are the global batch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import flax.linen as nn


@contextlib.contextmanager
def batch_stats_over(axes: tuple[str, ...] | None) -> Iterator[None]:
    """Within this context, BatchNorm reduces its statistics over ``axes``.

    Args:
        axes: mesh axes to average statistics over; ``None`` for per-shard statistics.

    Example:
        Two shards of two examples each (``vmap`` stands in for ``shard_map``): with the
        statistics over ``"data"``, the four examples are normalised together.

        >>> bn = nn.BatchNorm(use_running_average=False)
        >>> x = jnp.array([[[0.0], [1.0]], [[2.0], [3.0]]])
        >>> variables = bn.init(jax.random.PRNGKey(0), x[0])
        >>> def shard(x):
        ...     with batch_stats_over(("data",)):
        ...         return bn.apply(variables, x, mutable=["batch_stats"])[0]
        >>> [round(float(v), 2) for v in jax.vmap(shard, axis_name="data")(x).ravel()]
        [-1.34, -0.45, 0.45, 1.34]
    """
    axis_name = None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if not isinstance(module, nn.BatchNorm) or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        original = module.axis_name
        object.__setattr__(module, "axis_name", axis_name)
        try:
            return next_fun(*args, **kwargs)
        finally:
            object.__setattr__(module, "axis_name", original)

    with nn.intercept_methods(interceptor):
        yield

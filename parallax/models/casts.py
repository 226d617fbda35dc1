"""Mixed-precision casts at the model's edge: inputs and params down, outputs back to float32."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree: Any, dtype: Any, *, is_leaf: Callable[[Any], bool] | None = None,
                  cast_leaf: Callable[[Any, Any], Any] | None = None) -> Any:
    """Casts every floating leaf of ``tree`` to ``dtype``.

    ``is_leaf``/``cast_leaf`` let an adapter cast its own boxes (e.g. an FSDP shard that
    is cast after its gather, so that the gather and its gradient stay in float32).

    Example:
        >>> cast_floating({"w": jnp.ones(2), "n": jnp.arange(2)}, jnp.bfloat16)["w"].dtype
        dtype(bfloat16)
    """

    def cast(x):
        if is_leaf is not None and is_leaf(x):
            return cast_leaf(x, dtype)
        return x.astype(dtype) if _is_float(x) else x

    return jax.tree.map(cast, tree, is_leaf=is_leaf)


class Float32Outputs:
    """The model as the loss function sees it, with float32 outputs.

    Calling it (or any of its methods) runs the model and casts floating results to
    float32, so that the loss and its reductions are computed in float32.
    """

    def __init__(self, module: Any):
        self._module = module

    def _wrap(self, fn):
        def call(*args, **kwargs):
            return cast_floating(fn(*args, **kwargs), jnp.float32)

        return call

    def __call__(self, *args, **kwargs):
        return self._wrap(self._module)(*args, **kwargs)

    def __getattr__(self, name: str):
        attr = getattr(self._module, name)
        return self._wrap(attr) if callable(attr) and not isinstance(attr, type) else attr

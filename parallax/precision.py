"""Mixed precision: float32 params and optimizer state, a lower-precision forward/backward.

Under ``precision="bf16"`` the step casts params (after any FSDP gather, so gradients are
reduced in float32) and floating batch inputs to bfloat16, runs the model, and casts the
model's floating outputs back to float32 before the loss function sees them. Gradients
arrive in float32 (the transpose of a cast), the optimizer updates float32 master params.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from parallax.gather import GatherOnUse


@dataclasses.dataclass(frozen=True)
class Precision:
    """A precision policy.

    Attributes:
        name: ``"fp32"`` or ``"bf16"``.
        compute_dtype: the dtype of the forward and backward pass; ``None`` leaves the
            model's own dtypes alone.
    """

    name: str = "fp32"
    compute_dtype: Any = None

    @property
    def casts(self) -> bool:
        return self.compute_dtype is not None


POLICIES = {
    "fp32": Precision("fp32", None),
    "bf16": Precision("bf16", jnp.bfloat16),
}


def resolve(precision: str | Precision | None) -> Precision:
    """The :class:`Precision` for ``None``, a name in ``POLICIES``, or a policy."""
    if precision is None:
        return POLICIES["fp32"]
    if isinstance(precision, Precision):
        return precision
    if precision not in POLICIES:
        raise ValueError(f"precision={precision!r}; use one of {sorted(POLICIES)} (or None for float32).")
    return POLICIES[precision]


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts every floating leaf (and every FSDP shard, after its gather) to ``dtype``."""

    def cast(x):
        if isinstance(x, GatherOnUse):
            return x.replace(dtype=dtype)
        return x.astype(dtype) if _is_float(x) else x

    return jax.tree.map(cast, tree, is_leaf=lambda x: isinstance(x, GatherOnUse))


class Float32Outputs:
    """The bound model as the loss function sees it, with float32 outputs.

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

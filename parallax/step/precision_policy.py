"""Mixed-precision policies: float32 params and optimizer state, a lower-precision forward/backward.

Under ``precision="bf16"`` the model adapter casts params (after any FSDP gather, so
gradients are reduced in float32) and floating batch inputs to bfloat16, runs the model,
and casts the model's floating outputs back to float32 before the loss function sees them
(:mod:`parallax.models.casts`). Gradients arrive in float32 (the transpose of a cast),
the optimizer updates float32 master params.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


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

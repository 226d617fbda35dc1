"""The train state: everything a step reads and writes, and the rngs it draws from."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import struct

from parallax.models import adapter_for
from parallax.sharding.stacked_blocks import as_written


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes. A pytree of arrays plus two static fields.

    Attributes:
        step: number of updates applied (int32 scalar).
        params: the model's params, unboxed (plain arrays, sharded as the strategy says); a
            pipeline's list of blocks held stacked (:class:`parallax.sharding.stacked_blocks.StackedBlocks`,
            which reads as the list's mapping).
        opt_state: the optimizer state; moments are sharded like their params.
        rng: base PRNG key; step ``t`` uses ``fold_in(rng, t)``, so a resumed run
            draws the same numbers as an uninterrupted one.
        model_state: the model's other variable collections, e.g. ``{"batch_stats": ...}``.
        model: the model (static), e.g. a flax linen module.
        tx: the optax transformation (static).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    model_state: dict
    model: Any = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)

    @property
    def variables(self) -> dict:
        """``{"params": ..., **model_state}``, ready for ``model.apply`` (a list of blocks held stacked
        as the model writes it)."""
        return {"params": as_written(self.params), **self.model_state}

    def module(self) -> Any:
        """The model holding this state's values, callable outside a step: an NNX module
        (``nnx.merge`` of the values), or a bound linen module.

        Example:
            >>> trained = state.module()  # a linen model here: bound to the params
            >>> trained(batch["x"]).shape
            (32, 10)
        """
        return adapter_for(self.model).bind(as_written(self.params), self.model_state)


def as_key(rng: Any) -> jax.Array:
    """A raw ``uint32[2]`` PRNG key from a seed, a raw key or a typed key.

    Example:
        >>> as_key(0).shape
        (2,)
    """
    if isinstance(rng, int):
        return jax.random.PRNGKey(rng)
    rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng)
    return rng


def model_rngs(key: jax.Array, streams: Sequence[str]) -> dict[str, jax.Array]:
    """One independent key per named rng stream (``"dropout"``, ...)."""
    return {name: jax.random.fold_in(key, index) for index, name in enumerate(streams)}

"""The train state: everything a step reads and writes, and the rngs it draws from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from parallax.models import adapter_for
from parallax.parallel.pipeline.stacked_blocks import as_written


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes. A pytree of arrays plus two static fields.

    Attributes:
        step: number of updates applied (int32 scalar).
        params: the model's params, unboxed (plain arrays, sharded as the strategy says); a
            pipeline's list of blocks held stacked (:class:`parallax.parallel.pipeline.stacked_blocks.StackedBlocks`,
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


def key_struct() -> jax.ShapeDtypeStruct:
    """The shape and dtype of a raw PRNG key of JAX's default implementation: ``uint32[2]`` under
    threefry (JAX's default), ``uint32[4]`` under ``rbg`` and ``unsafe_rbg`` (MaxText's default,
    ``jax.config.update("jax_default_prng_impl", ...)``). The train state's key has this form.

    Example:
        >>> key_struct()
        ShapeDtypeStruct(shape=(2,), dtype=uint32)
    """
    return jax.eval_shape(lambda: jax.random.PRNGKey(0))


def as_key(rng: Any) -> jax.Array:
    """A raw PRNG key of JAX's default implementation (:func:`key_struct`) from a seed, a raw key or a
    typed key (``jax.random.key``).

    A typed key of the default implementation gives its own data; a typed key of another one (say
    ``jax.random.key(0, impl="rbg")`` under threefry) gives a key of the default implementation drawn
    from it, the same for the same key. A raw key of another implementation's shape is refused: its
    bits cannot be read as the default implementation's.

    Example:
        >>> as_key(0).shape
        (2,)
        >>> bool((as_key(jax.random.key(0)) == jax.random.PRNGKey(0)).all())
        True
    """
    expected = key_struct()
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return jax.random.PRNGKey(int(rng))
    if not isinstance(rng, (jax.Array, np.ndarray, jax.core.Tracer)):
        try:
            rng = jnp.asarray(rng)
        except TypeError:
            raise TypeError(f"rng must be a seed (an int), a raw PRNG key or a typed key (jax.random.key), "
                            f"got {type(rng).__name__}: {rng!r}") from None
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape:
            raise ValueError(f"rng must be one key, got an array of {rng.shape} typed keys ({rng.dtype}).")
        if jax.random.key_impl(rng) != jax.random.key_impl(jax.random.key(0)):  # drawn from it, in the default impl
            return jax.random.bits(rng, expected.shape, expected.dtype)
        return jax.random.key_data(rng)
    if tuple(rng.shape) != tuple(expected.shape) or not jnp.issubdtype(rng.dtype, jnp.unsignedinteger):
        impl = jax.config.jax_default_prng_impl
        raise ValueError(
            f"rng={rng!r} is not a raw PRNG key of JAX's default implementation ({impl}: "
            f"{expected.dtype}{list(expected.shape)}); got {rng.dtype}{list(rng.shape)}. Pass a seed (rng=0), a typed "
            f"key (jax.random.key(0)), or a raw key made under the same jax_default_prng_impl.")
    return rng


def model_rngs(key: jax.Array, streams: Sequence[str]) -> dict[str, jax.Array]:
    """One independent key per named rng stream (``"dropout"``, ...)."""
    return {name: jax.random.fold_in(key, index) for index, name in enumerate(streams)}

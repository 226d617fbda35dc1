"""A train state from values the caller gives, built without compiling a program.

Where the params are given (pretrained, or held by an NNX model) and nothing else needs the
model's init, the state's program has nothing to compute: the params go to their shards as
they are, the optimizer's init fills its state with constants (zeros, a count of 0), the step
is 0 and the key is split. Compiling that program took as long as compiling a small train step
and held the params twice on the devices (its inputs and its outputs). Here each leaf is put on
its shards from the host instead: the given params copied shard by shard, each constant leaf
made shard by shard (:func:`jax.make_array_from_callback`), never a whole array on one device.
The values are the program's, bit for bit (``tests/test_plan.py``). Where anything is not a
constant (an optimizer whose state starts from the params, a model state only the init makes,
params in another dtype than the model's, state in host memory), :func:`build_directly` returns
``None`` and the caller compiles the program as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from parallax.step.train_state import TrainState

_PASS_THROUGH = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "copy"})


def constant_fills(fn: Callable, *args: Any) -> list[tuple[Any, np.ndarray]] | None:
    """Each output of ``fn(*args)`` as ``(aval, value)`` where every output is one constant
    broadcast to its shape (``jnp.zeros_like``, ``jnp.zeros([], jnp.int32)``...); ``None`` where
    any output depends on the inputs' values or is not uniform.

    Example:
        >>> import optax
        >>> p = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
        >>> [(a.shape, v.item()) for a, v in constant_fills(optax.adam(1e-3).init, p)]
        [((), 0), ((4, 3), 0.0), ((4, 3), 0.0)]
        >>> constant_fills(lambda p: jax.tree.map(lambda x: x + 1, p), p) is None  # reads the params
        True
    """
    closed = jax.make_jaxpr(fn)(*args)
    made = {var: eqn for eqn in closed.jaxpr.eqns for var in eqn.outvars}
    consts = dict(zip(closed.jaxpr.constvars, closed.consts))

    def fill(atom) -> np.ndarray | None:
        if isinstance(atom, Literal):
            value = np.asarray(atom.val)
        elif atom in consts:
            value = np.asarray(consts[atom])
        elif atom in made and made[atom].primitive.name in _PASS_THROUGH:
            value = fill(made[atom].invars[0])
        else:  # an input, or computed from something
            return None
        if value is None or not value.size or not (value == value.reshape(-1)[0]).all():
            return None
        return value.reshape(-1)[0]

    fills = []
    for var in closed.jaxpr.outvars:
        aval = var.aval
        if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended) or getattr(aval, "weak_type", False):
            return None
        value = fill(var)
        if value is None:
            return None
        fills.append((aval, np.asarray(value).astype(aval.dtype)))
    return fills


def _filled(aval: Any, value: np.ndarray, sharding: Any) -> jax.Array:
    shard = np.full(sharding.shard_shape(aval.shape), value, aval.dtype)
    return jax.make_array_from_callback(aval.shape, sharding, lambda _: shard)


def build_directly(key: Any, values: Any, model_state: Any, opt_state: Any, *, plain: Any, abstract: TrainState,
                   shardings: TrainState, optimizer: Any) -> TrainState | None:
    """The train state the state's program would compute from given ``values`` (params on their
    shards, in the model's dtypes), put together on the host side without compiling it; ``None``
    where it needs the program (see the module's docstring).

    Args:
        key: the state's raw PRNG key (host array).
        values: the given params, already on ``shardings.params`` in buffers of their own (never the
            caller's arrays: the state's step donates them); ``None``: not given.
        model_state: the model state on its shards (given, or the empty one of a model that has none);
            ``None``: only the model's init makes it.
        opt_state: the given optimizer state on its shards, ``None`` where not given.
        plain: the params' ``ShapeDtypeStruct`` s (unboxed).
        abstract: the state's shapes (its model, for the state).
        shardings: the state's ``NamedSharding`` tree.
        optimizer: the optax transformation.
    """
    if values is None or model_state is None:  # the model's init makes the params, or its other state
        return None
    if any(getattr(s, "memory_kind", None) not in (None, "device") for s in jax.tree.leaves(shardings)):
        return None
    if any(jnp.dtype(v.dtype) != jnp.dtype(p.dtype) or tuple(v.shape) != tuple(p.shape)
           for v, p in zip(jax.tree.leaves(values), jax.tree.leaves(plain), strict=True)):
        return None  # cast by the program
    if opt_state is None:
        fills = constant_fills(optimizer.init, plain)
        if fills is None:
            return None
        structure = jax.tree.structure(jax.eval_shape(optimizer.init, plain))
        opt_state = jax.tree.unflatten(structure, [_filled(aval, value, sharding) for (aval, value), sharding in
                                                   zip(fills, jax.tree.leaves(shardings.opt_state), strict=True)])
    state_key = np.asarray(jax.random.split(jnp.asarray(key), 3)[2])  # a host value: placed as the program's argument
    return TrainState(
        step=_filled(jax.ShapeDtypeStruct((), jnp.int32), np.zeros((), np.int32), shardings.step),
        params=values,
        opt_state=opt_state,
        rng=jax.device_put(state_key, shardings.rng),
        model_state=model_state,
        model=abstract.model,
        tx=optimizer,
    )

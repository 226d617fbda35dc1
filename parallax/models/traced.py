"""A model's training loss as a jaxpr, traced from shapes: what ``strategy="auto"`` reads to know
which parts apply (attention to split over a context axis, a stack to pipeline and how its blocks
rematerialise) before anything is compiled or allocated.

Example:
    >>> closed = traced_loss(model, batch, loss_fn)
    >>> any(eqn.primitive.name == "dot_general" for eqn in closed.jaxpr.eqns)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from parallax._tree import path_str
from parallax.jaxpr.chains import call_body
from parallax.jaxpr.tp_layout import scanned_dims
from parallax.models.remat_policy import rematerialises


def traced_loss(model: Any, example_batch: Any, loss_fn: Any, rng_streams: Sequence[str] = ("dropout",)) -> Any:
    """The closed jaxpr of ``loss_fn(model, batch)`` in training, the model initialised and run
    from shapes (nothing is allocated)."""
    from parallax.models import ModelRun, adapter_for

    adapter = adapter_for(model)

    def loss(key: Any, batch: Any) -> Any:
        rngs = _streams(key, rng_streams)
        params, state = adapter.init(rngs, batch, loss_fn, ())
        return adapter.apply(adapter.unbox(params), state, batch, rngs=rngs, loss_fn=loss_fn, run=ModelRun(train=True))

    # The key as a shape (eval_shape runs nothing: on a deviceless target there is no backend to run it on).
    return jax.make_jaxpr(loss)(jax.eval_shape(lambda: jax.random.PRNGKey(0)), example_batch)


def _streams(key: Any, rng_streams: Sequence[str]) -> dict:
    """The init's and each stream's key, folded from ``key``."""
    return {name: jax.random.fold_in(key, i) for i, name in enumerate(("params", *rng_streams))}


def stacked_layers(model: Any, example_batch: Any, loss_fn: Any, rng_streams: Sequence[str] = ("dropout",)) -> bool:
    """Whether ``model`` stacks layers a ``scan`` steps over (``nn.scan``, ``nnx.scan``): what a
    pipeline without ``blocks=`` splits. Read from its trace (nothing is allocated)."""
    closed, paths, _ = params_loss(model, example_batch, loss_fn, rng_streams)
    return bool(scanned_dims(closed, paths))


def params_loss(model: Any, example_batch: Any, loss_fn: Any, rng_streams: Sequence[str]) -> tuple[Any, list, list]:
    """The closed jaxpr of the training loss as a function of the model's params (then its state
    and the batch), the params' paths and shapes (the model initialised from shapes)."""
    from parallax.models import ModelRun, adapter_for

    adapter = adapter_for(model)
    def streams() -> dict:  # made inside each trace: nothing runs (a deviceless target runs nothing)
        return _streams(jax.random.PRNGKey(0), rng_streams)

    params, state = jax.eval_shape(lambda batch: adapter.init(streams(), batch, loss_fn, ()), example_batch)
    params = adapter.unbox(params)
    paths = [path_str(key_path) for key_path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def loss(params: Any, state: Any, batch: Any) -> Any:
        return adapter.apply(params, state, batch, rngs=streams(), loss_fn=loss_fn, run=ModelRun(train=True))

    return jax.make_jaxpr(loss)(params, state, example_batch), paths, [leaf.shape for leaf in jax.tree.leaves(params)]


def stack_rematerialises(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` scans a body that rematerialises itself (``nn.scan`` of an ``nn.remat``
    block: :func:`parallax.models.remat_policy.rematerialises`), in itself or in a call inside it.

    Example:
        >>> layer = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
        >>> stack_rematerialises(jax.make_jaxpr(lambda x, w: jax.lax.scan(layer, x, w))(jnp.ones((2, 3)),
        ...                                                                            jnp.ones((4, 3, 3))).jaxpr)
        True
    """
    for eqn in jaxpr.eqns:
        inner = call_body(eqn)[0]
        if inner is None or not hasattr(inner, "eqns"):
            continue
        if (eqn.primitive.name == "scan" and rematerialises(inner)) or stack_rematerialises(inner):
            return True
    return False

"""The baselines parallax must not fall behind, written the way the tutorials write them.

* ``single_device``: a plain ``jax.jit`` train step on one device.
* ``data_parallel``: ``shard_map`` over a ``data`` axis, replicated params, ``pmean`` of
  the gradients, the optimizer update inside the ``shard_map`` (JAX / UvA notebook style).
* ``fsdp``: the UvA recipe: ``nn.map_variables`` shards params on write (``init`` runs
  inside ``shard_map``) and all-gathers them on read with a custom gradient that
  reduce-scatters; ``nn.Partitioned`` boxes carry the layout; non-split gradients are
  ``pmean``-ed.
* ``gspmd``: ``jax.jit`` with ``NamedSharding`` s on params, optimizer state and batch, as
  in the JAX sharding tutorial (used for tensor parallelism and hybrids).

Each returns ``(step, state, batch)`` with the inputs already placed, so a benchmark just
calls ``step(state, batch)``.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax.training import train_state
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def _apply_loss(model, loss_fn, variables, batch, mutable):
    def method(module, b):
        return loss_fn(module, b)

    if mutable:
        loss, updates = model.apply(variables, batch, method=method, mutable=mutable)
        return loss, updates
    return model.apply(variables, batch, method=method), {}


def _plain_step(model, tx, loss_fn):
    """value_and_grad and an optax update on whatever arrays it is given."""

    def step(state, batch):
        params, others, opt_state = state

        def loss(p):
            return _apply_loss(model, loss_fn, {"params": p, **others}, batch, list(others))

        (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(params)
        upd, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, upd), {**others, **updates}, opt_state), value

    return step


def single_device(model, tx, loss_fn, batch, rng=0):
    device = jax.devices()[0]
    variables = jax.device_put(model.init(jax.random.PRNGKey(rng), batch, method=lambda m, x: loss_fn(m, x)), device)
    params, others = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    state = (params, others, tx.init(params))

    return jax.jit(_plain_step(model, tx, loss_fn)), state, jax.device_put(batch, device)


def data_parallel(model, tx, loss_fn, batch, mesh: Mesh, axis: str = "data", rng=0):
    variables = model.init(jax.random.PRNGKey(rng), batch, method=lambda m, x: loss_fn(m, x))
    params, others = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    replicated = NamedSharding(mesh, P())
    state = jax.device_put((params, others, tx.init(params)), replicated)

    def local_step(state, batch):
        params, others, opt_state = state

        def loss(p):
            return _apply_loss(model, loss_fn, {"params": p, **others}, batch, list(others))

        (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(params)
        grads = lax.pmean(grads, axis)
        updates = lax.pmean(updates, axis)
        upd, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, upd), {**others, **updates}, opt_state), lax.pmean(value, axis)

    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(axis)), out_specs=(P(), P()),
                                 check_vma=False), donate_argnums=(0,))
    return step, state, jax.device_put(batch, NamedSharding(mesh, P(axis)))


# --- the UvA FSDP recipe ------------------------------------------------------------------

def shard_params(params, axis_name: str, min_weight_size: int):
    axis_index, axis_size = lax.axis_index(axis_name), lax.psum(1, axis_name)

    def split(x):
        value, names = (x.value, x.names) if isinstance(x, nn.Partitioned) else (x, (None,) * x.ndim)
        if axis_name in names or value.size <= min_weight_size:
            return x
        for dim in np.argsort(value.shape)[::-1]:
            if value.shape[dim] % axis_size == 0 and names[dim] is None:
                size = value.shape[dim] // axis_size
                shard = lax.dynamic_slice_in_dim(value, axis_index * size, size, axis=dim)
                return nn.Partitioned(shard, names[:dim] + (axis_name,) + names[dim + 1:])
        return x

    return jax.tree.map(split, params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def gather_array_with_mean_grads(x, axis: int, axis_name: str):
    axis_size = lax.psum(1, axis_name)

    @jax.custom_gradient
    def gather(x):
        def grad_fn(g):
            return lax.psum_scatter(g, axis_name, scatter_dimension=axis, tiled=True) / axis_size

        return lax.all_gather(x, axis_name, axis=axis, tiled=True), grad_fn

    return gather(x)


def gather_params(params, axis_name: str):
    def gather(p):
        if isinstance(p, nn.Partitioned) and axis_name in p.names:
            dim = p.names.index(axis_name)
            return gather_array_with_mean_grads(p.value, axis=dim, axis_name=axis_name)
        return p

    return jax.tree.map(gather, params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def shard_module_params(target, axis_name: str, min_weight_size: int):
    return nn.map_variables(target, trans_in_fn=functools.partial(gather_params, axis_name=axis_name),
                            trans_out_fn=functools.partial(shard_params, axis_name=axis_name,
                                                           min_weight_size=min_weight_size),
                            mapped_collections="params", mutable=True)


def sync_gradients(grads, axis_name: str):
    def sync(g):
        if isinstance(g, nn.Partitioned):
            return g if axis_name in g.names else g.replace(value=lax.pmean(g.value, axis_name))
        return lax.pmean(g, axis_name)

    return jax.tree.map(sync, grads, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def fsdp(model, tx, loss_fn, batch, mesh: Mesh, axis: str = "fsdp", min_weight_size: int = 2**18, rng=0):
    fields = {f: getattr(model, f) for f in model.__dataclass_fields__ if f not in ("parent", "name")}
    sharded = shard_module_params(type(model), axis, min_weight_size)(**fields)
    batch_sharding = NamedSharding(mesh, P(axis))
    batch = jax.device_put(batch, batch_sharding)

    def init(rng, batch):
        variables = sharded.init(rng, batch, method=lambda m, x: loss_fn(m, x))
        others = {k: v for k, v in variables.items() if k != "params"}
        return train_state.TrainState.create(apply_fn=sharded.apply, params=variables["params"], tx=tx), others

    shapes = jax.eval_shape(jax.shard_map(init, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(),
                                          check_vma=False), jax.random.PRNGKey(rng), batch)
    specs = nn.get_partition_spec(shapes)
    state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=(P(), P(axis)), out_specs=specs,
                                  check_vma=False))(jax.random.PRNGKey(rng), batch)

    def local_step(carry, batch):
        state, others = carry

        def loss(p):
            return _apply_loss(sharded, loss_fn, {"params": p, **others}, batch, list(others))

        (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        grads = sync_gradients(grads, axis)
        updates = lax.pmean(updates, axis)
        return (state.apply_gradients(grads=grads), {**others, **updates}), lax.pmean(value, axis)

    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()),
                                 check_vma=False), donate_argnums=(0,))
    return step, state, batch


def gspmd(model, tx, loss_fn, batch, mesh: Mesh, param_specs: Any, opt_specs: Any, batch_spec: P, rng=0):
    """``jax.jit`` with ``NamedSharding`` s: params and optimizer state laid out by the given specs."""
    variables = model.init(jax.random.PRNGKey(rng), batch, method=lambda m, x: loss_fn(m, x))
    params, others = variables["params"], {k: v for k, v in variables.items() if k != "params"}

    def shardings(specs):
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    params = jax.device_put(params, shardings(param_specs))
    opt_state = jax.jit(tx.init, out_shardings=shardings(opt_specs))(params)
    others = jax.device_put(others, NamedSharding(mesh, P()))
    state = (params, others, opt_state)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)

    jitted = jax.jit(_plain_step(model, tx, loss_fn), out_shardings=(state_shardings, NamedSharding(mesh, P())),
                     donate_argnums=(0,))
    return jitted, state, jax.device_put(batch, NamedSharding(mesh, batch_spec))


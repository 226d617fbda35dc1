"""Gathering FSDP shards inside ``shard_map``, and scattering their gradients: the one place.

A param split over a gathered axis (FSDP) is all-gathered where the model uses it; the
gather's gradient is a ``psum_scatter`` divided by the axis size, so each device keeps the
mean gradient of its own shard, which is exactly the ZeRO-3 update. The model adapters
decide *where* the gather happens (a linen model gathers each param as its layer reads it);
the step builders gather once per step and scatter once when accumulating microbatches.
"""

from __future__ import annotations

import functools
from typing import Any

import jax


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def all_gather_mean_grad(shard: jax.Array, axis_name: str, dim: int) -> jax.Array:
    """All-gathers ``shard`` along ``dim`` over ``axis_name``; the gradient is the
    shard's slice of the gradient averaged over the axis (a reduce-scatter / N).

    Must run inside ``shard_map`` with ``axis_name`` manual.
    """
    return jax.lax.all_gather(shard, axis_name, axis=dim, tiled=True)


def _gather_fwd(shard, axis_name, dim):
    return all_gather_mean_grad(shard, axis_name, dim), None


def _gather_bwd(axis_name, dim, _, grad):
    size = jax.lax.psum(1, axis_name)
    return (jax.lax.psum_scatter(grad, axis_name, scatter_dimension=dim, tiled=True) / size,)


all_gather_mean_grad.defvjp(_gather_fwd, _gather_bwd)


def gather_dim(spec: jax.sharding.PartitionSpec, axes: set[str]) -> tuple[int, str] | None:
    """The ``(dim, axis)`` of ``spec`` split over one of ``axes``, if any."""
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        hits = [name for name in names if name in axes]
        if hits:
            if len(names) > 1:
                raise ValueError(
                    f"Dim {dim} of spec {spec} splits over several axes {names}; FSDP "
                    "gathers one axis per dim."
                )
            return dim, hits[0]
    return None


def gather_all(local_params: Any, specs: Any, axes: set[str]) -> Any:
    """Every local shard split over one of ``axes``, all-gathered now (reduce-scatter gradient).

    For models that read params other than through ``self.param``, where a
    :class:`GatherOnUse` box would reach the model's code instead of an array.
    """

    def gather(value, spec):
        found = gather_dim(spec, axes)
        return value if found is None else all_gather_mean_grad(value, found[1], found[0])

    return jax.tree.map(gather, local_params, specs)


def gather_once(local_params: Any, specs: Any, axes: set[str]) -> Any:
    """Every local shard split over one of ``axes``, all-gathered (no custom gradient: the
    caller differentiates the gathered params and scatters their gradient itself)."""

    def gather(value, spec):
        found = gather_dim(spec, axes)
        return value if found is None else jax.lax.all_gather(value, found[1], axis=found[0], tiled=True)

    return jax.tree.map(gather, local_params, specs)


def scatter_mean(grads: Any, specs: Any, axes: set[str], axis_sizes: Any) -> Any:
    """Each full gradient of a param split over one of ``axes``, reduce-scattered to this
    device's shard and averaged over the axis (the transpose of :func:`gather_once`, as a mean)."""

    def scatter(grad, spec):
        found = gather_dim(spec, axes)
        if found is None:
            return grad
        dim, axis = found
        return jax.lax.psum_scatter(grad, axis, scatter_dimension=dim, tiled=True) / axis_sizes[axis]

    return jax.tree.map(scatter, grads, specs)

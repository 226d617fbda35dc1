"""Gathering FSDP shards inside ``shard_map``: the all-gather with a reduce-scatter gradient.

A param that FSDP splits over an axis reaches the module as a :class:`GatherOnUse` box.
Flax unboxes a param at the moment a module reads it (``self.param``), so each shard is
all-gathered right where its layer needs it, not all at once at the top of the model.
The gather's gradient is a ``psum_scatter`` divided by the axis size: each device keeps
the mean gradient of its own shard, which is exactly the ZeRO-3 update.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import struct
from flax.core import meta


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


class GatherOnUse(struct.PyTreeNode, meta.AxisMetadata):
    """A local FSDP shard that all-gathers itself when a module reads it.

    Attributes:
        value: the local shard.
        dim: the array dim the shard was cut along.
        axis_name: the manual mesh axis it is split over.
        dtype: if set, the gathered param is cast to it (mixed precision: the gather and
            its reduce-scatter gradient stay in the param's own dtype).
    """

    value: Any
    dim: int = struct.field(pytree_node=False)
    axis_name: str = struct.field(pytree_node=False)
    dtype: Any = struct.field(pytree_node=False, default=None)

    def unbox(self) -> Any:
        full = all_gather_mean_grad(self.value, self.axis_name, self.dim)
        return full if self.dtype is None else full.astype(self.dtype)

    def replace_boxed(self, val: Any) -> "GatherOnUse":
        return self.replace(value=val)

    def add_axis(self, index: int, params: dict[Any, Any]) -> "GatherOnUse":
        return self.replace(dim=self.dim + (1 if index <= self.dim else 0))

    def remove_axis(self, index: int, params: dict[Any, Any]) -> "GatherOnUse":
        if index == self.dim:
            raise ValueError(
                f"A lifted transform (nn.scan / nn.vmap) maps over dim {index}, which FSDP "
                f"split over {self.axis_name!r}; exclude this param from FSDP."
            )
        return self.replace(dim=self.dim - (1 if index < self.dim else 0))


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


def box_for_gather(local_params: Any, specs: Any, axes: set[str]) -> Any:
    """Boxes each local shard split over one of ``axes`` as :class:`GatherOnUse`."""

    def box(value, spec):
        found = gather_dim(spec, axes)
        return value if found is None else GatherOnUse(value, found[0], found[1])

    return jax.tree.map(box, local_params, specs)


def gather_all(local_params: Any, specs: Any, axes: set[str]) -> Any:
    """Every local shard split over one of ``axes``, all-gathered now (reduce-scatter gradient).

    For models that read params other than through ``self.param``, where a
    :class:`GatherOnUse` box would reach the model's code instead of an array.
    """

    def gather(value, spec):
        found = gather_dim(spec, axes)
        return value if found is None else all_gather_mean_grad(value, found[1], found[0])

    return jax.tree.map(gather, local_params, specs)

"""A linen module made to run inside ``shard_map`` with FSDP-sharded params (the notebook recipe)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
from flax.core import meta
from jax.sharding import Mesh, PartitionSpec

from parallax._tree import is_box, path_str
from parallax.models.linen.gather_box import GatherOnUse
from parallax.sharding.gather import gather_dim
from parallax.sharding.specs import place_param
from parallax.sharding.strategy import Strategy


def wrap_for_shard_map(module: nn.Module, strategy: Strategy, mesh: Mesh | None = None) -> nn.Module:
    """The same module, wrapped with ``nn.map_variables`` to run inside ``shard_map``.

    Inside ``shard_map`` (with the FSDP axes manual) the wrapped module takes params as
    ``nn.Partitioned`` boxes of local shards, as the notebook recipe keeps them: on read,
    each shard split over an FSDP axis is all-gathered where the layer uses it (gradient:
    reduce-scatter / N); on write (``init``), a full param is cut to this device's shard
    and boxed with its spec's names. Param paths are unchanged. parallax's own steps do
    not need it; it is for code that calls ``shard_map`` itself.

    Example:
        >>> wrapped = px.wrap_for_shard_map(model, px.FSDP(min_weight_size=0))
        >>> # inside jax.shard_map(..., axis_names={"fsdp"}):
        >>> #   variables = wrapped.init(rng, x)   # params: nn.Partitioned local shards
        >>> #   y = wrapped.apply(variables, x)    # the same y as model.apply on full params
    """
    fsdp_axes = set(strategy.fsdp_axes)
    sizes = strategy.axis_sizes(mesh)

    def gather_in(params):
        def to_gather(leaf):
            if isinstance(leaf, meta.Partitioned):
                found = gather_dim(PartitionSpec(*leaf.names), fsdp_axes)
                if found is not None:
                    return GatherOnUse(leaf.value, found[0], found[1])
                return leaf.value
            return leaf

        return jax.tree.map(to_gather, params, is_leaf=is_box)

    def shard_out(params):
        def to_shard(key_path, leaf):
            if isinstance(leaf, GatherOnUse):
                names = [None] * leaf.value.ndim
                names[leaf.dim] = leaf.axis_name
                return nn.Partitioned(leaf.value, tuple(names))
            if is_box(leaf) and not isinstance(leaf, meta.Partitioned):
                return leaf
            value = leaf.value if isinstance(leaf, meta.Partitioned) else leaf
            spec = place_param(path_str(key_path), value.shape, strategy.parts, sizes, box=leaf)
            names = list(spec) + [None] * (value.ndim - len(spec))
            found = gather_dim(spec, fsdp_axes)
            if found is not None:
                dim, axis = found
                chunk = value.shape[dim] // sizes[axis]
                start = jax.lax.axis_index(axis) * chunk
                value = jax.lax.dynamic_slice_in_dim(value, start, chunk, axis=dim)
            return nn.Partitioned(value, tuple(names))

        return jax.tree_util.tree_map_with_path(to_shard, params, is_leaf=is_box)

    wrapped_cls = nn.map_variables(
        type(module), "params", trans_in_fn=gather_in, trans_out_fn=shard_out, init=True, mutable=True
    )
    fields = {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.init and f.name not in ("parent", "name")
    }
    return wrapped_cls(**fields)

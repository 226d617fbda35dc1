"""FSDP shards that gather themselves where a linen layer reads them.

A param that FSDP splits over an axis reaches the module as a :class:`GatherOnUse` box.
Flax unboxes a param at the moment a module reads it (``self.param``), so each shard is
all-gathered right where its layer needs it, not all at once at the top of the model
(the gather and its reduce-scatter gradient: :mod:`parallax.sharding.gather`).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct
from flax.core import meta

from parallax.sharding.gather import all_gather_mean_grad, gather_dim


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

    def replace_boxed(self, val: Any) -> GatherOnUse:
        return self.replace(value=val)

    def add_axis(self, index: int, params: dict[Any, Any]) -> GatherOnUse:
        return self.replace(dim=self.dim + (1 if index <= self.dim else 0))

    def remove_axis(self, index: int, params: dict[Any, Any]) -> GatherOnUse:
        if index == self.dim:
            raise ValueError(
                f"A lifted transform (nn.scan / nn.vmap) maps over dim {index}, which FSDP "
                f"split over {self.axis_name!r}; exclude this param from FSDP."
            )
        return self.replace(dim=self.dim - (1 if index < self.dim else 0))


def box_for_gather(local_params: Any, specs: Any, axes: set[str]) -> Any:
    """Boxes each local shard split over one of ``axes`` as :class:`GatherOnUse`."""

    def box(value, spec):
        found = gather_dim(spec, axes)
        return value if found is None else GatherOnUse(value, found[0], found[1])

    return jax.tree.map(box, local_params, specs)


def cast_box(box: GatherOnUse, dtype: Any) -> GatherOnUse:
    """The box, cast to ``dtype`` after its gather (the gather and its gradient keep the param's dtype)."""
    return box.replace(dtype=dtype)

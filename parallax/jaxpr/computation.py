"""What only the computation shows: the traced loss, and the facts placement reads from it.

A strategy part that ``uses_computation`` (a ``TensorParallel`` that derives its layout, an
``FSDP`` that must not split a dim a ``scan`` steps over) is given a :class:`Computation`
when the state is planned. The model layer traces the loss (nothing runs); this module only
reads the jaxpr, so it stays free of any model library.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from parallax.jaxpr.chains import chained_params
from parallax.jaxpr.siblings import sibling_params
from parallax.jaxpr.tp_layout import TensorLayout, derive_layout, expert_dims, scanned_dims


@dataclasses.dataclass(frozen=True)
class Computation:
    """A traced loss and the params it reads.

    Attributes:
        jaxpr: ``jax.make_jaxpr`` of the loss; its invars are the param leaves first, then
            the model state's leaves, then the batch's, then the rng key.
        param_paths: the path of each param leaf (``"Dense_0/kernel"``).
        param_shapes: each param's global shape.
        param_boxes: each param's abstract leaf as the model declared it (metadata boxes
            such as ``nn.Partitioned`` kept, for the model's own annotations).
        batch_invars: the indices of the batch leaves among the invars.
        axis_sizes: the mesh's axis sizes.
    """

    jaxpr: Any
    param_paths: tuple[str, ...]
    param_shapes: tuple[tuple[int, ...], ...]
    param_boxes: tuple
    batch_invars: tuple[int, ...]
    axis_sizes: Mapping[str, int]

    @functools.cached_property
    def _scanned(self) -> dict[str, tuple[int, ...]]:
        return scanned_dims(self.jaxpr, self.param_paths)

    def scanned_dims(self) -> dict[str, tuple[int, ...]]:
        """The param dims a ``scan`` steps over (``nn.scan``'s stacked layer dim), by path."""
        return self._scanned

    def expert_dims(self) -> dict[str, int]:
        """The experts dim of each param stacking a mixture of experts' weights, by path
        (:func:`parallax.jaxpr.tp_layout.expert_dims`)."""
        return expert_dims(self.jaxpr, self.param_paths)

    def chained_params(self) -> dict[str, tuple[int, int]]:
        """The params of a list of identical blocks called in turn (each block rematerialised when
        traced, :mod:`parallax.jaxpr.chains`), by path: ``(chain, layer)``."""
        found = chained_params(self.jaxpr.jaxpr, len(self.param_paths), self.jaxpr.consts)
        return {self.param_paths[index]: where for index, where in found.items()}

    def sibling_params(self) -> dict[str, tuple[int, int]]:
        """The params of a list of identical modules called side by side (each rematerialised when
        traced, :mod:`parallax.jaxpr.siblings`: a list of experts), by path: ``(group, member)``."""
        found = sibling_params(self.jaxpr.jaxpr, len(self.param_paths), self.jaxpr.consts)
        return {self.param_paths[index]: where for index, where in found.items()}

    def derive_layout(self, axis: str, fixed: Mapping[str, tuple[int | None, str]]) -> TensorLayout:
        """The Megatron layout over ``axis`` (see :func:`parallax.jaxpr.tp_layout.derive_layout`)."""
        return derive_layout(self.jaxpr, self.param_paths, axis=axis, axis_size=self.axis_sizes[axis],
                             batch_invars=self.batch_invars, fixed=fixed)

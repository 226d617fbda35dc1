"""Flax linen models behind the model seam: the only package that imports ``flax.linen``.

:class:`LinenModel` runs an unchanged ``nn.Module`` the way a step needs it: BatchNorm
statistics over the data axes, chosen modules rematerialised, the model's own logical
constraints kept to the mesh's automatic axes, mixed-precision casts, and FSDP shards
gathered where each layer reads them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import errors as flax_errors

from parallax._tree import unbox
from parallax.models.adapter import LossFn, ModelRun
from parallax.models.casts import Float32Outputs, cast_floating
from parallax.models.linen.batchnorm import batch_stats_over
from parallax.models.linen.constraints import constraints_within
from parallax.models.linen.gather_box import GatherOnUse, box_for_gather, cast_box
from parallax.models.linen.remat import remat_modules
from parallax.models.linen.wrap import wrap_for_shard_map
from parallax.sharding.gather import gather_all

__all__ = ["LinenModel", "is_linen_model", "wrap_for_shard_map"]

log = logging.getLogger("parallax")


def is_linen_model(model: Any) -> bool:
    """Whether ``model`` is a linen module instance."""
    return isinstance(model, nn.Module)


def is_linen_class(model: Any) -> bool:
    """Whether ``model`` is a linen module class (not an instance)."""
    return isinstance(model, type) and issubclass(model, nn.Module)


def _method(batch: Any, loss_fn: LossFn | None) -> Callable:
    """The ``method=`` that runs ``loss_fn(bound_model, batch)``, or the model on the batch."""
    if loss_fn is not None:
        return lambda module, b: loss_fn(module, b)
    if isinstance(batch, (tuple, list)):
        return lambda module, b: module(*b)
    return lambda module, b: module(b)


@dataclasses.dataclass(frozen=True)
class LinenModel:
    """The model seam for a flax linen module.

    Attributes:
        model: the unchanged ``nn.Module``.
    """

    model: nn.Module

    def init(self, rngs: Mapping[str, Any], batch: Any, loss_fn: LossFn | None,
             constraint_axes: Sequence[str]) -> tuple[Any, dict]:
        with constraints_within(constraint_axes):
            variables = dict(self.model.init(dict(rngs), batch, method=_method(batch, loss_fn)))
        params = variables.pop("params", {})
        return params, unbox(variables)

    def unbox(self, params: Any) -> Any:
        return unbox(params)

    def module_calls(self, batch: Any, loss_fn: LossFn | None) -> set[tuple[str, tuple]]:
        calls: set[tuple[str, tuple]] = set()

        def record(next_fun, args, kwargs, context):
            if context.method_name == "__call__":
                calls.add((type(context.module).__name__, tuple(context.module.path)))
            return next_fun(*args, **kwargs)

        def init(batch: Any) -> Any:  # the key made inside the trace: nothing runs (a deviceless target runs nothing)
            key = jax.random.key(0)
            return self.model.init({"params": key, "dropout": key}, batch, method=_method(batch, loss_fn))

        with nn.intercept_methods(record):  # the batch traced (not a constant): shapes alone will do
            jax.eval_shape(init, batch)
        return calls

    def values(self) -> None:
        return None  # a linen module holds no values: the state is always initialised

    def pretrained(self, params: Any) -> Any:
        """A variables dict (``{"params": ...}``, as ``model.init`` returns) gives its params."""
        if isinstance(params, Mapping) and set(params) == {"params"}:
            return params["params"]
        return params

    def bind(self, params: Any, model_state: dict) -> nn.Module:
        return self.model.bind({"params": params, **model_state})

    def write_back(self, params: Any, model_state: dict) -> None:
        pass  # a linen module holds no values

    def optimizer(self, optimizer: Any) -> tuple[Any, None]:
        return optimizer, None

    def apply(self, params: Any, model_state: dict, batch: Any, *, rngs: Mapping[str, Any],
              loss_fn: LossFn | None, run: ModelRun) -> tuple[Any, dict]:
        if run.gather is None:
            return self._apply(params, model_state, batch, rngs, loss_fn, run)
        specs, axes = run.gather.specs, set(run.gather.axes)
        try:  # each FSDP param gathered where its layer reads it (self.param) ...
            return self._apply(box_for_gather(params, specs, axes), model_state, batch, rngs, loss_fn, run)
        except (AttributeError, TypeError) as err:
            if "GatherOnUse" not in str(err):
                raise
            # ... unless the model reads params another way (self.variables, a tied embedding
            # transposed): then all of them are gathered before the model runs.
            log.info("The model reads params other than through self.param (%s); FSDP gathers its params "
                     "before the model runs instead of where each layer reads them.", err)
            return self._apply(gather_all(params, specs, axes), model_state, batch, rngs, loss_fn, run)

    def _apply(self, params, model_state, batch, rngs, loss_fn, run: ModelRun):
        method = _method(batch, loss_fn)
        if run.compute_dtype is not None:
            params = cast_floating(params, run.compute_dtype, is_leaf=lambda x: isinstance(x, GatherOnUse),
                                   cast_leaf=cast_box)
            batch = cast_floating(batch, run.compute_dtype)
            inner = method
            method = lambda module, b: inner(Float32Outputs(module), b)
        with batch_stats_over(run.batch_stats_axes), remat_modules(run.remat), constraints_within(run.constraint_axes):
            try:
                output, updates = self.model.apply(
                    {"params": params, **model_state}, batch, method=method, rngs=dict(rngs),
                    mutable=list(model_state) if run.train else [],
                )
            except flax_errors.ModifyScopeVariableError as err:
                raise ValueError(
                    "The evaluation loss function tries to update the model's state (e.g. BatchNorm "
                    "statistics in training mode); pass eval_loss_fn that calls the model with "
                    f"train=False. ({err})"
                ) from None
        return output, {**model_state, **updates}

"""Flax NNX models behind the model seam.

An NNX module is split into its graph definition (static: what the train state keeps as
``model``) and plain nested dicts of values: the ``nnx.Param`` s are the params, every other
variable (``nnx.BatchStat``, rng state, ...) is model state. Inside a step the module is
merged back from the values, the loss function calls it, and the variables it mutated are
split off again. Status (issue 13, in progress): params and model state, train/eval mode,
BatchNorm over the data axes, rng streams per step and data shard, mixed precision and FSDP
(gathered before the model runs) work; gather-on-use and remat of NNX modules do not yet.
"""

from __future__ import annotations

import dataclasses
import inspect
import zlib
from typing import Any, Mapping, Sequence

import jax
from flax import nnx

from parallax.models.adapter import LossFn, ModelRun
from parallax.models.precision import Float32Outputs, cast_floating
from parallax.sharding.gather import gather_all

__all__ = ["NNXModel", "is_nnx_model"]


def is_nnx_model(model: Any) -> bool:
    """Whether ``model`` is an NNX module instance, or its graph definition."""
    return isinstance(model, (nnx.Module, nnx.graph.GraphDef))


def is_nnx_class(model: Any) -> bool:
    """Whether ``model`` is an NNX module class (not an instance)."""
    return isinstance(model, type) and issubclass(model, nnx.Module)


def _split(module: nnx.Module) -> tuple[Any, dict, dict]:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


@dataclasses.dataclass(frozen=True)
class NNXModel:
    """The model seam for a Flax NNX module.

    Attributes:
        model: the module's ``nnx.GraphDef`` (static; the train state's ``model``).
        source: the module instance, or a function that builds one, when the state is
            still to be built; ``None`` inside a step.
    """

    model: Any
    source: Any = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(cls, model: Any) -> "NNXModel":
        """The adapter of an NNX instance, a function that builds one, or a graph definition."""
        if isinstance(model, nnx.graph.GraphDef):
            return cls(model)
        if isinstance(model, nnx.Module):
            return cls(nnx.graphdef(model), source=model)
        try:
            inspect.signature(model).bind()
        except TypeError:
            raise ValueError(f"model is a function that takes arguments {inspect.signature(model)}; pass a function "
                             "with no arguments that builds the NNX module, e.g. lambda: MyModel(cfg, "
                             "rngs=nnx.Rngs(0)).") from None
        except ValueError:
            pass  # no signature to read (a builtin): try it
        built = nnx.eval_shape(model)
        if not isinstance(built, nnx.Module):
            what = (f"an array {built.dtype}{tuple(built.shape)}" if isinstance(built, jax.ShapeDtypeStruct)
                    else type(built).__name__)
            raise ValueError(f"model is a function that returns {what}, not an NNX module; pass a flax.linen or "
                             "flax.nnx module, or a function that builds an NNX module.")
        return cls(nnx.graphdef(built), source=model)

    def init(self, rngs: Mapping[str, Any], batch: Any, loss_fn: LossFn | None,
             constraint_axes: Sequence[str]) -> tuple[Any, dict]:
        """The module's own values (an NNX module seeds itself: ``rngs`` is not used)."""
        if self.source is None:
            raise ValueError("This NNX adapter holds only a graph definition; build the state from the module "
                             "or from a function that builds it.")
        module = self.source if isinstance(self.source, nnx.Module) else self.source()
        _, params, rest = _split(module)
        return params, rest

    def unbox(self, params: Any) -> Any:
        return params

    def apply(self, params: Any, model_state: dict, batch: Any, *, rngs: Mapping[str, Any],
              loss_fn: LossFn | None, run: ModelRun) -> tuple[Any, dict]:
        if run.remat:
            raise ValueError("remat= is not supported for NNX models yet; wrap the blocks with nnx.remat.")
        if run.gather is not None:
            params = gather_all(params, run.gather.specs, set(run.gather.axes))
        if run.compute_dtype is not None:
            params = cast_floating(params, run.compute_dtype)
            batch = cast_floating(batch, run.compute_dtype)
        module = nnx.merge(self.model, params, model_state)
        keys = _reseed(module, rngs)
        _set_batch_stats_axes(module, run.batch_stats_axes)
        if run.train:
            module.train()
        else:
            module.eval()
        call = Float32Outputs(module) if run.compute_dtype is not None else module
        output = _call(call, batch, loss_fn)
        _restore_keys(keys)
        _, _, new_state = _split(module)
        if not run.train:
            new_state = model_state  # evaluation changes nothing
        return output, new_state


def _call(module: Any, batch: Any, loss_fn: LossFn | None) -> Any:
    if loss_fn is not None:
        return loss_fn(module, batch)
    return module(*batch) if isinstance(batch, (tuple, list)) else module(batch)


def _streams(module: nnx.Module) -> list:
    return [node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.RngStream)]


def _reseed(module: nnx.Module, rngs: Mapping[str, Any]) -> list[tuple[Any, Any, Any]]:
    """Each rng stream draws from this step's (and data shard's) key for its name, so that dropout
    differs per step and per data shard and a resumed run draws the same numbers. Returns the
    streams' own keys and counts, put back after the call (the state keeps its seeds)."""
    saved = []
    first = next(iter(rngs.values()), None)
    for stream in _streams(module):
        saved.append((stream, stream.key.get_value(), stream.count.get_value()))
        base = rngs.get(stream.tag)
        if base is None and first is not None:  # a stream not named in rng_streams: its own fold of the first
            base = jax.random.fold_in(first, zlib.crc32(stream.tag.encode()) % 2**31)
        if base is not None:
            stream.key.set_value(jax.random.wrap_key_data(base, impl=jax.random.key_impl(stream.key.get_value())))
            stream.count.set_value(jax.numpy.zeros_like(stream.count.get_value()))
    return saved


def _restore_keys(saved: list[tuple[Any, Any, Any]]) -> None:
    for stream, key, count in saved:
        stream.key.set_value(key)
        stream.count.set_value(count)


def _set_batch_stats_axes(module: nnx.Module, axes: tuple[str, ...] | None) -> None:
    """BatchNorm reduces its statistics over the data axes inside ``shard_map`` (the global batch)."""
    axis_name = None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.BatchNorm):
            node.axis_name = axis_name

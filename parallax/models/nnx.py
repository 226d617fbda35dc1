"""Flax NNX models behind the model seam.

An NNX module is split into its graph definition (static: what the train state keeps as
``model``) and plain nested dicts of values: the ``nnx.Param`` s are the params, every other
variable (``nnx.BatchStat``, rng state, ...) is model state. Inside a step the module is
merged back from the values, the loss function calls it, and the variables it mutated are
split off again.

This step's merged copy is adjusted before the call: train or eval mode, BatchNorm reducing
over the data axes, rng streams reseeded from the step's key, FSDP shards that all-gather
themselves where they are read, and ``remat`` targets running under ``nnx.remat`` (the last
two by giving those objects a subclass of their own class). Mechanism, measured in
``benchmarks/nnx_vs_linen.py``: pure state through the same step builders as linen, which
trains the NNX definition of a network as fast as the linen one with the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from flax.core import meta
from flax.core import spmd as core_spmd
from flax.traverse_util import flatten_dict, unflatten_dict

from parallax._tree import unbox
from parallax.models.adapter import LossFn, ModelRun, ParamGather
from parallax.models.casts import Float32Outputs, cast_floating
from parallax.models.nnx_remat import rematerialise
from parallax.sharding.gather import all_gather_mean_grad, gather_dim
from parallax.sharding.mesh import is_explicit

__all__ = ["NNXModel"]


def _split(module: nnx.Module) -> tuple[Any, dict, dict]:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def _build(factory: Callable[[], Any]) -> Any:
    """Calls a function that builds a module with eager sharding off: a variable's sharding
    annotation (``nnx.with_partitioning``, ``out_sharding=``) stays metadata for parallax to read,
    instead of asking for a mesh context of the user's own."""
    with nnx.use_eager_sharding(False):
        return factory()


def _annotated_params(module: nnx.Module) -> dict:
    """The ``nnx.Param`` values, each with its sharding annotation in a flax ``Partitioned`` box
    (what the strategies read). Logical names go through the variable's ``sharding_rules`` and
    the ``logical_axis_rules`` context, as flax resolves them; other names stay as they are."""
    context = dict(core_spmd.get_logical_axis_rules())

    def boxed(variable):
        value = variable.get_value()
        metadata = variable.get_metadata()
        names = metadata.get("out_sharding")
        if isinstance(names, jax.sharding.NamedSharding):
            names = names.spec
        if not names:
            return value
        rules = {**context, **dict(metadata.get("sharding_rules") or ())}
        return meta.Partitioned(value, tuple(rules.get(name, name) if isinstance(name, str) else name
                                             for name in names))

    flat = {path: boxed(variable) for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    return unflatten_dict(flat)


def _check_one_mesh(module: nnx.Module) -> None:
    """Variables already placed on a mesh (``NamedSharding``) must all be on the same one."""
    meshes: dict[Any, str] = {}
    for path, variable in nnx.to_flat_state(nnx.state(module)):
        value = variable.get_value() if isinstance(variable, nnx.Variable) else variable
        sharding = getattr(value, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            mesh = (tuple(d.id for d in sharding.mesh.devices.flat), tuple(sharding.mesh.axis_names))
            meshes.setdefault(mesh, "/".join(map(str, path)))
    if len(meshes) > 1:
        (first, a), (second, b) = list(meshes.items())[:2]
        raise ValueError(
            f"The NNX model's variables live on different meshes: {a} on devices {list(first[0])} with axes "
            f"{first[1]}, {b} on devices {list(second[0])} with axes {second[1]}. parallax places every variable "
            "on the strategy's mesh: build the model on one mesh (or none), or nnx.update it with "
            "jax.device_get(nnx.state(model)) first.")


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
    def of(cls, model: Any) -> NNXModel:
        """The adapter of an NNX instance, a function that builds one, or a graph definition."""
        if isinstance(model, nnx.graph.GraphDef):
            return cls(model)
        if isinstance(model, nnx.Module):
            _check_one_mesh(model)
            return cls(nnx.graphdef(model), source=model)
        try:
            inspect.signature(model).bind()
        except TypeError:
            raise ValueError(f"model is a function that takes arguments {inspect.signature(model)}; pass a function "
                             "with no arguments that builds the NNX module, e.g. lambda: MyModel(cfg, "
                             "rngs=nnx.Rngs(0)).") from None
        except ValueError:
            pass  # no signature to read (a builtin): try it
        built = nnx.eval_shape(lambda: _build(model))
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
        module = self.source if isinstance(self.source, nnx.Module) else _build(self.source)
        values = _annotated_params(module), _split(module)[2]
        return _without_explicit_types(values) if module is self.source else values

    def unbox(self, params: Any) -> Any:
        return unbox(params)

    def module_calls(self, batch: Any, loss_fn: LossFn | None) -> set[tuple[str, tuple]]:
        """The submodules of the module (built from shapes for a function), each with its path."""
        module = self.source if isinstance(self.source, nnx.Module) else nnx.eval_shape(lambda: _build(self.source))
        return {(type(node).__name__, tuple(path)) for path, node in nnx.iter_graph(module)
                if isinstance(node, nnx.Module)}

    def values(self) -> tuple[dict, dict] | None:
        """An instance's own values (kept, e.g. pretrained weights); ``None`` for a function."""
        if not isinstance(self.source, nnx.Module):
            return None
        _, params, rest = _split(self.source)
        return params, rest

    def pretrained(self, params: Any) -> Any:
        """An ``nnx.State`` (``nnx.state(model, nnx.Param)``) or a module gives its params as a dict."""
        if isinstance(params, nnx.Module):
            return _split(params)[1]
        if isinstance(params, nnx.State):
            return nnx.to_pure_dict(params)
        return params

    def bind(self, params: Any, model_state: dict) -> nnx.Module:
        return nnx.merge(self.model, params, model_state)

    def write_back(self, params: Any, model_state: dict) -> None:
        """The instance the user passed takes the trained values (``nnx.update``): how an NNX user
        goes on (evaluate, export, save) after ``fit``."""
        if isinstance(self.source, nnx.Module):
            nnx.update(self.source, nnx.state(self.bind(params, model_state)))

    def optimizer(self, optimizer: Any) -> tuple[Any, Any]:
        """An optax transformation as it is; an ``nnx.Optimizer`` as its ``tx`` and, once it has
        taken steps, its state (so a resumed optimizer keeps its moments)."""
        if not isinstance(optimizer, nnx.Optimizer):
            return optimizer, None
        return optimizer_parts(optimizer, self._abstract_module())

    def _abstract_module(self) -> nnx.Module:
        if isinstance(self.source, nnx.Module):
            return self.source
        return nnx.eval_shape(lambda: _build(self.source))

    def apply(self, params: Any, model_state: dict, batch: Any, *, rngs: Mapping[str, Any],
              loss_fn: LossFn | None, run: ModelRun) -> tuple[Any, dict]:
        gathered = _gather_dims(run.gather) if run.gather is not None else {}
        if run.compute_dtype is not None:  # a gathered param is cast after its gather (as linen's)
            params = _cast_except(params, gathered, run.compute_dtype)
            batch = cast_floating(batch, run.compute_dtype)
        module = nnx.merge(self.model, params, model_state)
        _gather_on_read(module, gathered, run.compute_dtype)
        rematerialise(module, run.remat)
        keys = _reseed(module, rngs)
        _set_batch_stats_axes(module, run.batch_stats_axes)
        if run.train:
            module.train()
        else:
            module.eval()
        call = Float32Outputs(module) if run.compute_dtype is not None else module
        output = _call(call, batch, loss_fn)
        _restore_keys(keys)
        new_state = nnx.to_pure_dict(nnx.state(module, nnx.Not(nnx.Param)))  # params are not read again
        if not run.train:
            new_state = model_state  # evaluation changes nothing
        return output, new_state


def _without_explicit_types(tree: Any) -> Any:
    """An instance's values with the Explicit mesh types they were made with dropped (host copies of
    those arrays alone): a module built inside ``jax.set_mesh`` of an Explicit mesh holds arrays whose
    type names that mesh, and traced as the model's values on parallax's mesh (Auto axes for an
    ordinary model) JAX refused their first gather ("context mesh ... Auto should match the aval mesh
    ... Explicit"). The values are the same; where they go is the state's plan."""

    def untyped(leaf: Any) -> Any:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer) or not is_explicit(
                getattr(sharding, "mesh", None)):
            return leaf
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            with jax.ensure_compile_time_eval():  # the key's data, not a traced op on it, inside a trace too
                data = np.asarray(jax.random.key_data(leaf))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        return np.asarray(leaf)

    return jax.tree.map(untyped, tree)


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
            own = stream.key.get_value()
            key = jax.random.wrap_key_data(base, impl=jax.random.key_impl(own))
            if own.shape:  # a stream of stacked blocks (nnx.split_rngs + nnx.vmap): a key each, as split_rngs splits
                key = jax.random.split(key, math.prod(own.shape)).reshape(own.shape)
            stream.key.set_value(key)
            stream.count.set_value(jax.numpy.zeros_like(stream.count.get_value()))
    return saved


def _restore_keys(saved: list[tuple[Any, Any, Any]]) -> None:
    for stream, key, count in saved:
        stream.key.set_value(key)
        stream.count.set_value(count)


def _gather_dims(gather: ParamGather) -> dict[tuple, tuple[int, str]]:
    """``{param path: (dim, axis)}`` of the FSDP shards to all-gather where they are read."""
    found = {path: gather_dim(spec, set(gather.axes)) for path, spec in flatten_dict(gather.specs).items()}
    return {path: dim_axis for path, dim_axis in found.items() if dim_axis is not None}


def _cast_except(params: dict, skip: Mapping[tuple, Any], dtype: Any) -> dict:
    flat = flatten_dict(params)
    return unflatten_dict({path: value if path in skip else cast_floating(value, dtype)
                           for path, value in flat.items()})


def _gather_on_read(module: nnx.Module, gathered: Mapping[tuple, tuple[int, str]], dtype: Any) -> None:
    """Each FSDP shard all-gathers itself where the model reads it (``kernel[...]``), not all at
    once before the model runs: ZeRO-3's memory inside ``shard_map``. Its gradient is the
    reduce-scatter mean (:func:`parallax.sharding.gather.all_gather_mean_grad`)."""
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param) and tuple(path) in gathered:
            dim, axis = gathered[tuple(path)]
            object.__setattr__(node, "__class__", _gathered_on_read(type(node), dim, axis, dtype))


@functools.cache
def _gathered_on_read(cls: type, dim: int, axis: str, dtype: Any) -> type:
    """``cls`` (an ``nnx.Param`` type) whose value, when read, is its shard all-gathered along ``dim``."""

    def get_value(self, **kwargs):
        index = kwargs.pop("index", ...)
        full = all_gather_mean_grad(cls.get_value(self, **kwargs), axis, dim)
        full = full if dtype is None else cast_floating(full, dtype)
        return full if index is ... else full[index]

    return type(cls.__name__, (cls,), {"get_value": get_value, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _set_batch_stats_axes(module: nnx.Module, axes: tuple[str, ...] | None) -> None:
    """BatchNorm reduces its statistics over the data axes inside ``shard_map`` (the global batch)."""
    axis_name = None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.BatchNorm):
            node.axis_name = axis_name


def optimizer_parts(optimizer: nnx.Optimizer, module: nnx.Module) -> tuple[optax.GradientTransformation, Any]:
    """``(tx, opt_state or None)`` of an ``nnx.Optimizer`` over ``module``'s params.

    parallax trains every ``nnx.Param`` and nothing else, so ``wrt`` must select exactly those
    (``wrt=nnx.Param``). The state of an optimizer that has taken steps is carried over.
    """
    select = nnx.filterlib.to_predicate(optimizer.wrt)
    variables = nnx.to_flat_state(nnx.state(module))
    left_out = ["/".join(map(str, path)) for path, v in variables if isinstance(v, nnx.Param) and not select(path, v)]
    extra = [f"{'/'.join(map(str, path))} ({type(v).__name__})" for path, v in variables
             if not isinstance(v, nnx.Param) and select(path, v)]
    if left_out or extra:
        what = (f"leaves these params out: {', '.join(left_out[:5])}" if left_out
                else f"selects variables that are not params: {', '.join(extra[:5])}")
        raise ValueError(
            f"nnx.Optimizer(..., wrt={optimizer.wrt!r}) {what}. parallax trains every nnx.Param and only those: "
            "pass wrt=nnx.Param, and freeze params in the optax transformation instead (optax.multi_transform "
            "with optax.set_to_zero() for the frozen ones).")
    tx = optimizer.tx
    if int(np.asarray(optimizer.step.get_value())) == 0:
        return tx, None
    values = jax.tree.leaves(optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    values = [v.get_value() if isinstance(v, nnx.Variable) else v for v in values]
    fresh = jax.eval_shape(tx.init, nnx.to_pure_dict(nnx.state(module, nnx.Param)))
    leaves, treedef = jax.tree.flatten(fresh)
    if len(values) != len(leaves) or any(np.shape(v) != leaf.shape for v, leaf in zip(values, leaves)):
        raise ValueError("The nnx.Optimizer's state does not match its tx over the model's params; pass "
                         "optimizer.tx (a fresh optimizer state) or the optimizer built for this model.")
    return tx, jax.tree.unflatten(treedef, values)

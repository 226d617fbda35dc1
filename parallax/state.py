"""The train state and building it sharded, from shapes, without a whole copy anywhere."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding

from parallax._tree import is_box, path_str, unbox
from parallax.constraints import constraints_within
from parallax.specs import annotation_dims, dims_axes, is_spec
from parallax.strategy import FSDP, Strategy, TensorParallel
from parallax.tp_layout import TensorLayout, derive_layout, scanned_dims

LossFn = Callable[[nn.Module, Any], Any]


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes. A pytree of arrays plus two static fields.

    Attributes:
        step: number of updates applied (int32 scalar).
        params: the model's params, unboxed (plain arrays, sharded as the strategy says).
        opt_state: the optimizer state; moments are sharded like their params.
        rng: base PRNG key; step ``t`` uses ``fold_in(rng, t)``, so a resumed run
            draws the same numbers as an uninterrupted one.
        model_state: the model's other variable collections, e.g. ``{"batch_stats": ...}``.
        model: the flax module (static).
        tx: the optax transformation (static).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    model_state: dict
    model: nn.Module = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)

    @property
    def variables(self) -> dict:
        """``{"params": ..., **model_state}``, ready for ``model.apply``."""
        return {"params": self.params, **self.model_state}


def as_key(rng: Any) -> jax.Array:
    """A raw ``uint32[2]`` PRNG key from a seed, a raw key or a typed key."""
    if isinstance(rng, int):
        return jax.random.PRNGKey(rng)
    rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng)
    return rng


def model_rngs(key: jax.Array, streams: Sequence[str]) -> dict[str, jax.Array]:
    """One independent key per named rng stream (``"dropout"``, ...)."""
    return {name: jax.random.fold_in(key, index) for index, name in enumerate(streams)}


def check_model(model: Any) -> None:
    """Raises a clear error, before anything compiles, for a model parallax cannot take yet.

    Raises:
        ValueError: an NNX module (support is coming), a linen module class instead of an
            instance, or anything that is not a flax linen module.
    """
    if isinstance(model, nn.Module):
        return
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise ValueError(f"model is the class {model.__name__}; pass an instance, e.g. {model.__name__}(...).")
    from flax import nnx  # only on this error path

    if isinstance(model, nnx.Module) or (isinstance(model, type) and issubclass(model, nnx.Module)):
        name = model.__name__ if isinstance(model, type) else type(model).__name__
        raise ValueError(
            f"model is a Flax NNX module ({name}); parallax takes flax.linen modules today, and NNX "
            "support (the same strategies and Trainer) is in progress. Meanwhile, wrap it as a linen "
            f"module: flax.nnx.bridge.to_linen({name}, *constructor_args) (without the rngs argument), "
            "and pass that to parallax."
        )
    raise ValueError(
        f"model must be a flax.linen.Module instance, got {type(model).__name__} ({model!r:.80})."
    )


def call_model(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> Callable:
    """The ``method=`` that runs ``loss_fn(bound_model, batch)``, or the model on the batch."""
    if loss_fn is not None:
        return lambda module, b: loss_fn(module, b)
    if isinstance(batch, (tuple, list)):
        return lambda module, b: module(*b)
    return lambda module, b: module(b)


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """Where every leaf of a train state will live, before any of it exists.

    Attributes:
        mesh: the device mesh.
        strategy: the strategy as planned: a ``TensorParallel`` part carries the layout
            derived from the computation (see :meth:`describe_layout`).
        abstract: the state's shapes and dtypes (params still in their flax boxes).
        specs: a ``PartitionSpec`` per leaf of the (unboxed) state.
        shardings: the matching ``NamedSharding`` tree.
        build: ``build()`` computes the sharded state (each device only its shards).
        lower: ``lower()`` gives the lowered init computation (for memory analysis).
    """

    mesh: Mesh
    strategy: Strategy
    abstract: TrainState
    specs: Any
    shardings: Any
    build: Callable[[], TrainState]
    lower: Callable[[], Any]

    def describe_layout(self) -> str:
        """What each tensor-parallel axis splits, and why the rest stays whole.

        Example:
            >>> plan = px.plan_state(model, optax.sgd(0.1), batch, strategy=px.TensorParallel(2))
            >>> print(plan.describe_layout())  # doctest: +SKIP
            tensor-parallel layout over 'tensor' (size 2): 8 of 8 params split, 100.0% of param elements
              Dense_0/kernel  (16, 64)  dim 1  column  chain of Dense_0/kernel[1], Dense_1/kernel[0] ...
        """
        parts = [p for p in self.strategy.parts if isinstance(p, TensorParallel)]
        if not parts:
            return f"{self.strategy.describe()}: no tensor-parallel axis."
        return "\n".join(p.describe_layout() for p in parts)

    def abstract_arrays(self) -> Any:
        """``ShapeDtypeStruct`` s with shardings: a restore target for checkpoints."""
        plain = self.abstract.replace(params=unbox(self.abstract.params))
        return jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            plain,
            self.shardings,
        )


def plan_state(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    example_batch: Any,
    *,
    strategy: Strategy,
    rng: Any = 0,
    loss_fn: LossFn | None = None,
    mesh: Mesh | None = None,
    rng_streams: Sequence[str] = ("dropout",),
) -> StatePlan:
    """Plans the sharded train state from shapes: ``eval_shape`` → specs → ``jit``.

    Takes the same arguments as :func:`init_state`, which is ``plan_state(...).build()``.

    Example:
        >>> plan = px.plan_state(model, optax.adam(1e-3), batch, strategy=px.FSDP())
        >>> plan.specs.params["Dense_0"]["kernel"]
        PartitionSpec('fsdp', None)
    """
    check_model(model)
    if not isinstance(strategy, Strategy):
        raise ValueError(f"strategy must be a parallax strategy (e.g. px.FSDP()), got {strategy!r}.")
    mesh = strategy.make_mesh() if mesh is None else mesh
    key = as_key(rng)
    method = call_model(model, example_batch, loss_fn)

    def make(key, batch, boxed: bool):
        init_key, stream_key, state_key = jax.random.split(key, 3)
        rngs = {"params": init_key, **model_rngs(stream_key, rng_streams)}
        with constraints_within(mesh.axis_names):
            variables = dict(model.init(rngs, batch, method=method))
        params = variables.pop("params", {})
        plain_params = unbox(params)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params if boxed else plain_params,
            opt_state=optimizer.init(plain_params),
            rng=state_key,
            model_state=unbox(variables),
            model=model,
            tx=optimizer,
        )

    try:
        abstract = jax.eval_shape(lambda k, b: make(k, b, boxed=True), key, example_batch)
    except jax.errors.ConcretizationTypeError as err:
        raise ValueError(
            "The loss function (or the model) turns a traced array into a Python value: float(x), int(x), "
            "x.item(), bool(x) or `if x:` on an array. parallax compiles the loss, so values stay arrays: "
            "return the loss array (not float(loss)), and use jnp.where / lax.cond instead of Python `if`. "
            f"JAX's message: {str(err).splitlines()[0]}"
        ) from err
    strategy = fit_to_computation(strategy, model, abstract, example_batch, method, mesh, rng_streams)
    specs = strategy.state_specs(abstract, mesh)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
    jitted = jax.jit(lambda k, b: make(k, b, boxed=False), out_shardings=shardings)
    return StatePlan(
        mesh, strategy, abstract, specs, shardings,
        build=lambda: jitted(key, example_batch),
        lower=lambda: jitted.lower(key, example_batch),
    )


def fit_to_computation(
    strategy: Strategy,
    model: nn.Module,
    abstract: TrainState,
    example_batch: Any,
    method: Callable,
    mesh: Mesh,
    rng_streams: Sequence[str],
) -> Strategy:
    """``strategy`` with what only the computation shows: TP layouts, and the dims scans step over.

    The loss is traced once (``jax.make_jaxpr``, nothing runs) on the params' shapes, as a
    train step calls it. Each ``TensorParallel`` that derives gets a layout from
    :func:`parallax.tp_layout.derive_layout`; each ``FSDP`` learns which param dims an
    ``nn.scan`` steps over, so that it splits another one.
    """
    fsdp_parts = [part for part in strategy.parts if isinstance(part, FSDP)]
    if not strategy.needs_layout and not fsdp_parts:
        return strategy
    boxed = jax.tree_util.tree_flatten_with_path(abstract.params, is_leaf=is_box)[0]
    paths = [path_str(key_path) for key_path, _ in boxed]
    plain_leaves, treedef = jax.tree.flatten(unbox(abstract.params))
    state_leaves = jax.tree.leaves(abstract.model_state)

    def loss(param_leaves, model_state, batch, key):
        variables = {"params": jax.tree.unflatten(treedef, param_leaves), **model_state}
        with constraints_within(mesh.axis_names):
            return model.apply(variables, batch, rngs=model_rngs(key, rng_streams), method=method, mutable=True)

    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    closed = jax.make_jaxpr(loss)(plain_leaves, abstract.model_state, example_batch, key)
    first_batch = len(plain_leaves) + len(state_leaves)
    batch_invars = range(first_batch, first_batch + len(jax.tree.leaves(example_batch)))
    if fsdp_parts:
        scanned = scanned_dims(closed, paths)
        if scanned:
            for part in fsdp_parts:
                strategy = strategy.with_part(part, part.skipping_scanned(scanned))
    sizes = strategy.axis_sizes(mesh)
    for part in strategy.parts:
        if not part.needs_layout:
            continue
        fixed = {}
        for path, (_, box) in zip(paths, boxed):
            shape = tuple(box.value.shape) if is_box(box) else tuple(box.shape)
            annotated = annotation_dims(box, shape, sizes)
            dim = next((d for d, entry in enumerate(annotated) if part.axis in dims_axes([entry])), None)
            if dim is not None:
                fixed[path] = (dim, "annotation")
                continue
            ruled = part.rule_dims(path, shape, [None] * len(shape), sizes)
            if ruled is not None:
                fixed[path] = (next((d for d, entry in enumerate(ruled) if entry == part.axis), None), "rule")
        layout: TensorLayout = derive_layout(
            closed, paths, axis=part.axis, axis_size=sizes[part.axis], batch_invars=tuple(batch_invars), fixed=fixed,
        )
        strategy = strategy.with_part(part, part.with_layout(layout))
    return strategy


def init_state(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    example_batch: Any,
    *,
    strategy: Strategy,
    rng: Any = 0,
    loss_fn: LossFn | None = None,
    mesh: Mesh | None = None,
    rng_streams: Sequence[str] = ("dropout",),
) -> TrainState:
    """Builds the sharded train state from shapes (``eval_shape`` → specs → ``jit``).

    Each device computes only its own shard of every param and moment; no param is
    ever whole on one device under FSDP.

    Args:
        model: an unmodified flax linen module.
        optimizer: an optax transformation.
        example_batch: a batch as the loss function receives it (any batch size; only
            shapes and dtypes matter beyond the feature dims).
        strategy: the parallelism strategy.
        rng: a seed or a PRNG key.
        loss_fn: if given, the model is initialised by running ``loss_fn(model, batch)``,
            which calls the model exactly as training will. Otherwise the model is
            called on ``example_batch`` (unpacked if it is a tuple).
        mesh: the device mesh; ``strategy.make_mesh()`` by default.
        rng_streams: rng names the model draws from besides ``"params"``.

    Returns:
        A :class:`TrainState` whose arrays carry ``NamedSharding`` s on ``mesh``.

    Example:
        >>> state = px.init_state(model, optax.adam(1e-3), batch, strategy=px.FSDP(),
        ...                       rng=0, loss_fn=loss_fn)
    """
    return plan_state(
        model, optimizer, example_batch, strategy=strategy, rng=rng, loss_fn=loss_fn, mesh=mesh,
        rng_streams=rng_streams,
    ).build()

"""Planning the train state from shapes, and building it sharded without a whole copy anywhere."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from parallax._tree import is_box, path_str
from parallax.models import LossFn, ModelAdapter, ModelRun, adapter_for
from parallax.sharding.computation import Computation
from parallax.sharding.specs import is_spec
from parallax.sharding.strategy import Strategy
from parallax.step.state import TrainState, as_key, model_rngs


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
            >>> plan = px.plan_state(model, optax.sgd(0.1), batch, strategy=px.TensorParallel(2),
            ...                      loss_fn=loss_fn, mesh=px.TensorParallel(2).make_mesh(jax.devices()[:2]))
            >>> print(plan.describe_layout())
            tensor-parallel layout over 'tensor' (size 2): 5 of 6 params split, 98.9% of param elements
              Dense_0/bias    (64,)     dim 0  elementwise splits the chain ...
              Dense_0/kernel  (16, 64)  dim 1  column      splits the chain ...
              Dense_1/bias    (64,)     whole  -           dim 0 (64): shares arrays with the chain ...
              Dense_1/kernel  (64, 64)  dim 0  row         splits the chain ...
              Dense_2/bias    (10,)     dim 0  elementwise splits the chain ...
              Dense_2/kernel  (64, 10)  dim 1  column      splits the chain ...
        """
        return self.strategy.describe_layout()

    def abstract_arrays(self) -> Any:
        """``ShapeDtypeStruct`` s with shardings: a restore target for checkpoints."""
        plain = self.abstract.replace(params=adapter_for(self.abstract.model).unbox(self.abstract.params))
        return jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            plain,
            self.shardings,
        )


def plan_state(
    model: Any,
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
        >>> plan = px.plan_state(model, optax.adam(1e-3), batch, strategy=px.FSDP(min_weight_size=0),
        ...                      loss_fn=loss_fn)
        >>> tuple(plan.specs.params["Dense_1"]["kernel"])  # (64, 64): both dims divide by 8, the first is split
        ('fsdp',)
    """
    adapter = adapter_for(model)
    optimizer, given_opt_state = adapter.optimizer(optimizer)
    given = adapter.values()
    if not isinstance(strategy, Strategy):
        raise ValueError(f"strategy must be a parallax strategy (e.g. px.FSDP()), got {strategy!r}.")
    mesh = strategy.make_mesh() if mesh is None else mesh
    key = as_key(rng)
    rng_streams = tuple(rng_streams)

    def make(key, batch, boxed: bool, values=None, opt_state=None):
        init_key, stream_key, state_key = jax.random.split(key, 3)
        rngs = {"params": init_key, **model_rngs(stream_key, rng_streams)}
        params, model_state = adapter.init(rngs, batch, loss_fn, mesh.axis_names) if values is None else values
        plain_params = adapter.unbox(params)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params if boxed else plain_params,
            opt_state=optimizer.init(plain_params) if opt_state is None else opt_state,
            rng=state_key,
            model_state=model_state,
            model=adapter.model,
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
    if strategy.needs_computation:
        strategy = strategy.fitted_to(trace_computation(adapter, abstract, example_batch, loss_fn, mesh, strategy,
                                                        rng_streams))
    specs = strategy.state_specs(abstract, mesh)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
    jitted = jax.jit(lambda k, b, v, o: make(k, b, boxed=False, values=v, opt_state=o), out_shardings=shardings)

    def placed():
        """Values the model or optimizer already holds, put straight onto their shards (arguments
        of the build, never constants compiled into it)."""
        values = None if given is None else jax.device_put(given, (shardings.params, shardings.model_state))
        opt_state = None if given_opt_state is None else jax.device_put(given_opt_state, shardings.opt_state)
        return values, opt_state

    return StatePlan(
        mesh, strategy, abstract, specs, shardings,
        build=lambda: jitted(key, example_batch, *placed()),
        lower=lambda: jitted.lower(key, example_batch, *placed()),
    )


def trace_computation(adapter: ModelAdapter, abstract: TrainState, example_batch: Any, loss_fn: LossFn | None,
                      mesh: Mesh, strategy: Strategy, rng_streams: Sequence[str]) -> Computation:
    """The loss traced once (``jax.make_jaxpr``, nothing runs) on the params' shapes, as a
    train step calls it: what a strategy part reads its layout from."""
    boxed = jax.tree_util.tree_flatten_with_path(abstract.params, is_leaf=is_box)[0]
    plain_leaves, treedef = jax.tree.flatten(adapter.unbox(abstract.params))
    state_leaves = jax.tree.leaves(abstract.model_state)
    run = ModelRun(train=True, constraint_axes=tuple(mesh.axis_names))

    def loss(param_leaves, model_state, batch, key):
        return adapter.apply(jax.tree.unflatten(treedef, param_leaves), model_state, batch,
                             rngs=model_rngs(key, rng_streams), loss_fn=loss_fn, run=run)

    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    closed = jax.make_jaxpr(loss)(plain_leaves, abstract.model_state, example_batch, key)
    first_batch = len(plain_leaves) + len(state_leaves)
    return Computation(
        jaxpr=closed,
        param_paths=tuple(path_str(key_path) for key_path, _ in boxed),
        param_shapes=tuple(tuple(leaf.shape) for leaf in plain_leaves),
        param_boxes=tuple(box for _, box in boxed),
        batch_invars=tuple(range(first_batch, first_batch + len(jax.tree.leaves(example_batch)))),
        axis_sizes=strategy.axis_sizes(mesh),
    )

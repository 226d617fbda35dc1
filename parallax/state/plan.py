"""Planning the train state from shapes, and building it sharded without a whole copy anywhere."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax._compat import mesh_context
from parallax._errors import first_line
from parallax._tree import is_box, path_str
from parallax.jaxpr.computation import Computation
from parallax.models import LinenModel, LossFn, ModelAdapter, ModelRun, adapter_for, unwrap_pretrained
from parallax.parallel.experts.part import NoExpertsError
from parallax.parallel.pipeline.part import NoStackError
from parallax.parallel.pipeline.stacked_blocks import stacked, unstacked
from parallax.parallel.pipeline.stacking import stacking_groups, storage_specs
from parallax.sharding.found import NOTHING, Found
from parallax.sharding.mesh import is_explicit
from parallax.sharding.specs import dims_axes, is_spec
from parallax.sharding.strategy import Strategy
from parallax.state.given_params import build_directly
from parallax.state.pretrained import place_params, put_own
from parallax.step.jit import jit_loss
from parallax.step.mesh_mode import DETECT, check_sharding_mode, planned_in_mode
from parallax.step.offload import check_offload, with_memory_kinds
from parallax.step.run_changes import listed_experts_hint, pipelined_blocks, with_blocks_marked
from parallax.step.train_state import TrainState, as_key, key_struct, model_rngs


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """Where every leaf of a train state will live, before any of it exists.

    Attributes:
        mesh: the device mesh.
        strategy: the strategy the state is laid out by, as its user gave it (a pipeline that names no
            ``blocks=`` over a model with one class of listed blocks: named so).
        abstract: the state's shapes and dtypes (params still in their flax boxes).
        specs: a ``PartitionSpec`` per leaf of the (unboxed) state.
        shardings: the matching ``NamedSharding`` tree.
        build: ``build()`` computes the sharded state (each device only its shards).
        lower: ``lower()`` gives the lowered init computation (for memory analysis).
        sharding_note: one line: the sharding mode the model runs in (Auto or Explicit axes) and why.
        found: what the strategy's parts found in the traced loss, by axis (:mod:`parallax.sharding.found`:
            a derived tensor-parallel layout, the dims a ``scan`` steps over, the experts, a pipeline's
            blocks); the specs were placed with it (see :meth:`describe_layout`).
    """

    mesh: Mesh
    strategy: Strategy
    abstract: TrainState
    specs: Any
    shardings: Any
    build: Callable[[], TrainState]
    lower: Callable[[], Any]
    sharding_note: str = ""
    found: Found = NOTHING

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
        return self.strategy.describe_layout(self.found)

    def sharded_fraction(self) -> float:
        """The fraction of the state's bytes (params, optimizer state, other collections) split
        over the strategy's FSDP axes; 1.0 when the strategy has none.

        Example:
            >>> plan = px.plan_state(model, optax.adam(1e-3), batch, strategy=px.FSDP(), loss_fn=loss_fn)
            >>> plan.sharded_fraction()  # every param is below min_weight_size=2**18
            0.0
        """
        axes = set(self.strategy.fsdp_axes)
        if not axes:
            return 1.0
        plain = self.abstract.replace(params=adapter_for(self.abstract.model).unbox(self.abstract.params))
        total = split = 0
        for leaf, spec in zip(jax.tree.leaves(plain), jax.tree.leaves(self.specs, is_leaf=is_spec)):
            nbytes = leaf.size * leaf.dtype.itemsize
            total += nbytes
            split += nbytes if dims_axes(spec) & axes else 0
        return split / total if total else 1.0

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
    params: Any = None,
    sharding_mode: str = DETECT,
    offload: str | None = None,
) -> StatePlan:
    """Plans the sharded train state from shapes: ``eval_shape`` → specs → ``jit``.

    Takes the same arguments as :func:`init_state`, which is ``plan_state(...).build()``, and
    ``offload`` (:class:`parallax.StepOptions`' ``offload``: the parts kept in host memory).

    Example:
        >>> plan = px.plan_state(model, optax.adam(1e-3), batch, strategy=px.FSDP(min_weight_size=0),
        ...                      loss_fn=loss_fn)
        >>> tuple(plan.specs.params["Dense_1"]["kernel"])  # (64, 64): both dims divide by 8, the first is split
        ('fsdp',)
    """
    model, params = unwrap_pretrained(model, params)  # a Hugging Face model object: its module and params
    adapter = adapter_for(model)
    optimizer, given_opt_state = adapter.optimizer(optimizer)
    given = adapter.values()
    if not isinstance(strategy, Strategy):
        raise ValueError(f"strategy must be a parallax strategy (e.g. px.FSDP()), got {strategy!r}.")
    check_sharding_mode(sharding_mode)
    check_offload(offload)
    mesh = strategy.make_mesh() if mesh is None else mesh
    strategy.check_mesh(mesh)
    key = as_key(rng)
    if not isinstance(key, jax.core.Tracer):  # on the host: free of any mesh the caller has set
        key = np.asarray(jax.device_get(key))
    rng_streams = tuple(rng_streams)
    pretrained = None if params is None else (params if isinstance(params, (str, os.PathLike))
                                              else adapter.pretrained(params))

    def make(key, batch, boxed: bool, values=None, state=None, opt_state=None, groups=()):
        init_key, stream_key, state_key = jax.random.split(key, 3)
        rngs = {"params": init_key, **model_rngs(stream_key, rng_streams)}
        initial, model_state = (values, state) if state is not None else adapter.init(rngs, batch, loss_fn,
                                                                                      mesh.axis_names)
        params = initial if values is None else values
        plain_params = stacked(adapter.unbox(params), groups)  # a pipeline's listed blocks held stacked
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params if boxed else plain_params,
            opt_state=optimizer.init(plain_params) if opt_state is None else opt_state,
            rng=state_key,
            model_state=model_state,
            model=adapter.model,
            tx=optimizer,
        )

    def attempt(train_mesh: Mesh):
        abstract = _abstract(lambda k, b: make(k, b, boxed=True), key, example_batch)
        planned, found = strategy, NOTHING  # what planning finds stays beside the strategy, never in it
        if strategy.needs_computation:
            computation = trace_computation(adapter, abstract, example_batch, loss_fn, train_mesh, strategy,
                                            rng_streams)
            try:
                found = strategy.found_in(computation)
            except NoStackError as err:  # no stack: the model's one repeated block class, kept in a list, if it has one
                planned = pipelined_blocks(strategy, model, example_batch, loss_fn, err)  # as if blocks= were named
                computation = trace_computation(adapter, abstract, example_batch, loss_fn, train_mesh, planned,
                                                rng_streams)
                found = planned.found_in(computation)
            except NoExpertsError as err:
                raise NoExpertsError(f"{err}{listed_experts_hint(model, example_batch, loss_fn)}") from None
        specs = planned.state_specs(abstract, train_mesh, found)
        groups = stacking_groups(planned, found, adapter.unbox(abstract.params), optimizer,
                                 isinstance(adapter, LinenModel), planned.axis_sizes(train_mesh))
        model_specs = specs.params  # as the model writes its params: where given ones are placed
        if groups:
            abstract = _abstract(lambda k, b: make(k, b, boxed=False, groups=groups), key, example_batch)
            specs = storage_specs(abstract, specs, groups, planned, found)
        changed = None if loss_fn is None else probe_loss(adapter, abstract, specs, example_batch, loss_fn,
                                                          train_mesh, planned, rng_streams)
        return abstract, planned, found, specs, changed, groups, model_specs

    mesh, (abstract, strategy, found, specs, changed, groups, model_specs), note = planned_in_mode(
        attempt, mesh, sharding_mode)
    if changed:
        warnings.warn(changed, UserWarning, stacklevel=3)
        note = f"{note} {changed}"
    shardings = with_memory_kinds(jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec), offload)
    plain = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), jax.eval_shape(
        unstacked, adapter.unbox(abstract.params)))  # as the model writes them

    def known_state(v, s):
        """The model state, where given params leave nothing of the init needed (nor traced): none besides them."""
        return abstract.model_state if v is not None and s is None and not jax.tree.leaves(abstract.model_state) else s

    def build_values(k, b, v, s, o):
        if v is not None:  # pretrained params in the model's dtypes
            v = jax.tree.map(lambda value, leaf: value.astype(leaf.dtype), v, plain)
        return make(k, b, boxed=False, values=v, state=known_state(v, s), opt_state=o, groups=groups)

    jitted = jax.jit(build_values, out_shardings=shardings)

    def placed():
        """Values the model or optimizer already holds, or pretrained params, put straight onto their
        shards (arguments of the build, never constants compiled into it), each a copy of its own: a step
        donates the state, and the caller's arrays (an NNX module's, an ``nnx.Optimizer``'s) stay theirs
        (:func:`parallax.state.pretrained.put_own`)."""
        values, state = (None, None) if given is None else put_own(given, (shardings.params, shardings.model_state))
        if pretrained is not None:
            values = place_params(pretrained, plain, jax.tree.map(lambda s: NamedSharding(mesh, s), model_specs,
                                                                  is_leaf=is_spec))
        opt_state = None if given_opt_state is None else put_own(given_opt_state, shardings.opt_state)
        return values, state, opt_state

    def run(method):
        with mesh_context(mesh):
            return method(key, example_batch, *placed())

    def build():
        """The state: put together from the given values where it has nothing to compute, else the program's."""
        values, state, opt_state = placed()
        built = None if groups else build_directly(
            key, values, known_state(values, state), opt_state, plain=plain, abstract=abstract, shardings=shardings,
            optimizer=optimizer)
        if built is not None:
            return built
        with mesh_context(mesh):
            return jitted(key, example_batch, values, state, opt_state)

    return StatePlan(mesh, strategy, abstract, specs, shardings, build=build,
                     lower=lambda: run(jitted.lower), sharding_note=note, found=found)


UNSHARDED_FRACTION = 0.05  # below this share of the state split, an FSDP strategy warns


def unsharded_reason(plan: StatePlan) -> str | None:
    """Why an FSDP strategy splits less than 5% of the state's bytes (its ``min_weight_size``,
    or dims no axis size divides) and the option that changes it; ``None`` when it splits more.

    Example:
        >>> plan = px.plan_state(model, optax.sgd(0.1), batch, strategy=px.FSDP(), loss_fn=loss_fn)
        >>> from parallax.state.plan import unsharded_reason
        >>> print(unsharded_reason(plan))  # doctest: +ELLIPSIS
        FSDP(fsdp=8) splits only 0.0% of the train state over 'fsdp': every param has at most min_weight_size=262,144 ...
    """  # noqa: E501 (a doctest's output)
    fraction = plan.sharded_fraction()
    fsdp = next((part for part in plan.strategy.parts if part.gathers_params), None)
    if fraction >= UNSHARDED_FRACTION or fsdp is None or plan.mesh.shape[fsdp.axis] == 1:
        return None
    largest = max((leaf.size for leaf in jax.tree.leaves(adapter_for(plan.abstract.model).unbox(plan.abstract.params))),
                  default=0)
    minimum = getattr(fsdp, "min_weight_size", 0)
    if largest <= minimum:
        why = (f"every param has at most min_weight_size={minimum:,} elements (the largest has {largest:,}); lower "
               f"it, e.g. {type(fsdp).__name__}(min_weight_size={max(largest // 4, 1):,}), to split the large ones")
    else:
        why = (f"the params above min_weight_size={minimum:,} elements have no dim that {fsdp.axis}="
               f"{plan.mesh.shape[fsdp.axis]} divides (px.summarize(...) names each)")
    return (f"{plan.strategy.resolved(plan.mesh).describe()} splits only {fraction:.1%} of the train state over "
            f"'{fsdp.axis}': {why}. Until then it trains like data parallelism, each device holding the whole state.")


def warn_if_unsharded(plan: StatePlan) -> None:
    """Warns once with :func:`unsharded_reason` when an FSDP strategy splits almost nothing."""
    reason = unsharded_reason(plan)
    if reason is not None:
        warnings.warn(reason, UserWarning, stacklevel=3)


def warn_if_crossing(strategy: Strategy, mesh: Mesh | None) -> None:
    """Warns when a user's ``mesh`` (given, or set with ``jax.set_mesh``) lays a tensor or FSDP axis
    across hosts where the strategy's own layout would not
    (:meth:`parallax.sharding.strategy.Strategy.host_crossing`); the mesh is used as it is."""
    crossing = None if mesh is None or not isinstance(strategy, Strategy) else strategy.host_crossing(mesh)
    if crossing is not None:
        warnings.warn(crossing, UserWarning, stacklevel=3)


def _abstract(make: Callable, key: Any, example_batch: Any) -> TrainState:
    try:
        return jax.eval_shape(make, key, example_batch)
    except jax.errors.ConcretizationTypeError as err:
        raise ValueError(
            "The loss function (or the model) turns a traced array into a Python value: float(x), int(x), "
            "x.item(), bool(x) or `if x:` on an array. parallax compiles the loss, so values stay arrays: "
            "return the loss array (not float(loss)), and use jnp.where / lax.cond instead of Python `if`. "
            f"JAX's message: {first_line(err)}"
        ) from err


def probe_loss(adapter: ModelAdapter, abstract: TrainState, specs: Any, example_batch: Any, loss_fn: LossFn,
               mesh: Mesh, strategy: Strategy, rng_streams: Sequence[str]) -> str | None:
    """Traces the loss on the planned shardings, and on an Explicit mesh its gradient too (nothing
    compiles or runs): raises what JAX raises where the model's own sharding does not fit this
    mesh's mode. Returns what the train step will change to run the model (on an Explicit mesh,
    params gathered whole where used: :func:`parallax.step.jit.jit_loss`), or ``None``.

    On Auto axes shardings are not part of the arrays' types, so what JAX refuses there (``reshard``,
    ``out_sharding=``, an Explicit mesh's ``NamedSharding``) is in the loss as written, and the
    forward trace finds it; on Explicit axes the gradient's contractions are typed as well."""
    placed = lambda leaf, spec: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))
    params = jax.tree.map(placed, adapter.unbox(abstract.params), specs.params)
    model_state = jax.tree.map(placed, abstract.model_state, specs.model_state)
    shards = strategy.data_shards(mesh)
    batch_spec = strategy.batch_spec()

    def batch_leaf(x):
        divisible = getattr(x, "ndim", 0) and x.shape[0] % shards == 0
        return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=NamedSharding(mesh, batch_spec if divisible else PartitionSpec()))

    batch = jax.tree.map(batch_leaf, example_batch)
    key = key_struct()
    run = ModelRun(train=True, constraint_axes=tuple(mesh.axis_names))
    said: list[str] = []
    loss = jit_loss(adapter, loss_fn, rng_streams, run, mesh, strategy, specs.params,  # as the train step runs it
                    on_whole=said.append)
    traced = jax.value_and_grad(loss, has_aux=True) if is_explicit(mesh) else loss
    jax.eval_shape(traced, params, model_state, batch, key)
    return said[0] if said else None


def trace_computation(adapter: ModelAdapter, abstract: TrainState, example_batch: Any, loss_fn: LossFn | None,
                      mesh: Mesh, strategy: Strategy, rng_streams: Sequence[str]) -> Computation:
    """The loss traced once (``jax.make_jaxpr``, nothing runs) on the params' shapes, as a
    train step calls it: what a strategy part reads its layout from."""
    boxed = jax.tree_util.tree_flatten_with_path(abstract.params, is_leaf=is_box)[0]
    plain_leaves, treedef = jax.tree.flatten(adapter.unbox(abstract.params))
    state_leaves = jax.tree.leaves(abstract.model_state)
    run = with_blocks_marked(ModelRun(train=True, constraint_axes=tuple(mesh.axis_names)), strategy)

    def loss(param_leaves, model_state, batch, key):
        return adapter.apply(jax.tree.unflatten(treedef, param_leaves), model_state, batch,
                             rngs=model_rngs(key, rng_streams), loss_fn=loss_fn, run=run)

    key = key_struct()
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

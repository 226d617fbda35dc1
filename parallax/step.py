"""The train and eval steps: one jitted, donated function built from a user's loss.

Two ways to compile, driven by the same spec tree:

* ``"shard_map"``: the gradient is computed
  inside ``jax.shard_map``, manual over the data/FSDP axes (a tensor axis stays
  automatic). FSDP shards are all-gathered where a layer reads them; their gradient is a
  reduce-scatter. Replicated params get a ``pmean`` over every data axis they are not
  split over. ``check_vma=False``: with it on, the gradient of a replicated input comes
  back already summed and a ``pmean`` would leave it N times too large.
* ``"jit"``: the same loss under ``jax.jit`` with shardings; the compiler (GSPMD)
  inserts every collective. Always used for pure tensor parallelism.

``compile="auto"`` is exact for any loss: ``jit`` unless the loss is marked
:func:`parallax.per_example_loss`, then whichever path measured faster for the strategy
(see ``_Step.mode``).

The optimizer update always runs outside ``shard_map`` on the global (sharded) arrays,
so transformations that need global norms (``clip_by_global_norm``, LAMB, ...) see the
whole gradient, not one shard.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import errors as flax_errors
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax import metrics as metric_lib
from parallax._compat import shard_map
from parallax.batchnorm import batch_stats_over
from parallax.constraints import constraints_within
from parallax.gather import box_for_gather, gather_all, gather_dim
from parallax.per_example import is_per_example_loss
from parallax.precision import Float32Outputs, Precision, cast_floating
from parallax.precision import resolve as resolve_precision
from parallax.remat import remat_modules
from parallax.specs import dims_axes, is_spec, without_axes
from parallax.state import LossFn, TrainState, call_model, model_rngs
from parallax.strategy import Strategy

log = logging.getLogger("parallax")

COMPILE_MODES = ("auto", "shard_map", "jit")
BATCH_STATS_MODES = ("global", "local")


def _leading_dims(batch: Any) -> list[tuple[str, int]]:
    out = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0:
            raise ValueError(
                f"Batch leaf {jax.tree_util.keystr(key_path)!r} is {type(leaf).__name__} with "
                "no batch dim; every batch leaf must be an array whose first dim is the batch."
            )
        out.append((jax.tree_util.keystr(key_path), int(shape[0])))
    if not out:
        raise ValueError("The batch has no arrays in it.")
    return out


def check_batch(batch: Any, strategy: Strategy, mesh: Mesh, grad_accum: int = 1) -> int:
    """Checks a batch before anything compiles; returns its (global) batch size.

    Raises:
        ValueError: leaves with different leading dims, or a batch size that the data
            axes (times ``grad_accum``) do not divide.
    """
    dims = _leading_dims(batch)
    sizes = {size for _, size in dims}
    if len(sizes) > 1:
        raise ValueError(f"Batch leaves have different leading (batch) dims: {dict(dims)}.")
    batch_size = sizes.pop()
    strategy.check_batch_size(batch_size, mesh, multiple=grad_accum)
    return batch_size


def _check_batch_devices(batch: Any, mesh: Mesh) -> None:
    """Raises ``ValueError`` for a batch array that lives on devices outside the state's mesh."""
    mesh_devices = set(mesh.devices.flat)
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(leaf, jax.Array) and sharding is not None and not set(sharding.device_set) <= mesh_devices:
            where = (f"a mesh with axes {dict(sharding.mesh.shape)}" if isinstance(sharding, NamedSharding)
                     else f"{len(sharding.device_set)} device(s)")
            raise ValueError(
                f"batch{jax.tree_util.keystr(key_path)} is placed on {where}, other devices than the state's mesh "
                f"{dict(mesh.shape)}. Pass host (numpy) arrays, or place the batch on the state's mesh: "
                "px.data.to_global(batch, NamedSharding(mesh, strategy.batch_spec()))."
            )


def state_specs_of(state: TrainState) -> tuple[Mesh, Any]:
    """The mesh and ``PartitionSpec`` tree a (concrete) state is laid out with."""
    meshes = set()

    def spec(x):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            raise ValueError(
                f"A state leaf has sharding {sharding!r}; build the state with "
                "px.init_state(...) so that every leaf is placed on the strategy's mesh."
            )
        meshes.add(sharding.mesh)
        return sharding.spec

    specs = jax.tree.map(spec, state)
    if len(meshes) != 1:
        raise ValueError(f"The state's arrays live on {len(meshes)} different meshes; expected one.")
    return meshes.pop(), specs


def _apply_loss(state: TrainState, params: Any, model_state: dict, batch: Any, rngs: dict, loss_fn: LossFn,
                bn_axes: tuple[str, ...] | None, precision: Precision, remat: Sequence[type | str], train: bool,
                constraint_axes: Sequence[str]):
    """Runs ``loss_fn`` on the bound model; returns ``(loss, (sums, new_model_state))``.

    In evaluation (``train=False``) no collection is mutable: BatchNorm must use its
    running averages, as a model called with ``train=False`` does. The model's own logical
    sharding constraints may name only ``constraint_axes`` (the mesh's automatic axes).
    """
    method = call_model(state.model, batch, loss_fn)
    if precision.casts:
        params = cast_floating(params, precision.compute_dtype)
        batch = cast_floating(batch, precision.compute_dtype)
        inner = method
        method = lambda module, b: inner(Float32Outputs(module), b)  # noqa: E731
    with batch_stats_over(bn_axes), remat_modules(remat), constraints_within(constraint_axes):
        try:
            output, updates = state.model.apply(
                {"params": params, **model_state}, batch, method=method, rngs=rngs,
                mutable=list(model_state) if train else [],
            )
        except flax_errors.ModifyScopeVariableError as err:
            raise ValueError(
                "The evaluation loss function tries to update the model's state (e.g. BatchNorm "
                "statistics in training mode); pass eval_loss_fn that calls the model with "
                f"train=False. ({err})"
            ) from None
    loss, metrics = metric_lib.split_loss_output(output)
    num_examples = _leading_dims(batch)[0][1]
    sums = metric_lib.to_sums(loss, metrics, num_examples)
    return loss, (sums, {**model_state, **updates})


def _microbatches(batch: Any, grad_accum: int, shards: int) -> Any:
    """``(k, B/k, ...)`` microbatches; each keeps rows from every data shard."""

    def split(x):
        per_shard = x.shape[0] // shards
        x = x.reshape(shards, grad_accum, per_shard // grad_accum, *x.shape[1:])
        x = jnp.swapaxes(x, 0, 1)
        return x.reshape(grad_accum, x.shape[1] * x.shape[2], *x.shape[3:])

    return jax.tree.map(split, batch)


def _scan_microbatches(grad_fn: Callable, params: Any, model_state: dict, microbatches: Any, key: jax.Array,
                       grad_accum: int):
    """Sums gradients and metrics over microbatches with ``lax.scan``."""

    def body(carry, inputs):
        grads_acc, sums_acc, model_state = carry
        index, batch = inputs
        (_, (sums, model_state)), grads = grad_fn(params, model_state, batch, jax.random.fold_in(key, index))
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return (grads_acc, metric_lib.add_sums(sums_acc, sums), model_state), None

    first = jax.tree.map(lambda x: x[0], microbatches)
    sums_shape = jax.eval_shape(lambda: grad_fn(params, model_state, first, key)[0][1][0])
    zeros_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
    zeros_grads = jax.tree.map(jnp.zeros_like, params)
    (grads, sums, model_state), _ = jax.lax.scan(
        body, (zeros_grads, zeros_sums, model_state), (jnp.arange(grad_accum), microbatches)
    )
    return jax.tree.map(lambda g: g / grad_accum, grads), sums, model_state


class _Step:
    """A step built once per state layout; ``__call__`` checks the batch, then runs it."""

    def __init__(self, loss_fn: LossFn, strategy: Strategy, *, train: bool, compile: str, grad_accum: int,
                 batch_stats: str, rng_streams: Sequence[str], donate: bool,
                 precision: str | Precision | None = None, remat: Sequence[type | str] = (),
                 skip_nonfinite: bool = False, replicated_batch: bool = False):
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable, got {loss_fn!r}.")
        if not isinstance(strategy, Strategy):
            raise ValueError(f"strategy must be a parallax strategy (e.g. px.FSDP()), got {strategy!r}.")
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile={compile!r}; use one of {COMPILE_MODES}.")
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
            raise ValueError(f"grad_accum={grad_accum!r}; use an integer >= 1.")
        if batch_stats not in BATCH_STATS_MODES:
            raise ValueError(f"batch_stats={batch_stats!r}; use one of {BATCH_STATS_MODES}.")
        if batch_stats == "local" and compile == "jit":
            raise ValueError("batch_stats='local' needs compile='shard_map' (or 'auto'): under jit the "
                             "compiler computes BatchNorm statistics over the global batch.")
        self.loss_fn = loss_fn
        self.strategy = strategy
        self.train = train
        self.grad_accum = grad_accum
        self.batch_stats = batch_stats
        self.rng_streams = tuple(rng_streams)
        self.donate = donate
        self.compile = compile
        self.precision = resolve_precision(precision)
        self.remat = tuple(remat)
        self.skip_nonfinite = skip_nonfinite
        self.replicated_batch = replicated_batch
        for target in self.remat:
            if not isinstance(target, (str, type)):
                raise ValueError(f"remat takes module classes or class names, got {target!r}.")
        self._cache: dict = {}  # one jitted function per state layout
        self._fast: dict = {}  # (state layout, batch shapes) already checked -> jitted function

    def mode(self) -> str:
        """``"shard_map"`` or ``"jit"``: how this step compiles.

        ``"auto"`` is exact for any loss: it compiles with ``jit`` (the loss sees the
        global batch) unless the loss is marked :func:`parallax.per_example_loss`. For a
        marked loss it picks what measured fastest at equal per-device state in
        ``benchmarks/`` (8 simulated devices): explicit ``shard_map`` for data parallelism
        (the compiler's plan transposes gradients around the all-reduce) and for hybrids
        with a tensor axis; ``jit`` for FSDP without a tensor axis (it keeps weights in
        place and moves activations where that is cheaper) and for pure tensor parallelism.
        """
        if self.replicated_batch or not self.strategy.data_axes:
            return "jit"
        if self.batch_stats == "local":
            return "shard_map"  # per-shard statistics only exist where shards are explicit
        if self.compile == "auto":
            if not is_per_example_loss(self.loss_fn):
                return "jit"  # per-shard losses averaged would change a batch-level loss
            has_tensor_axis = len(self.strategy.data_axes) < len(self.strategy.parts)
            return "jit" if self.strategy.fsdp_axes and not has_tensor_axis else "shard_map"
        return self.compile

    def __call__(self, state: TrainState, batch: Any):
        return self._jitted(state, batch)(state, batch)

    def lower(self, state: TrainState, batch: Any):
        """``jax.jit(...).lower`` of the step, for inspecting HLO and memory."""
        return self._jitted(state, batch).lower(state, batch)

    def _jitted(self, state: TrainState, batch: Any):
        # Fast path for the loop: the same state layout and batch shapes as a previous call.
        leaves, treedef = jax.tree.flatten(state)
        batch_leaves, batch_treedef = jax.tree.flatten(batch)
        fast_key = (treedef, tuple(getattr(x, "sharding", None) for x in leaves),
                    batch_treedef, tuple(getattr(x, "shape", None) for x in batch_leaves))
        found = self._fast.get(fast_key)
        if found is not None:
            return found
        mesh, specs = state_specs_of(state)
        self.strategy.check_mesh(mesh)
        _check_batch_devices(batch, mesh)
        if self.replicated_batch:
            _leading_dims(batch)
        else:
            check_batch(batch, self.strategy, mesh, self.grad_accum if self.train else 1)
        key = (treedef, tuple(jax.tree.leaves(specs, is_leaf=is_spec)), mesh)
        if key not in self._cache:
            self._cache[key] = self._build(mesh, specs)
        self._fast[fast_key] = self._cache[key]
        return self._cache[key]

    # --- building ------------------------------------------------------------------------
    def _build(self, mesh: Mesh, specs: TrainState):
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
        replicated = NamedSharding(mesh, PartitionSpec())
        batch_sharding = replicated if self.replicated_batch else NamedSharding(mesh, self.strategy.batch_spec())
        gradients = self._shard_map_gradients(mesh, specs) if self.mode() == "shard_map" else self._jit_gradients(mesh)

        def train_step(state: TrainState, batch):
            key = jax.random.fold_in(state.rng, state.step)
            grads, sums, model_state = gradients(state, batch, key)
            updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state)
            metrics = metric_lib.means(sums)
            if self.skip_nonfinite:
                finite = jnp.isfinite(metrics["loss"])
                for grad in jax.tree.leaves(grads):
                    finite &= jnp.isfinite(grad).all()
                kept = state.replace(step=state.step + 1)
                new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, kept)
                metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
            return new_state, metrics

        def eval_step(state: TrainState, batch):
            key = jax.random.fold_in(state.rng, state.step)
            return gradients(state, batch, key)

        if self.train:
            return jax.jit(
                train_step,
                in_shardings=(shardings, batch_sharding),
                out_shardings=(shardings, replicated),
                donate_argnums=(0,) if self.donate else (),
            )
        return jax.jit(eval_step, in_shardings=(shardings, batch_sharding), out_shardings=replicated)

    def _jit_gradients(self, mesh: Mesh):
        """Gradients (or eval sums) on global arrays; GSPMD places the collectives."""
        shards = self.strategy.data_shards(mesh)
        batch_sharding = NamedSharding(mesh, PartitionSpec(None, *self.strategy.batch_spec()))

        def loss(params, model_state, batch, key, state):
            return _apply_loss(state, params, model_state, batch, model_rngs(key, self.rng_streams), self.loss_fn, None,
                               self.precision, self.remat, self.train, mesh.axis_names)

        def gradients(state: TrainState, batch, key):
            if not self.train:
                return loss(state.params, state.model_state, batch, key, state)[1][0]
            grad_fn = jax.value_and_grad(lambda p, m, b, k: loss(p, m, b, k, state), has_aux=True)
            if self.grad_accum == 1:
                (_, (sums, model_state)), grads = grad_fn(state.params, state.model_state, batch, key)
                return grads, sums, model_state
            microbatches = _microbatches(batch, self.grad_accum, shards)
            microbatches = jax.lax.with_sharding_constraint(microbatches, batch_sharding)
            return _scan_microbatches(grad_fn, state.params, state.model_state, microbatches, key, self.grad_accum)

        return gradients

    def _shard_map_gradients(self, mesh: Mesh, specs: TrainState):
        """Gradients inside ``shard_map``, manual over the data axes."""
        data_axes = self.strategy.data_axes
        manual = set(data_axes)
        fsdp_axes = set(self.strategy.fsdp_axes) & manual
        param_specs = jax.tree.map(lambda s: without_axes(s, manual), specs.params, is_leaf=is_spec)
        state_in = jax.tree.map(lambda s: without_axes(s, manual), specs.model_state, is_leaf=is_spec)
        bn_axes = data_axes if self.batch_stats == "global" else None
        auto_axes = tuple(a for a in mesh.axis_names if a not in manual)
        grad_accum = self.grad_accum
        train = self.train

        def fold_over_data(key):
            index = 0
            for axis in data_axes:
                index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
            return jax.random.fold_in(key, index)

        def sync(grads):
            def mean_over_replicas(grad, spec):
                axes = tuple(a for a in data_axes if a not in dims_axes(list(spec)))
                return jax.lax.pmean(grad, axes) if axes else grad

            return jax.tree.map(mean_over_replicas, grads, param_specs)

        def reduce_sums(sums):
            return jax.tree.map(lambda x: jax.lax.psum(x, data_axes), sums)

        def local(state: TrainState, params, model_state, batch, key):
            key = fold_over_data(key)

            def apply(variables, m, b, k):
                return _apply_loss(state, variables, m, b, model_rngs(k, self.rng_streams), self.loss_fn, bn_axes,
                                   self.precision, self.remat, train, auto_axes)

            def loss(p, m, b, k, boxed):
                if not boxed or not fsdp_axes:
                    return apply(p, m, b, k)
                try:  # each FSDP param gathered where its layer reads it (self.param) ...
                    return apply(box_for_gather(p, param_specs, fsdp_axes), m, b, k)
                except (AttributeError, TypeError) as err:
                    if "GatherOnUse" not in str(err):
                        raise
                    # ... unless the model reads params another way (self.variables, a tied
                    # embedding transposed): then all of them are gathered before the model runs.
                    log.info("The model reads params other than through self.param (%s); FSDP gathers "
                             "its params before the model runs instead of where each layer reads them.", err)
                    return apply(gather_all(p, param_specs, fsdp_axes), m, b, k)

            if not train:
                return reduce_sums(loss(params, model_state, batch, key, True)[1][0])
            if grad_accum == 1:
                grad_fn = jax.value_and_grad(lambda p, m, b, k: loss(p, m, b, k, True), has_aux=True)
                (_, (sums, model_state)), grads = grad_fn(params, model_state, batch, key)
            else:
                # Gather each FSDP shard once per step, accumulate full gradients over the
                # microbatches, then reduce-scatter once (not once per microbatch).
                def gather(p, spec):
                    found = gather_dim(spec, fsdp_axes)
                    return p if found is None else jax.lax.all_gather(p, found[1], axis=found[0], tiled=True)

                def scatter(g, spec):
                    found = gather_dim(spec, fsdp_axes)
                    if found is None:
                        return g
                    dim, axis = found
                    return jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True) / mesh.shape[axis]

                full = jax.tree.map(gather, params, param_specs)
                grad_fn = jax.value_and_grad(lambda p, m, b, k: loss(p, m, b, k, False), has_aux=True)
                microbatches = _microbatches(batch, grad_accum, 1)
                grads, sums, model_state = _scan_microbatches(grad_fn, full, model_state, microbatches, key, grad_accum)
                grads = jax.tree.map(scatter, grads, param_specs)
            if bn_axes is None:
                model_state = jax.tree.map(
                    lambda x: jax.lax.pmean(x, data_axes) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                    model_state,
                )
            return sync(grads), reduce_sums(sums), model_state

        def gradients(state: TrainState, batch, key):
            batch_spec = jax.tree.map(lambda _: self.strategy.batch_spec(), batch)
            out_specs = PartitionSpec() if not train else (param_specs, PartitionSpec(), state_in)
            mapped = shard_map(
                lambda p, m, b, k: local(state, p, m, b, k),
                mesh=mesh,
                in_specs=(param_specs, state_in, batch_spec, PartitionSpec()),
                out_specs=out_specs,
                manual_axes=manual,
            )
            return mapped(state.params, state.model_state, batch, key)

        return gradients


def make_train_step(
    loss_fn: LossFn,
    strategy: Strategy,
    *,
    compile: str = "auto",
    grad_accum: int = 1,
    batch_stats: str = "global",
    rng_streams: Sequence[str] = ("dropout",),
    donate: bool = True,
    precision: str | Precision | None = None,
    remat: Sequence[type | str] = (),
    skip_nonfinite: bool = False,
) -> _Step:
    """A jitted ``step(state, batch) -> (state, metrics)`` for any strategy.

    Args:
        loss_fn: ``loss_fn(model, batch)`` returning a scalar loss or ``(loss, metrics)``;
            ``model`` is the bound flax module (call it, or any of its methods). A metric
            may be a scalar mean, per-example values, or a ``(sum, count)`` pair.
        strategy: the parallelism strategy the state was built with.
        compile: ``"auto"`` (default: exact for any loss; the loss sees the global batch
            unless it is marked :func:`parallax.per_example_loss`, see ``mode()``),
            ``"jit"`` (compiler-placed collectives, the loss on the global batch) or
            ``"shard_map"`` (explicit collectives; the loss runs on each data shard and
            the shards' losses are averaged: per-shard semantics, exact only for a mean
            of per-example terms).
        grad_accum: microbatches per step; the update equals one step on the whole batch.
        batch_stats: ``"global"`` (BatchNorm statistics over the whole batch, as on one
            device) or ``"local"`` (each data shard's own; running stats then averaged;
            compiles with ``shard_map``).
        rng_streams: rng names the model draws from (a different stream on each data
            shard, the same on every tensor shard; step ``t`` uses ``fold_in(rng, t)``).
        donate: donate the state's buffers to the step.
        precision: ``None``/``"fp32"``, or ``"bf16"``: float32 params and optimizer
            state, bfloat16 forward and backward, float32 loss and gradient reductions.
        remat: module classes (or class names) whose activations are recomputed in the
            backward pass instead of stored, e.g. ``("Block",)``.
        skip_nonfinite: if the loss or any gradient is NaN/Inf, keep the old params,
            optimizer and model state (the step still counts); metrics gain ``skipped``.

    Returns:
        The step. Metrics are exact means over the global batch (``loss`` included).
        ``step.lower(state, batch)`` gives the lowered computation.

    Example:
        >>> step = px.make_train_step(loss_fn, px.FSDP())
        >>> state, metrics = step(state, batch)
    """
    return _Step(loss_fn, strategy, train=True, compile=compile, grad_accum=grad_accum, batch_stats=batch_stats,
                 rng_streams=rng_streams, donate=donate, precision=precision, remat=remat,
                 skip_nonfinite=skip_nonfinite)


def make_eval_step(
    loss_fn: LossFn,
    strategy: Strategy,
    *,
    compile: str = "auto",
    batch_stats: str = "global",
    rng_streams: Sequence[str] = ("dropout",),
    precision: str | Precision | None = None,
    replicated_batch: bool = False,
) -> _Step:
    """A jitted ``eval(state, batch) -> {name: (sum, count)}`` without an update.

    Sums and counts (not means) come back so that means over many batches stay exact;
    :func:`parallax.metrics.means` turns them into means. With ``replicated_batch=True``
    a batch of any size (e.g. the last, partial one of an eval set) is given whole to
    every device and the compiler splits the work.

    Example:
        >>> evaluate = px.make_eval_step(eval_loss_fn, px.FSDP())
        >>> px.metrics.means(evaluate(state, batch))["loss"]
    """
    return _Step(loss_fn, strategy, train=False, compile=compile, grad_accum=1, batch_stats=batch_stats,
                 rng_streams=rng_streams, donate=False, precision=precision, replicated_batch=replicated_batch)

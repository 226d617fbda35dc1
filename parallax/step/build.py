"""The train and eval steps: one jitted, donated function built from a user's loss.

Two ways to compile, driven by the same spec tree and the same loss closure
(:mod:`parallax.step.loss`) and accumulation (:mod:`parallax.step.accumulate`):

* ``"shard_map"`` (:mod:`parallax.step.shard_map`): the gradient is computed inside
  ``jax.shard_map``, manual over the data/FSDP axes, with explicit collectives.
* ``"jit"`` (:mod:`parallax.step.jit`): the same loss under ``jax.jit`` with shardings; the compiler
  inserts every collective. Always used for pure tensor parallelism.

``compile="auto"`` is exact for any loss: ``jit`` unless the loss is a mean of per-example terms (marked
:func:`parallax.per_example_loss`, or read so from its trace by :mod:`parallax.jaxpr.per_example`),
then whichever path the cost model prices faster for this model, strategy and batch (see ``Step.mode``).

The optimizer update always runs outside ``shard_map`` on the global (sharded) arrays, so transformations that need
global norms (``clip_by_global_norm``, LAMB, ...) see the whole gradient.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax._compat import mesh_context
from parallax.jaxpr.per_example import Proof
from parallax.models import LossFn
from parallax.parallel.candidates import AUTO, as_strategy, from_mesh
from parallax.parallel.pipeline.part import NoStackError
from parallax.pricing.choice import Choice
from parallax.sharding.mesh import is_explicit
from parallax.sharding.specs import is_spec
from parallax.sharding.strategy import Strategy
from parallax.sharding.topology import Topology
from parallax.step.batch import (
    check_batch,
    check_batch_devices,
    host_leaves_placed,
    layout_key,
    leading_dims,
    state_specs_of,
)
from parallax.step.compiled import CompiledPaths
from parallax.step.jit import jit_gradients
from parallax.step.mesh_mode import check_jit_only
from parallax.step.offload import moved, placement, with_memory_kinds
from parallax.step.options import StepOptions
from parallax.step.paths import allowed_paths, check_microbatches, preferred, read_proof
from parallax.step.per_example import is_per_example_loss
from parallax.step.resharding import Resharding, avoiding, compile_reporting, describe_all
from parallax.step.run_changes import pipelined_blocks
from parallax.step.shard_map import shard_map_gradients
from parallax.step.timed_paths import timed_paths
from parallax.step.train_state import TrainState
from parallax.step.update import step_bodies

log = logging.getLogger("parallax")


class Step(CompiledPaths):
    """A step built once per state layout; ``__call__`` checks the batch, then runs it.

    Attributes:
        loss_fn: the user's loss.
        strategy: the strategy the state was built with (for ``"auto"``: ``None`` until the
            first call reads it from the state's mesh).
        options: the :class:`StepOptions`.
        train: a train step (update) or an eval step (metric sums).
        replicated_batch: an eval step that takes a batch of any size, whole on every device.
        choice: the cost model's pick of the compile path (``None`` while there is none).
        proof: for a loss as written, whether its trace showed a mean of per-example terms (``None`` until read).
        auto_strategy: built with ``strategy="auto"``.
        reshardings: per compiled path, the tensors the compiler replicated to reshard them
            (:mod:`parallax.step.resharding`; logged as a warning when the path taken has any).
        prefer: of the paths ``compile="auto"`` allows, the ones to compile (the search prices an
            FSDP split on the path it is fast on); where it allows none of them, those it allows.
        topology: the hosts (:class:`parallax.Topology`) the paths' collectives are priced on; ``None``: the processes.
    """

    def __init__(self, loss_fn: LossFn, strategy: Strategy | str, options: StepOptions, *, train: bool,
                 replicated_batch: bool = False, prefer: tuple[str, ...] = (), topology: Topology | None = None):
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable, got {loss_fn!r}.")
        strategy = as_strategy(strategy)
        self.loss_fn = loss_fn
        # "auto": the state was built by init_state(strategy="auto"); its mesh says which strategy.
        self.strategy: Strategy | None = None if strategy == AUTO else strategy
        self.options = options
        self.train = train
        self.replicated_batch = replicated_batch
        self._cache: dict = {}  # one jitted function per state layout
        self._fast: dict = {}  # (state layout, batch shapes) already checked -> jitted function
        self.choice: Choice | None = None  # the cost model's pick of the compile path, once made
        self.proof: Proof | None = None  # read from the loss's trace at the first call
        self._microbatches_proven = False  # grad_accum's microbatches compute the batch's (read at the first call)
        self.searched = False  # its strategy is the pick of a search (FSDP's split='auto', strategy='auto')
        self.auto_strategy = strategy == AUTO
        self.explicit = False  # the state's mesh has Explicit axes (read at the first call)
        self._placement: dict = {}  # memory kinds of a state's leaves -> already where offload says
        self.reshardings: dict[str, list[Resharding]] = {}
        self.prefer = prefer
        self.topology = topology
        self.speeds = None  # the compile paths priced at these (a named hardware's), else measured on the devices
        self._compiled: dict[tuple, tuple[Any, Any]] = {}  # (layout, path) -> jitted step, program (reuse())

    def modes(self) -> tuple[str, ...]:
        """The compile paths this step may take: one, or ``("jit", "shard_map")`` when the cost
        model picks between them at the first call (see :meth:`mode`)."""
        return self._paths()[0]

    def _paths(self) -> tuple[tuple[str, ...], str]:
        """The compile paths this step may take, and why: one decision for :meth:`modes` and :meth:`describe`."""
        return preferred(self._allowed(), self.prefer)

    def _allowed(self) -> tuple[tuple[str, ...], str]:
        return allowed_paths(self.strategy, self.options, self.loss_fn, self.proof, train=self.train,
                             replicated_batch=self.replicated_batch, explicit=self.explicit)

    def mode(self) -> str:
        """``"shard_map"`` or ``"jit"``: how this step compiles (``"auto"`` until the first call decides it).

        ``compile="auto"`` is exact for any loss: ``jit`` (the loss sees the global batch) unless the loss is a mean
        of per-example terms, marked :func:`parallax.per_example_loss` or read so from its trace at the first call
        (:attr:`proof`). Then both paths are exact: the train step compiles both at its first call and keeps the
        faster by the cost model among those whose peak fits ``memory_budget``, or where it is a close call by a few
        steps on a copy of the state (:mod:`parallax.step.timed_paths`). :attr:`choice` holds the estimates and times.
        """
        if self.choice is not None:
            return self.choice.picked
        if self.strategy is None:
            return "auto"
        modes = self.modes()
        return modes[0] if len(modes) == 1 else "auto"

    def describe(self) -> str:
        """How this step compiles and why, in one line.

        Example:
            >>> px.make_train_step(loss_fn, px.FSDP()).describe()
            "compile path auto: jit, or the cost model's pick if the loss's trace shows a mean of per-example terms (read at the first call)"
            >>> px.make_eval_step(loss_fn, px.FSDP()).describe()
            'compile path jit: the loss sees the global batch'
        """  # noqa: E501 (a doctest's output)
        if self.choice is not None:
            basis = "marked px.per_example_loss" if is_per_example_loss(self.loss_fn) else self.proof.reason
            return f"{self.choice.describe()}; both paths exact: {basis}{self._resharded()}"
        if self.strategy is None:
            return "strategy auto: read from the state's mesh at the first call, then the compile path"
        modes, why = self._paths()
        return f"compile path {modes[0] if len(modes) == 1 else 'auto'}: {why}{self._resharded()}"

    def _resharded(self) -> str:
        found = self.reshardings.get(self.mode(), []) if self.strategy is not None else []
        return (f"; the compiler replicated {len(found)} tensor(s) to reshard them (involuntary full "
                f"rematerialization): {describe_all(found)}. "
                f"{avoiding(self.strategy, self.mode(), self._allowed()[0], self.searched)}") if found else ""

    def __call__(self, state: TrainState, batch: Any):
        state, _ = self._placed(state)
        function, mesh = self._jitted(state, batch)
        with mesh_context(mesh):  # the state's mesh, whatever mesh the caller has set
            return function(state, self._taken(batch, mesh))

    def lower(self, state: TrainState, batch: Any):
        """``jax.jit(...).lower`` of the step, for inspecting HLO and memory."""
        state, _ = self._placed(state)
        function, mesh = self._jitted(state, batch)
        with mesh_context(mesh):
            return function.lower(state, self._taken(batch, mesh))

    def trace(self, state: TrainState, batch: Any):
        """``jax.jit(...).trace`` of the step: its jaxpr (``.jaxpr``), and ``.lower()``."""
        state, _ = self._placed(state)
        function, mesh = self._jitted(state, batch)
        with mesh_context(mesh):
            return function.trace(state, self._taken(batch, mesh))

    def program(self, state: TrainState, batch: Any) -> Any:
        """The compiled program of the step for ``state``'s layout and ``batch``: compiled (once) to
        read the compiler's report or to price the paths, so a plan need not compile it again."""
        state, parts = self._placed(state)
        self._jitted(state, batch)
        key = layout_key(state, parts)
        mode = self.choice.picked if self.choice is not None else self.mode()
        found = self._compiled.get((key, mode))
        return found[1] if found is not None else self.lower(state, batch).compile()

    def _taken(self, batch: Any, mesh: Mesh) -> Any:
        """``batch`` as the step takes it, its host leaves placed: every program of the step is compiled
        for placed arrays and called with them (one program, whether the caller placed them or not)."""
        return (batch if self.replicated_batch
                else host_leaves_placed(batch, NamedSharding(mesh, self.strategy.batch_spec())))

    def _placed(self, state: TrainState) -> tuple[TrainState, tuple[str, ...]]:
        """``state`` in the memory the step keeps each part in, and the parts in host memory
        (:func:`parallax.step.offload.placement`; the answer is kept per memory layout)."""
        key = tuple(getattr(getattr(x, "sharding", None), "memory_kind", None) for x in jax.tree.leaves(state))
        if key not in self._placement:
            self._placement[key] = placement(state, self.options.offload)
        placed, parts = self._placement[key]
        if not placed:
            log.info("Moving the state to the memory offload=%r keeps it in (%s in host memory); pass the step "
                     "options to init_state to build it there.", self.options.offload, ", ".join(parts) or "nothing")
        return (state if placed else moved(state, parts)), parts

    def _jitted(self, state: TrainState, batch: Any):
        # Fast path for the loop: the same state layout and batch shapes as a previous call.
        leaves, treedef = jax.tree.flatten(state)
        batch_leaves, batch_treedef = jax.tree.flatten(batch)
        fast_key = (treedef, tuple(getattr(x, "sharding", None) for x in leaves), batch_treedef,
                    tuple((getattr(x, "shape", None), getattr(x, "sharding", None)) for x in batch_leaves))
        found = self._fast.get(fast_key)
        if found is not None:
            return found
        mesh, specs = state_specs_of(state)
        if self.auto_strategy:
            self.strategy = from_mesh(mesh)
        self.strategy.check_mesh(mesh)
        self._check_mode(mesh)
        check_batch_devices(batch, mesh, NamedSharding(mesh, PartitionSpec() if self.replicated_batch
                                                       else self.strategy.batch_spec()))  # before anything compiles
        if self.replicated_batch:
            leading_dims(batch)
        else:
            check_batch(batch, self.strategy, mesh, self.options.grad_accum if self.train else 1)
        parts, params_layout, batch = (self._placed(state)[1], (state.params, specs.params, mesh),
                                       self._taken(batch, mesh))
        key = layout_key(state, parts)
        if key not in self._cache:
            with mesh_context(mesh):  # the loss's proof decides the paths
                self.prove(state, batch)
            if len(self.modes()) > 1:  # compiled once here (under the mesh); the call reuses the picked program
                self.choice, functions, programs = self.compile_paths(state, batch)
                self.choice = timed_paths(self.choice, functions, programs, state, batch, self.options, mesh)
                log.info("Train step (%s): %s", self.strategy.describe(mesh), self.choice.describe())
                self._cache[key] = functions[self.choice.picked], mesh
            elif (key, self.mode()) in self._compiled:  # compiled by compile_paths (this step's or the search's)
                self._cache[key] = self._compiled[key, self.mode()][0], mesh
            else:
                function = self._function(self.mode(), mesh, specs, parts)
                try:
                    with mesh_context(mesh):  # compiled here to read the compiler's report; the call reuses it
                        lowered = function.lower(state, batch)
                except NoStackError as err:  # a pipeline that names no blocks= over a model with no stack
                    self.strategy = pipelined_blocks(self.strategy, state.model, batch, self.loss_fn, err)
                    return self._jitted(state, batch)
                program, self.reshardings[self.mode()] = compile_reporting(lowered, *params_layout)
                self._compiled[key, self.mode()] = function, program
                self._cache[key] = function, mesh
            if self.reshardings.get(self.mode()):
                log.warning("Step (%s, %s)%s", self.strategy.describe(mesh), self.mode(), self._resharded())
        self._fast[fast_key] = self._cache[key]
        return self._cache[key]

    def _check_mode(self, mesh: Mesh) -> None:
        """A state on Explicit axes (a model that shards itself) compiles with ``jit`` only."""
        self.explicit = is_explicit(mesh)
        if self.explicit:
            check_jit_only(mesh, self.options.compile, self.options.batch_stats)

    def prove(self, state: TrainState, batch: Any) -> Proof | None:
        """Reads once, from the loss's trace (nothing compiles or runs), whether a loss as written
        may run per data shard; afterwards :meth:`modes` is final for this state and batch. With
        ``grad_accum > 1``, first whether each microbatch computes what the batch does
        (:func:`parallax.step.paths.check_microbatches`).

        Raises:
            ValueError: ``grad_accum`` splits the batch of a loss that is not a mean of per-example terms.

        Returns:
            :attr:`proof`: ``None`` where the step has one path whatever the loss (or the loss
            is marked :func:`parallax.per_example_loss`).
        """
        mesh = state_specs_of(state)[0]
        if self.auto_strategy:
            self.strategy = from_mesh(mesh)
        if self.train and self.options.grad_accum > 1 and not self._microbatches_proven:
            check_microbatches(self.loss_fn, self.options, state, batch, mesh)
            self._microbatches_proven = True
        if self.proof is not None or len(self._allowed()[0]) == 1 or is_per_example_loss(self.loss_fn):
            return self.proof
        self.proof = read_proof(self.loss_fn, self.strategy, self.options, self.train, state, batch, mesh)
        log.info("Loss as written: %s",
                 self.proof.reason if self.proof else f"not proven per-example ({self.proof.reason})")
        return self.proof

    def _function(self, mode: str, mesh: Mesh, specs: TrainState, offloaded: tuple[str, ...]):
        shardings = with_memory_kinds(jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec),
                                      offloaded)
        replicated = NamedSharding(mesh, PartitionSpec())
        batch_sharding = replicated if self.replicated_batch else NamedSharding(mesh, self.strategy.batch_spec())
        if mode == "shard_map":
            gradients = shard_map_gradients(self.loss_fn, self.strategy, self.options, mesh, specs, self.train)
        else:
            gradients = jit_gradients(self.loss_fn, self.strategy, self.options, mesh, self.train, specs.params)
        train_step, eval_step = step_bodies(gradients, shardings, self.options.skip_nonfinite, offloaded)

        return (jax.jit(train_step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated),
                        donate_argnums=(0,) if self.options.donate else ()) if self.train else
                jax.jit(eval_step, in_shardings=(shardings, batch_sharding), out_shardings=replicated))


def make_train_step(loss_fn: LossFn, strategy: Strategy | str, options: StepOptions | None = None,
                    **overrides: Any) -> Step:
    """A jitted ``step(state, batch) -> (state, metrics)`` for any strategy.

    Args:
        loss_fn: ``loss_fn(model, batch)`` returning a scalar loss or ``(loss, metrics)``;
            ``model`` is the bound flax module (call it, or any of its methods). A metric
            may be a scalar mean, per-example values, or a ``(sum, count)`` pair.
        strategy: the parallelism strategy the state was built with, or ``"auto"`` for a
            state built by ``init_state(strategy="auto")`` (the step reads it from the
            state's mesh).
        options: a :class:`StepOptions` (its defaults otherwise).
        **overrides: any :class:`StepOptions` field by name (``compile``, ``grad_accum``,
            ``batch_stats``, ``rng_streams``, ``precision``, ``remat``, ``donate``,
            ``skip_nonfinite``), applied over ``options``.

    Returns:
        The step. Metrics are exact means over the global batch (``loss`` included).
        ``step.lower(state, batch)`` gives the lowered computation.

    Example:
        >>> step = px.make_train_step(loss_fn, px.FSDP(), grad_accum=2)
        >>> state, metrics = step(state, batch)
        >>> sorted(metrics)
        ['accuracy', 'loss']
    """
    return Step(loss_fn, strategy, StepOptions.create(options, **overrides), train=True)


def make_eval_step(loss_fn: LossFn, strategy: Strategy | str, options: StepOptions | None = None, *,
                   replicated_batch: bool = False, **overrides: Any) -> Step:
    """A jitted ``eval(state, batch) -> {name: (sum, count)}`` without an update.

    Sums and counts (not means) come back so that means over many batches stay exact;
    :func:`parallax.metrics.means` turns them into means. With ``replicated_batch=True``
    a batch of any size (e.g. the last, partial one of an eval set) is given whole to
    every device and the compiler splits the work. Options as in :func:`make_train_step`
    (``grad_accum``, ``donate`` and ``skip_nonfinite`` do not apply).

    Example:
        >>> evaluate = px.make_eval_step(loss_fn, px.FSDP())
        >>> float(px.metrics.means(evaluate(state, batch))["loss"]) > 0
        True
    """
    return Step(loss_fn, strategy, StepOptions.create(options, **overrides), train=False,
                replicated_batch=replicated_batch)

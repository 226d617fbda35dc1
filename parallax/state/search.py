"""``strategy="auto"`` and ``FSDP(split="auto")``: compile each candidate, price it, keep the fastest that fits.

Each candidate's state is planned from shapes (nothing is allocated) and its train step is compiled ahead of time on
abstract arrays placed on the candidate's mesh, then priced by the cost model (:mod:`parallax.pricing.cost`; over
several hosts, its collectives on the links they run over). Candidates whose state alone exceeds the memory budget are
dropped before anything compiles; those whose compiled peak exceeds it after. A candidate that does not apply (the
batch does not divide, a tensor layout cannot be derived) is skipped with its reason. Where the best estimates lie
close together, the closest few are run and the measured fastest kept where it beats the cost model's pick by over
10% (:mod:`parallax.pricing.timing`, ``StepOptions.timed_candidates``).

Example:
    >>> found = resolve(model, optax.adam(1e-3), batch, "auto", loss_fn=loss_fn, devices=jax.devices()[:4])
    >>> found.choice.picked.startswith(found.strategy.describe(found.mesh))
    True
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from parallax._errors import first_line
from parallax._units import format_bytes
from parallax.models import LossFn
from parallax.models.blocks import repeated_blocks
from parallax.parallel.candidates import (
    AUTO,
    candidates,
    every_param,
    is_auto,
    layout_family,
    layout_suffix,
    more_candidates,
    split_candidates,
    split_label,
    stacks,
    with_split,
)
from parallax.parallel.mesh_context import mesh_on
from parallax.pricing.choice import Choice, memory_budget, rank
from parallax.pricing.cost import device_key
from parallax.pricing.timing import Timed, on_mesh, settle
from parallax.sharding.strategy import Strategy
from parallax.sharding.topology import Topology
from parallax.state.candidate import plan_candidate
from parallax.state.plan import StatePlan
from parallax.state.search_budget import SearchBudget
from parallax.step.batch import check_batch_devices
from parallax.step.build import Step, make_train_step
from parallax.step.mesh_mode import DETECT
from parallax.step.options import StepOptions, memory_fallbacks

log = logging.getLogger("parallax")

# The (split, compile path) plans an open FSDP split is priced as when ``compile="auto"``: those
# that win somewhere. Under ``shard_map`` every FSDP shard is gathered by hand before use, so every
# split moves the same bytes, and ``input`` (a kernel's leading dim: the gather is a concatenation
# of whole rows) costs least; ``output`` under shard_map was the slowest plan on 21 of 22 zoo
# models. Under ``jit`` the split decides what the partitioner may do: ``largest`` lets it gather
# weights, ``output`` lets it leave each weight in place and move the activations instead (cheaper
# where a layer's weights outweigh the activations it sees: MLPs at modest batch), ``input`` keeps
# the contraction dim split (fastest for some hybrids and mixtures of experts); with the default size
# threshold, also ``output`` under ``jit`` with the small params split too (google-parallax's layout;
# ``benchmarks/held_out.py``). Plans laying the params out alike on one path are priced once. Measured
# on the zoo (``benchmarks/zoo.py``); a user's ``compile=`` prices every split on that path instead.
SAME_AS = "the same program as "  # a skipped candidate laid out like one already priced

SPLIT_PLANS = (("largest", "jit"), ("output", "jit"), ("input", "shard_map"), ("input", "jit"))


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A concrete strategy and mesh for an ``"auto"`` request, and how it was found.

    Attributes:
        strategy: the strategy to build with (no ``"auto"`` left in it).
        mesh: its mesh.
        choice: the cost model's :class:`~parallax.pricing.choice.Choice` (``None`` when nothing
            was searched).
        skipped: candidates that do not apply, with the reason.
        seconds: what the search took (planning and compiling every candidate, and timing).
        changes: the step options the search changed because no candidate fitted the memory
            budget with the options given (``offload``, then ``remat`` of the model's repeated
            blocks: :func:`~parallax.step.options.memory_fallbacks`), as ``StepOptions`` fields;
            build the state and the step with them (the Trainer and ``init_state`` do). Empty when
            nothing had to change.
        compile: the compile path the pick was priced on (``None`` when nothing was searched);
            with ``compile="auto"`` the Trainer builds its step on it (an FSDP split is only
            priced on the paths it is fast on: :data:`SPLIT_PLANS`).
        step: the pick's train step as the search compiled it (``None`` when nothing was
            searched): :meth:`train_step` trains with its program instead of compiling it again.
        plan: the pick's state as the search planned it (``None`` when nothing was searched), with the options
            it was priced with (:attr:`changes` included) and no params given: :meth:`state_plan` hands it on
            rather than planning the same state again.
    """

    strategy: Strategy
    mesh: Mesh
    choice: Choice | None = None
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    changes: dict[str, Any] = dataclasses.field(default_factory=dict)
    compile: str | None = None
    step: Step | None = dataclasses.field(default=None, repr=False, compare=False)
    plan: StatePlan | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def timed(self) -> dict[str, float]:
        """The candidates run on the devices to settle a close call, by label: their median step
        time in seconds (:attr:`Choice.timed`; empty when none was run)."""
        return self.choice.timed if self.choice is not None else {}

    def step_options(self, options: StepOptions) -> StepOptions:
        """``options`` for the step that trains the pick: with :attr:`changes`, and on the compile
        path it was priced on where ``options`` leave the path to the cost model."""
        fields = dict(self.changes)
        if self.compile is not None and options.compile == "auto":
            fields["compile"] = self.compile
        return dataclasses.replace(options, **fields) if fields else options

    def train_step(self, loss_fn: LossFn, options: StepOptions) -> Step:
        """The step that trains the pick (:meth:`step_options` of ``options``), running the program
        the search compiled for it where that is the same step (:meth:`Step.reuse`)."""
        step = make_train_step(loss_fn, self.strategy, self.step_options(options))
        step.reuse(self.step)
        step.searched = self.choice is not None
        return step

    def state_plan(self, mesh: Mesh, params: Any = None, sharding_mode: str = DETECT) -> StatePlan | None:
        """The state's plan the search made for its pick, where the state asked for on ``mesh`` is that one (the
        pick's mesh, no ``params`` given, ``sharding_mode`` as the search planned it); else ``None``: plan it."""
        if self.plan is None or params is not None or sharding_mode != DETECT or mesh is not self.mesh:
            return None
        return self.plan

    def headline(self) -> str:
        """What was chosen in a few words, for a progress line (:meth:`describe` has it all): ``FSDP
        split=input, shard_map: est. 6.6 ms a step (runner-up split=largest, jit: 6.8 ms); 2 candidates
        compiled in 2.7 s``."""
        if self.choice is None:
            return self.describe()
        choice = self.choice
        text = f"{choice.what} {choice.picked}: est. {1e3 * choice.estimates[choice.picked].seconds:.1f} ms a step"
        if choice.runner_up is not None:
            text += f" (runner-up {choice.runner_up}: {1e3 * choice.estimates[choice.runner_up].seconds:.1f} ms)"
        if choice.timed:
            text += ", the closest and each layout family's best timed on the devices"
        if self.changes:
            text += f"; with {describe_changes(self.changes)} to fit the memory budget"
        count = len(choice.estimates)
        return text + f"; {count} candidate{'s' if count != 1 else ''} compiled in {self.seconds:.1f} s"

    def describe(self) -> str:
        """One line: what was chosen, its estimate, the runner-up, and what the search cost."""
        if self.choice is None:
            return f"{self.strategy.describe(self.mesh)} (as given)"
        text = self.choice.describe()
        if self.changes:
            text += f"; with {describe_changes(self.changes)} to fit the memory budget"
        text += f"; {len(self.choice.estimates)} candidates compiled in {self.seconds:.1f} s"
        untried = [why for why in self.skipped.values() if why.startswith("not tried")]
        if untried:
            text += f", {len(untried)} not tried ({untried[0][len('not tried: '):]})"
        alike = [label for label, why in self.skipped.items() if why.startswith(SAME_AS)]
        if alike:
            text += f", {len(alike)} laid out like another ({', '.join(alike)})"
        others = len(self.skipped) - len(untried) - len(alike)
        return text + (f", {others} skipped" if others else "")


def _label(strategy: Strategy, mesh: Mesh | None, searching_splits: bool, split_open: bool) -> str:
    return split_label(strategy) if searching_splits else strategy.describe(mesh) + layout_suffix(strategy, split_open)


def resolve(model: Any, optimizer: Any, example_batch: Any, strategy: Strategy | str, *, loss_fn: LossFn | None,
            devices: Sequence[jax.Device] | None = None, mesh: Mesh | None = None,
            options: StepOptions | None = None, rng: Any = 0, rng_streams: Sequence[str] = ("dropout",),
            among: Sequence[Strategy] | None = None, steps: int | None = None,
            topology: Topology | None = None) -> Resolved:
    """The concrete strategy for ``strategy``: itself unless it is ``"auto"`` or has ``FSDP(split="auto")``.

    Args:
        model, optimizer, example_batch, loss_fn, rng, rng_streams: as for :func:`parallax.init_state`.
        strategy: ``"auto"`` (every DP/FSDP/TP mesh of the devices,
            :func:`~parallax.parallel.candidates.candidates`, and the pipeline, context and expert
            meshes the model calls for: :func:`~parallax.parallel.candidates.more_candidates`) or a
            strategy whose FSDP part has ``split="auto"`` (each split on the given mesh); any other
            is returned as is.
        devices: the devices to search meshes over (all of this process's by default).
        mesh: for a split search, the mesh to use; ``strategy="auto"`` picks its own.
        options: the step's :class:`parallax.StepOptions` (``memory_budget``, ``grad_accum``,
            ``precision``... the candidates are compiled with them).
        among: for ``"auto"``, the strategies to choose from instead of every mesh of the
            devices (e.g. ``candidates(8, fsdp=px.FSDP(min_weight_size=2**14))``).
        steps: how many steps the run will train, if known: the search stops once it has spent
            more than ``steps`` times the best estimated step time so far (what the rest could
            at most save). ``options.search_seconds`` bounds it in any case (and alone, without
            ``steps``: no fixed split is fast on every model, ``benchmarks/zoo.py``).
        topology: hosts as simulated, with their links' bandwidths (:class:`parallax.Topology`; by default the
            processes, at calibrated speeds): each candidate laid out and priced on them (never timed here).
    """
    if not is_auto(strategy):
        return Resolved(strategy, mesh if mesh is not None else mesh_on(strategy, devices, topology))
    if loss_fn is None and strategy != AUTO:  # nothing to compile: the split that needs no pricing
        log.info("FSDP(split='auto') prices each split by compiling the train step, which needs loss_fn=; "
                 "without it each param is split along its largest dim (split='largest').")
        return _largest(strategy, mesh, devices, topology=topology)
    if loss_fn is None:
        raise ValueError(f"strategy={strategy!r} compiles each candidate's train step to price it: pass loss_fn=.")
    if strategy == AUTO and mesh is not None:
        raise ValueError("strategy='auto' picks the mesh shape itself: pass devices= instead of mesh=.")
    start = time.perf_counter()
    options = StepOptions.create(options)
    devices = list(mesh.devices.flat) if mesh is not None else list(devices if devices is not None else jax.devices())
    check_batch_devices(example_batch, mesh if mesh is not None else devices)  # before anything compiles
    budget = memory_budget(options.memory_budget, devices)
    splitting = strategy != AUTO
    pool = priced_candidates([strategy] if splitting else list(among or candidates(len(devices))), options.compile)
    spent = SearchBudget(options.search_seconds, steps, device_key(devices),
                         [_pool_label(candidate, splitting, split_open, path) for candidate, path, split_open in pool])
    price = lambda opts: _price(pool, opts, model, optimizer, example_batch, loss_fn, mesh, devices, budget,
                                splitting, rng, rng_streams, spent, topology)
    estimates, found, skipped, runnable = price(options)
    fits = lambda found: budget is None or any(e.peak <= budget for e in found.values())
    stacked = stacks(plan for *_, plan in found.values())
    extra = more_candidates(stacked, model, example_batch, loss_fn, rng_streams, len(devices), not fits(estimates)) \
        if strategy == AUTO and among is None else []  # pipelines, the sequence or experts over the devices
    if extra:
        more = _price(priced_candidates(extra, options.compile), options, model, optimizer, example_batch, loss_fn,
                      mesh, devices, budget, splitting, rng, rng_streams, None, topology)  # all priced (no clock)
        for mine, theirs in zip((estimates, found, skipped, runnable), more):
            mine.update(theirs)
    changes: dict = {}
    if not fits(estimates):
        for _, fields in memory_fallbacks(options, lambda: repeated_blocks(model, example_batch, loss_fn)):
            trial = price(dataclasses.replace(options, **fields))  # only when nothing fits without
            if fits(trial[0]):
                log.info("No candidate fits the memory budget of %s per device as given; with %s some do.",
                         format_bytes(budget), describe_changes(fields))
                (estimates, found, skipped, runnable), changes = trial, fields
                break
    if not estimates:
        reasons = "; ".join(f"{label}: {why}" for label, why in skipped.items())
        if budget is not None and all("over the budget" in why for why in skipped.values()):
            raise ValueError(f"strategy={strategy!r}: no candidate fits the memory budget of {format_bytes(budget)} "
                             f"per device on {len(devices)} devices, with all state on the devices or offloaded to "
                             f"host memory ({reasons}). Raise memory_budget, use more devices, rematerialise the "
                             "model's blocks (remat=), or shrink the model or optimizer state.")
        if splitting:  # the search could not compile this model's step: the split that needs no pricing
            log.info("FSDP(split='auto') could not price the splits (%s); each param is split along its largest dim.",
                     reasons)
            return _largest(strategy, mesh, devices, skipped, topology)
        raise ValueError(f"strategy={strategy!r}: no candidate applies on {len(devices)} devices ({reasons}).")
    choice, leaves = rank(estimates, budget, what="FSDP" if splitting else "strategy"), jax.tree.leaves(example_batch)
    if not spent.stopped(estimates) and topology is None and all(isinstance(x, (np.ndarray, jax.Array))
                                                                 for x in leaves):
        families = None if splitting else {label: layout_family(found[label][0]) for label in estimates}
        choice = settle(choice, lambda label: _timed(runnable[label], example_batch, estimates[label].peak),
                        budget, options.timed_candidates, devices, families)
    picked, picked_mesh, path, step, plan = found[choice.picked]
    resolved = Resolved(picked, picked_mesh, choice, skipped, time.perf_counter() - start, changes, path, step, plan)
    log.info("%s", resolved.describe())
    return resolved


def _largest(strategy: Strategy, mesh: Mesh | None, devices: Sequence[jax.Device] | None,
             skipped: dict[str, str] | None = None, topology: Topology | None = None) -> Resolved:
    """An open split settled without pricing: each param split along its largest dim."""
    largest = with_split(strategy, "largest")
    return Resolved(largest, mesh if mesh is not None else mesh_on(largest, devices, topology),
                    skipped=dict(skipped or {}))


def priced_candidates(pool: Sequence[Strategy], compile: str) -> list[tuple[Strategy, str | None, bool]]:
    """Each candidate with the compile path to price it on (``None``: the step's own ``compile``)
    and whether its split was left open.

    A candidate whose FSDP part leaves the split open (``split="auto"``) becomes one per plan of
    :data:`SPLIT_PLANS` (and the comment's fifth) under ``compile="auto"``, else one per split on its path.

    Example:
        >>> [(split_label(s), path) for s, path, _ in priced_candidates([px.FSDP(split="auto")], "auto")][-2:]
        [('split=input', 'jit'), ('split=output, every param', 'jit')]
    """
    priced = []
    for candidate in pool:
        if not is_auto(candidate):
            priced.append((candidate, None, False))
        elif compile == "auto":
            every = [(plan, "jit", True) for plan in [every_param(candidate)] if plan is not None]
            priced.extend([(with_split(candidate, split), path, True) for split, path in SPLIT_PLANS] + every)
        else:
            priced.extend((split, None, True) for split in split_candidates(candidate))
    return priced


def describe_changes(changes: dict[str, Any]) -> str:
    """``offload='optimizer', remat=('Block',)``: option changes as you would write them."""
    return ", ".join(f"{name}={value!r}" for name, value in changes.items())


def _pool_label(candidate: Strategy, splitting: bool, split_open: bool, path: str | None) -> str:
    """A candidate's label before its mesh is made (``split=output, jit``)."""
    return _label(candidate, None, splitting, split_open) + (f", {path}" if path else "")


def _price(pool: Sequence[tuple[Strategy, str | None, bool]], options: StepOptions, model: Any, optimizer: Any,
           example_batch: Any, loss_fn: LossFn, mesh: Mesh | None, devices: Sequence[jax.Device], budget: int | None,
           splitting: bool, rng: Any, rng_streams: Sequence[str], spent: SearchBudget | None = None,
           topology: Topology | None = None) -> tuple:
    """Plans and compiles each candidate with ``options``, in order, until ``spent`` says stop: the
    cost model's estimates, the strategies and meshes, the skipped with their reasons, and what
    timing needs, by label."""
    estimates, found, skipped, runnable = {}, {}, {}, {}
    laid_out: dict[tuple, str] = {}  # (path, (mesh, batch and state layout)) -> the first candidate's label
    for candidate, path, split_open in pool:
        label = _pool_label(candidate, splitting, split_open, path)
        stop = spent.stop(estimates) if spent is not None else None  # the first candidate is always priced
        if stop:
            skipped[label] = stop
            continue
        try:
            candidate_mesh = mesh if mesh is not None else mesh_on(candidate, devices, topology)
            base = _label(candidate, candidate_mesh, splitting, split_open)
            label = base + (f", {path}" if path else "")
            planned = plan_candidate(model, optimizer, example_batch, loss_fn, candidate, mesh=candidate_mesh,
                                     options=options, rng=rng, rng_streams=rng_streams, topology=topology,
                                     prefer=(path,) if path else ())
            layout = planned.layout
            if (path, layout) in laid_out:  # another split placed every array alike: the same program
                skipped[label] = f"{SAME_AS}{laid_out[path, layout]} (every array laid out alike, on the same path)"
                continue
            laid_out[path, layout] = label
            over = planned.over_budget(budget)
            if over:  # pruned by memory before compiling
                skipped[label] = over
                continue
            step_choice, functions, programs = planned.step.compile_paths(planned.plan.abstract_arrays(),
                                                                          planned.batch)
        except (ValueError, TypeError) as err:  # does not apply: sizes, the batch, a layout
            skipped[label] = first_line(err)
            continue
        label = f"{base}, {step_choice.picked}"  # the path it compiled on (the loss may allow only jit)
        laid_out.setdefault((step_choice.picked, layout), label)
        estimates[label] = step_choice.estimates[step_choice.picked]
        if spent is not None:
            spent.priced(programs[step_choice.picked])
        found[label] = (planned.plan.strategy, planned.plan.mesh, step_choice.picked, planned.step, planned.plan)
        runnable[label] = (functions[step_choice.picked], programs[step_choice.picked], planned.plan.build,
                           planned.batch_sharding, planned.state_bytes)
    return estimates, found, skipped, runnable


def _timed(runnable: tuple, example_batch: Any, peak: int) -> Timed:
    """A priced candidate ready to run: its step on its mesh, its state's builder, the batch placed."""
    step, program, build, placement, state_bytes = runnable
    return Timed(on_mesh(step, placement.mesh), program, build, jax.device_put(example_batch, placement), state_bytes,
                 peak)

"""assert_equivalent: a sharded run against a plain one-device optax loop, step by step.

The tolerance policy (``tolerance="auto"``) is in :mod:`parallax.testing.rounding`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from parallax._compat import mesh_context
from parallax._tree import path_str
from parallax.models import LossFn, adapter_for, unwrap_pretrained
from parallax.parallel.candidates import AUTO, as_strategy, from_mesh, is_auto
from parallax.parallel.mesh_context import mesh_or_context
from parallax.parallel.pipeline.stacked_blocks import stacked_like, unstacked
from parallax.sharding.strategy import Strategy
from parallax.state.initialize import init_state
from parallax.state.search import resolve
from parallax.step.build import make_train_step
from parallax.step.train_state import TrainState
from parallax.testing.reference import Reference, Run
from parallax.testing.rounding import excess, rounding_allowance

__all__ = ["EquivalenceReport", "NotEquivalentError", "assert_equivalent"]

FLOAT32_TOLERANCE = 1e-5


class NotEquivalentError(AssertionError):
    """A sharded run did not train like one device; the message is the report."""


@dataclasses.dataclass(frozen=True)
class EquivalenceReport:
    """What :func:`assert_equivalent` compared.

    Attributes:
        strategy: the strategy's description.
        mode: the step's compile path (``"jit"`` or ``"shard_map"``).
        losses: the sharded run's loss per step; ``reference_losses`` the one-device run's.
        state_diffs: ``{part: {path: max |difference|}}`` of the final state, for the parts
            ``"params"``, ``"optimizer state"`` and ``"model state"``.
        tolerance: the bound every difference was held to, and ``tolerance_basis`` why.
        param_allowance: ``{path: largest allowance}``, where the params were also allowed
            what the optimizer amplifies of gradient rounding (``tolerance="auto"``, once a
            difference passed 1e-5; :mod:`parallax.testing.rounding`); empty otherwise.
        param_excess: ``{path: largest |difference| - allowance}`` of the params, with
            ``param_allowance``: what was held to ``tolerance``.
        grad_diffs: on failure, ``{path: (sharded norm, one-device norm, max |difference|)}``
            of the first step's gradient, for the params where it differs most.
    """

    strategy: str
    mode: str
    losses: np.ndarray
    reference_losses: np.ndarray
    state_diffs: dict[str, dict[str, float]]
    tolerance: float
    tolerance_basis: str
    param_allowance: dict[str, float] = dataclasses.field(default_factory=dict)
    param_excess: dict[str, float] = dataclasses.field(default_factory=dict)
    grad_diffs: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)

    @property
    def loss_diffs(self) -> np.ndarray:
        return np.abs(self.losses - self.reference_losses)

    @property
    def max_diff(self) -> float:
        """The largest difference anywhere: losses or final state."""
        state = [d for part in self.state_diffs.values() for d in part.values()]
        return float(max([*self.loss_diffs, *state], default=0.0))

    def _held(self, part: str) -> dict[str, float]:
        """What ``part``'s leaves are held to the tolerance with: their difference, or for the
        params with an allowance, their difference beyond it."""
        return self.param_excess if part == "params" and self.param_allowance else self.state_diffs[part]

    @property
    def max_held(self) -> float:
        """The largest difference held to the tolerance: losses, state, params beyond their allowance."""
        held = [d for part in self.state_diffs for d in self._held(part).values()]
        return float(max([*self.loss_diffs, *held], default=0.0))

    @property
    def passed(self) -> bool:
        return self.max_held <= self.tolerance

    def __str__(self) -> str:
        verdict = "trains like one device" if self.passed else "does NOT train like one device"
        if self.param_allowance:  # what the tolerance held: the params beyond each one's allowance
            compared = (f"max difference {self.max_held:.3g} (losses, state, and each param beyond its rounding "
                        f"allowance; {self.max_diff:.3g} before the allowances)")
        else:
            compared = f"max difference {self.max_diff:.3g} (losses and final state)"
        lines = [f"parallax.testing: {self.strategy} ({self.mode} path) {verdict}: {compared}, tolerance "
                 f"{self.tolerance:.3g} ({self.tolerance_basis})."]
        bad_steps = np.nonzero(self.loss_diffs > self.tolerance)[0]
        if len(bad_steps):
            t = int(bad_steps[0])
            lines.append(f"  first step whose loss differs: step {t} (loss {self.losses[t]:.6g}, one device "
                         f"{self.reference_losses[t]:.6g}, difference {self.loss_diffs[t]:.3g})")
        lines.append("  loss difference per step: " + ", ".join(f"{d:.2g}" for d in self.loss_diffs))
        for part, diffs in self.state_diffs.items():
            held = self._held(part)
            differing = sorted(((p, d) for p, d in held.items() if d > self.tolerance), key=lambda item: -item[1])
            if differing:
                shown = ", ".join(f"{p} {diffs[p]:.3g}" for p, d in differing[:5])
                more = f" and {len(differing) - 5} more" if len(differing) > 5 else ""
                beyond = " (beyond each one's rounding allowance)" if held is not diffs else ""
                lines.append(f"  {part} differ: {shown}{more}{beyond}")
            elif held is not diffs:
                path, most = max(diffs.items(), key=lambda item: item[1])  # the param that differs most
                lines.append(f"  {part}: equal within tolerance plus each param's rounding allowance (most different: "
                             f"{path} by {most:.2g}, its allowance {self.param_allowance.get(path, 0.0):.2g})")
            else:
                lines.append(f"  {part}: equal within tolerance (max {max(diffs.values(), default=0.0):.2g})")
        grads = {p: row for p, row in self.grad_diffs.items() if row[2] > self.tolerance} or self.grad_diffs
        if grads:
            shown = ", ".join(f"{p} (max difference {d:.3g}; norm {a:.4g} sharded, {b:.4g} one device)"
                              for p, (a, b, d) in grads.items())
            lines.append(f"  first-step gradients that differ most: {shown}")
        return "\n".join(lines)


def assert_equivalent(
    model: Any,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    batches: Sequence[Any],
    strategy: Strategy | str,
    *,
    steps: int | None = None,
    tolerance: float | str = "auto",
    rng: Any = 0,
    mesh: Any = None,
    devices: Sequence[Any] | None = None,
    params: Any = None,
    **step_options: Any,
) -> EquivalenceReport:
    """Trains ``model`` under ``strategy`` and on one device, and fails unless they agree.

    Args:
        model: a flax linen module, an NNX module, or a function that builds one.
        optimizer: an optax transformation (a fresh state is built for each run).
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, metrics)``.
        batches: the global batches, one per step (host arrays).
        strategy: the strategy to check, or ``"auto"`` (what the search picks on these devices).
        steps: how many of ``batches`` to train on (all by default).
        tolerance: the largest absolute difference allowed, or ``"auto"``: 1e-5; once a
            difference exceeds that, twice what plain ``jit`` already drifts when the same
            values are merely placed on the strategy's mesh (the compiler's own floor), and
            for each param element also twice what its optimizer amplifies of twice the gradients'
            rounding (:mod:`parallax.testing.rounding`: near-zero gradients under Adam).
        rng: the seed of both runs.
        mesh: the device mesh: the mesh set with ``jax.set_mesh`` around the call, else
            ``strategy.make_mesh(devices)``.
        devices: the devices the strategy's mesh is made of where no mesh is given (all by
            default), e.g. ``jax.devices()[:4]`` for ``px.FSDP(4)`` on a machine with 8.
        params: the params both runs start from (a pretrained model's, for a fine-tuning run), as
            :func:`parallax.init_state` takes them: a pytree of host or device arrays, or an orbax
            checkpoint path; the model's initialisation with ``rng`` by default.
        **step_options: options of the sharded step (``compile``, ``grad_accum``,
            ``precision``, ``rng_streams``, ...), as :func:`parallax.make_train_step` takes them.

    Returns:
        The :class:`EquivalenceReport` (``print`` it to see the differences).

    Raises:
        NotEquivalentError: a difference beyond the tolerance; the message is the report.

    Example:
        >>> report = px.testing.assert_equivalent(model, optax.adam(1e-3), loss_fn, [batch] * 3,
        ...                                       px.FSDP(min_weight_size=0))
        >>> report.passed, report.mode in ("jit", "shard_map")  # the mode: the cost model's pick
        (True, True)
    """
    strategy = as_strategy(strategy)
    model, params = unwrap_pretrained(model, params)  # a Hugging Face model object: its module and params
    batches = list(batches)[:steps]
    if not batches:
        raise ValueError("assert_equivalent needs at least one batch.")
    if strategy != AUTO:  # "auto" searches the devices of a jax.set_mesh in init_state
        mesh, devices = mesh_or_context(strategy, mesh, devices)
        mesh = strategy.make_mesh(devices) if mesh is None and devices is not None else mesh
    step = make_train_step(loss_fn, strategy, **step_options)
    options = step.options
    if strategy != AUTO and is_auto(strategy):  # FSDP(split="auto"): settled as for a run of len(batches) steps
        found = resolve(model, optimizer, batches[0], strategy, loss_fn=loss_fn, mesh=mesh, options=options, rng=rng,
                        rng_streams=options.rng_streams, steps=len(batches))
        step = found.train_step(loss_fn, options)  # runs the program the search compiled for its pick
        strategy, mesh, options = found.strategy, found.mesh, step.options
    state = init_state(model, optimizer, batches[0], strategy=strategy, rng=rng, loss_fn=loss_fn, mesh=mesh,
                       devices=devices if strategy == AUTO else None, rng_streams=options.rng_streams,
                       options=options, params=params)
    initial = unstacked(jax.device_get(state))  # the reference trains the model's own tree (a list's blocks as written)
    mesh_of = jax.tree.leaves(state.params)[0].sharding.mesh
    if strategy == AUTO:
        strategy = from_mesh(mesh_of)  # what the search chose (the step reads it from the state too)

    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    final = unstacked(jax.device_get(state))
    mode = step.mode()  # known once the step has compiled: the cost model may pick it
    data_shards = int(np.prod([mesh_of.shape[a] for a in strategy.data_axes]))
    reference = Reference(adapter_for(state.model), state.tx, loss_fn, options, data_shards,
                          per_shard=mode == "shard_map")
    ref = reference.run(initial, batches)
    report = _report(strategy, mesh_of, mode, np.array(losses), ref.losses, final, ref.final, FLOAT32_TOLERANCE,
                     "float32 rounding")
    if tolerance == "auto" and not report.passed:
        report = _auto_tolerance(report, reference, ref, initial, batches, final, state, strategy, mesh_of, options)
    elif tolerance != "auto":
        report = dataclasses.replace(report, tolerance=float(tolerance), tolerance_basis="given")
    if not report.passed:
        report = dataclasses.replace(report, grad_diffs=_gradient_diffs(loss_fn, strategy, options, initial,
                                                                        batches[0], reference, state))
        raise NotEquivalentError(str(report))
    return report


def _report(strategy, mesh, mode, losses, ref_losses, final, ref_final, tolerance, basis) -> EquivalenceReport:
    diffs = {"params": excess(final.params, ref_final.params),
             "optimizer state": excess(final.opt_state, ref_final.opt_state),
             "model state": excess(final.model_state, ref_final.model_state)}
    return EquivalenceReport(strategy.describe(mesh), mode, losses, ref_losses, diffs, tolerance, basis)


def _auto_tolerance(report, reference, ref: Run, initial, batches, final, state, strategy, mesh, options):
    """``report`` held to ``tolerance="auto"``'s bound (:mod:`parallax.testing.rounding`).

    The reference is run once more with its inputs placed as the strategy places them: another
    reduction order. Its gradients at the reference's own inputs, and the one-device gradients
    at those params dithered by a ulp (every rounding changed), give each step's rounding
    level; the optimizer rerun on the reference's gradients turns that into each param's
    allowance, and the placed run's drift beyond those allowances (losses, state) is the floor.
    """
    # the sharded run's layout, in device memory (its offloaded parts are placed on the devices here)
    shardings = jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), unstacked(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        (state.params, state.model_state, state.opt_state))))
    batch_sharding = NamedSharding(mesh, strategy.batch_spec())

    def place(tree, kind):
        where = {"state": shardings, "batch": batch_sharding, "key": NamedSharding(mesh, PartitionSpec())}[kind]
        return jax.device_put(tree, where)

    with mesh_context(mesh):  # the strategy's mesh (its axis types), not a context mesh of the caller's
        placed = reference.run(initial, batches, place)
        other = reference.gradients_at(ref.inputs, batches, initial, place)  # the same program: no second compile
    dithered = reference.dithered_gradients(ref.inputs, batches, initial)  # the one-device program, compiled already
    allowance = rounding_allowance(reference.tx, initial.params, initial.opt_state, jax.device_get(ref.grads),
                                   jax.device_get(other), jax.device_get(dithered))
    compared = report.state_diffs["params"]  # the floating leaves
    allowed = {path: float(np.max(a)) for path, a in _by_path(allowance).items() if path in compared}
    drift = dataclasses.replace(_report(strategy, mesh, "", placed.losses, ref.losses, placed.final, ref.final, 0.0,
                                        ""),
                                param_allowance=allowed,
                                param_excess=excess(placed.final.params, ref.final.params, allowance))
    floor = drift.max_held
    widest = max(allowed.items(), key=lambda item: item[1], default=("", 0.0))
    basis = (f"twice the drift of plain jit with the same values placed on the mesh ({floor:.2g})"
             + (f", {options.precision} compute" if options.policy.compute_dtype is not None else "")
             + f"; params also twice their optimizer's amplification of twice the gradients' rounding (largest: "
               f"{widest[0]} {widest[1]:.2g})")
    return dataclasses.replace(report, tolerance=max(FLOAT32_TOLERANCE, 2 * floor), tolerance_basis=basis,
                               param_allowance=allowed, param_excess=excess(final.params, ref.final.params, allowance))


def _by_path(tree) -> dict[str, Any]:
    return {path_str(path) or "(root)": leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _gradient_diffs(loss_fn, strategy, options, initial, batch, reference, layout: TrainState, top: int = 5):
    """The first step's gradient of each param, sharded and on one device, where they differ most
    (the sharded gradient read off one SGD step with learning rate 1 from the initial state, laid
    out as ``layout``, the sharded run's state)."""
    sgd = optax.sgd(1.0)
    probe = make_train_step(loss_fn, strategy, options, donate=False)

    def put(value, like):
        return jax.device_put(value, jax.tree.map(lambda x: x.sharding, like))

    params = put(stacked_like(initial.params, layout.params), layout.params)
    start = layout.replace(step=put(initial.step, layout.step), params=params, rng=put(initial.rng, layout.rng),
                           model_state=put(initial.model_state, layout.model_state), opt_state=sgd.init(params), tx=sgd)
    stepped, _ = probe(start, batch)
    sharded = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), initial.params,
                           unstacked(jax.device_get(stepped.params)))
    ones = jax.device_get(reference.grads(initial.params, initial.model_state, batch,
                                          jax.random.fold_in(initial.rng, 0))[0])
    rows = {}
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(sharded)[0], jax.tree.leaves(ones)):
        rows[path_str(path)] = (float(np.linalg.norm(a)), float(np.linalg.norm(b)), float(np.abs(a - b).max()))
    return dict(sorted(rows.items(), key=lambda item: -item[1][2])[:top])

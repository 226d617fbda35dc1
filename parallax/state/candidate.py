"""One candidate of a plan or a search, planned on its mesh and ready to compile: the one place both lay it out.

``px.plan``'s rows (:func:`parallax.plan.candidates.evaluate`), the search of ``strategy="auto"`` and of
``FSDP(split="auto")`` (:func:`parallax.state.search.resolve`) and the Trainer's layout over hosts
(:func:`parallax.train.planning.lay_out_by_bytes`) all start a candidate the same way: its mesh, the batch checked
against it, its state planned from shapes (nothing allocated), the state's bytes a device, the budget cut, the train
step and the batch's shapes placed as a real batch. :func:`plan_candidate` does that once and returns a
:class:`Candidate`; what each then compiles and reads from it is its own (the one chosen program and its costs for a
plan, every compile path's estimate for a search).

Example:
    >>> candidate = plan_candidate(model, optax.adam(1e-3), batch, loss_fn, px.FSDP(min_weight_size=0),
    ...                            devices=jax.devices()[:4])
    >>> candidate.describe(), candidate.over_budget(None)
    ('FSDP(fsdp=4)', None)
    >>> candidate.over_budget(1)
    'its state alone is 17.4 KiB per device, over the budget of 1 B'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax._units import format_bytes
from parallax.models import LossFn
from parallax.parallel.mesh_context import mesh_on
from parallax.sharding.strategy import Strategy
from parallax.sharding.topology import Topology
from parallax.state.plan import StatePlan, plan_state
from parallax.state.summary import summarize
from parallax.step.build import Step
from parallax.step.mesh_mode import DETECT
from parallax.step.offload import offloaded_parts
from parallax.step.options import StepOptions


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A candidate strategy planned on its mesh: what compiling it needs, and its state's bytes.

    Attributes:
        strategy: the strategy as asked for (as the pool has it).
        mesh: the mesh it was asked on (a given one, else :func:`~parallax.parallel.mesh_context.mesh_on`'s).
        plan: its state planned on ``mesh`` (``plan.mesh`` may differ from ``mesh``: a size-1 axis added for one
            the model's sharding names, its axis types as the model needs them; ``plan.strategy`` holds what the
            planning fitted to the traced loss).
        totals: :func:`parallax.summarize`'s totals of the state (bytes by part and where they live).
        state_bytes: the state's bytes a device in device memory (what the budget cuts on before compiling).
        step: its train step, not compiled.
        batch: the batch's shapes and dtypes, placed on ``plan.mesh`` as a real batch.
    """

    strategy: Strategy
    mesh: Mesh
    plan: StatePlan
    totals: dict
    state_bytes: int
    step: Step = dataclasses.field(repr=False)
    batch: Any = dataclasses.field(repr=False)

    def describe(self) -> str:
        """The planned strategy on its mesh (``FSDP(fsdp=4)``)."""
        return self.plan.strategy.describe(self.mesh)

    def over_budget(self, budget: int | None) -> str | None:
        """Why this candidate is cut before compiling (its state alone over ``budget`` bytes a device), or ``None``."""
        if budget is None or self.state_bytes <= budget:
            return None
        return (f"its state alone is {format_bytes(self.state_bytes)} per device, over the budget of "
                f"{format_bytes(budget)}")

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a real batch is placed for this candidate's step."""
        return NamedSharding(self.plan.mesh, self.plan.strategy.batch_spec())

    @property
    def layout(self) -> tuple:
        """What decides its program beside the compile path: the mesh, the batch's and every array's layout and the
        run changes. Two candidates laid out alike compile to the same program on one path."""
        plan = self.plan
        return (tuple(plan.mesh.shape.items()), str(plan.strategy.batch_spec()), repr(plan.strategy.run_changes),
                str(jax.tree.leaves(plan.specs, is_leaf=lambda x: isinstance(x, PartitionSpec))))

    def compiled(self) -> Any:
        """The program the step compiles for this candidate (one path: the step's own pick where it has two)."""
        return self.step.program(self.plan.abstract_arrays(), self.batch)


def plan_candidate(model: Any, optimizer: Any, example_batch: Any, loss_fn: LossFn, strategy: Strategy, *,
                   devices: Sequence[jax.Device] | None = None, mesh: Mesh | None = None,
                   options: StepOptions | None = None, rng: Any = 0, rng_streams: Sequence[str] | None = None,
                   topology: Topology | None = None, prefer: tuple[str, ...] = (),
                   sharding_mode: str = DETECT) -> Candidate:
    """``strategy`` planned as a candidate: on ``mesh`` (else its own mesh of ``devices``, laid out over
    ``topology``'s hosts where one is given), the batch checked, the state planned with ``options``' offload and
    ``rng_streams`` (``options``' by default), its step built (compile paths in ``prefer``'s order, priced on
    ``topology``'s links).

    Raises:
        ValueError, TypeError: the candidate does not apply (the sizes, a rule, the batch), with the reason.
    """
    options = StepOptions.create(options)
    if mesh is None:
        mesh = mesh_on(strategy, devices, topology)
    strategy.check_batch_size(int(jax.numpy.shape(jax.tree.leaves(example_batch)[0])[0]), mesh,
                              multiple=options.grad_accum)
    plan = plan_state(model, optimizer, example_batch, strategy=strategy, rng=rng, loss_fn=loss_fn, mesh=mesh,
                      rng_streams=options.rng_streams if rng_streams is None else rng_streams,
                      offload=options.offload, sharding_mode=sharding_mode)
    totals = host_counted(summarize(plan, find_frozen=False).totals, options.offload, list(mesh.devices.flat))
    step = Step(loss_fn, plan.strategy, options, train=True, prefer=prefer, topology=topology)
    batch = abstract_batch(example_batch, NamedSharding(plan.mesh, plan.strategy.batch_spec()))
    return Candidate(strategy, mesh, plan, totals, totals["total"]["per_device"] - totals["total"]["host"], step, batch)


def abstract_batch(example_batch: Any, sharding: NamedSharding) -> Any:
    """The batch's shapes and dtypes, placed like a real batch (no data needed)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x),
                                                       sharding=sharding), example_batch)


def without_memories(devices: Sequence[jax.Device]) -> bool:
    """Whether ``devices`` are a GPU described to XLA's GPU compiler without the GPUs: no memory spaces,
    so JAX drops a sharding's ``pinned_host`` there and the program holds offloaded state in device memory."""
    return devices[0].platform == "gpu" and jax.default_backend() != "gpu"


def host_counted(totals: dict, offload: Any, devices: Sequence[jax.Device]) -> dict:
    """``totals`` (:func:`parallax.summarize`'s) with the state that ``offload`` keeps in host memory
    counted there on deviceless GPUs, where the shardings could not say so."""
    if not offload or totals["total"]["host"] or not without_memories(devices):
        return totals
    totals = {part: dict(counts) for part, counts in totals.items()}
    for part in offloaded_parts(offload):
        totals[part]["host"] = totals[part]["per_device"]
    totals["total"]["host"] = sum(totals[part]["host"] for part in totals if part != "total")
    return totals

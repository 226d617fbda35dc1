"""Settling a close call between a train step's compile paths by running them.

The cost model prices ``jit`` and ``shard_map`` from their programs alone; where the two
estimates lie within its error (:data:`parallax.pricing.timing.WINDOW`), its pick is a coin
toss between paths that can differ by 10–25% in step time (measured on transformer LMs under
data parallelism, ``benchmarks/zoo.py``). At the first call, where both paths compiled and
their estimates are that close (or the steps so short that running them costs under
:data:`parallax.pricing.timing.CHEAP_SECONDS`: :func:`parallax.pricing.timing.closest`), each
runs a few steps on a copy of the caller's state and batch, and the measured fastest is kept
where it beats the cost model's pick by more than 10%
(:func:`parallax.pricing.timing.settle`: cached per machine and program, so a second run of the
same model runs nothing). The caller's state is not touched: the copies are donated, the
caller's arrays are not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from parallax.pricing.choice import Choice, memory_budget
from parallax.pricing.timing import Timed, on_mesh, settle
from parallax.step.options import StepOptions

HOST_KINDS = ("pinned_host", "unpinned_host")  # memory kinds of host memory, not the device's


def timed_paths(choice: Choice, functions: Mapping[str, Any], programs: Mapping[str, Any], state: Any, batch: Any,
                options: StepOptions, mesh: Mesh) -> Choice:
    """``choice`` of the compile path, settled on the devices where its estimates are close.

    Args:
        choice: the cost model's choice between the compiled paths.
        functions: per path, its jitted step (``functions[path](state, batch)`` reuses its program).
        programs: per path, its ``jax.stages.Compiled`` program.
        state: the caller's train state (copied for each path's run; never donated).
        batch: the caller's batch (placed on the devices as each path takes it).
        options: the step's options: ``timed_candidates`` (``0``: nothing runs), ``memory_budget``.
        mesh: the state's mesh.

    Returns:
        ``choice`` unchanged where nothing ran (no close call, abstract or traced arrays,
        several processes, timing failed); else with :attr:`Choice.timed` and the measured
        fastest picked.
    """
    arrays = jax.tree.leaves(state) + [x for x in jax.tree.leaves(batch) if not isinstance(x, np.ndarray)]
    if not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in arrays):
        return choice  # lowered from shapes, or called under a transformation: nothing to run
    devices = list(mesh.devices.flat)
    held = device_bytes(state, devices[0])
    budget = memory_budget(options.memory_budget, devices)
    if budget is not None:
        budget -= held  # the caller's state stays on the devices while the copies run

    def timed(path: str) -> Timed:
        placed = jax.device_put(batch, programs[path].input_shardings[0][1])  # as the step takes it
        return Timed(on_mesh(functions[path], mesh), programs[path], lambda: copied(state), placed, held,
                     choice.estimates[path].peak)

    return settle(choice, timed, budget, options.timed_candidates, devices)


def copied(tree: Any) -> Any:
    """A copy of every array in ``tree`` with the same sharding and memory kind (new buffers:
    donating the copy leaves ``tree`` intact)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)


def device_bytes(tree: Any, device: jax.Device) -> int:
    """The bytes of ``tree`` that ``device`` holds in its own memory (host-memory shards not counted)."""
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
               if shard.device == device and getattr(leaf.sharding, "memory_kind", None) not in HOST_KINDS)

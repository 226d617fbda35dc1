"""Every layout of the batch over the processes, trained in one launch (``python -m parallax.launch``).

usage: layouts_run.py OUT_DIR

For each layout of :data:`LAYOUTS` (DP, FSDP, TP, each 2-axis combination of them in either
order, which parallax lays out over the processes by the bytes each axis's collectives move,
user meshes whose axes fall across the processes in other ways, and a pipeline's stage
axis across and within the processes, on an MLP whose blocks are stacked), a small MLP trains
3 steps with AdamW on array data (each process reads the rows its devices hold), and the
aligned layouts once more on an iterable of each process's own part of every batch; last (with
several processes) lists of parts one batch shorter on process 1. Each process writes
OUT_DIR/layouts<index>.json: per run its losses, or the error it raised before training (an
iterable whose parts cannot fit the layout, parts of unequal lengths).

The test imports :func:`run` to train the same runs in one process on 8 devices.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import numpy as np
import optax
from jax.sharding import Mesh

import parallax as px
from parallax.pricing.cost import calibrate
from parallax.sharding.topology import crossing_axes
from tests.models import MLP, StackedMLP, classifier_loss

BATCH, STEPS = 16, 3
FSDP = dict(min_weight_size=0, split="largest")  # the split is not under test: nothing to search


def user_mesh(order, shape, names):
    """A mesh of the 8 devices taken in ``order`` (positions in ``jax.devices()``: process 0's first), of ``shape``."""
    devices = jax.devices()
    return Mesh(np.array([devices[i] for i in order]).reshape(shape), names)


# name -> (strategy, mesh or None): on 2 processes x 4 devices, process 0 has devices 0-3.
LAYOUTS = {
    "dp": (lambda: px.DataParallel(), None),
    "fsdp": (lambda: px.FSDP(**FSDP), None),
    "tp": (lambda: px.TensorParallel(), None),  # the batch whole on every device, of both processes
    "dp2+fsdp4": (lambda: px.combine(px.DataParallel(2), px.FSDP(4, **FSDP)), None),
    "fsdp4+dp2": (lambda: px.combine(px.FSDP(4, **FSDP), px.DataParallel(2)), None),
    "dp2+tp4": (lambda: px.combine(px.DataParallel(2), px.TensorParallel(4)), None),
    "tp4+dp2": (lambda: px.combine(px.TensorParallel(4), px.DataParallel(2)), None),  # every process: all rows
    "fsdp2+tp4": (lambda: px.combine(px.FSDP(2, **FSDP), px.TensorParallel(4)), None),
    "tp4+fsdp2": (lambda: px.combine(px.TensorParallel(4), px.FSDP(2, **FSDP)), None),  # every process: all rows
    # Your own meshes: the FSDP axis inside each process, the tensor axis across them; the tensor axis across
    # them and the FSDP axis inside (each process then holds every row); the devices reversed.
    "mesh fsdp4 in a process": (lambda: px.combine(px.FSDP(4, **FSDP), px.TensorParallel(2)),
                                lambda: user_mesh([0, 4, 1, 5, 2, 6, 3, 7], (4, 2), ("fsdp", "tensor"))),
    "mesh tensor4 across": (lambda: px.combine(px.TensorParallel(4), px.FSDP(2, **FSDP)),
                            lambda: user_mesh(range(8), (4, 2), ("tensor", "fsdp"))),
    "mesh reversed": (lambda: px.FSDP(**FSDP), lambda: user_mesh(range(7, -1, -1), (8,), ("fsdp",))),
    # A pipeline's stages one per process (the stage axis across them), and both stages in each.
    "pp2+fsdp4": (lambda: px.combine(px.PipelineParallel(2), px.FSDP(4, **FSDP)), None),
    "fsdp4+pp2": (lambda: px.combine(px.FSDP(4, **FSDP), px.PipelineParallel(2)), None),
}
STACKED = ("pp2+fsdp4", "fsdp4+pp2")  # trained on StackedMLP, the others on MLP
ITERABLE = ("fsdp", "dp2+fsdp4", "mesh reversed", "tp4+fsdp2", "mesh tensor4 across")  # the last: parts that cannot fit


def batches(index, count, iterable):
    """The global batches as arrays, or each process's own part of every batch as a list."""
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(BATCH * STEPS, 24)).astype(np.float32),
            "y": rng.integers(0, 10, BATCH * STEPS).astype(np.int32)}
    if not iterable:
        return data
    share = BATCH // count
    return [{k: v[step * BATCH + index * share:step * BATCH + (index + 1) * share] for k, v in data.items()}
            for step in range(STEPS)]


def run(out, index=0, count=1):
    """Trains every layout; returns (and writes) this process's record: {run: losses or error}, and
    under ``"crossing"`` the axes whose device groups span processes in each run's mesh, under
    ``"warned"`` the layouts whose mesh was warned about (a tensor or FSDP axis spanning hosts)."""
    record, crossing, warned = {}, {}, []
    for name, (strategy, mesh) in LAYOUTS.items():
        for iterable in (False, True) if name in ITERABLE else (False,):
            model = StackedMLP() if name in STACKED else MLP()
            trainer = px.Trainer(model, optax.adamw(3e-3), classifier_loss, strategy=strategy(),
                                 mesh=mesh() if mesh else None, max_steps=STEPS, batch_size=BATCH,
                                 shuffle=False, progress=False, compile="jit")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    result = trainer.fit(batches(index, count, iterable))
                record[f"{name}, {'iterable' if iterable else 'arrays'}"] = [r["loss"] for r in result.history.train]
                crossing[f"{name}, {'iterable' if iterable else 'arrays'}"] = list(
                    crossing_axes(jax.tree.leaves(result.state.params)[0].sharding.mesh))
                if name == "tp4+fsdp2" and not iterable:  # the summary shows the mesh by host
                    record["summary hosts"] = px.summarize(result.state, find_frozen=False).hosts
                if any("spans hosts" in str(w.message) for w in caught):
                    warned.append(name)
            except ValueError as err:
                record[f"{name}, {'iterable' if iterable else 'arrays'}"] = f"ValueError: {err}"
    record["crossing"], record["warned"] = crossing, sorted(set(warned))
    if count > 1:  # the devices' speeds measured inside a process and between the processes, each on its own
        speeds = calibrate(jax.devices())
        record["calibrated"] = {"key": speeds.key, "inside": sorted(speeds.collectives),
                                "across": sorted(speeds.cross_host or ()),
                                "all-reduce per byte, across / inside": speeds.cross_host["all-reduce"][1]
                                / speeds.collectives["all-reduce"][1]}
    if count > 1:  # each process's list of parts, process 1's one batch shorter, one epoch: refused on both, at start
        parts = batches(index, count, True)[:STEPS - index]
        trainer = px.Trainer(MLP(), optax.adamw(3e-3), classifier_loss, strategy=px.FSDP(**FSDP), epochs=1,
                             progress=False, compile="jit")
        try:
            trainer.fit(parts)
            record["uneven parts"] = "trained"
        except ValueError as err:
            record["uneven parts"] = f"ValueError: {err}"
    with open(os.path.join(out, f"layouts{index}.json"), "w") as stream:
        json.dump(record, stream)
    return record


if __name__ == "__main__":
    processes = px.distributed.initialize()
    run(sys.argv[1], processes.index, processes.count)

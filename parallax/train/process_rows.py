"""Which rows of each global batch a process feeds: those its devices hold, whatever the mesh.

``jax.make_array_from_process_local_data`` builds a global batch from each process's part: the
rows that process's devices hold, in order. Which rows those are follows from the batch's layout
(its ``NamedSharding``) and from which process each device of the mesh belongs to, not from the
process's index alone: with ``combine(TensorParallel(4), FSDP(2))`` over 2 processes of 4 devices
the tensor axis spans the processes, each process holds devices of both FSDP shards, and so needs
every row of the batch. Array data (and a ``grain.MapDataset``) is read row by row, so each process
reads exactly its rows; an iterable yields each process's own part, which fits only where every
process holds an equal share of the batch (:func:`check_parts_fit`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding


def rows_held(sharding: NamedSharding, batch_size: int, process: int | None = None) -> np.ndarray:
    """The rows of a global batch of ``batch_size`` that a process's devices hold, ascending.

    Args:
        sharding: the batch's layout (its leading dim split over the data axes).
        batch_size: the global batch's rows.
        process: the process (this one by default).

    Example:
        >>> sharding = NamedSharding(px.FSDP().make_mesh(), px.FSDP().batch_spec())
        >>> rows_held(sharding, 16).tolist() == list(range(16))  # one process: every row
        True
    """
    process = jax.process_index() if process is None else process
    rows: set[int] = set()
    for device, index in sharding.devices_indices_map((batch_size,)).items():
        if device.process_index == process:
            rows.update(range(*index[0].indices(batch_size)))
    return np.fromiter(sorted(rows), np.int64, len(rows))


def describe_holdings(sharding: NamedSharding, batch_size: int) -> str:
    """``process 0: rows 0-15; process 1: rows 0-15``: the rows of a batch each process holds."""
    def spans(rows: np.ndarray) -> str:
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in np.split(rows, breaks))

    return "; ".join(f"process {p}: rows {spans(rows_held(sharding, batch_size, p))}"
                     for p in range(jax.process_count()))


def parts_fit(sharding: NamedSharding, batch_size: int) -> bool:
    """Whether each process's devices hold an equal share of a batch of ``batch_size`` (an
    iterable's per-process parts then fill it), not e.g. every row of it."""
    processes = jax.process_count()
    return processes == 1 or (batch_size % processes == 0 and all(
        len(rows_held(sharding, batch_size, p)) == batch_size // processes for p in range(processes)))


def check_parts_fit(sharding: NamedSharding, batch_size: int) -> None:
    """Raises ``ValueError`` before training where an iterable's per-process parts cannot fill the
    batch's layout (:func:`parts_fit`): e.g. where the axes that split the batch lie inside each
    process, so that each process's devices hold every row."""
    if parts_fit(sharding, batch_size):
        return
    share = batch_size // jax.process_count()
    mesh = sharding.mesh
    raise ValueError(
        f"The training data is an iterable, which yields each process's own part of every batch ({share} of "
        f"{batch_size} rows), but the mesh {dict(mesh.shape)} lays the batch ({sharding.spec}) out so that the "
        f"processes' devices hold other rows ({describe_holdings(sharding, batch_size)}): the axes that split the "
        "batch do not span the processes. Let them span the processes (leave mesh= out: parallax's own mesh lays "
        "data and FSDP axes across hosts before a tensor axis, in whatever order they were combined; in your own "
        "mesh, give each process a share of their devices), or pass arrays or a grain.MapDataset with "
        "batch_size=, which parallax reads row by row (each process the rows its devices hold).")

"""Exact evaluation over a whole eval set: any size, any number of devices and processes.

A batch whose examples split evenly over the data axes (and over the processes) is fed as
training batches are, each process its own part. Any other batch, typically the last one,
is given whole to every device (with several processes each gets every process's rows),
so that every example counts exactly once whatever the set's size.

Example:
    >>> batches = eval_batches(px.data.ArrayData(x_train[:10], batch_size=4, shuffle=False,
    ...                                          drop_remainder=False), shards=4)
    >>> [(len(batch), split) for batch, split in batches]
    [(4, True), (4, True), (2, False)]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from parallax import _multihost
from parallax.step import metrics as metric_lib
from parallax.train.data import ArrayData, to_global
from parallax.train.process_rows import parts_fit
from parallax.train.sources import as_data


def _rows(batch: Any) -> int:
    return int(np.shape(jax.tree.leaves(batch)[0])[0])


def eval_batches(source: Any, shards: int, sharding: Any = None) -> Iterator[tuple[Any, bool]]:
    """``(batch, split)`` for each eval batch of ``source``: ``split`` is True for this
    process's part of a batch that splits over the ``shards`` data shards (laid out with
    ``sharding``: the rows this process's devices hold), False for a whole batch, the same on
    every process.

    An iterable yields each process's own part of every batch; with several processes
    they must yield the same number of batches (a clear error otherwise), and a batch whose
    parts do not fit ``sharding`` (:func:`parallax.train.process_rows.parts_fit`) is given whole.
    """
    processes = jax.process_count()
    if isinstance(source, ArrayData):
        source.hold(sharding)
        for rows in source.epoch_rows():
            split = len(rows) % shards == 0 and len(rows) % processes == 0
            yield source.take(rows, whole=not split), split
        return
    iterator = iter(source.epoch())
    for number in itertools.count():
        batch = next(iterator, None)
        if processes == 1:
            if batch is None:
                return
            yield batch, _rows(batch) % shards == 0
            continue
        counts = _multihost.gather_counts([batch is not None, 0 if batch is None else _rows(batch)])
        present, rows = counts[:, 0], counts[:, 1]
        if not present.any():
            return
        if not present.all():
            raise ValueError(
                f"The eval data of process {int(np.argmin(present))} ended after {number} batches, while process "
                f"{int(np.argmax(present))}'s yields more. With several processes each must yield its own part of "
                "every eval batch, so the same number of batches."
            )
        total = int(rows.sum())
        if (rows == rows[0]).all() and total % shards == 0 and (sharding is None or parts_fit(sharding, total)):
            yield batch, True
        else:
            yield _multihost.gather_rows(batch, [int(n) for n in rows]), False


def eval_source(eval_data: Any, cfg: Any) -> Any:
    """``eval_data`` as parallax reads it: in order, the last partial batch kept."""
    return as_data(eval_data, cfg.eval_batch_size or cfg.batch_size, shuffle=False, seed=0, drop_remainder=False)


def evaluate(trainer: Any, eval_data: Any, state: Any) -> dict[str, float]:
    """The metric means of ``trainer``'s eval loss over the whole of ``eval_data`` at ``state``."""
    source = eval_source(eval_data, trainer.config)
    totals = None
    for batch, split in eval_batches(source, trainer.strategy.data_shards(trainer.mesh), trainer.batch_sharding):
        if split:
            sums = trainer.eval_step(state, to_global(batch, trainer.batch_sharding))
        else:
            sums = trainer.eval_step_any_size(state, to_global(batch, trainer.replicated))
        totals = sums if totals is None else metric_lib.add_sums(totals, sums)
    if totals is None:
        raise ValueError("The eval data yields no batches.")
    return {name: float(value) for name, value in metric_lib.means(jax.device_get(totals)).items()}

"""Grain datasets and loaders as training data, one documented way per form.

* ``grain.MapDataset`` of **single examples**, with ``batch_size=``: parallax batches it, as it
  does arrays: each epoch's order is a permutation from ``(seed, epoch)`` (``shuffle=True``),
  global batch ``b`` is examples ``b·B … (b+1)·B-1`` of that order, and each process reads only
  its slice of every batch by random access. A checkpoint records the position alone, so a
  resume reads nothing twice and continues on any number of processes or devices.
* ``grain.IterDataset`` or ``grain.DataLoader`` **already batched** by Grain (``.batch(n)`` /
  ``operations=[grain.transforms.Batch(n)]``), each process's loader yielding its own share
  (``grain.sharding.ShardByJaxProcess``, or ``dataset[jax.process_index()::jax.process_count()]``):
  iterated as it is; its iterator's ``get_state()`` is saved in the checkpoint and restored with
  ``set_state()`` (:class:`parallax.train.data.IterableData`), on the same number of processes.

Grain is only imported where the user already has: no Grain object, no import.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

from parallax.train.data import ArrayData


def grain_kind(data: Any) -> str | None:
    """``"map"``, ``"iter"`` or ``"loader"`` for a Grain dataset or loader, else ``None``."""
    grain = sys.modules.get("grain")
    if grain is None:
        return None
    for kind, name in (("map", "MapDataset"), ("iter", "IterDataset"), ("loader", "DataLoader")):
        cls = getattr(grain, name, None)
        if cls is not None and isinstance(data, cls):
            return kind
    return None


def allow_grain_workers() -> None:
    """Lets Grain start worker processes in a script that never parsed absl flags.

    Grain up to at least 0.2.18 reads an absl flag when ``mp_prefetch`` / a ``DataLoader`` with
    workers starts, which raises ``UnparsedFlagAccessError`` outside ``absl.app.run``
    (google/grain#1355). Marking the flags parsed (Grain's own workaround) leaves every flag at
    its default; a script that parses its flags is left as it is.
    """
    from absl import flags  # a dependency of Grain

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class MapData(ArrayData):
    """A ``grain.MapDataset`` of single examples, batched, shuffled and split by parallax.

    Args:
        dataset: the ``grain.MapDataset`` (random access: ``len`` and ``dataset[i]``), each
            element one example (a dict, tuple or array).
        batch_size: the global batch size.
        shuffle: shuffle each epoch (from ``(seed, epoch)``: leave Grain's ``.shuffle`` out).
        seed: the shuffling seed.
        drop_remainder: drop the examples that do not fill a last batch.
    """

    def __init__(self, dataset: Any, batch_size: int | None, *, shuffle: bool = True, seed: int = 0,
                 drop_remainder: bool = True):
        if batch_size is None:
            raise ValueError(
                "A grain.MapDataset is read as single examples, batched by parallax: pass batch_size=... "
                "(the global batch). A dataset Grain already batches (.batch(n)) goes in as "
                "dataset.to_iter_dataset() or a grain.DataLoader.")
        try:
            rows = len(dataset)
        except TypeError:
            raise ValueError("This grain.MapDataset has no length (an infinite .repeat()): leave the repeat out; "
                             "parallax runs epochs itself (epochs= or max_steps=).") from None
        self.dataset = dataset
        self.example = dataset[0]
        leaves = jax.tree.leaves(self.example)
        if not leaves:
            raise ValueError(f"The grain.MapDataset's first element holds no arrays: {self.example!r}.")
        # ArrayData's order, epochs and per-process slices over `rows` examples; `read` fetches them.
        super().__init__(np.zeros((rows, 0), np.int8), batch_size, shuffle=shuffle, seed=seed,
                         drop_remainder=drop_remainder)
        self.arrays = None  # read from the dataset, never held whole

    def peek(self, saved: None = None) -> Any:
        """A batch of this process's shapes and dtypes for planning: the first example repeated
        (read once; a resumed run reads no batch it does not train on)."""
        rows = self.batch_size // jax.process_count()
        return jax.tree.map(lambda leaf: np.stack([np.asarray(leaf)] * rows), self.example)

    def read(self, rows: np.ndarray) -> Any:
        """The examples at ``rows`` of the dataset, stacked into one batch."""
        examples = [self.dataset[int(row)] for row in rows]
        return jax.tree.map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *examples)

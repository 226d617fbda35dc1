"""Feeding batches: arrays or iterables in, global sharded arrays out, resumable by step."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding


def _num_rows(arrays: Any) -> int:
    leaves = jax.tree.leaves(arrays)
    if not leaves:
        raise ValueError("The training data holds no arrays.")
    rows = {int(np.shape(leaf)[0]) for leaf in leaves}
    if len(rows) != 1:
        raise ValueError(f"The data's arrays have different numbers of rows: {sorted(rows)}.")
    return rows.pop()


def is_array_data(data: Any) -> bool:
    """Whether ``data`` is a dataset given as arrays: ``(x, y)`` or ``{"x": ..., ...}``."""
    if isinstance(data, (np.ndarray, jax.Array)):
        return True
    if isinstance(data, (tuple, Mapping)):
        leaves = jax.tree.leaves(data)
        return bool(leaves) and all(isinstance(leaf, (np.ndarray, jax.Array)) and np.ndim(leaf) >= 1
                                    for leaf in leaves)
    return False


class ArrayData:
    """Batches of a dataset held in arrays, shuffled per epoch from a seed.

    The order of epoch ``e`` depends only on ``(seed, e)``, so a run resumed at any step
    sees exactly the batches an uninterrupted run would. With several processes each
    process takes its own slice of every global batch.

    Args:
        arrays: ``(x, y)``, a dict of arrays, or one array; rows are examples.
        batch_size: the global batch size.
        shuffle: shuffle each epoch.
        seed: the shuffling seed.
        drop_remainder: drop the examples that do not fill a last batch (training);
            ``False`` keeps a smaller last batch (evaluation).

    Example:
        >>> data = ArrayData((x_train, y_train), batch_size=128, seed=0)
        >>> [a.shape for a in next(data.iter_from(0))], data.steps_per_epoch
        ([(128, 16), (128,)], 2)
    """

    def __init__(self, arrays: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_remainder: bool = True):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}; pass a positive integer with array data.")
        self.arrays = jax.tree.map(np.asarray, arrays)
        self.rows = _num_rows(self.arrays)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        if drop_remainder and self.rows < batch_size:
            raise ValueError(f"The data has {self.rows} examples, fewer than batch_size={batch_size}.")

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.rows, self.batch_size)
        return full if self.drop_remainder or rest == 0 else full + 1

    @property
    def dropped_per_epoch(self) -> int:
        return self.rows % self.batch_size if self.drop_remainder else 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.rows)

    def take(self, rows: np.ndarray, *, whole: bool = False) -> Any:
        """The examples ``rows`` of one global batch: this process's share of them (an equal
        slice per process), or all of them on every process (``whole``)."""
        processes, index = jax.process_count(), jax.process_index()
        if processes > 1 and not whole:
            if len(rows) % processes:
                raise ValueError(f"A batch of {len(rows)} rows does not split over {processes} processes.")
            share = len(rows) // processes
            rows = rows[index * share:(index + 1) * share]
        return jax.tree.map(lambda a: a[rows], self.arrays)

    def iter_from(self, position: int) -> Iterator[Any]:
        """Batches from global batch number ``position`` on, across epochs, forever."""
        epoch, offset = divmod(position, self.steps_per_epoch)
        while True:
            order = self._order(epoch)
            for index in range(offset, self.steps_per_epoch):
                yield self.take(order[index * self.batch_size:(index + 1) * self.batch_size])
            epoch, offset = epoch + 1, 0

    def epoch(self) -> Iterator[Any]:
        """One pass in order (for evaluation)."""
        return itertools.islice(self.iter_from(0), self.steps_per_epoch)

    def epoch_rows(self) -> Iterator[np.ndarray]:
        """The global rows of each batch of one pass in order (for evaluation)."""
        order = self._order(0)
        for index in range(self.steps_per_epoch):
            yield order[index * self.batch_size:(index + 1) * self.batch_size]


class IterableData:
    """Batches from an iterable (re-iterated each epoch) or a function returning one.

    Resuming skips the batches already consumed, so the iterable must yield the same
    batches in the same order each time it is iterated (a list, a dataset object, or a
    function that rebuilds a seeded pipeline). With several processes each process
    yields its own part of each global batch.
    """

    def __init__(self, data: Iterable | Callable[[], Iterable]):
        self.data = data
        self.steps_per_epoch: int | None = len(data) if hasattr(data, "__len__") else None
        self.dropped_per_epoch = 0

    def _iterate(self) -> Iterator[Any]:
        return iter(self.data() if callable(self.data) and not hasattr(self.data, "__iter__") else self.data)

    def iter_from(self, position: int) -> Iterator[Any]:
        skipped = 0
        while True:
            iterator = self._iterate()
            count = 0
            for batch in iterator:
                count += 1
                if skipped < position:
                    skipped += 1
                    continue
                yield batch
            if count == 0 or iterator is self.data:
                return  # empty, or a one-shot iterator: no further epochs
            if self.steps_per_epoch is None:
                self.steps_per_epoch = count

    def epoch(self) -> Iterator[Any]:
        return self._iterate()


def _not_numeric(leaf: Any) -> str | None:
    """Why a batch leaf cannot be fed to a model, or ``None``."""
    kind = np.asarray(leaf).dtype.kind if isinstance(leaf, (np.ndarray, jax.Array, str, bytes)) else None
    if isinstance(leaf, (str, bytes)) or kind in ("U", "S", "O"):
        return "holds strings or Python objects; encode them as numbers (e.g. integer ids) before training"
    return None


def check_batch_leaves(batch: Any, what: str = "a batch") -> None:
    """Raises ``ValueError`` naming the first leaf of ``batch`` a model cannot take (strings, objects)."""
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        problem = _not_numeric(leaf)
        if problem is not None:
            raise ValueError(f"{what}{jax.tree_util.keystr(key_path)} {problem}.")


def batch_signature(batch: Any, rows: bool = True) -> dict[str, str]:
    """``{leaf path: "dtype(shape)"}`` of a batch (without the leading rows dim if not ``rows``):
    what every process's part must agree on."""
    def described(leaf):
        dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype  # a device array is not copied
        return f"{dtype}{tuple(np.shape(leaf)[0 if rows else 1:])}"

    return {jax.tree_util.keystr(key_path): described(leaf)
            for key_path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]}


def _explain(data: Any, what: str) -> None:
    """Raises a clear error for data that looks like a dataset but is not one parallax reads."""
    if isinstance(data, (tuple, Mapping)):
        items = data.items() if isinstance(data, Mapping) else enumerate(data)
        for key, value in items:
            if isinstance(value, list):
                raise ValueError(f"{what}[{key!r}] is a Python list; make it an array (np.asarray).")
        check_batch_leaves(data, what)
    if isinstance(data, list) and data and isinstance(data[0], Mapping):
        leaves = jax.tree.leaves(data[0])
        if leaves and all(np.ndim(leaf) == 0 for leaf in leaves):
            keys = ", ".join(map(repr, list(data[0])[:4]))
            raise ValueError(
                f"{what} is a list of {len(data)} per-example dicts ({{{keys}}}); pass one dict of arrays "
                "with a leading example dim instead, e.g. {k: np.stack([ex[k] for ex in examples]) for k in "
                "examples[0]}, with batch_size=..."
            )


def as_data(data: Any, batch_size: int | None, *, shuffle: bool, seed: int, drop_remainder: bool,
            what: str = "the training data"):
    """``ArrayData`` for arrays (``batch_size`` required), ``IterableData`` otherwise."""
    if isinstance(data, (ArrayData, IterableData)):
        return data
    if not is_array_data(data):
        _explain(data, what)
    if is_array_data(data):
        check_batch_leaves(data, what)
        if batch_size is None:
            raise ValueError("Array data needs batch_size=...; e.g. fit((x, y), batch_size=128).")
        return ArrayData(data, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder)
    if isinstance(data, Iterable) or callable(data):
        return IterableData(data)
    raise ValueError(
        f"Cannot read batches from a {type(data).__name__}; pass arrays ((x, y) or a dict) with "
        "batch_size, or an iterable of batches."
    )


def to_global(batch: Any, sharding: NamedSharding) -> Any:
    """This process's part of a batch → global arrays laid out with ``sharding``."""
    def put(leaf):
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
            return leaf
        return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))

    return jax.tree.map(put, batch)

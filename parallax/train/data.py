"""Feeding batches: arrays or iterables in, global sharded arrays out, resumable by step."""

from __future__ import annotations

import base64
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from parallax.train.process_rows import rows_held

log = logging.getLogger("parallax")


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
    process takes the rows of every global batch its devices hold (:meth:`hold`).

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
        self.hold(None)
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

    def hold(self, sharding: NamedSharding | None) -> None:
        """Lays each global batch out with ``sharding`` from now on: each process takes the rows its
        devices hold (:func:`parallax.train.process_rows.rows_held`), whatever the mesh; ``None``: an equal
        slice per process, by process index."""
        self._layout: NamedSharding | None = sharding
        self._held: dict[int, np.ndarray] = {}  # batch rows -> the positions this process takes

    def take(self, rows: np.ndarray, *, whole: bool = False) -> Any:
        """The examples ``rows`` of one global batch: this process's part of them (the rows its
        devices hold under :meth:`hold`'s layout), or all of them on every process (``whole``)."""
        processes, index = jax.process_count(), jax.process_index()
        if processes > 1 and not whole and self._layout is not None:
            if len(rows) not in self._held:
                self._held[len(rows)] = rows_held(self._layout, len(rows))
            rows = rows[self._held[len(rows)]]
        elif processes > 1 and not whole:
            if len(rows) % processes:
                raise ValueError(f"A batch of {len(rows)} rows does not split over {processes} processes.")
            share = len(rows) // processes
            rows = rows[index * share:(index + 1) * share]
        return self.read(rows)

    def read(self, rows: np.ndarray) -> Any:
        """The examples at ``rows``, as one batch."""
        return jax.tree.map(lambda a: a[rows], self.arrays)

    def peek(self, saved: None = None) -> Any:
        """A batch of this process's shapes and dtypes (the first), for planning."""
        return self.take(self._order(0)[:self.batch_size])

    def state(self) -> None:
        """Nothing beyond the position: the order follows from ``(seed, epoch)``."""
        return None

    def close(self) -> None:
        """Nothing to release."""

    def iter_from(self, position: int, saved: None = None) -> Iterator[Any]:
        """Batches from global batch number ``position`` on, across epochs, forever (no state
        beyond the position: ``saved`` is always ``None``)."""
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

    An iterator with ``get_state()`` / ``set_state()`` (Grain's, or your own) is resumed from
    the state saved with the checkpoint: nothing is re-read. Any other iterable is resumed by
    re-reading and skipping the batches already consumed (with a warning), so it must yield
    the same batches in the same order each time (a list, a dataset object, or a function that
    rebuilds a seeded pipeline). A one-shot iterator (a generator) is read once, nothing lost.
    With several processes each process yields its own part of each global batch.
    """

    def __init__(self, data: Iterable | Callable[[], Iterable]):
        self.data = data
        self.steps_per_epoch: int | None = len(data) if hasattr(data, "__len__") else None
        self.dropped_per_epoch = 0
        self.one_shot = isinstance(data, Iterator)
        self.kind = "an iterable"  # what the data is, in errors ("a grain.IterDataset")
        self._live: Iterator | None = None  # the iterator being read, once one is
        self._peeked: list = []  # batches read from _live by peek(), handed out again first
        self._state_before_peek: dict | None = None
        self._started_from: dict | None = None  # the saved state _live started from
        self._untouched = False  # nothing handed out of _live yet (peek() keeps what it read)
        self._epoch = 0

    def _iterate(self) -> Iterator[Any]:
        return iter(self.data() if callable(self.data) and not hasattr(self.data, "__iter__") else self.data)

    def peek(self, saved: dict | None = None) -> Any:
        """The first batch (``None`` if there is none), from the iterator state ``saved`` if
        given, without losing it: the next :meth:`iter_from` from there hands it out again."""
        if self._live is None or saved != self._started_from:
            self._start(saved)
        if not self._peeked:
            self._state_before_peek = self._iterator_state()
            batch = next(self._live, None)
            if batch is None:
                return None
            self._peeked.append(batch)
        return self._peeked[0]

    @property
    def stateful(self) -> bool:
        """Whether the iterator being read saves its position (``get_state`` / ``set_state``)."""
        return all(callable(getattr(self._live, name, None)) for name in ("get_state", "set_state"))

    def _iterator_state(self) -> dict | None:
        return encode_state(self._live.get_state()) if self.stateful else None

    def state(self) -> dict | None:
        """Where the iterator stands after the batches handed out so far (``None``: it keeps no
        state, resumed by skipping); saved with each checkpoint."""
        if not self.stateful:
            return None
        iterator = self._state_before_peek if self._peeked else self._iterator_state()
        return {"epoch": self._epoch, "iterator": iterator}

    def _start(self, saved: dict | None) -> None:
        """Reads from a fresh iterator (the one-shot iterator itself), at ``saved``'s state if given."""
        if self._live is not None and not self.one_shot:
            self.close()
        if self._live is None or not self.one_shot:
            self._live, self._peeked, self._epoch = self._iterate(), [], 0
        self._started_from, self._untouched = saved, True
        if saved is not None:
            if not self.stateful:
                raise ValueError("The checkpoint saved the data iterator's state, but this run's training data "
                                 f"({type(self.data).__name__}) has no set_state(): resume with the same kind of data.")
            self._epoch = int(saved["epoch"])
            self._live.set_state(decode_state(saved["iterator"]))

    def iter_from(self, position: int, saved: dict | None = None) -> Iterator[Any]:
        """Batches from global batch ``position`` on, across epochs; from the iterator state
        ``saved`` (:meth:`state`) instead of skipping, where there is one."""
        if self._live is None or not self._untouched or saved != self._started_from or (position and saved is None):
            self._start(saved)
        self._untouched = False
        skip = 0 if saved is not None else position
        if skip and not self.one_shot:
            why = ("the checkpoint holds no position of its iterator" if self.stateful else
                   "it keeps no state")
            log.warning("Resuming %s (%s): re-reading and skipping the %d batches already trained on. A Grain "
                        "IterDataset or DataLoader (get_state()/set_state()), or a grain.MapDataset with batch_size=, "
                        "resumes without re-reading.", self.kind, why, skip)
        mid_epoch = saved is not None  # a resumed epoch may have nothing left: the next one follows
        while True:
            count = 0
            for batch in self._batches():
                count += 1
                if skip:
                    skip -= 1
                    continue
                yield batch
            if self.one_shot or (count == 0 and not mid_epoch):
                return  # a one-shot iterator has no further epochs; an empty iterable ends
            if self.steps_per_epoch is None and not mid_epoch:
                self.steps_per_epoch = count
            mid_epoch, epoch = False, self._epoch + 1
            self.close()
            self._live, self._epoch = self._iterate(), epoch

    def _batches(self) -> Iterator[Any]:
        while self._peeked:
            yield self._peeked.pop(0)
        yield from self._live

    def epoch(self) -> Iterator[Any]:
        return self._iterate()

    def close(self) -> None:
        """Ends the iterator being read (a Grain loader's worker processes stop)."""
        live, self._live = self._live, None
        for part in (live, getattr(live, "_iterator", None)):  # a grain.DataLoaderIterator wraps its pipeline
            close = getattr(part, "close", None)
            if callable(close):
                close()


def encode_state(state: Any) -> dict:
    """An iterator's ``get_state()`` as JSON: Grain's loaders give bytes, its datasets dicts."""
    if isinstance(state, bytes):
        return {"bytes": base64.b64encode(state).decode()}
    return {"json": state}


def decode_state(saved: dict) -> Any:
    return base64.b64decode(saved["bytes"]) if "bytes" in saved else saved["json"]


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


def to_global(batch: Any, sharding: NamedSharding) -> Any:
    """This process's part of a batch → global arrays laid out with ``sharding``."""
    def put(leaf):
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
            return leaf
        return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))

    return jax.tree.map(put, batch)

"""What ``fit`` and ``evaluate`` read data from, and the errors for data they cannot read.

* arrays (``(x, y)``, a dict, one array) with ``batch_size=``: :class:`~parallax.train.data.ArrayData`;
* a ``grain.MapDataset`` of single examples with ``batch_size=``: :class:`~parallax.train.grain_data.MapData`;
* a ``grain.IterDataset`` / ``grain.DataLoader`` of batches, or any iterable of batches (a list,
  a generator, a function returning one): :class:`~parallax.train.data.IterableData`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from parallax.train.data import ArrayData, IterableData, check_batch_leaves, is_array_data
from parallax.train.grain_data import MapData, allow_grain_workers, grain_kind
from parallax.train.process_rows import check_parts_fit, parts_fit

log = logging.getLogger("parallax")
_FORMS = {"map": "a grain.MapDataset", "iter": "a grain.IterDataset", "loader": "a grain.DataLoader"}


def as_data(data: Any, batch_size: int | None, *, shuffle: bool, seed: int, drop_remainder: bool,
            what: str = "the training data"):
    """The reader of ``data``: arrays and a ``grain.MapDataset`` need ``batch_size``; an
    iterable yields batches.

    Example:
        >>> source = as_data((x_train, y_train), 64, shuffle=False, seed=0, drop_remainder=True)
        >>> type(source).__name__, source.steps_per_epoch
        ('ArrayData', 4)
    """
    if isinstance(data, (ArrayData, IterableData)):
        return data
    kind = grain_kind(data)
    if kind == "map":
        return _warn_dropped(MapData(data, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder))
    if not is_array_data(data):
        _explain(data, what)
    if is_array_data(data):
        check_batch_leaves(data, what)
        if batch_size is None:
            raise ValueError("Array data needs batch_size=...; e.g. fit((x, y), batch_size=128).")
        return _warn_dropped(ArrayData(data, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder))
    if kind is not None:
        allow_grain_workers()
    if isinstance(data, Iterable) or callable(data):
        source = IterableData(data)
        source.kind = _FORMS.get(kind, "an iterable")
        return source
    raise ValueError(
        f"Cannot read batches from a {type(data).__name__}; pass arrays ((x, y) or a dict) with "
        "batch_size, a grain.MapDataset with batch_size, or an iterable of batches."
    )


def _warn_dropped(source: ArrayData) -> ArrayData:
    if source.dropped_per_epoch:
        log.warning("Each epoch drops the last %d examples, which do not fill a batch of %d.",
                    source.dropped_per_epoch, source.batch_size)
    return source


def epoch_steps(source: Any, epochs: int | None) -> int:
    """The steps of ``epochs`` (1 by default) passes over ``source``; data without a length needs ``max_steps``."""
    if source.steps_per_epoch is None:
        raise ValueError("The training data has no len(); pass max_steps=... (or data with a length).")
    return (epochs or 1) * source.steps_per_epoch


def _explain(data: Any, what: str) -> None:
    """Raises a clear error for data that looks like a dataset but is not one parallax reads."""
    if isinstance(data, (tuple, Mapping)):
        items = data.items() if isinstance(data, Mapping) else enumerate(data)
        for key, value in items:
            if isinstance(value, list):
                raise ValueError(f"{what}[{key!r}] is a Python list; make it an array (np.asarray).")
        check_batch_leaves(data, what)
    if isinstance(data, list) and data and isinstance(data[0], Mapping) and _looks_like_one_example(data[0]):
        keys = ", ".join(map(repr, list(data[0])[:4]))
        raise ValueError(
            f"{what} is a list of {len(data)} per-example dicts ({{{keys}}}); pass one dict of arrays "
            "with a leading example dim instead, e.g. {k: np.stack([ex[k] for ex in examples]) for k in "
            "examples[0]}, with batch_size=..."
        )


def _looks_like_one_example(element: Any) -> bool:
    """A dict/tuple whose leaves have no common leading dim (a scalar among them, or different
    first dims) is one example, not a batch."""
    leaves = jax.tree.leaves(element)
    if not leaves:
        return False
    if any(np.ndim(leaf) == 0 for leaf in leaves):
        return True
    return len({np.shape(leaf)[0] for leaf in leaves}) > 1


def check_first_batch(first: Any, source: Any, batch_size: int | None) -> None:
    """Raises a clear error when an iterable's first element is not a batch parallax can read:
    a list of example dicts, single examples, or batches of another size than ``batch_size``."""
    if not isinstance(source, IterableData):
        return
    form = getattr(source, "kind", "an iterable")
    if isinstance(first, list) and first and isinstance(first[0], (Mapping, tuple)):
        raise ValueError(
            f"Each element of the training data ({form}) is a Python list of {len(first)} "
            f"{type(first[0]).__name__}s, where parallax reads a batch: a dict or tuple of arrays with a leading "
            "example dim. Stack each list, e.g. {k: np.stack([ex[k] for ex in examples]) for k in examples[0]}.")
    leaves = jax.tree.leaves(first)
    processes = jax.process_count()
    wanted = None if batch_size is None else batch_size // processes
    single = _looks_like_one_example(first)
    local = None if single or not leaves else int(np.shape(leaves[0])[0])
    if not single and (wanted is None or local == wanted):
        return
    what = "single examples" if single else f"batches of {local} examples"
    fix = {"a grain.IterDataset": "batch it in Grain (dataset.batch(n)), or pass the grain.MapDataset it comes from "
                                "with batch_size= (parallax batches it)",
           "a grain.DataLoader": "add operations=[grain.transforms.Batch(n)] to the loader, or pass a "
                               "grain.MapDataset with batch_size= (parallax batches it)"}.get(
        form, "yield batches (dicts or tuples of arrays with a leading example dim), or pass arrays with batch_size=")
    expected = "" if wanted is None else f" of batch_size={batch_size} ({wanted} per process)"
    raise ValueError(f"The training data ({form}) yields {what}, where parallax reads each element as a "
                     f"batch{expected}. {fix[0].upper()}{fix[1:]}.")


def layouts_it_fits(source: Any, batch_size: int) -> Callable[[Any, Any], bool] | None:
    """For an iterable of each process's parts: whether a mesh and strategy lay the batch out so that
    they fit (:func:`parallax.train.process_rows.parts_fit`); ``None`` for data read row by row (any mesh)."""
    if isinstance(source, ArrayData):
        return None
    return lambda mesh, strategy: parts_fit(NamedSharding(mesh, strategy.batch_spec()), batch_size)


def lay_out(source: Any, sharding: Any, batch_size: int) -> None:
    """Each process feeds the rows of every batch its devices hold under ``sharding``, whatever the
    mesh: array data and a ``grain.MapDataset`` read exactly those rows; an iterable's per-process
    parts must fit the layout (a ``ValueError`` before training otherwise:
    :func:`parallax.train.process_rows.check_parts_fit`)."""
    if isinstance(source, ArrayData):
        source.hold(sharding)
    else:
        check_parts_fit(sharding, batch_size)

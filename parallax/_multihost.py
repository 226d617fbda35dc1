"""Agreement between the processes of a multi-process run (``jax.distributed``).

Anything that decides what a process compiles or when it stops must be the same on every
process, or the processes enter different collectives and wait for each other forever.
:func:`agree` hands process 0's value to all; :func:`check_same` raises the same clear error
on every process when a value differs between them. Both are collectives (every process
must call them, in the same order); in a single process they cost nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def is_primary() -> bool:
    """Whether this is process 0, the one that prints, logs to files and decides."""
    return jax.process_index() == 0


def gather_text(text: str) -> list[str]:
    """Every process's ``text``, in process order."""
    if jax.process_count() == 1:
        return [text]
    from jax.experimental import multihost_utils  # needs a started backend; imported when used

    data = np.frombuffer(text.encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int32))).reshape(-1)
    size = 1 << max(6, int(lengths.max()).bit_length())  # a few sizes, so a few compiled gathers
    padded = np.zeros(size, np.uint8)
    padded[:len(data)] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), size)
    return [bytes(row[:length]).decode() for row, length in zip(rows, lengths)]


def agree(value: Any) -> Any:
    """Process 0's ``value`` (anything JSON can hold), on every process."""
    if jax.process_count() == 1:
        return value
    return json.loads(gather_text(json.dumps(value))[0])


def check_same(value: Any, what: str, fix: str) -> None:
    """Raises ``ValueError`` on every process when ``value`` (JSON) is not the same on all of them.

    Args:
        value: this process's value.
        what: what the value is, for the message (e.g. ``"the first training batch"``).
        fix: what to do about it.
    """
    if jax.process_count() == 1:
        return
    texts = gather_text(json.dumps(value, sort_keys=True))
    differing = [index for index, text in enumerate(texts) if text != texts[0]]
    if differing:
        other = differing[0]
        raise ValueError(
            f"{what} differs between processes: process 0 has {texts[0][:300]}, process {other} has "
            f"{texts[other][:300]}. Every process must agree, or they wait for each other forever; {fix}"
        )


def gather_counts(values: Sequence[int]) -> np.ndarray:
    """Every process's ``values`` (small ints), one row per process."""
    if jax.process_count() == 1:
        return np.asarray([values], np.int64)
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(values, np.int32))
    return np.asarray(gathered, np.int64).reshape(jax.process_count(), len(values))


def gather_rows(tree: Any, rows: Sequence[int]) -> Any:
    """Every process's rows of ``tree`` (arrays of the same trailing shapes and dtypes everywhere;
    ``rows[i]`` of them on process ``i``), concatenated in process order, on every process.

    The bytes travel as they are, so every dtype arrives exact (int64 and float64 included).
    """
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    most = max(int(n) for n in rows)

    def as_bytes(leaf):
        raw = np.ascontiguousarray(leaf).reshape(len(leaf), -1).view(np.uint8)
        return np.concatenate([raw, np.zeros((most - len(leaf), raw.shape[1]), np.uint8)])

    def back(gathered, leaf):
        leaf = np.asarray(leaf)
        raw = np.concatenate([np.asarray(gathered)[i, :n] for i, n in enumerate(rows)])
        return np.ascontiguousarray(raw).view(leaf.dtype).reshape((-1,) + leaf.shape[1:])

    gathered = multihost_utils.process_allgather(jax.tree.map(as_bytes, tree))
    return jax.tree.map(back, gathered, tree)

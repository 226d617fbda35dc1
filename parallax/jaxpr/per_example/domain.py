"""The abstract values a loss's jaxpr is interpreted over (see :mod:`parallax.jaxpr.per_example`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


class NotPerExample(Exception):
    """The trace shows (or cannot rule out) that the loss mixes examples.

    Attributes:
        where: the source of the equation it was found at (``file:line:column (function)``),
            where the trace says.
    """

    where: str | None = None


@dataclasses.dataclass(frozen=True)
class Fixed:
    """Does not read the batch; constant along ``uniform`` dims; every element ``value`` if known."""

    uniform: frozenset = frozenset()
    value: float | None = None


@dataclasses.dataclass(frozen=True)
class PerExample:
    """Dim ``dim`` runs over the examples, ``block`` consecutive indices per example; slice ``i``
    reads only example ``i // block``."""

    dim: int
    block: int = 1


@dataclasses.dataclass(frozen=True)
class BatchSum:
    """``Σ_k scales[k] · Σ_i f_k(example_i) + Σ_j offsets[j] · c_j``, each ``c_j`` a value that
    does not read the batch; a ``None`` factor is not a known number."""

    scales: tuple = (1.0,)
    offsets: tuple = ()


@dataclasses.dataclass(frozen=True)
class Random:
    """Reads the step's random key."""


Abstract = Any  # one of Fixed, PerExample, BatchSum, Random


def fixed_from_array(array: Any) -> Fixed:
    """A constant the trace captured or a literal it reads: which dims it is constant along
    (``np.broadcast_to(np.arange(T), (B, T))`` is, along the batch), and its one value if it has one."""
    array = np.asarray(array)
    if array.size == 0 or array.size > 1 << 20:
        return Fixed()
    uniform = frozenset(d for d in range(array.ndim) if np.array_equal(array, np.take(array, [0], axis=d).repeat(
        array.shape[d], axis=d)))
    flat = array.reshape(-1)
    return Fixed(uniform, float(flat[0]) if len(uniform) == array.ndim and np.isreal(flat[0]) else None)


def kind_name(value: Abstract) -> str:
    """How an error names an abstract value."""
    if isinstance(value, Fixed):
        return "independent of the batch"
    if isinstance(value, PerExample):
        return "per-example values"
    if isinstance(value, BatchSum):
        return "a sum over the batch"
    return "random"


def join(a: Abstract, b: Abstract) -> Abstract:
    """One abstract value for two paths (a loop's carry, a ``cond``'s branches)."""
    if a == b:
        return a
    if isinstance(a, Random) or isinstance(b, Random):
        return Random()
    if isinstance(a, Fixed) and isinstance(b, Fixed):
        return Fixed(a.uniform & b.uniform, a.value if a.value == b.value else None)
    if (isinstance(a, BatchSum) and isinstance(b, BatchSum) and len(a.scales) == len(b.scales)
            and len(a.offsets) == len(b.offsets)):
        return BatchSum(*(tuple(x if x == y else None for x, y in zip(p, q))
                          for p, q in ((a.scales, b.scales), (a.offsets, b.offsets))))
    raise NotPerExample(f"a loop or branch gives {kind_name(a)} on one path and {kind_name(b)} on another")

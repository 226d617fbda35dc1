"""A model's own logical sharding constraints, kept to the mesh axes they may name here.

Models written for a particular mesh (MaxText-style code, ``nn.with_logical_constraint``,
``DenseGeneral`` with logical axis names) map logical names to mesh axes through the
``nn.logical_axis_rules(...)`` context their authors train in. Under parallax two things
break that: the rules may name axes this strategy's mesh does not have (``'fsdp'`` on a
data-parallel mesh), and inside ``shard_map`` the data axes are manual, which a sharding
constraint may not name. :func:`constraints_within` re-enters the rules with every other
axis removed, so the constraint keeps what it can still say and drops the rest (the
layout of the data axes inside ``shard_map`` is fixed by ``shard_map`` itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import flax.linen as nn


def _keep(entry: Any, axes: frozenset[str]) -> Any:
    if entry is None or isinstance(entry, str):
        return entry if entry in axes else None
    kept = tuple(a for a in entry if a in axes)
    return kept if len(kept) > 1 else (kept[0] if kept else None)


@contextlib.contextmanager
def constraints_within(axes: Iterable[str]) -> Iterator[None]:
    """Within this context, logical axis rules map only onto ``axes``.

    Args:
        axes: the mesh axes a sharding constraint may name here (the mesh's automatic axes).

    Example:
        >>> import flax.linen as nn
        >>> with nn.logical_axis_rules([("batch", "fsdp"), ("embed", "tensor")]):
        ...     with constraints_within({"tensor"}):
        ...         print(nn.get_logical_axis_rules())
        (('batch', None), ('embed', 'tensor'))
    """
    rules = nn.get_logical_axis_rules()
    if not rules:
        yield
        return
    allowed = frozenset(axes)
    with nn.logical_axis_rules(tuple((name, _keep(entry, allowed)) for name, entry in rules)):
        yield

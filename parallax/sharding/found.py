"""What planning finds in the traced loss, kept beside the strategy the user gave (never in it).

A strategy holds what its user said (``px.FSDP(min_weight_size=0)``); some parts also place params by what
only the model's computation shows: the dims a ``scan`` steps over (FSDP, and context parallelism's
``shard_params``), a derived tensor-parallel layout, the experts' params, a pipeline's stacked or listed
blocks. Each such part finds its record when the state is planned (``part.find_in(computation)``); the
state's plan holds them all as one :class:`Found` (:attr:`parallax.StatePlan.found`), by the part's axis,
and hands each part its own where it places params, says why one stays whole or reports its layout.

Example:
    >>> plan = px.plan_state(model, optax.sgd(0.1), batch, strategy=px.TensorParallel(2), loss_fn=loss_fn,
    ...                      mesh=px.TensorParallel(2).make_mesh(jax.devices()[:2]))
    >>> plan.strategy == px.TensorParallel(2), sorted(plan.found.records)
    (True, ['tensor'])
    >>> plan.found["tensor"].split_fraction > 0.9
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Found:
    """The records the parts of one strategy found in its traced loss, by axis.

    Attributes:
        records: each part's record, by its mesh axis (a part that found nothing, or placed without the
            computation, has none).
    """

    records: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def of(self, part: Any) -> Any:
        """``part``'s record, or ``None`` where it has none."""
        return self.records.get(part.axis)

    def __getitem__(self, axis: str) -> Any:
        if axis not in self.records:
            raise KeyError(f"No part on axis {axis!r} found anything in the traced loss (the records are on "
                           f"{sorted(self.records)}).")
        return self.records[axis]

    def given(self, part: Any) -> dict[str, Any]:
        """The keyword ``part``'s methods take its record by (``{"found": record}``; nothing where it has none,
        so a part of the user's own, which finds nothing, is called as its protocol says)."""
        record = self.of(part)
        return {} if record is None else {"found": record}


NOTHING = Found()  # what a strategy placed from shapes alone has found

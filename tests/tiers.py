"""What each comparison grid keeps in the core tier (``make test``) and why the rest is wide (tests/README.md).

The core tier compares every part and hybrid against one device at least once on every model family a grid
covers, on each compile path it runs, with AdamW (the optimizer that amplifies a difference), plus the SGD cases
that show a gradient off by a constant factor (Adam is blind to scale) and the cells only SGD covers; the wide tier
(``make test-all``) runs the rest of the grid.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

SECOND_OPTIMIZER = ("the grid's other cases (the second optimizer, another model of a family): the core tier "
                    "compares this part and compile path on this family already (tests/tiers.py)")


def cases(grid: Sequence, core: Iterable, why: str = SECOND_OPTIMIZER) -> list:
    """``grid`` as ``pytest.param``s, each with its values joined by ``-`` as its id: the cases in ``core`` in the
    core tier (their file's), the others marked wide because ``why``. A core case missing from the grid is an error
    (a renamed case must not leave the core)."""
    core = list(core)
    missing = [case for case in core if case not in grid]
    if missing:
        raise ValueError(f"core cases not in the grid: {missing}")
    values = [case if isinstance(case, tuple) else (case,) for case in grid]
    return [pytest.param(*case, marks=[] if original in core else [pytest.mark.wide(why)],
                         id="-".join(map(str, case)))
            for original, case in zip(grid, values)]

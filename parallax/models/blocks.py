"""A model's repeated blocks: the module classes ``remat`` would name, read from the model alone."""

from __future__ import annotations

import collections
from typing import Any

from parallax.models.adapter import LossFn


def repeated_blocks(model: Any, example_batch: Any, loss_fn: LossFn | None = None) -> tuple[str, ...]:
    """Module classes a model runs at two or more places, that hold modules themselves and are
    not all inside another such class (its repeated blocks): the candidates for ``remat``. A
    linen model is traced from shapes (its calls recorded); an NNX module (or a function that
    builds one, from shapes) is walked.

    Example:
        >>> repeated_blocks(model, batch, loss_fn)  # an MLP: its Dense layers hold no modules
        ()
    """
    from parallax.models import adapter_for

    calls = adapter_for(model).module_calls(example_batch, loss_fn)
    paths: dict[str, set[tuple]] = collections.defaultdict(set)
    for name, path in calls:
        if any(len(other) > len(path) and other[:len(path)] == path for _, other in calls):  # holds modules
            paths[name].add(path)
    repeated = {name: found for name, found in paths.items() if len(found) > 1}

    def inside_another(path: tuple, name: str) -> bool:
        return any(len(outer) < len(path) and path[:len(outer)] == outer
                   for other, found in repeated.items() if other != name for outer in found)

    return tuple(sorted(name for name, found in repeated.items()
                        if not all(inside_another(path, name) for path in found)))


def listed_siblings(model: Any, example_batch: Any, loss_fn: LossFn | None = None) -> tuple[str, ...]:
    """Module classes a model runs at two or more places under one parent module, each holding
    modules or params of its own: a list of experts (``modules=`` names one of them), those whose
    path says "expert" first.

    Example:
        >>> listed_siblings(model, batch, loss_fn)  # an MLP: its Dense layers hold no modules
        ()
    """
    from parallax.models import adapter_for

    calls = adapter_for(model).module_calls(example_batch, loss_fn)
    siblings: dict[tuple[str, tuple], int] = collections.Counter(
        (name, path[:-1]) for name, path in calls
        if any(len(other) > len(path) and other[:len(path)] == path for _, other in calls))
    found = dict.fromkeys(name for (name, _), count in siblings.items() if count > 1)
    return tuple(sorted(found, key=lambda name: ("expert" not in name.lower(), name)))

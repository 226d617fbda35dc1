"""A model's repeated blocks: the module classes ``remat`` would name, read from the model alone."""

from __future__ import annotations

import collections
import math
from typing import Any

from parallax.models.adapter import LossFn


def repeated_blocks(model: Any, example_batch: Any, loss_fn: LossFn | None = None,
                    calls: set | None = None) -> tuple[str, ...]:
    """Module classes a model runs at two or more places, that hold modules themselves and are
    not all inside another such class (its repeated blocks): the candidates for ``remat``. A
    linen model is traced from shapes (its calls recorded); an NNX module (or a function that
    builds one, from shapes) is walked (``calls``: :func:`module_calls`' result, where already read).

    Example:
        >>> repeated_blocks(model, batch, loss_fn)  # an MLP: its Dense layers hold no modules
        ()
    """
    calls = module_calls(model, example_batch, loss_fn) if calls is None else calls
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
    return tuple(_siblings(module_calls(model, example_batch, loss_fn)))


def listed_experts(model: Any, example_batch: Any, loss_fn: LossFn | None = None,
                   calls: set | None = None) -> tuple[str, int] | None:
    """The class of a model's experts kept in a list, and how many each list holds (the greatest
    common divisor where lists differ): the first :func:`listed_siblings` class whose name, or the
    path of one of its modules, says "expert" (``None``: none does). What ``strategy="auto"``
    offers ``ExpertParallel(modules=...)`` for.

    Example:
        >>> listed_experts(model, batch, loss_fn) is None  # an MLP
        True
    """
    for name, parents in _siblings(module_calls(model, example_batch, loss_fn) if calls is None else calls).items():
        if "expert" in name.lower() or any("expert" in "/".join(map(str, path)).lower()
                                           for paths in parents.values() for path in paths):
            return name, math.gcd(*(len(paths) for paths in parents.values()))
    return None


def module_calls(model: Any, example_batch: Any, loss_fn: LossFn | None = None) -> set[tuple[str, tuple]]:
    """``(class name, path)`` of every module the model runs, traced from shapes (nothing allocated)."""
    from parallax.models import adapter_for

    return adapter_for(model).module_calls(example_batch, loss_fn)


def _siblings(calls: set[tuple[str, tuple]]) -> dict[str, dict[tuple, list[tuple]]]:
    """Each listed sibling class (as :func:`listed_siblings` orders them): the parent paths it is
    listed under, with the paths of the modules listed there."""
    siblings: dict[tuple[str, tuple], list[tuple]] = collections.defaultdict(list)
    for name, path in calls:
        if any(len(other) > len(path) and other[:len(path)] == path for _, other in calls):
            siblings[name, path[:-1]].append(path)
    found: dict[str, dict[tuple, list[tuple]]] = collections.defaultdict(dict)
    for (name, parent), paths in siblings.items():
        if len(paths) > 1:
            found[name][parent] = paths
    return {name: found[name] for name in sorted(found, key=lambda name: ("expert" not in name.lower(), name))}

"""Activation rematerialisation of chosen NNX module classes, without changing the model.

:func:`rematerialise` gives this step's merged copy of a module, for each submodule of a named
class, a subclass whose ``__call__`` runs under ``nnx.remat`` with ``remat``'s checkpoint policy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from flax import nnx

from parallax.models.remat_policy import array_arguments, remat_parts


def rematerialise(module: nnx.Module, remat: Sequence) -> None:
    """Calls of the submodules whose class is (or is named) one of ``remat``'s targets run under
    ``nnx.remat`` (with its checkpoint policy): their activations are recomputed in the backward
    pass. Only this step's merged copy of the module changes class; the user's module and its
    graph definition do not."""
    targets, policy = remat_parts(remat)
    if not targets:
        return
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module) and any(
                (isinstance(t, str) and type(node).__name__ == t) or (isinstance(t, type) and isinstance(node, t))
                for t in targets):
            object.__setattr__(node, "__class__", _rematerialised(type(node), policy))


@functools.cache
def _rematerialised(cls: type, policy: Any = None) -> type:
    """``cls`` with its ``__call__`` under ``nnx.remat`` with ``policy`` (array arguments traced,
    the rest static)."""

    def __call__(self, *args, **kwargs):
        arrays, rebuild = array_arguments(args, kwargs)

        def body(module, *values):
            call_args, call_kwargs = rebuild(values)
            return cls.__call__(module, *call_args, **call_kwargs)

        return nnx.remat(body, policy=policy)(self, *arrays)

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})

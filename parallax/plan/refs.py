"""``module:attr`` references to a model, optimizer, batch or loss, for the CLI and for subprocesses."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import optax

OPTIMIZERS = {"adamw": lambda: optax.adamw(1e-3), "adam": lambda: optax.adam(1e-3), "sgd": lambda: optax.sgd(1e-2)}


def load(ref: str, what: str) -> Any:
    """The object ``ref`` (``"package.module:name"``, or ``"package.module:obj.attr"``) names."""
    module_name, _, attr = str(ref).partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what}={ref!r}; name it as 'package.module:name' (an importable module and an attribute).")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what}={ref!r}: cannot import {module_name!r} ({err}). Run from the directory that "
                         "holds it, or put it on PYTHONPATH.") from None
    for name in attr.split("."):
        if not hasattr(found, name):
            raise ValueError(f"{what}={ref!r}: {module_name!r} has no attribute {attr!r}.")
        found = getattr(found, name)
    return found


def _called(obj: Any) -> Any:
    return obj() if inspect.isfunction(obj) else obj


def resolve(kind: str, value: Any) -> Any:
    """A CLI or subprocess argument as the object ``plan`` takes; objects pass through.

    - ``model``: a model object, or a function returning one (a function that builds an NNX
      module is kept as it is: parallax plans it from shapes, never allocating it).
    - ``optimizer``: ``adamw`` / ``adam`` / ``sgd`` (learning rate irrelevant to a plan), an
      optax transformation, or a function returning one.
    - ``batch``: arrays or ``jax.ShapeDtypeStruct`` s, or a function returning them.
    - ``loss_fn``: the loss function itself.
    """
    if not isinstance(value, str):
        return value
    if kind == "optimizer" and value.lower() in OPTIMIZERS:
        return OPTIMIZERS[value.lower()]()
    found = load(value, kind)
    if kind == "loss_fn":
        return found
    if kind == "model" and inspect.isfunction(found):
        from flax import nnx

        try:
            if isinstance(nnx.eval_shape(found), nnx.Module):
                return found  # builds an NNX module: planned from shapes
        except Exception:
            pass
    return _called(found)

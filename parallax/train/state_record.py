"""What a checkpoint records about the state, and how a saved record differs from this run's.

The record is the shape and dtype of every array (:func:`signature`) and the tree structure
of each part (:func:`structure`; the optimizer state's includes optax's state types, e.g.
``ScaleByAdamState``), compared before any array is read.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import numpy as np

from parallax._tree import path_str

_STATE_TYPE = re.compile(r"CustomNode\((?:namedtuple\[(\w+)\]|(\w+)\[)")


def state_arrays(state: Any) -> dict:
    """The savable part of a :class:`parallax.TrainState`: its array fields, by name."""
    return {field.name: getattr(state, field.name) for field in dataclasses.fields(state)
            if field.metadata.get("pytree_node", True)}


def signature(arrays: Any) -> dict[str, list]:
    """``{path: [shape, dtype]}`` of every array leaf."""
    out = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        out[path_str(key_path)] = [list(np.shape(leaf)), str(leaf.dtype)]
    return out


def structure(arrays: dict) -> dict[str, str]:
    """The tree structure of each part of the state (optimizer state types included)."""
    return {name: str(jax.tree.structure(value)) for name, value in arrays.items()}


def differences(saved: dict, expected: dict, limit: int = 5) -> list[str]:
    order = {"params": 0, "model_state": 1, "step": 2, "rng": 2, "opt_state": 3}
    lines = []
    for path in sorted(set(saved) | set(expected), key=lambda p: (order.get(p.split("/")[0], 4), p)):
        if path not in expected:
            lines.append(f"{path} is in the checkpoint but not in this model")
        elif path not in saved:
            lines.append(f"{path} is in this model but not in the checkpoint")
        elif saved[path] != expected[path]:
            lines.append(f"{path} is {saved[path][1]}{tuple(saved[path][0])} in the checkpoint, "
                         f"{expected[path][1]}{tuple(expected[path][0])} here")
        if len(lines) == limit:
            lines.append("...")
            break
    return lines


def optimizer_state_types(structure_text: str) -> list[str]:
    """The optax state types in an optimizer state's tree structure, in order (nested ones
    included: an ``inject_hyperparams`` or ``MultiSteps`` state, then the states it wraps).

    Example:
        >>> from parallax.train.state_record import optimizer_state_types
        >>> optimizer_state_types(str(jax.tree.structure(optax.adamw(1e-3).init({"w": jnp.zeros(2)}))))
        ['ScaleByAdamState', 'EmptyState', 'EmptyState']
    """
    return [named or other for named, other in _STATE_TYPE.findall(structure_text)]


def describe_optimizer_change(saved: str, now: str) -> str:
    """How two optimizer states' structures differ, in optax's names: which state types the
    checkpoint has and this run has, or, with the same types, how many arrays each holds."""
    then, here = optimizer_state_types(saved), optimizer_state_types(now)
    if then != here:
        name = lambda types: ", ".join(types) if types else "no optax state"
        empty = (" (EmptyState: a stateless step such as add_decayed_weights or scale_by_learning_rate)"
                 if "EmptyState" in then + here else "")
        return f"the checkpoint's optimizer state is {name(then)}; this run's is {name(here)}{empty}"
    return (f"both optimizer states are {', '.join(then) or 'untyped'}, but they hold other arrays "
            f"({saved.count('*')} in the checkpoint, {now.count('*')} here): another mask, params tree or "
            "wrapper state")

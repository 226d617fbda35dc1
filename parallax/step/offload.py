"""Host offload: which parts of the train state live in host memory between steps.

``StepOptions(offload="optimizer")`` keeps the optimizer state in ``pinned_host`` memory,
``"optimizer+params"`` the params too (the float32 master copy under ``precision="bf16"``),
each sharded over the mesh exactly as on the devices. The train step moves each offloaded
part to device memory where it is first used (the params before the forward pass, the
optimizer state before the update) and its new value back to host memory, inside the
compiled program, so a GPU or TPU can overlap the transfers with compute; the update itself
is the optax transformation's own, unchanged.

The device memory this saves is the offloaded parts' share of the compiled step's peak
(:func:`parallax.inspect.memory_bytes` reads device and host bytes apart).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

from parallax.step.train_state import TrainState

HOST = "pinned_host"
DEVICE = "device"
PARTS = {None: (), "optimizer": ("opt_state",), "optimizer+params": ("opt_state", "params")}


def check_offload(offload: Any) -> None:
    """Raises for an offload level that is not one of :data:`PARTS`."""
    if offload not in PARTS:
        raise ValueError(f"offload={offload!r}; use None (all state on the devices) or one of "
                         f"{tuple(level for level in PARTS if level)}.")


def offloaded_parts(offload: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The :class:`TrainState` fields an offload level keeps in host memory (a tuple of fields
    is returned as it is).

    Example:
        >>> offloaded_parts("optimizer+params")
        ('opt_state', 'params')
    """
    return offload if isinstance(offload, tuple) else PARTS[offload]


def host_parts(state: Any) -> tuple[str, ...]:
    """The offloadable fields of ``state`` with arrays in host memory (how it was built).

    Example:
        >>> host_parts(state)
        ()
    """
    kinds = state_memory_kinds(state)
    return tuple(field for field in ("opt_state", "params") if HOST in kinds[field])


def with_memory_kinds(shardings: TrainState, offload: str | tuple[str, ...] | None) -> TrainState:
    """``shardings`` (a tree of ``NamedSharding`` s shaped like a state) with the offloaded parts'
    in host memory and the rest in device memory (unchanged when nothing is offloaded).

    Example:
        >>> shardings = px.plan_state(model, optax.adam(1e-3), batch, strategy=px.FSDP(), loss_fn=loss_fn).shardings
        >>> placed = with_memory_kinds(shardings, "optimizer")
        >>> ({s.memory_kind for s in jax.tree.leaves(placed.opt_state)},
        ...  {s.memory_kind for s in jax.tree.leaves(placed.params)})
        ({'pinned_host'}, {'device'})
    """
    parts = offloaded_parts(offload)
    if not parts:  # nothing offloaded: the shardings as they are (the default memory)
        return shardings
    kinds = {field: HOST if field in parts else DEVICE
             for field in ("step", "params", "opt_state", "rng", "model_state")}
    return shardings.replace(**{field: _kind(getattr(shardings, field), kind) for field, kind in kinds.items()})


def _kind(tree: Any, kind: str) -> Any:
    return jax.tree.map(lambda s: s.with_memory_kind(kind), tree, is_leaf=lambda s: isinstance(s, NamedSharding))


def state_memory_kinds(state: Any) -> dict[str, set[str]]:
    """``{field: memory kinds}`` of a state's arrays (or ``ShapeDtypeStruct`` s with shardings).

    Example:
        >>> state_memory_kinds(state)["opt_state"]
        {'device'}
    """
    kinds: dict[str, set[str]] = {}
    for field in ("params", "opt_state", "model_state", "step", "rng"):
        kinds[field] = {getattr(getattr(leaf, "sharding", None), "memory_kind", None) or DEVICE
                        for leaf in jax.tree.leaves(getattr(state, field))}
    return kinds


def placed_as(state: Any, offload: str | tuple[str, ...] | None) -> bool:
    """Whether every array of ``state`` is in the memory ``offload`` says (host for the offloaded
    parts, device for the rest)."""
    parts = offloaded_parts(offload)
    return all(kinds <= {HOST if field in parts else DEVICE} for field, kinds in state_memory_kinds(state).items())


def placement(state: Any, offload: str | None) -> tuple[bool, tuple[str, ...]]:
    """Whether ``state`` is already where a step with ``offload`` keeps it, and the parts it keeps
    in host memory: ``offload=None`` keeps the state where it was built (``init_state`` with the
    step's options, or a restore); a level keeps its parts in host memory."""
    parts = host_parts(state) if offload is None else offloaded_parts(offload)
    named = all(isinstance(getattr(x, "sharding", None), NamedSharding) for x in jax.tree.leaves(state))
    return (placed_as(state, parts) or not named), parts  # an unplaced state is refused later, with its reason


def moved(state: Any, parts: tuple[str, ...]) -> Any:
    """``state`` (arrays, or ``ShapeDtypeStruct`` s) with ``parts`` in host memory and the rest on
    the devices, each keeping its sharding."""
    shardings = with_memory_kinds(jax.tree.map(lambda x: x.sharding, state), parts)
    return jax.tree.map(lambda x, s: jax.device_put(x, s) if isinstance(x, jax.Array)
                        else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def to_memory(tree: Any, shardings: Any, kind: str) -> Any:
    """Inside a jitted function: ``tree`` moved to ``kind`` memory, keeping its ``shardings``."""
    if not jax.tree.leaves(tree):
        return tree
    return jax.device_put(tree, _kind(shardings, kind))


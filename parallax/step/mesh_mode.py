"""Running a model in the sharding mode it was written for: Auto or Explicit mesh axes.

JAX has two ways to shard a computation over a mesh, and code written for one fails in the
other (measured on both tested stacks):

* **Auto** axes (``jax.sharding.AxisType.Auto``; GSPMD places every collective): ordinary
  models work, and so do ``with_sharding_constraint`` with a bare ``PartitionSpec`` or a
  ``NamedSharding`` of an Auto mesh; ``jax.sharding.reshard``, ``einsum(..., out_sharding=)``
  and a ``NamedSharding`` of an Explicit mesh fail.
* **Explicit** axes (the default of ``jax.make_mesh``; shardings are part of array types): a
  model written for it (Flax's NNX Gemma example: ``out_sharding=`` on every einsum) works,
  and so do ``reshard`` and ``with_sharding_constraint``; an ordinary model fails at its first
  embedding lookup or contraction over a sharded dim (``ShardingTypeError``).

So parallax plans the state in each mode in turn (``sharding_mode="detect"``: Auto first, then
Explicit) and keeps the first in which the loss traces (on Explicit axes with its gradient); the mesh the
state lives on carries the mode, and the train step compiles under it. The user's mesh keeps
its devices, their order and its axis names; only the axis types may change, and
:func:`planned_in_mode` says so in one line.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TypeVar

from jax.sharding import Mesh

from parallax._compat import mesh_context
from parallax._errors import first_line
from parallax.sharding.mesh import describe_axis_types, is_explicit, with_axis_types, with_unit_axis

log = logging.getLogger("parallax")

DETECT, AUTO, EXPLICIT = "detect", "auto", "explicit"
SHARDING_MODES = (DETECT, AUTO, EXPLICIT)
T = TypeVar("T")

_UNKNOWN_AXIS = re.compile(r"Resource axis: (?P<axis>\S+) of (?P<spec>.*?) is not found in mesh: (?P<mesh>\(.*?\))")
# What JAX says when the model names a mesh of its own (one it was built against: MaxText's models take theirs) in
# a sharding that an op's result type carries (dropout's ``bernoulli(..., out_sharding=typeof(x).sharding)``).
_FOREIGN_MESH = re.compile(r"Context mesh (?P<ours>\S*Mesh\(.*?\)) must match the mesh passed to shardings "
                           r"(?P<theirs>\S*Mesh\(.*?\))\.")
# What JAX says when code written for one mode runs in the other (jax 0.10 and 0.12 alike).
_MODE_ERRORS = ("of type Auto", "refer to Auto axes", "ShardingTypeError", "out_sharding",
                "Explicit", "should match the mesh", "context mesh")


def check_sharding_mode(mode: str) -> str:
    """Returns ``mode`` if it is one of ``"detect"``, ``"auto"``, ``"explicit"``; raises otherwise.

    Example:
        >>> check_sharding_mode("explicit")
        'explicit'
    """
    if mode not in SHARDING_MODES:
        raise ValueError(
            f"sharding_mode={mode!r}: use 'detect' (try Auto axes, then Explicit), 'auto' (ordinary models, "
            "with_sharding_constraint) or 'explicit' (models that call jax.sharding.reshard or pass out_sharding=)."
        )
    return mode


def is_mode_error(err: BaseException) -> bool:
    """Whether ``err`` is JAX refusing code written for the other sharding mode."""
    text = f"{type(err).__name__}: {err}"
    return any(marker in text for marker in _MODE_ERRORS)


def planned_in_mode(attempt: Callable[[Mesh], T], mesh: Mesh, mode: str = DETECT) -> tuple[Mesh, T, str]:
    """Runs ``attempt(train_mesh)`` under ``jax.set_mesh(train_mesh)`` in the mode asked, or, for
    ``"detect"``, with Auto axes and then, if JAX refuses the model there, Explicit ones.

    Args:
        attempt: plans the state on the mesh it is given and traces the loss (raises what JAX raises).
        mesh: the user's mesh (or the strategy's): its devices, order and names are kept.
        mode: ``"detect"``, ``"auto"`` or ``"explicit"``.

    Returns:
        ``(train_mesh, attempt's result, note)``: the mesh the state lives on, and one line
        saying which mode the model runs in and why.

    An axis the model's own sharding names (``nn.with_partitioning``) that the mesh lacks is
    added with size 1, with a warning: its params stay whole along it.

    Raises:
        ValueError: JAX refuses the model in every mode tried.
    """
    check_sharding_mode(mode)
    order = (AUTO, EXPLICIT) if mode == DETECT else (mode,)
    refused: list[tuple[str, BaseException]] = []
    for tried in order:
        train_mesh = with_axis_types(mesh, explicit=tried == EXPLICIT)
        while True:
            try:
                with mesh_context(train_mesh):
                    result = attempt(train_mesh)
            except Exception as err:
                found = _UNKNOWN_AXIS.search(str(err))
                if found and found.group("axis") not in train_mesh.axis_names:  # kept whole along it
                    log.warning("The model's own sharding names mesh axis %r (in %s), which the mesh (%s) lacks: its "
                                "params stay whole along it (the mesh gets a %r axis of size 1). Give the strategy a "
                                "part on that axis to split them (e.g. px.TensorParallel(axis=%r)).",
                                found.group("axis"), found.group("spec"), describe_axis_types(train_mesh),
                                found.group("axis"), found.group("axis"))
                    train_mesh = with_unit_axis(train_mesh, found.group("axis"))
                    continue
                foreign = _FOREIGN_MESH.search(str(err))
                if foreign and _sizes(foreign.group("ours")) != _sizes(foreign.group("theirs")):  # not just the types
                    raise ValueError(_foreign_mesh_message(foreign.group("ours"), foreign.group("theirs"))) from err
                if not is_mode_error(err):
                    raise
                refused.append((tried, err))
                break
            return train_mesh, result, _note(mesh, train_mesh, mode, refused)
    lines = "; ".join(f"with {tried.capitalize()} axes: {first_line(err, 300)}" for tried, err in refused)
    other = "" if mode == DETECT else f" (sharding_mode={mode!r}; 'detect' also tries the other mode)"
    raise ValueError(
        f"JAX refuses this model's sharding on the mesh ({describe_axis_types(mesh)}){other}: {lines}. An ordinary "
        "model runs with Auto axes; a model that calls jax.sharding.reshard or passes out_sharding= needs Explicit "
        "axes, and then the loss must say how to shard what it gathers (e.g. logits.at[...].get(out_sharding=...), "
        "or a one-hot cross-entropy instead of take_along_axis)."
    ) from refused[-1][1]


def _sizes(mesh_repr: str) -> list[tuple[str, str]]:
    """The ``(axis, size)`` pairs of an ``AbstractMesh(...)``'s repr, in order."""
    return re.findall(r"'([^']+)': (\d+)", mesh_repr)


def _axes(mesh_repr: str) -> str:
    """``fsdp=8, tensor=2`` of an ``AbstractMesh(...)``'s repr: its axes, those of size 1 only counted.

    Example:
        >>> _axes("AbstractMesh('data': 1, 'fsdp': 8, 'tensor': 1, axis_types=(Auto, Auto, Auto))")
        'fsdp=8 (and 2 more of size 1)'
    """
    sizes = _sizes(mesh_repr)
    kept = [f"{name}={size}" for name, size in sizes if size != "1"] or [f"{name}={size}" for name, size in sizes]
    return ", ".join(kept) + (f" (and {len(sizes) - len(kept)} more of size 1)" if len(kept) < len(sizes) else "")


def _foreign_mesh_message(ours: str, theirs: str) -> str:
    """The fix for a model whose shardings name a mesh it was built against, not the one it is trained on.

    Example:
        >>> print(_foreign_mesh_message("AbstractMesh('data': 8, axis_types=(Auto,))",  # doctest: +ELLIPSIS
        ...                             "AbstractMesh('data': 1, 'fsdp': 8, axis_types=(Auto, Auto))"))
        The model's own shardings name the mesh it was built against (fsdp=8 (and 1 more of size 1)), ...
    """
    return (f"The model's own shardings name the mesh it was built against ({_axes(theirs)}), and JAX runs them only "
            f"under that mesh, not under the mesh parallax trains on here ({_axes(ours)}). Train on the model's "
            "mesh: `with jax.set_mesh(mesh):` around the call (or mesh=mesh) with a strategy laid out on its axes "
            "(px.FSDP() for an fsdp axis, px.combine(px.FSDP(4), px.TensorParallel(2)) for fsdp=4 x tensor=2; "
            "a model library's config sets that mesh, e.g. MaxText's ici_*_parallelism); or build the model "
            "against the mesh of the strategy (strategy.make_mesh()).")


def _note(given: Mesh, used: Mesh, mode: str, refused: list) -> str:
    kind = "Explicit" if is_explicit(used) else "Auto"
    if refused:
        why = f"with {refused[0][0].capitalize()} axes JAX refused it: {first_line(refused[0][1], 160)}"
    elif mode != DETECT:
        why = f"sharding_mode={mode!r}"
    else:
        why = "an ordinary model"
    changed = "" if given is used else f" (the mesh's own axes were {describe_axis_types(given)})"
    note = f"Sharding mode: {kind} axes, {why}{changed}."
    log.info(note)
    return note


def check_jit_only(mesh: Mesh, compile_path: str, batch_stats: str) -> None:
    """A clear error for step options that need the ``shard_map`` path on a mesh with Explicit
    axes (a model that shards itself), which only the ``jit`` path compiles."""
    forced = ("compile='shard_map'" if compile_path == "shard_map" else
              "batch_stats='local'" if batch_stats == "local" else None)
    if forced:
        raise ValueError(
            f"{forced} needs the shard_map path, but this state lives on a mesh with Explicit axes "
            f"({describe_axis_types(mesh)}: the model shards itself with reshard / out_sharding), which "
            "only the jit path compiles; use compile='auto' or 'jit', or build the state with "
            "sharding_mode='auto' if the model runs with Auto axes.")

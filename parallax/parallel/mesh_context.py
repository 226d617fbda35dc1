"""The mesh set the JAX way: ``jax.set_mesh(mesh)`` around a call that is given no ``mesh=``.

Current JAX code says which mesh to use with ``with jax.set_mesh(mesh):``. parallax's entry
points (``init_state``, the ``Trainer``'s ``fit``, ``px.plan``, ``px.testing.assert_equivalent``)
build on that mesh where they are given neither ``mesh=`` nor ``devices=``: its devices in its
order, its axis types (Auto, Explicit or mixed). ``strategy="auto"`` searches over its devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from parallax.parallel.candidates import AUTO
from parallax.sharding.mesh import describe_axis_types
from parallax.sharding.strategy import Strategy
from parallax.sharding.topology import Topology


def mesh_in_context() -> Mesh | None:
    """The mesh set with ``jax.set_mesh`` around the call, or ``None`` where there is none (or the
    call is traced, under ``jit`` or ``eval_shape``: JAX keeps only an abstract mesh there).

    Example:
        >>> mesh_in_context() is None
        True
        >>> with jax.set_mesh(px.FSDP().make_mesh()):
        ...     dict(mesh_in_context().shape)
        {'fsdp': 8}
    """
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside a trace (jit, eval_shape), where JAX keeps only an abstract mesh: pass mesh=
        return None
    return mesh if isinstance(mesh, Mesh) and mesh.axis_names else None


def mesh_or_context(strategy: Strategy | str, mesh: Mesh | None,
                    devices: Sequence[jax.Device] | None) -> tuple[Mesh | None, Sequence[jax.Device] | None]:
    """``(mesh, devices)`` as given, else the mesh set with ``jax.set_mesh`` (for ``"auto"``: its
    devices, to search over).

    Raises:
        ValueError: the mesh in context lacks an axis the strategy needs (or has one it does
            not use), naming both and how to fit them.
    """
    found = mesh_in_context() if mesh is None and devices is None else None
    if found is None:
        return mesh, devices
    if strategy == AUTO:
        return None, list(found.devices.flat)
    try:
        strategy.check_mesh(found)
    except ValueError as err:
        raise ValueError(f"The mesh set with jax.set_mesh ({describe_axis_types(found)}) does not fit the strategy "
                         f"{strategy.describe()}: {err} Or pass mesh= (or devices=) to use another mesh.") from None
    return found, None


def mesh_on(strategy: Strategy, devices: Sequence[jax.Device], topology: Topology | None = None) -> Mesh:
    """The mesh set with ``jax.set_mesh`` where it holds exactly ``devices`` (in its order) and fits
    ``strategy`` (a model built against that mesh, as MaxText's are, runs only on it); else
    ``strategy.make_mesh(devices)``, laid out over ``topology``'s hosts where one is given. ``px.plan``,
    ``strategy="auto"`` and FSDP's split search lay each candidate out so."""
    if topology is not None:
        return strategy.make_mesh(devices, topology)
    found = mesh_in_context()
    if found is not None and list(found.devices.flat) == list(devices):
        try:
            strategy.check_mesh(found)
            return found
        except ValueError:  # another candidate's axes: a mesh of its own on the same devices
            pass
    return strategy.make_mesh(devices)

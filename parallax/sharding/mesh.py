"""Building a device mesh from named axes, with validation before anything compiles."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from parallax._compat import auto_mesh
from parallax.sharding.topology import Topology, place_by_topology


def resolve_axis_sizes(axes: Sequence[tuple[str, int]], num_devices: int) -> tuple[tuple[str, int], ...]:
    """Replaces a size of ``-1`` by the devices left over and checks the product.

    Args:
        axes: ``(name, size)`` pairs in mesh order; at most one size may be ``-1``.
        num_devices: how many devices the mesh must cover.

    Returns:
        The same pairs with every size resolved.

    Raises:
        ValueError: a name used twice, a size that is not positive or ``-1``, two
            sizes of ``-1``, or sizes whose product is not ``num_devices``.

    Example:
        >>> resolve_axis_sizes([("data", 2), ("fsdp", -1)], 8)
        (('data', 2), ('fsdp', 4))
    """
    names = [name for name, _ in axes]
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Mesh axis names must be non-empty strings, got {name!r}.")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"Mesh axis name(s) {duplicates} used more than once in {names}; give each "
            "strategy its own axis, e.g. DataParallel(axis='data'), FSDP(axis='fsdp')."
        )
    for name, size in axes:
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(
                f"Axis {name!r} has size {size!r}; use a positive integer or -1 for "
                "'the devices left over'."
            )
    open_axes = [name for name, size in axes if size == -1]
    if len(open_axes) > 1:
        raise ValueError(
            f"Axes {open_axes} all have size -1; at most one axis may take the devices "
            "left over, give the others explicit sizes."
        )
    fixed = math.prod(size for _, size in axes if size != -1)
    if open_axes:
        if num_devices % fixed:
            raise ValueError(
                f"The fixed axis sizes {dict(axes)} multiply to {fixed}, which does not "
                f"divide the {num_devices} available devices; choose sizes whose product "
                f"divides {num_devices}."
            )
        axes = [(name, num_devices // fixed if size == -1 else size) for name, size in axes]
    total = math.prod(size for _, size in axes)
    if total != num_devices:
        raise ValueError(
            f"Mesh axes {dict(axes)} need {total} devices but {num_devices} are available; "
            f"make the sizes multiply to {num_devices}, set one size to -1, or pass "
            f"devices=jax.devices()[:{total}] to use a subset."
        )
    return tuple((name, int(size)) for name, size in axes)


def build_mesh(axes: Sequence[tuple[str, int]], devices: Sequence[jax.Device] | None = None,
               inside_first: Sequence[str] | None = None, topology: Topology | None = None) -> Mesh:
    """Builds a ``Mesh`` with Auto axes, ordering devices by topology.

    Args:
        axes: ``(name, size)`` pairs; one size may be ``-1``.
        devices: the devices to use; all of ``jax.devices()`` by default.
        inside_first: the axis names, the one to keep inside a host most first
            (:mod:`parallax.sharding.topology`); the mesh order by default. Where the devices
            are one host it changes nothing.
        topology: hosts to lay the devices out over, as simulated (a :class:`Topology`); the
            processes by default.

    Returns:
        A ``jax.sharding.Mesh`` whose axes are all ``AxisType.Auto`` (Explicit axes
        break the FSDP recipe and GSPMD matmuls on this JAX version).

    Example:
        >>> mesh = build_mesh([("data", -1)])
        >>> mesh.shape["data"] == jax.device_count()
        True
    """
    devices = list(jax.devices() if devices is None else devices)
    resolved = resolve_axis_sizes(axes, len(devices))
    names = tuple(name for name, _ in resolved)
    shape = tuple(size for _, size in resolved)
    grid = place_by_topology(resolved, devices, names if inside_first is None else inside_first, topology)
    if grid is None:  # one host: the order jax's mesh utilities give
        return auto_mesh(shape, names, devices)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def is_explicit(mesh: Mesh) -> bool:
    """Whether any axis of ``mesh`` is ``AxisType.Explicit`` (sharding part of array types).

    Example:
        >>> is_explicit(build_mesh([("data", -1)]))
        False
    """
    return any(kind == AxisType.Explicit for kind in getattr(mesh, "axis_types", ()))


def with_axis_types(mesh: Mesh, explicit: bool) -> Mesh:
    """The same devices, in the same order and under the same names, with every axis
    ``Explicit`` (``explicit=True``) or ``Auto``.

    Example:
        >>> explicit = with_axis_types(build_mesh([("data", -1)]), explicit=True)
        >>> is_explicit(explicit), list(explicit.devices.flat) == jax.devices()
        (True, True)
    """
    kind = AxisType.Explicit if explicit else AxisType.Auto
    if tuple(getattr(mesh, "axis_types", ())) == (kind,) * len(mesh.axis_names):
        return mesh
    return Mesh(mesh.devices, tuple(mesh.axis_names), axis_types=(kind,) * len(mesh.axis_names))


def with_unit_axis(mesh: Mesh, name: str) -> Mesh:
    """``mesh`` with an axis ``name`` of size 1 after its own (of its first axis's type): what a
    model's own sharding names and no part splits.

    Example:
        >>> dict(with_unit_axis(build_mesh([("data", -1)]), "tensor").shape)
        {'data': 8, 'tensor': 1}
    """
    types = tuple(getattr(mesh, "axis_types", ())) or (AxisType.Auto,) * len(mesh.axis_names)
    return Mesh(mesh.devices.reshape(*mesh.devices.shape, 1), (*mesh.axis_names, name),
                axis_types=(*types, types[0]))


def describe_axis_types(mesh: Mesh) -> str:
    """``"fsdp=4 Explicit, tensor=2 Auto"``: each axis's size and type.

    Example:
        >>> describe_axis_types(build_mesh([("data", 2), ("tensor", -1)]))
        'data=2 Auto, tensor=4 Auto'
    """
    kinds = getattr(mesh, "axis_types", ()) or (AxisType.Auto,) * len(mesh.axis_names)
    return ", ".join(f"{name}={mesh.shape[name]} {kind.name}" for name, kind in zip(mesh.axis_names, kinds))

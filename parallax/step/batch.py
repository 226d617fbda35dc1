"""Checks on a batch and a state before a step compiles (sizes, devices, layouts), and what a compiled
step is specific to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from parallax.sharding.specs import is_spec
from parallax.sharding.strategy import Strategy


def leading_dims(batch: Any) -> list[tuple[str, int]]:
    """``(path, leading dim)`` of every batch leaf.

    Raises:
        ValueError: a leaf without a batch dim, or no arrays at all.
    """
    out = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0:
            raise ValueError(
                f"Batch leaf {jax.tree_util.keystr(key_path)!r} is {type(leaf).__name__} with "
                "no batch dim; every batch leaf must be an array whose first dim is the batch."
            )
        out.append((jax.tree_util.keystr(key_path), int(shape[0])))
    if not out:
        raise ValueError("The batch has no arrays in it.")
    return out


def check_batch(batch: Any, strategy: Strategy, mesh: Mesh, grad_accum: int = 1) -> int:
    """Checks a batch before anything compiles; returns its (global) batch size.

    Raises:
        ValueError: leaves with different leading dims, or a batch size that the data
            axes (times ``grad_accum``) do not divide.
    """
    dims = leading_dims(batch)
    sizes = {size for _, size in dims}
    if len(sizes) > 1:
        raise ValueError(f"Batch leaves have different leading (batch) dims: {dict(dims)}.")
    batch_size = sizes.pop()
    strategy.check_batch_size(batch_size, mesh, multiple=grad_accum)
    return batch_size


def check_batch_devices(batch: Any, mesh: Mesh | Sequence[jax.Device], taken: NamedSharding | None = None) -> None:
    """Raises ``ValueError`` for a batch array placed on other devices than the state's mesh (a
    committed array on a subset of them too: ``jit`` would refuse it), or, given the sharding the step
    ``taken`` takes its batch with, one laid out otherwise on those devices (another mesh's shape or
    device order: ``jit`` would refuse it, or move it on every call); ``mesh`` may be the devices a
    search lays its meshes over, checked before it compiles anything.

    Example:
        >>> mesh = px.FSDP().make_mesh()
        >>> other = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("rows", "cols"))
        >>> P = jax.sharding.PartitionSpec
        >>> batch = {"x": jax.device_put(np.zeros((8, 3)), NamedSharding(other, P("rows")))}
        >>> check_batch_devices(batch, mesh, NamedSharding(mesh, P("fsdp")))
        Traceback (most recent call last):
        ...
        ValueError: batch['x'] is laid out on a mesh with axes {'rows': 4, 'cols': 2} (P('rows',)), not as the step takes it ...
    """  # noqa: E501 (a doctest's output)
    mesh_devices = set(mesh.devices.flat) if isinstance(mesh, Mesh) else set(mesh)
    target = f"the state's mesh {dict(mesh.shape)}" if isinstance(mesh, Mesh) else (
        f"the {len(mesh_devices)} devices the state is laid out over")
    fix = ("Pass host (numpy) arrays, or place the batch on the state's mesh: "
           "px.data.to_global(batch, NamedSharding(mesh, strategy.batch_spec())).")
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        sharding = getattr(leaf, "sharding", None)
        devices = set(getattr(sharding, "device_set", ()))
        if not isinstance(leaf, jax.Array) or sharding is None:
            continue
        where = (f"a mesh with axes {dict(sharding.mesh.shape)}" if isinstance(sharding, NamedSharding)
                 else f"{len(sharding.device_set)} device(s)")
        if not devices <= mesh_devices or (leaf.committed and devices != mesh_devices):
            raise ValueError(f"batch{jax.tree_util.keystr(key_path)} is placed on {where}, other devices than "
                             f"{target}. {fix}")
        if taken is not None and leaf.committed and leaf.ndim and not sharding.is_equivalent_to(taken, leaf.ndim):
            spec = f" ({sharding.spec})" if isinstance(sharding, NamedSharding) else ""
            if isinstance(sharding, NamedSharding) and sharding.mesh.shape == taken.mesh.shape:
                spec += ", its devices in another order than the state's mesh's"
            raise ValueError(
                f"batch{jax.tree_util.keystr(key_path)} is laid out on {where}{spec}, not as the step takes it "
                f"(the state's mesh {dict(taken.mesh.shape)}, {taken.spec}). {fix}")


def state_specs_of(state: Any) -> tuple[Mesh, Any]:
    """The mesh and ``PartitionSpec`` tree a (concrete) state is laid out with."""
    meshes = set()

    def spec(x):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            raise ValueError(
                f"A state leaf has sharding {sharding!r}; build the state with "
                "px.init_state(...) so that every leaf is placed on the strategy's mesh."
            )
        meshes.add(sharding.mesh)
        return sharding.spec

    specs = jax.tree.map(spec, state)
    if len(meshes) != 1:
        raise ValueError(f"The state's arrays live on {len(meshes)} different meshes; expected one.")
    return meshes.pop(), specs


def layout_key(state: Any, offloaded: tuple[str, ...]) -> tuple:
    """What a step compiled for ``state`` is specific to: its tree, specs and mesh, and the parts it
    keeps in host memory (a batch is checked against the state's mesh before it runs)."""
    mesh, specs = state_specs_of(state)
    return jax.tree.structure(state), tuple(jax.tree.leaves(specs, is_leaf=is_spec)), mesh, offloaded


def host_leaves_placed(batch: Any, sharding: NamedSharding) -> Any:
    """A batch's host leaves (NumPy arrays) placed with ``sharding``, in one process, as ``jit``
    would place them: typed as placed arrays, they find a program compiled ahead of time for
    placed arrays (a search's pick) instead of compiling another for host arrays."""
    if jax.process_count() > 1:
        return batch
    return jax.tree.map(lambda x: x if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
                        else jax.device_put(x, sharding),
                        batch)  # device arrays, tracers and shapes (a step lowered from shapes) as they are
